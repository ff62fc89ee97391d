"""Runtime modules of converted graphs (``qc.convert``) that torch does not provide.

- ``IntWeight``: a weight kept as integers (int8, or int4 packed two per byte) with its
  scale(s) and zero point(s); ``forward()`` returns the dequantized float weight, so any op
  (embedding, matmul, a per-group int4 linear...) runs on it. This is the storage path for
  what no integer kernel on the backend computes.
- ``DynamicLinear``: torch's dynamic int8 linear (``quantized::linear_dynamic``, weights
  int8 ahead of time, activation qparams per batch) with the full 8-bit activation range,
  which is what qcompile's dynamic fake-quant simulates (``torch.ao``'s module fixes
  ``reduce_range=True``, i.e. 7-bit activations).
- ``ActivationQParams``: the scale and zero point of one lowered activation quantizer as
  buffers, which the converted graph's code reads (``get_attr``) and passes to
  ``torch.quantize_per_tensor`` and ``add_quantized``: they are in the state dict, so
  ``load_state_dict`` of another calibration's converted graph gives its outputs exactly.
- ``clamp_levels``: the clamp of a reduced (7-bit) activation grid, its bounds taken from
  the quantized tensor's own qparams (nothing baked into the code).

Example:
    >>> import torch
    >>> from qcompile.runtime.quantized import IntWeight
    >>> q = torch.tensor([[-8, 7, 1, 0]], dtype=torch.int8)
    >>> w = IntWeight(q, torch.tensor([0.5]), torch.tensor([0]), axis=0, bits=4)
    >>> w.packed.numel(), w()            # two int4 values per byte
    (2, tensor([[-4.0000,  3.5000,  0.5000,  0.0000]]))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.ao.nn.quantized.dynamic as nnqd
from torch import nn


def _frozen(t: torch.Tensor) -> nn.Parameter:
    """A parameter without gradient: ``fully_shard`` shards parameters, not buffers."""
    return nn.Parameter(t, requires_grad=False)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 values (int8 tensor in [-8, 7], even numel) -> uint8, two per byte: the
    first value in the low nibble."""
    flat = q.reshape(-1).to(torch.int16) & 0xF
    return (flat[0::2] | (flat[1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``pack_int4``: int8 values in [-8, 7]."""
    b = packed.to(torch.int16)
    out = torch.stack((b & 0xF, b >> 4), dim=1).reshape(-1)[:numel]
    return (out - ((out & 0x8) << 1)).to(torch.int8)  # sign-extend the nibble


class IntWeight(nn.Module):
    """An integer-stored weight. ``forward()`` -> ``(q - zero_point) * scale`` in float32,
    the same arithmetic as the fake-quant it replaces (exactly, with float32 scales).

    ``axis`` is the channel axis for per-channel scales; ``group_size`` means per-group
    scales along the flattened trailing dims (rows = dim 0). ``bits=4`` packs two values
    per byte. Scales may be stored in float16 (``qc.convert`` does so for per-group int4
    to meet the size budget), zero points as a single value when they are all equal.

    The integers, scales and zero points are parameters without gradient (not buffers),
    so ``fully_shard`` shards them along dim 0 like any weight and gathers them for the
    forward; the state dict is the same either way. ``by_rows=True`` keeps every tensor
    in a layout that depends only on the scheme, never on the values (no packing, one
    zero point per scale, per-group scales as ``[rows, groups]``): what each rank of a
    sharded conversion stores for its own rows of one global tensor."""

    by_rows: bool = False  # a class default: graphs pickled before it existed load as before

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, *,
                 axis: int | None = None, group_size: int | None = None, bits: int = 8,
                 dtype: torch.dtype = torch.float32, by_rows: bool = False) -> None:
        super().__init__()
        self.shape = tuple(q.shape)
        self.axis = axis
        self.group_size = group_size
        self.bits = bits
        self.out_dtype = dtype
        self.by_rows = by_rows
        if bits <= 4:
            if q.numel() % 2:
                q = torch.cat([q.reshape(-1), q.new_zeros(1)])
            q = pack_int4(q)
        elif by_rows or q.dtype in (torch.int8, torch.uint8):
            pass  # stored as given (int8 / uint8 / int16 grids)
        else:
            q = q.to(torch.int8 if q.min() >= -128 and q.max() <= 127 else torch.int16)
        self.packed = _frozen(q)
        zp = zero_point.to(torch.int32)
        if by_rows and group_size is not None:
            scale, zp = scale.reshape(self.shape[0], -1), zp.reshape(self.shape[0], -1)
        if not by_rows and zp.numel() > 1 and bool((zp == zp.reshape(-1)[0]).all()):
            # symmetric schemes: one zero point, not one per scale (cloned: a slice would
            # keep, and serialize, the whole storage)
            zp = zp.reshape(-1)[:1].clone()
        self.scale = _frozen(scale)
        self.zero_point = _frozen(zp)

    def row_tensors(self) -> tuple[str, ...]:
        """The tensors laid out by the weight's rows (dim 0 = the weight's dim 0), which a
        row-sharded weight shards alike; the others (per-tensor qparams, per-column scales)
        are the same on every rank."""
        rows = ("packed",) if self.bits > 4 else ()
        if self.group_size is None and self.axis != 0:
            return rows
        return rows + tuple(n for n in ("scale", "zero_point")  # one zero point: shared
                            if self.by_rows or getattr(self, n).numel() > 1)

    def integers(self) -> torch.Tensor:
        """The stored integers, unpacked, in the weight's shape."""
        numel = 1
        for d in self.shape:
            numel *= d
        q = unpack_int4(self.packed, numel) if self.bits <= 4 else self.packed
        return q.reshape(self.shape)

    def forward(self) -> torch.Tensor:
        q = self.integers().to(torch.float32)
        scale = self.scale.to(torch.float32)
        zp = self.zero_point.to(torch.float32)
        if self.group_size is not None:
            q = q.reshape(self.shape[0], -1, self.group_size)
            scale = scale.view(self.shape[0], -1, 1)
            zp = zp.view(self.shape[0], -1, 1) if zp.numel() > 1 else zp
        elif self.axis is not None:
            view = [1] * len(self.shape)
            view[self.axis] = -1
            scale = scale.view(view)
            zp = zp.view(view) if zp.numel() > 1 else zp
        return ((q - zp) * scale).reshape(self.shape).to(self.out_dtype)

    def extra_repr(self) -> str:
        kind = (f"per_group({self.group_size})" if self.group_size is not None
                else f"per_channel(axis={self.axis})" if self.axis is not None else "per_tensor")
        return (f"int{self.bits}, shape={list(self.shape)}, {kind}, "
                f"scale={str(self.scale.dtype).removeprefix('torch.')}")


class DynamicLinear(nnqd.Linear):
    """``torch.ao.nn.quantized.dynamic.Linear`` computing activation qparams per batch over
    the range qcompile's dynamic fake-quant simulated: 7 bits (``reduce_range=True``) for
    ``quant.target: x86``, else the full 8 bits (torch.ao's module always reduces)."""

    # a class default, so graphs pickled before the attribute existed load as they were
    reduce_range: bool = False

    def __init__(self, in_features: int, out_features: int, *args: Any,
                 reduce_range: bool = False, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, *args, **kwargs)
        self.reduce_range = reduce_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = torch.ops.quantized.linear_dynamic(x, self._packed_params._packed_params,
                                               self.reduce_range)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, reduce_range={self.reduce_range}"

    def _get_name(self) -> str:
        return "DynamicQuantizedLinear"


class ActivationQParams(nn.Module):
    """A lowered activation quantizer's qparams on the ``quint8`` grid, as buffers:
    ``scale`` (float32, shape [1]) and ``zero_point`` (int32, shape [1]); ``levels`` is the
    highest level the target uses (127 for x86's 7-bit activations, else 255). Nothing
    calls it: the graph reads its buffers with ``get_attr``.

    Example:
        >>> qp = ActivationQParams(torch.tensor([0.5]), 3, levels=127)
        >>> sorted(qp.state_dict()), qp
        (['scale', 'zero_point'], ActivationQParams(quint8, levels 0..127))
        >>> torch.quantize_per_tensor(torch.tensor([1.0]), qp.scale, qp.zero_point,
        ...                           torch.quint8).int_repr()
        tensor([5], dtype=torch.uint8)
    """

    def __init__(self, scale: torch.Tensor, zero_point: int, *, levels: int = 255) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().to(torch.float32).reshape(1).clone())
        # on the scale's device: quantize_per_tensor wants both where the value is
        self.register_buffer("zero_point", torch.tensor([zero_point], dtype=torch.int32,
                                                        device=scale.device))
        self.levels = levels

    def extra_repr(self) -> str:
        return f"quint8, levels 0..{self.levels}"


def clamp_levels(q: torch.Tensor, levels: int) -> torch.Tensor:
    """A ``quint8`` tensor clamped to levels ``0..levels`` of its own grid: quint8 kernels
    clamp at 255, a 7-bit fake-quant grid at 127. The float bounds come from ``q``'s own
    scale and zero point, so a graph whose qparams are loaded from a state dict clamps on
    the new grid.

    Example:
        >>> q = torch.quantize_per_tensor(torch.tensor([0.0, 1.0, 9.0]), 0.05, 10,
        ...                               torch.quint8)
        >>> clamp_levels(q, 127).int_repr().tolist()
        [10, 30, 127]
    """
    scale, zero_point = q.q_scale(), q.q_zero_point()
    if q.device.type != "cpu":  # CUDA has no quantized clamp: the same levels as integers
        return torch._make_per_tensor_quantized_tensor(q.int_repr().clamp(max=levels), scale,
                                                       zero_point)
    return torch.clamp(q, (0 - zero_point) * scale, (levels - zero_point) * scale)


def add_quantized(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                  zero_point: torch.Tensor, relu: bool = False) -> torch.Tensor:
    """``quantized::add`` (``add_relu`` with ``relu``) of two ``quint8`` tensors, with the
    output qparams read from tensors (an ``ActivationQParams``' buffers) rather than
    constants in the graph's code.

    Example:
        >>> a = torch.quantize_per_tensor(torch.tensor([1.0, -2.0]), 0.1, 64, torch.quint8)
        >>> out = add_quantized(a, a, torch.tensor([0.1]), torch.tensor([64]), relu=True)
        >>> out.dequantize().tolist()
        [2.0, 0.0]
    """
    fn = torch.ops.quantized.add_relu if relu else torch.ops.quantized.add
    return fn(a, b, float(scale), int(zero_point))
