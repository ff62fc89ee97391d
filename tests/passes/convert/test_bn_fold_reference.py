"""``convert.fold_batchnorm`` (QAT graphs keep BatchNorm; conversion folds it) against a
fold computed here, in numpy float64, from the QAT graph's own numbers:

    q   = clip(round(W / s_w), qmin, qmax)          the weight quantizer's integers
    f   = gamma / sqrt(running_var + eps)           per output channel
    folded weight = q * s_w * f                     (what the kernel must multiply by)
    folded bias   = (b - running_mean) * f + beta

and the converted layer's output against the integer arithmetic of the kernel
(``tests/helpers/int_reference.py``) run on that reference fold, and against the frozen
fake-quant graph (which never folds: BatchNorm runs in eval mode there).

BatchNorm gets negative gammas and an ``eps`` far above the conv outputs' variances: with
torch's defaults (gamma = 1, eps = 1e-5) a fold that drops the sign or ``eps`` converts
within one step of the fake-quant graph and ``report.max_deviation`` cannot tell.
"""

from __future__ import annotations

import copy

import int_reference as ref
import numpy as np
import pytest
import torch
import torch.ao.nn.quantized as nnq
from convert_specs import spec
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qcompile as qc

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")

SHAPE = (4, 3, 6, 6)
GAMMA = (1.5, -2.0, 0.25, -0.5)


class ConvBn(nn.Module):
    def __init__(self, gamma: tuple[float, ...], eps: float, relu: bool, bias: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, len(gamma), 3, padding=1, bias=bias)
        self.bn = nn.BatchNorm2d(len(gamma), eps=eps)
        self.relu = relu
        with torch.no_grad():
            # small conv outputs and a small starting running_var: the variances stay
            # far below a large eps (momentum=None would do it too, but does not export)
            self.conv.weight.mul_(0.1)
            self.bn.running_var.fill_(0.01)
            self.bn.weight.copy_(torch.tensor(gamma))
            self.bn.bias.copy_(torch.linspace(-0.3, 0.3, len(gamma)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return torch.relu(y) if self.relu else y


def trained(gamma: tuple[float, ...], eps: float, relu: bool, bias: bool, method: str,
            seed: int = 0) -> torch.fx.GraphModule:
    """QAT graph after a few train-mode forwards: ranges observed, running stats moved."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(SHAPE, generator=gen) for _ in range(4)]
    gm = qc.qcompile(ConvBn(gamma, eps, relu, bias), spec("int8-qat", trace={"method": method}),
                     example_inputs=(batches[0],))
    gm.train()
    with torch.no_grad():
        for x in batches:
            gm(x)
    return gm


def roles(gm: torch.fx.GraphModule) -> dict[str, qc.FakeQuantize]:
    qs = qc.quantizers(gm)
    out: dict[str, qc.FakeQuantize] = {}
    for r in qc.report(gm).quantizers:
        assert r.role not in out, f"one quantizer per role expected, {r.role} twice"
        out[r.role] = qs[r.name]
    return out


def bn_numbers(gm: torch.fx.GraphModule) -> tuple[np.ndarray, ...]:
    """(gamma, beta, running_mean, running_var, eps) of the graph's BatchNorm (the model's
    own module, under both front ends)."""
    (bn,) = [m for m in gm.modules() if isinstance(m, nn.BatchNorm2d)]
    return (bn.weight.detach().double().numpy(), bn.bias.detach().double().numpy(),
            bn.running_mean.double().numpy(), bn.running_var.double().numpy(), bn.eps)


def reference_fold(gm: torch.fx.GraphModule) -> dict[str, np.ndarray]:
    """The fold, from the QAT graph's weight, its quantizer and its BatchNorm."""
    wfq = roles(gm)["weight"]
    params = dict(gm.named_parameters())  # conv.weight / conv.bias under both front ends
    w = params["conv.weight"].detach().numpy()
    s_w = wfq.scale.detach().numpy().astype(np.float32).reshape(-1, 1, 1, 1)
    assert int(wfq.zero_point.abs().max()) == 0, "symmetric weights assumed"
    q = np.clip(np.round(w / s_w), wfq.quant_min, wfq.quant_max)  # float32, as fake-quant
    gamma, beta, mean, var, eps = bn_numbers(gm)
    f = gamma / np.sqrt(var + eps)
    b = (params["conv.bias"].detach().double().numpy() if "conv.bias" in params
         else np.zeros_like(f))
    return {"q": q.astype(np.int64), "s_w": s_w.reshape(-1).astype(np.float64), "f": f,
            "weight": q * s_w.astype(np.float64) * f.reshape(-1, 1, 1, 1),
            "bias": (b - mean) * f + beta}


def converted_conv(out: torch.fx.GraphModule) -> nn.Module:
    (conv,) = [m for m in out.modules() if isinstance(m, nnq.Conv2d)]  # ConvReLU2d too
    return conv


CASES = [pytest.param(relu, bias, method, id=f"{'relu' if relu else 'no-relu'}-"
                      f"{'bias' if bias else 'no-bias'}-{method}")
         for relu, bias, method in [(True, True, "symbolic"), (False, True, "symbolic"),
                                    (True, False, "symbolic"), (False, True, "export")]]


def check_fold(gm: torch.fx.GraphModule) -> None:
    """Convert ``gm`` and compare the kernel's weight and bias with the reference fold."""
    r = reference_fold(gm)
    assert np.abs(r["q"]).max() < 128, "symmetric int8 uses [-127, 127]: mirroring is exact"
    out = qc.convert(gm)
    assert [c.op for c in qc.report(out).conversions if c.path == "fold"] == ["batchnorm"]
    conv = converted_conv(out)
    qw = conv.weight()
    got = qw.dequantize().double().numpy()
    # float32 rsqrt / products on the way: a few ulps of each channel's scale
    np.testing.assert_allclose(got, r["weight"], rtol=1e-5, atol=1e-9,
                               err_msg="folded weight vs q * s_w * gamma / sqrt(var + eps)")
    # the same, said as integers and scales: negative factors mirror the integers
    sign = np.sign(r["f"]).reshape(-1, 1, 1, 1).astype(np.int64)
    np.testing.assert_array_equal(qw.int_repr().long().numpy(), r["q"] * sign,
                                  err_msg="integers mirrored where gamma < 0")
    np.testing.assert_allclose(qw.q_per_channel_scales().numpy(), r["s_w"] * np.abs(r["f"]),
                               rtol=1e-6, err_msg="per-channel scales")
    np.testing.assert_allclose(conv.bias().detach().double().numpy(), r["bias"], rtol=1e-5,
                               atol=1e-6, err_msg="folded bias")


def large_eps_case(relu: bool, bias: bool, method: str) -> torch.fx.GraphModule:
    gm = trained(GAMMA, 1.0, relu, bias, method)
    _, _, _, var, eps = bn_numbers(gm)
    assert eps > 10 * var.max(), "the case must make eps matter"
    return gm


@pytest.mark.parametrize(("relu", "bias", "method"), CASES)
def test_qat_fold_weights_match_reference(relu: bool, bias: bool, method: str) -> None:
    check_fold(large_eps_case(relu, bias, method))


@pytest.mark.parametrize(("relu", "bias", "method"), CASES)
def test_qat_converted_output_matches_kernel_arithmetic_and_fake_quant(relu: bool, bias: bool,
                                                                       method: str) -> None:
    """End to end, without looking at the converted weights: the integer arithmetic on
    the reference fold, and the fake-quant graph (BatchNorm unfolded, in eval mode)."""
    gm = large_eps_case(relu, bias, method)
    fake_quant = qc.freeze(copy.deepcopy(gm)).eval()
    r = reference_fold(gm)
    out = qc.convert(gm)
    q = roles(gm)
    inp, act = q["input"], q["activation"]
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    xs, xz = float(inp.scale[0]), int(inp.zero_point[0])
    os_, oz = float(act.scale[0]), int(act.zero_point[0])
    xq = ref.quantize(x, xs, xz, inp.quant_min, inp.quant_max)
    # the kernel's per-channel scales are float32 products (converted to double)
    w_scale = torch.from_numpy(r["s_w"] * np.abs(r["f"])).float().double()
    wq = torch.from_numpy(r["q"] * np.sign(r["f"]).reshape(-1, 1, 1, 1).astype(np.int64))
    # relu: the output quantizer's range starts at 0 (zero point 0), so clamping at
    # quant_min is the ReLU
    expect = ref.conv2d(xq, xs, xz, wq, w_scale, 0, torch.from_numpy(r["bias"]).float(), os_,
                        oz, vnni=False, padding=1, quant_min=act.quant_min,
                        quant_max=act.quant_max)
    with torch.no_grad():
        got = out(x).double() / os_ + oz
        fq = fake_quant(x).double() / os_ + oz
    assert float((got - fq).abs().max()) <= 1 + 1e-6, "converted vs fake-quant graph"
    # the kernel requantizes in float32, the reference in float64: a tie may round apart
    diff = (got - expect.double()).abs()
    assert float(diff.max()) <= 1 + 1e-6, f"converted vs integer reference: {diff.max()}"
    assert float((diff > 0.5).double().mean()) < 0.01, "almost all integers identical"


@settings(max_examples=6)
@given(magnitudes=st.lists(st.floats(0.1, 3.0), min_size=3, max_size=3),
       negative=st.lists(st.booleans(), min_size=3, max_size=3).filter(any),
       eps=st.sampled_from([1e-5, 0.01, 0.5, 4.0]), seed=st.integers(0, 9))
def test_qat_fold_matches_reference_drawn(magnitudes: list[float], negative: list[bool],
                                          eps: float, seed: int) -> None:
    gamma = tuple(-m if n else m for m, n in zip(magnitudes, negative, strict=True))
    check_fold(trained(gamma, eps, True, True, "symbolic", seed))
