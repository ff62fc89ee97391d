"""``div_by``: a float32 tensor divided by a constant, rounded as numpy's IEEE float32
division, by the two routes devices take: a float64 division (CPUs, Inductor's CPU code)
and a float64 multiplication by the reciprocal (CUDA's division by a Python number,
Inductor's GPU kernels for any constant divisor). The divisors are every constant the
quantizers divide by: integer ranges, FP8 maxima, NVFP4's ``448 * 6`` and ``6``, and
llama.cpp's grids' ``127``, ``8``, ``15``, ``63``, ``32``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qcompile.runtime.quant_math import div_by

DIVISORS = (255.0, 254.0, 127.0, 15.0, 7.0, 3.0, 65535.0, 448.0, 57344.0, 2688.0, 6.0,
            -8.0, 63.0, -32.0, 16.0)


def float32_values(n: int, seed: int) -> np.ndarray:
    """Random float32 bit patterns (every exponent, subnormals included; no NaN or inf),
    and integers with many significant bits (the ranges quantizers divide)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)]
    ints = rng.integers(1, 2 ** 24, n // 4).astype(np.float32)
    return np.concatenate([x, ints, ints * np.float32(2.0 ** -130), -ints])


@pytest.mark.parametrize("b", DIVISORS)
def test_both_routes_round_as_float32_division(b: float) -> None:
    x = float32_values(400_000, int(abs(b)))
    with np.errstate(all="ignore"):
        want = (x / np.float32(b)).view(np.uint32)
    t = torch.from_numpy(x)
    got = div_by(t, b).numpy().view(np.uint32)
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {x.size} differ"
    # the reciprocal route, as CUDA and Inductor's GPU kernels compute it
    recip = (t.double() * (1.0 / b)).float().numpy().view(np.uint32)
    assert np.array_equal(recip, want), f"{int((recip != want).sum())} of {x.size} differ"


def test_non_finite_values_stay_what_a_division_makes() -> None:
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    got = div_by(x, 255.0)
    assert got[0] == float("inf") and got[1] == -float("inf") and torch.isnan(got[2])
    assert torch.equal(torch.signbit(got[3:]), torch.tensor([False, True]))
    assert got.dtype == torch.float32
