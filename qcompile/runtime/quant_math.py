"""Quantization arithmetic: qparams from ranges, and fake-quant with its gradients.

The numerics every quantizer follows (and the property tests check against an
independent reference):

    q   = clamp(round_half_even(x / scale) + zero_point, quant_min, quant_max)
    out = (q - zero_point) * scale

computed in float32 whatever the input dtype, with a straight-through gradient that is
1 where ``round(x / scale) + zero_point`` lies in ``[quant_min, quant_max]`` and 0
outside. fp8 formats fake-quantize by casting ``x / scale`` to the format (round to
nearest even, saturating at the largest finite value).

On CPU, ``fake_quantize`` runs the fused C++ kernels of ``qcompile.runtime.kernels`` (the same
bits, one pass forward and one backward); other devices, and machines without a C++
compiler, run the eager autograd Functions below (``fake_quantize_eager``).

Example:
    >>> import torch
    >>> from qcompile.runtime.quant_math import qparams_from_minmax, fake_quantize
    >>> s, z = qparams_from_minmax(torch.tensor([-1.0]), torch.tensor([1.0]), -128, 127, True)
    >>> fake_quantize(torch.tensor([0.5]), s, z, -128, 127)
    tensor([0.5039])
"""

from __future__ import annotations

import math

import torch

from qcompile.runtime import kernels

_EPS = torch.finfo(torch.float32).eps

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Where round-to-nearest-even stops landing on the largest finite value: max + ulp(max)/2
# (e4m3: 448 + 32/2, e5m2: 57344 + 8192/2). Inside it the gradient passes, as for the
# integer path's round(x / scale) in [quant_min, quant_max].
_FP8_ROUNDS_IN = {"fp8_e4m3": 464.0, "fp8_e5m2": 61440.0}


def div_by(a: torch.Tensor, b: float) -> torch.Tensor:
    """``a / b`` for float32 ``a`` and a number ``b``, rounded as an IEEE float32 division,
    the same bits on every device, eager or under ``torch.compile``.

    A float32 ``/`` by a constant is not that everywhere: CUDA divides a tensor by a Python
    number through its reciprocal, and Inductor's GPU kernels multiply by the reciprocal
    of any constant divisor (a ``full_like`` one too). In float64 either way is close
    enough: the quotient of a 24-bit float by a divisor of a few significant bits never
    lies within float64's error of a point halfway between two float32 values, so
    rounding the float64 result to float32 gives the IEEE float32 quotient (exhaustive
    checks of the divisors used here over 29M float32 values, subnormals included).

    Example:
        >>> x = torch.tensor([1.0, 3e-39, 250.7])
        >>> torch.equal(div_by(x, 255), x / torch.full_like(x, 255))
        True
    """
    if a.device.type == "mps":  # no float64 there
        return a / torch.full_like(a, b)
    return (a.double() / b).float()


def symmetric_zero_point(quant_min: int, quant_max: int) -> int:
    """0 for signed ranges, the middle of the range for unsigned ones (128 for uint8)."""
    return 0 if quant_min < 0 else (quant_min + quant_max + 1) // 2


def qparams_from_minmax(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    quant_min: int,
    quant_max: int,
    symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float32) and zero point (int32) covering ``[min_val, max_val]`` and 0.

    Constant and all-zero ranges give ``scale = eps`` instead of dividing by zero; a range
    never observed (min=+inf, max=-inf) behaves like all zeros.
    """
    min_neg = torch.clamp(min_val.float(), max=0.0)
    max_pos = torch.clamp(max_val.float(), min=0.0)
    if symmetric:
        zp = symmetric_zero_point(quant_min, quant_max)
        # Divide by the shorter side of the range so the largest |x| is never clipped.
        steps = min(quant_max - zp, zp - quant_min)
        scale = torch.clamp(div_by(torch.maximum(-min_neg, max_pos), steps), min=_EPS)
        return scale, torch.full_like(scale, zp, dtype=torch.int32)
    scale = torch.clamp(div_by(max_pos - min_neg, quant_max - quant_min), min=_EPS)
    zero_point = torch.clamp(quant_min - torch.round(min_neg / scale), quant_min, quant_max)
    return scale, zero_point.to(torch.int32)


def fp8_scale_from_minmax(
    min_val: torch.Tensor, max_val: torch.Tensor, fp8_max: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale mapping the largest |x| to the format's largest finite value; zero point 0."""
    amax = torch.maximum(-torch.clamp(min_val.float(), max=0.0),
                         torch.clamp(max_val.float(), min=0.0))
    scale = torch.clamp(div_by(amax, fp8_max), min=_EPS)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


def _grid(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
          quant_max: int, *, mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dequantize(quantize(x))`` and, with ``mask``, where ``x`` lies inside the range.

    Eager: one buffer updated in place (the same arithmetic, fewer passes). Under
    ``torch.compile``: the same ops out of place, the form Inductor is written for (it
    fuses them into one kernel either way)."""
    if torch.compiler.is_compiling():
        q = torch.round(x / scale) + zero_point
        inside = ((q >= quant_min) & (q <= quant_max)) if mask else None
        return (torch.clamp(q, quant_min, quant_max) - zero_point) * scale, inside
    q = torch.div(x, scale).round_().add_(zero_point)
    inside = None
    if mask:
        inside = q >= quant_min
        inside &= q <= quant_max
    return q.clamp_(quant_min, quant_max).sub_(zero_point).mul_(scale), inside


class _FakeQuantSTE(torch.autograd.Function):
    """Fixed-scale fake-quant; gradient passes straight through inside the range."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, quant_min, quant_max):  # type: ignore[override]
        out, mask = _grid(x, scale, zero_point, quant_min, quant_max, mask=True)
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return grad * mask, None, None, None, None


class _FakeQuantSTEWeight(torch.autograd.Function):
    """``_FakeQuantSTE`` of a weight: saves the weight (what the float layer keeps anyway;
    under FSDP2 the unsharded parameter, freed and gathered again as for the float layer)
    and the qparams instead of a one-byte-per-element mask, which the backward
    recomputes. The same arithmetic, the same bits, forward and backward."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, quant_min, quant_max):  # type: ignore[override]
        ctx.save_for_backward(x, scale, zero_point)
        ctx.qrange = (quant_min, quant_max)
        out, _ = _grid(x.float(), scale, zero_point, quant_min, quant_max, mask=False)
        # no .to() that returns its input: an autograd.Function whose forward returned
        # such an alias got a zero gradient under torch.compile in torch 2.11
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale, zero_point = ctx.saved_tensors
        quant_min, quant_max = ctx.qrange
        q = torch.div(x.float(), scale).round_().add_(zero_point)
        mask = (q >= quant_min) & (q <= quant_max)
        return (grad.float() * mask).to(x.dtype), None, None, None, None


class _FakeQuantLSQ(torch.autograd.Function):
    """Learned step size quantization (Esser et al., 2020): the gradient also reaches the
    scale, ``d out / d scale = q - zp - x/scale`` inside the range and ``q - zp`` at the
    clamp, times ``grad_factor = 1 / sqrt(numel_per_scale * quant_max)``."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, quant_min, quant_max, grad_factor):  # type: ignore[override]
        ctx.save_for_backward(x, scale, zero_point)
        ctx.qrange = (quant_min, quant_max, grad_factor)
        return _grid(x, scale, zero_point, quant_min, quant_max, mask=False)[0]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale, zero_point = ctx.saved_tensors
        quant_min, quant_max, grad_factor = ctx.qrange
        xs = x / scale
        q = torch.round(xs) + zero_point
        inside = (q >= quant_min) & (q <= quant_max)
        qc = torch.clamp(q, quant_min, quant_max)
        grad_scale = grad * torch.where(inside, qc - zero_point - xs, qc - zero_point)
        grad_scale = grad_scale.sum_to_size(scale.shape) * grad_factor
        return grad * inside, grad_scale, None, None, None, None


# A learned scale never goes below exp(-60) (~1e-26) of its reference: strictly positive
# and normal in float32 for any reference >= 1e-12 (observers give >= 1.2e-7), so x / scale
# stays finite even where exp would underflow. Below that the gradient keeps the slope at
# the bound (it never vanishes, the scale is not stuck by a zero gradient); a scale this
# small quantizes every value to 0 or the clamp already.
_LOG_FLOOR = -60.0


class _LearnedScale(torch.autograd.Function):
    """``learned_scale`` as one autograd node: ``d scale / d offset`` is 1 above the
    reference and ``exp(offset / ref)`` below it, which is the ``below`` it saves."""

    @staticmethod
    def forward(ctx, offset, ref):  # type: ignore[override]
        below = torch.div(offset, ref).clamp_(_LOG_FLOOR, 0.0).exp_()  # e^z below, 1 above
        ctx.save_for_backward(below)
        return torch.addcmul(offset.clamp(min=0.0), below, ref)  # ref * below + max(u, 0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (below,) = ctx.saved_tensors
        return grad * below, None


def learned_scale(offset: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The scale of a learnable (LSQ) quantizer from its parameter ``offset`` and its
    reference scale ``ref`` (> 0): ``ref + offset`` for ``offset >= 0`` and
    ``ref * exp(offset / ref)`` below (at least ``ref * exp(-60)``), so it is positive
    whatever value training gives ``offset``.

    Why this shape: ``offset`` is in the scale's own units and ``d scale / d offset = 1`` at
    ``offset = 0`` (where every (re)initialisation puts it), so an optimizer's first steps
    move the scale exactly as they moved a plain scale parameter (SGD and Adam alike, with
    LSQ's gradient factor as the paper applies it); growth stays linear (as before: no
    overflow), and a decrease is geometric: each step that would have taken the scale
    below zero shrinks it by a factor instead. A plain ``exp(log_scale)`` (gradient
    ``scale * dL/dscale``) would move scales ~1/scale times slower under Adam (and scale^2
    under SGD), and fixed scales clip weights that outgrow them: measured, it trained far
    worse. ``C^1``: value and slope agree at ``offset = 0``.

    Example:
        >>> import torch
        >>> ref = torch.tensor([0.5, 0.5, 0.5])
        >>> learned_scale(torch.tensor([0.25, 0.0, -1.0]), ref)
        tensor([0.7500, 0.5000, 0.0677])
    """
    return _LearnedScale.apply(offset, ref)


class _FakeQuantFP8(torch.autograd.Function):
    """Cast-based fp8 fake-quant, saturating at +-fp8_max; STE where the value rounds to a
    finite value of the format."""

    @staticmethod
    def forward(ctx, x, scale, fp8_dtype, fp8_max, rounds_in):  # type: ignore[override]
        xs = x / scale
        mask = xs.abs() < rounds_in
        out = torch.clamp(xs, -fp8_max, fp8_max).to(fp8_dtype).to(xs.dtype) * scale
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return grad * mask, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    quant_min: int,
    quant_max: int,
    *,
    learnable: bool = False,
    batch: int = 1,
    weight: bool = False,
) -> torch.Tensor:
    """Fake-quantize ``x`` with ``scale``/``zero_point`` already shaped to broadcast
    against it. Math runs in float32; the result has ``x``'s dtype. With ``learnable``,
    LSQ's gradient factor counts ``x.numel() / scale.numel() / batch`` elements.
    ``weight``: ``x`` is a weight (a parameter, kept by its layer anyway): the eager
    straight-through node saves it rather than a mask (the CPU kernels keep a 1-bit mask).

    CPU tensors run the fused kernels of ``qcompile.runtime.kernels`` (bit-identical results,
    one pass each way); other devices, or no C++ compiler, run ``fake_quantize_eager``."""
    factor = lsq_grad_factor(x, scale, quant_max, batch) if learnable else 0.0
    if _fused(x, scale, zero_point):
        ops = torch.ops.qcompile  # loaded by kernels.available()
        if learnable:
            return ops.fake_quant_lsq(x, scale, zero_point, quant_min, quant_max, factor)
        return ops.fake_quant(x, scale, zero_point, quant_min, quant_max)
    if weight and not learnable and torch.is_grad_enabled() and x.requires_grad:
        zp = zero_point.to(torch.float32)
        return _FakeQuantSTEWeight.apply(x, scale, zp, quant_min, quant_max)
    return fake_quantize_eager(x, scale, zero_point, quant_min, quant_max,
                               learnable=learnable, grad_factor=factor)


def lsq_grad_factor(x: torch.Tensor, scale: torch.Tensor, quant_max: int, batch: int) -> float:
    """LSQ's gradient scale ``1 / sqrt(n * quant_max)``, ``n`` the elements per scale (per
    example when ``batch`` > 1)."""
    n = max(x.numel() // max(scale.numel(), 1) // max(batch, 1), 1)
    return 1.0 / math.sqrt(n * max(quant_max, 1))


def fake_quantize_eager(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    quant_min: int,
    quant_max: int,
    *,
    learnable: bool = False,
    grad_factor: float = 1.0,
) -> torch.Tensor:
    """The tensor-op formulation (any device): the reference the fused kernels match."""
    xf = x.float()
    zp = zero_point.to(torch.float32)
    if learnable:
        out = _FakeQuantLSQ.apply(xf, scale, zp, quant_min, quant_max, grad_factor)
    else:
        out = _FakeQuantSTE.apply(xf, scale, zp, quant_min, quant_max)
    return out.to(x.dtype)


def _fused(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> bool:
    """Whether the fused CPU kernels take this call: CPU, floating point, and qparams that
    broadcast to ``x``'s own shape (the eager formula would grow the output otherwise).

    Never while ``torch.compile`` (dynamo) traces: the C++ operators are opaque to
    Inductor (an extern call each way), the eager formula is elementwise tensor ops that
    Inductor fuses with its neighbours into one kernel forward and one backward, on CPU
    and CUDA. ``torch.export`` (non-strict) still records the operator, for deployment."""
    if torch.compiler.is_dynamo_compiling():
        return False
    if not (x.is_cpu and x.is_floating_point() and kernels.available()):
        return False
    shape = x.shape
    return _fits(scale, shape) and _fits(zero_point, shape)


def _fits(t: torch.Tensor, shape: torch.Size) -> bool:
    """``t`` broadcasts to ``shape`` without growing it."""
    k, nd = t.dim(), len(shape)
    if k > nd:
        return False
    if t.numel() == 1:
        return True
    for a, b in zip(t.shape, shape[nd - k:]):  # noqa: SIM110  (no generator: per-call cost)
        if a != 1 and a != b:
            return False
    return True


def fake_quantize_fp8(
    x: torch.Tensor, scale: torch.Tensor, fmt: str, fp8_max: float, *, weight: bool = False
) -> torch.Tensor:
    """Fake-quantize ``x`` to an fp8 format (``fp8_e4m3`` / ``fp8_e5m2``). ``weight``: as
    for ``fake_quantize``, the node saves the weight, not a mask."""
    if weight and torch.is_grad_enabled() and x.requires_grad:
        return _FakeQuantFP8Weight.apply(x, scale, FP8_DTYPES[fmt], fp8_max,
                                         _FP8_ROUNDS_IN[fmt])
    out = _FakeQuantFP8.apply(x.float(), scale, FP8_DTYPES[fmt], fp8_max, _FP8_ROUNDS_IN[fmt])
    return out.to(x.dtype)


class _FakeQuantFP8Weight(torch.autograd.Function):
    """``_FakeQuantFP8`` of a weight: saves the weight and scale, not a mask (see
    ``_FakeQuantSTEWeight``); the same bits."""

    @staticmethod
    def forward(ctx, x, scale, fp8_dtype, fp8_max, rounds_in):  # type: ignore[override]
        ctx.save_for_backward(x, scale)
        ctx.rounds_in = rounds_in
        xs = x.float() / scale
        out = torch.clamp(xs, -fp8_max, fp8_max).to(fp8_dtype).to(xs.dtype) * scale
        return out if out.dtype == x.dtype else out.to(x.dtype)  # (see _FakeQuantSTEWeight)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale = ctx.saved_tensors
        mask = (x.float() / scale).abs() < ctx.rounds_in
        return (grad.float() * mask).to(x.dtype), None, None, None, None
