"""Working with a compiled graph: its report, its quantizers, freezing and calibration.

Example:
    >>> import torch, qcompile as qc
    >>> gm = qc.qcompile(torch.nn.Linear(4, 4), "int8-static", example_inputs=(torch.randn(2, 4),))
    >>> gm = qc.calibrate(gm, [(torch.randn(2, 4),) for _ in range(3)])
    >>> all(q.enabled and not q.observe for q in qc.quantizers(gm).values())
    True
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from qcompile.errors import QCompileError
from qcompile.fake_quant import FakeQuantize
from qcompile.records import Report


def report(gm: nn.Module) -> Report:
    """The ``Report`` of a graph returned by ``qcompile``."""
    from qcompile.compile import REPORT_KEY

    meta = getattr(gm, "meta", None)
    if not isinstance(meta, dict) or REPORT_KEY not in meta:
        raise QCompileError(f"{type(gm).__name__} has no qcompile report",
                            fix="pass the GraphModule returned by qc.qcompile")
    return meta[REPORT_KEY]


def quantizers(gm: nn.Module) -> dict[str, FakeQuantize]:
    """Every ``FakeQuantize`` in ``gm`` by qualified name."""
    return {name: m for name, m in gm.named_modules() if isinstance(m, FakeQuantize)}


def freeze(gm: nn.Module) -> nn.Module:
    """Stop observers: qparams stay as they are (``observe=False`` on every quantizer).

    Weight quantizers that were still tracking their weights (QAT) first take the
    current weights' ranges, as their next forward would: after the last optimizer step
    the weights have moved since they were last observed (torch.ao's convert likewise
    observes the final weights)."""
    with torch.no_grad():
        for fq, weight in weight_quantizers(gm):
            if fq.observe and weight.device.type != "meta":
                fq.observe_tensor(weight)
    for q in quantizers(gm).values():
        q.observe = False
    return gm


def weight_quantizers(gm: nn.Module) -> list[tuple[FakeQuantize, torch.Tensor]]:
    """(quantizer, parameter) for every weight quantizer in ``gm``'s graph(s): a
    ``FakeQuantize`` called on a ``get_attr`` of a parameter."""
    from torch.fx import GraphModule

    found = []
    for owner in gm.modules():
        if not isinstance(owner, GraphModule):
            continue
        for node in owner.graph.nodes:
            if node.op != "call_module" or not node.args:
                continue
            fq = owner.get_submodule(str(node.target))
            src = node.args[0]
            if not isinstance(fq, FakeQuantize) or getattr(src, "op", None) != "get_attr":
                continue
            parent, _, leaf = str(src.target).rpartition(".")
            value = getattr(owner.get_submodule(parent) if parent else owner, leaf)
            if isinstance(value, nn.Parameter):
                found.append((fq, value))
    return found


def _finite_stats(min_val: torch.Tensor, max_val: torch.Tensor) -> bool:
    # Unobserved entries are min=+inf, max=-inf; anything else non-finite came from data.
    bad = min_val.isnan() | max_val.isnan() | (min_val == float("-inf")) | (
        max_val == float("inf"))
    return not bool(bad.any())


def _mode(gm: nn.Module) -> str | None:
    meta = getattr(gm, "meta", None)
    rep = meta.get("qcompile.report") if isinstance(meta, dict) else None
    return rep.mode if rep is not None else None


def calibrate(gm: nn.Module, batches: Iterable[Any], *, sync: bool | None = None,
              progress: bool = True) -> nn.Module:
    """Static PTQ: run ``batches`` (tuples of inputs, or single tensors) through ``gm``
    with observers on, then freeze qparams and turn fake-quant on. With a process group
    and ``quant.sync_observers`` (or ``sync=True``) the statistics are reduced across
    ranks at the end, so every rank must call it; ``sync=False`` keeps them local.
    ``progress`` shows a tqdm bar when stderr is a terminal.

    Only static graphs are calibrated: QAT graphs learn their ranges while training and
    dynamic graphs compute activation qparams from every batch."""
    mode = _mode(gm)
    if mode in ("qat", "dynamic"):
        fix = ("train it (observers follow the data), then qc.freeze(gm) or qc.convert(gm)"
               if mode == "qat" else "run it as is, or qc.convert(gm): nothing to calibrate")
        raise QCompileError(f"calibrate: this graph was compiled with quant.mode {mode!r}; "
                            "calibration is for quant.mode 'static'",
                            fix=fix + "; to calibrate, compile with quant.mode: static")
    return collect_statistics(gm, batches, sync=sync, progress=progress)


def collect_statistics(gm: nn.Module, batches: Iterable[Any], *, sync: bool | None = None,
                       progress: bool = True) -> nn.Module:
    """What ``calibrate`` does, for any mode: observe ``batches``, then freeze. (The
    inspect tool's per-layer error uses it to give QAT graphs data-derived ranges.)"""
    qs = quantizers(gm)
    if not qs:
        raise QCompileError("calibrate: the graph has no quantizers",
                            fix="compile with a spec whose quant.mode is static")
    was_training = gm.training
    gm.eval()
    for q in qs.values():
        if q.observer is not None and not q.learnable:
            q.observe = True
    seen = 0
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        batches = tqdm(batches, desc="calibrate", unit="batch", leave=False)
    try:
        with torch.no_grad():
            for batch in batches:
                gm(*batch) if isinstance(batch, (tuple, list)) else gm(batch)
                seen += 1
                bad = [n for n, q in qs.items() if q.observer is not None
                       and not _finite_stats(q.observer.min_val, q.observer.max_val)]
                if bad:
                    raise QCompileError(f"calibration batch {seen - 1} put NaN or Inf into "
                                        f"the observer of {bad[0]}",
                                        fix="remove NaN/Inf values from the calibration data")
    finally:
        gm.train(was_training)
    if seen == 0:
        raise QCompileError("calibrate: no batches were given", fix="pass a non-empty iterable")
    if sync if sync is not None else getattr(gm, "meta", {}).get("qcompile.sync_observers",
                                                                 False):
        from qcompile.distributed import sync_observers

        sync_observers(gm, everything=True)  # every rank ends with the same qparams
    for q in qs.values():
        q.observe = False
        q.enabled = True
    return gm


def _uncalibrated(gm: nn.Module, mode: str | None) -> list[str]:
    """Activation quantizers whose observer never saw data (their qparams are defaults)."""
    out = []
    for name, q in quantizers(gm).items():
        if q.dynamic or q.observer is None or q.granularity == "per_token":
            continue
        if not q.per_example:  # a weight quantizer: observed its weight at compile time
            continue
        never = bool((q.observer.min_val > q.observer.max_val).all())
        if never or (mode == "static" and not q.enabled):
            out.append(name)
    return out


def _outputs(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def convert(gm: nn.Module, example_inputs: tuple[Any, ...] | None = None) -> nn.Module:
    """Lower a calibrated static, trained QAT or dynamic graph to integer kernels for
    inference (see ``qcompile.passes.convert``); ``gm`` is left as it is. With
    ``example_inputs``, both graphs run them and ``report(result).max_deviation`` records
    the largest difference per output, also in steps of the output's quantizer.

    The result is in eval mode and for inference (quantized kernels have no autograd).
    ``report(result).conversions`` says what each quantized node became and why.

    Example:
        >>> import torch, qcompile as qc
        >>> m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        >>> x = torch.randn(8, 16)
        >>> gm = qc.qcompile(m, "int8-dynamic", example_inputs=(x,))
        >>> int8 = qc.convert(gm, example_inputs=(x,))
        >>> [c.op for c in qc.report(int8).conversions]
        ['quantized::linear_dynamic']
    """
    import copy

    from qcompile.compile import REPORT_KEY
    from qcompile.passes.convert import convert_graph
    from qcompile.passes.place import STAGE_NAMES_KEY

    rep = report(gm)
    if not quantizers(gm):
        raise QCompileError("convert: the graph has no quantizers (quant.mode "
                            f"{rep.mode!r})", fix="compile with quant.mode static, qat or "
                            "dynamic; a float graph needs no conversion")
    missing = _uncalibrated(gm, rep.mode)
    if missing:
        fix = ("run qc.calibrate(gm, batches) first" if rep.mode == "static" else
               "train it for some steps first (observers learn ranges in train mode)")
        raise QCompileError(f"convert: {len(missing)} activation quantizer(s) have no "
                            f"ranges yet, e.g. {missing[0]}", fix=fix)
    out = copy.deepcopy(gm)
    freeze(out)
    out.eval()
    ref = None
    if example_inputs is not None:
        with torch.no_grad():
            ref = _outputs(out(*example_inputs))
    from torch.fx import GraphModule

    # a pipeline-placed graph: each stage_<i> child is a graph of its own
    targets = [out] if STAGE_NAMES_KEY not in out.meta else [
        m for n, m in out.named_children() if n.startswith("stage_")]
    steps = _output_steps(out)
    records = []
    for target in targets:
        if isinstance(target, GraphModule):
            records += convert_graph(target)
    new_report = rep.model_copy(deep=True)
    new_report.conversions = records
    if ref is not None:
        with torch.no_grad():
            got = _outputs(out(*example_inputs))
        for i, (a, b) in enumerate(zip(got, ref)):
            if not (a.is_floating_point() and b.is_floating_point()):
                continue
            dev = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
            new_report.max_deviation[f"output{i}"] = dev
            if i < len(steps) and steps[i] is not None:
                new_report.max_deviation[f"output{i}_steps"] = dev / steps[i]
    out.meta[REPORT_KEY] = new_report
    return out


def _output_steps(gm: nn.Module) -> list[float | None]:
    """Per graph output: the scale of the per-tensor quantizer that produces it, if any."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return []
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    steps: list[float | None] = []
    for node in torch.utils._pytree.tree_leaves(out_node.args[0]):
        m = gm.get_submodule(str(node.target)) if getattr(node, "op", "") == "call_module" \
            else None
        ok = isinstance(m, FakeQuantize) and m.granularity == "per_tensor" and not m.dynamic
        steps.append(float(m.scale[0]) if ok else None)
    return steps
