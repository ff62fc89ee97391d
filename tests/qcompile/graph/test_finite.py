"""``train.check_finite``: in the first training steps a NaN or infinity reaching a
quantizer is an error naming the quantizer, its node and the op upstream; evaluation
forwards, spent budgets and ``check_finite: 0`` check nothing; the budget survives copies
and ``torch.save``. Both front ends."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import qcompile as qc

A8 = {"dtype": "uint8", "symmetric": False}
W8 = {"dtype": "int8", "granularity": "per_channel"}


class Net(nn.Module):
    """A Linear, then a division by a (learned) norm that can be 0, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h / h.square().mean(-1, keepdim=True).sqrt())


def compiled(method: str, steps: int | None = None) -> torch.fx.GraphModule:
    spec = {"quant": {"mode": "qat", "rules": [
        {"match": {"module": "Linear"}, "weight": W8, "activation": A8}]},
        "trace": {"method": method}}
    if steps is not None:
        spec["train"] = {"check_finite": steps}
    return qc.qcompile(Net(), spec, example_inputs=(torch.randn(4, 8),))


def nan_batch(gm: torch.fx.GraphModule) -> torch.Tensor:
    """fc1 set so that the batch's first row gives ``h == 0`` (its bias cancelled): that
    row is 0 / sqrt(0), NaN."""
    fc1 = gm.get_submodule("fc1")
    x = torch.randn(4, 8)
    with torch.no_grad():
        fc1.weight[:, :] = 0.0
        fc1.bias[:] = torch.linspace(0.5, 1.0, 8)
        fc1.weight[:, 0] = -torch.linspace(0.5, 1.0, 8)  # x[:, 0] == 1 zeroes the row
    x[0, 0] = 1.0
    x[0, 1:] = 0.0
    return x


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_a_nan_reaching_a_quantizer_is_an_error_naming_it_and_the_op_upstream(
        method: str) -> None:
    gm = compiled(method)
    x = nan_batch(gm)
    with pytest.raises(qc.QCompileError) as e:
        gm(x)
    msg = str(e.value)
    # fc2's output quantizer is the first to read what the division made
    assert msg.startswith("training forward: quantizer 'fc2.output_fake_quant'"), msg
    assert "nearest op upstream" in msg and ": div (node " in msg, msg
    assert "holds 4 NaN" in msg, msg  # fc2's 4 outputs of the first row
    assert "train.check_finite: 0" in msg
    # the same forward in eval mode is not checked (NaN flows out as computed)
    gm.eval()
    assert torch.isnan(gm(x)).any()


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_the_check_ends_after_its_budget_and_can_be_off(method: str) -> None:
    gm = compiled(method, steps=2)
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    for _ in range(2):  # two optimizer steps spend the budget
        gm(torch.randn(4, 8)).sum().backward()
        opt.step()
    gm(torch.randn(4, 8))  # the forward after the last step sees the budget spent
    assert all(q.check_finite is None for q in qc.quantizers(gm).values())
    assert torch.isnan(gm(nan_batch(gm))).any()
    off = compiled(method, steps=0)
    assert torch.isnan(off(nan_batch(off))).any()


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_the_budget_survives_copies_and_saving(how: str) -> None:
    gm = compiled("symbolic")
    gm(torch.randn(4, 8))  # checks on
    if how == "deepcopy":
        twin = copy.deepcopy(gm)
    else:
        f = io.BytesIO()
        torch.save(gm, f)
        f.seek(0)
        twin = torch.load(f, weights_only=False)
    with pytest.raises(qc.QCompileError, match=r"holds .* NaN"):
        twin(nan_batch(twin))


def test_a_diverged_weight_says_so() -> None:
    gm = compiled("symbolic")
    with torch.no_grad():
        gm.get_submodule("fc2").weight[0, 0] = float("inf")
    with pytest.raises(qc.QCompileError, match="the weight itself: training diverged"):
        gm(torch.randn(4, 8))


def test_the_check_keeps_nothing_for_backward() -> None:
    """Checking reads each tensor once and keeps nothing: the step saves what it saves
    without the check."""
    def saved(gm: torch.fx.GraphModule) -> int:
        count = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gm(torch.randn(4, 8, requires_grad=True))
        return count

    assert saved(compiled("symbolic")) == saved(compiled("symbolic", steps=0))
