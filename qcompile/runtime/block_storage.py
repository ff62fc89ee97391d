"""Real storage for block-scaled weights in converted graphs (``qc.convert``).

``BlockWeight`` holds one weight in its block format (``qcompile.runtime.block_formats``:
MXFP8 / MXFP6 / MXFP4, NVFP4, NF4) as the bits a deployment stores, laid out by the
weight's rows (dim 0; blocks run along each row), and ``forward()`` returns the
dequantized weight in the layer's dtype, exactly ``fake_quant_eager``'s values:

========================  ==========================================  =====================
format                    elements (``codes``)                        scales (``scales``)
========================  ==========================================  =====================
``mxfp8_e4m3``            ``torch.float8_e4m3fn``, one per element    ``torch.float8_e8m0fnu``
``mxfp8_e5m2``            ``torch.float8_e5m2``, one per element      ``torch.float8_e8m0fnu``
``mxfp6_e3m2`` / ``e2m3`` ``uint8``, 4 codes in 3 bytes                ``torch.float8_e8m0fnu``
``mxfp4``                 ``torch.float4_e2m1fn_x2`` (two per byte)   ``torch.float8_e8m0fnu``
``nvfp4``                 ``torch.float4_e2m1fn_x2`` (two per byte)   ``torch.float8_e4m3fn``
                          + ``tensor_scale`` (float32, one value)
``nf4``                   ``uint8``, two level indices per byte       ``float32`` absmax
========================  ==========================================  =====================

Two 4-bit values share a byte with the first in the low nibble (torchao's, ONNX's and
NVIDIA's order). ``codes`` is ``[rows, packed row]`` and ``scales`` ``[rows, row / block]``.
The state dict holds them in these dtypes (they survive ``torch.save`` /
``torch.load(weights_only=True)`` and safetensors' ``save_file`` / ``load_file``); the
module's buffers hold the same bytes as uint8 (``typed(name)`` views them in their dtype),
because NCCL has no float4 or E8M0 type and DDP broadcasts buffers. Casting the module
(``.half()``, ``.to(torch.bfloat16)``) changes the dtype ``forward()`` returns, never the
stored bits; moving it (``.to(device)``) moves them.

Example:
    >>> import torch
    >>> from qcompile.runtime.block_formats import fake_quant_eager, quantize_blocks
    >>> w = torch.randn(4, 64)
    >>> bw = BlockWeight(quantize_blocks(w, "mxfp4", 32))
    >>> [(k, v.dtype, tuple(v.shape)) for k, v in bw.state_dict().items()]
    [('codes', torch.float4_e2m1fn_x2, (4, 32)), ('scales', torch.float8_e8m0fnu, (4, 2))]
    >>> torch.equal(bw(), fake_quant_eager(w, "mxfp4", 32))
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qcompile.runtime.block_formats import FORMATS, BlockCodes, dequantize_blocks

__all__ = ["BlockWeight", "pack_fp6", "pack_nibbles", "unpack_fp6", "unpack_nibbles"]

# the torch dtype holding each format's elements where torch has one (uint8 otherwise)
_ELEMENT_DTYPES = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2,
                   "mxfp4": torch.float4_e2m1fn_x2, "nvfp4": torch.float4_e2m1fn_x2}


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 ``[rows, n]``, ``n`` even) -> uint8 ``[rows, n / 2]``, two per
    byte, the first in the low nibble.

    >>> pack_nibbles(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist()
    [[33, 15]]
    """
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles`` (uint8 ``[rows, n / 2]`` -> ``[rows, n]``)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """6-bit codes (uint8 ``[rows, n]``, ``n`` divisible by 4) -> uint8 ``[rows, 3n / 4]``:
    four codes in three bytes, little-endian (``c0 | c1 << 6 | c2 << 12 | c3 << 18``).

    >>> pack_fp6(torch.tensor([[63, 0, 1, 32]], dtype=torch.uint8)).tolist()
    [[63, 16, 128]]
    """
    c = codes.reshape(codes.shape[0], -1, 4).to(torch.int32)
    v = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    return torch.stack((v & 0xFF, (v >> 8) & 0xFF, v >> 16), dim=-1).reshape(
        codes.shape[0], -1).to(torch.uint8)


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp6`` (uint8 ``[rows, 3n / 4]`` -> ``[rows, n]``)."""
    b = packed.reshape(packed.shape[0], -1, 3).to(torch.int32)
    v = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([(v >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).reshape(
        packed.shape[0], -1).to(torch.uint8)


class BlockWeight(nn.Module):
    """A weight stored in a block-scaled format (see the module docstring for the
    layout); ``forward()`` -> the dequantized weight (float32 arithmetic, as the
    fake-quant it replaces), cast to ``dtype`` (the layer's).

    ``codes`` is a ``BlockCodes`` from ``quantize_blocks`` (blocks along each row: the
    weight's trailing dims flattened). ``row_shape`` keeps the trailing dims; the number
    of rows is read from the stored tensors."""

    def __init__(self, codes: BlockCodes, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        fmt = FORMATS[codes.fmt]
        shape = tuple(codes.shape)
        rows = shape[0] if len(shape) > 1 else 1
        cols = codes.codes.numel() // rows if rows else 0
        if rows == 0 or cols % codes.block:
            raise ValueError(f"a weight of shape {list(shape)} does not split its rows into "
                             f"blocks of {codes.block}")
        self.fmt = codes.fmt
        self.block = codes.block
        self.flat = len(shape) <= 1  # a 1-D tensor: one row
        self.row_shape = shape if self.flat else shape[1:]
        self.out_dtype = dtype
        c = codes.codes.reshape(rows, cols).to(torch.uint8)
        if fmt.bits == 4:
            c = pack_nibbles(c)
        elif fmt.bits == 6:
            c = pack_fp6(c)
        # buffer -> the dtype of its bytes (its state-dict entry's), where not uint8/float32
        self.dtypes: dict[str, torch.dtype] = {}
        self._store("codes", c.contiguous().view(_ELEMENT_DTYPES.get(self.fmt, torch.uint8)))
        scales = codes.scales.reshape(rows, cols // codes.block)
        if fmt.kind == "mx":
            scales = scales.view(torch.float8_e8m0fnu)
        elif fmt.kind == "nf4":
            scales = scales.float()
        self._store("scales", scales.contiguous().clone())
        if codes.tensor_scale is not None:
            self.register_buffer("tensor_scale",
                                 codes.tensor_scale.detach().float().reshape(1).clone())
        else:
            self.tensor_scale = None

    def _store(self, name: str, t: torch.Tensor) -> None:
        if t.dtype not in (torch.uint8, torch.float32):
            self.dtypes[name] = t.dtype
            t = t.view(torch.uint8)
        self.register_buffer(name, t)

    def typed(self, name: str) -> torch.Tensor:
        """Buffer ``name`` in the dtype the state dict gives it."""
        t = getattr(self, name)
        return t.view(self.dtypes[name]) if name in self.dtypes else t

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (its rows read from the stored tensors)."""
        return self.row_shape if self.flat else (self.codes.shape[0], *self.row_shape)

    def element_codes(self) -> torch.Tensor:
        """The elements' codes, one uint8 per element, ``[rows, row]``."""
        raw = self.codes
        bits = FORMATS[self.fmt].bits
        if bits == 4:
            return unpack_nibbles(raw)
        if bits == 6:
            return unpack_fp6(raw)
        return raw

    def block_codes(self) -> BlockCodes:
        """What is stored, as ``quantize_blocks`` returned it."""
        scales = self.scales if FORMATS[self.fmt].kind == "mx" else self.typed("scales")
        ts = None if self.tensor_scale is None else self.tensor_scale.reshape(())
        return BlockCodes(self.fmt, self.block, self.element_codes(), scales.reshape(-1), ts,
                          self.shape)

    def forward(self) -> torch.Tensor:
        return dequantize_blocks(self.block_codes()).to(self.out_dtype)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor],
               recurse: bool = True) -> BlockWeight:
        # The stored dtypes are the format: a cast (.half(), .to(torch.bfloat16)) becomes
        # the dtype forward() returns; a move (.to(device), .cuda(), to_empty) moves the
        # bytes, seen by ``fn`` as uint8 (which casts of floating tensors leave alone).
        for probe in (torch.float32, torch.float16):
            cast = fn(torch.zeros(1, dtype=probe)).dtype
            if cast != probe:
                self.out_dtype = cast
                break
        for name, t in self._buffers.items():
            if t is None:
                continue
            raw = t.view(torch.uint8)
            moved = fn(raw)
            if moved.dtype != torch.uint8:  # Module.type(): a cast of everything
                moved = raw.to(moved.device)
            self._buffers[name] = moved.view(t.dtype)
        return self

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, dtype in self.dtypes.items():
            if prefix + name in destination:
                destination[prefix + name] = destination[prefix + name].view(dtype)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        for name, dtype in self.dtypes.items():
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.dtype in (dtype, torch.uint8):
                state_dict[prefix + name] = t.view(torch.uint8)  # the bytes, not a conversion
            elif isinstance(t, torch.Tensor):
                args[-1].append(f"{prefix}{name}: a {self.fmt} weight stores {dtype}, the "
                                f"state dict gives {t.dtype}")  # error_msgs
                state_dict = {k: v for k, v in state_dict.items() if k != prefix + name}
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return (f"{self.fmt}, block={self.block}, shape={list(self.shape)}, "
                f"dtype={str(self.out_dtype).removeprefix('torch.')}")
