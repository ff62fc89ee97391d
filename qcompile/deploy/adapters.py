"""LoRA adapters leaving the graph: ``save_adapters`` (peft's format) and ``merge_adapters``.

A graph compiled with an ``adapters`` section trains ``<layer>.lora_A`` / ``lora_B`` next to
a frozen base (``qcompile.passes.insert_adapters``). Two ways out:

- ``save_adapters(gm, directory)`` writes the adapters as a peft LoRA adapter
  (``adapter_config.json`` + ``adapter_model.safetensors``, tensors named
  ``base_model.model.<layer>.lora_A.weight`` as peft names them on the float model), so
  ``peft.PeftModel.from_pretrained(float_model, directory)`` loads them. Layers adapted
  with different ranks or alphas are written with peft's ``rank_pattern`` /
  ``alpha_pattern``; peft has one ``lora_dropout``, the one most layers use (dropout only
  acts in training). The float model peft loads onto computes what the graph computes
  when its adapted weights are the graph's base: for a frozen quantized base, the
  dequantized weight (``<layer>.weight_frozen.dequantize()``; transposed for a layer that
  stores its weight ``[in, out]``, GPT-2's ``Conv1D``, for which the config sets peft's
  ``fan_in_fan_out``). Modules an entry of
  ``kind: full`` trains are written whole (``base_model.model.<module>.<key>`` for each
  key of the module's state dict in the model, as peft writes a ``modules_to_save``
  module) and listed in ``modules_to_save``; so are the modules peft's rule for that list
  also selects (a name ending with a listed one), with the graph's values.
- ``merge_adapters(gm)`` returns a new graph whose adapted weights are
  ``W + alpha / rank * (B @ A)`` (float32 arithmetic; ``W`` the dequantized frozen base,
  or the float weight of a ``qat`` or float base; ``(B @ A)^T`` for a weight stored
  ``[in, out]``), quantized again as the spec says (read as ``insert_quant`` reads such a
  weight, ``weight_layout``: an ``[in, out]`` weight's groups along its inputs): a
  layer whose rule gives its weight a scheme reads it through a fake-quantizer that
  observed the merged weight (a frozen base's storage becomes ``<layer>.weight`` behind
  ``<layer>.weight_fake_quant`` again, as ``insert_quant`` made it; a ``qat`` base's
  quantizer observes the merged weight). The adapter modules and nodes are gone, so
  ``qc.convert`` and ``qc.export_onnx`` take the result; they refuse a graph that still
  holds adapters (``refuse_adapters``), naming ``qc.merge_adapters``. The modules trained
  in full keep their trained values, and every parameter the ``adapters`` section froze
  or unfroze gets back the flag the model gave it.

Both accept the graph or a DDP wrapper around it (its ``.module``) and pipeline-placed
graphs (``stage_<i>`` children; the names written are the model's). Under FSDP2
(``fully_shard``) the adapter weights and the trained modules' parameters are sharded
DTensors: ``save_adapters`` gathers each one (``full_tensor()``, a collective), so every
rank must call it; only rank 0 writes.
``merge_adapters`` refuses a sharded graph (merge an unsharded copy).

Example:
    >>> import os, tempfile, torch, qcompile as qc
    >>> from qcompile.deploy.adapters import merge_adapters, save_adapters
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
    ...                             torch.nn.Linear(64, 8))
    >>> spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
    ...         "weight": {"dtype": "int8", "granularity": "per_channel"}}]},
    ...         "adapters": [{"match": {"name": "0"}, "rank": 4, "alpha": 8}]}
    >>> gm = qc.qcompile(model, spec, example_inputs=(torch.randn(2, 64),))
    >>> folder = save_adapters(gm, os.path.join(tempfile.mkdtemp(), "adapter"))
    >>> sorted(os.listdir(folder))
    ['adapter_config.json', 'adapter_model.safetensors']
    >>> merged = merge_adapters(gm)
    >>> sorted(n for n, _ in merged.named_modules() if n.startswith("0."))
    ['0.weight_fake_quant', '0.weight_fake_quant.observer']
"""

from __future__ import annotations

import copy
import json
import operator
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.deploy.stages import share_stages, spread
from qcompile.errors import QCompileError
from qcompile.files import atomic_paths
from qcompile.graph.matching import WeightUse
from qcompile.graph.meta import (
    ADAPTERS_KEY,
    COLLECTIVES_KEY,
    FIXED_GRID_KEY,
    NN_MODULE_STACK,
    QSCHEME_KEY,
    REPORT_KEY,
    SPEC_KEY,
    TRAINING_KEY,
)
from qcompile.passes import parameter_count
from qcompile.passes.insert_adapters import AdapterLayer, FullModule, trainable_records
from qcompile.passes.insert_quant import weight_layout
from qcompile.passes.insert_quant.common import move_to, quantizer_record, set_flag
from qcompile.runtime.fake_quant import FakeQuantize

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "adapter_config", "merge_adapters",
           "refuse_adapters", "save_adapters"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# peft's names for a LoRA tensor on the model it wraps: PeftModel.base_model (LoraModel)
# .model (the float model) . <layer> . lora_A . weight (the adapter name left out)
_PREFIX = "base_model.model."
_PARTS = ("lora_dropout", "lora_A", "lora_B")


# -- finding the graph and its adapters ----------------------------------------------------
def unwrap(gm: nn.Module) -> nn.Module:
    """The compiled graph inside wrappers that keep it as ``.module`` (DDP); a
    ``fully_shard``-ed graph is the graph itself."""
    inner = gm
    while REPORT_KEY not in (getattr(inner, "meta", None) or {}) and isinstance(
            getattr(inner, "module", None), nn.Module):
        inner = inner.module
    return inner


def _graph(gm: nn.Module, where: str) -> GraphModule:
    inner = unwrap(gm)
    meta = getattr(inner, "meta", None)
    if not isinstance(inner, GraphModule) or not isinstance(meta, dict) \
            or REPORT_KEY not in meta:
        raise QCompileError(
            f"{where}: the model ({type(gm).__name__}) was not compiled by qcompile, so it "
            "holds no qcompile adapters",
            fix="pass the graph qc.qcompile returned for a spec with an adapters section "
                "(or the DDP module wrapping it)")
    return inner


def _layers(gm: GraphModule, where: str) -> dict[str, AdapterLayer]:
    layers = gm.meta.get(ADAPTERS_KEY) or {}
    if not layers:
        raise QCompileError(
            f"{where}: the graph has no adapters (its spec has no adapters section, or they "
            "were merged already)",
            fix="compile the model with an adapters section, e.g. adapters: [{match: "
                "{module: Linear}, rank: 8}], and train it before saving or merging")
    return dict(layers)


def refuse_adapters(gm: nn.Module, where: str) -> None:
    """Raise the ``QCompileError`` naming ``qc.merge_adapters`` when ``gm`` (or the graph a
    DDP wrapper holds) still computes with adapters: conversion and export lower the base
    weights and would lose the adapters' contribution.

    Example:
        >>> import torch, qcompile as qc
        >>> gm = qc.qcompile(torch.nn.Linear(8, 8), {"adapters": [{"match": {"name": ""},
        ...                  "optional": True}]})
        >>> refuse_adapters(gm, "convert")  # the entry matched nothing: no adapters
    """
    inner = unwrap(gm)
    meta = getattr(inner, "meta", None)
    layers = meta.get(ADAPTERS_KEY) if isinstance(meta, dict) else None
    if layers:
        shown = ", ".join(list(layers)[:4]) + (" ..." if len(layers) > 4 else "")
        raise QCompileError(
            f"{where}: the graph holds LoRA adapters on {len(layers)} layer(s) ({shown}); "
            "they are not part of the base weights this would lower",
            fix=f"qc.merge_adapters(gm) first: merged = qc.merge_adapters(gm), then "
                f"{where}(merged, ...) (or qc.save_adapters(gm, directory) to keep them "
                "apart, as a peft adapter)")


def _owners(gm: GraphModule) -> list[tuple[str, GraphModule]]:
    """(prefix, graph) of the graphs holding layers: the graph, and its ``stage_<i>``
    children (pipeline stages, FSDP2 blocks), whose modules keep the model's names below
    the stage."""
    return [("", gm), *((f"{n}.", c) for n, c in gm.named_children()
                        if n.startswith("stage_") and isinstance(c, GraphModule))]


def _owner_of(gm: GraphModule, layer: str, where: str) -> tuple[str, GraphModule]:
    for prefix, owner in _owners(gm):
        try:
            owner.get_submodule(f"{layer}.lora_A")
        except AttributeError:
            continue
        return prefix, owner
    raise QCompileError(
        f"{where}: layer {layer!r} is recorded as adapted, but the graph has no module "
        f"{layer}.lora_A (the graph was edited after qc.qcompile)",
        fix="pass the graph qc.qcompile returned (torch.load of a saved one keeps them)")


def _model_names(gm: GraphModule) -> set[str]:
    """Module names of the model the graph was compiled from (a stage's prefix dropped)."""
    names = set()
    for name, _ in gm.named_modules():
        head, _, rest = name.partition(".")
        names.add(rest if head.startswith("stage_") and rest else name)
    return names


# -- save_adapters -------------------------------------------------------------------------
def _rank() -> int:
    """This process's rank in the default process group (0 without one). Read through
    ``sys.modules``: this layer never imports ``torch.distributed`` itself."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return int(dist.get_rank())


def _full(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` whole (a sharded DTensor gathered: a collective), detached, contiguous, on
    the CPU, sharing nothing with the graph."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    if t.device.type == "meta":
        raise QCompileError(f"save_adapters: {name} is on the meta device (it has no values "
                            "yet)", fix="allocate and fill the graph (to_empty, load a "
                            "checkpoint, or qc.distributed.compile_once) and train it first")
    return t.to("cpu").contiguous().clone()


def _number(x: float) -> float | int:
    """An integral float as an int (peft's ``lora_alpha`` is typed int)."""
    return int(x) if float(x).is_integer() else float(x)


def _pattern_keys(names: list[str]) -> dict[str, str]:
    """Layer -> its key in ``rank_pattern`` / ``alpha_pattern``. peft looks a layer up by
    ``re.match(rf"(.*\\.)?({key})$", layer)``, the first key that matches winning: the
    plain name where it matches no other adapted layer, else ``^`` + the escaped name,
    which only the layer itself matches."""
    keys = {}
    for name in names:
        ambiguous = any(o != name and re.match(rf"(.*\.)?({name})$", o) for o in names)
        keys[name] = "^" + re.escape(name) if ambiguous else name
    return keys


def _target_modules(names: list[str], model: set[str]) -> list[str] | str:
    """peft's ``target_modules``: the layer names (peft takes a name and any module whose
    name ends in ``.<name>``), or, where such a suffix would also catch a module that has
    no adapter, one regular expression that peft matches against whole names."""
    chosen = set(names)
    caught = any(m not in chosen and m.endswith(f".{n}") for m in model for n in names)
    if not caught:
        return sorted(names)
    return "(" + "|".join(re.escape(n) for n in sorted(names)) + ")"


def adapter_config(layers: dict[str, AdapterLayer], model_names: set[str] | None = None,
                   modules_to_save: list[str] | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` for ``layers`` (``gm.meta[ADAPTERS_KEY]``): peft's LoRA
    config with the rank, alpha and dropout most layers use, ``rank_pattern`` /
    ``alpha_pattern`` for the others, and ``modules_to_save`` (the modules trained in full;
    null for none). ``model_names`` (the model's module names) decides whether plain names
    can be ``target_modules`` (see ``_target_modules``).

    Example:
        >>> from qcompile.passes.insert_adapters import AdapterLayer
        >>> a = AdapterLayer("q", 0, 8, 16.0, 0.0, "frozen", 4, 4, None, None, None, None,
        ...                  None, 0)
        >>> b = AdapterLayer("v", 1, 4, 16.0, 0.0, "frozen", 4, 4, None, None, None, None,
        ...                  None, 0)
        >>> c = adapter_config({"q": a, "v": b})
        >>> c["r"], c["lora_alpha"], c["target_modules"], c["rank_pattern"]
        (8, 16, ['q', 'v'], {'v': 4})
    """
    names = sorted(layers)
    recs = [layers[n] for n in names]

    def common(values: list[Any]) -> Any:
        return Counter(values).most_common(1)[0][0]  # ties: the first layer's

    r = common([a.rank for a in recs])
    alpha = common([float(a.alpha) for a in recs])
    keys = _pattern_keys(names)
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": _number(alpha),
        "lora_dropout": common([float(a.dropout) for a in recs]),
        "target_modules": _target_modules(names, model_names or set(names)),
        "bias": "none",
        # peft's flag for layers storing their weight [in, out] (GPT-2's Conv1D); it sets
        # each layer's own from its class, warning where the config disagrees
        "fan_in_fan_out": common([a.fan_in_fan_out for a in recs]),
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": sorted(modules_to_save) if modules_to_save else None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {keys[a.layer]: a.rank for a in recs if a.rank != r},
        "alpha_pattern": {keys[a.layer]: _number(a.alpha) for a in recs
                          if float(a.alpha) != alpha},
    }


def _caught(training: Any, layers: dict[str, AdapterLayer]) -> list[FullModule]:
    """The modules peft's ``modules_to_save`` rule selects besides the trained ones (their
    names end with a trained module's name): written with the graph's values, so peft's
    copy of each computes what the graph computes. One that holds or is an adapted layer,
    or nests with a trained module, is refused (peft would wrap it and lose its adapter)."""
    if training is None:
        return []
    full = [m.name for m in training.full]
    for m in training.caught:
        f = next(f for f in full if m.name.endswith(f))
        clash = next((n for n in [*layers, *full] if n != m.name and (
            n.startswith(m.name + ".") or m.name.startswith(n + "."))), None)
        if m.name in layers or clash is not None:
            raise QCompileError(
                f"save_adapters: peft selects modules_to_save by name suffix, so "
                f"{f!r} (trained in full) also selects {m.name!r}, which "
                + ("is a LoRA-adapted layer" if m.name in layers else
                   f"nests with {clash!r}") + ": peft would replace it by a plain copy",
                fix=f"train {m.name!r} in full too (if it holds no adapter), or rename "
                    f"the module {f!r} in the model so that no other module's name ends "
                    "with it")
    return list(training.caught)


def _module_of(graph: GraphModule, m: FullModule) -> nn.Module:
    """The graph's module ``m.name``: in the graph, or in the pipeline stage holding it."""
    for _, owner in _owners(graph):
        try:
            return owner.get_submodule(m.name)
        except AttributeError:
            continue
    raise QCompileError(
        f"save_adapters: module {m.name!r} trains in full, but the graph has no module of "
        "that name (the graph was edited after qc.qcompile)",
        fix="pass the graph qc.qcompile returned (torch.load of a saved one keeps it)")


def _tensor_of(module: nn.Module, m: FullModule, key: str) -> torch.Tensor:
    parent, _, leaf = key.rpartition(".")
    try:
        t = getattr(module.get_submodule(parent) if parent else module, leaf)
    except AttributeError:
        t = None
    if not isinstance(t, torch.Tensor):
        raise QCompileError(
            f"save_adapters: peft loads {m.name}.{key} from the adapter, but the graph "
            "holds no such tensor (the forward never reads it)",
            fix=f"keep {m.name!r} in the graph (a module the forward calls), or rename the "
                "trained modules so that peft's name-suffix rule selects no other module")
    return t


def save_adapters(gm: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write ``gm``'s adapters as a peft LoRA adapter in ``directory`` (made if missing):
    ``adapter_config.json`` and ``adapter_model.safetensors``, each written atomically (a
    temporary beside it, then moved into place). Returns the directory.

    ``peft.PeftModel.from_pretrained(float_model, directory)`` then computes what ``gm``
    computes, where ``float_model``'s adapted layers hold ``gm``'s base weights (a frozen
    quantized base: its dequantized values). The modules trained in full (``kind: full``)
    are written whole as peft's ``modules_to_save``: their float values (a weight the graph
    reads through a fake-quantizer is written as the float weight it trains). ``gm`` may be
    wrapped in DDP. Under FSDP2 every rank must call it (the sharded weights are gathered,
    a collective); only rank 0 writes. So it is for a graph whose stages
    ``qc.distributed.pipeline`` spread over ranks: each stage's trained state reaches the
    other ranks' copies first (``qcompile.deploy.stages.share_stages``), and the
    pipeline's lowest rank writes every stage's adapters. The ranks first agree on the call
    and the graph (over the pipeline's ranks, or the group ``qc.distributed.wrap`` or
    ``compile_once`` sharded it on), so a call made on some ranks only is the same
    ``QCompileError`` on every rank within seconds, not a hang. A graph without adapters
    is refused, and so is one where peft's ``modules_to_save`` rule would also select an
    adapted layer.

    Example:
        >>> import json, os, tempfile, torch, qcompile as qc
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
        ...                         torch.nn.Linear(8, 2))
        >>> gm = qc.qcompile(m, {"adapters": [{"match": {"module": "Linear"}, "rank": 2}]})
        >>> d = save_adapters(gm, tempfile.mkdtemp())
        >>> cfg = json.load(open(os.path.join(d, "adapter_config.json")))
        >>> cfg["peft_type"], cfg["r"], cfg["target_modules"]
        ('LORA', 2, ['0', '2'])
    """
    graph = _graph(gm, "save_adapters")
    placement = spread(graph)  # stages trained on other ranks: theirs are read
    check = placement or graph.meta.get(COLLECTIVES_KEY)
    if placement is not None or (check is not None and any(
            _dtensor(p) for p in graph.parameters())):
        check("save_adapters", graph)  # the gathers below are collectives: all ranks here?
    layers = _layers(graph, "save_adapters")
    share_stages(graph)
    training = graph.meta.get(TRAINING_KEY)
    full = list(training.full) if training is not None else []
    whole = sorted([*full, *_caught(training, layers)], key=lambda m: m.name)
    target = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # every rank gathers (collectives), in the same order
        for name in sorted(layers):
            _, owner = _owner_of(graph, name, "save_adapters")
            for part in ("lora_A", "lora_B"):
                key = f"{name}.{part}.weight"
                tensors[_PREFIX + key] = _full(owner.get_submodule(f"{name}.{part}").weight,
                                               key)
        for m in whole:
            module = _module_of(graph, m)
            for key in m.tensors:
                tensors[_PREFIX + f"{m.name}.{key}"] = _full(
                    _tensor_of(module, m, key), f"{m.name}.{key}")
    if _rank() != (0 if placement is None else placement.writer):
        return target
    if target.exists() and not target.is_dir():
        raise QCompileError(f"save_adapters: {str(target)!r} is a file",
                            fix="give a directory path (it is created if missing)")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QCompileError(f"save_adapters: cannot create directory {str(target)!r}: {e}",
                            fix="write somewhere this process can create folders") from None
    from safetensors.torch import save_file

    config = adapter_config(layers, _model_names(graph), [m.name for m in full])
    # Both files in one private temporary folder (safetensors' own `.tmpXXXXXX` lands there
    # too), fsynced, given the user's umask, then moved: weights first, so a config never
    # names weights that are not there yet.
    with atomic_paths(target / WEIGHTS_NAME, target / CONFIG_NAME) as (weights, cfg):
        save_file(tensors, str(weights), metadata={"format": "pt"})
        cfg.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return target


# -- merge_adapters ------------------------------------------------------------------------
def _dtensor(t: torch.Tensor) -> bool:
    return any(c.__name__ == "DTensor" for c in (*type(t).__mro__, *type(t.data).__mro__))


def _lora_nodes(owner: GraphModule, rec: AdapterLayer) -> list[tuple[list[Node], Node, Node]]:
    """Per call of the layer: (its adapter's nodes in order, the adder, the base op)."""
    g = owner.graph
    found = []
    for b in [n for n in g.nodes if n.op == "call_module" and n.target == f"{rec.layer}.lora_B"]:
        a = b.args[0] if b.args else None
        mul = next(iter(b.users), None) if len(b.users) == 1 else None
        add = next(iter(mul.users), None) if mul is not None and len(mul.users) == 1 else None
        ok = (isinstance(a, Node) and a.target == f"{rec.layer}.lora_A"
              and mul is not None and mul.target is operator.mul
              and add is not None and add.target is operator.add and mul in add.args)
        if not ok:
            raise QCompileError(
                f"merge_adapters: layer {rec.layer!r}: its adapter is not computed as "
                "qc.qcompile built it (lora_B(lora_A(x)) * scaling added to the layer's "
                "output); the graph was edited", fix="merge the graph qc.qcompile returned")
        nodes = [a, b, mul]
        d = a.args[0] if a.args else None
        if isinstance(d, Node) and d.target == f"{rec.layer}.lora_dropout":
            nodes.insert(0, d)
        base = next(x for x in add.args if x is not mul)
        found.append((nodes, add, base))
    return found


def _weight_param(owner: GraphModule, path: str) -> nn.Parameter:
    parent, _, leaf = path.rpartition(".")
    return getattr(owner.get_submodule(parent) if parent else owner, leaf)


def _tied(owner: GraphModule, param: torch.Tensor, path: str) -> list[str]:
    return [n for n, p in owner.named_parameters(remove_duplicate=False)
            if p is param and n != path]


def _merged_weight(owner: GraphModule, rec: AdapterLayer) -> torch.Tensor:
    """``W + scaling * (B @ A)`` in float32, in the base weight's dtype and device, laid
    out as the weight is stored (``[in, out]``, ``+ scaling * (B @ A)^T``, for a layer
    with ``fan_in_fan_out``; a frozen base's storage holds the ``[out, in]`` rows)."""
    if rec.storage is not None:
        if rec.weight is not None:
            raise QCompileError(
                f"merge_adapters: layer {rec.layer!r}: its float weight {rec.weight} is also "
                "read elsewhere in the graph (a tied weight); merging would change what the "
                "other reader computes", fix="keep this layer out of the adapters "
                "(an entry with skip: true for it), or untie the weights in the model")
        storage = owner.get_submodule(rec.storage)
        base, dtype, device = storage.dequantize().float(), storage.out_dtype, \
            storage.codes.device
        if rec.fan_in_fan_out:
            base = base.t()
    else:
        w = _weight_param(owner, rec.weight)
        others = _tied(owner, w, rec.weight)
        if others:
            raise QCompileError(
                f"merge_adapters: layer {rec.layer!r}: its weight is shared with "
                f"{others[0]} (a tied weight); merging would change that module too",
                fix="keep this layer out of the adapters (an entry with skip: true for it), "
                    "or untie the weights in the model")
        base, dtype, device = w.detach().float(), w.dtype, w.device
    a = owner.get_submodule(f"{rec.layer}.lora_A").weight.detach().float()
    b = owner.get_submodule(f"{rec.layer}.lora_B").weight.detach().float()
    delta = (b @ a).mul_(rec.scaling).to(base.device)
    if rec.fan_in_fan_out:
        delta = delta.t()
    return (base + delta).to(device=device, dtype=dtype).contiguous()


def _layout(rec: AdapterLayer, weight: torch.Tensor, node: Node) -> Any:
    """How the layer's weight quantizer reads ``weight`` (``insert_quant``'s
    ``weight_layout``: an ``[in, out]`` weight quantized per group is read as its
    transpose, so that groups run along the inputs)."""
    use = WeightUse(node, node, 1 if rec.fan_in_fan_out else 0)
    return weight_layout(weight, use, rec.scheme, f"merge_adapters: layer {rec.layer!r}",
                         "weight", node)


def _observe_flag(fq: FakeQuantize, mode: str | None) -> None:
    """A weight quantizer tracks its weight in QAT (the merged weight trains on), as
    ``insert_quant`` sets it; otherwise its qparams stay what the merged weight gave."""
    set_flag(fq, "observe", mode == "qat" and not fq.learnable)


def _merge_layer(owner: GraphModule, rec: AdapterLayer, spec: Any, mode: str | None,
                 added: list[tuple[str, FakeQuantize, str, int | None]], prefix: str
                 ) -> str | None:
    """Fold ``rec``'s adapter into its weight in ``owner`` (the graph's ``prefix`` child);
    the qualified name of the weight quantizer that observed the merged weight, if any."""
    g = owner.graph
    calls = _lora_nodes(owner, rec)
    merged = _merged_weight(owner, rec)
    module = owner.get_submodule(rec.layer)
    for nodes, add, base in calls:
        add.replace_all_uses_with(base)
        g.erase_node(add)
        for n in reversed(nodes):
            if not n.users:
                g.erase_node(n)
    for part in _PARTS:
        if hasattr(module, part):
            owner.delete_submodule(f"{rec.layer}.{part}")
    weight = nn.Parameter(merged, requires_grad=True)
    bias = getattr(module, "bias", None)
    if isinstance(bias, nn.Parameter):
        bias.requires_grad_(True)
    observed = None
    if rec.storage is not None:  # back to get_attr(weight) -> weight_fake_quant -> the op
        module.register_parameter("weight", weight)
        path = f"{rec.layer}.weight"
        reads = [n for n in g.nodes if n.op == "call_module" and n.target == rec.storage]
        layout = _layout(rec, merged, reads[0])
        rows = layout.apply(merged)
        target = getattr(getattr(spec, "quant", None), "target", "generic")
        fq = FakeQuantize.from_scheme(rec.scheme, role="weight", shape=tuple(rows.shape),
                                      target=target, channel_axis=layout.axis)
        move_to(fq, merged.device)
        fq.observe_tensor(rows)
        del rows
        _observe_flag(fq, mode)
        try:
            owner.get_submodule(rec.quantizer)
        except AttributeError:
            pass
        else:
            raise QCompileError(f"merge_adapters: layer {rec.layer!r}: {rec.quantizer} exists "
                                "already, where the merged weight's quantizer goes",
                                fix="merge the graph qc.qcompile returned")
        owner.add_submodule(rec.quantizer, fq)
        stack = {k: v for k, v in reads[0].meta.items() if k == NN_MODULE_STACK}
        with g.inserting_before(reads[0]):  # as insert_quant reads it: views, quantizer, back
            made = [g.create_node("get_attr", path)]
            for fn, args in layout.to_rows:
                made.append(g.call_function(fn, (made[-1], *args)))
            made.append(g.create_node("call_module", rec.quantizer, (made[-1],)))
            for fn, args in layout.back:
                made.append(g.call_function(fn, (made[-1], *args)))
        for n in made:
            n.meta.update(stack)
        rule = None
        for n in reads:
            # the storage's rows, transposed back where the weight is stored [in, out]
            ends = list(n.users) if rec.fan_in_fan_out else [n]
            for end in ends:
                for user in end.users:
                    qs = user.meta.get(QSCHEME_KEY)
                    rule = getattr(qs, "rule", None) if rule is None else rule
                end.replace_all_uses_with(made[-1])
                if end is not n:
                    g.erase_node(end)
            g.erase_node(n)
        owner.delete_submodule(rec.storage)
        added.append((prefix + rec.quantizer, fq, prefix + path, rule))
        observed = prefix + rec.quantizer
    else:
        setattr(module, rec.weight.rpartition(".")[2], weight)
        if rec.quantizer is not None:  # qat: the quantizer observes the merged weight
            fq = owner.get_submodule(rec.quantizer)
            fq.reset_parameters()
            fq.observe_tensor(_layout(rec, merged, calls[0][2]).apply(merged))
            _observe_flag(fq, mode)
            observed = prefix + rec.quantizer
    return observed


def _restore_flags(out: GraphModule) -> None:
    """Give every parameter the ``adapters`` section froze (or, under a module trained in
    full, unfroze) the ``requires_grad`` the model gave it: the merged graph trains as one
    compiled without adapters. Names are the model's (a stage's prefix left out)."""
    training = out.meta.pop(TRAINING_KEY, None)
    if training is None:
        return
    flags = {**{n: True for n in training.frozen}, **{n: False for n in training.unfrozen}}
    for name, p in out.named_parameters(remove_duplicate=False):
        head, _, rest = name.partition(".")
        flag = flags.get(rest if head.startswith("stage_") and rest else name)
        if flag is not None:
            p.requires_grad_(flag)


def merge_adapters(gm: nn.Module) -> GraphModule:
    """A new graph with every adapter folded into its layer's weight, quantized again as
    the spec says (see the module docstring); ``gm`` is left as it is.

    Each adapted layer's weight becomes the parameter ``<layer>.weight`` =
    ``W + alpha / rank * lora_B.weight @ lora_A.weight`` (float32 arithmetic, then the base
    weight's dtype), trainable again (its bias too). A frozen quantized base is replaced
    by that weight read through a new ``<layer>.weight_fake_quant`` built from the layer's
    weight scheme (observing the merged weight; in QAT it keeps tracking it, as compiled
    weights do); a ``qat`` base's quantizer observes the merged weight afresh; a float base
    stays float. The modules trained in full keep their values; every other parameter gets
    back the ``requires_grad`` the model gave it. The result holds no adapters
    (``gm.meta[ADAPTERS_KEY]`` is empty, its report lists none), so ``qc.convert`` and
    ``qc.export_onnx`` take it. A graph without
    adapters, a sharded (FSDP2) graph and a layer whose weight is tied to another module
    are refused.

    Example:
        >>> import torch, qcompile as qc
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 8))
        >>> spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
        ...         "weight": {"dtype": "nf4"}}]}, "adapters": [{"match": {"name": "0"}}]}
        >>> gm = qc.qcompile(m, spec, example_inputs=(torch.randn(2, 64),))
        >>> merged = merge_adapters(gm)
        >>> merged.get_submodule("0.weight_fake_quant").block_format, qc.report(merged).adapters
        ('nf4', [])
    """
    graph = _graph(gm, "merge_adapters")
    layers = _layers(graph, "merge_adapters")
    for name, p in graph.named_parameters():
        if _dtensor(p):
            raise QCompileError(
                f"merge_adapters: parameter {name!r} is a sharded DTensor (FSDP2 or tensor "
                "parallel): a merge needs whole weights",
                fix="save the adapters with qc.save_adapters (every rank), or gather the "
                    "full state dict and merge an unsharded copy of the graph on one rank")
    for name in layers:  # before copying anything: a mistake leaves nothing half done
        _owner_of(graph, name, "merge_adapters")
    out = copy.deepcopy(graph)
    spec = out.meta.get(SPEC_KEY)
    rep = out.meta.get(REPORT_KEY)
    mode = getattr(rep, "mode", None)
    added: list[tuple[str, FakeQuantize, str, int | None]] = []
    observed: set[str] = set()
    touched: list[GraphModule] = []
    with torch.no_grad():
        for name, rec in layers.items():
            prefix, owner = _owner_of(out, name, "merge_adapters")
            done = _merge_layer(owner, rec, spec, mode, added, prefix)
            if done is not None:
                observed.add(done)
            if all(owner is not t for t in touched):
                touched.append(owner)
    for owner in touched:
        owner.graph.lint()
        owner.recompile()
        if owner is not out:
            owner.meta.pop(ADAPTERS_KEY, None)
    out.meta[ADAPTERS_KEY] = {}
    _restore_flags(out)
    if FIXED_GRID_KEY in out.meta:  # the merged weights are no longer on an algorithm's grid
        out.meta[FIXED_GRID_KEY] = [n for n in out.meta[FIXED_GRID_KEY] if n not in observed]
    if spec is not None and getattr(spec, "adapters", None):
        out.meta[SPEC_KEY] = spec.model_copy(update={"adapters": []})
    if rep is not None:
        new = rep.model_copy(deep=True)
        new.adapters = []
        new.quantizers += [quantizer_record(name, fq, "weight", path, rule)
                           for name, fq, path, rule in added]
        new.trainable_parameters = sum(p.numel() for p in out.parameters() if p.requires_grad)
        new.parameters = parameter_count(out)
        new.trainable = trainable_records(out)
        out.meta[REPORT_KEY] = new
    return out

