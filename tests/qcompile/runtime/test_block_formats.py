"""Block-scaled formats (MX, NVFP4, NF4) against an independent numpy reference, bit for bit.

The reference (``tests/helpers/block_reference.py``) builds every element grid by decoding
all codes of the element format and rounds to the nearest grid point, ties to the even code;
``qcompile.runtime.block_formats`` computes the same values with exponent arithmetic. The
two must agree on every bit (the sign of zero included, NaN where the definition gives NaN),
on generated blocks and on the cases rounding gets wrong first: exact ties at every grid
midpoint (and one ulp either side), zeros and -0, all-zero blocks, float32 subnormals,
saturation after scaling, values near float32's maximum, NaN and inf. torchao 0.18 (when
installed) is a second, external reference: ``to_mx`` (FLOOR) and its dequantization,
``nvfp4_quantize`` / ``NVFP4Tensor``, and NF4's nearest-level choice.
"""

from __future__ import annotations

import block_reference as R
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompile.runtime import block_formats as bf

pytestmark = pytest.mark.usefixtures("one_thread")

FMTS = list(R.FORMATS)
MX_FMTS = [f for f in FMTS if R.FORMATS[f][0] == "mx"]
F32 = np.float32
FEW = settings(max_examples=15, deadline=None)
# Below this NVFP4 tensor amax, 1 / tensor_scale overflows float32 (tensor_scale < 2^-128).
NVFP4_TINY = 2688 * 2.0 ** -128


# -- comparing -------------------------------------------------------------------------

def _np(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().float().numpy()
    return np.asarray(t, dtype=F32)


def assert_bits(actual, expected, x, what: str, signed_zero: bool = True) -> None:
    """Equal float32 bit patterns (any NaN matches any NaN); the first difference is
    reported with its input."""
    a, e = _np(actual), _np(expected)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    differ = a.view(np.int32) != e.view(np.int32) if signed_zero else a != e
    bad = (nan_a != nan_e) | (~nan_a & ~nan_e & differ)
    if bad.any():
        i = int(np.flatnonzero(bad.ravel())[0])
        xi = float(_np(x).ravel()[i])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at flat index {i}:"
            f" x={xi!r} ({xi.hex()}), got {float(a.ravel()[i])!r}, expected"
            f" {float(e.ravel()[i])!r}")


def zero_sign_matters(x: np.ndarray, fmt: str) -> bool:
    """False for an all-zero NVFP4 tensor: its result is defined as "zeros", either sign."""
    return not (R.FORMATS[fmt][0] == "nvfp4" and np.abs(x).max() == 0)


def t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=F32, copy=True))


def block_of(fmt: str) -> int:
    return R.FORMATS[fmt][2]


# -- inputs ----------------------------------------------------------------------------

def _f32(v) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=np.float64).astype(F32)


def _ulps(v: np.ndarray) -> np.ndarray:
    """``v`` and its float32 neighbours on both sides."""
    v = _f32(v)
    return np.concatenate([v, np.nextafter(v, F32(np.inf)), np.nextafter(v, F32(-np.inf))])


def _chunk(values: np.ndarray, leader: float, block: int) -> np.ndarray:
    """Blocks of ``block``: ``leader`` first, then ``block - 1`` of ``values`` (zero-padded)."""
    per = block - 1
    n = -(-len(values) // per)
    body = np.zeros(n * per, F32)
    body[:len(values)] = values
    return np.concatenate([np.full((n, 1), leader, F32), body.reshape(n, per)], axis=1)


def mx_ties(fmt: str, s: int) -> np.ndarray:
    """Blocks whose scale is exactly ``2^s`` (each led by ``max * 2^s``), holding every grid
    point, every midpoint, values between the element max and ``2^(emax+1)`` (saturation),
    each one ulp either side too, both signs."""
    e = R.element_of(fmt)
    g = e.grid
    mids = (g[:-1] + g[1:]) / 2
    above = [e.max + (g[-1] - g[-2]) / 2, e.max * 1.0625, 2.0 ** (e.emax + 1) * (1 - 2 ** -24)]
    vals = _ulps(np.concatenate([g, mids, above]) * 2.0 ** s)
    vals = vals[np.abs(vals.astype(np.float64)) < 2.0 ** (e.emax + 1 + s)]  # keep e == s
    vals = np.concatenate([vals, -vals])
    return _chunk(vals, F32(e.max * 2.0 ** s), block_of(fmt))


def nvfp4_ties() -> np.ndarray:
    """Tensor scale exactly 1 (amax 2688); blocks with E4M3 scale 2^k holding the FP4
    midpoints times 2^k (and neighbours); blocks whose amax / 6 is an E4M3 midpoint (scale
    ties, saturation of the elements above the rounded-down scale); tiny blocks (scale
    clamped at 2^-6)."""
    fp4, e4 = R.ELEMENTS["fp4_e2m1"].grid, R.ELEMENTS["fp8_e4m3"].grid
    rows = [np.array([[2688.0] + [0.0] * 15], F32)]
    mids = np.concatenate([fp4, (fp4[:-1] + fp4[1:]) / 2, [7.0]])
    for k in range(-6, 9):
        v = _ulps(mids * 2.0 ** k)
        rows.append(_chunk(np.concatenate([v, -v]), F32(6 * 2.0 ** k), 16))
    e4_mids = (e4[:-1] + e4[1:]) / 2
    e4_mids = e4_mids[(e4_mids > 2.0 ** -6) & (e4_mids < 448)]
    for lead in _ulps(6 * e4_mids):
        frac = np.array([1, -1, 0.97, -0.93, 0.5, 0.26, -0.74, 0.083, 1 / 3, 0.6, -0.99,
                         0.875, -0.0625, 0.0, -0.0], np.float64)
        rows.append(np.concatenate([[lead], _f32(frac * np.float64(lead))])[None].astype(F32))
    for lead in (6 * 2.0 ** -7, 6 * 2.0 ** -12, 1e-6):
        rows.append(_chunk(_f32(np.linspace(-lead, lead, 15)), F32(lead), 16))
    return np.concatenate(rows)


def nf4_ties(block: int = 64) -> tuple[np.ndarray, int]:
    """Blocks of absmax 1 holding the float32 values a few ulps around each midpoint of two
    adjacent levels; returns (blocks, how many values are exact float32 ties)."""
    lv = R.NF4_LEVELS.astype(np.float64)
    v = _f32((lv[:-1] + lv[1:]) / 2)
    near, up, down = [v], v, v
    for _ in range(4):
        up, down = np.nextafter(up, F32(np.inf)), np.nextafter(down, F32(-np.inf))
        near += [up, down]
    vals = np.unique(np.concatenate(near))
    d = np.abs(vals[:, None] - R.NF4_LEVELS[None, :])
    dmin = d.min(axis=1, keepdims=True)
    ties = int(((d == dmin).sum(axis=1) > 1).sum())
    blocks = _chunk(np.concatenate([vals, -vals]), F32(1.0), block)
    # a second set with absmax 3 (the division is inexact there)
    blocks3 = _chunk(_f32(np.concatenate([vals, -vals]) * 3.0), F32(-3.0), block)
    return np.concatenate([blocks, blocks3]), ties


def special_rows(fmt: str) -> np.ndarray:
    """Finite corner cases, one block each: all +0, all -0, signed zeros beside values,
    fp32 subnormals only, subnormals beside the smallest normal, near fp32's maximum, the
    largest scale exponents, values that round to +-0."""
    b = block_of(fmt)
    tiny = np.float64(2.0 ** -149)
    fmax = float(np.finfo(F32).max)

    def row(vals) -> np.ndarray:
        return np.resize(_f32(vals), b)

    return np.stack([
        row([0.0]),
        row([-0.0]),
        row([0.0, -0.0, 1.0, -0.0, -1e-30, 1e-30, -3.0, 0.0]),
        row([tiny, -tiny, 3 * tiny, -7 * tiny, 2.0 ** -127, -(2.0 ** -126 - tiny), 0.0, -0.0]),
        row([2.0 ** -126, -tiny, 5 * tiny, 2.0 ** -130, -(2.0 ** -140), 0.0]),
        row([fmax, -fmax, 1e38, -3e38, 1.0, -2.0, 2.0 ** 127, 0.0]),
        row([-fmax, 2.0 ** 120, -(2.0 ** 100), 2.0 ** 125 * 1.75]),
        row([1.0, -2.0 ** -30, 2.0 ** -30, -1e-20, 0.5, -0.75]),
    ])


def special_cases(fmt: str) -> list[tuple[str, np.ndarray]]:
    """(name, float32 tensor): the finite corner cases, the same with a NaN, an inf and a
    -inf block (for NVFP4 that taints the whole tensor), all-zero and all-subnormal
    tensors, and the ties."""
    rows = special_rows(fmt)
    b = block_of(fmt)
    cases = [("finite", rows), ("all zero", np.zeros((2, b), F32)),
             ("all -0", np.full((1, b), -0.0, F32))]
    if fmt != "nvfp4":  # NVFP4 tensors this small: test_nvfp4_tiny_tensor
        cases.append(("subnormal only", rows[3:4].copy()))
    for name, val in (("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)):
        r = rows.copy()
        r[2, 1] = val
        cases.append((name, r))
    kind = R.FORMATS[fmt][0]
    if kind == "mx":
        cases += [(f"ties 2^{s}", mx_ties(fmt, s)) for s in (0, 9, -100, -124, 110)]
    elif kind == "nvfp4":
        cases.append(("ties", nvfp4_ties()))
    else:
        cases.append(("ties", nf4_ties()[0]))
    return cases


@st.composite
def tensors(draw, fmt: str) -> tuple[np.ndarray, int]:
    """(float32 tensor [rows, blocks * block], block): arbitrary float32 values, normals
    spread over a few binades at any exponent, or values on / between grid points (ties),
    with a sprinkle of zeros, -0, NaN and inf."""
    kind, _, default = R.FORMATS[fmt]
    block = draw(st.sampled_from([2, 8, 64])) if kind == "nf4" else default
    rows, nblk = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    n = rows * nblk * block
    style = draw(st.sampled_from(["floats", "spread", "grid"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if style == "floats":
        pool = draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                             min_size=1, max_size=block))
        x = _f32(rng.choice(np.array(pool, np.float64), n))
    elif style == "spread":
        k = draw(st.integers(-149, 127))
        spread = draw(st.integers(0, 40))
        x = _f32(np.clip(rng.standard_normal(n) * 2.0 ** (k - rng.integers(0, spread + 1, n)),
                         -float(np.finfo(F32).max), float(np.finfo(F32).max)))
    else:
        k = draw(st.integers(-120, 100))
        if kind == "nf4":
            lv = R.NF4_LEVELS.astype(np.float64)
            pts = np.concatenate([lv, (lv[:-1] + lv[1:]) / 2])
        else:
            g = R.element_of(fmt).grid
            pts = np.concatenate([g, (g[:-1] + g[1:]) / 2])
        v = _f32(rng.choice(pts, n) * rng.choice([-1.0, 1.0], n) * 2.0 ** k)
        v = np.where(rng.random(n) < 0.3, np.nextafter(v, rng.choice([-np.inf, np.inf], n)
                                                       .astype(F32)), v)
        x = v.astype(F32)
        if kind != "nf4" and draw(st.booleans()):  # pin the block scale at 2^k
            x.reshape(-1, block)[:, 0] = F32(R.element_of(fmt).max * 2.0 ** k)
    specials = draw(st.lists(st.sampled_from([0.0, -0.0, np.nan, np.inf, -np.inf]),
                             max_size=3))
    for val in specials:
        x[rng.integers(0, n)] = val
    if kind == "nvfp4" and 0 < np.abs(x).max() < NVFP4_TINY:  # see test_nvfp4_tiny_tensor
        x[rng.integers(0, n)] = 1.0
    return x.reshape(rows, nblk * block), block


# -- fake_quant_eager against the reference ---------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
@FEW
@given(data=st.data())
def test_eager_matches_reference_generated(fmt: str, data) -> None:
    x, block = data.draw(tensors(fmt))
    assert_bits(bf.fake_quant_eager(t(x), fmt, block), R.reference(x, fmt, block), x, fmt,
                signed_zero=zero_sign_matters(x, fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_eager_matches_reference_corner_cases(fmt: str) -> None:
    for name, x in special_cases(fmt):
        ref = R.reference(x, fmt)
        signed = zero_sign_matters(x, fmt)
        out = bf.fake_quant_eager(t(x), fmt, block_of(fmt))
        assert_bits(out, ref, x, f"{fmt} {name}", signed_zero=signed)
        # the same through the public entry point (the C++ kernel where it is built)
        assert_bits(bf.fake_quantize_block(t(x), fmt, block_of(fmt)), ref, x,
                    f"{fmt} {name} fake_quantize_block", signed_zero=signed)


def test_corner_cases_hit_what_they_claim() -> None:
    """The tie constructions really produce ties and the scales they assume."""
    for fmt in MX_FMTS:
        for s in (0, 9, -100, -124, 110):
            x = mx_ties(fmt, s)
            e, bad = R.mx_exponents(x, fmt, 32)
            assert (e == s).all() and not bad.any(), (fmt, s)
    p = R.nvfp4_parts(nvfp4_ties())
    assert p["pts"] == 1.0
    assert set(2.0 ** np.arange(-6, 9)) <= set(p["s8"].tolist())
    assert (p["s8"] == 2.0 ** -6).sum() > 3  # clamped blocks
    _, ties = nf4_ties()
    assert ties > 0


@pytest.mark.parametrize("fmt", MX_FMTS)
def test_mx_special_blocks(fmt: str) -> None:
    """A NaN or inf poisons its own block only; the other blocks keep their values."""
    x = special_rows(fmt)
    x[5, 3] = np.inf
    x[2, 0] = np.nan
    out = bf.fake_quant_eager(t(x), fmt, 32).numpy()
    assert np.isnan(out[[2, 5]]).all()
    keep = [i for i in range(len(x)) if i not in (2, 5)]
    assert not np.isnan(out[keep]).any()
    assert_bits(out[keep], bf.fake_quant_eager(t(x[keep]), fmt, 32), x[keep], fmt)


def test_nvfp4_nonfinite_taints_tensor() -> None:
    """NVFP4's tensor scale sees every block: a NaN or an inf anywhere makes it all NaN."""
    for val in (np.nan, np.inf):
        x = np.ones((2, 32), F32)
        x[1, 17] = val
        assert np.isnan(bf.fake_quant_eager(t(x), "nvfp4", 16).numpy()).all()


@pytest.mark.parametrize("amax", [9.36e-43, 1e-38, 2.0 ** -117])
def test_nvfp4_tiny_tensor(amax: float) -> None:
    """Eager, reference and the stored codes agree on tensors too small for 1 / scale:
    zeros (FP4 codes cannot hold the NaN the plain formula would give)."""
    x = np.zeros((1, 32), F32)
    x[0, :4] = [amax, -amax / 3, amax / 7, -0.0]
    assert amax < NVFP4_TINY
    xt = t(x)
    eager = bf.fake_quant_eager(xt, "nvfp4", 16)
    # zeros, of either sign
    assert_bits(bf.dequantize_blocks(bf.quantize_blocks(xt, "nvfp4", 16)), eager, x,
                "nvfp4 tiny round trip", signed_zero=False)
    assert_bits(eager, R.reference(x, "nvfp4"), x, "nvfp4 tiny vs reference",
                signed_zero=False)
    assert not eager.any()


def test_eager_non_contiguous_and_bf16() -> None:
    """Blocks are consecutive elements of the logical tensor; bf16 is computed in float32
    and cast back."""
    rng = np.random.default_rng(0)
    base = _f32(rng.standard_normal((64, 64)) * 3)
    for fmt in FMTS:
        xt = t(base).t()  # not contiguous
        ref = R.reference(np.ascontiguousarray(base.T), fmt)
        assert_bits(bf.fake_quant_eager(xt, fmt, block_of(fmt)), ref, base.T, fmt)
        xb = t(base).to(torch.bfloat16)
        out = bf.fake_quant_eager(xb, fmt, block_of(fmt))
        assert out.dtype == torch.bfloat16
        ref_b = torch.from_numpy(R.reference(xb.float().numpy(), fmt)).to(torch.bfloat16)
        assert_bits(out, ref_b, xb.float(), f"{fmt} bf16")


# -- codes and scales -------------------------------------------------------------------

def check_codes(x: np.ndarray, fmt: str, block: int) -> None:
    """quantize_blocks -> dequantize_blocks is fake_quant_eager exactly; the codes are the
    reference's bit patterns (decoded with the reference decoder they give the values back);
    the scales have the documented dtype and values."""
    kind = R.FORMATS[fmt][0]
    xt = t(x)
    c = bf.quantize_blocks(xt, fmt, block)
    fq = bf.fake_quant_eager(xt, fmt, block)
    assert c.codes.dtype == torch.uint8 and tuple(c.shape) == x.shape
    assert_bits(bf.dequantize_blocks(c), fq, x, f"{fmt} round trip",
                signed_zero=zero_sign_matters(x, fmt))
    assert bf.dequantize_blocks(c, torch.bfloat16).dtype == torch.bfloat16
    codes = c.codes.numpy().astype(np.int64).reshape(-1, block)
    xb = x.reshape(-1, block)
    fqb = fq.numpy().reshape(-1, block)
    if kind == "mx":
        ref_codes, ref_scales = R.mx_codes(x, fmt, block)
        assert c.scales.dtype == torch.uint8 and c.tensor_scale is None
        np.testing.assert_array_equal(c.scales.numpy(), ref_scales, err_msg=fmt)
        good = ref_scales != 255
        np.testing.assert_array_equal(codes[good], ref_codes.reshape(-1, block)[good],
                                      err_msg=fmt)
        e = R.element_of(fmt)
        assert (codes < (1 << e.bits)).all()
        vals = R.decode_codes(codes[good], e.name) * np.ldexp(1.0, ref_scales[good] - 127)[:, None]
        assert_bits(_f32(vals), fqb[good], xb[good], f"{fmt} decoded codes")
    elif kind == "nvfp4":
        assert c.scales.dtype == torch.float8_e4m3fn
        assert c.tensor_scale is not None and c.tensor_scale.dtype == torch.float32
        assert c.tensor_scale.dim() == 0
        p = R.nvfp4_parts(x, block)
        assert_bits(c.tensor_scale, p["pts"], np.float32(0), "nvfp4 tensor scale")
        if not (np.isfinite(p["tensor_amax"]) and p["tensor_amax"] > 0):
            return
        assert_bits(c.scales.float(), p["s8"], xb.max(axis=1), "nvfp4 block scales")
        ref_codes = R.element_codes(p["scaled"], "fp4_e2m1")
        np.testing.assert_array_equal(codes, ref_codes, err_msg=fmt)
        vals = R.decode_codes(codes, "fp4_e2m1").astype(F32) * p["dq_scale"][:, None]
        assert_bits(vals, fqb, xb, "nvfp4 decoded codes")
    else:
        idx, absmax = R.nf4_parts(x, block)
        assert c.scales.dtype == torch.float32 and c.tensor_scale is None
        assert_bits(c.scales, absmax, absmax, "nf4 absmax")
        assert (codes < 16).all()
        good = np.isfinite(absmax) & (absmax > 0)
        np.testing.assert_array_equal(codes[good], idx[good], err_msg=fmt)
        assert_bits(R.NF4_LEVELS[codes[good]] * absmax[good, None], fqb[good], xb[good],
                    "nf4 decoded codes")


@pytest.mark.parametrize("fmt", FMTS)
def test_codes_round_trip_corner_cases(fmt: str) -> None:
    for _, x in special_cases(fmt):
        check_codes(x, fmt, block_of(fmt))


@pytest.mark.parametrize("fmt", FMTS)
@FEW
@given(data=st.data())
def test_codes_round_trip_generated(fmt: str, data) -> None:
    x, block = data.draw(tensors(fmt))
    check_codes(x, fmt, block)


@pytest.mark.parametrize("fmt", bf.GGML_FORMATS)
def test_llama_cpp_grids_are_stored_by_ggml_bytes_not_quantize_blocks(fmt: str) -> None:
    with pytest.raises(ValueError, match=rf"{fmt} is one of llama.cpp's grids.*ggml_bytes"):
        bf.quantize_blocks(torch.randn(2, 256), fmt)


# -- BlockGrid ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
def test_block_grid_matches_eager(fmt: str) -> None:
    """block_scales(x).fake_quant(x) == fake_quant_eager(x); one column at a time with the
    grid fixed gives the same columns (how GPTQ uses it)."""
    rng = np.random.default_rng(1)
    b = block_of(fmt)
    cases = [x for _, x in special_cases(fmt)[:2]]
    cases.append(_f32(rng.standard_normal((4, 2 * b)) * 2.0 ** rng.integers(-20, 20, (4, 1))))
    for x in cases:
        xb = t(x).reshape(-1, b)
        full = bf.fake_quant_eager(t(x), fmt, b).reshape(-1, b)
        grid = bf.block_scales(xb, fmt)
        assert_bits(grid.fake_quant(xb), full, xb, f"{fmt} BlockGrid")
        for j in (0, b // 2, b - 1):
            assert_bits(grid.fake_quant(xb[:, j:j + 1]), full[:, j:j + 1], xb[:, j:j + 1],
                        f"{fmt} BlockGrid column {j}")
        if fmt == "nvfp4":
            g2 = bf.block_scales(xb, fmt, tensor_scale=bf.nvfp4_tensor_scale(t(x)))
            assert_bits(g2.fake_quant(xb), full, xb, "nvfp4 BlockGrid with tensor scale")


# -- autograd ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
def test_fake_quantize_block_straight_through(fmt: str) -> None:
    g = torch.Generator().manual_seed(2)
    b = block_of(fmt)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 2 * b, generator=g) * 4).to(dtype).requires_grad_(True)
        y = bf.fake_quantize_block(x, fmt, b)
        assert y.dtype == dtype and y.requires_grad
        grad = torch.randn(3, 2 * b, generator=g).to(dtype)
        y.backward(grad)
        assert torch.equal(x.grad, grad)
        ref = torch.from_numpy(R.reference(x.detach().float().numpy(), fmt)).to(dtype)
        assert_bits(y, ref, x, f"{fmt} {dtype}")


# -- torchao ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torchao_mx():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats import kernels, mx_tensor, nvfp4_tensor
    return mx_tensor, nvfp4_tensor, kernels


def _torchao_cases(fmt: str) -> list[np.ndarray]:
    """Finite blocks with amax >= 2^(emax - 126) (where torchao's max(X, 2^-126) is X)."""
    rng = np.random.default_rng(3)
    b = block_of(fmt)
    out = [_f32(rng.standard_normal((6, 2 * b)) * 2.0 ** rng.integers(-100, 100, (6, 1)))]
    if R.FORMATS[fmt][0] == "mx":
        out += [mx_ties(fmt, s) for s in (0, -110, 100)]
        r = special_rows(fmt)
        amax = np.abs(r).max(axis=1)
        out.append(r[amax >= 2.0 ** (R.element_of(fmt).emax - 126)])
    elif fmt == "nvfp4":
        out.append(nvfp4_ties())
    return out


@pytest.mark.parametrize("fmt", MX_FMTS)
def test_mx_matches_torchao(fmt: str, torchao_mx) -> None:
    mx_tensor, _, kernels = torchao_mx
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    elem = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2,
            "mxfp6_e3m2": "fp6_e3m2", "mxfp6_e2m3": "fp6_e2m3",
            "mxfp4": torch.float4_e2m1fn_x2}[fmt]
    for x in _torchao_cases(fmt):
        xt = t(x)
        scale, data = mx_tensor.to_mx(xt, elem, 32, ScaleCalculationMode.FLOOR)
        deq = mx_tensor.to_dtype(data, scale, elem, 32, torch.float32)
        assert_bits(bf.fake_quant_eager(xt, fmt, 32), deq, x, f"{fmt} vs torchao")
        c = bf.quantize_blocks(xt, fmt, 32)
        np.testing.assert_array_equal(c.scales.numpy(), scale.view(torch.uint8).reshape(-1))
        if fmt == "mxfp4":
            codes = kernels.unpack_uint4(data.view(torch.uint8))
        else:
            codes = data.view(torch.uint8)
        np.testing.assert_array_equal(c.codes.numpy(), codes.reshape(x.shape).numpy())


def test_nvfp4_matches_torchao(torchao_mx) -> None:
    _, nvfp4_tensor, kernels = torchao_mx
    for x in _torchao_cases("nvfp4"):
        xt = t(x)
        pts = nvfp4_tensor.per_tensor_amax_to_scale(xt.abs().amax())
        q = nvfp4_tensor.NVFP4Tensor.to_nvfp4(xt, 16, per_tensor_scale=pts)
        assert_bits(bf.fake_quant_eager(xt, "nvfp4", 16), q.dequantize(torch.float32), x,
                    "nvfp4 vs torchao")
        c = bf.quantize_blocks(xt, "nvfp4", 16)
        assert_bits(c.tensor_scale, pts, np.float32(0), "nvfp4 tensor scale vs torchao")
        np.testing.assert_array_equal(c.scales.view(torch.uint8).numpy(),
                                      q.scale.view(torch.uint8).reshape(-1).numpy())
        codes = kernels.unpack_uint4(q.qdata.view(torch.uint8))
        np.testing.assert_array_equal(c.codes.numpy(), codes.reshape(x.shape).numpy())
    for val in (np.nan, np.inf, -np.inf):  # torchao: NaN everywhere too
        x = np.ones((2, 32), F32)
        x[1, 17] = val
        pts = nvfp4_tensor.per_tensor_amax_to_scale(t(x).abs().amax())
        q = nvfp4_tensor.NVFP4Tensor.to_nvfp4(t(x), 16, per_tensor_scale=pts)
        assert_bits(bf.fake_quant_eager(t(x), "nvfp4", 16), q.dequantize(torch.float32), x,
                    f"nvfp4 {val} vs torchao")


def test_nf4_matches_torchao_levels(torchao_mx) -> None:
    """torchao's nearest-level choice (its ``quantize_tensor_nearest``, given the float32
    levels: torchao's own table is rounded to four decimals) on x / absmax."""
    pytest.importorskip("torchao")
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
        NF4Tensor,
        get_block_absmax,
    )

    levels = torch.tensor(R.NF4_LEVELS)
    rng = np.random.default_rng(4)
    for x in (_f32(rng.standard_normal((4, 128)) * 2.0 ** rng.integers(-60, 60, (4, 1))),
              nf4_ties()[0]):
        xt = t(x)
        absmax = get_block_absmax(xt.flatten(), 64)
        c = bf.quantize_blocks(xt, "nf4", 64)
        assert_bits(c.scales, absmax, absmax, "nf4 absmax vs torchao")
        v = (xt.reshape(-1, 64) / absmax[:, None]).flatten()
        idx = NF4Tensor.quantize_tensor_nearest(v, levels).reshape(x.shape)
        np.testing.assert_array_equal(c.codes.numpy(), idx.numpy())
        out = (levels[idx.reshape(-1, 64)] * absmax[:, None]).reshape(x.shape)
        assert_bits(bf.fake_quant_eager(xt, "nf4", 64), out, x, "nf4 vs torchao")
