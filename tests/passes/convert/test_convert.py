"""Golden before/after dumps for ``convert`` (``qc.convert``): which nodes become integer
kernels, which weights become integer storage, and the cases where no kernel fires."""

from __future__ import annotations

import warnings

import pytest
import torch
from convert_specs import spec
from torch import nn

import qcompile as qc
from qcompile.graph.dump import format_graph

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")


class ResBlock(nn.Module):
    """conv-bn-relu, conv-bn, residual add, relu, max-pool, dropout, flatten, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.pool, self.drop = nn.MaxPool2d(2), nn.Dropout(0.1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        return self.fc(torch.flatten(self.drop(self.pool(y)), 1))


def mlp(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 4))


def prepared(model: nn.Module, s: qc.CompileSpec, shape: tuple[int, ...]) -> torch.fx.GraphModule:
    """Compiled, then calibrated (static) or trained-forward (QAT) on seeded data."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(shape, generator=gen),) for _ in range(3)]
    gm = qc.qcompile(model, s, example_inputs=batches[0])
    if s.quant.mode == "static":
        qc.calibrate(gm, batches, progress=False)
    elif s.quant.mode == "qat":
        gm.train()
        with torch.no_grad():
            for b in batches:
                gm(*b)
    return gm


def dump(gm: torch.fx.GraphModule, title: str) -> str:
    modules = [f"  {name}: {type(m).__name__}" for name, m in gm.named_modules()
               if name and type(m).__module__.startswith(("torch.ao", "qcompile"))]
    return f"## {title}\n{format_graph(gm)}\n## modules\n" + "\n".join(modules)


def check(golden, name: str, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = qc.convert(gm)
    golden(name, dump(gm, "before convert") + "\n\n" + dump(out, "after convert"))
    return out


def test_static_mlp_becomes_quantized_linear_chain(golden) -> None:
    out = check(golden, "convert_static_mlp", prepared(mlp(), spec("int8-static"), (4, 8)))
    paths = {c.op for c in qc.report(out).conversions}
    assert paths == {"quantized::linear_relu", "quantized::linear", "quantize_per_tensor"}


def test_qat_resblock_folds_bn_and_fuses_add(golden) -> None:
    torch.manual_seed(0)
    out = check(golden, "convert_qat_resblock", prepared(ResBlock(), spec("int8-qat"),
                                                          (2, 3, 8, 8)))
    ops = [c.op for c in qc.report(out).conversions]
    assert ops.count("batchnorm") == 2 and "quantized::add" in ops
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Dropout)) for m in out.modules())


def test_export_graph_converts_like_symbolic(golden) -> None:
    torch.manual_seed(0)
    s = spec("int8-static", trace={"method": "export"})
    out = check(golden, "convert_export_static_resblock",
                prepared(ResBlock().eval(), s, (2, 3, 8, 8)))
    assert sum(c.path == "kernel" for c in qc.report(out).conversions) == 4


def test_dynamic_linear(golden) -> None:
    out = check(golden, "convert_dynamic_mlp", prepared(mlp(), spec("int8-dynamic",
                                                                     inputs=False), (4, 8)))
    assert [c.op for c in qc.report(out).conversions] == ["quantized::linear_dynamic"] * 2


def test_no_kernel_fires_without_quantized_input(golden) -> None:
    """No input quantizer: the first Linear reads float values, so it keeps a float op on
    an int8-stored weight; the second reads a quantized activation and gets the kernel."""
    out = check(golden, "convert_no_fire_float_input",
                prepared(mlp(), spec("int8-static", inputs=False), (4, 8)))
    paths = sorted(c.path for c in qc.report(out).conversions)
    assert paths == ["int_storage", "kernel", "quantize"]


def test_no_kernel_fires_for_int4_groups_and_per_token(golden) -> None:
    out = check(golden, "convert_no_fire_w4a8",
                prepared(mlp(32), spec("w4a8-qat", inputs=False), (4, 32)))
    rep = qc.report(out)
    assert {c.path for c in rep.conversions} == {"int_storage", "fake_quant"}
    assert all("per_token" in c.note for c in rep.conversions if c.path == "fake_quant")


def test_no_kernel_fires_for_weight_only(golden) -> None:
    out = check(golden, "convert_no_fire_weight_only",
                prepared(mlp(), spec("w8-weight-only", inputs=False), (4, 8)))
    assert {c.path for c in qc.report(out).conversions} == {"int_storage"}
