"""Running a graph without leaving a trace (a pass timing it or collecting statistics,
``qc.sqnr`` measuring it): eval mode and observers off for the run; every module's
training flag, every quantizer's flags and every buffer as they were after it; and the
example inputs cloned so a model that writes its inputs in place (``x.mul_(2)``) never
changes the caller's tensors.

Example:
    >>> import torch
    >>> from qcompile.graph.running import fresh, untouched
    >>> bn = torch.nn.BatchNorm1d(3)
    >>> x = torch.randn(4, 3)
    >>> with untouched(bn):
    ...     _ = bn(*fresh((x,)))
    >>> bool(bn.training), float(bn.num_batches_tracked)
    (True, 0.0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from qcompile.runtime.calibration import quiet_fx_trace
from qcompile.runtime.fake_quant import FakeQuantize


def fresh(args: Any) -> Any:
    """``args`` with every tensor cloned (a new copy per run)."""
    return torch.utils._pytree.tree_map(
        lambda v: v.clone() if isinstance(v, torch.Tensor) else v, args)


@contextlib.contextmanager
def untouched(*modules: nn.Module) -> Iterator[None]:
    """Run the body under ``no_grad`` with ``modules`` in eval mode and their observers
    off, then restore them exactly: every module's training flag, every quantizer's
    ``enabled`` / ``observe`` flags, and every buffer's tensor and values (observer
    statistics, BatchNorm statistics, a counter written in place, a buffer the forward
    replaced). What measuring (``qc.sqnr``) and passes that run the graph rely on.
    torch.fx's printout of a failing generated forward is kept off stderr meanwhile
    (``quiet_fx_trace``): the caller turns the exception into its own error."""
    training: list[tuple[nn.Module, bool]] = []
    flags: list[tuple[FakeQuantize, bool, bool]] = []
    buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for root in modules:
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            training.append((m, m.training))
            if isinstance(m, FakeQuantize):
                flags.append((m, m.enabled, m.observe))
            for name, b in m._buffers.items():
                if b is not None:
                    buffers.append((m, name, b, b.detach().clone()))
    try:
        for root in modules:
            root.eval()
        for q, _, observe in flags:
            if observe:
                q.observe = False
        with torch.no_grad(), quiet_fx_trace():
            yield
    finally:
        for m, was in training:
            m.training = was
        for q, enabled, observe in flags:
            if (q.enabled, q.observe) != (enabled, observe):  # (setting clears its cache)
                q.enabled, q.observe = enabled, observe
        with torch.no_grad():  # a module that swapped or updated a buffer gets it back
            for m, name, b, value in buffers:
                m._buffers[name] = b
                b.copy_(value)
