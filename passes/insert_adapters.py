"""``insert_adapters``: LoRA adapters next to the Linear layers the spec's ``adapters`` select.

For every linear op that reads a 2-D parameter ``<layer>.weight`` (a stock ``nn.Linear``
call, or ``F.linear`` / ``aten.linear`` after ``insert_quant`` re-expressed it; or, for a
layer storing its weight ``[in, out]`` as Hugging Face GPT-2's ``Conv1D`` does,
``addmm(bias, x, W)``, ``mm`` / ``matmul`` with the weight second), the first ``adapters``
entry whose ``match`` holds decides (``skip: true`` entries keep their layers as they are;
``module`` matches the layer's class and its base classes). An adapted layer:

- reads its frozen base as the entry's ``base`` says: ``frozen`` replaces the weight and
  its fake-quantizer by a ``FrozenWeight`` (``<layer>.weight_frozen``: the weight stored
  as its scheme's integers or block codes, dequantized on each call; the float parameter
  leaves the graph; an ``[in, out]`` weight is stored as its ``[out, in]`` rows, the
  graph transposing them back, so groups and blocks run along the inputs as its quantizer
  had them), or keeps a float weight, frozen, where no rule gave it a weight scheme;
  ``qat`` keeps the weight behind its fake-quantizer, frozen, with the observer off (its
  scale stays what the weight gave) and no cached copy (``reuse_weight`` off);
- gains ``<layer>.lora_A`` (``Linear(in, r)``, no bias), ``<layer>.lora_B``
  (``Linear(r, out)``, zeros) and ``<layer>.lora_dropout``, and computes
  ``base + lora_B(lora_A(dropout(x))) * alpha / r`` where ``x`` is what the base op reads
  (its input quantizer's output, when it has one), before any output quantizer (an
  ``[in, out]`` layer too: peft's ``fan_in_fan_out``, ``AdapterLayer.fan_in_fan_out``);
- stops training its weight and bias (``requires_grad`` off on the graph's copy).

Entries of ``kind: full`` select modules (by class and name, any kind of module) that
train in full, as peft's ``modules_to_save``: every parameter under them gets
``requires_grad`` on, their quantizers' learnable scales included. Everything else in the
graph stops training, as peft freezes what it neither adapts nor saves: only the adapters,
the ``full`` modules, and the learnable (LSQ) scales of activation quantizers and of
``base: qat`` weight quantizers keep training (a weight quantizer of a frozen layer stops:
its deployed weight stays what the graph had; the weight quantizer of any weight that
stops training, such as a mixture of experts' 3-D expert weights and its routers, stops
observing and keeps no cached copy). Only the graph's copies change; the user's model
keeps its flags. ``gm.meta[TRAINING_KEY]`` (a ``Training``) records the
``full`` modules (with the model's state-dict keys that ``qc.save_adapters`` writes), the
modules peft's name-suffix rule catches too, and the flags changed (``qc.merge_adapters``
restores them). A module both adapted and trained in full, a ``full`` module sharing a
parameter with an adapted layer, and an entry matching nothing (unless ``optional``) are
errors naming the entry and the module.

``lora_A`` starts from ``kaiming_uniform_(a=sqrt(5))`` (peft's and ``nn.Linear``'s
default), drawn from a generator seeded by the entry's ``seed`` and the layer's name, so
every rank and every world size starts from the same adapters with no communication;
``lora_B`` starts at zero, so a fresh graph computes what it computed without adapters.
The names are peft's (``q_proj.lora_A.weight``): ``qc.save_adapters`` writes them as a
peft adapter. ``gm.meta[ADAPTERS_KEY]`` holds one ``AdapterLayer`` per adapted layer.

Example:
    >>> import torch, qcompile as qc
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
    ...                             torch.nn.Linear(64, 8))
    >>> spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
    ...         "weight": {"dtype": "int4", "granularity": "per_group", "group_size": 32}}]},
    ...         "adapters": [{"match": {"name": "0"}, "rank": 4, "alpha": 8}]}
    >>> gm = qc.qcompile(model, spec, example_inputs=(torch.randn(2, 64),))
    >>> print(gm.code.split("def forward")[1])  # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
    (self, input):
        input_1 = input
        _0_weight_frozen = getattr(self, "0").weight_frozen()
        _0_bias = getattr(self, "0").bias
        linear = torch._C._nn.linear(input_1, _0_weight_frozen, _0_bias); ...
        _0_lora_a = getattr(self, "0").lora_A(input_1);  input_1 = None
        _0_lora_b = getattr(self, "0").lora_B(_0_lora_a);  _0_lora_a = None
        mul = _0_lora_b * 2.0;  _0_lora_b = None
        add = linear + mul;  linear = mul = None
        _1 = getattr(self, "1")(add);  add = None
        ...
    >>> sorted(n for n, p in gm.named_parameters() if p.requires_grad)
    ['0.lora_A.weight', '0.lora_B.weight']
    >>> spec["adapters"].append({"kind": "full", "match": {"name": "2"}})
    >>> gm = qc.qcompile(model, spec, example_inputs=(torch.randn(2, 64),))
    >>> sorted(n for n, p in gm.named_parameters() if p.requires_grad)
    ['0.lora_A.weight', '0.lora_B.weight', '2.bias', '2.weight']
    >>> [(r.module, r.kind, r.parameters) for r in qc.report(gm).trainable]
    [('0', 'lora', 512), ('2', 'full', 520)]
"""

from __future__ import annotations

import fnmatch
import math
import operator
import zlib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.matching import Owner, match_node, module_op, owner_of, owners
from qcompile.graph.meta import (
    ADAPTERS_KEY,
    NN_MODULE_STACK,
    QSCHEME_KEY,
    TENSOR_META,
    TRAINING_KEY,
)
from qcompile.graph.pipeline import graph_pass
from qcompile.graph.records import AdapterRecord, TrainableRecord
from qcompile.passes.insert_quant.common import attr, set_flag
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.frozen import FrozenWeight, frozen_layout
from qcompile.specs import AdapterSpec
from qcompile.specs.adapters import FullModuleSpec

_LINEAR = {F.linear, torch.ops.aten.linear.default}


@dataclass(frozen=True)
class AdapterLayer:
    """One adapted layer, as the graph holds it (``gm.meta[ADAPTERS_KEY][layer]``): the
    entry that chose it, the names of its tensors and modules, and its sizes."""

    layer: str
    entry: int
    rank: int
    alpha: float
    dropout: float
    base: str  # "frozen" | "qat"
    in_features: int
    out_features: int
    weight: str | None  # the float weight's name, None once the graph holds it frozen
    bias: str | None
    storage: str | None  # the FrozenWeight, for a base stored quantized
    quantizer: str | None  # the weight's fake-quantizer (base qat; frozen: the one replaced)
    scheme: object  # the weight's Scheme, None for a float base
    seed: int
    # the weight is stored [in, out] (GPT-2's Conv1D: ``addmm(b, x, W)``), as peft names it;
    # a frozen base's storage then holds its transpose, [out, in]
    fan_in_fan_out: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class FullModule:
    """A module ``qc.save_adapters`` writes whole into the adapter: one an entry of ``kind:
    full`` trains (``entry``, its index), or, with ``entry`` None, one peft's
    ``modules_to_save`` rule also selects (its name ends with a trained module's name) and
    so loads from the file. ``tensors``: its state-dict keys in the model (parameters and
    persistent buffers, what peft's copy of it loads)."""

    name: str
    entry: int | None
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Training:
    """What an ``adapters`` section trains besides the adapters (``gm.meta[TRAINING_KEY]``):
    the modules trained in full, the modules written with them only for peft's sake
    (``caught``), and the parameters whose flag it changed, by their names in the model:
    ``frozen`` (the model trained them) and ``unfrozen`` (under a ``full`` module, the model
    had them frozen)."""

    full: tuple[FullModule, ...]
    caught: tuple[FullModule, ...]
    frozen: tuple[str, ...]
    unfrozen: tuple[str, ...]


@dataclass(frozen=True)
class _Read:
    """How one linear op reads its layer's weight: the ``get_attr`` of the weight, the
    nodes between it and the op, in order (the layout views ``insert_quant`` put around
    the weight's fake-quantizer, and that quantizer's call), the quantizer's call (None
    for a float weight), and the op's data input ``x``."""

    get: Node
    path: tuple[Node, ...]
    fq: Node | None
    x: Node

    @property
    def to_rows(self) -> tuple[Node, ...]:
        """The views from the weight to what its quantizer reads (its ``[out, in]`` rows)."""
        return self.path[:self.path.index(self.fq)] if self.fq is not None else ()


@dataclass
class _Layer:
    name: str
    weight: str
    nodes: list[Node]  # the linear ops reading the weight
    fan_in_fan_out: bool  # the weight is stored [in, out] (GPT-2's Conv1D), peft's name
    reads: list[_Read | None]  # per node (None: a Linear's call_module)


# Ops computing ``x @ W (+ b)`` on a weight stored [in, out] (GPT-2's Conv1D:
# ``addmm(bias, x, W)``), and the positions (and keyword names) of ``x`` and ``W``
_IN_OUT = {torch.addmm: ((1, "mat1"), (2, "mat2")),
           torch.ops.aten.addmm.default: ((1, "mat1"), (2, "mat2")),
           torch.mm: ((0, "input"), (1, "mat2")),
           torch.ops.aten.mm.default: ((0, "self"), (1, "mat2")),
           torch.matmul: ((0, "input"), (1, "other")),
           torch.ops.aten.matmul.default: ((0, "self"), (1, "other")),
           operator.matmul: ((0, ""), (1, ""))}
_LINEAR_ARGS = ((0, "input"), (1, "weight"))
# the transpose insert_quant puts on each side of the quantizer of an [in, out] weight
# quantized per group (its groups run along the inputs: ``weight_layout``)
_TRANSPOSE = {torch.t, torch.ops.aten.t.default}


def _arg(node: Node, where: tuple[int, str]) -> object:
    i, key = where
    return node.args[i] if len(node.args) > i else node.kwargs.get(key)


def _read(gm: GraphModule, node: Node) -> tuple[_Read, bool] | None:
    """(how the linear op ``node`` reads its weight, whether the weight is stored [in, out])
    when it computes ``x W^T (+ b)`` with a weight stored [out, in] (linear) or ``x W
    (+ b)`` with one stored [in, out] (addmm, mm, matmul with the weight second), the
    weight reached directly or through its fake-quantizer with the views ``insert_quant``
    puts around it (which give back the weight as stored); else None."""
    if node.op != "call_function":
        return None
    fan_in_fan_out = node.target in _IN_OUT
    if not fan_in_fan_out and node.target not in _LINEAR:
        return None
    x_at, w_at = _IN_OUT[node.target] if fan_in_fan_out else _LINEAR_ARGS
    if fan_in_fan_out and any(node.kwargs.get(k, 1) != 1 for k in ("alpha", "beta")):
        return None  # addmm scaling its product or its bias: not a layer's x W + b
    x, w = _arg(node, x_at), _arg(node, w_at)
    path: list[Node] = []
    fq = None
    while isinstance(w, Node) and w.op != "get_attr":
        if w.op == "call_module" and fq is None and isinstance(
                gm.get_submodule(str(w.target)), FakeQuantize):
            fq = w
        elif not (w.op == "call_function" and w.target in _TRANSPOSE):
            return None
        path.append(w)
        if len(path) > 3 or not w.args:
            return None
        w = w.args[0]
    if not isinstance(w, Node) or not isinstance(x, Node):
        return None
    path.reverse()
    views = [n for n in path if n is not fq]
    before = path.index(fq) if fq is not None else 0
    # the op reads the weight as stored: no view, or one transpose each side of its quantizer
    as_stored = not views or (fq is not None and fan_in_fan_out and len(views) == 2
                              and before == 1)
    if not as_stored:
        return None
    return _Read(w, tuple(path), fq, x), fan_in_fan_out


def linear_layers(gm: GraphModule) -> dict[str, _Layer]:
    """Layers computed by a linear op on a 2-D parameter ``<layer>.weight``, by name: a
    Linear (``[out, in]``, ``linear``) or a layer storing its weight ``[in, out]`` (GPT-2's
    ``Conv1D``: ``addmm(bias, x, W)``; ``mm`` / ``matmul`` with the weight second)."""
    found: dict[str, _Layer] = {}
    mixed: set[str] = set()
    for node in gm.graph.nodes:
        read: _Read | None = None
        if node.op == "call_module":
            if module_op(gm.get_submodule(str(node.target))) != "linear":
                continue
            name, weight, in_out = str(node.target), f"{node.target}.weight", False
        else:
            got = _read(gm, node)
            if got is None or not str(got[0].get.target).endswith(".weight"):
                continue
            read, in_out = got
            weight = str(read.get.target)
            name = weight.rpartition(".")[0]
            t = attr(gm, weight)
            if not isinstance(t, nn.Parameter) or t.dim() != 2:
                continue
        layer = found.setdefault(name, _Layer(name, weight, [], in_out, []))
        if layer.fan_in_fan_out != in_out:  # read both ways: no one layout to adapt
            mixed.add(name)
        layer.nodes.append(node)
        layer.reads.append(read)
    return {n: lay for n, lay in found.items() if n not in mixed}


def _owners(gm: GraphModule, layer: _Layer) -> tuple[Owner, ...]:
    node = layer.nodes[0]
    found = owners(node, gm)
    own = next((o for o in found if o.name == layer.name), None)
    if own is None:
        own = owner_of(layer.name, type(gm.get_submodule(layer.name)))
    return (own, *(o for o in found if o.name != layer.name))


def _describe(a: AdapterSpec | FullModuleSpec) -> str:
    m = a.match
    return ", ".join(f"{k}: {v[0] if len(v) == 1 else v}"
                     for k, v in (("module", m.module), ("name", m.name)) if v)


def choose(gm: GraphModule, entries: list[AdapterSpec | FullModuleSpec],
           layers: dict[str, _Layer]) -> dict[str, tuple[int, _Layer]]:
    """Layer -> (index of the ``lora`` entry that adapts it, layer), of ``layers``
    (``linear_layers(gm)``); a non-optional entry that matches no layer is an error.
    ``full`` entries take no part (``choose_full``)."""
    chosen: dict[str, tuple[int, _Layer]] = {}
    lora = [(i, a) for i, a in enumerate(entries) if a.kind == "lora"]
    hits = [0] * len(entries)
    for name, layer in layers.items():
        who = _owners(gm, layer)
        for i, a in lora:
            if match_node(a.match, layer.nodes[0], who) is None:
                continue
            hits[i] += 1
            if not a.skip:
                chosen[name] = (i, layer)
            break
    for i, a in lora:
        if hits[i] == 0 and not a.optional:
            shown = ", ".join(list(layers)[:8]) + (" ..." if len(layers) > 8 else "")
            raise QCompileError(
                f"adapters[{i}] ({_describe(a)}) matched no Linear or Conv1D layer (an earlier "
                f"entry may have taken them); the graph's linear layers: {shown or 'none'}",
                fix="correct the match (module class names, fnmatch globs on qualified "
                "names), remove the entry, or set optional: true on it")
    return chosen


def init_adapter(a_weight: torch.Tensor, b_weight: torch.Tensor, layer: str, seed: int) -> None:
    """``lora_A`` ~ U(-1/sqrt(in), 1/sqrt(in)) (``kaiming_uniform_(a=sqrt(5))``), drawn from
    a generator seeded by ``seed`` and the layer's name; ``lora_B`` = 0. The same values on
    every rank and device (drawn on the CPU, then copied)."""
    gen = torch.Generator().manual_seed(seed * 0x9E3779B1 + zlib.crc32(layer.encode()))
    bound = 1.0 / math.sqrt(a_weight.shape[1])
    with torch.no_grad():
        a = torch.empty(a_weight.shape, dtype=torch.float32).uniform_(-bound, bound,
                                                                      generator=gen)
        a_weight.copy_(a.to(a_weight.dtype))
        b_weight.zero_()


def _selects(a: FullModuleSpec, own: Owner) -> bool:
    """Whether ``a.match`` holds for the module ``own`` (class names and dotted paths, its
    bases too, and name globs, as rules match an owning module)."""
    m = a.match
    if m.module is not None and not any(fnmatch.fnmatchcase(v, p) for p in m.module
                                        for v in (own.cls_name, own.cls_path, *own.bases)):
        return False
    return m.name is None or any(fnmatch.fnmatchcase(own.name, p) for p in m.name)


def _inside(name: str, outer: str) -> bool:
    return name == outer or name.startswith(outer + ".")


def choose_full(gm: GraphModule, model: nn.Module, entries: list[AdapterSpec | FullModuleSpec],
                chosen: dict[str, tuple[int, _Layer]]) -> dict[str, FullModule]:
    """The modules the ``full`` entries select, by name: the model's modules holding
    parameters (the root aside), the outermost where selections nest, each with its
    state-dict keys (every one must be in the graph). A non-optional entry selecting
    nothing, and a module that is, holds or shares a parameter with an adapted layer
    (``chosen``), are errors."""
    picked: dict[str, int] = {}
    for i, a in enumerate(entries):
        if a.kind != "full":
            continue
        hits = [name for name, m in model.named_modules() if name
                and next(m.parameters(), None) is not None
                and _selects(a, owner_of(name, type(m)))]
        if not hits and not a.optional:
            raise QCompileError(
                f"adapters[{i}] (kind: full, {_describe(a)}) matched no module holding "
                "parameters",
                fix="correct the match (module class names, fnmatch globs on qualified "
                "names, e.g. {name: score}), remove the entry, or set optional: true on it")
        for name in hits:
            picked.setdefault(name, i)
    # a module inside a selected one is part of it
    outer = {n: i for n, i in picked.items()
             if not any(_inside(n, o) and n != o for o in picked)}
    adapted_params: dict[int, str] = {}
    for layer, (_, lay) in chosen.items():
        for path in (lay.weight, f"{layer}.bias"):
            t = getattr(gm.get_submodule(layer), path.rpartition(".")[2], None)
            if isinstance(t, nn.Parameter):
                adapted_params[id(t)] = path
    found: dict[str, FullModule] = {}
    for name, j in sorted(outer.items()):
        for layer, (i, _) in chosen.items():
            if _inside(layer, name):
                where = "" if layer == name else " inside it"
                raise QCompileError(
                    f"adapters[{j}] trains {name!r} in full and adapters[{i}] puts a LoRA "
                    f"adapter on {layer!r}{where}: a module is adapted or trained in full, "
                    "not both",
                    fix=f"add {{match: {{name: '{layer}'}}, skip: true}} before adapters[{i}], "
                    f"or narrow adapters[{j}]'s match")
        keys = tuple(model.get_submodule(name).state_dict(keep_vars=True))
        for key in keys:
            try:
                t = attr(gm, f"{name}.{key}")
            except AttributeError:
                raise QCompileError(
                    f"adapters[{j}] trains {name!r} in full, but the graph holds no "
                    f"{name}.{key} (the model's forward does not read it, or a pass folded "
                    "it into another tensor)",
                    fix="train a module whose tensors the forward reads (e.g. the "
                    "classifier head), or remove the entry") from None
            if id(t) in adapted_params:
                i = chosen[adapted_params[id(t)].rpartition(".")[0]][0]
                raise QCompileError(
                    f"adapters[{j}] trains {name!r} in full, but its {key} is the same "
                    f"tensor as {adapted_params[id(t)]} (tied), which adapters[{i}] freezes "
                    "under a LoRA adapter",
                    fix=f"keep one of them: a skip entry for "
                    f"{adapted_params[id(t)].rpartition('.')[0]!r} before adapters[{i}], or "
                    "narrow the full entry's match (or untie the weights in the model)")
        found[name] = FullModule(name, j, keys)
    return found


def _caught(model: nn.Module, full: dict[str, FullModule]) -> tuple[FullModule, ...]:
    """The model's modules with state that peft's ``modules_to_save`` also selects: peft
    takes every module whose name ends with a listed name (``score`` catches
    ``head.xscore``), and loads its tensors from the adapter file."""
    if not full:
        return ()
    found = []
    for name, m in model.named_modules(remove_duplicate=False):
        if not name or name in full or not any(name.endswith(f) for f in full):
            continue
        keys = tuple(m.state_dict(keep_vars=True))
        if keys:
            found.append(FullModule(name, None, keys))
    return tuple(found)


def _train_only(gm: GraphModule, records: dict[str, AdapterLayer],
                full: dict[str, FullModule]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``requires_grad`` on for the adapters and the ``full`` modules, kept as it is for
    the learnable scales of activation quantizers and ``base: qat`` weight quantizers, off
    for everything else. Returns the names whose flag went off, and on."""
    train: set[int] = set()
    keep: set[int] = set()
    for rec in records.values():
        for part in ("lora_A", "lora_B"):
            train |= {id(p) for p in gm.get_submodule(f"{rec.layer}.{part}").parameters()}
    for name in full:
        train |= {id(p) for p in gm.get_submodule(name).parameters()}
    qat = {r.quantizer for r in records.values() if r.base == "qat"}
    for name, m in gm.named_modules():
        if isinstance(m, FakeQuantize) and (not m.weight or name in qat):
            keep |= {id(p) for p in m.parameters()}
    off, on = [], []
    for name, p in gm.named_parameters():
        if id(p) in train:
            if not p.requires_grad:
                p.requires_grad_(True)
                on.append(name)
        elif id(p) not in keep and p.requires_grad:
            p.requires_grad_(False)
            off.append(name)
    return tuple(off), tuple(on)


def _settle_frozen_quantizers(gm: GraphModule, ctx: Context) -> None:
    """The weight quantizers of weights that no longer train (layers neither adapted nor
    trained in full: e.g. experts held as 3-D parameters, routers) stop observing, their
    scale staying what the weight gave, and keep no cached fake-quantized copy: for a
    weight that never changes it would stay, one float copy more, for good."""
    for q in ctx.quantizers:
        if q.role != "weight":
            continue
        try:
            w, fq = attr(gm, q.node), gm.get_submodule(q.name)
        except AttributeError:
            continue
        if isinstance(w, nn.Parameter) and not w.requires_grad and isinstance(fq, FakeQuantize):
            set_flag(fq, "observe", False)
            fq.reuse_weight = False


def trainable_records(gm: nn.Module) -> list[TrainableRecord]:
    """What trains in a graph compiled with ``adapters`` (``Report.trainable``): per
    module, its elements with ``requires_grad``, by kind (``lora`` per adapted layer,
    ``full`` per module trained in full, ``quantizer`` per learnable quantizer, ``other``);
    names are the model's (a ``stage_<i>.`` prefix left out). Empty for any other graph."""
    training = getattr(gm, "meta", {}).get(TRAINING_KEY)
    if training is None:
        return []
    full = {f.name for f in training.full}
    adapted = set(gm.meta.get(ADAPTERS_KEY) or {})
    counts: dict[tuple[str, str], int] = {}
    for name, p in gm.named_parameters():
        if not p.requires_grad:
            continue
        head, _, rest = name.partition(".")
        plain = rest if head.startswith("stage_") and rest else name
        module, _, _ = plain.rpartition(".")
        parts = plain.split(".")
        outer = next((f for f in (".".join(parts[:k]) for k in range(1, len(parts)))
                      if f in full), None)
        layer, _, part = module.rpartition(".")
        if outer is not None:
            kind, module = "full", outer
        elif part in ("lora_A", "lora_B") and layer in adapted:
            kind, module = "lora", layer
        elif isinstance(gm.get_submodule(name.rpartition(".")[0]), FakeQuantize):
            kind = "quantizer"
        else:
            kind = "other"
        counts[(module, kind)] = counts.get((module, kind), 0) + p.numel()
    return [TrainableRecord(module=m, kind=k, parameters=n) for (m, k), n in counts.items()]


def _add_lora(gm: GraphModule, layer: _Layer, a: AdapterSpec, weight: torch.Tensor,
              in_f: int, out_f: int) -> None:
    kw = {"device": weight.device, "dtype": weight.dtype}
    lora_a = nn.Linear(in_f, a.rank, bias=False, **kw)
    lora_b = nn.Linear(a.rank, out_f, bias=False, **kw)
    if weight.device.type != "meta":
        init_adapter(lora_a.weight, lora_b.weight, layer.name, a.seed)
    gm.add_submodule(f"{layer.name}.lora_A", lora_a)
    gm.add_submodule(f"{layer.name}.lora_B", lora_b)
    if a.dropout > 0:
        gm.add_submodule(f"{layer.name}.lora_dropout", nn.Dropout(a.dropout))
    g = gm.graph
    targets = ([f"{layer.name}.lora_dropout"] if a.dropout > 0 else []) + [
        f"{layer.name}.lora_A", f"{layer.name}.lora_B"]
    for node, read in zip(layer.nodes, layer.reads):
        x = read.x if read is not None else node.args[0] if node.args else node.kwargs["input"]
        stack = {k: v for k, v in node.meta.items() if k == NN_MODULE_STACK}
        cursor, steps = node, []
        for target in targets:  # right after the op: dropout, A, B, then scale and add
            with g.inserting_after(cursor):
                cursor = g.create_node("call_module", target, (cursor if steps else x,))
            steps.append(cursor)
        with g.inserting_after(cursor):
            scaled = g.call_function(operator.mul, (cursor, a.scaling))
        with g.inserting_after(scaled):
            total = g.call_function(operator.add, (node, scaled))
        for n in (*steps, scaled, total):
            n.meta.update(stack)
        if TENSOR_META in node.meta:
            total.meta[TENSOR_META] = node.meta[TENSOR_META]
        node.replace_all_uses_with(total, delete_user_cb=lambda u, t=total: u is not t)


def _freeze_base(gm: GraphModule, ctx: Context, layer: _Layer, a: AdapterSpec, i: int,
                 reads: Counter[str], removed: set[str]
                 ) -> tuple[str | None, str | None, object]:
    """Freeze the layer's weight as ``a.base`` says: (storage name, quantizer name, scheme).
    ``reads`` counts the graph's ``get_attr`` nodes per target (kept up to date here);
    quantizers this removes join ``removed``."""
    weight = attr(gm, layer.weight)
    first = layer.reads[0]
    fq_node = first.fq if first is not None else None
    fq = gm.get_submodule(str(fq_node.target)) if fq_node is not None else None
    scheme = None
    if fq_node is not None:
        qs = layer.nodes[0].meta.get(QSCHEME_KEY)
        scheme = getattr(qs, "weight", None)
        other = next((n for n, r in zip(layer.nodes, layer.reads) if r.fq is not fq_node),
                     None)
        if other is not None:
            raise QCompileError(
                f"adapters[{i}]: layer {layer.name!r}: {other.name} reads its weight through "
                f"another quantizer than {layer.nodes[0].name} does ({fq_node.target}): "
                "the layer has no one base to freeze",
                fix=f"give every call of {layer.name} one quantization rule, or skip it "
                "with an adapters entry (skip: true)")
    weight.requires_grad_(False)
    if fq is None:
        if a.base == "qat":
            raise QCompileError(
                f"adapters[{i}]: layer {layer.name!r} has base: qat but no quantization rule "
                "gives it a weight scheme (its weight would stay float)",
                fix="add a rule with a weight scheme for it, or use base: frozen (a float "
                "base, frozen)")
        ctx.note(f"{layer.name}: no weight scheme, its float weight is the frozen base")
        return None, None, None
    set_flag(fq, "observe", False)  # frozen: the scale is what the weight gave
    if a.base == "qat":
        # no cached fake-quantized copy: for a weight that never changes it would stay, one
        # float model more, for good; the forward quantizes it again (and the backward
        # recomputes it), as the float step reads its weight
        fq.reuse_weight = False
        return None, str(fq_node.target), scheme
    # The storage holds [out, in] rows. A weight stored [in, out] (Conv1D) is held as its
    # transpose: what its quantizer reads when quantized per group (insert_quant's views
    # make its groups run along the inputs), or, when the quantizer reads it as stored
    # (per channel along axis 1, per tensor), the same values with the scales by row.
    rows = weight.detach().t() if layer.fan_in_fan_out else weight.detach()
    transposed = layer.fan_in_fan_out and not first.to_rows
    why = frozen_layout(fq, tuple(rows.shape), transposed=transposed)
    if why is not None:
        raise QCompileError(
            f"adapters[{i}]: layer {layer.name!r}: a frozen base cannot store {why}",
            fix="use base: qat for this layer, or give it an integer or block weight scheme")
    name = f"{layer.name}.weight_frozen"
    if weight.device.type == "meta":
        storage = FrozenWeight.empty(fq, tuple(rows.shape), dtype=weight.dtype)
    else:
        storage = FrozenWeight.from_quantizer(fq, rows, transposed=transposed)
    del rows
    gm.add_submodule(name, storage)
    g = gm.graph
    stack = {k: v for k, v in fq_node.meta.items() if k == NN_MODULE_STACK}
    with g.inserting_before(fq_node):
        call = g.create_node("call_module", name, ())
        # the op reads the weight as stored: [in, out] rows come back transposed
        out = g.call_function(torch.t, (call,)) if layer.fan_in_fan_out else call
    for n in {call, out}:
        n.meta.update(stack)
    if TENSOR_META in first.path[-1].meta:
        out.meta[TENSOR_META] = first.path[-1].meta[TENSOR_META]
    # only this layer's ops read the storage: another op reading the same (tied) weight
    # keeps its float weight and quantizer, and its gradient
    for node, r in zip(layer.nodes, layer.reads):
        node.replace_input_with(r.path[-1], out)
    gone = set()
    seen: set[Node] = set()
    for r in layer.reads:  # from each op back to the weight; a layer called twice shares them
        for n in (*reversed(r.path), r.get):
            if n in seen:
                continue
            seen.add(n)
            if n.users:
                break  # still read (a tied weight): so is everything before it
            g.erase_node(n)
            if n is r.fq:
                gone.add(str(n.target))  # one call per quantizer: the module goes too
            elif n is r.get:
                reads[str(n.target)] -= 1
    for target in gone:
        parent, _, leaf = target.rpartition(".")
        delattr(gm.get_submodule(parent) if parent else gm, leaf)
    removed |= gone
    if reads[layer.weight] <= 0:
        parent, _, leaf = layer.weight.rpartition(".")
        delattr(gm.get_submodule(parent), leaf)  # the float weight leaves the graph
    else:
        ctx.note(f"{layer.weight} is also read elsewhere in the graph: its float copy stays "
                 f"next to the frozen {name}")
    return name, str(fq_node.target), scheme


@graph_pass(requires=("graph",), provides=("adapters",))
def insert_adapters(gm: GraphModule, ctx: Context) -> GraphModule:
    entries = ctx.spec.adapters
    layers = linear_layers(gm)
    chosen = choose(gm, entries, layers)
    full = choose_full(gm, ctx.model, entries, chosen)  # before any weight leaves the graph
    # one scan of the graph for what every layer's clean-up needs (never one per layer)
    reads = Counter(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    removed: set[str] = set()
    records: dict[str, AdapterLayer] = {}
    for name, (i, layer) in chosen.items():
        a = entries[i]
        weight = attr(gm, layer.weight)
        before = weight.numel() * weight.element_size()
        rows, cols = weight.shape
        in_f, out_f = (rows, cols) if layer.fan_in_fan_out else (cols, rows)
        bias_name = f"{name}.bias"
        bias = getattr(gm.get_submodule(name), "bias", None)
        if isinstance(bias, nn.Parameter):
            bias.requires_grad_(False)
        else:
            bias_name = None
        storage, quantizer, scheme = _freeze_base(gm, ctx, layer, a, i, reads, removed)
        _add_lora(gm, layer, a, weight, in_f, out_f)
        after = (gm.get_submodule(storage).nbytes() if storage is not None else before)
        records[name] = AdapterLayer(
            layer=name, entry=i, rank=a.rank, alpha=a.alpha, dropout=a.dropout, base=a.base,
            in_features=in_f, out_features=out_f,
            weight=layer.weight if hasattr(gm.get_submodule(name), "weight") else None,
            bias=bias_name, storage=storage, quantizer=quantizer, scheme=scheme, seed=a.seed,
            fan_in_fan_out=layer.fan_in_fan_out)
        ctx.adapters.append(AdapterRecord(
            layer=name, entry=i, rank=a.rank, alpha=a.alpha, base=a.base,
            stored=getattr(scheme, "dtype", None) if storage is not None else None,
            base_bytes_before=before, base_bytes_after=after,
            adapter_parameters=a.rank * (in_f + out_f)))
    ctx.quantizers[:] = [q for q in ctx.quantizers if q.name not in removed]
    gm.meta[ADAPTERS_KEY] = records
    off, on = _train_only(gm, records, full)
    _settle_frozen_quantizers(gm, ctx)
    gm.meta[TRAINING_KEY] = Training(tuple(full.values()), _caught(ctx.model, full), off, on)
    ctx.note(f"{len(records)} layer(s) adapted (lora) of {len(layers)} linear")
    for name, f in full.items():
        quantized = hasattr(gm.get_submodule(name), "weight_fake_quant")
        ctx.note(f"{name}: trained in full (adapters[{f.entry}])" + (
            "; the graph computes with its fake-quantized weight, qc.save_adapters writes "
            "the float weight it trains" if quantized else ""))
    if off:
        ctx.note(f"{len(off)} parameter(s) stopped training (neither adapters nor trained "
                 f"in full): {', '.join(off[:4])}{' ...' if len(off) > 4 else ''}")
    if not records and not full:
        ctx.note("no layer adapted and no module trained in full: every parameter of the "
                 "model stays frozen")
    return gm
