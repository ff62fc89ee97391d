"""The pass pipeline: the requires/provides chain, PassRecords, and per-pass graph dumps."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import GraphDumps, format_graph
from qcompile.graph.pipeline import Pipeline, graph_pass
from qcompile.passes import default_passes
from qcompile.passes.annotate import annotate
from qcompile.passes.fold_bn import fold_bn
from qcompile.passes.insert_quant import insert_quant
from qcompile.passes.trace import trace

STATIC = {"quant": {"mode": "static", "rules": [
    {"match": {"module": "Conv2d"}, "weight": {"dtype": "int8", "granularity": "per_channel"},
     "activation": {"dtype": "uint8", "symmetric": False}}]}}


class ConvBnRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


# -- the requires / provides chain ----------------------------------------------------


@pytest.mark.parametrize(("passes", "name", "fact"), [
    ([annotate], "annotate", "fusion_groups"),  # the first missing fact, alphabetically
    ([fold_bn], "fold_bn", "graph"),
    ([trace, annotate], "annotate", "fusion_groups"),
    ([trace, fold_bn, insert_quant], "insert_quant", "annotations"),
    ([trace, annotate, fold_bn, insert_quant], "annotate", "fusion_groups"),
    ([trace, fold_bn, insert_quant, annotate], "insert_quant", "annotations"),
], ids=["annotate-first", "fold_bn-first", "no-fold_bn", "no-annotate", "annotate-early",
        "insert_quant-early"])
def test_pipeline_refuses_unmet_requirements(passes, name, fact):
    with pytest.raises(qc.QCompileError) as info:
        Pipeline(passes)
    err = info.value
    assert err.message == f"pass {name!r} requires {fact!r}, which no earlier pass provides"
    assert err.fix == f"put a pass providing {fact!r} before {name!r}"


def test_default_order_is_accepted():
    spec = qc.CompileSpec.model_validate(STATIC)
    assert [p.name for p in default_passes(spec)] == ["trace", "fold_bn", "annotate",
                                                      "insert_quant", "overwrite_inputs"]
    Pipeline(default_passes(spec))  # no error
    assert [p.name for p in default_passes(qc.CompileSpec())] == ["trace"]


def test_custom_pass_requiring_a_late_fact():
    @graph_pass(requires=("quantizers",), provides=("checked",))
    def check(gm, ctx):
        return gm

    with pytest.raises(qc.QCompileError, match="pass 'check' requires 'quantizers'"):
        Pipeline([trace, check])
    Pipeline([trace, fold_bn, annotate, insert_quant, check])  # fine once provided


def test_empty_pipeline_is_an_error_when_run():
    ctx = Context(spec=qc.CompileSpec(), model=nn.Linear(2, 2))
    with pytest.raises(qc.QCompileError, match="the pipeline has no passes"):
        Pipeline([]).run(ctx)


# -- PassRecords ----------------------------------------------------------------------


def test_pass_records_list_added_and_removed_nodes():
    ctx = Context(spec=qc.CompileSpec.model_validate(STATIC), model=ConvBnRelu().eval(),
                  example_inputs=(X,))
    gm, records = Pipeline([trace, fold_bn, annotate, insert_quant]).run(ctx)
    assert [r.name for r in records] == ["trace", "fold_bn", "annotate", "insert_quant"]
    t, f, a, q = records
    assert (t.nodes_before, t.nodes_after) == (0, 5)
    assert t.added == ["x", "conv", "bn", "relu", "output"] and t.removed == []
    assert (f.added, f.removed) == ([], ["bn"])
    assert f.notes == ["folded bn into conv"]
    assert (a.added, a.removed, a.notes) == ([], [], [])
    assert q.added == ["conv_weight", "conv_weight_fake_quant", "conv_bias", "conv2d",
                       "conv_output_fake_quant"]
    assert q.removed == ["conv"]  # re-expressed as torch.conv2d on the quantized weight
    for r in records:
        assert r.nodes_after == r.nodes_before + len(r.added) - len(r.removed)
        assert r.seconds >= 0
    assert [n.name for n in gm.graph.nodes] == ["x", "conv_weight", "conv_weight_fake_quant",
                                                "conv_bias", "conv2d", "relu",
                                                "conv_output_fake_quant", "output"]


def test_report_carries_the_records():
    gm = qc.qcompile(ConvBnRelu().eval(), STATIC, example_inputs=(X,))
    rep = qc.report(gm)
    assert [p.name for p in rep.passes] == ["trace", "fold_bn", "annotate", "insert_quant",
                                            "overwrite_inputs"]
    assert rep.passes[1].removed == ["bn"]
    assert rep.mode == "static" and rep.trace_method == "symbolic"
    assert rep.rule_matches == {0: ["conv"]}
    assert sorted(q.name for q in rep.quantizers) == ["conv.output_fake_quant",
                                                      "conv.weight_fake_quant"]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str, str]] = []

    def after_pass(self, index, record, gm, ctx):
        self.calls.append((index, record.name, format_graph(gm)))


def test_instruments_see_every_pass_in_order():
    rec = _Recorder()
    ctx = Context(spec=qc.CompileSpec.model_validate(STATIC), model=ConvBnRelu().eval(),
                  example_inputs=(X,))
    gm, _ = Pipeline([trace, fold_bn, annotate, insert_quant]).run(ctx, instruments=[rec])
    assert [(i, n) for i, n, _ in rec.calls] == [
        (1, "trace"), (2, "fold_bn"), (3, "annotate"), (4, "insert_quant")]
    assert rec.calls[-1][2] == format_graph(gm)
    assert "bn(conv)" in rec.calls[0][2] and "bn(conv)" not in rec.calls[1][2]


# -- GraphDumps -----------------------------------------------------------------------


def test_graph_dumps_writes_one_file_per_pass(tmp_path):
    gm = qc.qcompile(ConvBnRelu().eval(), STATIC, example_inputs=(X,),
                     instruments=[GraphDumps(tmp_path)])
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".txt")
    assert files == ["01_trace.txt", "02_fold_bn.txt", "03_annotate.txt", "04_insert_quant.txt",
                     "05_overwrite_inputs.txt"]
    texts = {name: (tmp_path / name).read_text(encoding="utf-8") for name in files}
    assert texts["05_overwrite_inputs.txt"] == format_graph(gm) + "\n"
    assert "bn      call_module    bn(conv)" in texts["01_trace.txt"]
    assert "bn(" not in texts["02_fold_bn.txt"] and "fusion=conv+relu" in texts["02_fold_bn.txt"]
    assert "rule=0" in texts["03_annotate.txt"] and "fake_quant" not in texts["03_annotate.txt"]
    assert "conv.output_fake_quant(relu)" in texts["04_insert_quant.txt"]


def test_graph_dumps_match_running_the_trace_alone(tmp_path):
    qc.qcompile(ConvBnRelu().eval(), STATIC, example_inputs=(X,),
                instruments=[GraphDumps(tmp_path / "nested" / "dir")])
    ctx = Context(spec=qc.CompileSpec.model_validate(STATIC), model=ConvBnRelu().eval(),
                  example_inputs=(X,))
    expected = format_graph(trace(None, ctx)) + "\n"
    assert (tmp_path / "nested" / "dir" / "01_trace.txt").read_text(encoding="utf-8") == expected


def test_graph_dumps_with_mode_none_has_only_the_trace(tmp_path):
    qc.qcompile(ConvBnRelu(), qc.CompileSpec(), instruments=[GraphDumps(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".txt") == ["01_trace.txt"]


def test_graph_dumps_writes_report_json(tmp_path):
    qc.qcompile(ConvBnRelu().eval(), STATIC, example_inputs=(X,),
                instruments=[GraphDumps(tmp_path)])
    path = tmp_path / "report.json"
    assert path.exists()
    assert "insert_quant" in json.dumps(json.loads(path.read_text(encoding="utf-8")))


@pytest.mark.parametrize("spec, codegens", [("int8-qat", 1), ("int8-static", 1),
                                             ({"quant": {"mode": "none"}}, 1)])
def test_passes_that_only_rewrite_nodes_share_one_code_generation(monkeypatch, spec,
                                                                  codegens):
    """trace -> fold_bn -> annotate -> insert_quant generate the graph's code once, after
    insert_quant (the traced graph's code is never generated), and that code is the
    graph's: the same as a fresh GraphModule's, and it runs."""
    generated: list[int] = []
    real = torch.fx.Graph.python_code

    def counting(self, *args, **kwargs):
        generated.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Graph, "python_code", counting)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    x = torch.randn(2, 3, 6, 6)
    gm = qc.qcompile(model, spec, (x,))
    assert len(generated) == codegens
    assert gm.code == torch.fx.GraphModule(gm, gm.graph).code
    assert gm(x).shape == (2, 2)
    # with an instrument looking after every pass, every pass's graph has its code
    seen: list[str] = []

    class Codes:
        def after_pass(self, index, record, g, ctx):
            seen.append(g.code)
            # a copy of the graph: a GraphModule made on g.graph itself would own it, and
            # the next pass's lint would look for g's new attributes there
            assert g.code == torch.fx.GraphModule(g, copy.deepcopy(g.graph)).code

        def finish(self, report, g):
            pass

    qc.qcompile(model, spec, (x,), instruments=[Codes()])
    assert len(seen) == len(qc.report(gm).passes)
