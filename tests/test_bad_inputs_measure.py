"""Mistakes with ``qc.sqnr``: each is a ``QCompileError`` naming the batch / argument and
the fix, and leaves the model, its inputs and the compiled graph exactly as they were."""

from __future__ import annotations

import pytest
import torch
from bad_inputs_harness import MLP, Case, World, X, case_table, check_case

import qcompile as qc

CASES: list[Case] = []
case = case_table(CASES)


@case("sqnr with a batch of the wrong width", qc.QCompileError,
      ("qc.sqnr: batch 1", "float32[4, 5]", "does not fit"), ("example inputs",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> object:
    return qc.sqnr(w.calibrated(), w.model, [X, torch.randn(4, 5)])


@case("sqnr with (input, target) pairs", qc.QCompileError,
      ("qc.sqnr: batch 0", "tuple of 2 values"), ("inputs=lambda batch: batch[0]", "qc.sqnr"),
      prepare=lambda w: w.calibrated())
def _(w: World) -> object:
    return qc.sqnr(w.calibrated(), w.model, [(X, torch.zeros(4))])


@case("sqnr with a keyword the graph does not take", qc.QCompileError,
      ("qc.sqnr: batch 0", "inputs: float32[4, 8]", "does not fit"), ("same names",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> object:
    return qc.sqnr(w.calibrated(), w.model, [{"inputs": X}])


@case("sqnr of the float model instead of the compiled graph", qc.QCompileError,
      ("qc.sqnr", "graph returned by qc.qcompile", "MLP"), ("qc.qcompile(model, spec",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> object:
    return qc.sqnr(w.model, w.calibrated(), [X])


@case("sqnr with no batches", qc.QCompileError, ("qc.sqnr", "no batches"), ("non-empty",),
      model=MLP, prepare=lambda w: w.calibrated())
def _(w: World) -> object:
    return qc.sqnr(w.calibrated(), w.model, iter(()))


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path) -> None:
    check_case(c, tmp_path)
