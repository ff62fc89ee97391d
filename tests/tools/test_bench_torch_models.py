"""The ``torch-models`` sweep's machinery on one tiny model (torch's test models are the
bench's to run, not the test suite's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qcompile.tools.bench.suites.torch_models import (
    PRESETS,
    Case,
    measure_case,
    rule_inputs,
    summarize,
    torch_models_text,
)


def test_one_model_side_by_side_and_its_text() -> None:
    case = Case("tiny", lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU()), rule_inputs, "rule")
    rows = measure_case(case, quick=True)
    assert [r["preset"] for r in rows] == list(PRESETS)
    for r in rows:
        assert r["kinds"] == "Linear"
        for side in ("qcompile", "torch_ao"):
            cell = r[side]
            assert cell["compiled"] and cell["converted"], (r["preset"], side, cell["error"])
            assert cell["quantized"] == pytest.approx(64 / 72)  # the weight, not the bias
            assert 0 <= cell["converted_rel_l2"] < 0.5
    summary = summarize(rows)
    assert summary["int8-static"]["qcompile"]["converted"] == 1
    assert summary["int8-dynamic"]["both_converted"] == 1
    text = torch_models_text({"models": 1, "summary": summary, "rows": rows})
    assert "both_median_int8_rel_l2" in text and "failures (0):" in text


def test_a_model_that_does_not_run_in_float_is_one_failure_per_preset() -> None:
    case = Case("misfit", lambda: nn.Linear(8, 8), lambda m: (torch.randn(2, 3),), "table")
    rows = measure_case(case)
    assert all(r["fp32_error"].startswith("fp32 run: RuntimeError") for r in rows)
    text = torch_models_text({"models": 1, "summary": summarize(rows), "rows": rows})
    assert "failures (3):" in text
