"""``qc.convert`` with zero points away from the defaults: signed int8 activations
(``quant_min`` -128, moved onto torch's quint8 grid by +128) and asymmetric ranges whose
zero point is far from the middle, per target. The converted graph must stay within one
output step of the fake-quant graph it came from (DESIGN.md), and its activation qparams
must be the quantizer's own, shifted onto the uint8 grid (written out here)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qcompile as qc


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batches(offset: float) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g) + offset,) for _ in range(3)]


@pytest.mark.parametrize("target", ["x86", "qnnpack"])
@pytest.mark.parametrize(("act", "offset"), [("int8", 3.0), ("uint8", -2.0), ("int8", -1.5)])
def test_activation_zero_points_survive_conversion(act: str, offset: float,
                                                   target: str) -> None:
    spec = {"quant": {"mode": "static", "target": target, "inputs": {
        "dtype": act, "symmetric": False}, "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8",
                                                   "granularity": "per_channel"},
         "activation": {"dtype": act, "symmetric": False}}]}}
    data = batches(offset)
    gm = qc.calibrate(qc.qcompile(MLP(), spec, example_inputs=data[0]), data, progress=False)
    qs = qc.quantizers(gm)
    out_q = qs["fc2.output_fake_quant"]
    zp = int(out_q.zero_point[0])
    assert zp not in (out_q.quant_min, 0, (out_q.quant_min + out_q.quant_max + 1) // 2)
    int8 = qc.convert(gm, example_inputs=data[0])
    step = float(out_q.scale[0])
    with torch.no_grad():
        for (x,) in data + batches(offset + 0.5):
            got, want = int8(x), gm.eval()(x)
            assert float((got - want).abs().max()) <= step * (1 + 1e-5), (act, target)
    # the kernel's output qparams: the quantizer's, on torch's quint8 grid (lowest level 0)
    kernels = {name: m for name, m in int8.named_modules()
               if hasattr(m, "zero_point") and isinstance(getattr(m, "scale", None), float)}
    fc2 = kernels.get("fc2")
    if fc2 is not None:
        assert fc2.scale == pytest.approx(step)
        assert int(fc2.zero_point) == zp - out_q.quant_min
