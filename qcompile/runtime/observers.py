"""Observers: running statistics from which a quantizer's qparams are computed.

An observer holds ``min_val`` / ``max_val`` buffers (one entry per scale) and folds each
batch's per-scale minima and maxima into them. Mode switches live on the owning
``FakeQuantize`` as Python attributes, so observers contain no control flow on tensor
data (no ``.item()``): graphs stay traceable by torch.export and runnable on meta tensors.

Example:
    >>> import torch
    >>> from qcompile.runtime.observers import MovingAverageObserver
    >>> obs = MovingAverageObserver(channels=1, momentum=0.5)
    >>> obs.update(torch.tensor([-2.0]), torch.tensor([2.0]))
    >>> obs.update(torch.tensor([0.0]), torch.tensor([4.0]))
    >>> obs.min_val, obs.max_val
    (tensor([-1.]), tensor([3.]))
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from qcompile.errors import QCompileError


class RankReduction(Protocol):
    """How statistics are combined across data-parallel ranks while they are gathered
    (``qcompile.distributed.data_parallel.RankSync`` provides it; this layer does not
    import torch.distributed). Every rank of the group makes the same calls in the same
    order: each is one collective."""

    def extremes(self, mn: torch.Tensor, mx: torch.Tensor, count: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The minimum of every rank's ``mn`` and the maximum of every rank's ``mx``
        (elementwise; an entry NaN on any rank is NaN on every rank), and the largest
        ``count`` any rank gave."""
        ...

    def total(self, counts: torch.Tensor, largest: int) -> torch.Tensor:
        """The sum of every rank's integer ``counts`` (no rank gives more than
        ``largest`` in all), exactly."""
        ...


def add_buffers(module: nn.Module, **tensors: torch.Tensor) -> None:
    """``module.register_buffer(name, tensor)`` for each, on a module being built (fresh
    names): the same table entries without ``register_buffer``'s name checks (~5 us a
    call; a graph builds hundreds of quantizers, each with five buffers). Buffer
    registration hooks, when any are installed, still see every buffer."""
    from torch.nn.modules import module as torch_module

    if getattr(torch_module, "_global_buffer_registration_hooks", True):
        for name, tensor in tensors.items():
            module.register_buffer(name, tensor)
        return
    module._buffers.update(tensors)


class MinMaxObserver(nn.Module):
    """Running minimum and maximum of everything observed."""

    def __init__(self, channels: int = 1) -> None:
        super().__init__()
        add_buffers(self, min_val=torch.full((channels,), float("inf")),
                    max_val=torch.full((channels,), float("-inf")))

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
        # torch.lerp's two formulas (exact at momentum 0 and 1), as separate roundings in
        # this order (lerp's kernels may fuse them into an FMA): what
        # qcompile::observe_minmax computes too
        m = self.momentum
        fresh = torch.isinf(self.min_val)
        for old, new in ((self.min_val, batch_min), (self.max_val, batch_max)):
            step = new - old
            mean = old + step * m if m < 0.5 else new - step * (1.0 - m)
            old.copy_(torch.where(fresh, new, mean))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, momentum={self.momentum}"


class HistogramObserver(MinMaxObserver):
    """A histogram of everything observed (re-binned as the range grows); the range used
    for qparams (``min_val`` / ``max_val``) is chosen from it by ``choose``. Per-tensor.

    The base class searches, like torch.ao's HistogramObserver, for the clipping range
    ``[a, b]`` (bin edges) that minimises the estimated L2 quantization error: rounding
    noise ``step^2 / 12`` for values inside, squared distance to the range outside."""

    needs_data = True
    # Under data parallelism (set by qcompile.distributed for the activation quantizers of
    # a graph whose observers it keeps in sync, and by qc.calibrate): each batch's range
    # and histogram are combined across the ranks in ``observe`` (two collectives per
    # call), so every rank holds the histogram of the global batch, as one process
    # observing it would. A plain attribute, not state: a pickled graph forgets it.
    across: RankReduction | None = None

    def __init__(self, channels: int = 1, bins: int = 2048, levels: int = 256) -> None:
        super().__init__(channels)
        if channels != 1:
            raise QCompileError(f"observer {type(self).__name__}: per_tensor only",
                                fix="use observer: minmax for per_channel / per_group")
        self.bins = bins
        self.levels = levels
        self.register_buffer("histogram", torch.zeros(bins, dtype=torch.float64))
        self.register_buffer("data_min", torch.full((1,), float("inf")))
        self.register_buffer("data_max", torch.full((1,), float("-inf")))

    def reset(self) -> None:
        super().reset()
        self.histogram.zero_()
        self.data_min.fill_(float("inf"))
        self.data_max.fill_(float("-inf"))

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        """Fold ``x`` into the histogram (re-binned first when ``x`` widens the range) and
        choose the range. With ``across`` (data parallelism) the ranks first agree on the
        batch's range (the global batch's minimum and maximum), bin their own values on
        it and sum the counts: exactly the histogram of the global batch, since every
        value falls into the bin it would fall into in one process."""
        x = x.detach().float().reshape(-1)
        mn, mx = torch.aminmax(x)
        mn, mx = mn.reshape(1), mx.reshape(1)
        largest = 0
        if self.across is not None:
            mn, mx, largest = self.across.extremes(mn, mx, x.numel())
        lo = torch.minimum(self.data_min, mn)
        hi = torch.maximum(self.data_max, mx)
        if not bool(torch.isinf(self.data_min)):  # re-bin what we have into the new range
            centers = torch.linspace(float(self.data_min), float(self.data_max), self.bins + 1,
                                     dtype=torch.float64)
            centers = (centers[:-1] + centers[1:]) / 2
            idx = self._bin(centers, lo, hi)
            old = self.histogram.clone()
            self.histogram.zero_().index_add_(0, idx, old)
        self.data_min.copy_(lo)
        self.data_max.copy_(hi)
        if self.across is None:
            self.histogram.index_add_(0, self._bin(x.double(), lo, hi),
                                      torch.ones(x.numel(), dtype=torch.float64))
        else:  # integer counts: summed exactly, added exactly (float64 holds them)
            counts = torch.bincount(self._bin(x.double(), lo, hi), minlength=self.bins)
            self.histogram.add_(self.across.total(counts, largest).to(torch.float64))
        a, b = self.choose()
        self.min_val.fill_(a)
        self.max_val.fill_(b)

    def _bin(self, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        width = max(float(hi - lo), 1e-12)
        return ((v - float(lo)) / width * self.bins).long().clamp_(0, self.bins - 1)

    def _centers(self) -> torch.Tensor:
        edges = torch.linspace(float(self.data_min), float(self.data_max), self.bins + 1,
                               dtype=torch.float64)
        return (edges[:-1] + edges[1:]) / 2

    def _error(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Estimated squared error of quantizing the histogram to ranges [a, b] (batched)."""
        c, w = self._centers(), self.histogram
        step = (b - a).clamp_min(1e-12) / torch.full_like(b - a, self.levels - 1)
        inside = step[:, None] ** 2 / 12
        clip = (c[None, :] - c[None, :].clamp(a[:, None], b[:, None])) ** 2
        return ((inside + clip) * w[None, :]).sum(1)

    def _edge_error(self, i: torch.Tensor, j: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        """``_error`` for ranges [edges[i], edges[j]] in O(1) each, from prefix sums: bins
        below edge i are those < i, bins above edge j those >= j (centers never sit on an
        edge), and sum w (c - a)^2 = S2 - 2 a S1 + a^2 S0 over them."""
        c, w = self._centers(), self.histogram
        zero = torch.zeros(1, dtype=torch.float64)
        s0, s1, s2 = (torch.cat([zero, torch.cumsum(v, 0)]) for v in (w, w * c, w * c * c))
        a, b = edges[i], edges[j]
        below = s2[i] - 2 * a * s1[i] + a * a * s0[i]
        above = (s2[-1] - s2[j]) - 2 * b * (s1[-1] - s1[j]) + b * b * (s0[-1] - s0[j])
        step = (b - a).clamp_min(1e-12) / torch.full_like(b - a, self.levels - 1)
        return step**2 / 12 * s0[-1] + below + above

    def choose(self) -> tuple[float, float]:
        # 64 x 64 candidate ranges; prefix sums make each O(1), so observing a batch costs
        # the histogram update, not a 4096 x 2048 error table (calibration stays cheap).
        lo, hi = float(self.data_min), float(self.data_max)
        edges = torch.linspace(lo, hi, self.bins + 1, dtype=torch.float64)
        stride = max(1, self.bins // 128)
        starts = torch.arange(0, self.bins // 2, stride)
        i = starts.repeat_interleave(len(starts))
        j = (self.bins - starts).repeat(len(starts))
        best = int(torch.argmin(self._edge_error(i, j, edges)))
        return float(edges[i[best]]), float(edges[j[best]])


class PercentileObserver(HistogramObserver):
    """Range from the histogram's ``percentile`` (upper) and ``100 - percentile`` (lower)
    quantiles: outliers beyond them are clipped."""

    def __init__(self, channels: int = 1, percentile: float = 99.99, bins: int = 2048) -> None:
        super().__init__(channels, bins)
        self.percentile = percentile

    def choose(self) -> tuple[float, float]:
        cdf = torch.cumsum(self.histogram, 0) / self.histogram.sum().clamp_min(1)
        edges = torch.linspace(float(self.data_min), float(self.data_max), self.bins + 1,
                               dtype=torch.float64)
        q = self.percentile / 100
        lo = int(torch.searchsorted(cdf, torch.tensor([1 - q], dtype=torch.float64)))
        hi = int(torch.searchsorted(cdf, torch.tensor([q], dtype=torch.float64)))
        return float(edges[min(lo, self.bins - 1)]), float(edges[min(hi + 1, self.bins)])


class MseObserver(HistogramObserver):
    """Clip search: the range ``r * [min, max]`` for ``steps`` ratios ``r`` in (0, 1] that
    minimises the mean squared quantization error of what was observed."""

    def __init__(self, channels: int = 1, steps: int = 100, bins: int = 2048) -> None:
        super().__init__(channels, bins)
        self.steps = steps

    def choose(self) -> tuple[float, float]:
        r = torch.linspace(1.0 / self.steps, 1.0, self.steps, dtype=torch.float64)
        lo, hi = min(float(self.data_min), 0.0), max(float(self.data_max), 0.0)
        best = int(torch.argmin(self._error(r * lo, r * hi)))
        return float(r[best] * lo), float(r[best] * hi)


def make_observer(spec: object, channels: int, levels: int = 256) -> MinMaxObserver:
    """Build the observer a spec's ``observer`` field names."""
    kind = getattr(spec, "kind", spec)
    if kind == "minmax":
        return MinMaxObserver(channels)
    if kind == "moving_average":
        return MovingAverageObserver(channels, momentum=getattr(spec, "momentum", 0.01))
    if kind == "histogram":
        return HistogramObserver(channels, bins=getattr(spec, "bins", 2048), levels=levels)
    if kind == "percentile":
        return PercentileObserver(channels, percentile=getattr(spec, "percentile", 99.99))
    if kind == "mse":
        obs = MseObserver(channels, steps=getattr(spec, "steps", 100))
        obs.levels = levels
        return obs
    raise QCompileError(f"observer kind {kind!r} is not known",
                        fix="use minmax, moving_average, histogram, percentile or mse")
