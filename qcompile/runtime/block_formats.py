"""Block-scaled number formats: OCP Microscaling (MXFP8 / MXFP6 / MXFP4), NVIDIA's NVFP4 and
QLoRA's NF4, as fake-quant (the eager formula, the reference every kernel matches bit for
bit), as codes and scales (what ``qc.convert`` stores), and per-block grids (for GPTQ).

A block is ``block`` consecutive elements of the contiguous tensor (``x.reshape(-1, block)``):
along each row of a weight ``[out, in]`` (the reduction dim), along the last dim of an
activation. All arithmetic is float32 (bf16 / fp16 inputs are upcast; the result is cast
back). The gradient is straight-through: the scales come from the data, nothing clips.

- **MX** (OCP MX v1.0, ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e3m2``, ``mxfp6_e2m3``,
  ``mxfp4``; 32-element blocks): the shared scale is ``X = 2^e`` with
  ``e = floor(log2(amax)) - emax_elem`` (the exponent of the block's largest magnitude,
  read from its float32 bits, minus that of the element format's largest power of two),
  clamped to the E8M0 range [-127, 127]; elements ``x / X`` round to nearest-even on the
  element grid and saturate at its largest finite value. A block holding NaN or inf is NaN
  (E8M0's NaN scale). torchao's FLOOR mode computes the same, except that it divides by
  ``max(X, 2^-126)`` and maps inf to a finite value.
- **NVFP4** (16-element blocks): one float32 tensor scale ``amax / (448 * 6)``; per block an
  FP8 E4M3 scale ``e4m3(clamp(block_amax / 6 / tensor_scale, 2^-6, 448))``; elements FP4 E2M1
  of ``x * ((1 / tensor_scale) / s8)``; dequantized as ``q * (tensor_scale * s8)`` (torchao's
  ``nvfp4_quantize`` and ``NVFP4Tensor`` order of operations). An all-zero tensor gives
  zeros, and so does one whose largest magnitude is below ``2688 * 2^-128`` (where
  ``1 / tensor_scale`` overflows float32).
- **NF4** (QLoRA; 64-element blocks by default, any even size): ``x / absmax`` goes to the
  nearest of 16 normal-float levels (the first on a tie), times ``absmax`` (float32, no double
  quantization). An all-zero block gives zeros; a block with NaN or inf is NaN.
- **llama.cpp's grids** (``q8_0``, ``q4_0``, ``q4_1``: blocks of 32; ``q4_k``, ``q6_k``:
  super-blocks of 256; ``q8_k``: the activation blocks of its CPU matmul for K-type
  weights): the value llama.cpp dequantizes the stored block to, fp16 scale rounding
  included (``_ggml_grid``); ``ggml_bytes`` gives the bytes a GGUF file stores. A block
  with NaN or inf is NaN.

Example:
    >>> import torch
    >>> from qcompile.runtime.block_formats import fake_quant_eager, quantize_blocks
    >>> x = torch.tensor([[0.3, -1.7, 2.9, 6.5] * 8])
    >>> y = fake_quant_eager(x, "mxfp4", 32)   # amax 6.5: X = 2^(2 - 2) = 1
    >>> y[0, :4].tolist()
    [0.5, -1.5, 3.0, 6.0]
    >>> c = quantize_blocks(x, "mxfp4", 32)
    >>> int(c.scales[0]), c.codes.dtype        # E8M0 biased exponent 127 means 2^0
    (127, torch.uint8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from qcompile.runtime import kernels
from qcompile.runtime.quant_math import div_by

__all__ = [
    "BLOCK_DTYPES",
    "FORMATS",
    "GGML_FORMATS",
    "GGUF_WEIGHT_FORMATS",
    "NF4_LEVELS",
    "BlockCodes",
    "BlockFormat",
    "BlockGrid",
    "bits_per_element",
    "block_scales",
    "default_block",
    "dequantize_blocks",
    "fake_quant_eager",
    "fake_quantize_block",
    "ggml_bytes",
    "nvfp4_tensor_scale",
    "quantize_blocks",
]


@dataclass(frozen=True)
class BlockFormat:
    """One block-scaled format: its element format (``ebits`` exponent and ``mbits``
    mantissa bits, largest finite ``max``, ``emax`` the exponent of its largest power of
    two), its kind (``mx``, ``nvfp4`` or ``nf4``), default ``block`` size, and the bits of
    one element and of one block scale."""

    name: str
    kind: str
    ebits: int
    mbits: int
    max: float
    emax: int
    block: int
    scale_bits: int
    code_bits: int = 0  # llama.cpp's grids: bits of one stored code

    @property
    def bits(self) -> int:
        """Bits of one element (sign included)."""
        if self.code_bits:
            return self.code_bits
        return 4 if self.kind == "nf4" else 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """The element format's smallest normal exponent (``1 - bias``)."""
        return 1 - (2 ** (self.ebits - 1) - 1)


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("mxfp8_e4m3", "mx", 4, 3, 448.0, 8, 32, 8),
        BlockFormat("mxfp8_e5m2", "mx", 5, 2, 57344.0, 15, 32, 8),
        BlockFormat("mxfp6_e3m2", "mx", 3, 2, 28.0, 4, 32, 8),
        BlockFormat("mxfp6_e2m3", "mx", 2, 3, 7.5, 2, 32, 8),
        BlockFormat("mxfp4", "mx", 2, 1, 6.0, 2, 32, 8),
        BlockFormat("nvfp4", "nvfp4", 2, 1, 6.0, 2, 16, 8),
        BlockFormat("nf4", "nf4", 0, 0, 1.0, 0, 64, 32),
        # llama.cpp's grids (GGUF types): scale bits per block (super-block for the K types)
        BlockFormat("q8_0", "ggml", 0, 0, 127.0, 0, 32, 16, code_bits=8),
        BlockFormat("q4_0", "ggml", 0, 0, 8.0, 0, 32, 16, code_bits=4),
        BlockFormat("q4_1", "ggml", 0, 0, 15.0, 0, 32, 32, code_bits=4),
        BlockFormat("q4_k", "ggml_k", 0, 0, 15.0, 0, 256, 128, code_bits=4),
        BlockFormat("q6_k", "ggml_k", 0, 0, 32.0, 0, 256, 144, code_bits=6),
        # the activation blocks llama.cpp's CPU matmul makes for K-type weights (float32 d)
        BlockFormat("q8_k", "ggml_k", 0, 0, 127.0, 0, 256, 32, code_bits=8),
    )
}
#: llama.cpp's grids, by the name GGUF gives their type (``Q4_0`` ...)
GGML_FORMATS: tuple[str, ...] = tuple(n for n, f in FORMATS.items()
                                      if f.kind in ("ggml", "ggml_k"))
#: the grids a GGUF file stores weights in (Q8_K is llama.cpp's activation blocks only)
GGUF_WEIGHT_FORMATS: tuple[str, ...] = tuple(n for n in GGML_FORMATS if n != "q8_k")
BLOCK_DTYPES: tuple[str, ...] = tuple(FORMATS)

# QLoRA's NormalFloat4 levels (bitsandbytes' and torchao's table), as float32.
NF4_LEVELS: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)

_E4M3 = BlockFormat("fp8_e4m3", "scale", 4, 3, 448.0, 8, 1, 8)
_FP4 = FORMATS["nvfp4"]
_NVFP4_DENOM = 448.0 * 6.0
_E4M3_TINY = 2.0 ** -6  # torch.finfo(torch.float8_e4m3fn).tiny: the smallest normal scale


def default_block(name: str) -> int:
    """The block size a format implies (MX 32, NVFP4 16, NF4 64)."""
    return FORMATS[name].block


def bits_per_element(name: str, block: int | None = None) -> float:
    """Storage bits per element, block scales included (NVFP4's tensor scale left out).

    >>> bits_per_element("mxfp4"), bits_per_element("nvfp4"), bits_per_element("nf4")
    (4.25, 4.5, 4.5)
    """
    f = FORMATS[name]
    return f.bits + f.scale_bits / (block or f.block)


# -- element rounding --------------------------------------------------------------------
def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of non-negative float32 ``a`` from its exponent bits (int32): exact,
    -127 for 0 and fp32 subnormals, 128 for inf / NaN."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _exp2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer ``e`` (int32) in [-149, 127], exact: built from its bits
    (``pow`` / ``ldexp`` go through a vectorised ``pow`` that need not be exact)."""
    normal = ((torch.clamp(e, min=-126) + 127) << 23).view(torch.float32)
    subnormal = (1 << torch.clamp(e + 149, 0, 22)).view(torch.float32)
    # chosen as float32, not as int32 bits: Inductor's AVX2 code for an int32 torch.where
    # picked the wrong side (torch 2.13), so a compiled MX / NVFP4 fake-quant was wrong
    return torch.where(e >= -126, normal, subnormal)


def _round_element(v: torch.Tensor, f: BlockFormat) -> torch.Tensor:
    """``v`` (float32) rounded to nearest-even on ``f``'s element grid, saturating at
    ``f.max``; NaN stays NaN, the sign of zero is kept."""
    a = v.abs()
    e = torch.clamp(_floor_log2(a), min=f.emin) - f.mbits
    # a / step and q * step scale by powers of two: exact (the grid never reaches fp32's
    # subnormals: the smallest step is 2^-17, e4m3's)
    q = torch.round(a * _exp2(-e)) * _exp2(e)
    return torch.copysign(torch.clamp(q, max=f.max), v)


def _nf4_round(v: torch.Tensor) -> torch.Tensor:
    """The NF4 level index nearest to ``v`` (first on a tie), as torchao's NF4 picks it:
    argmin over ``|v - level|`` in float32."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=v.device)
    return (v.unsqueeze(-1) - levels).abs().argmin(dim=-1)


# -- the formats -----------------------------------------------------------------------
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.numel() % block:
        raise ValueError(f"a tensor of {x.numel()} elements does not split into blocks of "
                         f"{block}")
    return x.detach().reshape(-1, block).float() if x.requires_grad else \
        x.reshape(-1, block).float()


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 tensor scale of ``x``: ``amax(|x|) / (448 * 6)`` (0-d)."""
    a = x.detach().abs().amax().float()
    return div_by(a, _NVFP4_DENOM)


@dataclass(frozen=True)
class BlockGrid:
    """The per-block quantization grid of one format, fixed: multiply by ``to_grid``, round
    to the element grid (or the nearest NF4 level), multiply by ``from_grid``. ``nan``
    marks blocks that are NaN whatever the values (MX / NF4 blocks holding NaN or inf).
    ``fake_quant(cols)`` applies it to columns of the blocks it was computed from (GPTQ
    quantizes a block's columns one at a time with the block's grid).

    Example:
        >>> import torch
        >>> w = torch.randn(4, 32)
        >>> g = block_scales(w, "mxfp4")
        >>> torch.equal(g.fake_quant(w), fake_quant_eager(w, "mxfp4", 32))
        True
    """

    fmt: str
    to_grid: torch.Tensor  # [N, 1] float32 ([N, block] for llama.cpp's K types)
    from_grid: torch.Tensor  # [N, 1] float32 (idem)
    nan: torch.Tensor | None  # [N, 1] bool, or None
    zero: torch.Tensor | None  # [N, 1] bool: blocks that are exactly zero (NF4), or None
    # llama.cpp's grids with a minimum (Q4_1, Q4_K): subtracted before scaling (float32),
    # and the stored (fp16-rounded) one added after; else None
    offset: torch.Tensor | None = None
    offset_out: torch.Tensor | None = None

    def codes(self, cols: torch.Tensor) -> torch.Tensor:
        """llama.cpp's grids only: the integer codes (float32 values) ``cols`` store."""
        v = cols.float()
        if self.fmt == "q8_0":
            return torch.clamp(_roundf(v * self.to_grid), -127.0, 127.0)
        if self.fmt == "q4_0":
            return torch.clamp(torch.trunc(v * self.to_grid + 8.5), 0.0, 15.0)
        if self.fmt == "q4_1":
            return torch.clamp(torch.trunc((v - self.offset) * self.to_grid + 0.5), 0.0, 15.0)
        if self.fmt == "q4_k":
            q = torch.clamp(torch.round((v + self.offset) * self.to_grid), 0.0, 15.0)
        elif self.fmt == "q8_k":
            q = torch.clamp(torch.round(v * self.to_grid), -128.0, 127.0)  # MIN(127, ...)
        else:  # q6_k
            q = torch.clamp(torch.round(v * self.to_grid), -32.0, 31.0)
        return _plus0(q)

    def values(self, q: torch.Tensor) -> torch.Tensor:
        """llama.cpp's grids only: what codes ``q`` dequantize to, with the operations of
        gguf-py's (and llama.cpp's reference) dequantization, in their order."""
        if self.fmt == "q4_0":
            return (q - 8.0) * self.from_grid
        if self.fmt == "q4_1":
            return self.from_grid * q + self.offset_out
        if self.fmt == "q4_k":
            return self.from_grid * q - self.offset_out
        return self.from_grid * q  # q8_0, q6_k, q8_k

    def fake_quant(self, cols: torch.Tensor) -> torch.Tensor:
        """``cols`` ([N, k], float32) on this grid (float32). llama.cpp's K types: the
        whole super-blocks (their scales are per sub-block)."""
        f = FORMATS[self.fmt]
        if f.kind in ("ggml", "ggml_k"):
            out = self.values(self.codes(cols))
        elif f.kind == "nf4":
            v = cols.float() / self.to_grid
            levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=cols.device)
            out = levels[_nf4_round(v)] * self.from_grid
        elif f.kind == "nvfp4":
            out = _round_element(torch.clamp(cols.float() * self.to_grid, -f.max, f.max), f) \
                * self.from_grid
        else:
            out = _round_element(cols.float() * self.to_grid, f) * self.from_grid
        if self.zero is not None:
            out = torch.where(self.zero, torch.zeros((), device=out.device), out)
        if self.nan is not None:
            out = torch.where(self.nan, torch.full((), math.nan, device=out.device), out)
        return out


def _nvfp4_block_scale(amax: torch.Tensor, pts: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-block scale (float32 values on the E4M3 grid)."""
    return _round_element(torch.clamp(div_by(amax, 6.0) / pts, _E4M3_TINY, 448.0), _E4M3)


# -- llama.cpp's grids -------------------------------------------------------------------
def _recip(d: torch.Tensor) -> torch.Tensor:
    """``1 / d``, and 0 where ``d`` is 0: llama.cpp's ``id = d ? 1.0f/d : 0.0f``; 0 too
    where ``1 / d`` overflows (a block of float32 subnormals: its fp16 scale is 0, so every
    code dequantizes to 0, and an infinite ``id`` would make ``0 * inf`` NaN)."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    r = torch.ones_like(d) / safe
    return torch.where((d == 0) | torch.isinf(r), torch.zeros_like(d), r)


def _inverse_scale(lead: torch.Tensor, code: float) -> torch.Tensor:
    """llama.cpp's ``iscale = code / lead`` (Q6_K's, Q8_K's); 0 where ``lead`` is 0 or the
    division overflows (a subnormal lead: every code then dequantizes to 0)."""
    safe = torch.where(lead == 0, torch.ones_like(lead), lead)
    iscale = torch.full_like(lead, code) / safe
    return torch.where((lead == 0) | torch.isinf(iscale), torch.zeros_like(lead), iscale)


def _f16(t: torch.Tensor) -> torch.Tensor:
    """Finite float32 ``t`` rounded to fp16 (nearest-even, as ggml's ``GGML_FP32_TO_FP16``),
    as float32: the same values as ``t.half().float()``, computed from the float32 bits
    because Inductor drops a float32 -> float16 -> float32 round trip under torch.compile.
    Normal fp16 range: the mantissa rounded to 10 bits; below 2^-14, multiples of 2^-24
    (exact scalings by powers of two around a round-to-even); above 65504, inf."""
    u = t.view(torch.int32)
    normal = ((u + 0xFFF + ((u >> 13) & 1)) & ~0x1FFF).view(torch.float32)
    tiny = torch.round(t * 16777216.0) * (1.0 / 16777216.0)
    out = torch.where(t.abs() < 2.0 ** -14, tiny, normal)
    return torch.where(out.abs() > 65504.0, torch.copysign(torch.full_like(t, math.inf), t),
                       out)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (halves away from zero), exactly (gguf-py's ``np_roundf``); a zero
    result is +0.0, as the integer code it becomes."""
    a = v.abs()
    fl = torch.floor(a)
    b = fl + torch.floor(2.0 * (a - fl))  # a - fl is exact: no a + 0.5 rounding
    return torch.where(v < 0, 0.0 - b, b)


def _plus0(q: torch.Tensor) -> torch.Tensor:
    """+0.0 for a zero integer value (round / a product gives -0.0): a stored integer
    code or sub-block scale decodes to +0.0."""
    return torch.where(q == 0, torch.zeros((), device=q.device), q)


def _lead(xs: torch.Tensor) -> torch.Tensor:
    """The signed value of largest magnitude of each row (the first on a tie), as
    llama.cpp's Q4_0 / Q6_K quantizers pick it."""
    return xs.gather(-1, xs.abs().argmax(dim=-1, keepdim=True))


def _ggml_grid(xb: torch.Tensor, fmt: str) -> tuple[BlockGrid, dict[str, torch.Tensor]]:
    """llama.cpp's grid of each block (row of ``xb``, float32), and the scale fields a
    block stores (float32 before their fp16 rounding; K types' sub-block scales as int32).
    Q8_0 / Q4_0 / Q4_1 are llama.cpp's own reference quantizers (``quantize_row_q*_ref``),
    so their codes are the ones ``llama-quantize`` writes. Q4_K / Q6_K take each
    sub-block's range directly (no search) under llama.cpp's 6-bit / 8-bit sub-block
    scales."""
    bad = ~torch.isfinite(xb.abs().amax(dim=-1, keepdim=True))
    if fmt == "q8_0":
        d = div_by(xb.abs().amax(dim=-1, keepdim=True), 127.0)
        return BlockGrid(fmt, _recip(d), _f16(d), bad, None), {"d": d}
    if fmt == "q4_0":
        d = div_by(_lead(xb), -8.0)
        return BlockGrid(fmt, _recip(d), _f16(d), bad, None), {"d": d}
    if fmt == "q4_1":  # (+0.0 for a zero end: a minimum or maximum of zeros has no sign)
        hi = _plus0(xb.amax(dim=-1, keepdim=True))
        lo = _plus0(xb.amin(dim=-1, keepdim=True))
        d = div_by(hi - lo, 15.0)
        grid = BlockGrid(fmt, _recip(d), _f16(d), bad, None, offset=lo, offset_out=_f16(lo))
        return grid, {"d": d, "m": lo}
    n = xb.shape[0]
    if fmt == "q4_k":  # 8 sub-blocks of 32: w = d * sc * q - dmin * m, sc and m 6-bit
        xs = xb.reshape(n, 8, 32)
        lo = _plus0(torch.clamp(xs.amin(dim=-1), max=0.0))  # llama.cpp keeps it <= 0
        scale, mins = div_by(_plus0(xs.amax(dim=-1)) - lo, 15.0), 0.0 - lo
        d = div_by(scale.amax(dim=-1, keepdim=True), 63.0)
        dmin = div_by(mins.amax(dim=-1, keepdim=True), 63.0)
        sc = _plus0(torch.clamp(torch.round(scale * _recip(d)), 0.0, 63.0))
        m = _plus0(torch.clamp(torch.round(mins * _recip(dmin)), 0.0, 63.0))
        scale_el = (_f16(d) * sc).repeat_interleave(32, dim=-1)
        min_el = (_f16(dmin) * m).repeat_interleave(32, dim=-1)
        grid = BlockGrid(fmt, _recip(scale_el), scale_el, bad, None, offset=min_el,
                         offset_out=min_el)
        return grid, {"d": d, "dmin": dmin, "sc": sc.to(torch.int32), "m": m.to(torch.int32)}
    if fmt == "q8_k":  # llama.cpp's quantize_row_q8_K_ref: the largest magnitude at -127
        lead = _lead(xb)
        iscale = _inverse_scale(lead, -127.0)
        return BlockGrid(fmt, iscale, _recip(iscale), bad, None), {"d": _recip(iscale)}
    # q6_k: 16 sub-blocks of 16: w = d * sc * (q - 32), sc int8
    xs = xb.reshape(n, 16, 16)
    scale = div_by(_lead(xs)[..., 0], -32.0)  # each sub-block's largest magnitude at -32
    top = _lead(scale)  # the scale of largest magnitude gets code -128
    iscale = _inverse_scale(top, -128.0)
    sc = _plus0(torch.clamp(torch.round(iscale * scale), -128.0, 127.0))
    d = _recip(iscale)
    scale_el = (_f16(d) * sc).repeat_interleave(16, dim=-1)
    return BlockGrid(fmt, _recip(scale_el), scale_el, bad, None), \
        {"d": d, "sc": sc.to(torch.int32)}


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, 1] float32 -> [N, 2] uint8: the fp16 value's little-endian bytes."""
    return t.reshape(-1, 1).half().contiguous().view(torch.uint8).reshape(-1, 2)


def _nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo | (hi << 4)).to(torch.uint8)


def ggml_bytes(x: torch.Tensor, fmt: str) -> np.ndarray:
    """llama.cpp's block bytes of ``x`` on grid ``fmt`` (``q8_0``, ``q4_0``, ``q4_1``,
    ``q4_k``, ``q6_k``: ``GGUF_WEIGHT_FORMATS``), one row of ``x.shape[-1]`` elements per
    row of the result (uint8, ``[rows, row_bytes]``): what a GGUF file stores, so that
    llama.cpp's dequantization of it (and gguf-py's ``quants.dequantize``) gives
    ``fake_quant_eager(x, fmt, block)`` bit for bit. Blocks run along the last dim (a
    weight's rows).

    Example:
        >>> import torch
        >>> from gguf import GGMLQuantizationType, quants
        >>> w = torch.randn(4, 64)
        >>> raw = ggml_bytes(w, "q4_0")
        >>> raw.shape                                     # 2 blocks of 18 bytes per row
        (4, 36)
        >>> back = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_0))
        >>> torch.equal(back, fake_quant_eager(w, "q4_0", 32))
        True
    """
    f = FORMATS[fmt]
    if fmt not in GGUF_WEIGHT_FORMATS:
        raise ValueError(f"{fmt} is not a GGUF weight type (one of "
                         f"{', '.join(GGUF_WEIGHT_FORMATS)})")
    if x.dim() < 1 or x.shape[-1] % f.block:
        raise ValueError(f"{fmt}: rows of {x.shape[-1] if x.dim() else 0} elements do not "
                         f"split into blocks of {f.block}")
    rows = x.numel() // x.shape[-1]
    xb = _blocks(x.detach().cpu(), f.block)
    if not bool(torch.isfinite(xb).all()):
        raise ValueError(f"{fmt}: the tensor holds NaN or inf, which no GGUF block stores")
    grid, k = _ggml_grid(xb, fmt)
    q = grid.codes(xb).to(torch.int32)
    n = xb.shape[0]
    if fmt == "q8_0":
        parts = [_half_bytes(k["d"]), q.to(torch.int8).view(torch.uint8)]
    elif fmt == "q4_0":
        parts = [_half_bytes(k["d"]), _nibbles(q[:, :16], q[:, 16:])]
    elif fmt == "q4_1":
        parts = [_half_bytes(k["d"]), _half_bytes(k["m"]), _nibbles(q[:, :16], q[:, 16:])]
    elif fmt == "q4_k":
        sc, m = k["sc"], k["m"]
        # 12 bytes: sc / m 0-3 in the low 6 bits of bytes 0-3 / 4-7, their 4-7 split into
        # a low nibble (bytes 8-11) and 2 high bits (the top of bytes 0-3 / 4-7)
        packed = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                            m[:, :4] | ((m[:, 4:] >> 4) << 6),
                            (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], dim=1)
        qs = q.reshape(n, 4, 2, 32)  # 32 bytes per pair of sub-blocks: low, then high nibble
        parts = [_half_bytes(k["d"]), _half_bytes(k["dmin"]), packed.to(torch.uint8),
                 _nibbles(qs[:, :, 0], qs[:, :, 1]).reshape(n, 128)]
    else:  # q6_k: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
        u = (q + 32).reshape(n, 2, 4, 32)  # per 128 elements: 4 runs of 32
        low, high = u & 0xF, u >> 4
        ql = torch.cat([_nibbles(low[:, :, 0], low[:, :, 2]),
                        _nibbles(low[:, :, 1], low[:, :, 3])], dim=2).reshape(n, 128)
        qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
              | (high[:, :, 3] << 6)).to(torch.uint8).reshape(n, 64)
        parts = [ql, qh, k["sc"].to(torch.int8).view(torch.uint8), _half_bytes(k["d"])]
    return torch.cat(parts, dim=1).reshape(rows, -1).numpy()


def block_scales(x_blocks: torch.Tensor, fmt: str,
                 tensor_scale: torch.Tensor | None = None) -> BlockGrid:
    """The grid of each row of ``x_blocks`` ([N, block]) in format ``fmt``. NVFP4 takes its
    tensor scale from ``tensor_scale`` when given (GPTQ: the original weight's), else from
    ``x_blocks``."""
    f = FORMATS[fmt]
    xb = x_blocks.detach().float()
    if f.kind in ("ggml", "ggml_k"):
        return _ggml_grid(xb, fmt)[0]
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if f.kind == "mx":
        bad = ~torch.isfinite(amax)
        e = torch.clamp(_floor_log2(torch.where(bad, torch.zeros_like(amax), amax)) - f.emax,
                        -127, 127)
        return BlockGrid(fmt, _exp2(-e), _exp2(e), bad, None)
    if f.kind == "nvfp4":
        pts = nvfp4_tensor_scale(xb) if tensor_scale is None else tensor_scale.float()
        # an all-zero tensor gives zeros (torchao would give NaN), and so does one so small
        # (amax < 2688 * 2^-128) that 1 / tensor_scale overflows; no branch on the value,
        # so torch.compile traces one graph
        zero = (pts == 0) | torch.isinf(1.0 / pts)
        pts = torch.where(zero, torch.ones_like(pts), pts)
        s8 = _nvfp4_block_scale(amax, pts)
        nothing = torch.zeros((), device=amax.device)
        return BlockGrid(fmt, torch.where(zero, nothing, (1.0 / pts) / s8),
                         torch.where(zero, nothing, pts * s8), None, None)
    # nf4
    bad = ~torch.isfinite(amax)
    return BlockGrid(fmt, amax, amax, bad, amax == 0)


def fake_quant_eager(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """``dequantize(quantize(x))`` in format ``fmt`` with ``block``-element blocks: the
    reference formula (plain torch ops, no autograd node of its own; Inductor fuses it under
    ``torch.compile``). Returns ``x``'s shape and dtype."""
    xb = _blocks(x, block)
    out = block_scales(xb, fmt).fake_quant(xb).reshape(x.shape)
    # no .to() that returns its input: an autograd.Function (_BlockSTE) whose forward
    # returned such an alias got a zero gradient under torch.compile in torch 2.11
    return out if out.dtype == x.dtype else out.to(x.dtype)


class _BlockSTE(torch.autograd.Function):
    """Block fake-quant with the straight-through gradient (identity)."""

    @staticmethod
    def forward(ctx, x, fmt, block):  # type: ignore[override]
        return _forward(x, fmt, block)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None


def _kernel_ok(x: torch.Tensor) -> bool:
    # kernels.available() means the library loaded with block_fake_quant registered
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.is_cpu
            and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous()
            and not torch.compiler.is_compiling() and kernels.available())


def _forward(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    if _kernel_ok(x):
        return torch.ops.qcompile.block_fake_quant(x.detach(), fmt, block)
    with torch.no_grad():
        return fake_quant_eager(x, fmt, block)


def fake_quantize_block(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Block fake-quant of ``x`` with a straight-through gradient: the C++ kernel on plain
    contiguous CPU float32 / bfloat16 tensors (the same bits), else the eager formula.

    Example:
        >>> import torch
        >>> x = torch.randn(2, 64, requires_grad=True)
        >>> y = fake_quantize_block(x, "nvfp4", 16)
        >>> y.sum().backward()
        >>> bool((x.grad == 1).all()), torch.equal(y, fake_quant_eager(x, "nvfp4", 16))
        (True, True)
    """
    # under torch.compile the Function's forward is the plain formula (``_kernel_ok``),
    # which Inductor fuses; written as x + (q - x).detach() it would turn -0.0 into +0.0
    if _kernel_ok(x):  # the operator's own C++ autograd node: identity backward
        return torch.ops.qcompile.block_fake_quant(x, fmt, block)
    if x.requires_grad and torch.is_grad_enabled():
        return _BlockSTE.apply(x, fmt, block)
    return _forward(x, fmt, block)


# -- codes and scales (storage) ---------------------------------------------------------
@dataclass(frozen=True)
class BlockCodes:
    """A tensor in a block format: ``codes`` (uint8, one per element: the element's bit
    pattern ``sign | exponent | mantissa`` for FP formats, the level index for NF4),
    ``scales`` (one per block: uint8 E8M0 biased exponents for MX, ``float8_e4m3fn`` for
    NVFP4, float32 absmax for NF4), ``tensor_scale`` (NVFP4's float32, 0-d; else None),
    and the original ``shape``."""

    fmt: str
    block: int
    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    shape: tuple[int, ...]


def _element_codes(q: torch.Tensor, f: BlockFormat) -> torch.Tensor:
    """Bit patterns of the on-grid float32 values ``q`` in ``f``'s element format. NaN
    (an NVFP4 block holding inf: its scale is NaN, so it decodes to NaN whatever the code)
    becomes code 0: a NaN's sign bit differs between devices, these bytes do not."""
    q = torch.where(torch.isnan(q), torch.zeros((), device=q.device), q)
    a = q.abs()
    sign = (torch.signbit(q)).to(torch.int32) << (f.ebits + f.mbits)
    e = torch.clamp(_floor_log2(a), min=f.emin)
    mant = torch.round(a * _exp2(f.mbits - e)).to(torch.int32)  # 1.m * 2^mbits, or 0.m
    normal = mant >= (1 << f.mbits)
    bias = 2 ** (f.ebits - 1) - 1
    exp_field = torch.where(normal, e + bias, torch.zeros_like(e))
    mant = torch.where(normal, mant - (1 << f.mbits), mant)
    return (sign | (exp_field << f.mbits) | mant).to(torch.uint8)


def _element_values(codes: torch.Tensor, f: BlockFormat) -> torch.Tensor:
    """float32 values of ``f``'s element bit patterns."""
    c = codes.to(torch.int32)
    mant = c & ((1 << f.mbits) - 1)
    exp_field = (c >> f.mbits) & ((1 << f.ebits) - 1)
    bias = 2 ** (f.ebits - 1) - 1
    normal = exp_field > 0
    sig = torch.where(normal, mant + (1 << f.mbits), mant).float()
    e = torch.where(normal, exp_field - bias, torch.full_like(exp_field, f.emin)) - f.mbits
    v = sig * _exp2(e)
    return torch.where((c >> (f.ebits + f.mbits)) & 1 == 1, -v, v)


def quantize_blocks(x: torch.Tensor, fmt: str, block: int | None = None, *,
                    tensor_scale: torch.Tensor | None = None) -> BlockCodes:
    """``x`` as codes and scales of format ``fmt`` (``dequantize_blocks`` gives back exactly
    ``fake_quant_eager(x, fmt, block)``). NVFP4 takes ``tensor_scale`` when given (``x`` is
    some rows of a larger tensor, whose tensor scale that is). llama.cpp's grids are
    refused: their bytes are ``ggml_bytes``'s."""
    f = FORMATS[fmt]
    if f.kind in ("ggml", "ggml_k"):
        raise ValueError(f"{fmt} is one of llama.cpp's grids, stored as its GGUF blocks: "
                         f"ggml_bytes(x, {fmt!r}) gives them (qc.export_gguf writes them)")
    block = block or f.block
    xb = _blocks(x, block)
    if f.kind == "nf4":
        amax = xb.abs().amax(dim=-1, keepdim=True)
        safe = torch.where(amax == 0, torch.ones_like(amax), amax)
        codes = _nf4_round(xb / safe).to(torch.uint8)
        # level 0.0 for all-zero blocks, and for NaN blocks (their values are NaN whatever
        # the codes: argmin over NaN differs between devices, these bytes do not)
        codes = torch.where((amax == 0) | ~torch.isfinite(amax), torch.full_like(codes, 7),
                            codes)
        return BlockCodes(fmt, block, codes.reshape(x.shape), amax.reshape(-1), None,
                          tuple(x.shape))
    grid = block_scales(xb, fmt, tensor_scale)
    if f.kind == "mx":
        q = _round_element(torch.nan_to_num(xb) * grid.to_grid, f)
        e = _floor_log2(grid.from_grid)  # exact powers of two (2^-127 is subnormal: -127)
        e = torch.where(grid.from_grid < 2.0 ** -126, torch.full_like(e, -127), e)
        scales = torch.where(grid.nan, torch.full_like(e, 255), e + 127).to(torch.uint8)
    else:
        q = _round_element(torch.clamp(xb * grid.to_grid, -f.max, f.max), f)
        tensor_scale = (nvfp4_tensor_scale(xb) if tensor_scale is None
                        else tensor_scale.float().reshape(()))
        if float(tensor_scale) == 0 or math.isinf(float(1.0 / tensor_scale)):
            scales = torch.zeros_like(grid.from_grid)
        else:
            scales = _nvfp4_block_scale(xb.abs().amax(dim=-1, keepdim=True), tensor_scale)
        # a NaN scale (a tensor with an inf) as one byte on every device: x86 makes inf /
        # inf a NaN with the sign bit set, CUDA one without
        scales = torch.where(torch.isnan(scales), torch.full_like(scales, math.nan), scales)
        scales = scales.to(torch.float8_e4m3fn)
    return BlockCodes(fmt, block, _element_codes(q, f).reshape(x.shape),
                      scales.reshape(-1), tensor_scale, tuple(x.shape))


def dequantize_blocks(c: BlockCodes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``c`` stores, as ``dtype`` (float32 arithmetic, as ``fake_quant_eager``)."""
    f = FORMATS[c.fmt]
    codes = c.codes.reshape(-1, c.block)
    if f.kind == "nf4":
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=codes.device)
        amax = c.scales.float().reshape(-1, 1)
        out = levels[codes.long()] * amax
        out = torch.where(torch.isfinite(amax), out, torch.full((), math.nan))
    elif f.kind == "mx":
        e = c.scales.to(torch.int32).reshape(-1, 1) - 127
        out = _element_values(codes, f) * _exp2(torch.clamp(e, max=127))
        out = torch.where(e == 128, torch.full((), math.nan), out)
    else:
        s8 = c.scales.float().reshape(-1, 1)
        out = _element_values(codes, f) * (c.tensor_scale.float() * s8)
    return out.reshape(c.shape).to(dtype)
