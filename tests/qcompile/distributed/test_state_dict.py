"""``qc.distributed.optimizer_state_dict`` in one process (no process group): a graph
compiled with ``data_parallel: fsdp2`` holds its blocks as child graphs; torch's
``get_optimizer_state_dict`` names their parameters' state by the child
(``stage_0.``), which its own ``set_state_dict`` does not find; qcompile's names it by the
model's names, and a fresh compile resumes from it bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.distributed.state_dict import model_name

dsd = pytest.importorskip("torch.distributed.checkpoint.state_dict")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


def compiled() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    spec = {**qc.load_spec("int8-qat").model_dump(), "data_parallel": {"kind": "fsdp2"}}
    gm = qc.qcompile(model, spec, example_inputs=(torch.randn(4, 8),))
    return gm, torch.optim.AdamW(gm.parameters(), lr=1e-2)


def step(gm: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = gm(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_model_name_drops_a_block_child_only() -> None:
    assert model_name("stage_2.fc.weight", ["stage_2"]) == "fc.weight"
    assert model_name("stage_2.fc.weight", ["stage_1"]) == "stage_2.fc.weight"
    assert model_name("stage_2", ["stage_2"]) == "stage_2"


@pytest.mark.parametrize("flatten", [False, True])
def test_a_fresh_compile_resumes_from_the_model_named_state(flatten: bool) -> None:
    x = torch.randn(4, 8)
    gm, opt = compiled()
    assert [n for n, _ in gm.named_children() if n.startswith("stage_")]  # blocks as children
    for _ in range(2):
        step(gm, opt, x)
    options = dsd.StateDictOptions(flatten_optimizer_state_dict=flatten)
    theirs = dsd.get_optimizer_state_dict(gm, opt, options=options)
    ours = qc.distributed.optimizer_state_dict(gm, opt, options=options)
    names = {n for n, _ in nn.Sequential(Block(), Block(), Block()).named_parameters()}
    keys = set(ours["state"]) if not flatten else {
        k.removeprefix("state.").rsplit(".", 1)[0] for k in ours if k.startswith("state.")}
    assert keys == names
    # copies, as a checkpoint holds (torch's dicts share the live tensors)
    model = copy.deepcopy(dsd.get_model_state_dict(gm, options=options))
    theirs, ours = copy.deepcopy(theirs), copy.deepcopy(ours)
    again, opt2 = compiled()  # torch's names: not found by torch's own loader
    with pytest.raises((RuntimeError, KeyError), match=r"optimizer state|param_groups"):
        dsd.set_state_dict(again, opt2, model_state_dict=model, optim_state_dict=theirs,
                           options=options)
    again, opt2 = compiled()
    dsd.set_state_dict(again, opt2, model_state_dict=model, optim_state_dict=ours,
                       options=options)
    assert [step(gm, opt, x) for _ in range(2)] == [step(again, opt2, x) for _ in range(2)]
    a, b = gm.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
