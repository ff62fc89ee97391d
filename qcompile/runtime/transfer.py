"""Quantized activations across pipeline cuts (``pipeline.transfer: int8``).

A value crossing a stage boundary that is already the output of an integer fake-quantizer
(8 bits or fewer, fixed qparams) is sent as its integer payload plus its scale and zero
point, and dequantized by the stage that uses it. The receiver computes
``(q - zero_point) * scale`` exactly as the quantizer did, so the result is bit-identical
to sending the float tensor, with a quarter of the bytes.

A quantizer that is off (a static graph before or during ``qc.calibrate``: its observers
record, its output is not yet on an integer grid) has no integers behind its output, so
the value crosses as the float tensor itself and the receiver takes it as it is. Calibration
therefore sees exactly what it sees with ``transfer: fp32``, and once the quantizers are on
the integers cross. (A torch pipeline schedule fixes the payload's dtype when it is built:
calibrate before building it.)

Integers carry no gradient: packing refuses tensors that autograd is tracking, so a
training step with ``transfer: int8`` fails loudly instead of silently cutting the
backward pass. Use it for forward-only pipelines (``torch.no_grad()``, ``schedule.eval``).

Example:
    >>> import torch
    >>> from qcompile.runtime.fake_quant import FakeQuantize
    >>> fq = FakeQuantize("uint8", symmetric=False)
    >>> y = fq(torch.randn(4, 8))
    >>> q = pack(y, fq.scale, fq.zero_point, None, 0, 255, fq.mode_flags)
    >>> q.dtype, torch.equal(unpack(q, fq.scale, fq.zero_point, None, torch.float32), y)
    (torch.uint8, True)
    >>> fq.enabled = False               # not calibrated yet: the float crosses as it is
    >>> pack(y, fq.scale, fq.zero_point, None, 0, 255, fq.mode_flags) is y
    True
"""

from __future__ import annotations

import torch

from qcompile.errors import QCompileError


def _view(t: torch.Tensor, x: torch.Tensor, axis: int | None) -> torch.Tensor:
    if axis is None:
        return t
    shape = [1] * x.dim()
    shape[axis] = -1
    return t.view(shape)


def payload_dtype(quant_min: int, quant_max: int) -> torch.dtype:
    return torch.uint8 if quant_min >= 0 else torch.int8


def pack(y: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None,
         quant_min: int, quant_max: int, flags: torch.Tensor | None = None) -> torch.Tensor:
    """The integers behind a fake-quantized tensor ``y``. ``flags`` is the quantizer's
    ``mode_flags`` buffer: a quantizer that is off (a static graph before or during
    calibration) produced floats with no integers behind them, and ``y`` itself is
    returned (``unpack`` passes floats through)."""
    if flags is not None and not bool(flags[0]):
        return y
    if torch.is_grad_enabled() and y.requires_grad:
        raise QCompileError(
            "pipeline.transfer: int8 sends integers, which carry no gradient",
            fix="run forward-only (torch.no_grad() or schedule.eval(...)), or set "
            "pipeline.transfer: fp32 for training")
    s = _view(scale, y, axis)
    zp = _view(zero_point.to(torch.float32), y, axis)
    q = torch.round(y.float() / s) + zp
    return q.clamp_(quant_min, quant_max).to(payload_dtype(quant_min, quant_max))


def unpack(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None,
           dtype: torch.dtype) -> torch.Tensor:
    """Dequantize a payload exactly as ``FakeQuantize`` computed its output; a float
    payload (its quantizer was off) is the value itself."""
    if q.is_floating_point():
        return q.to(dtype)
    s = _view(scale, q, axis)
    zp = _view(zero_point.to(torch.float32), q, axis)
    return ((q.to(torch.float32) - zp) * s).to(dtype)
