"""``qc.export_onnx`` mistakes: each is refused with a ``QCompileError`` that names what is
wrong and the fix, before the export runs, and writes nothing (no file, no temporary); the
model, inputs and graphs are unchanged (the shared harness checks that)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from bad_inputs_harness import MLP, Case, World, case_table, check_case

import qcompile as qc

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

CASES: list[Case] = []
case = case_table(CASES)


def nothing_written(w: World, export: Callable[[], Any]) -> Any:
    """Run ``export``; whatever it raises, the tmp folder must still be empty."""
    try:
        return export()
    finally:
        left = sorted(p.name for p in w.tmp.rglob("*"))
        assert left == [] or left == ["sub"], f"files written: {left}"


@case("exporting an uncalibrated static graph", qc.QCompileError,
      ("export_onnx", "no ranges yet", "output_fake_quant"), ("qc.calibrate",),
      prepare=lambda w: w.graph("static"))
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(w.graph("static"), w.tmp / "m.onnx",
                                                     example_inputs=w.inputs))


@case("exporting an untrained QAT graph", qc.QCompileError,
      ("export_onnx", "no ranges yet"), ("train",), prepare=lambda w: w.graph("qat"))
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(w.graph("qat"), w.tmp / "m.onnx",
                                                     example_inputs=w.inputs))


@case("exporting the original model", qc.QCompileError,
      ("export_onnx", "MLP", "not compiled by qcompile"), ("qc.qcompile",))
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(w.model, w.tmp / "m.onnx",
                                                     example_inputs=w.inputs))


@case("exporting a plain torch.fx GraphModule", qc.QCompileError,
      ("export_onnx", "not compiled by qcompile"), ("qc.qcompile",))
def _(w: World) -> Any:
    gm = torch.fx.symbolic_trace(MLP())
    return nothing_written(w, lambda: qc.export_onnx(gm, w.tmp / "m.onnx",
                                                     example_inputs=w.inputs))


@case("exporting into a folder that does not exist", qc.QCompileError,
      ("export_onnx", "does not exist", "missing"), ("create it",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(
        w.calibrated(), w.tmp / "missing" / "m.onnx", example_inputs=w.inputs))


@case("exporting onto a folder", qc.QCompileError, ("export_onnx", "is a folder"),
      ("file path",), prepare=lambda w: (w.calibrated(), (w.tmp / "sub").mkdir()))
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(w.calibrated(), w.tmp / "sub",
                                                     example_inputs=w.inputs))


@case("exporting with a wrong-shaped input", qc.QCompileError,
      ("export_onnx", "input 'x' is float32[4, 5]", "compiled for x: float32[4, 8]"),
      ("shaped like",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(w.calibrated(), w.tmp / "m.onnx",
                                                     example_inputs=(torch.randn(4, 5),)))


@case("exporting with an int64 input", qc.QCompileError,
      ("export_onnx", "'x' is int64[4, 8]", "float32[4, 8]"), ("same dtypes",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(w.calibrated(), w.tmp / "m.onnx",
                                                     example_inputs=w.inputs[0].long()))


@case("exporting with (input, target) pairs", qc.QCompileError,
      ("export_onnx", "2 values", "1 input(s): x"), ("only the model's inputs",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(
        w.calibrated(), w.tmp / "m.onnx", example_inputs=(w.inputs[0], torch.zeros(4))))


@case("exporting with a misnamed keyword input", qc.QCompileError,
      ("export_onnx", "'inputs'", "x"), ("forward()",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(
        w.calibrated(), w.tmp / "m.onnx", example_kwargs={"inputs": w.inputs[0]}))


@case("exporting with a numpy array as example_inputs", qc.QCompileError,
      ("export_onnx", "example_inputs is a ndarray"), ("tensor",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(w.calibrated(), w.tmp / "m.onnx",
                                                     example_inputs=w.inputs[0].numpy()))


@case("exporting without example inputs", qc.QCompileError,
      ("export_onnx", "example inputs"), ("example_inputs=(x,)",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return nothing_written(w, lambda: qc.export_onnx(w.calibrated(), w.tmp / "m.onnx"))


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path) -> None:
    check_case(c, tmp_path)
