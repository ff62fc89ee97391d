"""``insert_adapters``: golden before/after dumps (frozen integer and block bases, a qat
base, mode none, an entry that does not fire, a head trained in full), what trains (only
the adapters and the ``full`` modules, learnable scales by what they quantize), the
first-match / skip rules, the deterministic start, and the errors."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from pass_runs import annotated
from pydantic import ValidationError
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.graph.meta import ADAPTERS_KEY, TRAINING_KEY
from qcompile.passes import insert_adapters as ia
from qcompile.passes.insert_quant import insert_quant
from qcompile.passes.trace import trace
from qcompile.runtime.frozen import FrozenWeight

pytestmark = pytest.mark.usefixtures("one_thread")

INT4 = {"dtype": "int4", "granularity": "per_group", "group_size": 16}


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.q_proj(x)
        return h + self.down(torch.relu(self.up(h)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def spec(weight: dict | None, adapters: list[dict], mode: str = "qat", **extra) -> dict:
    rules = [{"match": {"name": "head"}, "skip": True}]
    if weight is not None:
        rules.append({"match": {"module": "Linear"}, "weight": weight})
    quant = {"mode": mode, "rules": rules} if mode != "none" else {"mode": "none"}
    return {"quant": quant, "adapters": adapters, **extra}


def run_pass(model: nn.Module, spec_dict: dict, x: torch.Tensor):
    """(dump before insert_adapters, graph after it, ctx)."""
    s = qc.CompileSpec.model_validate(spec_dict)
    if s.quant.mode == "none":
        ctx = Context(spec=s, model=model, example_inputs=(x,))
        gm = trace(None, ctx)
    else:
        gm, ctx, _ = annotated(model, spec_dict, x)
        gm = insert_quant(gm, ctx)
        gm.recompile()
    before = format_graph(gm)
    ctx.notes = []
    gm = ia.insert_adapters(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return before, gm, ctx


def dump(before: str, gm, ctx: Context) -> str:
    records = gm.meta[ADAPTERS_KEY]
    layers = "\n".join(
        f"{r.layer}: entry {r.entry} r={r.rank} scaling={r.scaling:g} base={r.base} "
        f"storage={r.storage} weight={r.weight}" for r in records.values())
    stored = "\n".join(f"{n}: {m.extra_repr()}" for n, m in gm.named_modules()
                       if isinstance(m, FrozenWeight))
    trains = ", ".join(n for n, p in gm.named_parameters() if p.requires_grad)
    return (f"## before insert_adapters\n{before}\n## after insert_adapters\n"
            f"{format_graph(gm)}\n## adapted\n{layers or '(none)'}\n## frozen storage\n"
            f"{stored or '(none)'}\n## trainable\n{trains}\n## notes\n"
            + ("\n".join(ctx.notes) or "(none)"))


X = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))


def test_golden_frozen_int4_base_on_the_q_projections(golden):
    before, gm, ctx = run_pass(Net(), spec(INT4, [{"match": {"name": "*.q_proj"},
                                                   "rank": 4, "alpha": 8}]), X)
    golden("insert_adapters_frozen_int4", dump(before, gm, ctx))


def test_golden_nf4_base_with_dropout_and_a_skip_entry(golden):
    adapters = [{"match": {"name": "blocks.1.*"}, "skip": True},
                {"match": {"module": "Linear", "name": "blocks.*"}, "rank": 2,
                 "dropout": 0.1}]
    before, gm, ctx = run_pass(Net(), spec({"dtype": "nf4", "group_size": 32}, adapters), X)
    golden("insert_adapters_nf4_skip", dump(before, gm, ctx))


def test_golden_qat_base_keeps_the_fake_quantizer(golden):
    before, gm, ctx = run_pass(Net(), spec(INT4, [{"match": {"name": "blocks.0.up"},
                                                   "base": "qat"}]), X)
    golden("insert_adapters_qat_base", dump(before, gm, ctx))
    fq = gm.get_submodule("blocks.0.up.weight_fake_quant")
    assert not fq.observe and fq.enabled


def test_golden_mode_none_float_base(golden):
    before, gm, ctx = run_pass(Net(), spec(None, [{"match": {"name": "head"}}], mode="none"), X)
    golden("insert_adapters_mode_none", dump(before, gm, ctx))


def test_golden_optional_entry_that_does_not_fire(golden):
    before, gm, ctx = run_pass(Net(), spec(INT4, [{"match": {"module": "Conv2d"},
                                                   "optional": True}]), X)
    golden("insert_adapters_no_fire", dump(before, gm, ctx))
    assert format_graph(gm) == before
    assert gm.meta[ADAPTERS_KEY] == {}


@pytest.mark.parametrize("method", ["symbolic", "export"])
@pytest.mark.parametrize("weight", [INT4, {"dtype": "nvfp4"}, {"dtype": "mxfp4"},
                                    {"dtype": "int8", "granularity": "per_channel"}])
def test_fresh_adapters_leave_the_graph_computing_what_it_computed(weight, method):
    model = Net()
    plain = qc.qcompile(model, {**spec(weight, []), "trace": {"method": method}},
                        example_inputs=(X,))
    adapted = qc.qcompile(model, spec(weight, [{"match": {"module": "Linear"}, "rank": 3}],
                                      trace={"method": method}), example_inputs=(X,))
    for m in (plain, adapted):
        m.eval()
    # lora_B starts at zero: base + 0, the same bits
    assert torch.equal(adapted(X), plain(X))
    assert all(isinstance(adapted.get_submodule(f"blocks.{i}.{n}.weight_frozen"), FrozenWeight)
               for i in (0, 1) for n in ("q_proj", "up", "down"))
    assert not any(n.endswith("q_proj.weight") for n, _ in adapted.named_parameters())


def test_mode_none_with_adapters_is_bit_identical_in_train_and_eval():
    model = Net()
    gm = qc.qcompile(model, spec(None, [{"match": {"module": "Linear"}, "dropout": 0.5}],
                                 mode="none"), example_inputs=(X,))
    for train in (True, False):
        model.train(train)
        gm.train(train)
        assert torch.equal(gm(X), model(X))


def test_only_the_adapters_train_and_the_model_is_untouched():
    model = Net()
    state = copy.deepcopy(model.state_dict())
    model.blocks[1].requires_grad_(False)  # the user's flags stay the user's
    gm = qc.qcompile(model, spec(INT4, [{"match": {"name": "blocks.0.*"}, "rank": 2}]),
                     example_inputs=(X,))
    lora = {f"blocks.0.{n}.lora_{p}.weight" for n in ("q_proj", "up", "down") for p in "AB"}
    assert {n for n, p in gm.named_parameters() if p.requires_grad} == lora
    gm(X).square().mean().backward()
    assert {n for n, p in gm.named_parameters() if p.grad is not None} == lora
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.requires_grad for m in (model.blocks[0], model.head) for p in m.parameters())
    assert not any(p.requires_grad for p in model.blocks[1].parameters())
    rep = qc.report(gm)
    # r * (in + out) per layer, from the layers' shapes: q_proj 32->32, up 32->64, down 64->32
    assert [(r.module, r.kind, r.parameters) for r in rep.trainable] == [
        ("blocks.0.q_proj", "lora", 2 * 64), ("blocks.0.up", "lora", 2 * 96),
        ("blocks.0.down", "lora", 2 * 96)]
    assert len(rep.adapters) == 3 and rep.trainable_parameters == 2 * (64 + 96 + 96)
    assert "adapters: 3 lora" in rep.text() and "trains: lora on 3 layer(s) (512)" in rep.text()
    # the head and the user-trained parameters of blocks.0 stopped: recorded for the merge
    training = gm.meta[TRAINING_KEY]
    assert set(training.frozen) == {"head.weight", "head.bias"}
    assert training.unfrozen == () and training.full == ()


def test_golden_head_trained_in_full_next_to_the_adapters(golden):
    adapters = [{"match": {"name": "*.q_proj"}, "rank": 2},
                {"kind": "full", "match": {"name": "head"}}]
    before, gm, ctx = run_pass(Net(), spec(INT4, adapters), X)
    golden("insert_adapters_full_head", dump(before, gm, ctx))


def test_full_modules_train_where_the_model_froze_them():
    model = Net().requires_grad_(False)  # frozen first, as peft users do
    gm = qc.qcompile(model, spec(INT4, [{"match": {"name": "*.q_proj"}, "rank": 2},
                                        {"kind": "full", "match": {"name": "head"}}]),
                     example_inputs=(X,))
    gm(X).square().mean().backward()
    trained = {n for n, p in gm.named_parameters() if p.grad is not None}
    assert trained == {"head.weight", "head.bias"} | {
        f"blocks.{b}.q_proj.lora_{p}.weight" for b in (0, 1) for p in "AB"}
    assert not any(p.requires_grad for p in model.parameters())  # the model's own flags
    training = gm.meta[TRAINING_KEY]
    assert [(f.name, f.entry, f.tensors) for f in training.full] == [
        ("head", 1, ("weight", "bias"))]
    assert set(training.unfrozen) == {"head.weight", "head.bias"} and training.frozen == ()
    rep = qc.report(gm)
    assert [(r.module, r.kind, r.parameters) for r in rep.trainable if r.kind == "full"] == [
        ("head", "full", 32 * 4 + 4)]
    assert "in full head (132)" in rep.text()


def test_full_selects_modules_by_class_and_name_and_keeps_the_outermost():
    model = Net()
    block = sum(p.numel() for p in model.blocks[1].parameters())
    # a glob selecting a block and everything in it: the block is the module trained
    gm = qc.qcompile(model, spec(INT4, [{"match": {"name": "blocks.0.q_proj"}},
                                        {"kind": "full", "match": {"name": "blocks.1*"}}]),
                     example_inputs=(X,))
    assert [f.name for f in gm.meta[TRAINING_KEY].full] == ["blocks.1"]
    assert [(r.module, r.parameters) for r in qc.report(gm).trainable if r.kind == "full"] == [
        ("blocks.1", block)]
    assert all(p.requires_grad for n, p in gm.named_parameters() if n.startswith("blocks.1."))
    # by class (the model's classes: the graph's containers are plain modules)
    gm = qc.qcompile(model, spec(INT4, [{"match": {"name": "head"}},
                                        {"kind": "full", "match": {"module": "Block"}}]),
                     example_inputs=(X,))
    assert [f.name for f in gm.meta[TRAINING_KEY].full] == ["blocks.0", "blocks.1"]
    frozen = {n for n, p in gm.named_parameters() if not p.requires_grad}
    assert frozen == {"head.weight", "head.bias"}  # the adapted head's float base
    # an optional entry selecting nothing adds nothing
    gm = qc.qcompile(model, spec(INT4, [{"match": {"name": "head"}},
                                        {"kind": "full", "match": {"module": "Conv2d"},
                                         "optional": True}]), example_inputs=(X,))
    assert {n for n, p in gm.named_parameters() if p.requires_grad} == {
        "head.lora_A.weight", "head.lora_B.weight"}


def test_learnable_scales_train_with_what_they_quantize():
    """LSQ scales: a frozen layer's weight scale stops (its deployed weight stays what the
    graph had); a qat base's weight scale, a full module's and activations' keep training."""
    lsq = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"}, "weight": {
        "dtype": "int8", "granularity": "per_channel", "learnable": True}, "activation": {
        "dtype": "int8", "learnable": True}}]},
        "adapters": [{"match": {"name": "blocks.0.q_proj"}, "base": "qat"},
                     {"match": {"name": "blocks.0.up"}},
                     {"kind": "full", "match": {"name": "head"}}]}
    gm = qc.qcompile(Net(), lsq, example_inputs=(X,))
    trains = {n for n, p in gm.named_parameters() if p.requires_grad}
    offsets = {n for n in trains if n.endswith("scale_offset")}
    layers = [f"blocks.{b}.{n}" for b in (0, 1) for n in ("q_proj", "up", "down")] + ["head"]
    assert offsets == {f"{n}.output_fake_quant.scale_offset" for n in layers} | {
        "blocks.0.q_proj.weight_fake_quant.scale_offset", "head.weight_fake_quant.scale_offset"}
    assert trains - offsets == {"head.weight", "head.bias"} | {
        f"blocks.0.{n}.lora_{p}.weight" for n in ("q_proj", "up") for p in "AB"}
    kinds = {r.kind for r in qc.report(gm).trainable}
    assert kinds == {"lora", "full", "quantizer"}
    assert "7 learnable quantizer scale(s)" in qc.report(gm).text()


def test_the_start_is_the_same_for_every_compile_and_depends_on_seed_and_layer():
    s = spec(INT4, [{"match": {"module": "Linear", "name": "blocks.*"}, "rank": 4}])
    a = qc.qcompile(Net(), s, example_inputs=(X,)).state_dict()
    torch.manual_seed(123)  # the global generator plays no part
    b = qc.qcompile(Net(), s, example_inputs=(X,)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if "lora" in k)
    a0, a1 = a["blocks.0.up.lora_A.weight"], a["blocks.1.up.lora_A.weight"]
    assert not torch.equal(a0, a1)
    bound = 1 / math.sqrt(32)
    assert float(a0.abs().max()) <= bound and float(a0.abs().max()) > 0.8 * bound
    assert not a["blocks.0.up.lora_B.weight"].any()
    s2 = spec(INT4, [{"match": {"module": "Linear", "name": "blocks.*"}, "rank": 4,
                      "seed": 7}])
    c = qc.qcompile(Net(), s2, example_inputs=(X,)).state_dict()
    assert not torch.equal(c["blocks.0.up.lora_A.weight"], a0)


def test_training_moves_the_output_and_the_graph_saves_and_loads(tmp_path):
    gm = qc.qcompile(Net(), spec(INT4, [{"match": {"module": "Linear", "name": "blocks.*"},
                                         "rank": 4, "alpha": 16}]), example_inputs=(X,))
    opt = torch.optim.SGD([p for p in gm.parameters() if p.requires_grad], lr=0.1)
    before = gm(X).detach()
    stored = {n: p.clone() for n, p in gm.named_parameters() if "weight_frozen" in n}
    for _ in range(3):
        opt.zero_grad()
        gm(X).square().mean().backward()
        opt.step()
    after = gm(X).detach()
    assert not torch.allclose(before, after)
    assert all(torch.equal(p, stored[n]) for n, p in gm.named_parameters() if n in stored)
    torch.save(gm, tmp_path / "g.pt")
    back = torch.load(tmp_path / "g.pt", weights_only=False)
    assert torch.equal(back(X), gm(X))


def test_errors_name_the_entry_and_the_fix():
    with pytest.raises(qc.QCompileError,
                       match=r"adapters\[0\].*matched no Linear or Conv1D layer"):
        qc.qcompile(Net(), spec(INT4, [{"match": {"module": "Conv2d"}}]), example_inputs=(X,))
    with pytest.raises(qc.QCompileError, match=r"adapters\[0\].*base: qat but no quantization"):
        qc.qcompile(Net(), spec(INT4, [{"match": {"name": "head"}, "base": "qat"}]),
                    example_inputs=(X,))
    with pytest.raises(qc.QCompileError, match="frozen base cannot store fp8_e4m3"):
        qc.qcompile(Net(), spec({"dtype": "fp8_e4m3"}, [{"match": {"name": "blocks.0.up"}}]),
                    example_inputs=(X,))
    with pytest.raises(ValidationError, match=r"match\.op"):
        qc.CompileSpec.model_validate({"adapters": [{"match": {"op": "linear"}}]})
    with pytest.raises(ValidationError, match="rank"):
        qc.CompileSpec.model_validate({"adapters": [{"match": {"name": "x"}, "rank": 0}]})
    with pytest.raises(ValidationError, match="gptq"):
        qc.CompileSpec.model_validate({"quant": {"mode": "static", "algorithms": [
            {"kind": "gptq"}]}, "adapters": [{"match": {"name": "x"}}]})


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_full_entry_errors_name_the_entry_and_the_module():
    lora = {"match": {"name": "*.q_proj"}, "rank": 2}
    with pytest.raises(qc.QCompileError, match=r"adapters\[1\] \(kind: full, name: "
                       r"nothing\) matched no module holding parameters") as e:
        qc.qcompile(Net(), spec(INT4, [lora, {"kind": "full", "match": {"name": "nothing"}}]),
                    example_inputs=(X,))
    assert "optional: true" in e.value.fix
    with pytest.raises(qc.QCompileError, match=r"adapters\[1\] trains 'blocks.0.q_proj' in "
                       r"full and adapters\[0\] puts a LoRA adapter on 'blocks.0.q_proj': a "
                       "module is adapted or trained in full, not both") as e:
        qc.qcompile(Net(), spec(INT4, [lora, {"kind": "full", "match": {
            "name": "blocks.0.q_proj"}}]), example_inputs=(X,))
    assert "{match: {name: 'blocks.0.q_proj'}, skip: true} before adapters[0]" in e.value.fix
    with pytest.raises(qc.QCompileError, match=r"trains 'blocks.1' in full and adapters\[0\] "
                       r"puts a LoRA adapter on 'blocks.1.q_proj' inside it"):
        qc.qcompile(Net(), spec(INT4, [lora, {"kind": "full", "match": {"name": "blocks.1"}}]),
                    example_inputs=(X,))
    # what the fix says: a skip entry first leaves the layer to the full entry
    gm = qc.qcompile(Net(), spec(INT4, [{"match": {"name": "blocks.0.q_proj"}, "skip": True},
                                        lora, {"kind": "full", "match": {
                                            "name": "blocks.0.q_proj"}}]), example_inputs=(X,))
    assert sorted(gm.meta[ADAPTERS_KEY]) == ["blocks.1.q_proj"]
    assert gm.get_submodule("blocks.0.q_proj").weight.requires_grad
    with pytest.raises(qc.QCompileError, match=r"adapters\[1\] trains 'b' in full, but its "
                       r"weight is the same tensor as a.weight \(tied\)"):
        qc.qcompile(TiedNet(), {"quant": {"mode": "qat", "rules": [
            {"match": {"module": "Linear"}, "weight": INT4}]}, "adapters": [
            {"match": {"name": "a"}}, {"kind": "full", "match": {"name": "b"}}]},
            example_inputs=(X,))


@pytest.mark.parametrize(("entries", "where", "message"), [
    ([{"kind": "full", "match": {"name": "head"}}], "adapters",
     r"adapters\[0\] trains modules in full .* no entry adds an adapter"),
    ([{"match": {"name": "head"}, "skip": True}, {"kind": "full", "match": {"name": "head"}}],
     "adapters", "no entry adds an adapter"),
    ([{"match": {"name": "x"}}, {"kind": "full", "match": {"name": "head"}, "rank": 4}],
     "adapters.1.full.rank", "Extra inputs are not permitted"),
    ([{"match": {"name": "x"}}, {"kind": "full", "match": {"op": "linear"}}],
     "adapters.1.full", r"match\.op"),
    ([{"kind": "dora", "match": {"name": "x"}}], "adapters.0", "'lora', 'full'"),
])
def test_full_entries_validate_strictly(entries, where, message):
    with pytest.raises(ValidationError) as e:
        qc.CompileSpec.model_validate({"adapters": entries})
    (err,) = e.value.errors()
    assert ".".join(str(x) for x in err["loc"]) == where
    assert re.search(message, str(e.value)), str(e.value)



class Twice(nn.Module):
    """One Linear called twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(torch.relu(self.fc(x))))


def test_a_layer_called_twice_reads_one_storage():
    model = Twice()
    rules = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
                                                  "weight": INT4}]}}
    plain = qc.qcompile(model, rules, example_inputs=(X,))
    gm = qc.qcompile(model, {**rules, "adapters": [{"match": {"name": "fc"}, "rank": 2}]},
                     example_inputs=(X,))
    gm.graph.lint()
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc.weight_frozen"]
    assert len(calls) == 1 and len(calls[0].users) == 2  # both calls of fc read it
    assert not hasattr(gm.get_submodule("fc"), "weight_fake_quant")
    assert not hasattr(gm.get_submodule("fc"), "weight")
    assert [q.name for q in qc.report(gm).quantizers] == ["out.weight_fake_quant"]
    assert torch.equal(gm(X), plain(X))
    gm(X).sum().backward()
    assert gm.get_submodule("fc").lora_A.weight.grad is not None


class Conv1DMLP(nn.Module):
    """GPT-2's MLP: Hugging Face ``Conv1D`` layers, weights stored [in, out]."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(0)
        self.c_fc, self.c_proj = Conv1D(64, 32), Conv1D(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(torch.relu(self.c_fc(x)))


@pytest.mark.parametrize("weight", [{"dtype": "nf4", "group_size": 32},
                                    {"dtype": "int8", "granularity": "per_channel"}],
                         ids=["nf4", "int8_per_channel"])
def test_golden_conv1d_base_stored_by_output_rows(golden, weight):
    """The frozen storage holds [out, in] rows, transposed back for ``addmm``; the adapter
    reads the op's ``x`` and adds to its output, before GPT-2's reshape."""
    pytest.importorskip("transformers")
    s = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Conv1D"},
                                             "weight": weight}]},
         "adapters": [{"match": {"module": "Conv1D", "name": "c_fc"}, "rank": 2}]}
    before, gm, ctx = run_pass(Conv1DMLP(), s, X)
    golden(f"insert_adapters_conv1d_{weight['dtype']}", dump(before, gm, ctx))
    rec = gm.meta[ADAPTERS_KEY]["c_fc"]
    assert rec.fan_in_fan_out and (rec.in_features, rec.out_features) == (32, 64)
    # c_proj, not adapted, keeps its float weight behind its quantizer, frozen
    assert not gm.get_submodule("c_proj").weight.requires_grad
    assert not gm.get_submodule("c_proj.weight_fake_quant").observe


class SubLinear(nn.Linear):
    """A Linear subclass with the stock forward (as Falcon's ``FalconLinear``)."""


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_module_linear_selects_subclasses(method):
    model = nn.Sequential(SubLinear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    gm = qc.qcompile(model, {**spec(INT4, [{"match": {"module": "Linear"}, "rank": 2}]),
                             "quant": {"mode": "qat", "rules": [
                                 {"match": {"module": "Linear"}, "weight": INT4}]},
                             "trace": {"method": method}}, example_inputs=(X,))
    assert sorted(gm.meta[ADAPTERS_KEY]) == ["0", "2"]
    assert isinstance(gm.get_submodule("0.weight_frozen"), FrozenWeight)
