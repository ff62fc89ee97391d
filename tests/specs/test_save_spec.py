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


# -- specs built in Python (not read from a file) ------------------------------------------
# Every field kind: enums, bools, ints, floats (tiny, with exponents), None, lists of plain
# values and of objects, dicts with int and str keys, a discriminated union given by kind
# and left at a default, strings YAML would read as something else ('yes', 'null', '1e3',
# '~', '0'), a note with a colon and a '#', a path with a space and a colon.
KITCHEN = {
    "version": 1,
    "quant": {
        "mode": "qat", "target": "generic",
        "rules": [
            {"match": {"name": ["0", "yes", "null", "1e3", "on", "~", "a: b", "#x", "'q'"]},
             "skip": True},
            {"match": {"module": "Linear", "op": ["add", "matmul"], "reads_weight": False},
             "optional": True, "note": "line1\nline2: x # y\n",
             "weight": {"dtype": "int8", "granularity": "per_channel", "axis": 1,
                        "observer": {"kind": "mse", "steps": 7}},
             "activation": {"dtype": "uint8", "symmetric": False,
                            "observer": {"kind": "moving_average", "momentum": 1e-05}}},
            {"match": {"module": ["Conv2d"]},
             "weight": {"dtype": "int4", "granularity": "per_group", "group_size": 16,
                        "learnable": True},
             "activation": {"dtype": "int8", "granularity": "per_token",
                            "observer": {"kind": "percentile", "percentile": 99.99}}},
            {"match": {"name": "h*"}, "weight": {"dtype": "fp8_e4m3"},
             "activation": {"dtype": "uint8", "symmetric": False,
                            "observer": {"kind": "histogram", "bins": 128}}},
            {"match": {"name": "m*"}, "weight": {"dtype": "nvfp4"},
             "activation": {"dtype": "int8", "observer": "minmax"}},
        ],
        "inputs": "auto",
        "algorithms": [{"kind": "smoothquant", "alpha": 0.25},
                       {"kind": "cross_layer_equalization"}],
        "fold_bn": False, "sync_observers": False,
    },
    "pipeline": {"stages": [{"modules": ["a*"], "device": "cpu"}, {"modules": ["b"]}],
                 "microbatches": 3, "schedule": "1f1b", "transfer": "int8",
                 "allow_tied": False},
    "data_parallel": {"kind": "fsdp2"},
    "cache_dir": "/tmp/x y: z",
    "trace": {"method": "export", "leaf_modules": ["Foo"],
              "concrete_args": {"a": None, "b": 1.5, "c": "off", "d": True, "e": 3},
              "inputs": [{"shape": [2, 3], "dtype": "bfloat16"}],
              "dynamic_dims": {"x": {0: "batch", 1: {"name": "seq", "min": 2, "max": 64}}},
              "stack_traces": True},
    "train": {"accumulate": 4, "recompute_weights": True, "check_finite": 10},
    "adapters": [{"kind": "lora", "match": {"name": "a*"}, "rank": 3, "alpha": 0.1,
                  "dropout": 0.05, "base": "qat", "seed": 7},
                 {"kind": "full", "match": {"name": "head"}, "optional": True}],
}
QUANT_INPUTS = {"quant": {"mode": "static", "observer_update": "forward",
                          "rules": [{"match": {"module": "Linear"}, "weight": INT8}],
                          "inputs": {"dtype": "uint8", "symmetric": False},
                          "search": {**SEARCH, "budget": {"max_loss_increase": 0.5}}}}


def python_built(name: str) -> list[tuple[str, CompileSpec]]:
    """The preset ``name`` rebuilt in Python three ways: every field set (a JSON dump), the
    Python objects of a dump (enums, nested models as dicts), the fields the file set."""
    spec = load_spec(name)
    return [("json dump", CompileSpec.model_validate(spec.model_dump(mode="json"))),
            ("python dump", CompileSpec.model_validate(spec.model_dump())),
            ("set fields", CompileSpec.model_validate(spec.model_dump(exclude_unset=True)))]


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("name", sorted(presets()))
def test_every_preset_built_in_python_round_trips(name: str, suffix: str,
                                                  tmp_path: Path) -> None:
    for how, spec in python_built(name):
        path = tmp_path / f"{how.replace(' ', '_')}{suffix}"
        save_spec(spec, path)
        assert load_spec(path) == spec, f"{name} ({how}): not read back equal"
        assert load_spec(path) == load_spec(name)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize("raw", [KITCHEN, QUANT_INPUTS], ids=["every_field_kind", "inputs"])
def test_specs_with_every_field_kind_round_trip(raw: dict, suffix: str,
                                                tmp_path: Path) -> None:
    spec = CompileSpec.model_validate(raw)
    for how, built in [("dict", spec),
                       ("full dump", CompileSpec.model_validate(spec.model_dump(mode="json"))),
                       ("python dump", CompileSpec.model_validate(spec.model_dump()))]:
        path = tmp_path / f"s{suffix}"
        qc.save_spec(built, path)
        back = load_spec(path)
        assert back == built, f"{how}: {back.model_dump()} != {built.model_dump()}"
    # a dict is taken too (validated first), and the file is plain YAML / JSON
    qc.save_spec(raw, tmp_path / f"d{suffix}")
    assert load_spec(tmp_path / f"d{suffix}") == spec
    text = (tmp_path / f"d{suffix}").read_text(encoding="utf-8")
    assert "!!python" not in text and "!!" not in text


def test_a_spec_built_from_model_objects_round_trips(tmp_path: Path) -> None:
    """Built with the pydantic classes' constructors (what a script does), not from a
    dict: discriminators (``kind``) left at their defaults are not "set" fields, and must
    still be written, or the file does not load."""
    from qcompile.specs import adapters as A
    from qcompile.specs import compile as C
    from qcompile.specs import quant as Q

    observers = [Q.MinMaxObserver(), Q.MovingAverageObserver(momentum=0.1),
                 Q.HistogramObserver(bins=64), Q.PercentileObserver(percentile=99.0),
                 Q.MseObserver(steps=10)]
    rules = [Q.Rule(match=Q.Match(name=[f"l{i}"]),
                    weight=Q.Scheme(dtype="int8", observer=o) if i == 0 else None,
                    activation=Q.Scheme(dtype="uint8", symmetric=False, observer=o))
             for i, o in enumerate(observers)]
    spec = CompileSpec(
        quant=Q.QuantSpec(mode="qat", rules=rules, algorithms=[
            Q.SmoothQuant(alpha=0.3), Q.CrossLayerEqualization()]),
        pipeline=C.PipelineSpec(stages=[C.StageSpec(modules=["l0"]),
                                        C.StageSpec(modules=["l*"], device="cpu")]),
        data_parallel=C.DataParallelSpec(),
        trace=C.TraceSpec(dynamic_dims={"x": {0: C.DynamicDim(name="batch", max=64)}}),
        train=C.TrainSpec(accumulate=2),
        adapters=[A.AdapterSpec(match=Q.Match(name=["l0"]), rank=2),
                  A.FullModuleSpec(match=Q.Match(name=["l1"]))])
    for suffix in (".yaml", ".json"):
        save_spec(spec, tmp_path / f"c{suffix}")
        assert load_spec(tmp_path / f"c{suffix}") == spec
