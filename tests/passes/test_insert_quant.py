"""Golden before/after dumps for the ``insert_quant`` pass: where quantizers go, how they
are named, how they start per mode, and the errors for schemes a tensor cannot take."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from pass_runs import annotated
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.passes.insert_quant import insert_quant
from qcompile.runtime.fake_quant import FakeQuantize

# -- helpers --------------------------------------------------------------------------

W8 = {"dtype": "int8"}
W8C = {"dtype": "int8", "granularity": "per_channel"}
A8 = {"dtype": "uint8", "symmetric": False}


def qspec(*rules: dict, mode: str = "qat", **quant) -> dict:
    return {"quant": {"mode": mode, "rules": list(rules), **quant}}


def run_insert(model: nn.Module, spec_dict: dict, *inputs: torch.Tensor):
    """(dump before insert_quant, graph after it, ctx with insert_quant's notes)."""
    gm, ctx, before = annotated(model, spec_dict, *inputs)
    gm = insert_quant(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return before, gm, ctx


def dump(before: str, gm, ctx: Context) -> str:
    notes = "\n".join(ctx.notes) or "(none)"
    quantizers = "\n".join(f"{name}: {fq.extra_repr()}"
                           for name, fq in sorted(qc.quantizers(gm).items()))
    return (f"## before insert_quant\n{before}\n## after insert_quant\n{format_graph(gm)}\n"
            f"## quantizers\n{quantizers or '(none)'}\n## notes\n{notes}")


def node(gm, name: str):
    return next(n for n in gm.graph.nodes if n.name == name)


def quantizer_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(str(n.target)), FakeQuantize)]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


X = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))


class ConvBnRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class Proj(nn.Module):
    """A functional linear on its own parameter (no nn.Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = Proj()

    def forward(self, x):
        return torch.relu(self.proj(x))


class Twice(nn.Module):
    """One Linear called twice: its weight is used by two ops."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x)))


class Tied(nn.Module):
    """Two Linears sharing one weight Parameter (e.g. an embedding tied to a head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# -- placement ------------------------------------------------------------------------


def test_linear_relu_fusion_one_quantizer_at_the_relu_output(golden):
    before, gm, ctx = run_insert(mlp(), qspec(
        {"match": {"module": "Linear"}, "weight": W8C, "activation": A8}), X)
    golden("insert_quant_linear_relu", dump(before, gm, ctx))
    relu = node(gm, "_1")
    assert [u.target for u in relu.users] == ["0.output_fake_quant"]
    linear = node(gm, "linear")  # Linear 0, re-expressed as F.linear
    assert [u.name for u in linear.users] == ["_1"]  # nothing between the linear and its relu
    assert sorted(qc.quantizers(gm)) == ["0.output_fake_quant", "0.weight_fake_quant",
                                         "2.output_fake_quant", "2.weight_fake_quant"]
    assert [u.target for u in node(gm, "linear_1").users] == ["2.output_fake_quant"]
    assert node(gm, "output").args[0].target == "2.output_fake_quant"


def test_conv_bn_relu_qat(golden):
    model = ConvBnRelu().train()
    x = torch.randn(2, 3, 8, 8)
    before, gm, ctx = run_insert(model, qspec(
        {"match": {"module": "Conv2d"}, "weight": W8C, "activation": A8}), x)
    golden("insert_quant_conv_bn_relu_qat", dump(before, gm, ctx))
    assert isinstance(gm.get_submodule("bn"), nn.BatchNorm2d)  # kept for QAT
    assert [u.target for u in node(gm, "relu").users] == ["conv.output_fake_quant"]
    conv = node(gm, "conv2d")
    assert conv.args[1].target == "conv.weight_fake_quant"
    assert [u.name for u in conv.users] == ["bn"]  # no quantizer inside the group
    assert qc.quantizers(gm)["conv.weight_fake_quant"].scale.numel() == 4  # per out-channel
    gm(x).sum().backward()  # trains
    assert gm.get_submodule("conv").weight.grad is not None


def test_functional_linear_on_a_parameter_gets_a_weight_quantizer(golden):
    x = torch.randn(2, 4)
    before, gm, ctx = run_insert(Functional(), qspec(
        {"match": {"op": "linear"}, "weight": W8C, "activation": A8}), x)
    golden("insert_quant_functional_linear", dump(before, gm, ctx))
    lin = node(gm, "linear")
    assert lin.op == "call_function" and lin.target is F.linear
    assert lin.args[1].op == "call_module" and lin.args[1].target == "proj.weight_fake_quant"
    assert lin.args[1].args[0].op == "get_attr" and lin.args[1].args[0].target == "proj.weight"
    assert lin.args[2].target == "proj.bias"  # bias stays float
    # the linear-relu group is what module `proj` returns: named like a module's output
    assert sorted(qc.quantizers(gm)) == ["proj.output_fake_quant", "proj.weight_fake_quant"]


def test_module_called_twice_gets_one_weight_quantizer():
    x = torch.randn(2, 4)
    _, gm, ctx = run_insert(Twice(), qspec({"match": {"module": "Linear"}, "weight": W8}), x)
    assert list(qc.quantizers(gm)) == ["fc.weight_fake_quant"]
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert len(linears) == 2
    assert linears[0].args[1] is linears[1].args[1]  # the same quantizer node
    assert [r.name for r in ctx.quantizers] == ["fc.weight_fake_quant"]


def test_module_called_twice_leaves_no_dead_weight_node():
    _, gm, _ = run_insert(Twice(), qspec({"match": {"module": "Linear"}, "weight": W8}),
                          torch.randn(2, 4))
    dead = [n.name for n in gm.graph.nodes if n.op == "get_attr" and not n.users]
    assert dead == []


def test_parameter_tied_across_modules_gets_one_quantizer():
    _, gm, _ = run_insert(Tied(), qspec({"match": {"module": "Linear"}, "weight": W8}),
                          torch.randn(2, 4))
    assert len([n for n in qc.quantizers(gm) if n.endswith("weight_fake_quant")]) == 1


def test_quant_inputs_adds_an_input_quantizer(golden):
    before, gm, ctx = run_insert(mlp(), qspec(
        {"match": {"module": "Linear"}, "weight": W8}, inputs=A8), X)
    golden("insert_quant_inputs", dump(before, gm, ctx))
    placeholder = node(gm, "input_1")
    assert [u.target for u in placeholder.users] == ["input_input_fake_quant"]
    assert node(gm, "linear").args[0].target == "input_input_fake_quant"
    rec = next(r for r in ctx.quantizers if r.role == "input")
    assert (rec.name, rec.node, rec.rule) == ("input_input_fake_quant", "input_1", None)


@pytest.mark.parametrize(("axis", "scales"), [(1, 8), (-1, 8), (0, 2)])
def test_per_channel_activation_with_axis(axis, scales):
    act = {"dtype": "int8", "granularity": "per_channel", "axis": axis}
    _, gm, _ = run_insert(mlp(), qspec({"match": {"name": "0"}, "activation": act}), X)
    fq = qc.quantizers(gm)["0.output_fake_quant"]  # the [2, 8] output of linear 0 + relu
    assert fq.axis == axis
    assert fq.scale.numel() == scales
    out = gm(X)
    assert out.shape == (2, 3)


def test_per_channel_conv_activation(golden):
    act = {"dtype": "int8", "granularity": "per_channel", "axis": 1}
    x = torch.randn(2, 3, 8, 8)
    before, gm, ctx = run_insert(ConvBnRelu().eval(), qspec(
        {"match": {"module": "Conv2d"}, "activation": act}, mode="static"), x)
    golden("insert_quant_per_channel_activation", dump(before, gm, ctx))
    fq = qc.quantizers(gm)["conv.output_fake_quant"]
    assert fq.scale.numel() == 4 and fq.axis == 1
    assert "conv.weight_fake_quant" not in qc.quantizers(gm)  # no weight scheme


def test_weight_scheme_on_a_relu_is_noted_not_applied(golden):
    before, gm, ctx = run_insert(mlp(), qspec(
        {"match": {"module": "ReLU"}, "weight": W8},
        {"match": {"module": "Linear"}, "weight": W8}), X)
    golden("insert_quant_weight_on_relu", dump(before, gm, ctx))
    assert ctx.notes == ["rule 0: weight scheme not applied to 1 node(s) that read no "
                         "weight (_1)"]
    assert sorted(qc.quantizers(gm)) == ["0.weight_fake_quant", "2.weight_fake_quant"]
    assert node(gm, "_1").op == "call_module" and node(gm, "_1").target == "1"


def test_skip_rule_inserts_nothing(golden):
    before, gm, ctx = run_insert(mlp(), qspec({"match": {"module": "Linear"}, "skip": True}), X)
    golden("insert_quant_skip", dump(before, gm, ctx))
    assert format_graph(gm) == before
    assert qc.quantizers(gm) == {} and ctx.quantizers == []
    model = mlp()
    assert torch.equal(gm(X), model(X))


# -- errors ---------------------------------------------------------------------------


def test_group_size_not_dividing_names_parameter_rule_and_divisors():
    w4g = {"dtype": "int4", "granularity": "per_group", "group_size": 4}
    with pytest.raises(qc.QCompileError) as info:
        run_insert(mlp(), qspec({"match": {"module": "Linear"}, "weight": w4g}), X)
    err = info.value
    assert "parameter '0.weight' (node 'linear')" in err.message
    assert "quant.rules[0].weight" in err.message
    assert "group_size 4 does not divide 6" in err.message
    assert "use one of [3, 2, 1]" in err.message
    assert "quant.rules[0].weight" in err.fix and "skip rule" in err.fix


def test_group_size_dividing_works():
    w4g = {"dtype": "int4", "granularity": "per_group", "group_size": 2}
    _, gm, _ = run_insert(mlp(), qspec({"match": {"module": "Linear"}, "weight": w4g}), X)
    fq = qc.quantizers(gm)["0.weight_fake_quant"]
    assert fq.group_size == 2 and fq.scale.numel() == 8 * 3


def test_per_channel_activation_without_example_inputs():
    act = {"dtype": "int8", "granularity": "per_channel"}
    with pytest.raises(qc.QCompileError) as info:
        run_insert(mlp(), qspec({"match": {"module": "Linear"}, "activation": act}))
    err = info.value
    assert "quant.rules[0].activation" in err.message
    assert "pass example_inputs" in err.message
    assert "node '_1'" in err.message  # the output of the linear-relu group


def test_per_tensor_activation_without_example_inputs_is_fine():
    _, gm, _ = run_insert(mlp(), qspec({"match": {"module": "Linear"}, "activation": A8}))
    assert sorted(qc.quantizers(gm)) == ["0.output_fake_quant", "2.output_fake_quant"]
    assert gm(X).shape == (2, 3)


# -- how quantizers start, per mode ---------------------------------------------------


def _by_role(ctx: Context, gm) -> dict[str, list[FakeQuantize]]:
    qs = qc.quantizers(gm)
    out: dict[str, list[FakeQuantize]] = {}
    for r in ctx.quantizers:
        out.setdefault(r.role, []).append(qs[r.name])
    return out


@pytest.mark.parametrize("mode", ["static", "qat", "dynamic"])
def test_quantizer_start_state_per_mode(mode):
    _, gm, ctx = run_insert(mlp(), qspec(
        {"match": {"module": "Linear"}, "weight": W8C, "activation": A8},
        mode=mode, inputs=A8), X)
    roles = _by_role(ctx, gm)
    assert {k: len(v) for k, v in roles.items()} == {"activation": 2, "weight": 2, "input": 1}
    acts = roles["activation"] + roles["input"]
    weights = roles["weight"]
    if mode == "static":  # observe float activations until qc.calibrate
        assert all(not q.enabled and q.observe and not q.dynamic for q in acts)
    elif mode == "qat":
        assert all(q.enabled and q.observe and not q.dynamic for q in acts)
    else:
        assert all(q.enabled and q.dynamic for q in acts)
    assert all(q.enabled and not q.dynamic for q in weights)
    assert all(q.observe == (mode == "qat") for q in weights)  # weights move only in QAT
    assert all(r.dynamic == (mode == "dynamic" and r.role != "weight") for r in ctx.quantizers)


def test_weight_qparams_are_computed_at_insertion():
    model = mlp()
    _, gm, _ = run_insert(model, qspec({"match": {"module": "Linear"}, "weight": W8C},
                                       mode="static"), X)
    fq = qc.quantizers(gm)["0.weight_fake_quant"]
    w = model[0].weight.detach()
    assert fq.scale.shape == (8,)
    assert torch.all(fq.scale != 1.0) and torch.all(fq.scale > 0)
    err = (fq(w) - w).abs().amax(dim=1)
    assert torch.all(err <= fq.scale / 2 + 1e-6)  # round to nearest on the observed range


def test_weight_quantizer_names_and_state_dict_keys():
    model = mlp()
    sd = model.state_dict()
    _, gm, _ = run_insert(model, qspec(
        {"match": {"module": "Linear"}, "weight": W8C, "activation": A8}), X)
    names = sorted(n for n in qc.quantizers(gm) if "weight" in n)
    assert names == ["0.weight_fake_quant", "2.weight_fake_quant"]
    gsd = gm.state_dict()
    for k, v in sd.items():  # the original parameters keep their names and values
        assert torch.equal(gsd[k], v), k
    assert all("_fake_quant." in k for k in set(gsd) - set(sd))
    assert {n for n, _ in gm.named_parameters()} == {n for n, _ in model.named_parameters()}
    assert model.state_dict().keys() == sd.keys()  # the user's model is untouched
    assert not any(isinstance(m, FakeQuantize) for m in model.modules())


def test_quantizer_nodes_match_records():
    _, gm, ctx = run_insert(mlp(), qspec(
        {"match": {"module": "Linear"}, "weight": W8C, "activation": A8}, inputs=A8), X)
    assert sorted(str(n.target) for n in quantizer_nodes(gm)) == sorted(
        r.name for r in ctx.quantizers)
    assert {(r.name, r.role, r.rule) for r in ctx.quantizers} == {
        ("0.weight_fake_quant", "weight", 0), ("2.weight_fake_quant", "weight", 0),
        ("0.output_fake_quant", "activation", 0), ("2.output_fake_quant", "activation", 0),
        ("input_input_fake_quant", "input", None)}


# -- known bugs -----------------------------------------------------------------------


class KwargWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 4))
        self.b = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return F.linear(x, weight=self.w, bias=self.b)


def test_functional_linear_with_weight_keyword():
    _, gm, _ = run_insert(KwargWeight(), qspec({"match": {"op": "linear"}, "weight": W8}),
                          torch.randn(2, 4))
    assert list(qc.quantizers(gm)) == ["w_fake_quant"]
    lin = next(n for n in gm.graph.nodes if n.target is F.linear)
    assert lin.kwargs["weight"].target == "w_fake_quant"


class SizeArithmetic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(0) + 1  # int arithmetic: an `add` node that is not a tensor
        return self.fc(x).reshape(n - 1, -1) + x


def test_op_rule_on_int_arithmetic_with_shapes_is_noted():
    _, gm, ctx = run_insert(SizeArithmetic(), qspec(
        {"match": {"op": "add"}, "activation": {"dtype": "int8"}}), torch.randn(2, 4))
    assert list(qc.quantizers(gm)) == ["add_1_fake_quant"]
    assert ctx.notes == ["rule 0: add does not output a floating-point tensor; its "
                         "activation is not quantized"]
    assert gm(torch.randn(2, 4)).shape == (2, 4)


def test_op_rule_on_int_arithmetic_without_shapes_still_runs():
    _, gm, _ = run_insert(SizeArithmetic(), qspec(
        {"match": {"op": "add"}, "activation": {"dtype": "int8"}}))
    assert gm(torch.randn(2, 4)).shape == (2, 4)


# -- quant.target: the range of activation quantizers ---------------------------------

TARGETS = ["x86", "qnnpack", "onednn_vnni", "generic"]
FULL = {"uint8": (0, 255), "int8": (-128, 127)}
REDUCED = {"uint8": (0, 127), "int8": (-64, 63)}


def _ranges(gm) -> dict[str, tuple[int, int]]:
    return {n: (q.quant_min, q.quant_max) for n, q in qc.quantizers(gm).items()}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", ["static", "qat", "dynamic"])
@pytest.mark.parametrize("adtype", ["uint8", "int8"])
def test_target_sets_8_bit_activation_ranges(target: str, mode: str, adtype: str) -> None:
    """x86 reduces every 8-bit activation quantizer (outputs, dynamic inputs of weighted
    ops, model inputs) to 7 bits; weights keep the full range; other targets never
    reduce."""
    a = {"dtype": adtype, "symmetric": False}
    _, gm, ctx = run_insert(mlp(), qspec({"match": {"module": "Linear"}, "weight": W8C,
                                          "activation": a},
                                         mode=mode, target=target, inputs=a), X)
    roles = {r.name: r.role for r in ctx.quantizers}
    expected_act = REDUCED[adtype] if target == "x86" else FULL[adtype]
    ranges = _ranges(gm)
    assert set(roles.values()) == {"weight", "activation", "input"}
    if mode == "dynamic":
        assert {"0.input_fake_quant", "2.input_fake_quant"} <= set(ranges)
    for name, rng in ranges.items():
        fq = qc.quantizers(gm)[name]
        if roles[name] == "weight":
            assert rng == (-128, 127), name
            assert fq.reduce_range is False
        else:
            assert rng == expected_act, name
            assert fq.reduce_range is (target == "x86")
            assert fq.dynamic is (mode == "dynamic")


@pytest.mark.parametrize(("adtype", "learnable"), [("int4", False), ("uint4", False),
                                                   ("int16", False), ("uint16", False),
                                                   ("fp8_e4m3", False), ("uint8", True)])
def test_x86_reduces_only_8_bit_integer_activations(adtype: str, learnable: bool) -> None:
    a = {"dtype": adtype, "learnable": learnable}
    if adtype.startswith("u"):
        a["symmetric"] = False
    _, gm, _ = run_insert(mlp(), qspec({"match": {"module": "Linear"}, "weight": W8C,
                                        "activation": a}, target="x86"), X)
    q = qc.quantizers(gm)["0.output_fake_quant"]
    full = qc.specs.Scheme(dtype=adtype, symmetric=a.get("symmetric", True)).qrange()
    if adtype == "uint8":  # LSQ activations too
        assert q.learnable and (q.quant_min, q.quant_max) == (0, 127)
    else:
        assert (q.quant_min, q.quant_max) == full and q.reduce_range is False


def test_x86_int8_weights_and_activations_for_an_op_rule() -> None:
    """An op rule's activation (the add) is an activation like any other; a weight scheme
    of uint8 is a weight and keeps its full range."""
    _, gm, _ = run_insert(SizeArithmetic(), qspec(
        {"match": {"module": "Linear"}, "weight": {"dtype": "uint8", "symmetric": False}},
        {"match": {"op": "add"}, "activation": {"dtype": "int8"}}, target="x86"),
        torch.randn(2, 4))
    assert _ranges(gm) == {"fc.weight_fake_quant": (0, 255), "add_1_fake_quant": (-64, 63)}


@pytest.mark.parametrize("mode", ["qat", "dynamic"])
def test_x86_activation_values_stay_in_7_bits(mode: str) -> None:
    """What the graph computes: activations on a grid of at most 128 levels, the integers
    within [quant_min, quant_max] (dynamic: each batch's own qparams, still 7 bits)."""
    a = {"dtype": "uint8", "symmetric": False}
    _, gm, _ = run_insert(mlp(), qspec({"match": {"module": "Linear"}, "weight": W8C,
                                        "activation": a}, mode=mode, target="x86"), X)
    fq = qc.quantizers(gm)["0.input_fake_quant" if mode == "dynamic" else "0.output_fake_quant"]
    seen = []
    handle = fq.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    try:
        with torch.no_grad():  # observes at once (a training step would apply it after)
            gm(torch.randn(64, 6, generator=torch.Generator().manual_seed(5)) * 3)
    finally:
        handle.remove()
    (inp, out), = seen
    levels = torch.unique(out)
    assert 64 < levels.numel() <= 128
    # the step of the grid is the range over 127 levels, not 255
    lo, hi = inp.min().clamp(max=0), inp.max().clamp(min=0)
    step = (levels[1:] - levels[:-1]).min()
    torch.testing.assert_close(step, (hi - lo) / 127, rtol=1e-4, atol=0)


# -- QAT weights: observed when compiling ----------------------------------------------

def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


@pytest.mark.parametrize("weight", [
    W8C,
    {"dtype": "int4", "granularity": "per_group", "group_size": 9},
    {**W8C, "observer": {"kind": "moving_average", "momentum": 0.5}},
    {**W8C, "learnable": True},
])
def test_an_untrained_qat_graph_has_its_weights_ranges(weight):
    """Compiling observes every weight: before any forward the weight quantizers' qparams
    are those of the weights (what export_encodings, qc.sqnr and inspect read), equal to a
    fresh quantizer observing the weight."""
    from qcompile.runtime.calibration import weight_quantizers

    spec = qc.CompileSpec.model_validate(qspec(
        {"match": {"module": ["Conv2d", "Linear"]}, "weight": weight, "activation": A8}))
    gm = qc.qcompile(_conv_net(), spec, (torch.randn(4, 3, 6, 6),))
    found = weight_quantizers(gm)
    assert len(found) == 2
    for fq, w in found:
        twin = copy.deepcopy(fq)
        twin.reset_parameters()
        twin.observe_tensor(w.detach())
        assert torch.equal(fq.scale.detach(), twin.scale.detach())
        assert torch.equal(fq.zero_point, twin.zero_point)
        assert not torch.equal(fq.scale.detach(), torch.ones_like(fq.scale))


def test_untrained_qat_graph_freezes_with_its_weight_ranges():
    """``qc.freeze`` of a QAT graph that never ran: the frozen weight qparams are those of
    the weights."""
    model = _conv_net()
    gm = qc.qcompile(model, qspec({"match": {"module": ["Conv2d", "Linear"]}, "weight": W8C,
                                   "activation": A8}), (torch.randn(2, 3, 6, 6),))
    fq = qc.quantizers(gm)["0.weight_fake_quant"]
    assert fq.observe  # QAT: the weight is tracked while training
    qc.freeze(gm)
    ref = FakeQuantize("int8", granularity="per_channel", axis=0, channels=4)
    ref.observe_tensor(model[0].weight)
    assert not fq.observe and torch.equal(fq.scale, ref.scale)
    assert torch.equal(fq.zero_point, ref.zero_point)


@pytest.mark.parametrize("kw", [
    {"dtype": "int8", "granularity": "per_channel", "axis": 0, "channels": 4},
    {"dtype": "uint8", "symmetric": False, "observer": "moving_average", "per_example": True,
     "reduce_range": True},
    {"dtype": "int4", "granularity": "per_group", "group_size": 8, "channels": 6,
     "learnable": True},
    {"dtype": "int8", "granularity": "per_token", "dynamic": True},
    {"dtype": "fp8_e4m3", "observer": "histogram"},
])
def test_from_scheme_builds_what_the_constructor_builds(kw):
    """``FakeQuantize.from_scheme`` skips re-validating the spec's scheme and the
    ``__setattr__`` chain: the module is the one ``FakeQuantize(...)`` builds."""
    from qcompile.specs import Scheme

    role = "activation" if kw.get("per_example") else "weight"
    a = FakeQuantize(**kw, weight=role == "weight")
    fields = {k: kw[k] for k in ("dtype", "symmetric", "granularity", "axis", "group_size",
                                 "observer", "learnable") if k in kw}
    shape = {1: None, 4: (4, 3), 6: (6, 8)}[kw.get("channels", 1)]
    b = FakeQuantize.from_scheme(Scheme(**fields), role=role, shape=shape,
                                 dynamic=kw.get("dynamic", False),
                                 target="x86" if kw.get("reduce_range") else "generic")
    strip = ("_modules", "_parameters", "_buffers")
    assert {k: v for k, v in vars(a).items() if k not in strip} == {
        k: v for k, v in vars(b).items() if k not in strip}
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [type(p) for p in a.parameters()] == [type(p) for p in b.parameters()]
    assert type(a.observer) is type(b.observer)
    assert repr(a) == repr(b)


# -- every weight a model has: experts, functional weights, transposed convs, bags -----


class TinyExperts(nn.Module):
    """Experts as one [experts, out, in] parameter read through ``W[e]`` + linear and bmm
    (stored [experts, in, out]), and a router reading a plain Parameter functionally."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Parameter(torch.randn(2, 4))
        self.up = nn.Parameter(torch.randn(2, 8, 4))  # [experts, out, in]
        self.down = nn.Parameter(torch.randn(2, 8, 4))  # [experts, in, out]

    def forward(self, x):
        gates = F.linear(x, self.router).softmax(-1)
        h = torch.stack([F.linear(x, self.up[0]), F.linear(x, self.up[1])])
        y = torch.bmm(torch.relu(h), self.down)
        return (y * gates.t().unsqueeze(-1)).sum(0)


def test_golden_expert_weights_quantized_per_expert_and_channel(golden):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    before, gm, ctx = run_insert(TinyExperts(), qspec(
        {"match": {"op": ["linear", "bmm"], "reads_weight": True}, "weight": W8C}), x)
    golden("insert_quant_experts", dump(before, gm, ctx))
    qs = qc.quantizers(gm)
    assert qs["up_fake_quant"].scale.shape == (2 * 8,)  # experts x out
    assert qs["down_fake_quant"].scale.shape == (2 * 4,)  # out is the last dim here
    # one quantizer per parameter, however many ops read it
    assert sum(1 for n in gm.graph.nodes if n.target == "up_fake_quant") == 1
    with torch.no_grad():
        ref = TinyExperts()(x)
    with torch.no_grad():
        assert float((gm(x) - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_golden_reads_weight_rule_does_not_fire_on_activation_products(golden):
    class Scores(nn.Module):  # q @ k.T: two activations, no weight
        def forward(self, x):
            return torch.bmm(x, x.transpose(1, 2)).softmax(-1)

    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    rules = [{"match": {"op": "bmm", "reads_weight": True}, "weight": W8C, "optional": True},
             {"match": {"op": "softmax"}, "activation": A8}]
    before, gm, ctx = run_insert(Scores(), qspec(*rules), x)
    golden("insert_quant_no_fire_reads_weight", dump(before, gm, ctx))
    assert sorted(qc.quantizers(gm)) == ["softmax_fake_quant"]


class FunctionalWeights(nn.Module):
    """Weights a graph reads with get_attr: a Parameter, a buffer and a plain tensor, into
    F.linear / F.conv2d, and ``x @ W`` with W stored [in, out]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(6, 4))
        self.register_buffer("frozen", torch.randn(6, 6))
        self.plain = torch.randn(6, 3)  # neither parameter nor buffer
        self.kernel = nn.Parameter(torch.randn(2, 1, 3, 3))

    def forward(self, x, img):
        y = F.linear(F.linear(x, self.w), self.frozen) @ self.plain
        return y, F.conv2d(img, self.kernel)


def test_golden_functional_weights_on_parameters_buffers_and_tensors(golden):
    x, img = torch.randn(2, 4), torch.randn(1, 1, 5, 5)
    before, gm, ctx = run_insert(FunctionalWeights(), qspec(
        {"match": {"op": ["linear", "matmul", "conv2d"], "reads_weight": True},
         "weight": W8C}), x, img)
    golden("insert_quant_functional_weights", dump(before, gm, ctx))
    qs = qc.quantizers(gm)
    assert sorted(qs) == ["frozen_fake_quant", "kernel_fake_quant", "plain_fake_quant",
                          "w_fake_quant"]
    assert qs["plain_fake_quant"].scale.shape == (3,)  # x @ W: out channels on dim 1
    # only a trainable Parameter keeps being observed in QAT
    assert qs["w_fake_quant"].observe and not qs["frozen_fake_quant"].observe
    assert not qs["plain_fake_quant"].observe


def test_golden_conv_transpose_and_embedding_bag(golden):
    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.bag = nn.EmbeddingBag(10, 4, mode="mean")
            self.up = nn.ConvTranspose1d(4, 3, 3, stride=2, output_padding=1)

        def forward(self, ids, offsets):
            return self.up(self.bag(ids, offsets).unsqueeze(-1))

    ids, offsets = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 2, 4])
    model = Decoder()
    before, gm, ctx = run_insert(model, qspec(
        {"match": {"module": ["EmbeddingBag", "ConvTranspose1d"]}, "weight": W8C}),
        ids, offsets)
    golden("insert_quant_conv_transpose_embedding_bag", dump(before, gm, ctx))
    qs = qc.quantizers(gm)
    assert qs["up.weight_fake_quant"].scale.shape == (3,)  # [in, out, k]: out is dim 1
    assert qs["bag.weight_fake_quant"].scale.shape == (10,)  # one scale per row
    assert float((gm(ids, offsets) - model(ids, offsets)).abs().max()) < 0.05


def test_conv_transpose_with_output_size_is_refused_with_the_fix():
    class Up(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(2, 2, 3, stride=2)

        def forward(self, x):
            return self.up(x, output_size=[10, 10])

    with pytest.raises(qc.QCompileError, match=r"(?s)output_size.*output_padding"):
        qc.qcompile(Up(), qspec({"match": {"module": "ConvTranspose2d"}, "weight": W8C}),
                    example_inputs=(torch.randn(1, 2, 4, 4),))


# -- block formats and activation_at --------------------------------------------------------
def block_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


XB = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))


def test_golden_block_format_at_the_inputs_linears_read(golden):
    rule = {"match": {"module": "Linear"}, "weight": {"dtype": "nvfp4"},
            "activation": {"dtype": "mxfp4"}, "activation_at": "input"}
    before, gm, ctx = run_insert(block_mlp(), qspec(rule), XB)
    golden("insert_quant_block_inputs", dump(before, gm, ctx))
    qs = qc.quantizers(gm)
    assert sorted(qs) == ["0.input_fake_quant", "0.weight_fake_quant",
                          "2.input_fake_quant", "2.weight_fake_quant"]
    assert {q.block_format for q in qs.values()} == {"nvfp4", "mxfp4"}
    assert all(q.observer is None for q in qs.values())  # scales from each block
    out = gm(XB)  # the last Linear's output is not quantized
    assert out.shape == (2, 16) and torch.isfinite(out).all()


def test_golden_block_rule_does_not_fire_without_a_linear(golden):
    class NoLinear(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    rules = [{"match": {"module": "Linear"}, "weight": {"dtype": "nvfp4"},
              "activation": {"dtype": "nvfp4"}, "activation_at": "input", "optional": True},
             {"match": {"op": "relu"}, "activation": A8}]
    before, gm, ctx = run_insert(NoLinear(), qspec(*rules), XB)
    golden("insert_quant_no_fire_block", dump(before, gm, ctx))
    assert sorted(qc.quantizers(gm)) == ["relu_fake_quant"]


@pytest.mark.parametrize(("scheme", "role", "words"), [
    ({"dtype": "mxfp4"}, "weight", ["mxfp4 blocks of 32 do not divide 48", "row length"]),
    ({"dtype": "nf4"}, "weight", ["nf4 blocks of 64 do not divide 48", "group_size",
                                  "[48, 24, 16]"]),
    ({"dtype": "nvfp4"}, "activation", ["nvfp4 blocks of 16 do not divide 8", "last dim"]),
])
def test_block_size_not_dividing_names_the_layer_and_the_fix(scheme, role, words):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 8))
    rule = {"match": {"module": "Linear"}, ("weight" if role == "weight" else "activation"):
            scheme}
    with pytest.raises(qc.QCompileError) as ei:
        run_insert(model, qspec(rule), torch.randn(2, 48))
    for w in words:
        assert w in str(ei.value), str(ei.value)
    assert "rules[0]" in str(ei.value)
