"""The ``partition`` pass: the stage of every node, cuts that respect quantizers and
non-tensor values, explicit stages, the cost models and the per-stage report."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from pipeline_models import ResidualMLP, Stack, none, qat
from torch import nn
from torch.fx import GraphModule, Node

import qcompile as qc
from qcompile.graph.dump import format_graph
from qcompile.passes.partition import STAGE_KEY
from qcompile.runtime.fake_quant import FakeQuantize

# -- models ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x)) * 0.5


class LM(nn.Module):
    """embed, two blocks and a head, with root-level ops between them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(4), Block(4)])
        self.head = nn.Linear(4, 10)

    def forward(self, ids):
        h = self.embed(ids) * 2.0         # root-level: follows embed (stage 0)
        h = self.layers[0](h)
        h = h + 1.0                       # root-level: follows layers.0 (stage 0)
        h = self.layers[1](h)
        h = torch.tanh(h)                 # root-level: follows layers.1 (stage 1)
        return self.head(h)


class ShapeAcross(nn.Module):
    """``n = x.shape[0]`` is computed after ``a`` and used after ``c``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        h = self.a(x)
        n = h.shape[0]
        h = self.c(self.b(h))
        h = h.reshape(n, -1)
        return self.d(h)


class WideThenNarrow(nn.Module):
    """A heavy linear-relu group followed by a light head (flops balance)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.act = nn.ReLU()
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.act(self.fc(x)))


class ConvBNReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


# -- helpers --------------------------------------------------------------------------


class Capture:
    """Instrument keeping the graph as ``partition`` left it (before ``place``)."""

    def __init__(self) -> None:
        self.graphs: dict[str, GraphModule] = {}
        self.dumps: dict[str, str] = {}

    def after_pass(self, index, record, gm, ctx) -> None:
        self.graphs[record.name] = gm
        self.dumps[record.name] = format_graph(gm)

    def finish(self, report, gm) -> None:
        pass


def compile_and_capture(model, spec, *inputs) -> tuple[GraphModule, GraphModule]:
    """(placed graph, the graph after partition)."""
    cap = Capture()
    gm = qc.qcompile(model, spec, example_inputs=inputs or None, instruments=[cap])
    return gm, cap.graphs["partition"]


def data_nodes(g: GraphModule) -> list[Node]:
    """Placeholders and every node a model input reaches (the computation)."""
    reached: set[Node] = set()
    for n in g.graph.nodes:
        if n.op == "placeholder" or any(i in reached for i in n.all_input_nodes):
            reached.add(n)
    return [n for n in g.graph.nodes if n in reached and n.op != "output"]


def anchors(g: GraphModule) -> list[Node]:
    return [n for n in data_nodes(g) if n.op != "placeholder"]


def is_fake_quant(g: GraphModule, n: Node) -> bool:
    return n.op == "call_module" and isinstance(g.get_submodule(str(n.target)), FakeQuantize)


def crossing(g: GraphModule, i: int) -> list[Node]:
    """Values computed at or before anchor ``i`` and used after it."""
    order = anchors(g)
    pos = {n: j for j, n in enumerate(order)}
    out = []
    for v in data_nodes(g):
        if pos.get(v, -1) > i:
            continue
        if any(u.op == "output" or pos.get(u, -1) > i for u in v.users):
            out.append(v)
    return out


def splits_a_quantized_op(g: GraphModule, v: Node, i: int) -> bool:
    """Sending ``v`` across the cut after anchor ``i`` would separate an op (or its fusion
    group) from its activation quantizer. (A model input may cross a cut in float: its
    own quantizer, read by the layer it feeds, can sit before the cut.)"""
    pos = {n: j for j, n in enumerate(anchors(g))}
    if any(is_fake_quant(g, u) and pos.get(u, -1) > i for u in v.users):
        return True
    group = v.meta.get("qcompile.fusion")
    return group is not None and group[-1] != v.name


def tensor_bytes(v: Node) -> int:
    tm = v.meta["tensor_meta"]
    return int(tm.shape.numel()) * torch.empty((), dtype=tm.dtype).element_size()


def stage_lines(g: GraphModule) -> str:
    return "\n".join(f"{n.name} -> {n.meta[STAGE_KEY]}" for n in g.graph.nodes)


# -- property: stages of random stacks ------------------------------------------------

KINDS = st.sampled_from(["linear", "relu", "layernorm", "residual", "dropout"])


@settings(max_examples=30)
@example(kinds=["residual", "layernorm", "linear", "relu", "residual"], d=3, k=4,
         balance="flops", mode="int8-qat")
@example(kinds=["linear", "relu"], d=2, k=3, balance="params", mode="int8-qat")
@example(kinds=["relu"], d=2, k=4, balance="params", mode="none")
@given(kinds=st.lists(KINDS, min_size=1, max_size=6), d=st.integers(2, 4),
       k=st.integers(1, 4), balance=st.sampled_from(["params", "flops"]),
       mode=st.sampled_from(["none", "int8-qat"]))
def test_stages_are_contiguous_and_respect_quantizers(kinds, d, k, balance, mode):
    torch.manual_seed(0)
    model = Stack(kinds, d)
    x = torch.randn(3, d)
    base = qat() if mode == "int8-qat" else none()
    # the cut positions, found independently on the unpartitioned graph
    cap = Capture()
    qc.qcompile(model, base, example_inputs=(x,), instruments=[cap])
    plain = cap.graphs["insert_quant" if mode == "int8-qat" else "trace"]
    n_anchors = len(anchors(plain))
    cuttable = [i for i in range(n_anchors - 1)
                if not any(splits_a_quantized_op(plain, v, i) for v in crossing(plain, i))]
    spec = {**base, "pipeline": {"stages": k, "balance": balance}}
    if k - 1 > len(cuttable):
        with pytest.raises(qc.QCompileError, match=r"pipeline\.stages") as err:
            qc.qcompile(model, spec, example_inputs=(x,))
        assert f"only {len(cuttable)} place(s)" in str(err.value)
        event("k exceeds the cut positions")
        return
    event(f"{mode} k={k}")
    gm, g = compile_and_capture(model, spec, x)
    assert all(STAGE_KEY in n.meta for n in g.graph.nodes)
    order = anchors(g)
    stages = [n.meta[STAGE_KEY] for n in order]
    assert stages == sorted(stages)  # non-decreasing along the computation
    assert sorted(set(stages)) == list(range(k))  # no empty stage
    for n in g.graph.nodes:
        if n.op == "placeholder":
            assert n.meta[STAGE_KEY] == 0
        elif n.op == "output":
            assert n.meta[STAGE_KEY] == k - 1
        elif n not in set(order):  # parameters and weight quantizers: first user's stage
            users = [u for u in n.users if u.op != "output"]
            assert n.meta[STAGE_KEY] == min(u.meta[STAGE_KEY] for u in users), n.name
    for i in range(len(order) - 1):
        if stages[i] != stages[i + 1]:
            assert i in cuttable
            for v in crossing(g, i):
                assert not splits_a_quantized_op(g, v, i), (v.name, stages[i])
    # the report agrees with the graph
    records = qc.report(gm).stages
    assert [r.stage for r in records] == list(range(k))
    assert [r.nodes for r in records] == [stages.count(s) for s in range(k)]
    assert sum(r.parameters for r in records) == sum(p.numel() for p in model.parameters())
    for a, b in itertools.pairwise(records):
        assert a.bytes_out == b.bytes_in
    bounds = [i for i in range(len(order) - 1) if stages[i] != stages[i + 1]]
    assert [r.bytes_in for r in records[1:]] == [
        sum(tensor_bytes(v) for v in crossing(g, i)) for i in bounds]
    ratio = qc.report(gm).balance_ratio
    assert ratio is None or ratio >= 1 - 1e-12


# -- quantizers and cuts --------------------------------------------------------------


def test_each_boundary_sends_a_fake_quantize_output():
    torch.manual_seed(0)
    _, g = compile_and_capture(ResidualMLP(depth=3), qat(pipeline={"stages": 3}),
                               torch.randn(2, 4))
    order = anchors(g)
    bounds = [i for i in range(len(order) - 1)
              if order[i].meta[STAGE_KEY] != order[i + 1].meta[STAGE_KEY]]
    assert len(bounds) == 2
    for i in bounds:
        values = crossing(g, i)
        assert values and all(is_fake_quant(g, v) for v in values), [v.name for v in values]


def test_cut_goes_after_the_quantizer_even_when_cutting_inside_is_cheaper():
    # flops: fc alone is the heaviest node; the unconstrained optimum cuts right after it
    # (between fc and relu), which would send an unquantized, unfused value.
    torch.manual_seed(0)
    model = WideThenNarrow()
    x = torch.randn(2, 64)
    _, g = compile_and_capture(model, qat(pipeline={"stages": 2, "balance": "flops"}), x)
    order = anchors(g)
    last0 = max(i for i, n in enumerate(order) if n.meta[STAGE_KEY] == 0)
    assert is_fake_quant(g, order[last0])
    assert order[last0].args[0].name == "act"
    # without quantization the same model is cut right after fc
    _, plain = compile_and_capture(model, none(pipeline={"stages": 2, "balance": "flops"}), x)
    first1 = [n.name for n in anchors(plain) if n.meta[STAGE_KEY] == 1]
    assert first1[0] == "act"


def test_conv_bn_relu_group_and_its_quantizer_cannot_be_split():
    model = ConvBNReLU()
    x = torch.randn(2, 3, 8, 8)
    # the one place: after the quantizer of the model input, before the group
    with pytest.raises(qc.QCompileError, match=r"only 1 place\(s\)"):
        qc.qcompile(model, qat(pipeline={"stages": 3}), example_inputs=(x,))
    # unquantized, conv | bn | relu may be separated
    gm = qc.qcompile(model, none(pipeline={"stages": 3}), example_inputs=(x,))
    assert [r.nodes for r in qc.report(gm).stages] == [1, 1, 1]


# -- explicit stages ------------------------------------------------------------------

LM_STAGES = [{"modules": ["embed", "layers.0*"]}, {"modules": ["layers.1*", "head"]}]


@pytest.mark.parametrize("mode", ["none", "int8-qat"])
def test_explicit_stages_follow_the_globs(mode):
    torch.manual_seed(0)
    model = LM()
    ids = torch.randint(0, 10, (2, 3))
    base = qat() if mode == "int8-qat" else none()
    gm, g = compile_and_capture(model, {**base, "pipeline": {"stages": LM_STAGES}}, ids)
    stage = {n.name: n.meta[STAGE_KEY] for n in g.graph.nodes}
    assert stage["embed"] == 0
    # root-level ops (owned by no submodule) follow their inputs
    for name, expected in (("mul", 0), ("add", 0), ("tanh", 1)):
        node = next(n for n in g.graph.nodes if n.name == name)
        assert not [o for o, _ in (node.meta.get("nn_module_stack") or {}).values() if o]
        assert stage[name] == expected, name
    for n in anchors(g):
        stack = n.meta.get("nn_module_stack") or {}
        names = [name for name, _ in stack.values()] + (
            [str(n.target)] if n.op == "call_module" else [])
        if any(x.startswith("layers.0") for x in names):
            assert stage[n.name] == 0, n.name
        if any(x.startswith(("layers.1", "head")) for x in names):
            assert stage[n.name] == 1, n.name
    records = qc.report(gm).stages
    top = dict(model.named_children())  # (the qat root-level add_fake_quant aside)
    assert [m for m in records[0].modules if m in top] == ["embed", "layers"]
    assert [m for m in records[1].modules if m in top] == ["layers", "head"]
    assert qc.report(gm).balance == "params"
    if mode == "none":
        assert torch.equal(gm(ids), model(ids))


def test_explicit_stages_out_of_order_are_refused():
    spec = none(pipeline={"stages": list(reversed(LM_STAGES))})
    with pytest.raises(qc.QCompileError, match="forward order") as err:
        qc.qcompile(LM(), spec, example_inputs=(torch.randint(0, 10, (2, 3)),))
    assert "pipeline.stages" in str(err.value)


def test_explicit_stage_matching_nothing_is_named():
    stages = [LM_STAGES[0], {"modules": ["decoder.*"]}, LM_STAGES[1]]
    with pytest.raises(qc.QCompileError, match=r"pipeline\.stages\[1\].*decoder") as err:
        qc.qcompile(LM(), none(pipeline={"stages": stages}),
                    example_inputs=(torch.randint(0, 10, (2, 3)),))
    assert "matched no module" in str(err.value)


class Parallel(nn.Module):
    """Two independent branches: ``a`` runs before ``b`` in the traced order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        return self.c(self.a(x) + self.b(x))


class LateRootOp(nn.Module):
    """``r = h0 * 2`` is traced after ``b`` but only uses ``a``'s output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        h0 = self.a(x)
        h1 = self.b(h0)
        r = h0 * 2.0
        return self.c(h1 + r)


@pytest.mark.parametrize(("model", "stages"), [
    (LateRootOp, [{"modules": ["a"]}, {"modules": ["b", "c"]}]),
    (Parallel, [{"modules": ["b"]}, {"modules": ["a", "c"]}]),
], ids=["root-op-traced-late", "independent-branches"])
def test_explicit_stages_against_the_traced_order_land_where_the_globs_say(model, stages):
    torch.manual_seed(0)
    model = model()
    x = torch.randn(2, 4)
    spec = none(pipeline={"stages": stages})
    try:
        gm = qc.qcompile(model, spec, example_inputs=(x,))
    except qc.QCompileError as e:  # refusing is fine too
        assert "forward order" in str(e)
        return
    assert torch.equal(gm(x), model(x))
    held = {name: [n.target for n in child.graph.nodes if n.op == "call_module"]
            for name, child in gm.named_children()}
    assert held == {f"stage_{i}": s["modules"] for i, s in enumerate(stages)}
    assert [s.modules for s in qc.report(gm).stages] == [s["modules"] for s in stages]


@pytest.mark.parametrize("with_inputs", [True, False])
def test_non_tensor_across_an_explicit_boundary_is_refused(with_inputs):
    spec = none(pipeline={"stages": [{"modules": ["a", "b"]}, {"modules": ["c", "d"]}]})
    inputs = (torch.randn(2, 4),) if with_inputs else None
    with pytest.raises(qc.QCompileError, match="non-tensor") as err:
        qc.qcompile(ShapeAcross(), spec, example_inputs=inputs)
    assert "pipeline.stages" in str(err.value)
    assert "getitem" in str(err.value)


@pytest.mark.parametrize("with_inputs", [True, False])
def test_automatic_stages_avoid_non_tensor_cuts(with_inputs):
    # params balance: a|b|c|d weigh the same, the best cut (after b) would send n.
    torch.manual_seed(0)
    model = ShapeAcross()
    x = torch.randn(2, 4)
    gm, g = compile_and_capture(model, none(pipeline={"stages": 2}),
                                *((x,) if with_inputs else ()))
    stage = {n.name: n.meta[STAGE_KEY] for n in g.graph.nodes}
    assert stage["getattr_1"] == stage["getitem"] == stage["reshape"]
    assert stage["a"] == 0 and stage["d"] == 1
    assert torch.equal(gm(x), model(x))


# -- costs and the report -------------------------------------------------------------


def test_report_stages_match_what_crosses_at_run_time():
    torch.manual_seed(0)
    model = ResidualMLP(depth=3)
    x = torch.randn(5, 4)
    gm = qc.qcompile(model, qat(pipeline={"stages": 3}), example_inputs=(x,))
    report = qc.report(gm)
    assert len(report.stages) == 3
    assert all(s.device == "cpu" for s in report.stages)
    assert sum(s.parameters for s in report.stages) == sum(
        p.numel() for p in model.parameters())
    assert sum(s.parameter_bytes for s in report.stages) == 4 * sum(
        p.numel() for p in model.parameters())
    seen: dict[str, tuple[int, int]] = {}

    def hook(name):
        def record(module, args, out):
            outs = out if isinstance(out, tuple) else (out,)
            seen[name] = (sum(a.numel() * a.element_size() for a in args),
                          sum(o.numel() * o.element_size() for o in outs))
        return record

    for name, child in gm.named_children():
        child.register_forward_hook(hook(name))
    gm(x)
    for s in report.stages:
        assert seen[f"stage_{s.stage}"] == (s.bytes_in, s.bytes_out)
    # params balance, counted here from what each stage holds (not the report's costs):
    # three blocks of 4x4 + 4 float32 parameters (80 bytes) and a 4x2 + 2 head (40 bytes);
    # the best 3-way cut of [80, 80, 80, 40] is [80, 80, 120]
    held = [4 * sum(p.numel() for p in gm.get_submodule(f"stage_{i}").parameters())
            for i in range(3)]
    assert held == [80, 80, 120]
    assert [s.cost for s in report.stages] == held
    assert report.balance == "params"
    assert report.balance_ratio == pytest.approx(120 / (280 / 3))
    assert report.balance_ratio >= 1
    assert "stages: 3 (balance params" in report.text()


def test_params_balance_costs_are_parameter_bytes():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    gm = qc.qcompile(model, none(pipeline={"stages": 2}), example_inputs=(torch.randn(2, 8),))
    records = qc.report(gm).stages
    assert [s.modules for s in records] == [["0", "1"], ["2", "3"]]
    assert [s.cost for s in records] == [2 * 72 * 4.0, 2 * 72 * 4.0]
    assert qc.report(gm).balance_ratio == 1.0


def test_flops_balance_counts_forward_and_backward():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(2, 8)
    gm = qc.qcompile(model, none(pipeline={"stages": 2, "balance": "flops"}),
                     example_inputs=(x,))
    report = qc.report(gm)
    assert report.balance == "flops"
    # a linear: 2 * out elements * in_features, x3 for forward + backward; two per stage
    assert [s.cost for s in report.stages] == [2 * 3 * 2 * 16 * 8.0] * 2


def test_flops_balance_needs_example_inputs():
    with pytest.raises(qc.QCompileError, match=r"pipeline\.balance: flops") as err:
        qc.qcompile(ResidualMLP(), none(pipeline={"stages": 2, "balance": "flops"}))
    assert "example_inputs" in str(err.value)
    # shapes from the spec are enough
    spec = none(pipeline={"stages": 2, "balance": "flops"},
                trace={"inputs": [{"shape": [2, 4]}]})
    gm = qc.qcompile(ResidualMLP(), spec)
    assert len(qc.report(gm).stages) == 2


def test_time_balance_needs_example_inputs():
    with pytest.raises(qc.QCompileError, match=r"pipeline\.balance: time"):
        qc.qcompile(ResidualMLP(), none(pipeline={"stages": 2, "balance": "time"}))


@pytest.mark.parametrize("mode", ["none", "int8-qat"])
def test_time_balance_runs(mode):
    torch.manual_seed(0)
    model = ResidualMLP(depth=3)
    x = torch.randn(4, 4)
    base = qat() if mode == "int8-qat" else none()
    gm = qc.qcompile(model, {**base, "pipeline": {"stages": 2, "balance": "time"}},
                     example_inputs=(x,))
    report = qc.report(gm)
    assert report.balance == "time"
    assert len(report.stages) == 2 and all(s.cost > 0 for s in report.stages)
    assert report.balance_ratio >= 1
    assert gm.training  # timing ran in eval mode and restored the flags
    assert all(m.training for m in gm.modules())
    if mode == "none":
        assert torch.equal(gm(x), model(x))


def test_time_balance_leaves_quantizers_untouched():
    torch.manual_seed(0)
    model = ResidualMLP(depth=3)
    x = torch.randn(4, 4)
    timed = qc.qcompile(model, qat(pipeline={"stages": 2, "balance": "time"}),
                        example_inputs=(x,))
    plain = qc.qcompile(model, qat(pipeline={"stages": 2}), example_inputs=(x,))
    a, b = timed.state_dict(), plain.state_dict()
    assert sorted(a) == sorted(b)
    changed = [key for key in a if not torch.equal(a[key], b[key])]
    assert changed == []


class _InPlaceModel(nn.Module):
    """Writes its input and a counter buffer in place, as some models do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        self.calls.add_(1)
        return self.b(torch.relu(self.a(x)))


def test_time_balance_leaves_inputs_and_buffers_alone():
    """Timing runs the graph three times: the caller's example inputs and the graph's
    buffers must not carry those runs (they did: the inputs came back multiplied by 8)."""
    torch.manual_seed(0)
    model = _InPlaceModel()
    x = torch.randn(4, 4)
    before = x.clone()
    gm = qc.qcompile(model, none(pipeline={"stages": 2, "balance": "time"}),
                     example_inputs=(x,))
    assert torch.equal(x, before)
    assert float(model.calls) == 0
    assert all(float(b) == 0 for name, b in gm.state_dict().items() if name.endswith("calls"))


def test_too_many_stages_is_a_clear_error():
    with pytest.raises(qc.QCompileError, match=r"pipeline\.stages: 9 stages need 8 cuts") as e:
        qc.qcompile(ResidualMLP(depth=1), qat(pipeline={"stages": 9}),
                    example_inputs=(torch.randn(2, 4),))
    # [x's fq] | block 0: [linear relu fq] [add fq] | head: [linear fq] -> cuts after the
    # first three fq's
    assert "only 3 place(s)" in str(e.value) and "at most 4 stages" in str(e.value)


# -- golden dumps ---------------------------------------------------------------------


def partition_dump(cap: Capture, g: GraphModule) -> str:
    before = cap.dumps["insert_quant"] if "insert_quant" in cap.dumps else cap.dumps["trace"]
    return (f"## before partition\n{before}\n## after partition\n{format_graph(g)}\n"
            f"## stages\n{stage_lines(g)}")


def test_golden_residual_mlp_qat_three_stages(golden):
    torch.manual_seed(0)
    cap = Capture()
    qc.qcompile(ResidualMLP(depth=3), qat(pipeline={"stages": 3}),
                example_inputs=(torch.randn(2, 4),), instruments=[cap])
    g = cap.graphs["partition"]
    assert cap.dumps["partition"] == cap.dumps["insert_quant"]  # only metadata changes
    stage = {n.name: n.meta[STAGE_KEY] for n in g.graph.nodes}
    assert stage["blocks_0_output_fake_quant"] == 0 and stage["linear_1"] == 1
    assert stage["blocks_1_output_fake_quant"] == 1 and stage["linear_2"] == 2
    assert stage["head_weight"] == 2 and stage["output"] == 2
    golden("partition_residual_mlp_qat_3_stages", partition_dump(cap, g))


def test_golden_one_stage_does_not_split(golden):
    torch.manual_seed(0)
    cap = Capture()
    qc.qcompile(ResidualMLP(depth=2), qat(pipeline={"stages": 1}),
                example_inputs=(torch.randn(2, 4),), instruments=[cap])
    g = cap.graphs["partition"]
    assert {n.meta[STAGE_KEY] for n in g.graph.nodes} == {0}
    golden("partition_one_stage_no_split", partition_dump(cap, g))
