"""A converted graph's activation qparams are state: ``int8_a.load_state_dict(
int8_b.state_dict())`` gives exactly ``int8_b``'s outputs, for two calibrations (or two
QAT runs) of the same model, on every conversion path (quantize steps, clamps of the 7-bit
x86 grid, integer kernels, ``quantized::add``, BatchNorm folded at conversion, pipeline
stages sending integers)."""

from __future__ import annotations

import copy
import functools
import io
import warnings

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.runtime.quantized import ActivationQParams, clamp_levels

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")


class ResBlock(nn.Module):
    """conv + BN + ReLU, conv + BN, residual add + ReLU, max-pool, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        return self.fc(torch.flatten(self.pool(y), 1))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def spec(mode: str, target: str = "x86", **top: object) -> qc.CompileSpec:
    d = qc.load_spec(f"int8-{mode}").model_dump()
    d["quant"]["target"] = target
    d["quant"]["rules"].append({"match": {"op": "add"}, "optional": True,
                                "activation": {"dtype": "uint8", "symmetric": False}})
    d.update(top)
    return qc.CompileSpec.model_validate(d)


def converted(make: type[nn.Module] | object, s: qc.CompileSpec, shape: tuple[int, ...],
              seed: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """(fake-quant graph, its conversion) for data of ``seed``: seeds 0 and 1 calibrate
    (or train) on ranges twice apart, so every scale differs."""
    torch.manual_seed(0)
    model = make()
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(shape, generator=gen) * (1 + seed),) for _ in range(2)]
    gm = qc.qcompile(model, s, example_inputs=batches[0])
    if s.quant.mode == "static":
        qc.calibrate(gm, batches, progress=False)
    else:  # QAT: weights, BatchNorm statistics and ranges move
        opt = torch.optim.SGD(gm.parameters(), lr=1e-2)
        gm.train()
        for (x,) in batches:
            gm(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        qc.distributed.sync_observers(gm)  # the last step's observations, as train_step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gm, qc.convert(gm, example_inputs=batches[0])


def lowered(int8: nn.Module) -> dict[str, ActivationQParams]:
    return {n: m for n, m in int8.named_modules() if isinstance(m, ActivationQParams)}


CASES = {
    "static-mlp-x86": (mlp, spec("static"), (8, 16)),
    "static-resblock-x86": (ResBlock, spec("static"), (2, 3, 8, 8)),
    "static-resblock-qnnpack": (ResBlock, spec("static", "qnnpack"), (2, 3, 8, 8)),
    "qat-resblock-x86": (ResBlock, spec("qat"), (2, 3, 8, 8)),
    "static-mlp-pipeline-int8-transfer": (mlp, spec("static", pipeline={
        "stages": 2, "transfer": "int8"}), (8, 16)),
}


@functools.cache
def pair(case: str, seed: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    make, s, shape = CASES[case]
    return converted(make, s, shape, seed)


@pytest.mark.parametrize("case", list(CASES))
def test_another_calibrations_state_dict_gives_its_outputs(case: str) -> None:
    shape = CASES[case][2]
    fq_a, a = pair(case, 0)
    a = copy.deepcopy(a)  # loaded into below
    b = pair(case, 1)[1]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out_a, out_b = a(x), b(x)
    assert not torch.equal(out_a, out_b), "the two calibrations must differ for this test"
    # the activation qparams are in the state dict, as the quantizers had them ...
    held = lowered(a)
    assert held, "no lowered activation quantizer"
    quantizers = qc.quantizers(fq_a)
    in_place = [n for n in held if n in quantizers]  # else beside a quantizer still read
    assert in_place
    for name in in_place:  # the quint8 grid starts at the quantizer's lowest level
        fq = quantizers[name]
        assert torch.equal(held[name].scale, fq.scale.detach())
        assert int(held[name].zero_point) == int(fq.zero_point) - fq.quant_min
    # ... and not constants in the code
    for node in a.graph.nodes:
        if node.target is torch.quantize_per_tensor:
            assert all(isinstance(v, torch.fx.Node) for v in node.args[1:3]), node.format_node()
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    result = a.load_state_dict(torch.load(buf, weights_only=True))
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        assert torch.equal(a(x), out_b)


def test_whole_graph_save_load_keeps_the_loaded_qparams() -> None:
    shape = CASES["static-resblock-x86"][2]
    a, b = copy.deepcopy(pair("static-resblock-x86", 0)[1]), pair("static-resblock-x86", 1)[1]
    a.load_state_dict(b.state_dict())
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    x = torch.randn(shape)
    with torch.no_grad():
        assert torch.equal(again(x), b(x))


def test_clamp_levels_keeps_the_levels_of_the_tensors_own_grid() -> None:
    """The clamp reads its bounds from the tensor's qparams: on the integers it is
    ``clamp(q, 0, levels)``, whatever grid was loaded."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen) * 4
    for scale, zp in ((0.05, 10), (0.013, 0), (0.2, 127)):
        q = torch.quantize_per_tensor(x, scale, zp, torch.quint8)
        out = clamp_levels(q, 127)
        assert (out.q_scale(), out.q_zero_point()) == (q.q_scale(), q.q_zero_point())
        assert torch.equal(out.int_repr(), q.int_repr().clamp(0, 127))
