"""The ``round_adaround`` pass (``quant.algorithms: adaround``): learned rounding beats
round-to-nearest on correlated inputs (MLP and convolutions), lands on the quantizer's
grid, is deterministic, and the closed-form gradient its solver steps on is the gradient
of the paper's loss (autograd and finite differences on a loss written here)."""

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


def _paper_loss(v, w, s, z, qmin, qmax, hm, norm, lam, beta):
    """The solver's objective written from the paper (Nagel et al. 2020, eqs. 22-25), not
    from the pass: the rectified sigmoid with zeta 1.1, gamma -0.1; the weight
    ``s * (clamp(floor(w / s) + z + h, qmin, qmax) - z)``; the layer's output error
    ``trace(dW H dW^T)``, normalised; ``lam * mean(1 - |2h - 1|^beta)``."""
    h = torch.clamp(torch.sigmoid(v) * 1.2 - 0.1, 0.0, 1.0)
    w_soft = s * (torch.clamp(torch.floor(w / s) + z + h, qmin, qmax) - z)
    dw = w_soft - w
    loss = torch.trace(dw @ hm @ dw.T) / norm
    if lam:
        loss = loss + lam * (1 - (2 * h - 1).abs().pow(beta)).mean()
    return loss


@pytest.mark.parametrize(("lam", "beta"), [(0.0, 0.0), (0.05, 20.0), (0.05, 9.0), (3.0, 2.0)])
def test_solver_gradient_is_the_gradient_of_the_papers_loss(lam, beta):
    """The closed-form gradient the solver steps on (``_gradient``) equals autograd's
    gradient of the loss written above from the definition, in float64, with weights at
    both ends of the grid (clamped levels) and V where the rectified sigmoid clips."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 7, generator=g, dtype=torch.float64)
    x = torch.randn(40, 7, generator=g, dtype=torch.float64)
    hm = x.T @ x / 40
    s = torch.full_like(w, 0.3)
    z = torch.full_like(w, 1.0)
    qmin, qmax, norm = -3, 3, 0.7
    v = torch.randn(5, 7, generator=g, dtype=torch.float64) * 2
    v[0, :3] = torch.tensor([8.0, -8.0, 0.1], dtype=torch.float64)  # h clipped to 1, to 0
    w[1, :2] = torch.tensor([-1.35, 0.75], dtype=torch.float64)  # levels past qmin / qmax
    base = torch.floor(w / s) + z
    assert ((base + 1 < qmin) | (base > qmax)).any()  # the clamp is exercised
    leaf = v.clone().requires_grad_(True)
    _paper_loss(leaf, w, s, z, qmin, qmax, hm, norm, lam, beta).backward()
    got = round_adaround._gradient(v, w, base, s, z, qmin, qmax, hm, norm, lam, beta)
    torch.testing.assert_close(got, leaf.grad, rtol=1e-9, atol=1e-12)
    assert leaf.grad.abs().max() > 0 and (leaf.grad == 0).any()  # both regimes present


def test_gradient_finite_differences():
    """Where the loss is smooth, the solver's gradient matches central differences."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    x = torch.randn(20, 4, generator=g, dtype=torch.float64)
    hm = x.T @ x / 20
    s, z = torch.full_like(w, 0.25), torch.zeros_like(w)
    v = torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.5  # h inside (0, 1)
    base = torch.floor(w / s) + z
    got = round_adaround._gradient(v, w, base, s, z, -100, 100, hm, 0.3, 0.2, 4.0)
    eps = 1e-6
    for i in range(3):
        for j in range(4):
            up, down = v.clone(), v.clone()
            up[i, j] += eps
            down[i, j] -= eps
            fd = (_paper_loss(up, w, s, z, -100, 100, hm, 0.3, 0.2, 4.0)
                  - _paper_loss(down, w, s, z, -100, 100, hm, 0.3, 0.2, 4.0)) / (2 * eps)
            assert abs(float(fd) - float(got[i, j])) <= 1e-6 * max(1.0, abs(float(fd)))


def test_beta_schedule():
    """No regulariser during the warm-up, then beta from 20 down to 2, linearly."""
    beta = round_adaround._beta
    assert [beta(t, 100, 20) for t in (0, 19)] == [None, None]
    assert beta(20, 100, 20) == 20.0
    assert beta(60, 100, 20) == pytest.approx(11.0)
    assert beta(100, 100, 20) == pytest.approx(2.0)


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
    short = {**ADA, "iterations": 40}  # the same rounding twice: no need to converge
    a = calibrated(mlp(), spec([short]), CALIB).state_dict()
    b = calibrated(mlp(), spec([short]), CALIB).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
