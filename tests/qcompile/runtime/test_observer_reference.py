"""Histogram-family observers against numpy: the percentile observer's range against
``numpy.quantile`` and the histogram against ``numpy.histogram``.

The percentile observer keeps a histogram of ``bins`` equal bins over [data min, data max]
and returns the *lower edge* of the bin holding the ``100 - p`` quantile and the *upper
edge* of the bin holding the ``p`` quantile: the range covers both quantiles and is at
most one bin wider on each side. So, with ``w`` the bin width and ``Q`` numpy's
``inverted_cdf`` quantile (an order statistic: the smallest x with F(x) >= q, which lies
in exactly that bin):

    max_val - w <= Q_p <= max_val          min_val <= Q_(1-p) <= min_val + w

Both bounds are one-sided on purpose: "within one bin" in absolute value also holds for a
range that took the bin's other edge (one bin off), and must not pass.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.observers import HistogramObserver, PercentileObserver


def observed(x: np.ndarray, percentile: float, bins: int) -> PercentileObserver:
    obs = PercentileObserver(percentile=percentile, bins=bins)
    obs.observe(torch.from_numpy(x))
    return obs


def check_brackets(obs: PercentileObserver, x: np.ndarray, percentile: float) -> None:
    xd = x.astype(np.float64)
    q = percentile / 100
    width = (xd.max() - xd.min()) / obs.bins
    # min_val / max_val are float32 buffers holding float64 edges; a value on a bin edge
    # may bin either side: a float32 rounding of slack, far below a bin
    slack = 1e-6 * float(np.abs(xd).max())
    hi_q = float(np.quantile(xd, q, method="inverted_cdf"))
    lo_q = float(np.quantile(xd, 1 - q, method="inverted_cdf"))
    mn, mx = float(obs.min_val), float(obs.max_val)
    assert mx - width - slack <= hi_q <= mx + slack, (
        f"upper: quantile {hi_q!r} not in the bin below max_val {mx!r} (width {width!r})")
    assert mn - slack <= lo_q <= mn + width + slack, (
        f"lower: quantile {lo_q!r} not in the bin above min_val {mn!r} (width {width!r})")


def _off_integer(v: float) -> bool:
    """q * n far from an integer: numpy's and the observer's CDF comparisons (both in
    float64) then agree on which order statistic is the quantile."""
    return abs(v - round(v)) > 1e-6


# -- percentile ---------------------------------------------------------------------------
@given(x=st.integers(20, 3000).flatmap(lambda n: arrays(
           np.float32, n, elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False))),
       percentile=st.sampled_from([90.0, 95.0, 99.0, 99.9, 99.99]),
       bins=st.sampled_from([16, 128, 2048]))
def test_percentile_range_brackets_numpy_quantiles(x: np.ndarray, percentile: float,
                                                   bins: int) -> None:
    # (ranges below 1e-12 are binned as 1e-12 wide: all in the first bin, by design)
    assume(float(x.max()) - float(x.min()) > 1e-6)
    q = percentile / 100
    assume(_off_integer(q * x.size) and _off_integer((1 - q) * x.size))
    check_brackets(observed(x, percentile, bins), x, percentile)


def test_percentile_on_gaussian_with_outliers() -> None:
    """A fixed case the bounds above pin down to a bin (Gaussian data, outliers at +-50,
    n chosen so that q * n is not an integer)."""
    gen = np.random.default_rng(0)
    x = gen.standard_normal(20011).astype(np.float32)
    x[:3] = [50.0, -50.0, 40.0]
    for percentile, bins in [(99.9, 2048), (99.0, 256), (95.0, 64)]:
        obs = observed(x, percentile, bins)
        check_brackets(obs, x, percentile)
        assert float(obs.max_val) < 10.0 and float(obs.min_val) > -10.0  # outliers clipped


@given(seed=st.integers(0, 2**32 - 1), percentile=st.sampled_from([99.0, 99.9]),
       grow=st.floats(1.5, 8.0))
def test_percentile_over_batches_stays_within_two_bins(seed: int, percentile: float,
                                                       grow: float) -> None:
    """A wider second batch re-bins the first batch's counts by their bin centers: each
    count may move one bin, so the range stays within two bins of the quantiles of
    everything observed."""
    gen = np.random.default_rng(seed)
    a = gen.standard_normal(3001).astype(np.float32)
    b = (gen.standard_normal(3001) * grow).astype(np.float32)
    obs = PercentileObserver(percentile=percentile, bins=512)
    obs.observe(torch.from_numpy(a))
    obs.observe(torch.from_numpy(b))
    xd = np.concatenate([a, b]).astype(np.float64)
    width = (xd.max() - xd.min()) / obs.bins
    q = percentile / 100
    assert abs(float(obs.max_val) - np.quantile(xd, q, method="inverted_cdf")) <= 2 * width
    assert abs(float(obs.min_val) - np.quantile(xd, 1 - q, method="inverted_cdf")) <= 2 * width


def test_percentile_observer_inside_fake_quantize_uses_the_numpy_range() -> None:
    """The quantizer's qparams come from that range: uint8 asymmetric over [min, max]."""
    gen = np.random.default_rng(3)
    x = gen.standard_normal(10007).astype(np.float32)
    fq = FakeQuantize("uint8", symmetric=False,
                      observer={"kind": "percentile", "percentile": 99.0})
    fq(torch.from_numpy(x))
    check_brackets(fq.observer, x, 99.0)
    mn, mx = float(fq.observer.min_val), float(fq.observer.max_val)
    scale = np.float32(np.float32(mx) - np.float32(mn)) / np.float32(255)
    assert float(fq.scale[0]) == float(scale)


# -- histogram ----------------------------------------------------------------------------
@given(seed=st.integers(0, 2**32 - 1), bins=st.sampled_from([8, 100, 2048]),
       n=st.integers(10, 5000))
def test_histogram_counts_match_numpy_histogram(seed: int, bins: int, n: int) -> None:
    """One batch: the same counts as ``numpy.histogram`` over [min, max] (a value exactly
    on an inner edge may land on either side in floating point: none here but the
    extremes, which both put in the outer bins)."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    obs = HistogramObserver(bins=bins)
    obs.observe(torch.from_numpy(x))
    counts, _ = np.histogram(x.astype(np.float64), bins=bins,
                             range=(float(x.min()), float(x.max())))
    got = obs.histogram.numpy()
    assert got.sum() == n
    assert np.abs(got - counts).sum() <= 2, np.nonzero(got != counts)
    # the range chosen from it is inside the data and made of bin edges
    edges = np.linspace(float(x.min()), float(x.max()), bins + 1)
    assert np.isclose(edges, float(obs.min_val), rtol=0, atol=1e-6).any()
    assert np.isclose(edges, float(obs.max_val), rtol=0, atol=1e-6).any()
