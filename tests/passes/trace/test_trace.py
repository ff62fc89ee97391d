"""Golden before/after dumps and error cases for the ``trace`` pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.distributed.guards import refuse_wrapped
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.passes.trace import trace

# -- helpers --------------------------------------------------------------------------


def make_ctx(model: nn.Module, spec: dict, *inputs: torch.Tensor) -> Context:
    return Context(spec=qc.CompileSpec.model_validate(spec), model=model,
                   example_inputs=inputs or None)


def run_trace(ctx: Context):
    ctx.notes = []
    gm = trace(None, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm


def dump(gm, ctx: Context) -> str:
    notes = "\n".join(ctx.notes) or "(none)"
    return (f"## before trace\n(no graph: the nn.Module)\n## after trace\n{format_graph(gm)}\n"
            f"## notes\n{notes}")


# -- models ---------------------------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.fc(x))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


class Gate(nn.Module):
    """Data-dependent control flow: symbolic tracing cannot follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.gate = Gate()
        self.post = nn.Linear(4, 2)

    def forward(self, x):
        return self.post(self.gate(self.pre(x)))


class TopLevelBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            return y
        return -y


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x, double: bool = False):
        y = self.fc(x)
        if double:
            y = y * 2
        return y


class Stateful(nn.Module):
    """BatchNorm (running stats), Dropout (RNG) and a submodule left in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.frozen = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.frozen(self.drop(self.bn(self.conv(x))))


# -- golden dumps ---------------------------------------------------------------------


def test_trace_mlp(golden):
    model = mlp()
    x = torch.randn(2, 6)
    ctx = make_ctx(model, {}, x)
    gm = run_trace(ctx)
    golden("trace_mlp", dump(gm, ctx))
    assert ctx.trace_method == "symbolic"
    assert ctx.has_shapes
    assert [n.op for n in gm.graph.nodes].count("call_module") == 3
    assert torch.equal(gm(x), model(x))


def test_trace_through_custom_submodule(golden):
    model = Encoder()
    x = torch.randn(2, 8)
    ctx = make_ctx(model, {}, x)
    gm = run_trace(ctx)
    golden("trace_custom_submodule", dump(gm, ctx))
    nodes = {n.name: n for n in gm.graph.nodes}
    # traced through: no node calls a Block, its Linear/ReLU/add are in the graph
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert targets == {"encoder.0.fc", "encoder.0.act", "encoder.1.fc", "encoder.1.act", "head"}
    # ownership survives as nn_module_stack: the add inside encoder.1 is owned by that Block
    stack = list(nodes["add_1"].meta["nn_module_stack"].values())
    assert ("encoder", nn.Sequential) in stack
    assert ("encoder.1", Block) in stack
    assert nodes["head"].meta["nn_module_stack"] and all(
        name != "encoder.1" for name, _ in nodes["head"].meta["nn_module_stack"].values())
    assert torch.equal(gm(x), model(x))


LEAF_FORMS = {
    "class name": "Gate",
    "qualified name": "gate",
    "qualified-name glob": "g?t*",
    "dotted class path": f"{Gate.__module__}.{Gate.__qualname__}",
}


@pytest.mark.parametrize("pattern", list(LEAF_FORMS.values()), ids=list(LEAF_FORMS))
def test_trace_leaf_module_keeps_control_flow_as_one_node(golden, pattern):
    model = Gated()
    x = torch.randn(2, 4)
    ctx = make_ctx(model, {"trace": {"leaf_modules": [pattern]}}, x)
    gm = run_trace(ctx)
    golden("trace_leaf_module", dump(gm, ctx))  # one golden: every form gives this graph
    gate = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "gate"]
    assert len(gate) == 1
    assert not any(str(n.target).startswith("gate.") for n in gm.graph.nodes)
    assert ctx.notes == []  # the pattern was used
    # the branch is decided at run time: inputs taking either branch give the model's output
    inputs = (torch.ones(2, 4) * 10, -torch.ones(2, 4) * 10)
    with torch.no_grad():
        assert {bool(model.pre(xi).sum() > 0) for xi in inputs} == {True, False}
    for xi in inputs:
        assert torch.equal(gm(xi), model(xi))


def test_unused_leaf_pattern_is_noted():
    ctx = make_ctx(Gated(), {"trace": {"leaf_modules": ["Gate", "NoSuchModule"]}},
                   torch.randn(2, 4))
    run_trace(ctx)
    assert ctx.notes == ["trace.leaf_modules entry 'NoSuchModule' matched no module"]


def test_trace_concrete_args(golden):
    model = Flagged()
    x = torch.randn(2, 4)
    ctx = make_ctx(model, {"trace": {"concrete_args": {"double": False}}}, x)
    gm = run_trace(ctx)
    golden("trace_concrete_args", dump(gm, ctx))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert all(getattr(t, "__name__", "") != "mul" for t in ops)  # branch not taken
    assert torch.equal(gm(x), model(x, double=False))


def test_trace_concrete_args_pick_the_branch_without_inputs():
    ctx = make_ctx(Flagged(), {"trace": {"concrete_args": {"double": True}}})
    gm = run_trace(ctx)
    names = [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes]
    assert "mul" in names


class FlaggedNoDefault(Flagged):
    def forward(self, x, double):
        return super().forward(x, double)


@pytest.mark.parametrize("model_cls", [Flagged, FlaggedNoDefault],
                         ids=["value-differs-from-default", "no-default"])
def test_trace_concrete_args_with_example_inputs_use_the_concrete_value(model_cls):
    model = model_cls()
    x = torch.randn(2, 4)
    ctx = make_ctx(model, {"trace": {"concrete_args": {"double": True}}}, x)
    gm = run_trace(ctx)
    mul = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "mul"]
    assert len(mul) == 1
    assert list(mul[0].meta["tensor_meta"].shape) == [2, 4]
    assert ctx.has_shapes


def test_trace_without_example_inputs(golden):
    ctx = make_ctx(mlp(), {})
    gm = run_trace(ctx)
    golden("trace_no_inputs", dump(gm, ctx))
    assert not ctx.has_shapes
    assert all("tensor_meta" not in n.meta for n in gm.graph.nodes)
    assert ctx.notes == ["no example inputs: shapes unknown (pass example_inputs or trace.inputs)"]


def test_trace_inputs_from_spec():
    ctx = make_ctx(mlp(), {"trace": {"inputs": [{"shape": [5, 6], "dtype": "float32"}]}})
    gm = run_trace(ctx)
    assert ctx.has_shapes and ctx.notes == []
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert list(out.meta["tensor_meta"].shape) == [5, 3]


# -- errors ---------------------------------------------------------------------------


def test_data_dependent_control_flow_names_the_module_and_suggests_leaf_modules():
    ctx = make_ctx(Gated(), {}, torch.randn(2, 4))
    with pytest.raises(qc.QCompileError) as info:
        trace(None, ctx)
    err = info.value
    assert "module 'gate' (Gate)" in err.message
    assert "symbolic tracing failed" in err.message
    assert "trace.leaf_modules" in err.fix and "leaf_modules: [Gate]" in err.fix


def test_control_flow_in_the_root_forward_names_the_model():
    ctx = make_ctx(TopLevelBranch(), {}, torch.randn(2, 4))
    with pytest.raises(qc.QCompileError) as info:
        trace(None, ctx)
    assert "the forward of TopLevelBranch" in info.value.message
    assert "concrete_args" in info.value.fix


def _fake_ddp(inner: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ddp = object.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = inner
    return ddp


def test_refuse_wrapped_ddp_says_compile_first_then_wrap():
    with pytest.raises(qc.QCompileError) as info:
        refuse_wrapped(_fake_ddp(mlp()))
    err = info.value
    assert "DistributedDataParallel" in err.message
    assert "qcompile must run before data-parallel wrapping" in err.message
    assert "compile the bare module" in err.fix and "then wrap the result" in err.fix


@pytest.mark.parametrize("nested", [False, True], ids=["root", "submodule"])
def test_qcompile_refuses_a_ddp_wrapped_model(nested):
    model = _fake_ddp(mlp())
    if nested:
        model = nn.Sequential(model)
    with pytest.raises(qc.QCompileError, match="wrapped in DistributedDataParallel"):
        refuse_wrapped(model)
    with pytest.raises(qc.QCompileError, match="before data-parallel wrapping"):
        qc.qcompile(model, qc.CompileSpec())


def test_refuse_wrapped_accepts_a_bare_module():
    refuse_wrapped(mlp())  # no error


def test_wrong_example_input_shape_names_the_node():
    ctx = make_ctx(mlp(), {}, torch.randn(2, 5))
    with pytest.raises(qc.QCompileError) as info:
        trace(None, ctx)
    err = info.value
    assert "running node '_0'" in err.message
    assert "mat1 and mat2 shapes cannot be multiplied" in err.message
    assert "example_inputs" in err.fix


def test_too_many_example_inputs():
    ctx = make_ctx(mlp(), {}, torch.randn(2, 6), torch.randn(2, 6))
    with pytest.raises(qc.QCompileError, match=r"2 example inputs given, the traced model takes 1"):
        trace(None, ctx)


def test_trace_method_export_needs_example_inputs():
    ctx = make_ctx(mlp(), {"trace": {"method": "export"}})
    with pytest.raises(qc.QCompileError) as info:
        trace(None, ctx)
    assert "torch.export front end needs example inputs" in info.value.message
    assert "example_inputs" in info.value.fix


# -- the user's model is never touched ------------------------------------------------


def test_user_model_unchanged_by_trace():
    model = Stateful().train()
    model.frozen.eval()
    with torch.no_grad():  # non-trivial running stats
        model.bn.running_mean.uniform_(-1, 1)
        model.frozen.running_var.uniform_(0.5, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {name: m.training for name, m in model.named_modules()}
    params = {id(p) for p in model.parameters()}
    x = torch.randn(2, 3, 8, 8)
    rng = torch.get_rng_state()

    gm = run_trace(make_ctx(model, {}, x))

    assert torch.equal(torch.get_rng_state(), rng)  # ShapeProp ran dropout in eval mode
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert int(model.bn.num_batches_tracked) == 0
    assert {name: m.training for name, m in model.named_modules()} == modes
    # the graph is a copy, in the same train/eval state as the model
    assert not params & {id(p) for p in gm.parameters()}
    assert gm.training is True
    assert gm.get_submodule("bn").training and not gm.get_submodule("frozen").training


def test_package_keeps_its_import_paths() -> None:
    """Importers of ``qcompile.passes.trace`` (partition's ``example_args``, ``copy_model``)
    keep working now that the package is split by concern."""
    import qcompile.passes.trace as package
    from qcompile.passes.trace import capture_export, capture_symbolic, model_copy, shape_prop

    assert package.copy_model is model_copy.copy_model
    assert callable(package.example_args) and callable(package.trace)
    for module in (capture_export, capture_symbolic, model_copy, shape_prop):
        assert module.__name__.startswith("qcompile.passes.trace."), module
