"""Fake-quant exactly on rounding ties, in bfloat16 (and float16 / float32), against an
independent reference.

Inputs are built so that ``x / scale`` is exactly ``k + 0.5``: ``x = (k + 0.5) * scale``
with ``(2k + 1) * mantissa(scale)`` small enough for the input dtype, so ``x`` is
representable and the float32 division is exact. Round half to even then picks the even
neighbour (``0.5 -> 0``, ``1.5 -> 2``, ``-2.5 -> -2``), which decides both the output and
whether the straight-through gradient passes at the clamp edges (``127.5 -> 128`` is out of
an int8 range, ``-128.5 -> -128`` is in). The reference is numpy in float64
(``numpy.rint`` rounds half to even), the output cast to the input dtype last; the paths
under test are the fused C++ kernels (every instruction set this CPU has) and the eager
formula (``fake_quantize_eager``, what ``QCOMPILE_NO_EXT=1`` runs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qcompile.runtime import kernels, quant_math

OPS = kernels.load()

# (quant_min, quant_max, zero_point)
RANGES = {"int8": (-128, 127, 0), "uint8_zp": (0, 255, 100), "int4_zp": (-8, 7, -3)}
# scales with few mantissa bits, so (k + 0.5) * scale fits bfloat16's 8 bits
SCALES = (0.5, 0.75, 2.0 ** -6, 3.0 * 2.0 ** -9)


def _paths() -> list[str]:
    paths = ["eager"]
    if OPS is not None:
        paths += ["ext", "ext-base"]
        if OPS.fake_quant_isa() in ("avx2", "avx512"):
            paths.append("ext-avx2")
    return paths


def tie_inputs(scale: float, qmin: int, qmax: int, zp: int, dtype: torch.dtype
               ) -> np.ndarray:
    """Every ``(k + 0.5) * scale`` representable in ``dtype`` with ``k + zp`` from two steps
    below ``qmin`` to two above ``qmax``: both signs, even and odd ``k``, the clamp edges."""
    k = np.arange(qmin - zp - 2, qmax - zp + 3, dtype=np.float64)
    x = (k + 0.5) * scale
    exact = torch.from_numpy(x).to(dtype).double().numpy() == x
    return x[exact]


def reference(x: np.ndarray, scale: float, qmin: int, qmax: int, zp: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """(output, straight-through mask) from the definition, in float64."""
    q = np.rint(x / scale) + zp  # half to even
    mask = (q >= qmin) & (q <= qmax)
    return (np.clip(q, qmin, qmax) - zp) * scale, mask


def run(path: str, x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int,
        monkeypatch: pytest.MonkeyPatch, learnable: bool = False
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    monkeypatch.setenv("QCOMPILE_FQ_ISA", {"ext-base": "base", "ext-avx2": "avx2"}.get(path, ""))
    xl = x.clone().requires_grad_(True)
    sl = s.clone().requires_grad_(learnable)
    if path == "eager":
        y = quant_math.fake_quantize_eager(xl, sl, z, qmin, qmax, learnable=learnable,
                                           grad_factor=0.5)
    else:
        assert quant_math._fused(xl, sl, z)  # the C++ kernels take this call
        ops = torch.ops.qcompile
        y = (ops.fake_quant_lsq(xl, sl, z, qmin, qmax, 0.5) if learnable
             else ops.fake_quant(xl, sl, z, qmin, qmax))
    # a gradient of distinct values: a wrong mask entry shows
    grad = (torch.arange(y.numel(), dtype=torch.float32) % 7 + 1).reshape(y.shape).to(y.dtype)
    y.backward(grad)
    return y.detach(), xl.grad, (sl.grad if learnable else None)


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qrange", list(RANGES))
def test_ties_round_half_to_even(path: str, dtype: torch.dtype, qrange: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    qmin, qmax, zp = RANGES[qrange]
    clamped = 0
    for scale in SCALES:
        xs = tie_inputs(scale, qmin, qmax, zp, dtype)
        assert len(xs) >= 8, (scale, dtype)
        # both signs, even and odd k, and ties just outside and inside each clamp edge
        k = np.floor(xs / scale)
        assert (xs > 0).any() and (xs < 0).any() and (k % 2 == 0).any() and (k % 2 == 1).any()
        want, mask = reference(xs, scale, qmin, qmax, zp)
        clamped += int((~mask).sum())
        # long rows (the kernels' row mode, vector body and tail) and per-channel rows of 3
        # (column mode): the same values either way
        cols = len(xs) - len(xs) % 3
        layouts = [((2, len(xs)), len(xs), 1), ((cols // 3, 3), cols, 3)]
        for shape, n, channels in layouts:
            x = torch.from_numpy(np.resize(xs[:n], shape[0] * shape[1])).reshape(shape)
            s = torch.full((1, channels), scale, dtype=torch.float32)
            z = torch.full((1, channels), zp, dtype=torch.int32)
            y, gx, _ = run(path, x.to(dtype), s, z, qmin, qmax, monkeypatch)
            exp_y = torch.from_numpy(np.resize(want[:n], x.numel())).reshape(shape)
            exp_m = torch.from_numpy(np.resize(mask[:n], x.numel())).reshape(shape)
            grad = (torch.arange(x.numel(), dtype=torch.float32) % 7 + 1).reshape(shape)
            assert y.dtype == dtype and torch.equal(y, exp_y.to(dtype)), (path, scale, shape)
            assert torch.equal(gx, (grad * exp_m).to(dtype)), (path, scale, shape)
    assert clamped > 0  # some ties round out of the range (the gradient stops there)


@pytest.mark.parametrize("path", _paths())
def test_lsq_scale_gradient_on_ties(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """LSQ's scale gradient on ties: ``q - zp - x/scale`` is exactly -0.5 or +0.5 inside
    the range, ``q - zp`` at the clamp; every term is exact, so the sum is too."""
    qmin, qmax, zp = RANGES["int8"]
    scale = 0.75
    xs = tie_inputs(scale, qmin, qmax, zp, torch.bfloat16)
    want, mask = reference(xs, scale, qmin, qmax, zp)
    q = np.clip(np.rint(xs / scale) + zp, qmin, qmax)
    grad = (np.arange(len(xs)) % 7 + 1).astype(np.float64)
    ds = np.where(mask, q - zp - xs / scale, q - zp)
    assert set(np.unique(ds[mask])) == {-0.5, 0.5}
    x = torch.from_numpy(xs).to(torch.bfloat16).reshape(1, -1)
    y, gx, gs = run(path, x, torch.tensor([scale]), torch.tensor([zp], dtype=torch.int32),
                    qmin, qmax, monkeypatch, learnable=True)
    assert torch.equal(y, torch.from_numpy(want).to(torch.bfloat16).reshape(1, -1))
    assert torch.equal(gx, torch.from_numpy(grad * mask).to(torch.bfloat16).reshape(1, -1))
    assert gs is not None and float(gs) == float((grad * ds).sum() * 0.5)


def near_ties(scales: np.ndarray, k: np.ndarray, ulps: int) -> np.ndarray:
    """float32 inputs within ``ulps`` units in the last place of ``(k + 0.5) * scale``, one
    row per scale: where ``x / scale`` is a hair from a rounding tie, so that which side of
    it the float32 quotient lands on decides the step (a quotient computed any other way
    than by IEEE division, say from a reciprocal, shows)."""
    base = ((k[None, :] + 0.5) * scales[:, None].astype(np.float64)).astype(np.float32)
    out = base.copy()
    steps = np.arange(base.shape[1]) % (2 * ulps + 1) - ulps
    up, down = np.full_like(base, np.inf), np.full_like(base, -np.inf)
    for i in range(1, ulps + 1):
        out = np.where(steps[None, :] >= i, np.nextafter(out, up), out)
        out = np.where(steps[None, :] <= -i, np.nextafter(out, down), out)
    return out


def quotient_reference(x: np.ndarray, s: np.ndarray, qmin: int, qmax: int, zp: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The definition in numpy float32: IEEE division, half to even, the product last."""
    q = np.rint(x / s) + np.float32(zp)
    return ((np.clip(q, qmin, qmax) - np.float32(zp)) * s).astype(np.float32), \
        (q >= qmin) & (q <= qmax)


@pytest.mark.parametrize("path", [p for p in _paths() if p != "eager"])
@pytest.mark.parametrize("qrange", list(RANGES))
def test_near_ties_follow_the_float32_quotient(path: str, qrange: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs 0-3 ulps from a tie, with scales of full 24-bit mantissas, through every
    kernel that fake-quantizes float32 rows with one scale each (fake_quant per channel
    and per tensor, the weight observer's fused call, the step statistics' one pass): the
    step is the float32 quotient's (numpy), on both sides of the tie."""
    qmin, qmax, zp = RANGES[qrange]
    rng = np.random.default_rng(7)
    scales = rng.uniform(1e-3, 2.0, 24).astype(np.float32)
    k = np.arange(qmin - zp - 2, qmax - zp + 2, dtype=np.float64)[:256]
    k = np.resize(k, 272)  # rows of 272: a 16-multiple body and more than one tail
    x = near_ties(scales, k, 3)
    monkeypatch.setenv("QCOMPILE_FQ_ISA", {"ext-base": "base", "ext-avx2": "avx2"}.get(path, ""))
    ops = torch.ops.qcompile
    xt = torch.from_numpy(x)
    # fake_quant, one scale per row
    s = torch.from_numpy(scales).reshape(-1, 1)
    z = torch.full((len(scales), 1), zp, dtype=torch.int32)
    want, mask = quotient_reference(x, scales[:, None], qmin, qmax, zp)
    xg = xt.clone().requires_grad_(True)
    y = ops.fake_quant(xg, s, z, qmin, qmax)
    y.backward(torch.ones_like(y))
    assert np.array_equal(y.detach().numpy(), want), path
    assert np.array_equal(xg.grad.numpy(), mask.astype(np.float32)), path
    # per tensor: one scale for everything
    want1, _ = quotient_reference(x, scales[0], qmin, qmax, zp)
    y1 = ops.fake_quant(xt, s[:1, 0], z[:1, 0], qmin, qmax)
    assert np.array_equal(y1.numpy(), want1), path
    # the step statistics' one pass: the same output, and the extremes
    mn = torch.full((1,), float("inf"))
    mx = torch.full((1,), float("-inf"))
    y2 = ops.fake_quant_minmax(xt, s[:1, 0], z[:1, 0], qmin, qmax, mn, mx)
    assert np.array_equal(y2.numpy(), want1) and mn.item() == x.min() and mx.item() == x.max()
    # a weight's observer and forward in one call: its scales are the row ranges'; the
    # reference divides by the scales the call wrote
    obs = [torch.full((len(scales),), v) for v in (float("inf"), float("-inf"))]
    qs, qz = torch.empty(len(scales)), torch.empty(len(scales), dtype=torch.int32)
    y3 = ops.fake_quant_observe(xt, obs[0], obs[1], qs, qz, qmin, qmax, zp == 0, -1.0)

    def want_rows(xs: np.ndarray) -> np.ndarray:
        return np.stack([quotient_reference(r, qs.numpy()[i], qmin, qmax, int(qz[i]))[0]
                         for i, r in enumerate(xs)])

    assert np.array_equal(y3.numpy(), want_rows(x)), path
    # again, with inputs near the ties of the scales the observer picked, inside each
    # row's range, the row's extremes kept (so the scales stay)
    x4 = np.stack([near_ties(qs.numpy()[i:i + 1], np.resize(
        np.arange(qmin - int(qz[i]) + 1, qmax - int(qz[i]) - 1, dtype=np.float64), 272), 3)[0]
        for i in range(len(scales))])
    x4[:, 0], x4[:, 1] = x.min(axis=1), x.max(axis=1)
    scales_before = qs.clone()
    y4 = ops.fake_quant_observe(torch.from_numpy(x4), obs[0], obs[1], qs, qz, qmin, qmax,
                                zp == 0, -1.0)
    assert torch.equal(qs, scales_before)
    assert np.array_equal(y4.numpy(), want_rows(x4)), path
