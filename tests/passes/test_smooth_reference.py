"""SmoothQuant's scales against the paper's definition (Xiao et al. 2023, eq. 4), computed
here from the calibration data and the weights: ``s_j = max|X_j|^alpha /
max|W_j|^(1 - alpha)``, ``X_j`` the Linear layers' input channel ``j`` over every example
row, ``W_j`` column ``j`` of every weight that reads ``X`` (q and k share one ``s``). The
LayerNorm absorbs ``1 / s`` (weight and bias), the weights ``s``. Alphas other than 0.5
tell ``alpha`` from ``1 - alpha``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qcompile as qc

D = 8


class NormQK(nn.Module):
    """LayerNorm -> q, k (one group: both read the norm's output)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ln = nn.LayerNorm(D)
        self.q, self.k = nn.Linear(D, 4), nn.Linear(D, 6)
        with torch.no_grad():
            self.ln.weight.copy_(torch.rand(D, generator=g) + 0.5)
            self.ln.weight[2] *= 30.0  # an outlier channel: activation and weight differ
            self.ln.bias.copy_(torch.rand(D, generator=g) - 0.5)
            self.q.weight.copy_(torch.randn(4, D, generator=g))
            self.k.weight.copy_(torch.randn(6, D, generator=g) * 3.0)

    def forward(self, x):
        h = self.ln(x)
        return self.q(h), self.k(h)


X = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1))


def reference_scales(m: NormQK, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """The paper's ``s_j``, in float64, from the data and the weights."""
    with torch.no_grad():
        act = m.ln(x).double().abs().reshape(-1, D).amax(dim=0)
        w = torch.cat([m.q.weight, m.k.weight]).double().abs().amax(dim=0)
    return act ** alpha / w ** (1.0 - alpha)


@pytest.mark.parametrize("alpha", [0.25, 0.8])
def test_scales_follow_the_definition(alpha: float) -> None:
    m = NormQK().eval()
    spec = {"quant": {"mode": "static",
                      "algorithms": [{"kind": "smoothquant", "alpha": alpha}],
                      "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
                                 "activation": {"dtype": "int8"}}]}}
    gm = qc.qcompile(m, spec, example_inputs=(X,))
    notes = [n for p in qc.report(gm).passes if p.name == "smooth" for n in p.notes]
    assert any(n.startswith("smoothed ln -> q, k") for n in notes), notes
    s = reference_scales(m, X, alpha)
    # the test data tells alpha from 1 - alpha (a swap moves every scale by > 10 %)
    swapped = reference_scales(m, X, 1.0 - alpha)
    assert ((s / swapped - 1).abs() > 0.1).all()
    # float32 parameters from float64 products: equal up to float32 rounding
    expect = {"ln.weight": m.ln.weight.double() / s, "ln.bias": m.ln.bias.double() / s,
              "q.weight": m.q.weight.double() * s, "k.weight": m.k.weight.double() * s,
              "q.bias": m.q.bias.double(), "k.bias": m.k.bias.double()}
    for name, want in expect.items():
        got = gm.get_parameter(name).detach().double()
        torch.testing.assert_close(got, want, rtol=2e-7, atol=0.0, msg=name)
