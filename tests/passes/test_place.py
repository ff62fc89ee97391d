"""The ``place`` pass: stage children, bit-identical pipelined execution, threaded skip
connections, tied parameters, state_dict under the original names, devices, and golden
dumps of the placed graph."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from pipeline_models import ResidualMLP, Stack, none, qat
from pydantic import ValidationError
from torch import nn
from torch.fx import GraphModule

import qcompile as qc
from qcompile.runtime.fake_quant import FakeQuantize

# -- models ---------------------------------------------------------------------------


class LongSkip(nn.Module):
    """``a``'s output is used by ``c``'s stage: it crosses stage_1 untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.c(self.b(h)) + h


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.layers(self.embed(ids)))


TIED_STAGES = [{"modules": ["embed", "layers.0*"]}, {"modules": ["layers.1*", "head"]}]


def grads_by_original_name(gm: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients keyed by the model's names (``stage_s.`` prefix stripped)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        first, _, rest = name.partition(".")
        key = rest if first.startswith("stage_") else name
        out.setdefault(key, p.grad)
    return out


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    ga, gb = grads_by_original_name(a), grads_by_original_name(b)
    assert set(ga) == set(gb)
    for name in ga:
        assert ga[name] is not None and gb[name] is not None, name
        assert torch.equal(ga[name], gb[name]), name


def placeholders(g: GraphModule) -> list[str]:
    return [n.name for n in g.graph.nodes if n.op == "placeholder"]


def returned(g: GraphModule) -> list[str]:
    out = next(n for n in g.graph.nodes if n.op == "output").args[0]
    return [x.name for x in (out if isinstance(out, tuple) else (out,))]


# -- property: pipelined == unpipelined, bit for bit ----------------------------------

KINDS = st.sampled_from(["linear", "relu", "layernorm", "residual", "dropout"])


@settings(max_examples=40)
@example(kinds=["residual", "layernorm", "linear", "relu", "residual"], d=3, k=4,
         balance="flops", mode="int8-qat", seed=1)
@example(kinds=["residual", "residual", "relu"], d=4, k=3, balance="params",
         mode="int8-qat", seed=2)
@example(kinds=["linear", "relu"], d=2, k=4, balance="params", mode="int8-qat", seed=3)
@example(kinds=["relu", "layernorm", "linear"], d=2, k=4, balance="flops", mode="none", seed=4)
@given(kinds=st.lists(KINDS, min_size=1, max_size=6), d=st.integers(2, 4),
       k=st.integers(1, 4), balance=st.sampled_from(["params", "flops"]),
       mode=st.sampled_from(["none", "int8-qat"]), seed=st.integers(0, 2**16))
def test_pipelined_graph_is_bit_identical(kinds, d, k, balance, mode, seed):
    torch.manual_seed(seed)
    model = Stack(kinds, d)
    x0, x1 = torch.randn(3, d), torch.randn(3, d)
    base = qat() if mode == "int8-qat" else none()
    ref = qc.qcompile(model, base, example_inputs=(x0,))
    try:
        pipe = qc.qcompile(model, {**base, "pipeline": {"stages": k, "balance": balance}},
                           example_inputs=(x0,))
    except qc.QCompileError as e:
        # only allowed when k exceeds the cuttable positions
        assert k > 1
        assert "pipeline.stages" in str(e) and "place(s) where it can be cut" in str(e)
        event("k exceeds the cut positions")
        return
    event(f"{mode} k={k}")
    assert [name for name, _ in pipe.named_children()] == [f"stage_{s}" for s in range(k)]
    # first forward: observers see the same batch on both sides, then freeze them
    # (dropout draws the same masks: same seed, same ops in the same order)
    torch.manual_seed(seed + 1)
    first_pipe = pipe(x0)
    torch.manual_seed(seed + 1)
    assert torch.equal(first_pipe, ref(x0))
    qc.freeze(ref)
    qc.freeze(pipe)
    xa, xb = x1.clone().requires_grad_(), x1.clone().requires_grad_()
    torch.manual_seed(seed + 2)
    out_ref = ref(xa)
    torch.manual_seed(seed + 2)
    out_pipe = pipe(xb)
    assert torch.equal(out_pipe, out_ref)
    out_ref.square().sum().backward()
    out_pipe.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    assert_same_grads(ref, pipe)


# -- structure ------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_children_are_the_stages_in_order(k):
    torch.manual_seed(0)
    model = ResidualMLP(depth=3)
    gm = qc.qcompile(model, none(pipeline={"stages": k}), example_inputs=(torch.randn(2, 4),))
    names = [name for name, _ in gm.named_children()]
    assert names == [f"stage_{s}" for s in range(k)]
    assert all(isinstance(child, GraphModule) for _, child in gm.named_children())
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert calls == names
    # each stage takes exactly what its predecessor returns
    for s in range(1, k):
        assert len(placeholders(getattr(gm, f"stage_{s}"))) == len(
            returned(getattr(gm, f"stage_{s - 1}")))
    x = torch.randn(5, 4)
    assert torch.equal(gm(x), model(x))


def test_skip_connection_across_three_stages_is_threaded():
    torch.manual_seed(0)
    model = LongSkip()
    spec = none(pipeline={"stages": [{"modules": ["a"]}, {"modules": ["b"]}, {"modules": ["c"]}]})
    gm = qc.qcompile(model, spec, example_inputs=(torch.randn(2, 4),))
    s0, s1, s2 = gm.stage_0, gm.stage_1, gm.stage_2
    assert returned(s0) == ["a"]
    # stage_1 receives a, uses it for b, and re-emits it untouched for stage_2
    assert placeholders(s1) == ["a"]
    out1 = next(n for n in s1.graph.nodes if n.op == "output").args[0]
    assert next(n for n in s1.graph.nodes if n.op == "placeholder") in out1
    assert sorted(returned(s1)) == ["a", "b"]
    assert sorted(placeholders(s2)) == ["a", "b"]
    # the top-level graph only connects neighbours
    top_calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    for call in top_calls[1:]:
        producers = {i.target if i.op == "call_module" else i.args[0].target
                     for i in call.all_input_nodes}
        assert producers == {f"stage_{int(call.target[-1]) - 1}"}
    x = torch.randn(3, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = gm(x)
    ref = model(x2)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(gm.stage_0.a.weight.grad, model.a.weight.grad)


def test_activation_quantizer_output_is_what_crosses_each_cut():
    torch.manual_seed(0)
    model = ResidualMLP(depth=3)
    gm = qc.qcompile(model, qat(pipeline={"stages": 3}), example_inputs=(torch.randn(2, 4),))
    for s in range(3):
        stage = getattr(gm, f"stage_{s}")
        out = next(n for n in stage.graph.nodes if n.op == "output").args[0]
        for value in out if isinstance(out, tuple) else (out,):
            assert value.op == "call_module", value.name
            assert isinstance(stage.get_submodule(str(value.target)), FakeQuantize), value.name


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, y):
        h0 = self.a(x)
        h1 = self.b(h0) * y
        return {"first": h0, "out": (self.c(h1), x)}


def test_several_inputs_and_nested_outputs_keep_their_structure():
    torch.manual_seed(0)
    model = TwoInputs()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    gm = qc.qcompile(model, none(pipeline={"stages": 3}), example_inputs=(x, y))
    assert placeholders(gm.stage_0) == ["x", "y"]
    # the first layer's output and the input x are returned: threaded to the end
    assert sorted(returned(gm.stage_2)) == ["a", "c", "x"]
    got, want = gm(x, y), model(x, y)
    assert set(got) == {"first", "out"} and isinstance(got["out"], tuple)
    assert torch.equal(got["first"], want["first"])
    assert torch.equal(got["out"][0], want["out"][0])
    assert torch.equal(got["out"][1], x)


def test_output_computed_from_parameters_alone_is_refused():
    class ParamOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.p = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.b(self.a(x)), self.p * 2

    with pytest.raises(qc.QCompileError, match=r"pipeline: the model returns \['mul'\]"):
        qc.qcompile(ParamOut(), none(pipeline={"stages": 2}),
                    example_inputs=(torch.randn(2, 4),))


def test_training_the_pipeline_leaves_the_users_model_alone():
    torch.manual_seed(0)
    model = ResidualMLP()
    before = copy.deepcopy(model.state_dict())
    gm = qc.qcompile(model, qat(pipeline={"stages": 3}), example_inputs=(torch.randn(2, 4),))
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        gm(torch.randn(8, 4)).square().mean().backward()
        opt.step()
    trained = gm.stage_0.get_submodule("blocks.0.fc").weight
    assert not torch.equal(trained, before["blocks.0.fc.weight"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


# -- tied parameters ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "int8-qat"])
def test_tied_weights_stay_one_parameter_across_stages(mode):
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 10, (2, 3))
    base = qat() if mode == "int8-qat" else none()
    ref = qc.qcompile(model, base, example_inputs=(ids,))
    gm = qc.qcompile(model, {**base, "pipeline": {"stages": TIED_STAGES}},
                     example_inputs=(ids,))
    assert "embed" in dict(gm.stage_0.named_children())
    assert "head" in dict(gm.stage_1.named_children())
    assert gm.stage_0.embed.weight is gm.stage_1.head.weight
    # one Parameter object: the optimizer sees it once
    assert len(list(gm.parameters())) == len(list(model.parameters()))
    assert torch.equal(gm(ids), ref(ids))
    qc.freeze(gm)
    qc.freeze(ref)
    out, out_ref = gm(ids), ref(ids)
    assert torch.equal(out, out_ref)
    out.square().mean().backward()
    out_ref.square().mean().backward()
    assert torch.equal(gm.stage_0.embed.weight.grad, ref.embed.weight.grad)
    assert_same_grads(ref, gm)
    # an update through one stage is seen by the other
    with torch.no_grad():
        gm.stage_1.head.weight.add_(1.0)
    assert torch.equal(gm.stage_0.embed.weight, gm.stage_1.head.weight)


def test_reused_module_in_two_stages_is_shared_and_noted():
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4)
            self.mid = nn.Linear(4, 4)

        def forward(self, x):
            return self.shared(self.mid(self.shared(x)))

    torch.manual_seed(0)
    model = Reuse()
    x = torch.randn(2, 4)
    gm = qc.qcompile(model, none(pipeline={"stages": 2}), example_inputs=(x,))
    assert gm.stage_0.shared.weight is gm.stage_1.shared.weight
    notes = qc.report(gm).passes[-1].notes
    assert "shared.weight is shared by stage_0, stage_1" in notes
    assert torch.equal(gm(x), model(x))
    with pytest.raises(qc.QCompileError, match=r"pipeline\.allow_tied") as err:
        qc.qcompile(model, none(pipeline={"stages": 2, "allow_tied": False}),
                    example_inputs=(x,))
    assert "shared." in str(err.value)
    assert "stage_0 and stage_1" in str(err.value)


def test_allow_tied_false_refuses_tied_embedding_and_head():
    model = TiedLM()
    ids = torch.randint(0, 10, (2, 3))
    with pytest.raises(qc.QCompileError, match=r"pipeline\.allow_tied") as err:
        qc.qcompile(model, none(pipeline={"stages": TIED_STAGES, "allow_tied": False}),
                    example_inputs=(ids,))
    msg = str(err.value)
    assert "embed.weight" in msg or "head.weight" in msg
    assert "stage_0" in msg and "stage_1" in msg


def test_tied_weights_in_one_stage_are_accepted_without_allow_tied():
    model = TiedLM()
    ids = torch.randint(0, 10, (2, 3))
    # both holders of the tied weight in stage 1: nothing is shared between stages
    spec = none(pipeline={"stages": [{"modules": ["layers.0"]},
                                     {"modules": ["embed", "layers.1", "head"]}],
                          "allow_tied": False})
    with pytest.raises(qc.QCompileError, match="forward order"):
        qc.qcompile(model, spec, example_inputs=(ids,))
    spec["pipeline"]["stages"] = [{"modules": ["embed", "layers.*", "head"]}]
    gm = qc.qcompile(model, spec, example_inputs=(ids,))
    assert torch.equal(gm(ids), model(ids))


# -- state_dict -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "int8-qat"])
def test_state_dict_uses_original_names_and_loads_both_ways(mode):
    torch.manual_seed(0)
    model = ResidualMLP(depth=3)
    x = torch.randn(4, 4)
    base = qat() if mode == "int8-qat" else none()
    ref = qc.qcompile(model, base, example_inputs=(x,))
    pipe = qc.qcompile(model, {**base, "pipeline": {"stages": 3}}, example_inputs=(x,))
    assert sorted(pipe.state_dict()) == sorted(ref.state_dict())
    if mode == "none":
        assert sorted(pipe.state_dict()) == sorted(model.state_dict())
    # train the reference a little so its values differ from pipe's
    ref(x)
    qc.freeze(ref)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.25)
    assert not torch.equal(pipe(x), ref(x))
    pipe.load_state_dict(ref.state_dict())
    qc.freeze(pipe)
    assert torch.equal(pipe(x), ref(x))
    # and back: a fresh unpipelined graph from the pipelined state_dict
    other = qc.qcompile(model, base, example_inputs=(x,))
    other.load_state_dict(pipe.state_dict())
    qc.freeze(other)
    assert torch.equal(other(x), pipe(x))
    assert torch.equal(pipe.stage_2.head.weight, ref.head.weight)


def test_state_dict_save_load_round_trip_weights_only():
    torch.manual_seed(0)
    model = ResidualMLP(depth=3)
    x = torch.randn(4, 4)
    pipe = qc.qcompile(model, qat(pipeline={"stages": 3}), example_inputs=(x,))
    pipe(x)
    qc.freeze(pipe)
    buf = io.BytesIO()
    torch.save(pipe.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert sorted(loaded) == sorted(pipe.state_dict())
    fresh = qc.qcompile(model, qat(pipeline={"stages": 3}), example_inputs=(x,))
    fresh.load_state_dict(loaded)
    qc.freeze(fresh)
    assert torch.equal(fresh(x), pipe(x))
    fresh.load_state_dict(loaded, strict=True)  # twice: the hooks do not consume names


def test_tied_state_dict_has_both_names_and_loads():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 10, (2, 3))
    gm = qc.qcompile(model, none(pipeline={"stages": TIED_STAGES}), example_inputs=(ids,))
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    other = TiedLM()
    gm.load_state_dict(other.state_dict())
    assert gm.stage_0.embed.weight is gm.stage_1.head.weight
    assert torch.equal(gm(ids), other(ids))


# -- the export front end --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "int8-qat"])
@pytest.mark.parametrize("model_cls", [ResidualMLP, LongSkip])
def test_export_graphs_pipeline_bit_identically(model_cls, mode):
    torch.manual_seed(0)
    model = model_cls()
    x = torch.randn(3, 4)
    base = (qat if mode == "int8-qat" else none)(trace={"method": "export"})
    ref = qc.qcompile(model, base, example_inputs=(x,))
    pipe = qc.qcompile(model, {**base, "pipeline": {"stages": 3}}, example_inputs=(x,))
    assert qc.report(pipe).trace_method == "export"
    assert [name for name, _ in pipe.named_children()] == ["stage_0", "stage_1", "stage_2"]
    assert torch.equal(pipe(x), ref(x))
    qc.freeze(ref)
    qc.freeze(pipe)
    out_ref, out_pipe = ref(x), pipe(x)
    assert torch.equal(out_pipe, out_ref)
    out_ref.sum().backward()
    out_pipe.sum().backward()
    assert_same_grads(ref, pipe)
    assert sorted(pipe.state_dict()) == sorted(ref.state_dict())


def test_export_tied_weights_keep_every_original_name():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 10, (2, 3))
    base = none(trace={"method": "export"})
    ref = qc.qcompile(model, base, example_inputs=(ids,))
    pipe = qc.qcompile(model, {**base, "pipeline": {"stages": TIED_STAGES}},
                       example_inputs=(ids,))
    assert torch.equal(pipe(ids), ref(ids))
    ref.load_state_dict(model.state_dict())  # the unpipelined graph takes the checkpoint
    assert sorted(pipe.state_dict()) == sorted(ref.state_dict())
    pipe.load_state_dict(model.state_dict())


# -- transfer: int8 -------------------------------------------------------------------


def static(**extra) -> dict:
    spec = qc.load_spec("int8-static").model_dump()
    spec.update(extra)
    return spec


def cut_quantizers(gm: GraphModule) -> list[str]:
    """The quantizers whose integers stage_0 sends (``pack`` nodes' scale targets)."""
    from qcompile.runtime.transfer import pack

    return [str(n.args[1].target).rsplit(".", 1)[0] for n in gm.stage_0.graph.nodes
            if n.op == "call_function" and n.target is pack]


def test_static_int8_transfer_calibrates_then_sends_integers_matching_fp32():
    torch.manual_seed(0)
    model = ResidualMLP(d=8, depth=4)
    x = torch.randn(16, 8)
    batches = [(torch.randn(16, 8),) for _ in range(4)]
    graphs = {t: qc.qcompile(model, static(pipeline={"stages": 2, "transfer": t}),
                             example_inputs=(x,)) for t in ("fp32", "int8")}
    int8 = graphs["int8"]
    cut = cut_quantizers(int8)
    assert cut, "a quantizer output crosses the cut"
    with torch.no_grad():  # before calibration the quantizers are off: floats cross
        sent = int8.stage_0(x)
        assert sent[0].is_floating_point()
        assert torch.equal(int8(x), graphs["fp32"](x))
    for gm in graphs.values():
        qc.calibrate(gm, batches, progress=False)
    qs = {t: qc.quantizers(gm) for t, gm in graphs.items()}
    assert qs["fp32"].keys() == qs["int8"].keys()
    for name, q in qs["int8"].items():  # calibration saw the same values
        assert torch.equal(q.scale, qs["fp32"][name].scale), name
        assert torch.equal(q.zero_point, qs["fp32"][name].zero_point), name
    with torch.no_grad():
        sent = int8.stage_0(x)
        assert sent[0].dtype == torch.uint8  # (integers, scale, zero_point) per packed value
        got, ref = int8(x), graphs["fp32"](x)
    step = float(int8.stage_0.get_submodule(cut[0]).scale.max())
    assert float((got - ref).abs().max()) <= step
    rep = qc.report(int8)
    assert rep.stages[0].bytes_out < qc.report(graphs["fp32"]).stages[0].bytes_out
    assert any("as floats while their quantizers are off" in n for p in rep.passes
               for n in p.notes)
    converted = qc.convert(int8, example_inputs=(x,))  # integers still cross the cut
    head_step = float(int8.stage_1.get_submodule("head.output_fake_quant").scale.max())
    assert qc.report(converted).max_deviation["output0"] <= head_step


def test_int8_transfer_refuses_to_send_integers_that_need_a_gradient():
    torch.manual_seed(0)
    model = ResidualMLP(d=8, depth=2)
    x = torch.randn(4, 8)
    gm = qc.qcompile(model, static(pipeline={"stages": 2, "transfer": "int8"}),
                     example_inputs=(x,))
    gm(x).sum().backward()  # uncalibrated: floats cross, gradients flow
    qc.calibrate(gm, [(x,)], progress=False)
    with pytest.raises(qc.QCompileError, match="carry no gradient"):
        gm(x.requires_grad_())


# -- devices --------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has cuda devices")
@pytest.mark.parametrize("device", ["cuda:3", "cuda"])
def test_missing_device_is_refused(device):
    with pytest.raises(qc.QCompileError, match=rf"pipeline\.devices\[1\].*'{device}'"):
        qc.qcompile(ResidualMLP(), none(pipeline={"stages": 2, "devices": ["cpu", device]}),
                    example_inputs=(torch.randn(2, 4),))


def test_malformed_device_string_is_a_spec_error():
    with pytest.raises(ValidationError, match="gpu:0"):
        qc.qcompile(ResidualMLP(), none(pipeline={"stages": 2, "devices": ["cpu", "gpu:0"]}))


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="this machine has cuda:1")
def test_missing_device_in_explicit_stage_names_the_stage():
    spec = none(pipeline={"stages": [{"modules": ["blocks.0"]},
                                     {"modules": ["blocks.1", "blocks.2", "head"],
                                      "device": "cuda:1"}]})
    with pytest.raises(qc.QCompileError, match=r"pipeline\.stages\[1\]"):
        qc.qcompile(ResidualMLP(), spec, example_inputs=(torch.randn(2, 4),))


def test_meta_device_is_refused_and_leaves_the_model_alone():
    # meta holds no data and runs nothing: a stage on it would return shapes, not outputs
    torch.manual_seed(0)
    model = ResidualMLP()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValidationError) as err:
        qc.qcompile(model, none(pipeline={"stages": 2, "devices": ["cpu", "meta"]}),
                    example_inputs=(torch.randn(2, 4),))
    text = str(err.value)
    assert "pipeline.devices" in text and "'meta'" in text and "cpu" in text
    for key, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, before[key])


# -- golden dumps ---------------------------------------------------------------------


def placed_dump(gm: GraphModule) -> str:
    parts = [f"## top level\n{gm.code.strip()}"]
    for name, child in gm.named_children():
        parts.append(f"## {name}\n{child.code.strip()}")
    report = qc.report(gm)
    parts.append("## stages\n" + "\n".join(
        f"stage {s.stage}: device={s.device} nodes={s.nodes} parameters={s.parameters} "
        f"bytes_in={s.bytes_in} bytes_out={s.bytes_out} modules={s.modules}"
        for s in report.stages))
    return "\n".join(parts)


def test_golden_residual_mlp_qat_three_stages(golden):
    torch.manual_seed(0)
    gm = qc.qcompile(ResidualMLP(depth=3), qat(pipeline={"stages": 3}),
                     example_inputs=(torch.randn(2, 4),))
    assert [name for name, _ in gm.named_children()] == ["stage_0", "stage_1", "stage_2"]
    golden("place_residual_mlp_qat_3_stages", placed_dump(gm))


def test_golden_one_stage_holds_everything(golden):
    torch.manual_seed(0)
    model = ResidualMLP(depth=2)
    x = torch.randn(2, 4)
    gm = qc.qcompile(model, qat(pipeline={"stages": 1}), example_inputs=(x,))
    ref = qc.qcompile(model, qat(), example_inputs=(x,))
    assert [name for name, _ in gm.named_children()] == ["stage_0"]
    stage_ops = [n.target for n in gm.stage_0.graph.nodes if n.op != "placeholder"]
    ref_ops = [n.target for n in ref.graph.nodes if n.op != "placeholder"]
    assert stage_ops == ref_ops
    golden("place_one_stage_no_split", placed_dump(gm))
