"""``fold_bn`` (static / dynamic PTQ) against BatchNorm folding computed here, in numpy
float64, from the layer's and the BatchNorm's own numbers:

    f  = gamma / sqrt(running_var + eps)          (one factor per output channel)
    W' = W * f                                    (along the output-channel axis)
    b' = (b - running_mean) * f + beta            (b = 0 when the layer has no bias)

Negative gammas, tiny variances and large ``eps`` are drawn on purpose: with torch's
default ``eps = 1e-5`` and variances near 1, a fold that forgets ``eps`` or a sign is off
by far less than the tolerances of an output comparison, so the weights themselves are
compared, and the folded graph's output is compared with BatchNorm's eval formula
evaluated in float64 on the unfolded layer.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.passes.fold_bn import fold_bn
from qcompile.passes.trace import trace

# Wide on purpose: eps from torch's default to far above every variance drawn.
EPS = [1e-5, 1e-3, 0.1, 1.0, 10.0]


class Head(nn.Module):
    """One layer followed by its BatchNorm (the fusion group fold_bn folds)."""

    def __init__(self, kind: str, bias: bool, eps: float) -> None:
        super().__init__()
        if kind == "linear":
            self.layer, self.bn = nn.Linear(5, 4, bias=bias), nn.BatchNorm1d(4, eps=eps)
        elif kind == "conv1d":
            self.layer, self.bn = nn.Conv1d(3, 4, 3, bias=bias), nn.BatchNorm1d(4, eps=eps)
        else:
            self.layer, self.bn = nn.Conv2d(3, 4, 3, bias=bias), nn.BatchNorm2d(4, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.layer(x))


SHAPES = {"linear": (3, 5), "conv1d": (2, 3, 7), "conv2d": (2, 3, 6, 6)}
MODULE = {"linear": "Linear", "conv1d": "Conv1d", "conv2d": "Conv2d"}


def build(kind: str, bias: bool, eps: float, gamma: np.ndarray, var: np.ndarray,
          mean: np.ndarray, beta: np.ndarray, seed: int = 0) -> Head:
    torch.manual_seed(seed)
    model = Head(kind, bias, eps)
    with torch.no_grad():
        model.bn.weight.copy_(torch.from_numpy(gamma))
        model.bn.bias.copy_(torch.from_numpy(beta))
        model.bn.running_mean.copy_(torch.from_numpy(mean))
        model.bn.running_var.copy_(torch.from_numpy(var))
    return model.eval()


def folded(model: Head, kind: str, mode: str = "static", method: str = "symbolic",
           ) -> tuple[torch.fx.GraphModule, list[str], torch.Tensor]:
    x = torch.randn(SHAPES[kind], generator=torch.Generator().manual_seed(1))
    spec = qc.CompileSpec.model_validate({
        "quant": {"mode": mode, "rules": [{"match": {"module": MODULE[kind]},
                                           "weight": {"dtype": "int8"}}]},
        "trace": {"method": method}})
    ctx = Context(spec=spec, model=model, example_inputs=(x,))
    gm = fold_bn(trace(None, ctx), ctx)
    gm.recompile()
    return gm.eval(), ctx.notes, x


def reference_fold(model: Head) -> tuple[np.ndarray, np.ndarray]:
    """(W', b') in float64, from the layer's weight and the BatchNorm's numbers."""
    w = model.layer.weight.detach().double().numpy()
    b = (model.layer.bias.detach().double().numpy() if model.layer.bias is not None
         else np.zeros(w.shape[0]))
    bn = model.bn
    gamma, beta = bn.weight.detach().double().numpy(), bn.bias.detach().double().numpy()
    mean, var = bn.running_mean.double().numpy(), bn.running_var.double().numpy()
    f = gamma / np.sqrt(var + bn.eps)
    return w * f.reshape((-1,) + (1,) * (w.ndim - 1)), (b - mean) * f + beta


def reference_output(model: Head, x: torch.Tensor) -> np.ndarray:
    """BatchNorm's eval formula after the unfolded layer, all in float64."""
    bn = model.bn
    y = copy.deepcopy(model.layer).double()(x.double()).detach().numpy()
    view = (1, -1) + (1,) * (y.ndim - 2)
    g = lambda t: t.detach().double().numpy().reshape(view)  # noqa: E731
    return (y - g(bn.running_mean)) / np.sqrt(g(bn.running_var) + bn.eps) * g(bn.weight) + g(
        bn.bias)


def check(model: Head, kind: str, mode: str = "static", method: str = "symbolic") -> None:
    gm, notes, x = folded(model, kind, mode, method)
    assert notes == ["folded bn into layer"], notes
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gm.modules())
    w_ref, b_ref = reference_fold(model)
    params = dict(gm.named_parameters())
    # float32 rsqrt and products: a few ulps; a missing eps or sign is orders above
    np.testing.assert_allclose(params["layer.weight"].detach().double().numpy(), w_ref,
                               rtol=1e-5, atol=1e-12, err_msg="folded weight")
    np.testing.assert_allclose(params["layer.bias"].detach().double().numpy(), b_ref,
                               rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b_ref).max())),
                               err_msg="folded bias")
    with torch.no_grad():
        y = gm(x).double().numpy()
    y_ref = reference_output(model, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4,
                               atol=1e-5 * max(1.0, float(np.abs(y_ref).max())),
                               err_msg="folded output vs BatchNorm eval formula")


# -- fixed cases: negative gammas and an eps far above the variances ---------------------
GAMMA = np.array([1.5, -2.0, 0.25, -0.5], dtype=np.float32)
VAR = np.array([1e-3, 0.02, 0.5, 1e-4], dtype=np.float32)
MEAN = np.array([0.3, -1.0, 0.0, 2.0], dtype=np.float32)
BETA = np.array([0.1, -0.2, 0.3, 0.0], dtype=np.float32)


@pytest.mark.parametrize("method", ["symbolic", "export"])
@pytest.mark.parametrize("kind", ["linear", "conv2d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fold_matches_reference_with_negative_gamma_and_large_eps(kind: str, bias: bool,
                                                                  method: str) -> None:
    check(build(kind, bias, 1.0, GAMMA, VAR, MEAN, BETA), kind, method=method)


def test_dynamic_mode_folds_linear_bn_like_the_reference() -> None:
    check(build("linear", True, 0.1, GAMMA, VAR, MEAN, BETA), "linear", mode="dynamic")


# -- drawn cases --------------------------------------------------------------------------
def channel_values(lo: float, hi: float) -> st.SearchStrategy[np.ndarray]:
    return st.lists(st.floats(lo, hi), min_size=4, max_size=4).map(
        lambda v: np.array(v, dtype=np.float32))


@given(kind=st.sampled_from(["linear", "conv1d", "conv2d"]), bias=st.booleans(),
       eps=st.sampled_from(EPS),
       # magnitudes and signs apart, so that every example has gammas of both signs
       magnitude=channel_values(0.05, 4.0),
       signs=st.lists(st.sampled_from([-1.0, 1.0]), min_size=4, max_size=4).filter(
           lambda s: len(set(s)) == 2),
       var=channel_values(1e-4, 2.0), mean=channel_values(-2.0, 2.0),
       beta=channel_values(-1.0, 1.0), seed=st.integers(0, 3))
def test_fold_matches_reference(kind: str, bias: bool, eps: float, magnitude: np.ndarray,
                                signs: list[float], var: np.ndarray, mean: np.ndarray,
                                beta: np.ndarray, seed: int) -> None:
    gamma = (magnitude * np.array(signs, dtype=np.float32)).astype(np.float32)
    check(build(kind, bias, eps, gamma, var, mean, beta, seed), kind)
