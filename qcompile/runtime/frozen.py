"""A frozen base weight held in its quantized form (``adapters: [{base: frozen}]``).

``FrozenWeight`` stores one ``[out, in]`` weight (for a layer that stores its weight
``[in, out]``, GPT-2's ``Conv1D``, its transpose: output rows, with groups and blocks
along the inputs) as its scheme stores it (integers with per-tensor / per-channel /
per-group scales, or the codes and scales of a block-scaled format: MXFP8/6/4, NVFP4,
NF4) and returns the dequantized weight on each call: exactly the
values the weight's fake-quantizer gave (``FakeQuantize`` with the same qparams), so a
graph whose base is frozen computes what its QAT graph computed with the same weights.

The stored tensors are parameters without gradient, laid out by the weight's rows (dim 0):
``fully_shard`` shards them like any weight (a rank keeps its rows, 1/N of the storage)
and gathers them for the layer's forward; DDP broadcasts them once when it wraps the model
(buffers it would broadcast before every forward). A call made while a compiled graph runs
its forward with the weight-recomputing hooks (``qcompile.runtime.recompute``) tags its
output, so autograd keeps the stored integers, not the float weight: the backward
dequantizes the layer again, and a step never holds more than one layer's float weight.

Casting the module (``.half()``, ``.to(torch.bfloat16)``) changes the dtype ``forward()``
returns, never the stored values; moving it moves them.

Example:
    >>> import torch
    >>> from qcompile.runtime.fake_quant import FakeQuantize
    >>> w = torch.randn(8, 64)
    >>> fq = FakeQuantize("int4", granularity="per_group", group_size=32, channels=16,
    ...                   weight=True)
    >>> fq.observe_tensor(w)
    >>> fw = FrozenWeight.from_quantizer(fq, w)
    >>> torch.equal(fw(), fq(w)), fw.nbytes(), sorted(n for n, _ in fw.named_parameters())
    (True, 320, ['codes', 'scale'])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from qcompile.errors import QCompileError
from qcompile.runtime import kernels, recompute
from qcompile.runtime.block_formats import (
    FORMATS,
    GGML_FORMATS,
    NF4_LEVELS,
    BlockCodes,
    _element_values,
    _exp2,
    dequantize_blocks,
    nvfp4_tensor_scale,
    quantize_blocks,
)
from qcompile.runtime.block_storage import pack_fp6, pack_nibbles, unpack_fp6, unpack_nibbles
from qcompile.runtime.quant_math import FP8_DTYPES, symmetric_zero_point

__all__ = ["FrozenWeight", "frozen_layout", "symmetric_offset"]

_INT_DTYPES = ((torch.int8, -128, 127), (torch.uint8, 0, 255), (torch.int16, -2**15, 2**15 - 1))


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def frozen_layout(fq: nn.Module, shape: tuple[int, ...], *, transposed: bool = False
                  ) -> str | None:
    """Why the weight quantizer ``fq`` cannot have the rows of ``shape`` stored frozen, or
    None when it can (a 2-D ``[out, in]`` weight, any integer scheme whose scales run along
    its rows, or a block format). ``transposed``: ``fq`` reads these rows' transpose (a
    weight stored ``[in, out]``, GPT-2's ``Conv1D``, quantized as it is stored), so its
    per-channel scales run along that weight's axis 1.

    Example:
        >>> from qcompile.runtime.fake_quant import FakeQuantize
        >>> fq = FakeQuantize("int8", granularity="per_channel", axis=1, channels=4,
        ...                   weight=True)
        >>> frozen_layout(fq, (4, 8))
        'per-channel scales along axis 1 (frozen storage needs them along the output rows)'
        >>> frozen_layout(fq, (4, 8), transposed=True) is None
        True
    """
    if len(shape) != 2:
        return f"a {len(shape)}-D weight (frozen storage holds [out, in] matrices)"
    if getattr(fq, "dtype", None) in FP8_DTYPES:
        return f"{fq.dtype} weights (frozen storage holds integers and block formats)"
    if getattr(fq, "block_format", None) in GGML_FORMATS:
        return (f"llama.cpp's {fq.block_format} grid (frozen storage holds integers, MX, "
                "NVFP4 and NF4; write it for llama.cpp with qc.export_gguf)")
    if transposed and fq.granularity == "per_group":
        return "groups along a weight's output dimension (stored [in, out], read as stored)"
    if fq.granularity == "per_channel" and fq.axis % 2 != (1 if transposed else 0):
        return (f"per-channel scales along axis {fq.axis} (frozen storage needs them along "
                "the output rows)")
    if getattr(fq, "learnable", False) is True and fq.block_format is None:
        return None  # its scale is read as it is now
    if fq.granularity == "per_token":
        return "a per-token weight scheme"
    return None


class FrozenWeight(nn.Module):
    """An ``[out, in]`` weight stored quantized; ``forward()`` returns it dequantized.

    Integer schemes store ``codes`` (int8 / uint8 / int16 ``[out, in]``; two per byte,
    ``[out, in / 2]``, for 4 bits or fewer) with ``scale`` (float32 ``[out, groups]``,
    ``[out, 1]`` per channel, ``[1, 1]`` per tensor) and, for asymmetric schemes,
    ``zero_point`` (float32, the same shape): ``(codes - zero_point) * scale``; a symmetric
    scheme's zero point is one number fixed by its range (``offset``, moved by
    ``-quant_min`` for packed unsigned nibbles), stored in no tensor. Block formats store
    their ``codes`` packed by row, ``scales`` (one per block; the scale's bytes for MX and
    NVFP4, float32 absmax for NF4) and NVFP4's ``tensor_scale``."""

    def __init__(self, storage: dict[str, torch.Tensor], *, shape: tuple[int, int],
                 dtype: torch.dtype = torch.float32, fmt: str | None = None,
                 block: int | None = None, packed: bool = False, offset: float = 0.0) -> None:
        super().__init__()
        self.rows, self.cols = int(shape[0]), int(shape[1])
        self.out_dtype = dtype
        self.fmt = fmt  # a block format, or None for integers
        self.block = block  # the block (format) or group (integers) size; None otherwise
        self.packed = packed  # integers: two 4-bit codes per byte
        self.offset = offset  # integers: the zero point of a symmetric scheme (no tensor)
        for name, t in storage.items():
            self.register_parameter(name, _frozen(t))
        if "zero_point" not in storage:
            self.zero_point = None
        if "tensor_scale" not in storage:
            self.tensor_scale = None

    # -- building ------------------------------------------------------------------------
    @classmethod
    def from_quantizer(cls, fq: nn.Module, weight: torch.Tensor, *,
                       transposed: bool = False) -> FrozenWeight:
        """``weight`` (``[out, in]``) stored as the weight quantizer ``fq`` quantizes it
        (its current qparams; a block format computes its own); ``transposed``: ``fq``
        quantizes ``weight.t()`` (see ``frozen_layout``), per tensor or per channel along
        its axis 1, which are the same scales by ``weight``'s rows."""
        shape = tuple(weight.shape)
        why = frozen_layout(fq, shape, transposed=transposed)
        if why is not None:
            raise QCompileError(f"a frozen base cannot store {why}",
                                fix="use base: qat for this layer, or another weight scheme")
        storage, packed = cls.encode(fq, weight.detach())
        return cls(storage, shape=shape, dtype=weight.dtype, fmt=fq.block_format,
                   block=fq.group_size, packed=packed, offset=symmetric_offset(fq, packed))

    @staticmethod
    @torch.no_grad()
    def encode(fq: nn.Module, weight: torch.Tensor, *, scale: torch.Tensor | None = None,
               zero_point: torch.Tensor | None = None,
               tensor_scale: torch.Tensor | None = None
               ) -> tuple[dict[str, torch.Tensor], bool]:
        """(stored tensors, packed) for the rows ``weight`` holds: with ``fq``'s qparams, or
        the ``scale`` / ``zero_point`` given for these rows (a rank's shard); NVFP4 with the
        ``tensor_scale`` given (the whole weight's, when these are some of its rows)."""
        rows, cols = weight.shape
        if fq.block_format is not None:
            return _encode_blocks(weight, fq.block_format, fq.group_size, tensor_scale), False
        w = weight.float()
        scale = (fq.scale if scale is None else scale).detach().float()
        zp = (fq.zero_point if zero_point is None else zero_point).detach()
        if fq.granularity == "per_group":
            g = fq.group_size
            scale2, zp2 = scale.reshape(rows, cols // g), zp.reshape(rows, cols // g)
            q = torch.div(w.reshape(rows, cols // g, g), scale2.unsqueeze(-1)).round_()
            q = q.add_(zp2.unsqueeze(-1)).clamp_(fq.quant_min, fq.quant_max).reshape(rows, cols)
        else:
            shape = (rows, 1) if fq.granularity == "per_channel" else (1, 1)
            scale2, zp2 = scale.reshape(shape), zp.reshape(shape)
            q = torch.div(w, scale2).round_().add_(zp2).clamp_(fq.quant_min, fq.quant_max)
        zp2 = zp2.float()
        packed = fq.quant_max - fq.quant_min < 16 and cols % 2 == 0
        if packed:  # unsigned nibbles: q - quant_min, against a zero point moved alike
            codes = pack_nibbles((q - fq.quant_min).to(torch.uint8))
            zp2 = zp2 - fq.quant_min
        else:
            dtype = next((d for d, lo, hi in _INT_DTYPES
                          if lo <= fq.quant_min and fq.quant_max <= hi), torch.int32)
            codes = q.to(dtype)
        storage = {"codes": codes.contiguous(), "scale": scale2.contiguous().clone()}
        if not fq.symmetric:
            storage["zero_point"] = zp2.contiguous().clone()
        return storage, packed

    @classmethod
    def empty(cls, fq: nn.Module, shape: tuple[int, int], *, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "meta") -> FrozenWeight:
        """Storage for an ``[out, in]`` weight as ``fq`` quantizes it, uninitialised (on the
        meta device by default: ``compile_once`` fills each rank's rows later)."""
        rows, cols = shape
        kw = {"device": device}
        if fq.block_format is not None:
            f = FORMATS[fq.block_format]
            block = fq.group_size
            storage = {"codes": torch.empty(rows, cols * f.bits // 8, dtype=torch.uint8, **kw),
                       "scales": torch.empty(rows, cols // block, **kw, dtype=(
                           torch.float32 if f.kind == "nf4" else torch.uint8))}
            if f.kind == "nvfp4":
                storage["tensor_scale"] = torch.empty(1, dtype=torch.float32, **kw)
            return cls(storage, shape=shape, dtype=dtype, fmt=fq.block_format, block=block)
        packed = fq.quant_max - fq.quant_min < 16 and cols % 2 == 0
        if packed:
            codes = torch.empty(rows, cols // 2, dtype=torch.uint8, **kw)
        else:
            codes = torch.empty(rows, cols, **kw, dtype=next(
                (d for d, lo, hi in _INT_DTYPES if lo <= fq.quant_min and fq.quant_max <= hi),
                torch.int32))
        qshape = ((rows, cols // fq.group_size) if fq.granularity == "per_group"
                  else (rows, 1) if fq.granularity == "per_channel" else (1, 1))
        storage = {"codes": codes, "scale": torch.empty(qshape, dtype=torch.float32, **kw)}
        if not fq.symmetric:
            storage["zero_point"] = torch.empty(qshape, dtype=torch.float32, **kw)
        return cls(storage, shape=shape, dtype=dtype, block=fq.group_size, packed=packed,
                   offset=symmetric_offset(fq, packed))

    # -- reading -------------------------------------------------------------------------
    def integers(self) -> torch.Tensor:
        """The stored integers, ``[out, in]`` (unsigned nibbles when packed)."""
        return unpack_nibbles(self.codes) if self.packed else self.codes

    def block_codes(self) -> BlockCodes:
        """What a block format stores, as ``quantize_blocks`` returns it."""
        f = FORMATS[self.fmt]
        raw = self.codes
        codes = unpack_nibbles(raw) if f.bits == 4 else unpack_fp6(raw) if f.bits == 6 else raw
        scales = self.scales
        if f.kind == "nvfp4":
            scales = scales.view(torch.float8_e4m3fn)
        ts = None if self.tensor_scale is None else self.tensor_scale.reshape(())
        return BlockCodes(self.fmt, self.block, codes, scales.reshape(-1), ts,
                          (self.rows, self.cols))

    def dequantize(self) -> torch.Tensor:
        """The weight, ``[out, in]``, in ``out_dtype`` (float32 arithmetic)."""
        fast = self._table_lookup() if self.codes.is_cpu and kernels.available() else None
        if fast is not None:
            return fast.to(self.out_dtype)
        return self.dequantize_eager()

    def _table_lookup(self) -> torch.Tensor | None:
        """``qcompile::dequant_lut4`` / ``dequant_lut8``: one table value times its block's
        scale per element (the same bits as ``dequantize_eager``); None where the storage
        does not take it (asymmetric integer groups, odd groups)."""
        ops = torch.ops.qcompile
        if self.fmt is not None:
            f = FORMATS[self.fmt]
            table = self._constant("_element_table", lambda: _table(self.fmt, 1 << f.bits))
            scale = _block_scale(self)
            if f.bits == 4:
                return ops.dequant_lut4(self.codes, table, scale, self.block)
            codes = unpack_fp6(self.codes) if f.bits == 6 else self.codes
            return ops.dequant_lut8(codes, _padded(table), scale, self.block)
        zp = self.zero_point
        if zp is None:  # a symmetric scheme: its zero point is fixed, so is the table
            lut = self._constant("_int_table", lambda: _int_table(self, self.offset))
        else:  # one zero point for every scale, or no table
            z = float(zp.reshape(-1)[0])
            if zp.numel() > 1 and not bool((zp == z).all()):
                return None
            lut = _int_table(self, z)
        if lut is None:
            return None
        block = self.block or self.cols
        scale = self.scale if self.scale.shape[0] == self.rows else self.scale.expand(
            self.rows, 1)
        if self.packed:
            return ops.dequant_lut4(self.codes, lut, scale, block)
        return ops.dequant_lut8(self.codes.view(torch.uint8), lut, scale, block)

    def _constant(self, name: str, make: Callable[[], torch.Tensor | None]
                  ) -> torch.Tensor | None:
        """A table fixed by this storage's format, made on first use and kept on the module
        (a few hundred bytes; the forward and the backward read it at every step)."""
        if name not in self.__dict__:
            self.__dict__[name] = make()
        return self.__dict__[name]

    def dequantize_eager(self) -> torch.Tensor:
        """``dequantize`` in torch operations (any device)."""
        if self.fmt is not None:
            return dequantize_blocks(self.block_codes()).to(self.out_dtype)
        q = self.integers()
        if self.block is not None:  # per group
            q = q.reshape(self.rows, self.cols // self.block, self.block)
            scale, zp = self.scale.unsqueeze(-1), self.zero_point
            zp = zp.unsqueeze(-1) if zp is not None else None
        else:
            scale, zp = self.scale, self.zero_point
        w = q.to(torch.float32)
        if zp is not None:
            w = w.sub_(zp)
        elif self.offset:
            w = w.sub_(self.offset)
        return w.mul_(scale).reshape(self.rows, self.cols).to(self.out_dtype)

    def forward(self) -> torch.Tensor:
        w = self.dequantize()
        # autograd keeps the integers, not this float copy (train.recompute_weights)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and recompute.active():
            recompute.tag(w, self.codes, _again, self)
        return w

    def nbytes(self) -> int:
        """Bytes stored (codes, scales, zero points)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor],
               recurse: bool = True) -> FrozenWeight:
        # The stored dtypes are the format: a cast (.half(), .to(torch.bfloat16)) becomes
        # the dtype forward() returns; a move (.to(device), to_empty) moves the values.
        for probe in (torch.float32, torch.float16):
            cast = fn(torch.zeros(1, dtype=probe)).dtype
            if cast != probe:
                self.out_dtype = cast
                break

        def keep(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        return super()._apply(keep, recurse)

    def extra_repr(self) -> str:
        kind = self.fmt or (f"int, {'per_group(' + str(self.block) + ')' if self.block else ''}"
                            .rstrip(", "))
        return (f"{kind}, shape={[self.rows, self.cols]}, "
                f"dtype={str(self.out_dtype).removeprefix('torch.')}")


def _table(fmt: str, size: int) -> torch.Tensor:
    """The float32 value of every element code of a block format (``size`` codes)."""
    f = FORMATS[fmt]
    if f.kind == "nf4":
        return torch.tensor(NF4_LEVELS, dtype=torch.float32)
    return _element_values(torch.arange(size, dtype=torch.uint8), f)


def _padded(table: torch.Tensor) -> torch.Tensor:
    """A table over fewer than 256 codes (FP6) as the 256 entries ``dequant_lut8`` reads."""
    return table if table.numel() == 256 else torch.cat(
        [table, table.new_zeros(256 - table.numel())])


def _int_table(fw: FrozenWeight, zero_point: float) -> torch.Tensor | None:
    """``code - zero_point`` for every code the table kernels index (the 16 nibbles of
    packed codes, the 256 bytes of 8-bit ones), or None for wider codes (and packed codes
    whose groups are odd)."""
    if fw.packed:
        if (fw.block or fw.cols) % 2:
            return None
        return torch.arange(16, dtype=torch.float32).sub_(zero_point)
    if fw.codes.dtype == torch.uint8:
        return torch.arange(256, dtype=torch.float32).sub_(zero_point)
    if fw.codes.dtype == torch.int8:  # indexed by the byte: 128..255 are -128..-1
        return torch.arange(256, dtype=torch.uint8).view(torch.int8).float().sub_(zero_point)
    return None


def _block_scale(fw: FrozenWeight) -> torch.Tensor:
    """Each block's float32 multiplier, as ``dequantize_blocks`` applies it (NaN for a
    block it makes NaN), read from a table over the scale's byte."""
    f = FORMATS[fw.fmt]
    if f.kind == "nf4":
        amax = fw.scales.float()
        return torch.where(torch.isfinite(amax), amax, torch.full((), math.nan))
    table = fw._constant("_scale_table", lambda: _scale_table(f.kind))
    return table[fw.scales.long()] * (fw.tensor_scale.float() if f.kind == "nvfp4" else 1.0)


def _scale_table(kind: str) -> torch.Tensor:
    """float32 value of every scale byte: E8M0 (``2^(byte - 127)``, NaN for 255) for MX,
    E4M3 for NVFP4."""
    b = torch.arange(256, dtype=torch.int32)
    if kind == "mx":
        e = b - 127
        return torch.where(e == 128, torch.full((), math.nan), _exp2(torch.clamp(e, max=127)))
    return b.to(torch.uint8).view(torch.float8_e4m3fn).float()


def symmetric_offset(fq: nn.Module, packed: bool) -> float:
    """The zero point a symmetric scheme fixes (0 for signed integers, the middle of the
    range for unsigned ones), moved like the codes for packed nibbles; decided by the
    scheme, never by the values (every rank of a sharded weight stores alike)."""
    if not fq.symmetric or fq.block_format is not None:
        return 0.0
    return float(symmetric_zero_point(fq.quant_min, fq.quant_max)
                 - (fq.quant_min if packed else 0))


def _again(codes: torch.Tensor, module: FrozenWeight) -> torch.Tensor:
    """The recompute recipe: dequantize again (``codes`` is the version-checked tensor)."""
    return module.dequantize()


# Rows quantized at a time: NF4's nearest level compares every element with 16 levels, so
# a whole layer at once would hold 16 float copies of it (hundreds of MB for a large one)
_ENCODE_ELEMENTS = 1 << 20


def _encode_blocks(weight: torch.Tensor, fmt: str, block: int,
                   tensor_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    f = FORMATS[fmt]
    rows, cols = weight.shape
    if f.kind == "nvfp4" and tensor_scale is None:  # the whole weight's, for every chunk
        tensor_scale = nvfp4_tensor_scale(weight)
    step = max(1, _ENCODE_ELEMENTS // max(cols, 1))
    codes, scales = [], []
    for start in range(0, rows, step):
        c = quantize_blocks(weight[start:start + step], fmt, block,
                            tensor_scale=tensor_scale if f.kind == "nvfp4" else None)
        part = c.codes.reshape(-1, cols).to(torch.uint8)
        codes.append(pack_nibbles(part) if f.bits == 4 else pack_fp6(part) if f.bits == 6
                     else part)
        s = c.scales.reshape(-1, cols // block)
        scales.append(s.float() if f.kind == "nf4" else s.view(torch.uint8))
    out = {"codes": torch.cat(codes).contiguous(), "scales": torch.cat(scales).contiguous()}
    if f.kind == "nvfp4":
        out["tensor_scale"] = tensor_scale.detach().float().reshape(1).clone()
    return out
