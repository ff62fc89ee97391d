"""Golden before/after dumps for the ``fold_bn`` pass: folding (static), fusion groups,
simulated-free QAT, and the cases where folding must not fire."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.passes.fold_bn import fold_bn
from qcompile.passes.trace import trace

# -- helpers --------------------------------------------------------------------------

W8 = {"dtype": "int8"}


def spec(mode: str = "static", *, fold: bool = True, module: str = "Conv2d") -> dict:
    return {"quant": {"mode": mode, "fold_bn": fold,
                      "rules": [{"match": {"module": module}, "weight": W8}]}}


def run_fold(model: nn.Module, spec_dict: dict, *inputs: torch.Tensor):
    """(dump before fold_bn, graph after it, ctx with fold_bn's notes)."""
    ctx = Context(spec=qc.CompileSpec.model_validate(spec_dict), model=model,
                  example_inputs=inputs or None)
    gm = trace(None, ctx)
    gm.graph.lint()
    gm.recompile()
    before = format_graph(gm)
    ctx.notes = []
    gm = fold_bn(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return before, gm, ctx


def dump(before: str, gm, ctx: Context) -> str:
    notes = "\n".join(ctx.notes) or "(none)"
    return (f"## before fold_bn\n{before}\n## after fold_bn\n{format_graph(gm)}\n"
            f"## notes\n{notes}")


def bn_modules(gm) -> list[str]:
    return [name for name, m in gm.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def with_stats(model: nn.Module) -> nn.Module:
    """Give every BatchNorm non-trivial running statistics and affine parameters."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.randn(m.num_features, generator=g))
                m.bias.copy_(torch.randn(m.num_features, generator=g))
    return model


# -- models ---------------------------------------------------------------------------


class ConvBnRelu(nn.Module):
    def __init__(self, bias: bool = True, track: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, bias=bias)
        self.bn = nn.BatchNorm2d(4, track_running_stats=track)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class ConvTwoUsers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class BnTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn(self.c2(F.relu(self.bn(self.c1(x))))))


class ConvShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(3)
        self.bn2 = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn2(self.conv(self.bn1(self.conv(x))))


class LinearBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))

# -- folding --------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["conv-bias", "no-conv-bias"])
def test_static_conv_bn_relu_folds_bn(golden, bias):
    model = with_stats(ConvBnRelu(bias=bias)).eval()
    before, gm, ctx = run_fold(model, spec("static"), X)
    if bias:
        golden("fold_bn_static_conv_bn_relu", dump(before, gm, ctx))
    assert bn_modules(gm) == []
    assert [n.name for n in gm.graph.nodes] == ["x", "conv", "relu", "output"]
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["conv"].meta["qcompile.fusion"] == ("conv", "relu")
    assert nodes["relu"].meta["qcompile.fusion"] == ("conv", "relu")
    assert ctx.notes == ["folded bn into conv"]
    gm.eval()
    with torch.no_grad():
        assert torch.allclose(gm(X), model(X), atol=1e-5, rtol=0)
    # the user's model still has its BatchNorm and its own conv weight
    assert isinstance(model.bn, nn.BatchNorm2d)
    assert gm.get_submodule("conv").weight is not model.conv.weight
    assert not torch.equal(gm.get_submodule("conv").weight, model.conv.weight)


def test_static_linear_bn_folds_for_2d_outputs():
    model = with_stats(LinearBn()).eval()
    x = torch.randn(3, 5)
    _, gm, ctx = run_fold(model, spec("static", module="Linear"), x)
    assert bn_modules(gm) == []
    assert ctx.notes == ["folded bn into fc"]
    gm.eval()
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=1e-5, rtol=0)


def test_linear_bn_without_shapes_is_kept():
    _, gm, ctx = run_fold(with_stats(LinearBn()).eval(), spec("static", module="Linear"))
    assert bn_modules(gm) == ["bn"]
    assert ctx.notes == ["kept bn: Linear+BatchNorm folds only for 2-D outputs, "
                         "and the shape is unknown (pass example_inputs)"]


def test_dynamic_mode_folds_too():
    model = with_stats(ConvBnRelu()).eval()
    _, gm, ctx = run_fold(model, spec("dynamic"), X)
    assert bn_modules(gm) == [] and ctx.notes == ["folded bn into conv"]


def test_qat_keeps_bn_and_records_the_group(golden):
    model = with_stats(ConvBnRelu()).train()
    before, gm, ctx = run_fold(model, spec("qat"), X)
    golden("fold_bn_qat_conv_bn_relu", dump(before, gm, ctx))
    assert bn_modules(gm) == ["bn"]
    group = ("conv", "bn", "relu")
    assert {n.name: n.meta.get("qcompile.fusion") for n in gm.graph.nodes} == {
        "x": None, "conv": group, "bn": group, "relu": group, "output": None}
    assert len(ctx.notes) == 1 and ctx.notes[0].startswith("qat: BatchNorm kept unfolded")
    # BatchNorm keeps training exactly: train-mode outputs match the model's
    with torch.no_grad():
        assert torch.equal(gm(X), model(X))


@pytest.mark.parametrize("relu", [
    pytest.param(lambda y: torch.relu(y), id="torch.relu"),
    pytest.param(lambda y: F.relu(y), id="F.relu"),
    pytest.param(lambda y: y.relu(), id="Tensor.relu"),
    pytest.param(nn.ReLU6(), id="nn.ReLU6"),
])
def test_linear_relu_group_for_every_relu_spelling(relu):
    class LinRelu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = relu if isinstance(relu, nn.Module) else None

        def forward(self, x):
            return self.act(self.fc(x)) if self.act is not None else relu(self.fc(x))

    _, gm, _ = run_fold(LinRelu(), spec("qat", module="Linear"), torch.randn(2, 4))
    fc = next(n for n in gm.graph.nodes if n.name == "fc")
    group = fc.meta["qcompile.fusion"]
    assert len(group) == 2 and group[0] == "fc"
    assert next(iter(fc.users)).name == group[1]


# -- fold_bn does not fire -----------------------------------------------------------


NO_FIRE = {
    "conv_two_users": (ConvTwoUsers, spec("static"), []),
    "bn_called_twice": (BnTwice, spec("static"),
                        ["kept bn: c1 or bn is called twice", "kept bn: c2 or bn is called twice"]),
    "conv_shared": (ConvShared, spec("static"),
                    ["kept bn1: conv or bn1 is called twice",
                     "kept bn2: conv or bn2 is called twice"]),
    "bn_without_running_stats": (lambda: ConvBnRelu(track=False), spec("static"),
                                 ["kept bn: it has no running statistics to fold"]),
    "fold_bn_false": (ConvBnRelu, spec("static", fold=False), []),
}


@pytest.mark.parametrize("case", list(NO_FIRE))
def test_fold_bn_does_not_fire(golden, case):
    make, spec_dict, notes = NO_FIRE[case]
    model = with_stats(make()).eval()
    bns_before = bn_modules(model)
    before, gm, ctx = run_fold(model, spec_dict, X)
    golden(f"fold_bn_no_fire_{case}", dump(before, gm, ctx))
    assert bn_modules(gm) == bns_before  # every BatchNorm is still there
    traced_names = [line.split()[0] for line in before.splitlines()]
    assert [n.name for n in gm.graph.nodes] == traced_names  # no node removed or added
    assert ctx.notes == notes
    gm.eval()
    with torch.no_grad():
        assert torch.equal(gm(X), model(X))


def test_two_users_forms_no_group():
    _, gm, _ = run_fold(ConvTwoUsers().eval(), spec("static"), X)
    assert all("qcompile.fusion" not in n.meta for n in gm.graph.nodes)


def test_shared_conv_weight_is_not_folded():
    class TiedConvs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 3, 3, padding=1)
            self.b = nn.Conv2d(3, 3, 3, padding=1)
            self.b.weight = self.a.weight
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(self.a(x)) + self.b(x)

    model = with_stats(TiedConvs()).eval()
    _, gm, ctx = run_fold(model, spec("static"), X)
    assert bn_modules(gm) == ["bn"]
    assert ctx.notes == ["kept bn: a.weight is shared with another layer"]
    gm.eval()
    with torch.no_grad():
        assert torch.equal(gm(X), model(X))
