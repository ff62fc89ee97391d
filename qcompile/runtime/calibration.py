"""Driving a graph's quantizers: find them, observe data (calibration), freeze them.

These work on any module holding ``FakeQuantize`` children; the public wrappers with
their mode checks and cross-rank sync are ``qc.calibrate`` / ``qc.freeze``.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.runtime.calibration import collect_statistics, quantizers
    >>> gm = qc.qcompile(torch.nn.Linear(4, 4), "int8-static", example_inputs=(torch.randn(2, 4),))
    >>> gm = collect_statistics(gm, [torch.randn(2, 4) for _ in range(3)])
    >>> all(q.enabled and not q.observe for q in quantizers(gm).values())
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.errors import QCompileError
from qcompile.runtime.fake_quant import FakeQuantize


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


def check_calibratable(mode: str | None) -> None:
    """Refuse to calibrate a graph compiled with ``quant.mode`` qat or dynamic: QAT graphs
    learn their ranges while training and dynamic graphs compute activation qparams from
    every batch."""
    if mode in ("qat", "dynamic"):
        fix = ("train it (observers follow the data), then qc.freeze(gm) or qc.convert(gm)"
               if mode == "qat" else "run it as is, or qc.convert(gm): nothing to calibrate")
        raise QCompileError(f"calibrate: this graph was compiled with quant.mode {mode!r}; "
                            "calibration is for quant.mode 'static'",
                            fix=fix + "; to calibrate, compile with quant.mode: static")


def collect_statistics(gm: nn.Module, batches: Iterable[Any], *,
                       sync: Callable[[nn.Module], Any] | None = None,
                       progress: bool = True) -> nn.Module:
    """What ``qc.calibrate`` does, for any mode: observe ``batches``, then ``sync(gm)``
    (when given), then freeze. (The inspect tool's per-layer error uses it to give QAT
    graphs data-derived ranges.)"""
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
    if sync is not None:
        sync(gm)  # e.g. reduce across data-parallel ranks: every rank ends with the same qparams
    for q in qs.values():
        q.observe = False
        q.enabled = True
    return gm
