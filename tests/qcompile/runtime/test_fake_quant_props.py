"""Property tests of ``qcompile.runtime.fake_quant.FakeQuantize`` against an independent numpy
reference.

The reference below re-derives the numerics from the contract (DESIGN.md, the
``qcompile.runtime.quant_math`` docstring) in numpy float32 and never calls qcompile's math:

    range  = [min(x_min, 0), max(x_max, 0)]
    symmetric:  zp = 0 (signed) | (qmin + qmax + 1) // 2 (unsigned)
                scale = max(|min|, |max|) / min(qmax - zp, zp - qmin)
    asymmetric: scale = (max - min) / (qmax - qmin)
                zp = clip(qmin - round(min / scale), qmin, qmax)
    scale = max(scale, float32 eps)
    q = clip(round_half_even(x / scale) + zp, qmin, qmax);  y = (q - zp) * scale

Every float32 operation above is a single correctly rounded IEEE operation in both numpy
and torch (CPU), so outputs, scales and zero points are compared bit-exactly.

Granularities are exercised on the shapes they are used for: per_tensor (any), per_channel
(2-D linear and 4-D conv weights, axis 0, a non-zero axis and -1), per_group (2-D and 4-D
weights, groups along the flattened row) and per_token (3-D activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays
from torch import nn

from qcompile.runtime.fake_quant import FakeQuantize

F32 = np.float32
EPS = F32(np.finfo(np.float32).eps)
INT_DTYPES = [f"int{b}" for b in range(2, 17)] + [f"uint{b}" for b in range(2, 17)]
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
GRANULARITIES = ("per_tensor", "per_channel", "per_group", "per_token")

int_dtypes = st.sampled_from(INT_DTYPES)
fp8_dtypes = st.sampled_from(sorted(FP8))
# Finite float32 values of bounded magnitude (subnormals, +-0 and exact integers included).
elements = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)


def ref_qrange(dtype: str) -> tuple[int, int]:
    bits = int(dtype.removeprefix("u").removeprefix("int"))
    if dtype.startswith("u"):
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


# -- cases: granularity + shape ----------------------------------------------------------
@dataclass(frozen=True)
class Case:
    granularity: str
    shape: tuple[int, ...]
    axis: int | None = None
    group_size: int | None = None

    @property
    def channels(self) -> int:
        if self.granularity == "per_channel":
            return self.shape[self.axis]
        if self.granularity == "per_group":
            return self.shape[0] * (math.prod(self.shape[1:]) // self.group_size)
        return 1

    def make(self, dtype: str, symmetric: bool = True, **kw: object) -> FakeQuantize:
        return FakeQuantize(dtype, symmetric=symmetric, granularity=self.granularity,
                            axis=self.axis, group_size=self.group_size,
                            channels=self.channels, **kw)

    # numpy reference helpers ------------------------------------------------------
    def work(self, x: np.ndarray) -> np.ndarray:
        """The view the scales broadcast against (per_group: [rows, groups, group_size])."""
        if self.granularity == "per_group":
            return x.reshape(x.shape[0], -1, self.group_size)
        return x

    def shaped(self, t: np.ndarray) -> np.ndarray:
        """Per-scale values (1-D, or [..., 1] for per_token) shaped against ``work``."""
        if self.granularity == "per_channel":
            shape = [1] * len(self.shape)
            shape[self.axis] = -1
            return t.reshape(shape)
        if self.granularity == "per_group":
            return t.reshape(self.shape[0], -1, 1)
        return t

    def minmax(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = self.granularity
        if g == "per_tensor":
            return x.min().reshape(1), x.max().reshape(1)
        if g == "per_channel":
            xm = np.moveaxis(x, self.axis, 0).reshape(x.shape[self.axis], -1)
            return xm.min(axis=1), xm.max(axis=1)
        if g == "per_group":
            xg = self.work(x)
            return xg.min(axis=-1).reshape(-1), xg.max(axis=-1).reshape(-1)
        return x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)  # per_token


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def cases(draw: st.DrawFn, granularities: tuple[str, ...] = GRANULARITIES) -> Case:
    g = draw(st.sampled_from(granularities))
    if g == "per_tensor":
        return Case(g, draw(array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5)))
    if g == "per_channel":
        nd = draw(st.sampled_from([2, 4]))  # Linear weight / Conv2d weight
        shape = draw(array_shapes(min_dims=nd, max_dims=nd, min_side=1, max_side=4 if nd == 2
                                  else 3))
        return Case(g, shape, axis=draw(st.sampled_from([0, 1, nd - 1, -1])))
    if g == "per_group":
        if draw(st.booleans()):  # Linear weight [out, in]
            gs = draw(st.integers(1, 4))
            shape = (draw(st.integers(1, 4)), gs * draw(st.integers(1, 3)))
        else:  # Conv2d weight [out, in, kh, kw]: groups along the flattened row
            shape = tuple(draw(st.integers(1, 3)) for _ in range(4))
            gs = draw(st.sampled_from(_divisors(math.prod(shape[1:]))))
        return Case(g, shape, group_size=gs)
    # per_token: [batch, tokens, hidden]
    return Case(g, (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 6))))


@st.composite
def case_and_x(draw: st.DrawFn, granularities: tuple[str, ...] = GRANULARITIES,
               ) -> tuple[Case, np.ndarray]:
    case = draw(cases(granularities))
    return case, draw(arrays(np.float32, case.shape, elements=elements))


# -- independent numpy reference ---------------------------------------------------------
def ref_qparams(mn: np.ndarray, mx: np.ndarray, qmin: int, qmax: int, symmetric: bool,
                ) -> tuple[np.ndarray, np.ndarray]:
    mn = np.minimum(mn.astype(F32), F32(0))
    mx = np.maximum(mx.astype(F32), F32(0))
    if symmetric:
        zp = 0 if qmin < 0 else (qmin + qmax + 1) // 2
        scale = np.maximum(np.maximum(-mn, mx) / F32(min(qmax - zp, zp - qmin)), EPS)
        return scale.astype(F32), np.full(scale.shape, zp, dtype=np.int32)
    scale = np.maximum((mx - mn) / F32(qmax - qmin), EPS).astype(F32)
    zp = np.clip(F32(qmin) - np.round(mn / scale), F32(qmin), F32(qmax))
    return scale, zp.astype(np.int32)


def ref_fake_quant(case: Case, x: np.ndarray, scale: np.ndarray, zp: np.ndarray, qmin: int,
                   qmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, q, inside): output, clamped integer code, and the STE mask, all in x's shape."""
    xw = case.work(x.astype(F32))
    s = case.shaped(scale.astype(F32))
    z = case.shaped(zp).astype(F32)
    q_raw = np.round(xw / s) + z
    inside = (q_raw >= qmin) & (q_raw <= qmax)
    q = np.clip(q_raw, F32(qmin), F32(qmax))
    y = (q - z) * s
    assert y.dtype == np.float32
    return y.reshape(x.shape), q.reshape(x.shape), inside.reshape(x.shape)


def ref_expected(case: Case, x: np.ndarray, dtype: str, symmetric: bool,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    qmin, qmax = ref_qrange(dtype)
    scale, zp = ref_qparams(*case.minmax(x), qmin, qmax, symmetric)
    y, _, _ = ref_fake_quant(case, x, scale, zp, qmin, qmax)
    return y, scale, zp


def per_element(case: Case, t: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per-scale values broadcast to every element of x (x's shape)."""
    return np.broadcast_to(case.shaped(t), case.work(x).shape).reshape(x.shape)


def observed(case: Case, x: np.ndarray, dtype: str, symmetric: bool = True,
             **kw: object) -> FakeQuantize:
    """A quantizer whose qparams were observed from x, with observe turned off."""
    fq = case.make(dtype, symmetric, **kw)
    fq(torch.from_numpy(x))
    fq.observe = False
    return fq


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


# -- 1. reference equality ---------------------------------------------------------------
@given(case_and_x(), int_dtypes, st.booleans())
def test_matches_independent_reference_exactly(cx: tuple[Case, np.ndarray], dtype: str,
                                               symmetric: bool) -> None:
    case, x = cx
    fq = case.make(dtype, symmetric)
    assert (fq.quant_min, fq.quant_max) == ref_qrange(dtype)
    y_obs = fq(torch.from_numpy(x))  # observes x, then fake-quantizes it
    fq.observe = False
    y = fq(torch.from_numpy(x))
    y_ref, s_ref, zp_ref = ref_expected(case, x, dtype, symmetric)
    if case.granularity != "per_token":  # per_token keeps no qparams
        np.testing.assert_array_equal(_np(fq.scale), s_ref)
        np.testing.assert_array_equal(_np(fq.zero_point), zp_ref)
    np.testing.assert_array_equal(_np(y), y_ref)
    np.testing.assert_array_equal(_np(y_obs), y_ref)
    assert y.dtype == torch.float32 and y.shape == x.shape


# -- 2. output on the integer grid ---------------------------------------------------------
@given(case_and_x(("per_tensor", "per_channel", "per_group")), int_dtypes, st.booleans(),
       st.sampled_from([0.5, 1.0, 3.0]))
def test_output_lies_on_integer_grid(cx: tuple[Case, np.ndarray], dtype: str, symmetric: bool,
                                     stretch: float) -> None:
    case, x = cx
    qmin, qmax = ref_qrange(dtype)
    fq = observed(case, x, dtype, symmetric)
    x2 = x * F32(stretch)  # also values beyond the observed range
    y = _np(fq(torch.from_numpy(x2)))
    s = per_element(case, _np(fq.scale), x)
    zp = per_element(case, _np(fq.zero_point), x)
    # y must be float32(k * s) for an integer k with k + zp in [qmin, qmax]; recover k
    # in float64 (its error is < 0.01 for |k| < 2**17) and check the product bit-exactly.
    k = np.rint(y.astype(np.float64) / s.astype(np.float64))
    np.testing.assert_array_equal(k.astype(F32) * s, y)
    assert np.all(k + zp >= qmin) and np.all(k + zp <= qmax)
    # and it is the reference's integer code
    _, q_ref, _ = ref_fake_quant(case, x2, _np(fq.scale), _np(fq.zero_point), qmin, qmax)
    np.testing.assert_array_equal(k + zp, q_ref)


# -- 3. error bound inside the range, clamping outside ----------------------------------------
@given(case_and_x(("per_tensor", "per_channel", "per_group")), int_dtypes, st.booleans(),
       st.sampled_from([0.25, 1.0, 2.0, 10.0]))
def test_error_bound_inside_and_clamp_outside(cx: tuple[Case, np.ndarray], dtype: str,
                                              symmetric: bool, stretch: float) -> None:
    case, x = cx
    qmin, qmax = ref_qrange(dtype)
    fq = observed(case, x, dtype, symmetric)
    x2 = x * F32(stretch)
    y = _np(fq(torch.from_numpy(x2)))
    s = per_element(case, _np(fq.scale), x)
    zp = per_element(case, _np(fq.zero_point), x).astype(F32)
    lo, hi = (F32(qmin) - zp) * s, (F32(qmax) - zp) * s
    inside = (x2 >= lo) & (x2 <= hi)
    err = np.abs(x2.astype(np.float64) - y)
    bound = s.astype(np.float64) / 2 + 1e-6 * np.abs(x2)
    assert np.all(err[inside] <= bound[inside]), (x2[inside], y[inside], s[inside])
    np.testing.assert_array_equal(y[x2 < lo], lo[x2 < lo])
    np.testing.assert_array_equal(y[x2 > hi], hi[x2 > hi])


@given(case_and_x(), int_dtypes, st.booleans())
def test_observed_values_are_within_half_a_step(cx: tuple[Case, np.ndarray], dtype: str,
                                                symmetric: bool) -> None:
    """The data the qparams were computed from is never off by more than scale / 2 (for
    asymmetric ranges the rounded zero point can push the top end half a step out)."""
    case, x = cx
    qmin, qmax = ref_qrange(dtype)
    fq = observed(case, x, dtype, symmetric)
    y = _np(fq(torch.from_numpy(x)))
    s_ref, _ = ref_qparams(*case.minmax(x), qmin, qmax, symmetric)
    s = per_element(case, s_ref, x).astype(np.float64)
    err = np.abs(x.astype(np.float64) - y)
    assert np.all(err <= s / 2 * (1 + 1e-6) + 1e-6 * np.abs(x)), (x, y, s)


# -- 4. idempotence -------------------------------------------------------------------------
@given(case_and_x(("per_tensor", "per_channel", "per_group")), int_dtypes, st.booleans())
def test_idempotent(cx: tuple[Case, np.ndarray], dtype: str, symmetric: bool) -> None:
    """fq(fq(x)) == fq(x) bit-exactly in float32 with fixed qparams: y = fl(k * s) and
    fl(y / s) is within a few ulp of the integer k (|k| < 2**16), so it rounds back to k.

    Not asserted: bfloat16 (rounding k * s to 8 mantissa bits can move it off the grid for
    wide dtypes) and per_token / dynamic quantizers (they re-derive the scale from y, whose
    range differs from x's by rounding, so the grid itself can move by an ulp)."""
    case, x = cx
    fq = observed(case, x, dtype, symmetric)
    y = fq(torch.from_numpy(x))
    assert torch.equal(fq(y), y)


# -- 5. monotonicity ---------------------------------------------------------------------
@given(arrays(np.float32, st.integers(1, 40), elements=elements), int_dtypes, st.booleans(),
       st.sampled_from([0.5, 1.0, 4.0]))
def test_monotone_non_decreasing(x: np.ndarray, dtype: str, symmetric: bool,
                                 stretch: float) -> None:
    x = np.sort(x)
    fq = observed(Case("per_tensor", x.shape), x, dtype, symmetric)
    y = _np(fq(torch.from_numpy(x * F32(stretch))))
    assert np.all(np.diff(y) >= 0), y


# -- 6. straight-through gradient ------------------------------------------------------------
@st.composite
def fixed_qparams(draw: st.DrawFn, dtype: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    qmin, qmax = ref_qrange(dtype)
    scale = np.array([draw(st.floats(2.0**-10, 2.0**10, width=32)) for _ in range(n)], dtype=F32)
    zp = np.array([draw(st.integers(qmin, qmax)) for _ in range(n)], dtype=np.int32)
    return scale, zp


@given(st.data(), int_dtypes, st.sampled_from(["per_tensor", "per_channel"]))
def test_ste_gradient_mask(data: st.DataObject, dtype: str, granularity: str) -> None:
    qmin, qmax = ref_qrange(dtype)
    shape = data.draw(array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=6))
    case = Case(granularity, shape, axis=1 if granularity == "per_channel" else None)
    scale, zp = data.draw(fixed_qparams(dtype, case.channels))
    x = data.draw(arrays(np.float32, shape, elements=elements))
    # plant values far outside and just inside the range
    s_e = per_element(case, scale, x)
    z_e = per_element(case, zp, x).astype(F32)
    x = x.copy()
    x.flat[0] = (F32(qmax) - z_e.flat[0] + 7) * s_e.flat[0]
    x.flat[-1] = (F32(qmin) - z_e.flat[-1] - 7) * s_e.flat[-1]
    if x.size > 2:
        x.flat[1] = (F32(qmax) - z_e.flat[1]) * s_e.flat[1]
    fq = case.make(dtype, True)
    fq.scale.copy_(torch.from_numpy(scale))
    fq.zero_point.copy_(torch.from_numpy(zp))
    fq.observe = False
    xt = torch.from_numpy(x).requires_grad_(True)
    upstream = torch.from_numpy(data.draw(arrays(np.float32, shape, elements=elements)))
    y = fq(xt)
    (grad,) = torch.autograd.grad(y, xt, upstream)
    y_ref, _, inside = ref_fake_quant(case, x, scale, zp, qmin, qmax)
    np.testing.assert_array_equal(_np(y), y_ref)
    np.testing.assert_array_equal(_np(grad), np.where(inside, _np(upstream), F32(0)))
    # with a unit upstream gradient the mask is exactly 1 / 0
    xt.grad = None
    fq(xt).sum().backward()
    np.testing.assert_array_equal(_np(xt.grad), inside.astype(F32))
    assert not inside.flat[0] and not inside.flat[-1]
    if x.size > 2:
        assert inside.flat[1]


@given(case_and_x(("per_tensor", "per_channel", "per_group")), int_dtypes)
def test_observed_extremes_keep_their_gradient_symmetric(cx: tuple[Case, np.ndarray],
                                                         dtype: str) -> None:
    """Symmetric ranges contain every observed value, so the STE passes all of them."""
    case, x = cx
    fq = observed(case, x, dtype, True)
    xt = torch.from_numpy(x).requires_grad_(True)
    fq(xt).sum().backward()
    np.testing.assert_array_equal(_np(xt.grad), np.ones_like(x))


# -- 7. per-group scales -----------------------------------------------------------------
@given(case_and_x(("per_group",)), int_dtypes, st.booleans())
def test_per_group_scales_and_error_bound(cx: tuple[Case, np.ndarray], dtype: str,
                                          symmetric: bool) -> None:
    case, x = cx
    fq = observed(case, x, dtype, symmetric)
    rows, n_groups = x.shape[0], math.prod(x.shape[1:]) // case.group_size
    assert fq.scale.shape == (rows * n_groups,) and fq.scale.dim() == 1
    assert fq.zero_point.shape == (rows * n_groups,) and fq.zero_point.dtype == torch.int32
    assert fq.group_size == case.group_size and fq.axis is None
    y = _np(fq(torch.from_numpy(x)))
    xg = x.reshape(rows, n_groups, case.group_size).astype(np.float64)
    yg = y.reshape(rows, n_groups, case.group_size)
    sg = _np(fq.scale).reshape(rows, n_groups, 1).astype(np.float64)
    assert np.all(np.abs(xg - yg) <= sg / 2 * (1 + 1e-6) + 1e-6 * np.abs(xg))
    # each group's scale is its own range's scale
    qmin, qmax = ref_qrange(dtype)
    for r in range(rows):
        for g in range(n_groups):
            s1, _ = ref_qparams(xg[r, g].min(keepdims=True).astype(F32),
                                xg[r, g].max(keepdims=True).astype(F32), qmin, qmax, symmetric)
            assert _np(fq.scale)[r * n_groups + g] == s1[0]


# -- 8. scale shape/dtype, bfloat16 inputs -------------------------------------------------
@given(case_and_x(), int_dtypes, st.booleans())
def test_bfloat16_input(cx: tuple[Case, np.ndarray], dtype: str, symmetric: bool) -> None:
    case, x = cx
    xb = torch.from_numpy(x).to(torch.bfloat16)
    xf = xb.float().numpy()  # the values the quantizer sees
    fq = case.make(dtype, symmetric)
    y = fq(xb)
    assert y.dtype == torch.bfloat16 and y.shape == xb.shape
    assert fq.scale.dtype == torch.float32 and fq.scale.dim() == 1
    assert fq.scale.shape == (case.channels,)
    assert fq.zero_point.dtype == torch.int32 and fq.zero_point.shape == (case.channels,)
    y_ref, s_ref, zp_ref = ref_expected(case, xf, dtype, symmetric)
    if case.granularity != "per_token":
        np.testing.assert_array_equal(_np(fq.scale), s_ref)
        np.testing.assert_array_equal(_np(fq.zero_point), zp_ref)
    # math in float32, one rounding to bfloat16 at the end
    assert torch.equal(y, torch.from_numpy(y_ref).to(torch.bfloat16))


@given(cases(), st.sampled_from(INT_DTYPES + sorted(FP8)))
def test_scales_are_1d_float32(case: Case, dtype: str) -> None:
    fq = case.make(dtype, True)
    for name, buf in fq.named_buffers():  # the quantizer's and its observer's (if any)
        assert buf.dim() == 1, (name, buf.shape)
    assert fq.scale.shape == (case.channels,) and fq.scale.dtype == torch.float32
    fq(torch.ones(case.shape))  # a 1-element input must not give a 0-dim scale
    assert fq.scale.shape == (case.channels,) and fq.scale.dtype == torch.float32
    assert fq.zero_point.shape == (case.channels,) and fq.zero_point.dtype == torch.int32


# -- 9. zero and constant tensors ------------------------------------------------------------
@given(cases(), st.sampled_from(INT_DTYPES + sorted(FP8)), st.booleans(),
       st.sampled_from([0.0, -0.0, 1.0, -3.5, 1e-30, 1e4, -1e4]))
def test_zero_and_constant_tensors(case: Case, dtype: str, symmetric: bool, c: float) -> None:
    symmetric = symmetric or dtype in FP8  # fp8 formats are symmetric only
    x = np.full(case.shape, c, dtype=F32)
    fq = case.make(dtype, symmetric)
    y = _np(fq(torch.from_numpy(x)))
    assert np.all(np.isfinite(_np(fq.scale))) and np.all(_np(fq.scale) > 0)
    assert np.all(np.isfinite(y))
    if c == 0.0:
        np.testing.assert_array_equal(y, np.zeros_like(x))
        return
    mn, mx = case.minmax(x)
    if dtype in FP8:
        amax = np.maximum(-np.minimum(mn, F32(0)), np.maximum(mx, F32(0)))
        s = np.maximum(amax / F32(FP8[dtype][1]), EPS)
        rel = 2.0**-3  # relative rounding of x / s to 2 (e5m2) or 3 (e4m3) mantissa bits
    else:
        s, _ = ref_qparams(mn, mx, *ref_qrange(dtype), symmetric)
        rel = 0.0
    if case.granularity != "per_token":
        np.testing.assert_array_equal(_np(fq.scale), s)
    s_e = per_element(case, s, x).astype(np.float64)
    assert np.all(np.abs(x.astype(np.float64) - y) <= s_e / 2 * (1 + 1e-6)
                  + (rel + 1e-6) * abs(c)), (x, y, s)


# -- 10. fp8 ------------------------------------------------------------------------------
@given(case_and_x(("per_tensor", "per_channel")), fp8_dtypes)
def test_fp8_matches_cast_reference(cx: tuple[Case, np.ndarray], fmt: str) -> None:
    case, x = cx
    torch_fmt, fp8_max = FP8[fmt]
    fq = observed(case, x, fmt)
    assert (fq.quant_min, fq.quant_max) == (-fp8_max, fp8_max)
    y = _np(fq(torch.from_numpy(x)))
    mn, mx = case.minmax(x)
    amax = np.maximum(-np.minimum(mn, F32(0)), np.maximum(mx, F32(0)))
    s_ref = np.maximum(amax / F32(fp8_max), EPS).astype(F32)
    np.testing.assert_array_equal(_np(fq.scale), s_ref)
    np.testing.assert_array_equal(_np(fq.zero_point), np.zeros_like(s_ref, dtype=np.int32))
    s = per_element(case, s_ref, x)
    xs = np.clip(x / s, F32(-fp8_max), F32(fp8_max))
    y_ref = torch.from_numpy(xs).to(torch_fmt).float().numpy() * s
    np.testing.assert_array_equal(y, y_ref)
    # y = float32(v * s) with v exactly representable in the format
    v = torch.from_numpy(y.astype(np.float64) / s).to(torch_fmt).float().numpy()
    np.testing.assert_array_equal(v * s, y)
    assert np.all(np.abs(v) <= fp8_max)


@given(st.data(), fp8_dtypes, st.sampled_from([torch.float32, torch.bfloat16]))
def test_fp8_saturation_and_gradient_mask(data: st.DataObject, fmt: str,
                                          dtype: torch.dtype) -> None:
    torch_fmt, fp8_max = FP8[fmt]
    scale = F32(data.draw(st.floats(2.0**-10, 1.0, width=32)))
    v = data.draw(arrays(np.float32, st.integers(1, 30),
                         elements=st.floats(-4 * fp8_max, 4 * fp8_max, width=32)))
    x = torch.from_numpy(v * scale).to(dtype)
    xf = x.float().numpy()
    fq = FakeQuantize(fmt)
    fq.scale.fill_(float(scale))
    fq.observe = False
    xt = x.clone().requires_grad_(True)
    y = fq(xt)
    assert y.dtype == dtype
    y.float().sum().backward()
    xs = xf / scale
    yf = y.detach().float().numpy()
    end = F32(fp8_max) * scale
    big = np.abs(xs) > fp8_max
    ref = torch.from_numpy(np.clip(xs, -fp8_max, fp8_max).astype(F32)).to(torch_fmt).float()
    expected = torch.from_numpy(ref.numpy() * scale).to(dtype).float().numpy()
    np.testing.assert_array_equal(yf, expected)
    # saturation: everything beyond +-max maps to +-max * scale
    np.testing.assert_array_equal(yf[big], np.sign(xs[big]) * torch.tensor(end).to(dtype).item())
    grad = xt.grad.float().numpy()
    assert set(np.unique(grad)) <= {0.0, 1.0}
    assert np.all(grad[np.abs(xs) <= fp8_max] == 1)
    assert np.all(grad[np.abs(xs) >= 2 * fp8_max] == 0)


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_fp8_observed_maximum_keeps_its_gradient(fmt: str) -> None:
    # each of these amax values satisfies fl(amax / fl(amax / 448)) > 448 in float32
    values = [80.22161865234375, -75.08905792236328]
    for a in values:
        if fmt == "fp8_e5m2":
            a = a * 57344.0 / 448.0
        x = torch.tensor([a, a / 3], requires_grad=True)
        fq = FakeQuantize(fmt)
        fq(x.detach())
        fq.observe = False
        fq(x).sum().backward()
        assert x.grad.tolist() == [1.0, 1.0], (fmt, a, (x[0] / fq.scale).item())


# -- 11. LSQ ------------------------------------------------------------------------------
@given(case_and_x(("per_tensor", "per_channel")), int_dtypes, st.booleans(),
       st.sampled_from([0.5, 1.0, 3.0]), st.data())
def test_lsq_gradients(cx: tuple[Case, np.ndarray], dtype: str, symmetric: bool,
                       stretch: float, data: st.DataObject) -> None:
    case, x = cx
    qmin, qmax = ref_qrange(dtype)
    fq = case.make(dtype, symmetric, learnable=True)
    assert isinstance(fq.scale_offset, nn.Parameter) and fq.observe
    fq(torch.from_numpy(x))  # the first forward initialises the scale from the observer
    assert not fq.observe
    s_ref, zp_ref = ref_qparams(*case.minmax(x), qmin, qmax, symmetric)
    np.testing.assert_array_equal(_np(fq.scale), s_ref)
    np.testing.assert_array_equal(_np(fq.zero_point), zp_ref)
    assert isinstance(fq.scale_offset, nn.Parameter) and fq.scale_offset.requires_grad

    x2 = x * F32(stretch)
    g = data.draw(arrays(np.float32, x.shape, elements=st.floats(-4, 4, width=32)))
    fq.scale_offset.grad = None
    xt = torch.from_numpy(x2).requires_grad_(True)
    y = fq(xt)
    y.backward(torch.from_numpy(g))
    assert not fq.observe
    np.testing.assert_array_equal(_np(fq.scale), s_ref)  # forward does not move the scale
    y_ref, q, inside = ref_fake_quant(case, x2, s_ref, zp_ref, qmin, qmax)
    np.testing.assert_array_equal(_np(y), y_ref)
    np.testing.assert_array_equal(_np(xt.grad), np.where(inside, g, F32(0)))

    # LSQ (Esser et al. 2020): y = (clip(round(x/s) + zp) - zp) * s with round as identity
    # in the backward pass, so dy/ds = round(x/s) - x/s inside the range and
    # (qclip - zp) at the clip; the step-size gradient is scaled by 1/sqrt(N * Q_P) with N
    # the elements sharing the scale and Q_P the top of the integer range.
    s_e = per_element(case, s_ref, x2)
    z_e = per_element(case, zp_ref, x2).astype(np.float64)
    xs = (x2 / s_e).astype(np.float64)  # float32 division, as the forward rounds it
    dyds = np.where(inside, q - z_e - xs, q - z_e)
    n = x.size // case.channels
    factor = 1.0 / math.sqrt(n * qmax)
    terms = g.astype(np.float64) * dyds
    if case.granularity == "per_tensor":
        ref = np.array([terms.sum()]) * factor
        mag = np.array([np.abs(terms).sum()]) * factor
    else:
        axis = case.axis % x.ndim
        other = tuple(d for d in range(x.ndim) if d != axis)
        ref = terms.sum(axis=other) * factor
        mag = np.abs(terms).sum(axis=other) * factor
    got = _np(fq.scale_offset.grad).astype(np.float64)
    assert fq.scale_offset.grad.shape == fq.scale.shape
    # float32 summation order differs from numpy's: relative to the sum of magnitudes
    assert np.all(np.abs(got - ref) <= 1e-5 * mag + 1e-30), (got, ref, mag)


# -- 12. dynamic and per-token quantizers ------------------------------------------------
@given(st.data(), int_dtypes, st.booleans())
def test_dynamic_and_per_token_use_each_inputs_range(data: st.DataObject, dtype: str,
                                                     symmetric: bool) -> None:
    case = data.draw(cases())
    dynamic = case.granularity != "per_token" or data.draw(st.booleans())
    x1 = data.draw(arrays(np.float32, case.shape, elements=elements))
    x2 = data.draw(arrays(np.float32, case.shape, elements=elements)) * F32(7)
    fq = case.make(dtype, symmetric, dynamic=dynamic)
    state = {k: v.clone() for k, v in fq.state_dict().items()}
    for x in (x1, x2, x1):
        y = fq(torch.from_numpy(x))
        y_ref, _, _ = ref_expected(case, x, dtype, symmetric)
        np.testing.assert_array_equal(_np(y), y_ref)
    for k, v in fq.state_dict().items():
        assert torch.equal(v, state[k]), k  # forward changed no buffer
    assert torch.equal(fq.scale, torch.ones(case.channels))


# -- 13. enabled / observe switches, empty tensors -------------------------------------------
@given(case_and_x(), st.sampled_from(INT_DTYPES + sorted(FP8)), st.booleans())
def test_disabled_is_identity(cx: tuple[Case, np.ndarray], dtype: str, dynamic: bool) -> None:
    case, x = cx
    fq = case.make(dtype, True, dynamic=dynamic)
    fq.enabled = False
    xt = torch.from_numpy(x).requires_grad_(True)
    y = fq(xt)
    np.testing.assert_array_equal(_np(y), x)
    y.sum().backward()
    np.testing.assert_array_equal(_np(xt.grad), np.ones_like(x))
    xb = xt.detach().to(torch.bfloat16)
    assert torch.equal(fq(xb), xb) and fq(xb).dtype == torch.bfloat16


@given(case_and_x(("per_tensor", "per_channel", "per_group")), int_dtypes, st.booleans())
def test_observe_off_keeps_qparams(cx: tuple[Case, np.ndarray], dtype: str,
                                   symmetric: bool) -> None:
    case, x = cx
    qmin, qmax = ref_qrange(dtype)
    fq = observed(case, x, dtype, symmetric)
    s0, zp0 = fq.scale.clone(), fq.zero_point.clone()
    obs0 = {k: v.clone() for k, v in fq.observer.state_dict().items()}
    x2 = x * F32(5) + F32(1)
    y = fq(torch.from_numpy(x2))
    assert torch.equal(fq.scale, s0) and torch.equal(fq.zero_point, zp0)
    for k, v in fq.observer.state_dict().items():
        assert torch.equal(v, obs0[k]), k
    y_ref, _, _ = ref_fake_quant(case, x2, _np(s0), _np(zp0), qmin, qmax)
    np.testing.assert_array_equal(_np(y), y_ref)
    # turning observe back on folds the new batch into the running range
    fq.observe = True
    fq(torch.from_numpy(x2))
    (mn1, mx1), (mn2, mx2) = case.minmax(x), case.minmax(x2)
    mn, mx = np.minimum(mn1, mn2), np.maximum(mx1, mx2)
    s_ref, zp_ref = ref_qparams(mn, mx, qmin, qmax, symmetric)
    np.testing.assert_array_equal(_np(fq.scale), s_ref)
    np.testing.assert_array_equal(_np(fq.zero_point), zp_ref)


@pytest.mark.parametrize("dtype", ["int8", "uint4", "fp8_e4m3"])
@pytest.mark.parametrize(("granularity", "shape", "kw"), [
    ("per_tensor", (0,), {}),
    ("per_tensor", (3, 0), {}),
    ("per_channel", (3, 0), {"axis": 0, "channels": 3}),
    ("per_channel", (0, 4), {"axis": 1, "channels": 4}),
    ("per_group", (2, 0), {"group_size": 4, "channels": 2}),
    ("per_token", (2, 0, 4), {}),
])
@pytest.mark.parametrize("dynamic", [False, True])
def test_empty_tensor_passes_through(dtype: str, granularity: str, shape: tuple[int, ...],
                                     kw: dict, dynamic: bool) -> None:
    fq = FakeQuantize(dtype, granularity=granularity, dynamic=dynamic, **kw)
    state = {k: v.clone() for k, v in fq.state_dict().items()}
    x = torch.empty(shape, requires_grad=True)
    y = fq(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    for k, v in fq.state_dict().items():
        assert torch.equal(v, state[k]), k
    fq.observe = False
    assert fq(x).shape == x.shape


# -- 15. non-contiguous inputs ---------------------------------------------------------
@given(st.data(), st.sampled_from(INT_DTYPES + sorted(FP8)), st.booleans(), st.booleans())
def test_non_contiguous_input_matches_contiguous_copy(data: st.DataObject, dtype: str,
                                                      symmetric: bool, dynamic: bool) -> None:
    symmetric = symmetric or dtype in FP8
    case = data.draw(cases())
    base = torch.from_numpy(data.draw(arrays(np.float32, case.shape[::-1],
                                             elements=elements)))
    # the same logical tensor, as a permuted (non-contiguous) view and as a dense copy
    x_view = base.permute(*reversed(range(base.dim())))
    assert x_view.shape == case.shape
    x_dense = x_view.contiguous()
    fq_view = case.make(dtype, symmetric, dynamic=dynamic)
    fq_dense = case.make(dtype, symmetric, dynamic=dynamic)
    for _ in range(2):
        assert torch.equal(fq_view(x_view), fq_dense(x_dense))
        assert torch.equal(fq_view.scale, fq_dense.scale)
        assert torch.equal(fq_view.zero_point, fq_dense.zero_point)
    if x_view.dim() >= 2 and x_view.shape[-1] >= 2:  # a strided slice too
        sl = x_view[..., ::2]
        fq_a = FakeQuantize(dtype, symmetric=symmetric, dynamic=dynamic)
        fq_b = FakeQuantize(dtype, symmetric=symmetric, dynamic=dynamic)
        assert torch.equal(fq_a(sl), fq_b(sl.contiguous()))
