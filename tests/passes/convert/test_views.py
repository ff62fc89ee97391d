"""``qc.convert`` of models that reshape a convolution's output: torch's quantized
convolutions return channels-last tensors, so a ``view`` after one needs ``reshape``
(``use_kernels``), and size arguments (``x.view(x.size(0), -1)``) must not keep the view
off the quantized tensor (``sink_dequantize``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")


class CNN(nn.Module):
    """Conv-ReLU-MaxPool-Conv-ReLU, a reshape of the features, then Linear layers."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv1, self.pool = nn.Conv2d(1, 4, 3), nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1, self.fc2 = nn.Linear(8 * 3 * 3, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = F.relu(self.conv2(x))
        if self.how == "view":
            x = x.view(x.size(0), -1)
        elif self.how == "reshape":
            x = x.reshape(x.shape[0], 72)
        elif self.how == "flatten":
            x = torch.flatten(x, 1)
        else:  # a float op between the kernel and the view: the view reads float values
            x = torch.sigmoid(x).view(-1, 72)
        return self.fc2(F.relu(self.fc1(x)))


def data(n: int, seed: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 1, 12, 12, generator=gen),) for _ in range(n)]


def prepared(how: str, preset: str) -> torch.fx.GraphModule:
    """The CNN compiled with ``preset`` as shipped: calibrated (static) or trained one SGD
    step (QAT), then frozen."""
    torch.manual_seed(0)
    batches = data(2, seed=1)
    gm = qc.qcompile(CNN(how), preset, example_inputs=batches[0])
    if preset == "int8-static":
        return qc.calibrate(gm, batches, progress=False)
    opt = torch.optim.SGD(gm.parameters(), lr=0.01)
    gm.train()
    for (x,) in batches:
        gm(x).square().mean().backward()
    opt.step()
    return qc.freeze(gm)


def output_step(gm: torch.fx.GraphModule) -> float:
    return float(qc.quantizers(gm)["fc2.output_fake_quant"].scale[0])


@pytest.mark.parametrize(("how", "preset"), [("view", "int8-static"), ("view", "int8-qat"),
                                             ("reshape", "int8-static"),
                                             ("flatten", "int8-qat"),
                                             ("float_view", "int8-static")])
def test_reshaped_conv_output_converts_within_one_step(how: str, preset: str) -> None:
    gm = prepared(how, preset)
    ref = copy.deepcopy(gm).eval()
    example = data(1, seed=5)[0]
    out = qc.convert(gm, example_inputs=example)
    step = output_step(ref)
    with torch.no_grad():
        for (x,) in [example, *data(2, seed=6)]:
            assert float((out(x) - ref(x)).abs().max()) <= step * (1 + 1e-5)
    kernels = [c.module for c in qc.report(out).conversions if c.path == "kernel"]
    if how == "float_view":  # fc1 reads sigmoid's float output: a float op
        assert kernels == ["conv1", "conv2", "fc2"]
    else:  # the reshape runs on the quantized tensor, so fc1 reads integers too
        assert kernels == ["conv1", "conv2", "fc1", "fc2"]
    views = [n for n in out.graph.nodes if n.op == "call_method" and n.target == "view"]
    assert views == [], "every view of a channels-last kernel output became a reshape"


def test_sizes_are_read_from_the_quantized_tensor() -> None:
    """No dequantize runs only to be measured: ``x.size(0)`` reads the quantized tensor,
    and the note says how many views became reshapes."""
    out = qc.convert(prepared("view", "int8-static"))
    size = next(n for n in out.graph.nodes if n.op == "call_method" and n.target == "size")
    reshape = next(iter(size.users))
    assert reshape.target == "reshape" and reshape.args[0] is size.args[0]
    assert not (size.args[0].op == "call_method" and size.args[0].target == "dequantize")
    step = next(p for p in qc.report(out).passes if p.name == "convert.use_kernels")
    assert "1 view(s) of a channels-last kernel output -> reshape" in step.notes
