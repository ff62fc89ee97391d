"""A pure-PyTorch reference of the integer arithmetic of torch's x86 int8 kernels.

fbgemm and onednn (``torch.ops.quantized.linear`` / ``conv2d`` / ``linear_dynamic`` on
the ``x86``, ``fbgemm`` and ``onednn`` engines) compute ``u8 activation x s8 weight``
products with one of two instructions:

- without VNNI (AVX2, AVX-512 before Cascade Lake): ``vpmaddubsw`` multiplies u8 by s8
  and adds *adjacent pairs* of products into int16 **with saturation** (to
  [-32768, 32767]); ``vpmaddwd`` then widens to int32, where the rest is summed exactly;
- with VNNI (``vpdpbusd``): products summed in int32, exactly.

The products are of the *stored* integers (the u8 activation with its zero point in it);
the zero points are taken out afterwards, exactly, through row and column sums. A pair
saturates when ``|a_k * b_k + a_{k+1} * b_{k+1}| > 32767``: with full-range activations
(``255 * -128 * 2 = -65280``) it can, with 7-bit ones (``127 * -128 * 2 = -32512``) it
never does. That is the whole reason for ``quant.target: x86``.

Everything here runs on int64 tensors (exact), except the requantization, which follows
the kernels: ``acc * (x_scale * w_scale) + bias`` in float, divided by the output scale,
rounded half to even, plus the output zero point, clamped.

Example:
    >>> import torch
    >>> x = torch.tensor([[255, 255]])              # u8, zero point 0
    >>> w = torch.tensor([[-128, -128]])            # s8
    >>> accumulate(x, w, vnni=True).item()          # exact
    -65280
    >>> accumulate(x, w, vnni=False).item()         # the pair saturates in int16
    -32768
    >>> accumulate(x // 2, w, vnni=False).item()    # 7-bit activations never do
    -32512
"""

from __future__ import annotations

import re
from functools import cache

import torch
import torch.nn.functional as F

INT16_MIN, INT16_MAX = -(2**15), 2**15 - 1
# Elements of the [M, N, K/2] pair tensor per chunk (int64: 8 bytes each).
_CHUNK = 1 << 23


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


@cache
def cpu_has_vnni() -> bool:
    """Whether fbgemm's int8 kernels accumulate exactly on this CPU: AVX-512 VNNI (torch's
    own probe where it has one). AVX-VNNI alone (no AVX-512) does not count: fbgemm runs
    its AVX2 kernels there (onednn may not)."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    if probe is not None:
        return bool(probe())
    return "avx512_vnni" in cpu_flags()


def quantize(x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int,
             quant_min: int, quant_max: int) -> torch.Tensor:
    """``clamp(round_half_even(x / scale) + zero_point)`` as int64 (scale and zero point
    broadcast against ``x``)."""
    q = torch.round(x.double() / torch.as_tensor(scale, dtype=torch.float64))
    q = q + torch.as_tensor(zero_point, dtype=torch.float64)
    return q.clamp(quant_min, quant_max).to(torch.int64)


def accumulate(xq: torch.Tensor, wq: torch.Tensor, *, vnni: bool) -> torch.Tensor:
    """``sum_k xq[m, k] * wq[n, k]`` as the kernel's int32 accumulator holds it: ``[M, N]``.

    ``xq`` [M, K] (u8 values, zero point included), ``wq`` [N, K] (s8 values). Without
    VNNI the products of adjacent pairs along K (k = 0 and 1, 2 and 3, ...; an odd K is
    padded with a zero) are added in int16 with saturation first."""
    xq, wq = xq.to(torch.int64), wq.to(torch.int64)
    if vnni:
        return xq @ wq.t()
    m, k = xq.shape
    n = wq.shape[0]
    if k % 2:
        xq, wq = F.pad(xq, (0, 1)), F.pad(wq, (0, 1))
        k += 1
    xp, wp = xq.view(m, k // 2, 2), wq.view(n, k // 2, 2)
    out = torch.empty(m, n, dtype=torch.int64)
    rows = max(1, _CHUNK // max(1, n * k // 2))
    for i in range(0, m, rows):
        a = xp[i:i + rows, None]  # [r, 1, K/2, 2]
        pairs = (a * wp[None]).sum(-1)  # [r, N, K/2]: each pair in int64, exactly
        out[i:i + rows] = pairs.clamp_(INT16_MIN, INT16_MAX).sum(-1)
    return out


def linear_acc(xq: torch.Tensor, x_zero_point: int, wq: torch.Tensor,
               w_zero_point: torch.Tensor | int, *, vnni: bool) -> torch.Tensor:
    """``sum_k (xq - x_zp) * (wq - w_zp)`` as the kernel computes it: the products of the
    stored integers (saturating pairs without VNNI), then the zero points taken out with
    row sums of ``xq`` and column sums of ``wq`` (exact). ``w_zero_point``: one per output
    channel or a scalar. [M, N] int64."""
    k = xq.shape[1]
    raw = accumulate(xq, wq, vnni=vnni)
    wz = torch.as_tensor(w_zero_point, dtype=torch.int64).reshape(-1)
    col = wq.to(torch.int64).sum(1) - wz * k  # [N]
    row = xq.to(torch.int64).sum(1, keepdim=True)  # [M, 1]
    return raw - x_zero_point * col[None, :] - wz[None, :] * row


def requantize(acc: torch.Tensor, x_scale: float, w_scale: torch.Tensor | float,
               bias: torch.Tensor | None, out_scale: float, out_zero_point: int,
               quant_min: int = 0, quant_max: int = 255) -> torch.Tensor:
    """The output integers: ``clamp(round_half_even((acc * x_scale * w_scale + bias) /
    out_scale) + out_zero_point)`` ([M, N] int64)."""
    y = dequantize_acc(acc, x_scale, w_scale, bias)
    return quantize(y, out_scale, out_zero_point, quant_min, quant_max)


def dequantize_acc(acc: torch.Tensor, x_scale: float, w_scale: torch.Tensor | float,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``acc * x_scale * w_scale[n] + bias[n]`` in float64 (the float output)."""
    ws = torch.as_tensor(w_scale, dtype=torch.float64).reshape(-1)
    y = acc.double() * (float(x_scale) * ws)[None, :]
    if bias is not None:
        y = y + bias.detach().double()[None, :]
    return y


def linear(xq: torch.Tensor, x_scale: float, x_zero_point: int, wq: torch.Tensor,
           w_scale: torch.Tensor | float, w_zero_point: torch.Tensor | int,
           bias: torch.Tensor | None, out_scale: float, out_zero_point: int, *, vnni: bool,
           quant_min: int = 0, quant_max: int = 255, relu: bool = False) -> torch.Tensor:
    """``quantized::linear`` (``relu``: ``linear_relu``): output integers [M, N] (int64)
    from input integers ``xq`` [M, K] and weight integers ``wq`` [N, K]."""
    acc = linear_acc(xq, x_zero_point, wq, w_zero_point, vnni=vnni)
    y = dequantize_acc(acc, x_scale, w_scale, bias)
    if relu:
        y = y.clamp(min=0)
    return quantize(y, out_scale, out_zero_point, quant_min, quant_max)


def choose_qparams(x: torch.Tensor, *, reduce_range: bool) -> tuple[float, int]:
    """The activation qparams the dynamic kernels pick for ``x`` (fbgemm's
    ``ChooseQuantizationParams`` over [0, 255], or [0, 127] with ``reduce_range``): the
    range extended to hold 0, ``scale = (max - min) / (qmax - qmin)``, zero point rounded
    and clamped."""
    qmax = 127 if reduce_range else 255
    lo = min(float(x.min()), 0.0)
    hi = max(float(x.max()), 0.0)
    scale = (hi - lo) / qmax
    if scale == 0.0:
        scale = 0.1  # fbgemm's choice for an all-zero tensor
    scale = float(torch.tensor(scale, dtype=torch.float32))
    zp = min(max(round(-lo / scale), 0), qmax)
    return scale, int(zp)


def linear_dynamic(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor | float,
                   w_zero_point: torch.Tensor | int, bias: torch.Tensor | None, *,
                   reduce_range: bool, vnni: bool) -> torch.Tensor:
    """``quantized::linear_dynamic``: activations quantized per batch (``choose_qparams``),
    the integer product, dequantized with bias (float64 [M, N])."""
    scale, zp = choose_qparams(x, reduce_range=reduce_range)
    qmax = 127 if reduce_range else 255
    xq = quantize(x, scale, zp, 0, qmax)
    acc = linear_acc(xq, zp, wq, w_zero_point, vnni=vnni)
    return dequantize_acc(acc, scale, w_scale, bias)


def unfold_conv2d(xq: torch.Tensor, kernel_size: tuple[int, int], *, stride: int = 1,
                  padding: int = 0, dilation: int = 1, pad_value: int = 0) -> torch.Tensor:
    """im2col of an integer [N, C, H, W] tensor as fbgemm lays it out: one row per output
    position (N*OH*OW rows), K ordered (kh, kw, c) with channels fastest (NHWC), so that
    adjacent pairs along K are neighbouring channels. Padding holds ``pad_value`` (the
    input zero point: a padded zero in float)."""
    if padding:
        xq = F.pad(xq, (padding,) * 4, value=pad_value)
    n, c = xq.shape[:2]
    cols = F.unfold(xq.double(), kernel_size, dilation=dilation, stride=stride)  # exact
    kk = kernel_size[0] * kernel_size[1]
    cols = cols.view(n, c, kk, -1).permute(0, 3, 2, 1)  # [N, L, kh*kw, C]
    return cols.reshape(-1, kk * c).round().to(torch.int64)


def conv2d(xq: torch.Tensor, x_scale: float, x_zero_point: int, wq: torch.Tensor,
           w_scale: torch.Tensor | float, w_zero_point: torch.Tensor | int,
           bias: torch.Tensor | None, out_scale: float, out_zero_point: int, *, vnni: bool,
           stride: int = 1, padding: int = 0, dilation: int = 1, quant_min: int = 0,
           quant_max: int = 255) -> torch.Tensor:
    """``quantized::conv2d`` (groups=1): output integers [N, OC, OH, OW] (int64), as a
    linear over fbgemm's im2col (``unfold_conv2d``)."""
    n, _, h, w = xq.shape
    oc, ic, kh, kw = wq.shape
    cols = unfold_conv2d(xq, (kh, kw), stride=stride, padding=padding, dilation=dilation,
                         pad_value=x_zero_point)
    wmat = wq.to(torch.int64).permute(0, 2, 3, 1).reshape(oc, kh * kw * ic)  # (kh, kw, c)
    out = linear(cols, x_scale, x_zero_point, wmat, w_scale, w_zero_point, bias, out_scale,
                 out_zero_point, vnni=vnni, quant_min=quant_min, quant_max=quant_max)
    oh = (h + 2 * padding - dilation * (kh - 1) - 1) // stride + 1
    ow = (w + 2 * padding - dilation * (kw - 1) - 1) // stride + 1
    return out.view(n, oh, ow, oc).permute(0, 3, 1, 2)
