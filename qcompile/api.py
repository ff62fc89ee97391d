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
    """Stop observers: qparams stay as they are (``observe=False`` on every quantizer)."""
    for q in quantizers(gm).values():
        q.observe = False
    return gm


def _finite_stats(min_val: torch.Tensor, max_val: torch.Tensor) -> bool:
    # Unobserved entries are min=+inf, max=-inf; anything else non-finite came from data.
    bad = min_val.isnan() | max_val.isnan() | (min_val == float("-inf")) | (
        max_val == float("inf"))
    return not bool(bad.any())


def calibrate(gm: nn.Module, batches: Iterable[Any], *, sync: bool | None = None,
              progress: bool = True) -> nn.Module:
    """Static PTQ: run ``batches`` (tuples of inputs, or single tensors) through ``gm``
    with observers on, then freeze qparams and turn fake-quant on. With a process group
    and ``quant.sync_observers`` (or ``sync=True``) the statistics are reduced across
    ranks at the end, so every rank must call it; ``sync=False`` keeps them local.
    ``progress`` shows a tqdm bar when stderr is a terminal."""
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
