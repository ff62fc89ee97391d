"""``insert_adapters``: golden before/after dumps (frozen integer and block bases, a qat
base, mode none, an entry that does not fire), what trains, the first-match / skip rules,
the deterministic start, and the errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from pass_runs import annotated
from pydantic import ValidationError
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.graph.meta import ADAPTERS_KEY
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


def test_only_adapters_and_unmatched_parameters_train_and_the_model_is_untouched():
    model = Net()
    state = copy.deepcopy(model.state_dict())
    model.blocks[1].requires_grad_(False)  # the user froze this block: it stays frozen
    gm = qc.qcompile(model, spec(INT4, [{"match": {"name": "blocks.0.*"}, "rank": 2}]),
                     example_inputs=(X,))
    loss = gm(X).square().mean()
    loss.backward()
    trained = {n for n, p in gm.named_parameters() if p.grad is not None}
    assert trained == {"blocks.0.q_proj.lora_A.weight", "blocks.0.q_proj.lora_B.weight",
                       "blocks.0.up.lora_A.weight", "blocks.0.up.lora_B.weight",
                       "blocks.0.down.lora_A.weight", "blocks.0.down.lora_B.weight",
                       "head.weight", "head.bias"}
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.blocks[0].parameters())
    rep = qc.report(gm)
    assert len(rep.adapters) == 3 and rep.trainable_parameters == sum(
        p.numel() for p in gm.parameters() if p.requires_grad)
    assert "adapters: 3 lora" in rep.text() and "trainable parameters" in rep.text()


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
    with pytest.raises(qc.QCompileError, match=r"adapters\[0\].*matched no Linear layer"):
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
