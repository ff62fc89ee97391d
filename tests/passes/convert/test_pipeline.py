"""``qc.convert`` as a Pipeline of conversion passes: the requires/provides chain, one
PassRecord per step in the report, one graph dump per step, stage-prefixed names."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import GraphDumps
from qcompile.graph.meta import SPEC_KEY
from qcompile.graph.pipeline import Pipeline
from qcompile.passes.convert import (
    CONVERSION_PASSES,
    GRAPH_FACT,
    conversion_pipeline,
    convert_graph,
)
from qcompile.passes.convert.collect_weights import collect_weights
from qcompile.passes.convert.fold_batchnorm import fold_batchnorm
from qcompile.passes.convert.lower_activations import lower_activations
from qcompile.passes.convert.sink_dequantize import sink_dequantize
from qcompile.passes.convert.store_weights import store_weights
from qcompile.passes.convert.tidy import tidy
from qcompile.passes.convert.use_kernels import use_kernels
from qcompile.runtime.calibration import freeze

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")

STEPS = ["collect_weights", "fold_batchnorm", "lower_activations", "sink_dequantize",
         "use_kernels", "use_recurrent_kernels", "store_weights", "tidy"]
COMPILE = ["trace", "fold_bn", "annotate", "insert_quant", "overwrite_inputs"]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(), nn.Linear(16, 4))


def conv_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def static(model: nn.Module, shape: tuple[int, ...], **extra) -> torch.fx.GraphModule:
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(shape, generator=gen),) for _ in range(3)]
    gm = qc.qcompile(model, {"quant": {"mode": "static", "rules": [
        {"match": {"module": ["Linear", "Conv2d"]},
         "weight": {"dtype": "int8", "granularity": "per_channel"},
         "activation": {"dtype": "uint8", "symmetric": False}}]}, **extra},
        example_inputs=batches[0])
    return qc.calibrate(gm, batches, progress=False)


def qat(model: nn.Module, shape: tuple[int, ...], *,
        float_inputs: bool = False) -> torch.fx.GraphModule:
    """int8-qat, run once in train mode; ``float_inputs``: the model input is not quantized
    (``quant.inputs: null``), so the first layer keeps a float op on integer weights."""
    spec = qc.load_spec("int8-qat")
    if float_inputs:
        spec = spec.model_copy(update={"quant": spec.quant.model_copy(update={"inputs": None})})
    gm = qc.qcompile(model, spec, example_inputs=(torch.randn(shape),))
    with torch.no_grad():
        gm(torch.randn(shape))
    return gm


def convert(gm: torch.fx.GraphModule, **kw) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qc.convert(gm, **kw)


# -- the chain ----------------------------------------------------------------------------
def test_the_steps_run_in_this_order() -> None:
    assert [p.name for p in CONVERSION_PASSES] == STEPS
    pipeline = conversion_pipeline()
    assert [p.name for p in pipeline.passes] == [f"convert.{s}" for s in STEPS]
    assert pipeline.initial_facts == {GRAPH_FACT}
    assert [p.name for p in conversion_pipeline("").passes] == STEPS


@pytest.mark.parametrize(("passes", "name", "fact"), [
    ([fold_batchnorm], "fold_batchnorm", "integer_weights"),
    ([collect_weights, use_kernels], "use_kernels", "batchnorm_folded"),
    ([collect_weights, fold_batchnorm, use_kernels], "use_kernels", "dequantize_sunk"),
    ([collect_weights, fold_batchnorm, sink_dequantize], "sink_dequantize",
     "quantized_activations"),
    ([collect_weights, fold_batchnorm, lower_activations, sink_dequantize, store_weights,
      use_kernels], "store_weights", "kernels"),
    ([*CONVERSION_PASSES[:5], tidy, store_weights], "tidy", "int_storage"),
], ids=["fold-first", "kernels-early", "kernels-before-sink", "sink-before-lower",
        "store-before-kernels", "tidy-before-store"])
def test_pipeline_refuses_a_wrong_order(passes, name, fact) -> None:
    with pytest.raises(qc.QCompileError) as info:
        conversion_pipeline("", passes)
    assert info.value.message == (f"pass {name!r} requires {fact!r}, which no earlier pass "
                                  "provides")
    assert info.value.fix == f"put a pass providing {fact!r} before {name!r}"


def test_the_steps_need_a_frozen_graph_first() -> None:
    with pytest.raises(qc.QCompileError, match="requires 'frozen_graph'"):
        Pipeline(CONVERSION_PASSES)  # the compile pipeline's initial fact is 'model'


def test_a_step_without_collect_weights_says_so() -> None:
    gm = static(mlp(), (4, 8))
    freeze(gm)
    gm.eval()
    with pytest.raises(qc.QCompileError, match="without collect_weights"):
        Pipeline([fold_batchnorm], initial_facts=frozenset({"integer_weights"})).run(
            Context(spec=gm.meta[SPEC_KEY], model=gm), gm)


# -- records ------------------------------------------------------------------------------
def test_report_has_a_record_per_conversion_step() -> None:
    gm = static(mlp(), (4, 8))
    out = convert(gm)
    before, after = qc.report(gm), qc.report(out)
    assert [p.name for p in before.passes] == COMPILE  # the input's report is unchanged
    assert [p.name for p in after.passes] == COMPILE + [f"convert.{s}" for s in STEPS]
    steps = {p.name.removeprefix("convert."): p for p in after.passes[len(COMPILE):]}
    assert all(p.seconds >= 0 and p.notes for p in steps.values())
    assert steps["collect_weights"].notes == ["2 weight(s) as integers"]
    assert steps["collect_weights"].added == steps["collect_weights"].removed == []
    assert steps["fold_batchnorm"].notes == ["no BatchNorm after a conv to fold"]
    assert all(n.endswith("fake_quant") for n in steps["lower_activations"].removed)
    assert "_2" in steps["sink_dequantize"].removed  # the Dropout
    stored = steps["store_weights"]  # the weight quantizers no kernel took, as IntWeights
    assert all(n.endswith("weight_fake_quant") for n in stored.removed)
    assert len(stored.added) == len(stored.removed)
    # conversions are reported under the nodes' final names (tidy renames)
    names = {n.name for n in out.graph.nodes}
    assert after.conversions and all(c.node in names for c in after.conversions
                                     if c.path != "fold")
    for a, b in zip(after.passes[len(COMPILE):], after.passes[len(COMPILE) + 1:]):
        assert a.nodes_after == b.nodes_before  # each step starts where the last ended


def test_fold_batchnorm_records_the_fold() -> None:
    out = convert(qat(conv_bn(), (2, 3, 8, 8)))
    step = next(p for p in qc.report(out).passes if p.name == "convert.fold_batchnorm")
    assert step.removed == ["_1"] and step.notes == [
        "conv2d: folded _1 into the weight scales"]
    assert [c.op for c in qc.report(out).conversions if c.path == "fold"] == ["batchnorm"]


def test_convert_graph_returns_records_and_pass_records() -> None:
    gm = copy.deepcopy(static(mlp(), (4, 8)))  # as qc.convert does (fresh node namespace)
    freeze(gm)
    gm.eval()
    done, passes = convert_graph(gm, gm.meta[SPEC_KEY], prefix="")
    assert [p.name for p in passes] == STEPS
    assert done == qc.report(convert(static(mlp(), (4, 8)))).conversions


def test_pipeline_graphs_name_each_stage() -> None:
    out = convert(static(mlp(), (4, 8), pipeline={"stages": 2}),
                  example_inputs=(torch.randn(4, 8),))
    names = [p.name for p in qc.report(out).passes]
    assert names[-2 * len(STEPS):] == [f"convert.stage_{i}.{s}" for i in (0, 1) for s in STEPS]
    assert "output0" in qc.report(out).max_deviation


# -- dumps ----------------------------------------------------------------------------------
def test_graph_dumps_once_per_conversion_step(tmp_path) -> None:
    gm = qat(conv_bn(), (2, 3, 8, 8), float_inputs=True)  # the conv's weight: int storage
    convert(gm, instruments=[GraphDumps(tmp_path)])
    files = sorted(p.name for p in tmp_path.iterdir())
    first = len(COMPILE) + 1  # numbered after the compile passes (their dumps come first)
    assert files == [f"{first + i:02d}_convert.{s}.txt" for i, s in enumerate(STEPS)] + [
        "report.json"]
    text = {s: (tmp_path / f"{first + i:02d}_convert.{s}.txt").read_text(encoding="utf-8")
            for i, s in enumerate(STEPS)}
    # each dump is the graph after its step: the BatchNorm (_1) goes with fold_batchnorm,
    # the weight quantizer with store_weights, the temporary `_qc_` names with tidy
    assert "_1" in text["collect_weights"].split() and "_1" not in text["fold_batchnorm"].split()
    assert "weight_fake_quant" in text["use_kernels"]
    assert "weight_fake_quant" not in text["store_weights"] and "_qc_" in text["store_weights"]
    assert "_qc_1_0_weight" not in text["tidy"]
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert [p["name"] for p in report["passes"]][first - 1:] == [f"convert.{s}" for s in STEPS]
    assert report["conversions"]


def test_compile_and_convert_dumps_share_a_folder(tmp_path) -> None:
    dumps = GraphDumps(tmp_path)
    gm = qc.qcompile(mlp(), "int8-dynamic", example_inputs=(torch.randn(4, 8),),
                     instruments=[dumps])
    convert(gm, instruments=[dumps])
    numbered = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".txt")
    assert [n.split("_", 1)[1] for n in numbered] == [
        *(f"{p}.txt" for p in COMPILE), *(f"convert.{s}.txt" for s in STEPS)]
    assert [int(n.split("_", 1)[0]) for n in numbered] == list(range(1, len(numbered) + 1))


def test_sink_dequantize_keeps_an_identity_with_hooks() -> None:
    """An ``nn.Identity`` is dropped at inference, unless hooks make it something else
    (torch's tensor-parallel styles gather or scatter tokens through hooked identities)."""
    m = nn.Sequential(nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 4), nn.Identity())
    x = torch.randn(2, 8)
    gm = qc.qcompile(m, "w8-weight-only", example_inputs=(x,))
    gm.get_submodule("1").register_forward_hook(lambda mod, args, out: out * 2)
    with torch.no_grad():
        want = gm(x)
    out = convert(gm)
    step = next(p for p in qc.report(out).passes if p.name == "convert.sink_dequantize")
    assert step.removed == ["_3"], step.removed  # the plain identity only
    with torch.no_grad():
        torch.testing.assert_close(out(x), want, rtol=0, atol=1e-6)
