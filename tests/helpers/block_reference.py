"""An independent numpy reference of the block-scaled formats (MX, NVFP4, NF4).

Nothing here shares code with ``qcompile.runtime.block_formats``: the element grids come
from decoding every code of each element format from its bits (OCP 8-bit floating point
and OCP MX v1.0 element encodings: exponent field 0 holds the subnormals; ``e4m3fn`` has no
infinity and its code ``S.1111.111`` is NaN, so its largest finite value is 448; ``e5m2``
is IEEE-like, exponent field 31 holds inf and NaN; the fp6 and fp4 formats have no special
values), and a value is rounded to the nearest grid point, a tie going to the point whose
code is even (mantissa bit 0), a value beyond the largest finite point saturating to it.

The block math follows the definitions: MX (E8M0 scale ``2^(floor_log2(amax) - emax)``,
``floor_log2`` read from the float32 exponent field, a block with NaN or inf all NaN),
NVFP4 (a float32 tensor scale ``amax / 2688`` and float8 e4m3 block scales, every step a
float32 operation in the documented order) and NF4 (the sixteen QLoRA levels, fp32 absmax
per block, the first nearest level). Float32 arithmetic is numpy's (IEEE, correctly
rounded); the products of float32 values by powers of two run in float64, where they are
exact, and come back to float32 once.

Example:
    >>> import numpy as np
    >>> ELEMENTS["fp4_e2m1"].grid.tolist()
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    >>> fake_quant(np.array([0.25, 0.75, 2.5, 5.0, 7.0], np.float32), "fp4_e2m1").tolist()
    [0.0, 1.0, 2.0, 4.0, 6.0]
    >>> x = np.array([448.0, 17.0] + [0.0] * 30, np.float32)       # e = 0: the fp8 grid
    >>> mx_fake_quant(x, "mxfp8_e4m3", 32)[:2].tolist()
    [448.0, 16.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The QLoRA / bitsandbytes NF4 levels, as float32.
NF4_LEVELS = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)


@dataclass(frozen=True)
class Element:
    """One element format: ``grid`` the non-negative finite values (ascending, float64),
    ``grid_codes`` their codes (sign bit clear), ``max``, ``emax`` (exponent of the
    largest power of two at most ``max``), ``emin`` (the smallest normal exponent)."""

    name: str
    ebits: int
    mbits: int
    special: str  # "none" (fp6, fp4), "fn" (e4m3fn: one NaN code), "ieee" (e5m2)
    grid: np.ndarray
    grid_codes: np.ndarray

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def max(self) -> float:
        return float(self.grid[-1])

    @property
    def emax(self) -> int:
        return int(np.floor(np.log2(self.max)))

    @property
    def emin(self) -> int:
        return 2 - 2 ** (self.ebits - 1)


def decode(code: int, ebits: int, mbits: int, special: str) -> float:
    """The value of one element code (sign, exponent field, mantissa field)."""
    sign = -1.0 if (code >> (ebits + mbits)) & 1 else 1.0
    exp = (code >> mbits) & ((1 << ebits) - 1)
    man = code & ((1 << mbits) - 1)
    top = (1 << ebits) - 1
    if special == "fn" and exp == top and man == (1 << mbits) - 1:
        return float("nan")
    if special == "ieee" and exp == top:
        return sign * float("inf") if man == 0 else float("nan")
    bias = (1 << (ebits - 1)) - 1
    if exp == 0:  # subnormal: 0.m * 2^(1 - bias)
        return sign * man / (1 << mbits) * 2.0 ** (1 - bias)
    return sign * (1 + man / (1 << mbits)) * 2.0 ** (exp - bias)


def _element(name: str, ebits: int, mbits: int, special: str) -> Element:
    codes = np.arange(1 << (ebits + mbits))  # sign bit clear: the magnitudes
    values = np.array([decode(int(c), ebits, mbits, special) for c in codes])
    finite = np.isfinite(values)
    order = np.argsort(values[finite], kind="stable")
    grid, grid_codes = values[finite][order], codes[finite][order]
    assert np.all(np.diff(grid) > 0), name  # one code per magnitude
    return Element(name, ebits, mbits, special, grid, grid_codes.astype(np.int64))


ELEMENTS: dict[str, Element] = {
    e.name: e for e in (
        _element("fp8_e4m3", 4, 3, "fn"),
        _element("fp8_e5m2", 5, 2, "ieee"),
        _element("fp6_e3m2", 3, 2, "none"),
        _element("fp6_e2m3", 2, 3, "none"),
        _element("fp4_e2m1", 2, 1, "none"),
    )
}

# format name -> (kind, element format, default block)
FORMATS: dict[str, tuple[str, str | None, int]] = {
    "mxfp8_e4m3": ("mx", "fp8_e4m3", 32),
    "mxfp8_e5m2": ("mx", "fp8_e5m2", 32),
    "mxfp6_e3m2": ("mx", "fp6_e3m2", 32),
    "mxfp6_e2m3": ("mx", "fp6_e2m3", 32),
    "mxfp4": ("mx", "fp4_e2m1", 32),
    "nvfp4": ("nvfp4", "fp4_e2m1", 16),
    "nf4": ("nf4", None, 64),
}


def element_of(fmt: str) -> Element:
    """The element format of a block format (MX and NVFP4)."""
    elem = FORMATS[fmt][1]
    assert elem is not None, fmt
    return ELEMENTS[elem]


def round_codes(a: np.ndarray, elem: str) -> tuple[np.ndarray, np.ndarray]:
    """(grid value, magnitude code) of non-negative ``a`` (any float dtype, no NaN):
    nearest grid point, ties to the even code, saturating at the largest finite value."""
    e = ELEMENTS[elem]
    a = np.asarray(a, dtype=np.float64)  # float32 inputs are exact in float64
    i = np.clip(np.searchsorted(e.grid, a, side="right") - 1, 0, len(e.grid) - 1)
    j = np.minimum(i + 1, len(e.grid) - 1)
    lo, hi = e.grid[i], e.grid[j]
    mid = (lo + hi) / 2  # exact in float64 (grid values have few bits)
    up = (a > mid) | ((a == mid) & (e.grid_codes[i] % 2 == 1))
    k = np.where(up & (j > i), j, i)
    k = np.where(a >= e.max, len(e.grid) - 1, k)  # saturate
    return e.grid[k], e.grid_codes[k]


def fake_quant(v: np.ndarray, elem: str) -> np.ndarray:
    """Round float values to the element grid (sign kept, -0 stays -0, NaN stays NaN)."""
    v = np.asarray(v)
    nan = np.isnan(v)
    q, _ = round_codes(np.where(nan, 0, np.abs(v)), elem)
    out = np.copysign(q, v)
    return np.where(nan, np.nan, out).astype(v.dtype)


def element_codes(v: np.ndarray, elem: str) -> np.ndarray:
    """The full element codes (sign bit included) of already-scaled finite values."""
    e = ELEMENTS[elem]
    v = np.asarray(v)
    _, mag = round_codes(np.abs(v), elem)
    return (np.signbit(v).astype(np.int64) << (e.ebits + e.mbits)) | mag


def decode_codes(codes: np.ndarray, elem: str) -> np.ndarray:
    """Element codes -> float64 values (via the decoder, not the grid)."""
    e = ELEMENTS[elem]
    table = np.array([decode(c, e.ebits, e.mbits, e.special) for c in range(1 << e.bits)])
    return table[np.asarray(codes, dtype=np.int64)]


def floor_log2(a: np.ndarray) -> np.ndarray:
    """The unbiased exponent field of float32 ``a`` (0 and subnormals give -127)."""
    bits = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.int64)
    return ((bits >> 23) & 0xFF) - 127


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.size % block == 0, (x.shape, block)
    return x.reshape(-1, block)


# -- MX --------------------------------------------------------------------------------

def mx_exponents(x: np.ndarray, fmt: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(unbiased scale exponent e per block, bad-block mask: a NaN or inf inside)."""
    xb = _blocks(x, block)
    bad = ~np.isfinite(xb).all(axis=1)
    amax = np.abs(np.where(bad[:, None], 0, xb)).max(axis=1)
    e = np.clip(floor_log2(amax) - element_of(fmt).emax, -127, 127)
    return e, bad


def mx_fake_quant(x: np.ndarray, fmt: str, block: int) -> np.ndarray:
    """MX fake quantization (float32 in, float32 out, same shape)."""
    elem = element_of(fmt).name
    xb = _blocks(x, block)
    e, bad = mx_exponents(x, fmt, block)
    pow2 = np.ldexp(1.0, e)[:, None]  # float64, exact (2^-127 .. 2^127)
    scaled = np.where(bad[:, None], 0, xb).astype(np.float64) / pow2  # exact
    q = fake_quant(scaled, elem) * pow2  # exact in float64
    out = np.where(bad[:, None], np.nan, q).astype(np.float32)
    return out.reshape(np.shape(x))


def mx_codes(x: np.ndarray, fmt: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(element codes per element, E8M0 scale bytes per block; 255 for bad blocks)."""
    elem = element_of(fmt).name
    xb = _blocks(x, block)
    e, bad = mx_exponents(x, fmt, block)
    scaled = np.where(bad[:, None], 0, xb).astype(np.float64) / np.ldexp(1.0, e)[:, None]
    codes = element_codes(scaled, elem)
    return codes.reshape(np.shape(x)), np.where(bad, 255, e + 127)


# -- NVFP4 -----------------------------------------------------------------------------

F32 = np.float32


def nvfp4_parts(x: np.ndarray, block: int = 16) -> dict[str, np.ndarray]:
    """Every intermediate of the NVFP4 definition, in float32: ``pts`` (0-d), per block
    ``s8`` (the e4m3 block scale), ``recip``, ``dq_scale`` (pts * s8); per element the
    clamped scaled value ``scaled`` and the fp4 ``codes`` (finite inputs only)."""
    xb = _blocks(x, block)
    with np.errstate(all="ignore"):
        absx = np.abs(xb)
        tensor_amax = absx.max() if absx.size else F32(0)  # NaN propagates
        pts = F32(tensor_amax) / F32(2688.0)
        bs = absx.max(axis=1) / F32(6.0)
        r = np.clip(bs / pts, F32(2.0 ** -6), F32(448.0))  # NaN stays NaN
        s8 = fake_quant(r.astype(F32), "fp8_e4m3")
        recip = (F32(1.0) / pts) / s8
        scaled = np.clip(xb * recip[:, None], F32(-6.0), F32(6.0))
        dq_scale = pts * s8
    return {"tensor_amax": F32(tensor_amax), "pts": F32(pts), "s8": s8.astype(F32),
            "recip": recip.astype(F32), "dq_scale": dq_scale.astype(F32),
            "scaled": scaled.astype(F32)}


def nvfp4_fake_quant(x: np.ndarray, block: int = 16) -> np.ndarray:
    """NVFP4 fake quantization (a whole-tensor amax of 0, or one so small that 1 / tensor
    scale overflows float32, gives +0 everywhere)."""
    p = nvfp4_parts(x, block)
    with np.errstate(all="ignore"):
        overflow = bool(np.isinf(F32(1.0) / p["pts"]))
    if p["tensor_amax"] == 0 or overflow:
        return np.zeros(np.shape(x), np.float32)
    with np.errstate(all="ignore"):
        q = fake_quant(p["scaled"], "fp4_e2m1")
        out = q * p["dq_scale"][:, None]
    return out.astype(F32).reshape(np.shape(x))


# -- NF4 -------------------------------------------------------------------------------

def nf4_parts(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(level index per element [N, block], fp32 absmax per block): the first level at the
    smallest fp32 ``|x / absmax - level|``. Indices of zero or non-finite blocks are
    meaningless (those blocks are all 0 or all NaN)."""
    xb = _blocks(x, block)
    with np.errstate(all="ignore"):
        absmax = np.abs(xb).max(axis=1)
        safe = np.where(np.isfinite(absmax) & (absmax > 0), absmax, F32(1.0))
        v = np.where(np.isfinite(xb), xb, F32(0.0)) / safe[:, None]
        diff = np.abs(v[..., None] - NF4_LEVELS)  # float32 subtraction and abs
    return np.argmin(diff, axis=-1), absmax.astype(F32)  # argmin: first minimum


def nf4_fake_quant(x: np.ndarray, block: int) -> np.ndarray:
    """NF4 fake quantization: level * absmax; 0 where absmax is 0, NaN where it is not
    finite."""
    idx, absmax = nf4_parts(x, block)
    with np.errstate(all="ignore"):
        out = NF4_LEVELS[idx] * absmax[:, None]
    out = np.where((absmax == 0)[:, None], F32(0.0), out)
    out = np.where(~np.isfinite(absmax)[:, None], F32(np.nan), out)
    return out.astype(F32).reshape(np.shape(x))


def reference(x: np.ndarray, fmt: str, block: int | None = None) -> np.ndarray:
    """Fake-quantize float32 ``x`` in ``fmt`` (any name of ``FORMATS``)."""
    kind, _, default = FORMATS[fmt]
    block = block or default
    if kind == "mx":
        return mx_fake_quant(x, fmt, block)
    if kind == "nvfp4":
        return nvfp4_fake_quant(x, block)
    return nf4_fake_quant(x, block)
