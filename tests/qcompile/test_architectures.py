"""The architecture sweep (``qcompile-bench architectures``): every decoder family
transformers ships that torch.export captures, and the encoders, built from tiny configs,
under each LLM preset: compiles with a pad token in the batch, three training steps with
finite losses, at least 99% of the weights linear layers read behind a weight quantizer
(counted from the model, the preset's skip rules aside), and a converted graph within
tolerance of the fake-quant graph.

The default run takes a dense decoder under every preset and one case each of an MoE,
Falcon's ``x @ W.T`` layers, GPT-2's Conv1D and an encoder; ``.ci/run`` sets
``QCOMPILE_SWEEP=1`` for every family under every preset (about five minutes on two cores),
and then also checks that the table the docs show (``docs/reference/architectures.json``)
says what the sweep finds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from qcompile.tools.architectures import ARCHITECTURES
from qcompile.tools.bench.suites.architectures import PRESETS, sweep_case

FULL = os.environ.get("QCOMPILE_SWEEP") == "1"
DEFAULT = [("llama", p) for p in PRESETS] + [
    ("mixtral", "int8-qat"), ("qwen2_moe", "qlora-nf4"), ("falcon", "qlora-nf4"),
    ("gpt2", "qlora-nf4"), ("bert", "int8-static")]
CASES = [(a, p) for a in ARCHITECTURES for p in PRESETS] if FULL else DEFAULT
DOCS_DATA = Path(__file__).resolve().parents[2] / "docs" / "reference" / "architectures.json"


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str], dict]:
    return {}


@pytest.mark.parametrize(("arch", "preset"), CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_family_under_preset(arch: str, preset: str, rows: dict) -> None:
    row = sweep_case(arch, preset)
    rows[arch, preset] = row
    assert "error" not in row, row["error"]
    assert row["finite"], row["losses"]
    assert row["share"] >= 0.99, f"float: {row['float']}"
    assert row["converted"], f"converted graph off by {row['convert_deviation']} (relative)"


@pytest.mark.skipif(not FULL, reason="the whole sweep runs in .ci/run (QCOMPILE_SWEEP=1)")
def test_the_docs_table_says_what_the_sweep_finds(rows: dict) -> None:
    """What each cell of docs/reference/architectures.md states (compiled, finite, share to
    0.1%, converted) is what this run found; the two-rank compile_once column is checked
    by tests/dist/test_architectures_dist.py."""
    data = json.loads(DOCS_DATA.read_text())
    assert data["presets"] == list(PRESETS)
    shown = {(r["arch"], r["preset"]): r for r in data["rows"]}
    assert set(shown) == {(a, p) for a in ARCHITECTURES for p in PRESETS}
    for key, row in rows.items():
        doc = shown[key]
        assert ("error" in doc) == ("error" in row), key
        for field in ("finite", "converted"):
            assert doc.get(field) == row.get(field), (key, field)
        assert round(doc["share"], 3) == round(row["share"], 3), key
