"""Observers: running statistics from which a quantizer's qparams are computed.

An observer holds ``min_val`` / ``max_val`` buffers (one entry per scale) and folds each
batch's per-scale minima and maxima into them. Mode switches live on the owning
``FakeQuantize`` as Python attributes, so observers contain no control flow on tensor
data (no ``.item()``): graphs stay traceable by torch.export and runnable on meta tensors.

Example:
    >>> import torch
    >>> from qcompile.observers import MovingAverageObserver
    >>> obs = MovingAverageObserver(channels=1, momentum=0.5)
    >>> obs.update(torch.tensor([-2.0]), torch.tensor([2.0]))
    >>> obs.update(torch.tensor([0.0]), torch.tensor([4.0]))
    >>> obs.min_val, obs.max_val
    (tensor([-1.]), tensor([3.]))
"""

from __future__ import annotations

import torch
from torch import nn

from qcompile.errors import QCompileError


class MinMaxObserver(nn.Module):
    """Running minimum and maximum of everything observed."""

    def __init__(self, channels: int = 1) -> None:
        super().__init__()
        self.register_buffer("min_val", torch.full((channels,), float("inf")))
        self.register_buffer("max_val", torch.full((channels,), float("-inf")))

    @torch.no_grad()
    def update(self, batch_min: torch.Tensor, batch_max: torch.Tensor) -> None:
        self.min_val.copy_(torch.minimum(self.min_val, batch_min))
        self.max_val.copy_(torch.maximum(self.max_val, batch_max))

    def reset(self) -> None:
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))

    def extra_repr(self) -> str:
        return f"channels={self.min_val.numel()}"


class MovingAverageObserver(MinMaxObserver):
    """Exponential moving average of each batch's min and max; the first batch is taken
    as is (an unobserved entry is +-inf)."""

    def __init__(self, channels: int = 1, momentum: float = 0.01) -> None:
        super().__init__(channels)
        self.momentum = momentum

    @torch.no_grad()
    def update(self, batch_min: torch.Tensor, batch_max: torch.Tensor) -> None:
        m = self.momentum
        fresh = torch.isinf(self.min_val)
        self.min_val.copy_(torch.where(fresh, batch_min, torch.lerp(self.min_val, batch_min, m)))
        self.max_val.copy_(torch.where(fresh, batch_max, torch.lerp(self.max_val, batch_max, m)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, momentum={self.momentum}"


def make_observer(spec: object, channels: int) -> MinMaxObserver:
    """Build the observer a spec's ``observer`` field names."""
    kind = getattr(spec, "kind", spec)
    if kind == "minmax":
        return MinMaxObserver(channels)
    if kind == "moving_average":
        return MovingAverageObserver(channels, momentum=getattr(spec, "momentum", 0.01))
    raise QCompileError(
        f"observer kind {kind!r} is not available in this version of qcompile",
        fix="use observer: minmax or observer: {kind: moving_average, momentum: 0.01}",
    )
