"""What a traced graph keeps of a forward's hooks, buffer updates, mode branches and
weight norm: ``quant.mode: none`` graphs stay bit-identical (``torch.equal``) to the model,
switched between train and eval mode on one compiled graph. The cases refused instead are
in ``tests/test_bad_inputs_trace.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import qcompile as qc
from qcompile.passes.trace.forward_effects import StateMarks, reads_training

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


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


class BufferCount(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.fc2(torch.relu(self.fc1(x))) + self.count


class FunctionalDropout(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(torch.relu(self.fc1(x)), 0.3, self.training)
        return self.fc2(F.dropout1d(y.unsqueeze(0), p=0.2, training=self.training).squeeze(0))


class Keyed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"it's": nn.Linear(8, 4), "a b": nn.Linear(8, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["it's"](x) - self.heads["a b"](x)


def seeded(build, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def assert_bit_identical(build, spec: dict, modes=("train", "eval", "train"), steps: int = 2
                         ) -> nn.Module:
    """Compile a fresh model in its first mode; run it and a reference copy ``steps`` times
    per mode, switching the one graph with .train() / .eval(); same RNG seed each call."""
    model = seeded(build)
    getattr(model, modes[0])()
    ref = copy.deepcopy(model)
    gm = qc.qcompile(model, spec, example_inputs=(X,))
    gm.meta["test_model"] = model
    for i, mode in enumerate(modes):
        getattr(gm, mode)()
        getattr(ref, mode)()
        for step in range(steps):
            torch.manual_seed(10 * i + step)
            want = ref(X)
            torch.manual_seed(10 * i + step)
            got = gm(X)
            assert torch.equal(got, want), f"{mode} mode, call {step}"
    return gm


def root_hooks() -> nn.Module:
    m = MLP()
    m.register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    m.register_forward_hook(lambda mod, args, out: out + 1)
    return m


def root_kwargs_hook() -> nn.Module:
    m = MLP()
    m.register_forward_pre_hook(lambda mod, args, kwargs: ((args[0] - 1,), kwargs),
                                with_kwargs=True)
    return m


def traced_through_hook() -> nn.Module:
    m = WithBlock()
    m.block.register_forward_hook(lambda mod, args, out: out * 0.5)
    return m


@pytest.mark.parametrize(("build", "method"), [
    (root_hooks, "symbolic"), (root_kwargs_hook, "symbolic"), (traced_through_hook, "symbolic"),
    (root_hooks, "export"), (traced_through_hook, "export")],
    ids=["root-hooks", "root-kwargs-pre-hook", "traced-through-hook", "root-hooks-export",
         "traced-through-hook-export"])
def test_value_returning_hooks_are_kept(build, method: str) -> None:
    """Hooks that change inputs or outputs become part of the graph (torch.export runs the
    root's hooks too); the reference is the model called with its hooks."""
    spec = {"quant": {"mode": "none"}, "trace": {"method": method}}
    gm = assert_bit_identical(build, spec)
    hooks = {id(h) for m in gm.meta["test_model"].modules()
             for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())}
    assert hooks
    in_graph = {id(h) for m in gm.modules()
                for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())}
    assert not hooks & in_graph  # baked into the graph's code, not run a second time


def test_leaf_module_hook_runs_on_every_call() -> None:
    """A hook on a module the graph calls (a leaf) runs on every call of the graph, side
    effects included."""
    seen: list[torch.Tensor] = []
    model = seeded(MLP)
    model.fc1.register_forward_hook(lambda mod, args, out: seen.append(out))
    gm = qc.qcompile(model, {"quant": {"mode": "none"}}, example_inputs=(X,))
    seen.clear()
    for _ in range(3):
        gm(X)
    assert len(seen) == 3
    assert torch.equal(seen[0], F.linear(X, model.fc1.weight, model.fc1.bias))


def test_leaf_hook_kept_under_qat_when_the_layer_is_skipped() -> None:
    """The fix the QAT refusal names: a skip rule keeps the layer a call, hooks and all."""
    seen: list[int] = []
    model = seeded(MLP)
    model.fc1.register_forward_hook(lambda mod, args, out: seen.append(1))
    rules = [{"match": {"name": "fc1"}, "skip": True},
             {"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}]
    gm = qc.qcompile(model, {"quant": {"mode": "qat", "rules": rules}}, example_inputs=(X,))
    seen.clear()
    gm(X)
    assert seen == [1]


@pytest.mark.parametrize("method", ["auto", "export"])
def test_in_place_buffer_update_is_kept_by_export(method: str) -> None:
    """``self.count.add_(1)``: symbolic tracing would run it once (refused), so ``auto``
    captures with torch.export, whose graph updates the buffer on every call."""
    gm = assert_bit_identical(BufferCount, {"quant": {"mode": "none"},
                                            "trace": {"method": method}}, steps=2)
    assert qc.report(gm).trace_method == "export"
    assert gm.get_buffer("count").item() == 6.0  # 3 modes x 2 calls


def test_functional_dropout_follows_train_and_eval() -> None:
    """``F.dropout(x, p, self.training)`` becomes a dropout module that reads its own flag:
    same random numbers in train mode, identity in eval mode, whichever mode compiled."""
    for first in ("train", "eval"):
        gm = assert_bit_identical(FunctionalDropout, {"quant": {"mode": "none"}},
                                  modes=(first, "eval" if first == "train" else "train", first))
        assert sum(isinstance(m, (nn.Dropout, nn.Dropout1d)) for m in gm.modules()) == 2
        assert list(gm.state_dict()) == list(seeded(FunctionalDropout).state_dict())


def test_parametrized_weight_norm_trains_g_and_v() -> None:
    """torch.nn.utils.parametrizations.weight_norm: the graph computes the weight from g and
    v on every call, so a training step moves g and v and the output follows, exactly as
    in the model."""
    def build() -> nn.Module:
        m = MLP()
        m.fc1 = nn.utils.parametrizations.weight_norm(m.fc1)
        return m

    model = seeded(build)
    ref = copy.deepcopy(model)
    gm = assert_bit_identical(lambda: copy.deepcopy(model), {"quant": {"mode": "none"}})
    for net in (ref, gm):
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net(X).square().mean().backward()
        opt.step()
    g = "fc1.parametrizations.weight.original0"
    assert torch.equal(gm.get_parameter(g), ref.get_parameter(g))
    assert not torch.equal(gm.get_parameter(g), model.get_parameter(g))  # it moved
    assert torch.equal(gm.eval()(X), ref.eval()(X))


@pytest.mark.parametrize("mode", ["none", "qat"])
def test_module_dict_key_with_a_quote_compiles(mode: str) -> None:
    """A key fx can write (a single quote, a space) compiles; mode none is bit-identical,
    and QAT quantizes both heads."""
    spec = {"quant": {"mode": mode, "rules": [] if mode == "none" else [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}]}}
    if mode == "none":
        assert_bit_identical(Keyed, spec)
    else:
        gm = qc.qcompile(seeded(Keyed), spec, example_inputs=(X,))
        assert {"heads.it's.weight_fake_quant", "heads.a b.weight_fake_quant"} <= set(
            qc.quantizers(gm))
        assert gm(X).shape == (4, 4)


def test_state_marks_name_what_changed() -> None:
    """The detector itself: an assigned attribute, an in-place buffer write, nothing else."""
    m = BufferCount()
    marks = StateMarks.of(m)
    m.count.add_(1)
    m.fc1.note = "x"
    got = {(c.module, c.what, c.name) for c in marks.changes()}
    assert got == {("", "buffer", "count"), ("fc1", "attribute", "note")}
    marks.restore()
    assert not hasattr(m.fc1, "note")


def test_reads_training_only_for_user_code() -> None:
    """The second trace runs only for classes whose code reads ``training``."""
    assert reads_training(FunctionalDropout)
    assert not reads_training(MLP) and not reads_training(nn.Dropout)


class Counter(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = torch.relu(self.fc1(x))
        if self.training:
            y = y * 2
        return self.fc2(y)


def test_export_front_end_keeps_no_assignment_and_exports_train_mode() -> None:
    """What ``trace.method: export`` does where symbolic tracing refuses (stated here so a
    change is seen): torch.export undoes attribute assignments after its run and its graph
    makes none, and it captures an ``if self.training:`` branch in train mode."""
    model = seeded(Counter).eval()
    gm = qc.qcompile(model, {"quant": {"mode": "none"}, "trace": {"method": "export"}},
                     example_inputs=(X,))
    gm(X)
    assert model.calls == 0 and getattr(gm, "calls", 0) == 0
    want_train = model.fc2(2 * torch.relu(model.fc1(X)))
    assert torch.equal(gm.eval()(X), want_train)  # the train-mode branch, in eval mode
