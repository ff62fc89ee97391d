"""qcompile-bench search --quick: a smoke run of the whole flow (tiny LM, digits CNN after
one epoch, 2 batches): every row is measured after compiling what ``qc.search`` returned,
and the files it writes are what ``qcompile-inspect search`` reads. Numbers are checked
for consistency, never timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qcompile.tools.inspect_cli import main as inspect_main


def test_quick_search_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    from qcompile.tools.bench.suites.search import BUDGETS, CASES, bench_search, search_text

    monkeypatch.setenv("QCOMPILE_BENCH_CACHE", str(tmp_path / "cache"))  # trains afresh
    monkeypatch.setenv("QCOMPILE_BENCH_OUT", str(tmp_path / "out"))
    result = bench_search(quick=True)
    for name, case in CASES.items():
        r = result[name]
        assert r["model_unchanged"], name
        int4, int8 = r["uniform"].values()
        assert set(r["searched"]) == set(case.metrics)
        for metric, s in r["searched"].items():
            assert s["search_s"] > 0 and s["search_vs_calibration"] > 0
            for bits in BUDGETS:
                row = s["budgets"][f"{bits:g}"]
                # the budget holds, and the mix is a mix at these budgets
                assert 4.0 <= row["avg_weight_bits"] <= bits + 1e-9, (name, metric, bits)
                assert sum(row["groups_per_candidate"].values()) > 0
                assert isinstance(row["value"], float)
                if row["gap_closed"] is not None:
                    want = (int4["value"] - row["value"]) / (int4["value"] - int8["value"])
                    assert row["gap_closed"] == pytest.approx(want)
        assert r["fp32"]["value"] > 0 and all(v > 0 for v in r["calibration_pass_s"].values())
    assert result["CNN"]["fisher_vs_loss"] > 0 and "test_loss" in result["CNN"]["fp32"]
    text = search_text(result)
    assert "| LM (" in text and "sqnr @4.5" in text and "fisher / loss search time" in text
    # the files: the report of each search and its measured points, for the inspect CLI
    files = result["LM"]["files"]
    measured = json.loads(Path(files["sqnr measured"]).read_text(encoding="utf-8"))
    assert measured["metric"] == "validation perplexity"
    values = {float(k): v for k, v in measured["values"].items()}
    assert values[4.0] == result["LM"]["uniform"]["int4/per_group32/asym"]["value"]
    assert values[8.0] == result["LM"]["uniform"]["int8/per_channel"]["value"]
    capsys.readouterr()
    assert inspect_main(["search", files["sqnr details"], "--measured",
                         files["sqnr measured"], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["pareto"]
    assert sum(r["measured"] is not None for r in rows) == len(values)
    assert any(r["chosen"] and r["measured"] is not None for r in rows)
