"""Golden before/after dumps of ``fold_bn`` on transposed convolutions: BatchNorm folded
(static; grouped too, which ``torch.nn.utils.fusion`` does not fold), kept for QAT with the
fusion group recorded, and not folded where the conv's output has another reader."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.passes.fold_bn import fold_bn, fuse_conv_transpose_bn_weights
from qcompile.passes.trace import trace

CT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def spec(mode: str) -> dict:
    return {"quant": {"mode": mode, "rules": [
        {"match": {"module": "ConvTranspose*"}, "weight": {"dtype": "int8"},
         "activation": {"dtype": "uint8", "symmetric": False}}]}}


class Up(nn.Module):
    """ConvTranspose-BN-ReLU; ``tap``: the conv's output is also returned (a second user)."""

    def __init__(self, dims: int = 2, groups: int = 2, tap: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = CT[dims](4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups)
        self.bn = BN[dims](6)
        self.tap = tap
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # statistics and affine parameters worth folding
            self.bn.running_mean.copy_(torch.randn(6, generator=g))
            self.bn.running_var.copy_(torch.rand(6, generator=g) + 0.5)
            self.bn.weight.copy_(torch.randn(6, generator=g))
            self.bn.bias.copy_(torch.randn(6, generator=g))

    def forward(self, x: torch.Tensor):
        y = self.up(x)
        out = F.relu(self.bn(y))
        return (out, y) if self.tap else out


def run_fold(model: nn.Module, mode: str, x: torch.Tensor) -> tuple[str, torch.fx.GraphModule]:
    ctx = Context(spec=qc.CompileSpec.model_validate(spec(mode)), model=model,
                  example_inputs=(x,))
    gm = trace(None, ctx)
    gm.recompile()
    before = format_graph(gm)
    ctx.notes = []
    gm = fold_bn(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    text = (f"## before fold_bn\n{before}\n## after fold_bn\n{format_graph(gm)}\n"
            f"## notes\n{chr(10).join(ctx.notes) or '(none)'}")
    return text, gm


def has_bn(gm: torch.fx.GraphModule) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gm.modules())


def test_golden_static_folds_grouped_conv_transpose(golden) -> None:
    model, x = Up().eval(), torch.randn(2, 4, 5, 5)
    text, gm = run_fold(model, "static", x)
    golden("fold_bn_conv_transpose_static", text)
    assert not has_bn(gm)
    assert torch.allclose(gm(x), model(x), atol=1e-5)


def test_golden_qat_keeps_bn_and_records_the_group(golden) -> None:
    text, gm = run_fold(Up(groups=1), "qat", torch.randn(2, 4, 5, 5))
    golden("fold_bn_conv_transpose_qat", text)
    assert has_bn(gm) and "fusion=up+bn+relu" in text


def test_golden_does_not_fold_when_the_conv_output_has_another_reader(golden) -> None:
    text, gm = run_fold(Up(tap=True).eval(), "static", torch.randn(2, 4, 5, 5))
    golden("fold_bn_conv_transpose_no_fire", text)
    assert has_bn(gm) and "folded" not in text


@pytest.mark.parametrize(("dims", "groups"), [(1, 3), (3, 1)])
def test_static_fold_is_exact_in_float(dims: int, groups: int) -> None:
    model = nn.Sequential(CT[dims](6, 9, 2, stride=2, groups=groups), BN[dims](9)).eval()
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.uniform_(-2.0, 2.0)  # negative factors too
    x = torch.randn(2, 6, *([3] * dims))
    _, gm = run_fold(model, "static", x)
    assert not has_bn(gm)
    assert torch.allclose(gm(x), model(x), atol=1e-5)


def test_a_shard_of_rows_folds_like_the_whole_weight() -> None:
    """What a sharded compile_once folds per rank: rows of the [in, out / groups, k...]
    weight (input channels) with the whole statistics."""
    torch.manual_seed(0)
    w, mean, var = torch.randn(8, 3, 2, 2), torch.randn(6), torch.rand(6) + 0.5
    gamma, beta = torch.randn(6), torch.randn(6)
    whole, bias = fuse_conv_transpose_bn_weights(w, None, mean, var, 1e-5, gamma, beta, 2)
    part, part_bias = fuse_conv_transpose_bn_weights(w[3:7], None, mean, var, 1e-5, gamma,
                                                     beta, 2, first_row=3, in_channels=8)
    assert torch.equal(part, whole[3:7]) and torch.equal(part_bias, bias)
