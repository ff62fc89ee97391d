"""Observers: running min/max, moving averages, the ``make_observer`` factory, and how a
``FakeQuantize`` derives its qparams from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qcompile.errors import QCompileError
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.observers import MinMaxObserver, MovingAverageObserver, make_observer
from qcompile.specs.quant import HistogramObserver, MseObserver, PercentileObserver
from qcompile.specs.quant import MinMaxObserver as MinMaxSpec
from qcompile.specs.quant import MovingAverageObserver as MovingAverageSpec

F32 = np.float32
elements = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, list[np.ndarray]]:
    """1..5 batches of [channels, k] float32 values (k varies per batch)."""
    channels = draw(st.integers(1, 4))
    n = draw(st.integers(1, 5))
    return channels, [draw(arrays(np.float32, (channels, draw(st.integers(1, 6))),
                                  elements=elements)) for _ in range(n)]


def _feed(obs: MinMaxObserver, batch: np.ndarray) -> None:
    obs.update(torch.from_numpy(batch.min(axis=1)), torch.from_numpy(batch.max(axis=1)))


# -- MinMaxObserver ----------------------------------------------------------------------
@pytest.mark.parametrize("channels", [1, 3])
def test_minmax_starts_unobserved_and_resets(channels: int) -> None:
    obs = MinMaxObserver(channels)
    for buf in (obs.min_val, obs.max_val):
        assert buf.shape == (channels,) and buf.dtype == torch.float32
    assert torch.all(obs.min_val == float("inf")) and torch.all(obs.max_val == float("-inf"))
    assert set(obs.state_dict()) == {"min_val", "max_val"}
    obs.update(torch.full((channels,), -1.0), torch.full((channels,), 2.0))
    obs.reset()
    assert torch.all(obs.min_val == float("inf")) and torch.all(obs.max_val == float("-inf"))


@given(batches())
def test_minmax_running_min_max(cb: tuple[int, list[np.ndarray]]) -> None:
    channels, bs = cb
    obs = MinMaxObserver(channels)
    for i, b in enumerate(bs):
        _feed(obs, b)
        seen = np.concatenate(bs[: i + 1], axis=1)
        np.testing.assert_array_equal(obs.min_val.numpy(), seen.min(axis=1))
        np.testing.assert_array_equal(obs.max_val.numpy(), seen.max(axis=1))
    # reset forgets everything: the next batch alone defines the range
    obs.reset()
    _feed(obs, bs[-1])
    np.testing.assert_array_equal(obs.min_val.numpy(), bs[-1].min(axis=1))
    np.testing.assert_array_equal(obs.max_val.numpy(), bs[-1].max(axis=1))


def test_minmax_update_runs_on_meta_tensors() -> None:
    """Observers hold no data-dependent control flow, so meta tensors go through."""
    obs = MinMaxObserver(3).to("meta")
    obs.update(torch.empty(3, device="meta"), torch.empty(3, device="meta"))
    ema = MovingAverageObserver(3, momentum=0.1).to("meta")
    ema.update(torch.empty(3, device="meta"), torch.empty(3, device="meta"))
    assert obs.min_val.device.type == "meta" and ema.max_val.shape == (3,)


# -- MovingAverageObserver ---------------------------------------------------------------
def test_moving_average_docstring_example() -> None:
    obs = MovingAverageObserver(channels=1, momentum=0.5)
    obs.update(torch.tensor([-2.0]), torch.tensor([2.0]))
    obs.update(torch.tensor([0.0]), torch.tensor([4.0]))
    assert obs.min_val.tolist() == [-1.0] and obs.max_val.tolist() == [3.0]


@given(batches(), st.sampled_from([0.01, 0.1, 0.25, 0.5, 0.9, 1.0]))
def test_moving_average_matches_hand_computation(cb: tuple[int, list[np.ndarray]],
                                                 momentum: float) -> None:
    channels, bs = cb
    obs = MovingAverageObserver(channels, momentum=momentum)
    assert obs.momentum == momentum
    assert torch.all(torch.isinf(obs.min_val)) and torch.all(torch.isinf(obs.max_val))
    ref_min = ref_max = None
    for i, b in enumerate(bs):
        _feed(obs, b)
        bmin, bmax = b.min(axis=1).astype(np.float64), b.max(axis=1).astype(np.float64)
        if i == 0:  # the first batch is taken as is, exactly
            ref_min, ref_max = bmin, bmax
            np.testing.assert_array_equal(obs.min_val.numpy(), b.min(axis=1))
            np.testing.assert_array_equal(obs.max_val.numpy(), b.max(axis=1))
            continue
        ref_min = ref_min + momentum * (bmin - ref_min)  # (1 - m) * old + m * new
        ref_max = ref_max + momentum * (bmax - ref_max)
        # float32 lerp vs the float64 hand computation: a few ulp of the magnitudes
        tol = 1e-5 * max(1.0, *(np.abs(np.concatenate(bs[: i + 1], axis=1)).max(axis=1)))
        np.testing.assert_allclose(obs.min_val.numpy(), ref_min, rtol=0, atol=tol)
        np.testing.assert_allclose(obs.max_val.numpy(), ref_max, rtol=0, atol=tol)
    if momentum == 1.0 and len(bs) > 1:  # momentum 1 keeps only the newest batch
        np.testing.assert_array_equal(obs.min_val.numpy(), bs[-1].min(axis=1))
        np.testing.assert_array_equal(obs.max_val.numpy(), bs[-1].max(axis=1))


def test_moving_average_reset_takes_next_batch_as_is() -> None:
    obs = MovingAverageObserver(2, momentum=0.1)
    obs.update(torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 2.0]))
    obs.update(torch.tensor([-11.0, -2.0]), torch.tensor([11.0, 2.0]))
    assert obs.min_val.tolist() == pytest.approx([-2.0, -2.0])
    assert obs.max_val.tolist() == pytest.approx([2.0, 2.0])
    obs.reset()
    obs.update(torch.tensor([-5.0, 0.5]), torch.tensor([7.0, 0.75]))
    assert obs.min_val.tolist() == [-5.0, 0.5] and obs.max_val.tolist() == [7.0, 0.75]


# -- make_observer ----------------------------------------------------------------------
def test_make_observer_known_kinds() -> None:
    for spec in ("minmax", MinMaxSpec()):
        obs = make_observer(spec, 3)
        assert type(obs) is MinMaxObserver and obs.min_val.shape == (3,)
    obs = make_observer("moving_average", 2)
    assert isinstance(obs, MovingAverageObserver) and obs.momentum == 0.01
    obs = make_observer(MovingAverageSpec(momentum=0.3), 4)
    assert isinstance(obs, MovingAverageObserver) and obs.momentum == 0.3
    assert obs.min_val.shape == (4,)


def test_make_observer_builds_the_histogram_family() -> None:
    from qcompile.runtime.observers import HistogramObserver as H
    from qcompile.runtime.observers import MseObserver as M
    from qcompile.runtime.observers import PercentileObserver as P

    assert type(make_observer(HistogramObserver(bins=256), 1)) is H
    assert make_observer(HistogramObserver(bins=256), 1).bins == 256
    assert make_observer(PercentileObserver(percentile=99.0), 1).percentile == 99.0
    assert make_observer(MseObserver(steps=10), 1).steps == 10
    assert type(make_observer("percentile", 1)) is P and type(make_observer("mse", 1)) is M
    with pytest.raises(QCompileError, match="per_tensor only"):
        make_observer("histogram", 4)


def test_make_observer_unknown_kind_raises() -> None:
    with pytest.raises(QCompileError, match="no_such_observer") as info:
        make_observer("no_such_observer", 1)
    assert info.value.fix and "minmax" in info.value.fix


def _output_mse(observer: object, x: torch.Tensor) -> tuple[float, FakeQuantize]:
    fq = FakeQuantize("int8", symmetric=False, observer=observer)
    y = fq(x)
    return float(((y - x) ** 2).mean()), fq


def test_histogram_and_mse_never_do_worse_than_minmax_on_heavy_tails() -> None:
    gen = torch.Generator().manual_seed(0)
    # Laplace-distributed: an exponential magnitude with a random sign
    magnitude = torch.empty(20000).exponential_(generator=gen)
    x = magnitude * torch.sign(torch.randn(20000, generator=gen))
    base, _ = _output_mse("minmax", x)
    for kind in ("histogram", "mse"):
        err, fq = _output_mse(kind, x)
        assert err <= base * 1.02, (kind, err, base)  # the full range is one candidate
        assert fq.observer.min_val >= x.min() - 1e-6 and fq.observer.max_val <= x.max() + 1e-6


def test_percentile_clips_outliers() -> None:
    x = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    x[0] = 50.0
    _, fq = _output_mse({"kind": "percentile", "percentile": 99.9}, x)
    assert 2.0 < float(fq.observer.max_val) < 5.0  # the outlier at 50 is clipped
    assert -5.0 < float(fq.observer.min_val) < -2.0


def test_histogram_accumulates_over_batches_as_the_range_grows() -> None:
    fq = FakeQuantize("int8", symmetric=False, observer="histogram")
    fq(torch.linspace(-1, 1, 1000))
    fq(torch.linspace(-4, 4, 1000))  # wider: old counts are re-binned, none lost
    assert float(fq.observer.histogram.sum()) == 2000
    assert float(fq.observer.data_min) == -4 and float(fq.observer.data_max) == 4


# -- observers inside FakeQuantize ----------------------------------------------------------
def _ref_qparams(mn: np.ndarray, mx: np.ndarray, qmin: int, qmax: int,
                 symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    mn, mx = np.minimum(mn, F32(0)), np.maximum(mx, F32(0))
    eps = F32(np.finfo(np.float32).eps)
    if symmetric:
        zp = 0 if qmin < 0 else (qmin + qmax + 1) // 2
        s = np.maximum(np.maximum(-mn, mx) / F32(min(qmax - zp, zp - qmin)), eps)
        return s.astype(F32), np.full(s.shape, zp, np.int32)
    s = np.maximum((mx - mn) / F32(qmax - qmin), eps).astype(F32)
    return s, np.clip(F32(qmin) - np.round(mn / s), qmin, qmax).astype(np.int32)


@given(batches(), st.sampled_from(["int8", "uint8", "int4", "uint3"]), st.booleans(),
       st.sampled_from(["minmax", {"kind": "moving_average", "momentum": 0.25}]))
def test_fake_quantize_qparams_follow_observer(cb: tuple[int, list[np.ndarray]], dtype: str,
                                               symmetric: bool, observer: object) -> None:
    """Per-channel (axis 0) quantizer: after each observed batch, scale / zero_point are
    the qparams of the observer's current range; with observe off they stay put."""
    channels, bs = cb
    fq = FakeQuantize(dtype, symmetric=symmetric, granularity="per_channel", axis=0,
                      channels=channels, observer=observer)
    ref = MinMaxObserver(channels) if observer == "minmax" else \
        MovingAverageObserver(channels, momentum=0.25)
    assert type(fq.observer) is type(ref)
    for b in bs:
        fq(torch.from_numpy(b))
        _feed(ref, b)
        assert torch.equal(fq.observer.min_val, ref.min_val)
        assert torch.equal(fq.observer.max_val, ref.max_val)
        s, zp = _ref_qparams(ref.min_val.numpy(), ref.max_val.numpy(), fq.quant_min,
                             fq.quant_max, symmetric)
        np.testing.assert_array_equal(fq.scale.numpy(), s)
        np.testing.assert_array_equal(fq.zero_point.numpy(), zp)
    fq.observe = False
    state = {k: v.clone() for k, v in fq.state_dict().items()}
    fq(torch.from_numpy(bs[0] * F32(3) - F32(1)))
    for k, v in fq.state_dict().items():
        assert torch.equal(v, state[k]), k
