"""The eager fake-quant path (``quant_math.fake_quantize_eager``, ``fake_quantize_fp8``, and
``fake_quantize`` when the C++ kernels are not taken) against numpy, not against the
kernels (``test_kernels.py`` compares the two with each other: a shared mistake would
pass there).

The reference re-derives the contract in numpy float32 (every step one correctly
rounded IEEE operation, so the comparison is bit-exact):

    q_raw = round_half_even(x / scale) + zp;   inside = qmin <= q_raw <= qmax
    out   = (clip(q_raw, qmin, qmax) - zp) * scale        d out / d x = inside

LSQ (scale gradient) per Esser et al.: ``d out / d scale = q - zp - x/scale`` inside the
range, ``q - zp`` at the clamp, times ``grad_factor``, summed over what shares a scale.
fp8 rounds ``clip(x / scale, -max, max)`` to the format by hand here (round to nearest
even on the format's grid: mantissa bits, minimum exponent, subnormals), not by a cast.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from qcompile.runtime import kernels
from qcompile.runtime.quant_math import fake_quantize, fake_quantize_eager, fake_quantize_fp8

F32 = np.float32
INT_DTYPES = [f"int{b}" for b in range(2, 17)] + [f"uint{b}" for b in range(2, 17)]
elements = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)
# (mantissa bits, smallest normal exponent, largest finite value, where rounding stops
# landing on the largest value: max + ulp(max) / 2)
FP8 = {"fp8_e4m3": (3, -6, 448.0, 464.0), "fp8_e5m2": (2, -14, 57344.0, 61440.0)}


def qrange(dtype: str) -> tuple[int, int]:
    bits = int(dtype.removeprefix("u").removeprefix("int"))
    return (0, 2**bits - 1) if dtype.startswith("u") else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def ref_fake_quant(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, qmin: int,
                   qmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out, q_clamped, inside) in numpy float32, broadcast like the torch call."""
    xs = x.astype(F32) / scale.astype(F32)
    z = zp.astype(F32)
    q_raw = np.round(xs) + z
    inside = (q_raw >= qmin) & (q_raw <= qmax)
    q = np.clip(q_raw, F32(qmin), F32(qmax))
    out = (q - z) * scale.astype(F32)
    assert out.dtype == F32
    return out, q, inside


@st.composite
def problems(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """x, and a scale / zero point shaped to broadcast against it: per tensor (one value)
    or one per index of an axis (the FakeQuantize layouts)."""
    dtype = draw(st.sampled_from(INT_DTYPES))
    qmin, qmax = qrange(dtype)
    shape = draw(array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5))
    if draw(st.booleans()):
        pshape: tuple[int, ...] = (1,)
    else:
        axis = draw(st.integers(0, len(shape) - 1))
        pshape = tuple(s if i == axis else 1 for i, s in enumerate(shape))
    x = draw(arrays(F32, shape, elements=elements))
    scale = draw(arrays(F32, pshape, elements=st.floats(2.0**-10, 2.0**10, width=32)))
    zp = draw(arrays(np.int32, pshape, elements=st.integers(qmin, qmax)))
    return x, scale, zp, qmin, qmax


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


@given(problems(), st.data())
def test_eager_forward_and_gradient_match_numpy(p: tuple, data: st.DataObject) -> None:
    x, scale, zp, qmin, qmax = p
    y_ref, _, inside = ref_fake_quant(x, scale, zp, qmin, qmax)
    xt = _t(x).requires_grad_(True)
    y = fake_quantize_eager(xt, _t(scale), _t(zp), qmin, qmax)
    np.testing.assert_array_equal(y.detach().numpy(), y_ref)
    g = data.draw(arrays(F32, x.shape, elements=st.floats(-4, 4, width=32)))
    y.backward(_t(g))
    np.testing.assert_array_equal(xt.grad.numpy(), g * inside, err_msg="straight-through mask")


@given(st.sampled_from(INT_DTYPES), st.sampled_from([2.0**-6, 0.5, 1.0, 8.0]), st.data())
def test_eager_rounds_ties_to_even(dtype: str, scale: float, data: st.DataObject) -> None:
    """x / scale exactly half-way between integers (scale a power of two: exact): random
    floats almost never land there, so they are drawn on purpose."""
    qmin, qmax = qrange(dtype)
    k = data.draw(arrays(np.int64, data.draw(array_shapes(max_dims=2, max_side=8)),
                         elements=st.integers(qmin - 3, qmax + 3)))
    x = ((k + 0.5) * scale).astype(F32)
    s, zp = np.array([scale], F32), np.array([data.draw(st.integers(qmin, qmax))], np.int32)
    y = fake_quantize_eager(_t(x), _t(s), _t(zp), qmin, qmax)
    np.testing.assert_array_equal(y.numpy(), ref_fake_quant(x, s, zp, qmin, qmax)[0])


@given(problems(), st.sampled_from([torch.float16, torch.float64]))
def test_eager_computes_in_float32_and_returns_the_input_dtype(p: tuple,
                                                               dtype: torch.dtype) -> None:
    x, scale, zp, qmin, qmax = p
    xt = _t(x).to(dtype)
    x32 = xt.float().numpy()  # the values the quantizer sees
    y = fake_quantize_eager(xt, _t(scale), _t(zp), qmin, qmax)
    assert y.dtype == dtype
    y_ref, _, _ = ref_fake_quant(x32, scale, zp, qmin, qmax)
    np.testing.assert_array_equal(y.float().numpy(), _t(y_ref).to(dtype).float().numpy())


@given(problems(), st.data(), st.floats(0.01, 1.0))
def test_eager_lsq_gradients_match_numpy(p: tuple, data: st.DataObject,
                                         grad_factor: float) -> None:
    x, scale, zp, qmin, qmax = p
    y_ref, q, inside = ref_fake_quant(x, scale, zp, qmin, qmax)
    xt = _t(x).requires_grad_(True)
    st_ = _t(scale).requires_grad_(True)
    y = fake_quantize_eager(xt, st_, _t(zp), qmin, qmax, learnable=True,
                            grad_factor=grad_factor)
    np.testing.assert_array_equal(y.detach().numpy(), y_ref)
    g = data.draw(arrays(F32, x.shape, elements=st.floats(-4, 4, width=32)))
    y.backward(_t(g))
    np.testing.assert_array_equal(xt.grad.numpy(), g * inside)
    # float64 from the float32 quotient the path divides by: no rounding of its own
    xs = (x / scale).astype(np.float64)
    z = zp.astype(np.float64)
    d = np.where(inside, q - z - xs, q - z) * g
    expect = sum_to(d, scale.shape) * grad_factor
    # float32 products and summation inside torch: relative to the sum of magnitudes
    tol = 1e-5 * sum_to(np.abs(d), scale.shape) * grad_factor + 1e-30
    assert np.all(np.abs(st_.grad.numpy() - expect) <= tol), (st_.grad, expect)


def sum_to(d: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``torch.Tensor.sum_to_size`` in numpy: sum what a scale of ``shape`` broadcasts over."""
    d = d.sum(axis=tuple(range(d.ndim - len(shape))))
    return d.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


# -- fp8 ----------------------------------------------------------------------------------
def ref_fp8(v: np.ndarray, mant: int, min_exp: int) -> np.ndarray:
    """Round float32 values (already within +-max) to the fp8 grid: nearest, ties to
    even; exact in float64 (scaling by powers of two)."""
    a = np.abs(v.astype(np.float64))
    _, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1): exponent e - 1
    exp = np.maximum(e - 1, min_exp)  # subnormals share the smallest exponent's step
    step = np.ldexp(1.0, exp - mant)
    return np.sign(v) * np.round(a / step) * step


@given(st.sampled_from(sorted(FP8)), st.data())
def test_fp8_matches_hand_rounding(fmt: str, data: st.DataObject) -> None:
    mant, min_exp, fp8_max, rounds_in = FP8[fmt]
    shape = data.draw(array_shapes(min_dims=1, max_dims=3, max_side=6))
    scale = F32(data.draw(st.sampled_from([1.0, 0.5, 1e-3, 3.7, 1e2])))
    # values around the format's whole range, in units of scale: subnormals to saturation
    v = data.draw(arrays(F32, shape, elements=st.floats(-2 * fp8_max, 2 * fp8_max, width=32)))
    x = (v * scale).astype(F32)
    xt = _t(x).requires_grad_(True)
    y = fake_quantize_fp8(xt, _t(np.array([scale], F32)), fmt, fp8_max)
    xs = x / scale
    expect = ref_fp8(np.clip(xs, -fp8_max, fp8_max), mant, min_exp).astype(F32) * scale
    np.testing.assert_array_equal(y.detach().numpy(), expect)
    y.backward(torch.ones_like(y))
    np.testing.assert_array_equal(xt.grad.numpy(), (np.abs(xs) < rounds_in).astype(F32))


def test_fp8_hand_rounding_knows_the_formats() -> None:
    """The reference itself, on values whose fp8 neighbours are known."""
    e4 = FP8["fp8_e4m3"]
    v = np.array([1.0625, 1.1875, 2**-9, 1.5 * 2**-10, 2**-11, 440.0, 447.0], F32)
    np.testing.assert_array_equal(ref_fp8(v, e4[0], e4[1]),
                                  [1.0, 1.25, 2**-9, 2**-9, 0.0, 448.0, 448.0])
    e5 = FP8["fp8_e5m2"]
    v = np.array([1.125, 1.375, 2**-16, 3 * 2**-18], F32)
    np.testing.assert_array_equal(ref_fp8(v, e5[0], e5[1]), [1.0, 1.5, 2**-16, 2**-16])


# -- the dispatcher without kernels ----------------------------------------------------------
@given(problems())
def test_fake_quantize_without_kernels_matches_numpy(p: tuple) -> None:
    """``fake_quantize`` on a machine without the C++ kernels (or off CPU) is eager."""
    x, scale, zp, qmin, qmax = p
    with mock.patch.object(kernels, "available", lambda: False):
        y = fake_quantize(_t(x), _t(scale), _t(zp), qmin, qmax)
    np.testing.assert_array_equal(y.numpy(), ref_fake_quant(x, scale, zp, qmin, qmax)[0])
