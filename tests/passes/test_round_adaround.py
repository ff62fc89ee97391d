"""The ``round_adaround`` pass (``quant.algorithms: adaround``): learned rounding beats
round-to-nearest on correlated inputs (MLP and convolutions), lands on the quantizer's
grid, is deterministic, and its solver's closed-form gradient is autograd's."""

from __future__ import annotations

import pytest
import torch

import qcompile as qc
from qcompile.graph.layerwise import output_error, round_to_grid
from qcompile.passes import round_adaround
from qcompile.passes.round_adaround import adaround
from tests.helpers.ptq_cases import (
    ConvNet,
    calibrated,
    conv_data,
    mlp,
    mlp_data,
    output_mse,
    spec,
    weights_on_grid,
)

ADA = {"kind": "adaround", "iterations": 300}
CALIB = [mlp_data(64, seed) for seed in range(4)]
TEST = mlp_data(512, 100)


def test_the_solver_beats_rounding_and_ends_binary():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 24, generator=g) @ torch.randn(24, 24, generator=g)
    w = torch.randn(12, 24, generator=g)
    s, z = w.abs().amax(1, keepdim=True).expand_as(w) / 3, torch.zeros_like(w)
    h = x.T @ x
    nearest = round_to_grid(w, s, z, -4, 3)
    q, flipped = adaround(w, h, 512, s, z, -4, 3, iterations=400)
    assert torch.equal(round_to_grid(q, s, z, -4, 3), q)
    # only up or down from the weight: never further than one step
    assert bool(((q - w).abs() <= s + 1e-6).all())
    assert flipped == int((q != nearest).sum()) > 0
    assert output_error(q - w, h, 512) < 0.75 * output_error(nearest - w, h, 512)


def test_closed_form_gradient_matches_autograd():
    """The solver's hand-written gradient of its loss, against autograd on the same loss."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 7, generator=g, dtype=torch.float64)
    x = torch.randn(40, 7, generator=g, dtype=torch.float64)
    hm = x.T @ x / 40
    s = torch.full_like(w, 0.3)
    z = torch.full_like(w, 1.0)
    base = torch.floor(w / s) + z
    v = torch.randn(5, 7, generator=g, dtype=torch.float64).requires_grad_(True)
    norm, beta, lam, qmin, qmax = 0.7, 9.0, 0.05, -3, 3
    h = round_adaround._soft(v)
    level = base + h
    d = (level.clamp(qmin, qmax) - z) * s - w
    c = 2 * h - 1
    loss = ((d @ hm) * d).sum() / norm + lam * (1 - c.abs().pow(beta)).mean()
    loss.backward()
    # the same expressions as round_adaround.adaround's loop, without autograd
    with torch.no_grad():
        span = round_adaround._ZETA - round_adaround._GAMMA
        sig = torch.sigmoid(v)
        raw = sig * span + round_adaround._GAMMA
        grad_h = (2.0 / norm) * (d @ hm) * s * ((level > qmin) & (level < qmax))
        grad_h = grad_h - (2 * beta * lam / w.numel()) * c.abs().pow(beta - 1) * c.sign()
        grad_v = grad_h * (span * sig * (1 - sig)) * ((raw > 0) & (raw < 1))
    assert torch.allclose(grad_v, v.grad, atol=1e-10)


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_beats_round_to_nearest_on_an_mlp(method):
    m = mlp()
    rtn = output_mse(calibrated(m, spec([], method=method), CALIB), m, TEST)
    gm = calibrated(m, spec([ADA], method=method), CALIB)
    assert output_mse(gm, m, TEST) < 0.85 * rtn
    assert weights_on_grid(gm)
    notes = qc.report(gm).passes[-1].notes
    assert qc.report(gm).passes[-1].name == "round_adaround.calibrate" and len(notes) == 3
    assert all("weights rounded the other way" in n for n in notes)


def test_convolutions():
    m = ConvNet()
    calib = [conv_data(16, s) for s in range(4)]
    test = conv_data(128, 50)
    kw = {"dtype": "int3", "granularity": "per_channel"}
    rtn = output_mse(calibrated(m, spec([], **kw), calib), m, test)
    gm = calibrated(m, spec([ADA], **kw), calib)
    assert output_mse(gm, m, test) < 0.9 * rtn and weights_on_grid(gm)


def test_deterministic():
    a = calibrated(mlp(), spec([ADA]), CALIB).state_dict()
    b = calibrated(mlp(), spec([ADA]), CALIB).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
