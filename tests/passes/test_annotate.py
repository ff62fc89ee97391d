"""Golden before/after dumps for the ``annotate`` pass: rule precedence, name / module /
op matching, and the errors for rules that select nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.passes.annotate import annotate
from qcompile.passes.fold_bn import fold_bn
from qcompile.passes.trace import trace

# -- helpers --------------------------------------------------------------------------

W8 = {"dtype": "int8"}
W4 = {"dtype": "int4"}
A8 = {"dtype": "uint8", "symmetric": False}


def qspec(*rules: dict, mode: str = "qat") -> dict:
    return {"quant": {"mode": mode, "rules": list(rules)}}


def run_annotate(model: nn.Module, spec_dict: dict, *inputs: torch.Tensor):
    """(dump before annotate, graph after it, ctx with annotate's notes)."""
    ctx = Context(spec=qc.CompileSpec.model_validate(spec_dict), model=model,
                  example_inputs=inputs or None)
    gm = None
    for p in (trace, fold_bn):
        gm = p(gm, ctx)
        gm.graph.lint()
        gm.recompile()
    before = format_graph(gm)
    ctx.notes = []
    gm = annotate(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return before, gm, ctx


def dump(before: str, gm, ctx: Context) -> str:
    notes = "\n".join(ctx.notes) or "(none)"
    matches = "\n".join(f"rule {i}: {', '.join(v)}" for i, v in sorted(ctx.rule_matches.items()))
    return (f"## before annotate\n{before}\n## after annotate\n{format_graph(gm)}\n"
            f"## rule matches\n{matches or '(none)'}\n## notes\n{notes}")


def rules_of(gm) -> dict[str, int | None]:
    """node name -> winning rule index (None when unannotated), for call nodes."""
    return {n.name: (n.meta["qcompile.qscheme"].rule if "qcompile.qscheme" in n.meta else None)
            for n in gm.graph.nodes if n.op.startswith("call_")}


# -- models ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.fc(x))


class Net(nn.Module):
    """encoder (two Blocks, traced through), functional adds / cat, and a head Sequential."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(Block(), Block())
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        h = self.encoder(x)
        y = torch.add(h, x)
        z = h.add(y)
        c = torch.cat([z, y], dim=0)
        return self.head(c)


class Ops(nn.Module):
    """Every spelling of add, a cat (and its alias), and a mul no rule asks for."""

    def forward(self, x, y):
        a = x + y
        b = torch.add(a, x)
        c = b.add(y)
        c += x
        d = torch.cat([c, x], dim=1)
        e = torch.concat([d, d], dim=0)
        return e * 2


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
LINEARS = ["encoder_0_fc", "encoder_1_fc", "head_0", "head_2"]

# -- precedence -----------------------------------------------------------------------


def test_first_matching_rule_wins(golden):
    before, gm, ctx = run_annotate(Net(), qspec(
        {"match": {"name": "head.0"}, "weight": W4},
        {"match": {"module": "Linear"}, "weight": W8},
    ), X)
    golden("annotate_first_match_wins", dump(before, gm, ctx))
    r = rules_of(gm)
    assert r["head_0"] == 0  # both rules match head.0: the first one wins
    assert [r[n] for n in ("encoder_0_fc", "encoder_1_fc", "head_2")] == [1, 1, 1]
    head0 = next(n for n in gm.graph.nodes if n.name == "head_0").meta["qcompile.qscheme"]
    assert head0.weight.dtype == "int4" and not head0.skip
    assert ctx.rule_matches == {0: ["head_0"], 1: ["encoder_0_fc", "encoder_1_fc", "head_2"]}


def test_skip_rule_wins_even_when_listed_after(golden):
    before, gm, ctx = run_annotate(Net(), qspec(
        {"match": {"module": "Linear"}, "weight": W8},
        {"match": {"name": "head"}, "skip": True},
    ), X)
    golden("annotate_skip_wins", dump(before, gm, ctx))
    r = rules_of(gm)
    assert [r[n] for n in ("head_0", "head_1", "head_2")] == [1, 1, 1]
    assert r["encoder_0_fc"] == r["encoder_1_fc"] == 0
    schemes = {n.name: n.meta["qcompile.qscheme"] for n in gm.graph.nodes
               if "qcompile.qscheme" in n.meta}
    assert all(schemes[n].skip and schemes[n].weight is None for n in ("head_0", "head_2"))
    # `name: head` covers head.0 / head.1 / head.2 through the ownership chain
    assert {schemes[n].matched for n in ("head_0", "head_1", "head_2")} == {"head"}
    assert ctx.notes == ["rule 1 keeps 3 node(s) in float"]


def test_name_glob(golden):
    before, gm, ctx = run_annotate(Net(), qspec(
        {"match": {"name": "encoder.*"}, "weight": W8},
        {"match": {"module": "Linear"}, "weight": W4},
    ), X)
    golden("annotate_name_glob", dump(before, gm, ctx))
    r = rules_of(gm)
    # the glob selects the modules under encoder (Linear and ReLU) and what each encoder
    # block returns (its residual add), the same nodes torch.export graphs would give
    assert {n for n, i in r.items() if i == 0} == {
        "encoder_0_fc", "encoder_0_act", "add", "encoder_1_fc", "encoder_1_act", "add_1"}
    assert r["add_2"] is None and r["add_3"] is None  # root-level adds: no module owns them
    assert r["head_0"] == r["head_2"] == 1


def test_custom_module_owns_the_nodes_traced_through_it(golden):
    before, gm, ctx = run_annotate(Net(), qspec(
        {"match": {"module": "Block", "name": "encoder.1"}, "weight": W8},
    ), X)
    golden("annotate_custom_module_owner", dump(before, gm, ctx))
    r = rules_of(gm)
    # the Block's layers and the value the Block returns
    assert {n for n, i in r.items() if i == 0} == {"encoder_1_fc", "encoder_1_act", "add_1"}
    fc = next(n for n in gm.graph.nodes if n.name == "encoder_1_fc")
    assert fc.meta["qcompile.qscheme"].matched == "encoder.1"  # the Block, not the Linear


@pytest.mark.parametrize("module", [
    "Linear", "torch.nn.modules.linear.Linear", "torch.nn.modules.*.Linear", "Lin*",
])
def test_module_class_name_and_dotted_path_select_the_same_nodes(module):
    _, gm, ctx = run_annotate(Net(), qspec({"match": {"module": module}, "weight": W8}), X)
    assert ctx.rule_matches == {0: LINEARS}
    assert {n for n, i in rules_of(gm).items() if i == 0} == set(LINEARS)


def test_module_list_means_any():
    _, _, ctx = run_annotate(Net(), qspec(
        {"match": {"module": ["ReLU", "Linear"]}, "activation": A8}), X)
    assert len(ctx.rule_matches[0]) == 7  # 4 Linear + 3 ReLU


# -- op rules -------------------------------------------------------------------------


def test_op_rules_match_every_spelling(golden):
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    before, gm, ctx = run_annotate(Ops(), qspec(
        {"match": {"op": "add"}, "activation": A8},
        {"match": {"op": "cat"}, "activation": A8},
    ), x, y)
    golden("annotate_op_rules", dump(before, gm, ctx))
    assert rules_of(gm) == {
        "add": 0,      # x + y
        "add_1": 0,    # torch.add
        "add_2": 0,    # Tensor.add
        "add_3": 0,    # +=
        "cat": 1,      # torch.cat
        "concat": 1,   # torch.concat (alias)
        "mul": None,   # no rule asks for mul
    }


def test_op_and_module_combined(golden):
    before, gm, ctx = run_annotate(Net(), qspec(
        {"match": {"op": "add", "module": "Block"}, "activation": A8},
        {"match": {"op": ["add", "cat"]}, "activation": {"dtype": "int8"}},
    ), X)
    golden("annotate_op_and_module", dump(before, gm, ctx))
    r = rules_of(gm)
    assert r["add"] == r["add_1"] == 0  # the adds inside the Blocks
    assert r["add_2"] == r["add_3"] == r["cat"] == 1  # the top-level add / Tensor.add / cat
    assert all(r[n] is None for n in LINEARS)  # op rules never select module calls


# -- rules that select nothing --------------------------------------------------------


def test_rule_matching_nothing_names_the_rule_and_lists_the_graph():
    with pytest.raises(qc.QCompileError) as info:
        run_annotate(Net(), qspec(
            {"match": {"module": "Linear"}, "weight": W8},
            {"match": {"module": "Conv2d"}, "weight": W8},
        ), X)
    err = info.value
    assert err.message.startswith("quant.rules[1] (module: Conv2d) matched no node")
    assert "modules Linear, ReLU" in err.message
    assert "ops add, cat" in err.message
    assert "optional: true" in err.fix


def test_op_rule_matching_nothing():
    with pytest.raises(qc.QCompileError, match=r"quant\.rules\[0\] \(op: matmul\) matched no "
                       r"node; the graph has modules Linear, ReLU and ops add, cat"):
        run_annotate(Net(), qspec({"match": {"op": "matmul"}, "activation": A8}), X)


def test_shadowed_rule_is_an_error():
    with pytest.raises(qc.QCompileError) as info:
        run_annotate(Net(), qspec(
            {"match": {"module": "Linear"}, "weight": W8},
            {"match": {"name": "head.0"}, "weight": W4},
        ), X)
    err = info.value
    assert err.message.startswith("quant.rules[1] (name: head.0) selects nothing")
    assert "taken by earlier rules (first match wins)" in err.message
    assert "move the rule before" in err.fix


def test_optional_suppresses_both_errors():
    _, gm, ctx = run_annotate(Net(), qspec(
        {"match": {"module": "Linear"}, "weight": W8},
        {"match": {"name": "head.0"}, "weight": W4, "optional": True},  # shadowed
        {"match": {"module": "Conv2d"}, "weight": W8, "optional": True},  # matches nothing
    ), X)
    assert ctx.rule_matches == {0: LINEARS}
    assert {i for i in rules_of(gm).values() if i is not None} == {0}


# -- a bare leaf-type model -----------------------------------------------------------


def test_bare_linear_model_is_matched_by_its_class():
    # symbolic tracing inlines a bare Linear root as F.linear; the root module owns it
    _, gm, ctx = run_annotate(nn.Linear(4, 4), qspec(
        {"match": {"module": "Linear"}, "weight": W8}), torch.randn(2, 4))
    assert ctx.rule_matches == {0: ["linear"]}
    node = next(n for n in gm.graph.nodes if n.name == "linear")
    assert node.op == "call_function" and node.meta["qcompile.qscheme"].matched == ""


def test_root_module_owns_every_node():
    _, gm, ctx = run_annotate(Net(), qspec({"match": {"module": "Net"}, "weight": W8}), X)
    modules = {n for n in rules_of(gm) if n.startswith(("encoder", "head"))}
    # module calls, plus the residual adds the two encoder blocks return
    assert set(ctx.rule_matches[0]) == modules | {"add", "add_1"}
    assert {n.meta["qcompile.qscheme"].matched for n in gm.graph.nodes
            if "qcompile.qscheme" in n.meta} == {""}
