"""``qc.save_spec``: YAML that ``load_spec`` reads back to an equal spec, for every preset,
for specs with a ``quant.search`` section and for the specs ``qc.search`` returns, with each
rule's note also written as comment lines above it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import qcompile as qc
from qcompile.specs import CompileSpec, load_spec, presets, save_spec

INT4 = {"dtype": "int4", "granularity": "per_group", "group_size": 32}
INT8 = {"dtype": "int8", "granularity": "per_channel"}
SEARCH = {"candidates": [{"weight": INT4}, {"weight": INT8}, {"weight": {"dtype": "nvfp4"}}],
          "budget": {"avg_weight_bits": 5.0}, "metric": "fisher", "granularity": "block"}


def round_trip(spec: CompileSpec, path: Path) -> str:
    save_spec(spec, path)
    assert load_spec(path) == spec
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(presets()))
def test_every_preset_round_trips(name: str, tmp_path: Path) -> None:
    spec = load_spec(name)
    text = round_trip(spec, tmp_path / f"{name}.yaml")
    # what the preset file says, no more: its fields, not every default
    assert "observer_update" not in text
    assert yaml.safe_load(text)["quant"]["mode"] == spec.quant.mode
    round_trip(spec, tmp_path / f"{name}.json")  # JSON for a .json path


def test_a_spec_with_a_search_section_round_trips(tmp_path: Path) -> None:
    spec = CompileSpec.model_validate({"quant": {
        "mode": "qat", "rules": [{"match": {"module": "Linear"}, "weight": INT8}],
        "search": SEARCH}})
    text = round_trip(spec, tmp_path / "s.yaml")
    assert "max_loss_increase" not in text  # the budget given, not the others as nulls
    budget = CompileSpec.model_validate({"quant": {
        "mode": "qat", "rules": [{"match": {"module": "Linear"}, "weight": INT8}],
        "search": {**SEARCH, "budget": {"weight_bytes": 4096}}}})
    round_trip(budget, tmp_path / "b.yaml")


def test_notes_are_written_as_comments_above_their_rules(tmp_path: Path) -> None:
    note = "measured: int4 0.5 (12 dB), int8 0.01\n# not a key: 'quoted' \"too\""
    spec = CompileSpec.model_validate({"quant": {"mode": "static", "rules": [
        {"match": {"name": "fc1"}, "weight": INT4, "note": note},
        {"match": {"module": "Linear"}, "weight": INT8}]}})
    text = round_trip(spec, tmp_path / "n.yaml")
    lines = text.splitlines()
    first = lines.index("    # measured: int4 0.5 (12 dB), int8 0.01")
    assert lines[first + 1] == "    # # not a key: 'quoted' \"too\""
    assert lines[first + 2].startswith("    - match:")
    assert load_spec(tmp_path / "n.yaml").quant.rules[0].note == note


def test_a_searched_spec_round_trips_with_its_measurements(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    spec = {"quant": {"mode": "static", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
         "activation": {"dtype": "uint8", "symmetric": False}}],
        "search": {"candidates": [{"weight": INT4}, {"weight": INT8}],
                   "budget": {"avg_weight_bits": 6.0}}}}
    found = qc.search(model, spec, [torch.randn(8, 32) for _ in range(2)])
    text = round_trip(found, tmp_path / "found.yaml")
    assert "search" not in yaml.safe_load(text)["quant"]
    comments = [line.strip() for line in text.splitlines() if line.strip().startswith("#")]
    assert len(comments) == 2  # one per searched layer
    assert all(c.startswith("# qc.search, metric sqnr over 2 batches: int4/per_group32 ")
               for c in comments)
    assert "dB" in comments[0] and "; chosen " in comments[0]
    assert qc.save_spec is save_spec


def test_save_spec_refuses_what_is_not_a_spec(tmp_path: Path) -> None:
    with pytest.raises(qc.QCompileError, match="save_spec takes a CompileSpec"):
        save_spec("int8-qat", tmp_path / "x.yaml")  # type: ignore[arg-type]
