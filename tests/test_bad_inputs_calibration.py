"""Calibration mistakes that used to become wrong numbers (or noise) instead of an error.

The bad-input table (``bad_inputs_harness``): each case asserts the error class, that the
message names the batch / input / quantizer / weight and says the fix, and that the model,
the inputs and the graphs built before are unchanged (quantizers keep their state). Then
plain tests: the right result where the input is fine, NaN (not only Inf) weights, and
stderr free of torch.fx's traceback printout.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest
import torch
from bad_inputs_harness import MLP, Case, World, X, case_table, check_case, spec_dict
from torch import nn

import qcompile as qc
from qcompile.graph.signature import graph_inputs
from qcompile.runtime.calibration import quiet_fx_trace

CASES: list[Case] = []
case = case_table(CASES)

VOCAB = 10
IDS = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(0))


class Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids.long()))


class EmptyMiddle(MLP):
    """fc1 sees 0 rows whatever the batch: its output quantizer can observe nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x[:0])))


class Overflow(MLP):
    """Finite inputs and weights, an infinite activation (as float16 overflows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)) * 1e30 * 1e30)


def _emb_spec(module: str = "Linear") -> qc.CompileSpec:
    spec = spec_dict()
    spec["quant"]["rules"][0]["match"] = {"module": module}
    return qc.CompileSpec.model_validate(spec)


def emb_graph(w: World, module: str = "Linear") -> nn.Module:
    """A graph of ``w.model`` compiled for ids (the harness's inputs are floats); kept
    with the world's graphs so the harness checks it is unchanged."""
    key = f"emb-{module}"
    if key not in w._graphs:
        w._graphs[key] = qc.qcompile(copy.deepcopy(w.model), _emb_spec(module),
                                     example_inputs=(IDS,))
    return w._graphs[key]


def poisoned(gm: nn.Module, value: float = float("inf"), count: int = 3) -> nn.Module:
    # Inf, not NaN, in the table: the harness compares states with torch.equal, and
    # NaN != NaN; NaN has its own test below.
    with torch.no_grad():
        gm.get_parameter("fc1.weight")[0, :count] = value
    return gm


# -- 1. empty batches and quantizers that saw nothing ------------------------------------------
@case("calibrating with a batch of 0 rows", qc.QCompileError, ("batch 1", "input x", "0 rows"),
      ("non-empty",), prepare=lambda w: w.graph("static"))
def _(w: World) -> Any:
    return qc.calibrate(w.graph("static"), [X, torch.zeros(0, 8)], progress=False)


@case("a 0-row keyword input", qc.QCompileError, ("batch 0", "input x", "0 rows"),
      ("non-empty",), prepare=lambda w: w.graph("static"))
def _(w: World) -> Any:
    return qc.calibrate(w.graph("static"), [{"x": torch.zeros(0, 8)}], progress=False)


@case("a quantizer that observed no data", qc.QCompileError,
      ("fc1.output_fake_quant", "observed no data", "1 batch"), ("skip",),
      model=EmptyMiddle, prepare=lambda w: w.graph("static"))
def _(w: World) -> Any:
    return qc.calibrate(w.graph("static"), [X], progress=False)


# -- 2. weights that are not finite: named, and not blamed on the data ------------------------
@case("calibrating a graph whose weight is infinite", qc.QCompileError,
      ("calibrate", "fc1.weight has 3 infinite values"), ("checkpoint", "diverged"),
      prepare=lambda w: poisoned(w.graph("static")))
def _(w: World) -> Any:
    return qc.calibrate(w.graph("static"), [X], progress=False)


@case("freezing a QAT graph whose weight diverged", qc.QCompileError,
      ("freeze", "fc1.weight has 2 infinite values"), ("diverged",),
      prepare=lambda w: poisoned(w.graph("qat"), float("-inf"), 2))
def _(w: World) -> Any:
    return qc.freeze(w.graph("qat"))


@case("converting a graph whose weight is infinite", qc.QCompileError,
      ("convert", "fc1.weight has 3 infinite values"), ("checkpoint",),
      prepare=lambda w: poisoned(w.calibrated()))
def _(w: World) -> Any:
    return qc.convert(w.graph("static"))


@case("a non-finite activation from finite data and weights", qc.QCompileError,
      ("batch 0", "fc2.output_fake_quant", "weights are finite"), ("float32",),
      model=Overflow, prepare=lambda w: w.graph("static"))
def _(w: World) -> Any:
    return qc.calibrate(w.graph("static"), [X], progress=False)


@case("Inf in calibration data names the input", qc.QCompileError,
      ("batch 1", "input x has 32 infinite values"), ("calibration data",),
      prepare=lambda w: w.graph("static"))
def _(w: World) -> Any:
    return qc.calibrate(w.graph("static"), [X, torch.full((4, 8), float("inf"))],
                        progress=False)


# -- 4. ids beyond an embedding -------------------------------------------------------------
@case("ids beyond an embedding's num_embeddings", qc.QCompileError,
      ("batch 1", "input ids", "ids up to 12", "embedding emb", "num_embeddings 10"),
      ("tokenizer",), model=Emb, prepare=emb_graph)
def _(w: World) -> Any:
    return qc.calibrate(emb_graph(w), [IDS, torch.full((4, 3), 12)], progress=False)


@case("a negative id into a quantized embedding", qc.QCompileError,
      ("batch 0", "input ids", "the id -1", "embedding emb", "num_embeddings 10"),
      ("num_embeddings",), model=Emb,
      prepare=lambda w: emb_graph(w, ["Linear", "Embedding"]))
def _(w: World) -> Any:
    return qc.calibrate(emb_graph(w, ["Linear", "Embedding"]), [IDS - 1], progress=False)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path) -> None:
    check_case(c, tmp_path)


# -- the right results ------------------------------------------------------------------------
def test_nan_weight_is_named_with_its_count_not_blamed_on_data() -> None:
    torch.manual_seed(0)
    gm = qc.qcompile(MLP(), qc.CompileSpec.model_validate(spec_dict()), example_inputs=(X,))
    state = {k: v.clone() for k, v in gm.state_dict().items()}
    state["fc2.weight"][1, :5] = float("nan")
    state["fc2.weight"][2, 0] = float("inf")
    gm.load_state_dict(state)  # a checkpoint from a diverged run
    scales = {n: q.scale.clone() for n, q in qc.quantizers(gm).items()}
    with pytest.raises(qc.QCompileError) as info:
        qc.calibrate(gm, [X], progress=False)
    assert "fc2.weight has 5 NaN values and 1 infinite value (of 64)" in info.value.message
    assert "calibration data" not in info.value.message
    assert "diverged" in info.value.fix
    assert all(torch.equal(q.scale, scales[n]) for n, q in qc.quantizers(gm).items())


def test_a_refused_empty_batch_leaves_calibration_as_if_never_called() -> None:
    """A refused 0-row batch, then a good one: the scales are exactly those of a graph
    calibrated on the good batch alone, not the placeholder 1.0."""
    spec = qc.CompileSpec.model_validate(spec_dict())
    graphs = [qc.qcompile(MLP(), spec, example_inputs=(X,)) for _ in range(2)]
    graphs[1].load_state_dict(graphs[0].state_dict())
    with pytest.raises(qc.QCompileError):
        qc.calibrate(graphs[0], [torch.zeros(0, 8)], progress=False)
    for gm in graphs:
        qc.calibrate(gm, [X], progress=False)
    (a, b) = (qc.quantizers(gm) for gm in graphs)
    assert list(a) == list(b)
    assert all(torch.equal(a[n].scale, b[n].scale) for n in a)
    assert float(a["fc1.output_fake_quant"].scale) != 1.0


@pytest.mark.parametrize("module", ["Linear", ["Linear", "Embedding"]])
def test_graph_inputs_know_the_embedding_their_ids_index(module: Any) -> None:
    gm = qc.qcompile(Emb(), _emb_spec(module), example_inputs=(IDS,))
    (ids,) = graph_inputs(gm)
    assert ids.name == "ids" and ids.indexes == (("emb", VOCAB),)
    qc.calibrate(gm, [IDS, torch.full((2, 3), VOCAB - 1)], progress=False)  # in range: fine


def test_a_misfit_prints_no_fx_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    gm = qc.qcompile(MLP(), qc.CompileSpec.model_validate(spec_dict()), example_inputs=(X,))
    capfd.readouterr()
    with pytest.raises(qc.QCompileError, match="does not fit"):
        qc.calibrate(gm, [torch.randn(4, 5)], progress=False)
    with pytest.raises(qc.QCompileError, match="do not fit"):
        qc.convert(qc.calibrate(gm, [X], progress=False), example_inputs=(torch.randn(4, 5),))
    with pytest.raises(qc.QCompileError, match="4x5"):
        qc.sqnr(gm, MLP(), [torch.randn(4, 5)])
    out, err = capfd.readouterr()
    assert err == "" and out == ""
    assert sys.stderr is not None and "WithoutFxTrace" not in type(sys.stderr).__name__


def test_quiet_fx_trace_passes_everything_else(capsys: pytest.CaptureFixture[str]) -> None:
    with quiet_fx_trace():
        print("a warning", file=sys.stderr)
        print("Traceback ...\n\nCall using an FX-traced Module, line 8 of the traced "
              "Module's generated forward function:\n    x = y", file=sys.stderr)
        print("after", file=sys.stderr)
    assert capsys.readouterr().err == "a warning\nafter\n"
