"""``qc.convert`` output against references computed here, outside ``qc.convert``: the
integer arithmetic of the kernels (``tests/helpers/int_reference.py``) run layer by layer
on integers taken from the fake-quant graph's own weights and quantizers, and the frozen
fake-quant graph itself. ``report.max_deviation`` is what ``qc.convert`` measured about
itself; nothing here reads it.

The chain of layers is the reference's, not the converted graph's: the input quantized
with the input quantizer, each Linear as ``quantized::linear(_relu)`` on the 7-bit
activation grid of ``quant.target: x86``, its output requantized with the layer's
output quantizer, and the last output dequantized.
"""

from __future__ import annotations

import copy

import int_reference as ref
import pytest
import torch
from convert_specs import spec
from torch import nn

import qcompile as qc

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 10))


LAYERS = (("0", True), ("2", True), ("4", False))  # (name, followed by ReLU)


def ready(preset: str, seed: int = 0) -> torch.fx.GraphModule:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, 16, generator=gen),) for _ in range(4)]
    gm = qc.qcompile(mlp(), spec(preset), example_inputs=batches[0])
    if preset.endswith("static"):
        qc.calibrate(gm, batches, progress=False)
    else:  # a few real QAT steps: weights and ranges move
        opt = torch.optim.SGD(gm.parameters(), lr=1e-3)
        gm.train()
        for (x,) in batches:
            gm(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return gm


def reference(gm: torch.fx.GraphModule, x: torch.Tensor, *, vnni: bool,
              ) -> tuple[torch.Tensor, float, int]:
    """(output integers, output scale, output zero point) of the integer MLP."""
    qs = qc.quantizers(gm)
    (inp,) = [qs[r.name] for r in qc.report(gm).quantizers if r.role == "input"]
    s, z = float(inp.scale[0]), int(inp.zero_point[0])
    assert (inp.quant_min, inp.quant_max) == (0, 127), "x86: 7-bit activations"
    xq = ref.quantize(x, s, z, inp.quant_min, inp.quant_max)
    for name, relu in LAYERS:
        wfq, ofq = qs[f"{name}.weight_fake_quant"], qs[f"{name}.output_fake_quant"]
        w = gm.get_parameter(f"{name}.weight").detach()
        ws, wz = wfq.scale.detach().double(), wfq.zero_point.long()
        ws, wz = ws.expand(w.shape[0]), wz.expand(w.shape[0])
        wq = ref.quantize(w, ws[:, None], wz[:, None], wfq.quant_min, wfq.quant_max)
        os_, oz = float(ofq.scale[0]), int(ofq.zero_point[0])
        xq = ref.linear(xq, s, z, wq, ws, wz, gm.get_parameter(f"{name}.bias"), os_, oz,
                        vnni=vnni, quant_min=ofq.quant_min, quant_max=ofq.quant_max, relu=relu)
        s, z = os_, oz
    return xq, s, z


@pytest.mark.parametrize("preset", ["int8-static", "int8-qat"])
def test_converted_mlp_matches_the_integer_reference(preset: str) -> None:
    gm = ready(preset)
    fake_quant = qc.freeze(copy.deepcopy(gm)).eval()
    out = qc.convert(gm, example_inputs=(torch.randn(64, 16),))
    assert {c.op for c in qc.report(out).conversions} == {
        "quantize_per_tensor", "quantized::linear_relu", "quantized::linear"}
    for seed in range(3):
        x = torch.randn(256, 16, generator=torch.Generator().manual_seed(100 + seed)) * 1.5
        r, s, z = reference(fake_quant, x, vnni=False)
        # 7-bit activations: no pair of products saturates, VNNI or not
        assert torch.equal(r, reference(fake_quant, x, vnni=True)[0])
        with torch.no_grad():
            got = out(x).double() / s + z
            fq = fake_quant(x).double() / s + z
        # on the output grid (up to float32 dequantization): compare as integers
        assert float((got - got.round()).abs().max()) < 1e-3, "converted output off the grid"
        got, fq = got.round(), fq.round()
        # the kernels requantize in float32 and the reference in float64: a near-tie may
        # round apart in some layer (then carried on); integers agree almost everywhere
        diff = (got - r.double()).abs()
        assert float((diff > 0).double().mean()) < 0.01, f"{int((diff > 0).sum())} differ"
        assert float(diff.max()) <= 2, "a one-off in a hidden layer moves the output a little"
        # DESIGN: converted is within one output step of the fake-quant graph
        assert float((got - fq).abs().max()) <= 1 + 1e-6
        # and the fake-quant graph is the same integer arithmetic, up to float rounding
        assert float(((fq - r.double()).abs() > 0).double().mean()) < 0.01


def test_int_reference_tells_a_wrong_bias_apart() -> None:
    """The reference is sharp enough to see a conversion mistake: shifting one layer's
    bias by a single output step moves the integers."""
    gm = qc.freeze(ready("int8-static")).eval()
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(5))
    r, _, _ = reference(gm, x, vnni=False)
    step = float(qc.quantizers(gm)["4.output_fake_quant"].scale[0])
    with torch.no_grad():
        gm.get_parameter("4.bias").add_(step)
    moved, _, _ = reference(gm, x, vnni=False)
    assert float((moved - r).abs().double().mean()) > 0.5
