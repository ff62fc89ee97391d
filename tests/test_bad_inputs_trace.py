"""Models whose forward does more than a traced graph would repeat: refused, not dropped.

Each case compiles a model whose forward assigns attributes, updates buffers in place,
branches on ``self.training``, has hooks the graph cannot run, uses old-style weight norm
or a ``ModuleDict`` key fx cannot write; the harness asserts a ``QCompileError`` naming the
module (or key) and the fix, and that the model and inputs are unchanged. The cases a
traced graph keeps (and their bit-identity) are in ``tests/passes/trace/test_forward_effects.py``.
"""

from __future__ import annotations

import pytest
import torch
from bad_inputs_harness import MLP, Case, World, case_table, check_case, compile_, spec_dict
from torch import nn

import qcompile as qc

CASES: list[Case] = []
case = case_table(CASES)

NONE = {"quant": {"mode": "none"}}
SYMBOLIC_NONE = {"quant": {"mode": "none"}, "trace": {"method": "symbolic"}}


class Counter(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


class WithCounted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Counted()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


class BufferCount(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return super().forward(x) + self.count


class TrainBranch(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc1(x))
        if self.training:
            y = y * 2
        return self.fc2(y)


class Doubling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 2 if self.training else self.fc(x)


class WithBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Doubling()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class WithBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x))


def record_activations(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    module.seen = out  # works by side effect: returns None


def log_inputs(module: nn.Module, args: tuple) -> None:
    return None


def on_grad(module: nn.Module, grad_in: tuple, grad_out: tuple) -> None:
    return None


def block_hooked() -> nn.Module:
    m = WithBlock()
    m.block.register_forward_hook(record_activations)
    return m


def root_hooked() -> nn.Module:
    m = MLP()
    m.register_forward_pre_hook(log_inputs)
    return m


def block_backward_hooked() -> nn.Module:
    m = WithBlock()
    m.block.register_full_backward_hook(on_grad)
    return m


def fc1_hooked() -> nn.Module:
    m = MLP()
    m.fc1.register_forward_hook(record_activations)
    return m


def old_weight_norm() -> nn.Module:
    m = MLP()
    m.fc1 = nn.utils.weight_norm(m.fc1)
    return m


class Keyed(nn.Module):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({key: nn.Linear(8, 4)})
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads[self.key](x)


@case("a forward that counts its calls in an attribute", qc.QCompileError,
      ("Counter", "'calls'", "forward()"), ("move the update out of forward()",), model=Counter)
def _(w: World):
    try:
        return compile_(w, NONE, w.inputs)
    finally:
        assert w.model.calls == 0  # traced on a copy: the model's counter did not move


@case("a submodule that counts its calls", qc.QCompileError, ("'inner'", "Counted", "'calls'"),
      ("leaf_modules: [Counted]",), model=WithCounted)
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("a buffer updated in place, symbolic tracing", qc.QCompileError,
      ("buffer 'count'", "in place"), ("trace.method: export",), model=BufferCount)
def _(w: World):
    return compile_(w, SYMBOLIC_NONE, w.inputs)


@case("the model branches on self.training", qc.QCompileError,
      ("TrainBranch", "self.training", "train-mode"), ("leaf_modules", "remove the branch"),
      model=TrainBranch)
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("a submodule branches on self.training (eval mode)", qc.QCompileError,
      ("'block'", "Doubling", "eval-mode"), ("leaf_modules: [Doubling]",),
      model=lambda: WithBranch().eval())
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("a side-effect forward hook on a traced-through module", qc.QCompileError,
      ("'block'", "forward hook", "record_activations", "returned None"),
      ("leaf_modules: [Block]",), model=block_hooked)
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("a side-effect forward pre-hook on the model", qc.QCompileError,
      ("forward pre-hook", "log_inputs"), ("gm.register_forward_pre_hook",), model=root_hooked)
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("a backward hook on a traced-through module", qc.QCompileError,
      ("'block'", "backward hook", "on_grad"), ("leaf_modules",), model=block_backward_hooked)
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("a forward hook on a layer that QAT quantizes", qc.QCompileError,
      ("'fc1'", "forward hook", "record_activations", "'qat'"), ("skip: true",),
      model=fc1_hooked)
def _(w: World):
    return compile_(w, spec_dict("qat"), w.inputs)


@case("old-style weight norm", qc.QCompileError, ("'fc1'", "torch.nn.utils.weight_norm"),
      ("parametrizations.weight_norm", "remove_weight_norm"), model=old_weight_norm)
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("a ModuleDict key with a double quote", qc.QCompileError, ("'heads.a\"b'", "ModuleDict"),
      ("rename the key", "'a_b'"), model=lambda: Keyed('a"b'))
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("a ModuleDict key with a backslash (QAT)", qc.QCompileError, ("heads.a\\\\b",),
      ("rename the key",), model=lambda: Keyed("a\\b"))
def _(w: World):
    return compile_(w, spec_dict("qat"), w.inputs)


@case("a ModuleDict key with a line break", qc.QCompileError, ("heads.a\\nb",),
      ("rename the key",), model=lambda: Keyed("a\nb"))
def _(w: World):
    return compile_(w, NONE, w.inputs)


@case("an attribute counter, compiled inplace=True", qc.QCompileError, ("'calls'",),
      ("move the update out of forward()",), model=Counter)
def _(w: World):
    try:
        return compile_(w, NONE, w.inputs, inplace=True)
    finally:
        assert w.model.calls == 0  # traced in place: the assignment is put back


class ScaledBy(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.scales = nn.ParameterDict({"it's \"x\"": nn.Parameter(torch.ones(4))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scales["it's \"x\""]


@case("a ParameterDict key with a double quote", qc.QCompileError,
      ("parameter", repr("scales.it's \"x\"")), ("rename the key",), model=ScaledBy)
def _(w: World):
    return compile_(w, NONE, w.inputs)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path) -> None:
    check_case(c, tmp_path)
