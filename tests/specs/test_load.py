"""load_spec / dump_spec, the bundled presets, round trips, JSON schema, torch-free import."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import qcompile.specs
from qcompile.errors import QCompileError
from qcompile.specs import DTYPES, CompileSpec, dump_spec, load_spec, presets
from qcompile.specs.load import PRESET_DIR
from qcompile.specs.quant import BLOCK_DTYPES, FLOAT_DTYPES

PRESET_NAMES = sorted(presets())
EXPECTED_PRESETS = ["8da4w-qat", "gguf-q4_0-qat", "gguf-q4_k-qat", "gguf-q8_0-qat",
                    "int8-dynamic", "int8-qat", "int8-static", "mxfp4-qat", "mxfp8-qat",
                    "nvfp4-qat", "qlora-nf4", "w4a8-qat", "w8-weight-only"]


# ---------------------------------------------------------------------------------------
# Hypothesis strategies: valid spec dicts

OBSERVER_KINDS = ("minmax", "moving_average", "histogram", "percentile", "mse")

# Names/globs: mostly module-ish text, sometimes arbitrary (YAML-hostile) text.
_ident = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.*?[]",
                 min_size=1, max_size=12)
_any_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]),
                    max_size=12)
names = st.one_of(_ident, _any_text)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def observers(draw: st.DrawFn, kinds: tuple[str, ...] = OBSERVER_KINDS) -> object:
    kind = draw(st.sampled_from(kinds))
    form = draw(st.sampled_from(["short", "long", "params"]))
    if form == "short":
        return kind
    d: dict = {"kind": kind}
    if form == "params":
        if kind == "moving_average":
            d["momentum"] = draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
        elif kind == "histogram":
            d["bins"] = draw(st.integers(16, 65536))
        elif kind == "percentile":
            d["percentile"] = draw(st.floats(min_value=50.0, max_value=100.0, exclude_min=True))
        elif kind == "mse":
            d["steps"] = draw(st.integers(2, 10000))
    return d


@st.composite
def schemes(draw: st.DrawFn, role: str, mode: str,
            kinds: tuple[str, ...] = OBSERVER_KINDS) -> dict:
    d: dict = {}
    dtype = draw(st.sampled_from(DTYPES))
    if draw(st.booleans()) or dtype != "int8":
        d["dtype"] = dtype
    if dtype in BLOCK_DTYPES:  # granularity and block size implied by the dtype
        if dtype == "nf4" and draw(st.booleans()):
            d["group_size"] = 2 * draw(st.integers(1, 512))
        return d
    if dtype in FLOAT_DTYPES:
        if draw(st.booleans()):
            d["symmetric"] = True  # fp8 is symmetric only
    elif draw(st.booleans()):
        d["symmetric"] = draw(st.booleans())
    allowed = {"weight": ["per_tensor", "per_channel", "per_group"],
               "activation": ["per_tensor", "per_channel", "per_token"],
               "inputs": ["per_tensor", "per_channel", "per_token"]}[role]
    g = draw(st.sampled_from(allowed))
    if g != "per_tensor" or draw(st.booleans()):
        d["granularity"] = g
    if g == "per_channel" and draw(st.booleans()):
        d["axis"] = draw(st.integers(-4, 4))
    if g == "per_group":
        d["group_size"] = draw(st.integers(1, 1 << 20))
    if draw(st.booleans()):
        d["observer"] = draw(observers(kinds))
    if mode == "qat" and dtype not in FLOAT_DTYPES and draw(st.booleans()):
        d["learnable"] = draw(st.booleans())
    return d


def _one_or_list(s: st.SearchStrategy[str]) -> st.SearchStrategy[object]:
    return st.one_of(s, st.lists(s, min_size=1, max_size=3))


@st.composite
def matches(draw: st.DrawFn) -> dict:
    fields = draw(st.lists(st.sampled_from(["module", "name", "op"]), min_size=1, max_size=3,
                           unique=True))
    return {f: draw(_one_or_list(names)) for f in fields}


@st.composite
def rules(draw: st.DrawFn, mode: str, kinds: tuple[str, ...]) -> dict:
    r: dict = {"match": draw(matches())}
    if draw(st.integers(0, 3)) == 0:
        r["skip"] = True
    else:
        if draw(st.booleans()):
            r["skip"] = False
        roles = draw(st.sampled_from([("weight",), ("activation",), ("weight", "activation")]))
        for role in roles:
            r[role] = draw(schemes(role, mode, kinds))
    if draw(st.booleans()):
        r["optional"] = draw(st.booleans())
    return r


_devices = st.one_of(
    st.sampled_from(["cpu", "cuda", "mps", "xpu", "hpu", "npu"]),
    st.builds(lambda k, i: f"{k}:{i}", st.sampled_from(["cuda", "xpu", "npu"]),
              st.integers(0, 15)),
)


@st.composite
def pipelines(draw: st.DrawFn) -> dict:
    p: dict = {}
    if draw(st.booleans()):
        n = draw(st.integers(1, 8))
        p["stages"] = n
    else:
        stages = draw(st.lists(
            st.fixed_dictionaries({"modules": st.lists(names, min_size=1, max_size=3)},
                                  optional={"device": st.one_of(st.none(), _devices)}),
            min_size=1, max_size=4))
        p["stages"] = stages
        n = len(stages)
    if draw(st.booleans()):
        p["devices"] = draw(st.lists(_devices, min_size=n, max_size=n))
    if draw(st.booleans()):
        p["balance"] = draw(st.sampled_from(["params", "flops", "time"]))
    if draw(st.booleans()):
        p["microbatches"] = draw(st.integers(1, 64))
    if draw(st.booleans()):
        p["schedule"] = draw(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]))
    if draw(st.booleans()):
        p["transfer"] = draw(st.sampled_from(["fp32", "int8"]))
    if draw(st.booleans()):
        p["allow_tied"] = draw(st.booleans())
    return p


traces = st.fixed_dictionaries(
    {},
    optional={
        "method": st.sampled_from(["auto", "symbolic", "export"]),
        "leaf_modules": st.lists(names, max_size=3),
        "concrete_args": st.dictionaries(
            names,
            st.one_of(st.none(), st.booleans(), st.integers(), finite_floats, _any_text),
            max_size=4),
        "inputs": st.one_of(st.none(), st.lists(st.fixed_dictionaries(
            {"shape": st.lists(st.integers(0, 4096), max_size=4)},
            optional={"dtype": st.sampled_from(["float32", "float16", "bfloat16", "int64",
                                                "bool"])}), max_size=3)),
    },
)


@st.composite
def spec_dicts(draw: st.DrawFn, kinds: tuple[str, ...] = OBSERVER_KINDS) -> dict:
    d: dict = {}
    if draw(st.booleans()):
        d["version"] = 1
    mode = draw(st.sampled_from(["none", "dynamic", "static", "qat"]))
    quant: dict = {"mode": mode}
    # mode none quantizes nothing: rules or inputs with it are an error (tests/specs/
    # test_strict.py), so only a quantizing mode gets them.
    quant["rules"] = draw(st.lists(rules(mode, kinds), max_size=4)) if mode != "none" else []
    if mode != "none" and draw(st.booleans()):
        quant["inputs"] = draw(schemes("inputs", mode, kinds))
    if draw(st.booleans()):
        quant["fold_bn"] = draw(st.booleans())
    if draw(st.booleans()):
        quant["sync_observers"] = draw(st.booleans())
    d["quant"] = quant
    if draw(st.booleans()):
        d["data_parallel"] = {"kind": draw(st.sampled_from(["none", "ddp", "fsdp2"]))}
    if draw(st.booleans()):
        d["pipeline"] = draw(st.one_of(st.none(), pipelines()))
    if draw(st.booleans()):
        d["cache_dir"] = draw(st.one_of(st.none(), _any_text.filter(str.strip)))
    if draw(st.booleans()):
        d["trace"] = draw(traces)
    return d


# ---------------------------------------------------------------------------------------
# Presets


def test_presets_listed() -> None:
    assert PRESET_NAMES == EXPECTED_PRESETS
    for name, path in presets().items():
        assert path.is_file()
        assert path.suffix == ".yaml"
        assert path.stem == name
        assert path.parent == PRESET_DIR


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_loads_and_validates(name: str) -> None:
    spec = load_spec(name)
    assert isinstance(spec, CompileSpec)
    assert spec.version == 1
    assert spec.quant.rules, "a preset without rules quantizes nothing"
    # The preset file itself validates directly too.
    raw = yaml.safe_load(presets()[name].read_text(encoding="utf-8"))
    assert CompileSpec.model_validate(raw) == spec


@pytest.mark.parametrize(
    ("name", "mode"),
    [("int8-dynamic", "dynamic"), ("int8-qat", "qat"), ("int8-static", "static"),
     ("w4a8-qat", "qat"), ("w8-weight-only", "static")],
)
def test_preset_mode_matches_name(name: str, mode: str) -> None:
    assert load_spec(name).quant.mode == mode


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_dtypes_match_name(name: str) -> None:
    spec = load_spec(name)
    weights = [r.weight for r in spec.quant.rules if r.weight is not None]
    acts = [r.activation for r in spec.quant.rules if r.activation is not None]
    if name.startswith("int8"):
        assert weights
        assert {w.dtype for w in weights} == {"int8"}
        assert acts
        assert {a.dtype for a in acts} <= {"int8", "uint8"}
    elif name == "w4a8-qat":
        assert {w.dtype for w in weights} == {"int4"}
        assert {a.dtype for a in acts} == {"int8"}
        linear = spec.quant.rules[0]
        assert linear.match.module == ["Linear", "Conv1D"]  # Conv1D: GPT-2's Linear
        assert linear.weight.granularity == "per_group"
        assert linear.weight.group_size == 32
        assert linear.activation.granularity == "per_token"
    elif name == "w8-weight-only":
        assert {w.dtype for w in weights} == {"int8"}
        assert acts == []
    elif name.startswith("gguf-"):  # llama.cpp's grid, and its matmul's activation blocks
        grid = name.removeprefix("gguf-").removesuffix("-qat")
        assert {(w.dtype, w.group_size) for w in weights} == {
            (grid, 256 if grid.endswith("_k") else 32)}
        assert {a.dtype for a in acts} == {"q8_k" if grid.endswith("_k") else "q8_0"}
        assert {r.activation_at for r in spec.quant.rules} == {"input"}
    elif name == "8da4w-qat":  # torchao's LLM QAT scheme: what each Linear reads
        assert {(w.dtype, w.granularity, w.group_size) for w in weights} == {
            ("int4", "per_group", 32)}
        assert {(a.dtype, a.granularity, a.symmetric) for a in acts} == {
            ("int8", "per_token", False)}
        assert {r.activation_at for r in spec.quant.rules} == {"input"}
    elif name in ("nvfp4-qat", "mxfp4-qat", "mxfp8-qat"):  # weights and activations
        dtype = {"nvfp4-qat": "nvfp4", "mxfp4-qat": "mxfp4", "mxfp8-qat": "mxfp8_e4m3"}[name]
        assert {w.dtype for w in weights} == {a.dtype for a in acts} == {dtype}
        assert {r.activation_at for r in spec.quant.rules} == {"input"}
    elif name == "qlora-nf4":  # frozen NF4 bases under LoRA adapters, the head float
        assert {w.dtype for w in weights} == {"nf4"} and acts == []
        assert [(a.skip, a.rank, a.alpha, a.base) for a in spec.adapters] == [
            (True, 8, 8.0, "frozen"), (False, 16, 32.0, "frozen")]
    else:  # pragma: no cover - a new preset needs a line here
        pytest.fail(f"no expectations for preset {name}")


def test_preset_by_name_and_by_path_equal() -> None:
    by_name = load_spec("int8-qat")
    path = presets()["int8-qat"]
    assert load_spec(path) == by_name
    assert load_spec(str(path)) == by_name
    assert by_name.quant.mode == "qat"


def test_file_in_cwd_beats_preset_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "int8-qat").write_text("quant: {mode: static}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert load_spec("int8-qat").quant.mode == "static"


# ---------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_preset_dump_load_round_trip(name: str, suffix: str, tmp_path: Path) -> None:
    spec = load_spec(name)
    path = tmp_path / f"spec{suffix}"
    dump_spec(spec, path)
    assert load_spec(path) == spec


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_model_dump_round_trip(name: str) -> None:
    spec = load_spec(name)
    assert CompileSpec.model_validate(spec.model_dump()) == spec
    assert CompileSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(
    "observer",
    [
        {"kind": "moving_average"},
        {"kind": "moving_average", "momentum": 0.5},
        {"kind": "histogram", "bins": 256},
        {"kind": "percentile"},
        {"kind": "mse", "steps": 10},
    ],
)
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_dump_spec_keeps_observer_kind(observer: dict, suffix: str, tmp_path: Path) -> None:
    spec = CompileSpec.model_validate(
        {"quant": {"mode": "static",
                   "rules": [{"match": {"module": "Linear"},
                              "activation": {"dtype": "uint8", "symmetric": False,
                                             "observer": observer}}]}}
    )
    path = tmp_path / f"spec{suffix}"
    dump_spec(spec, path)
    assert load_spec(path) == spec


def test_dump_spec_default_observer_round_trip(tmp_path: Path) -> None:
    spec = CompileSpec.model_validate(
        {"quant": {"mode": "static",
                   "rules": [{"match": {"module": "Linear"},
                              "weight": {"observer": "minmax"}}]}}
    )
    for suffix in (".yaml", ".json"):
        dump_spec(spec, tmp_path / f"s{suffix}")
        assert load_spec(tmp_path / f"s{suffix}") == spec


def test_dump_spec_format_by_suffix(tmp_path: Path) -> None:
    spec = load_spec("int8-static")
    dump_spec(spec, tmp_path / "a.yaml")
    dump_spec(spec, tmp_path / "a.json")
    dump_spec(spec, tmp_path / "a.txt")
    yaml_text = (tmp_path / "a.yaml").read_text(encoding="utf-8")
    assert not yaml_text.lstrip().startswith("{")
    assert yaml.safe_load(yaml_text)["quant"]["mode"] == "static"
    assert json.loads((tmp_path / "a.json").read_text(encoding="utf-8"))["quant"]["mode"] == (
        "static"
    )
    # anything not .yaml/.yml is JSON
    assert json.loads((tmp_path / "a.txt").read_text(encoding="utf-8")) == json.loads(
        (tmp_path / "a.json").read_text(encoding="utf-8")
    )


def test_dump_default_spec_round_trip(tmp_path: Path) -> None:
    for suffix in (".yaml", ".json"):
        dump_spec(CompileSpec(), tmp_path / f"d{suffix}")
        assert load_spec(tmp_path / f"d{suffix}") == CompileSpec()


def _dump_load(spec: CompileSpec, suffix: str) -> CompileSpec:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"spec{suffix}"
        dump_spec(spec, path)
        return load_spec(path)


@given(spec_dicts())
@settings(deadline=None)
def test_generated_specs_validate_and_model_round_trip(d: dict) -> None:
    spec = CompileSpec.model_validate(d)
    assert CompileSpec.model_validate(spec.model_dump()) == spec
    assert CompileSpec.model_validate(spec.model_dump(mode="json")) == spec
    assert CompileSpec.model_validate_json(spec.model_dump_json()) == spec
    assert spec.quant.mode == d["quant"]["mode"]
    assert len(spec.quant.rules) == len(d["quant"]["rules"])


@given(spec_dicts())
@settings(deadline=None)
def test_generated_specs_dump_load_round_trip(d: dict) -> None:
    spec = CompileSpec.model_validate(d)
    assert _dump_load(spec, ".yaml") == spec
    assert _dump_load(spec, ".json") == spec


# ---------------------------------------------------------------------------------------
# load_spec errors and file handling


def test_missing_file_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(QCompileError) as excinfo:
        load_spec(missing)
    msg = str(excinfo.value)
    assert str(missing) in msg
    assert "does not exist" in msg
    for name in PRESET_NAMES:
        assert name in msg
    assert excinfo.value.fix is not None


def test_unknown_preset_name_error() -> None:
    with pytest.raises(QCompileError) as excinfo:
        load_spec("int8-qta")
    msg = str(excinfo.value)
    assert "'int8-qta'" in msg
    assert "int8-qat" in msg


def test_directory_is_not_a_spec(tmp_path: Path) -> None:
    with pytest.raises(QCompileError):
        load_spec(tmp_path)


@pytest.mark.parametrize("text", ["quant: {mode: qat\n", "quant:\n  mode: qat\n mode: x\n",
                                  "a: [1, 2\n", "\tquant: 1\n"])
def test_invalid_yaml_syntax(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(QCompileError) as excinfo:
        load_spec(path)
    assert str(path) in str(excinfo.value)
    assert "not valid" in str(excinfo.value)


def test_invalid_json_syntax(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"quant": {"mode": "qat",}}', encoding="utf-8")
    with pytest.raises(QCompileError) as excinfo:
        load_spec(path)
    msg = str(excinfo.value)
    assert str(path) in msg
    assert "json" in msg


def test_json_file_is_parsed_as_json_not_yaml(tmp_path: Path) -> None:
    # YAML would accept this (a flow mapping with an unquoted key); JSON must not.
    path = tmp_path / "s.json"
    path.write_text("{quant: {mode: qat}}", encoding="utf-8")
    with pytest.raises(QCompileError):
        load_spec(path)


@pytest.mark.parametrize(
    ("text", "type_name"),
    [("- quant\n- pipeline\n", "list"), ("42\n", "int"), ("just a string\n", "str")],
)
def test_top_level_not_a_mapping(tmp_path: Path, text: str, type_name: str) -> None:
    path = tmp_path / "list.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(QCompileError) as excinfo:
        load_spec(path)
    msg = str(excinfo.value)
    assert "mapping" in msg
    assert type_name in msg
    assert str(path) in msg


def test_json_top_level_list(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(QCompileError) as excinfo:
        load_spec(path)
    assert "list" in str(excinfo.value)


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n", "null\n"])
def test_empty_yaml_is_an_error(tmp_path: Path, text: str) -> None:
    # An empty file used to load as the default spec (mode none: a float graph), silently.
    path = tmp_path / "empty.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(QCompileError) as excinfo:
        load_spec(path)
    assert f"spec file {str(path)!r} is empty" in str(excinfo.value)
    assert "preset" in excinfo.value.fix and "int8-qat" in excinfo.value.fix


def test_json_file(tmp_path: Path) -> None:
    data = {"version": 1,
            "quant": {"mode": "static",
                      "rules": [{"match": {"module": "Linear"},
                                 "weight": {"dtype": "int4", "granularity": "per_group",
                                            "group_size": 64}}]},
            "pipeline": {"stages": 2, "devices": ["cpu", "cuda:1"]}}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    spec = load_spec(path)
    assert spec == CompileSpec.model_validate(data)
    assert spec.quant.rules[0].weight.group_size == 64
    assert spec.pipeline.devices == ["cpu", "cuda:1"]


def test_json_suffix_case_insensitive(tmp_path: Path) -> None:
    path = tmp_path / "spec.JSON"
    path.write_text('{"quant": {"mode": "dynamic"}}', encoding="utf-8")
    assert load_spec(path).quant.mode == "dynamic"


def test_yml_and_other_suffixes_are_yaml(tmp_path: Path) -> None:
    for name in ("a.yml", "a.YAML", "a.spec", "noext"):
        path = tmp_path / name
        path.write_text("quant:\n  mode: qat\n", encoding="utf-8")
        assert load_spec(path).quant.mode == "qat"


def test_invalid_spec_raises_validation_error_with_path(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "quant:\n  mode: static\n  rules:\n"
        "    - match: {module: Linear}\n"
        "      weight: {dtype: int4, granularity: per_group}\n",
        encoding="utf-8",
    )
    with pytest.raises(ValidationError) as excinfo:
        load_spec(path)
    locs = [tuple(e["loc"]) for e in excinfo.value.errors()]
    assert locs == [("quant", "rules", 0, "weight")]
    assert "group_size" in str(excinfo.value)


def test_unknown_key_in_file_named(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("version: 1\nquant: {mode: qat}\npipline: {stages: 2}\n", encoding="utf-8")
    with pytest.raises(ValidationError) as excinfo:
        load_spec(path)
    assert [tuple(e["loc"]) for e in excinfo.value.errors()] == [("pipline",)]


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system",
        "!!python/object/apply:subprocess.call",
    ],
)
def test_yaml_python_tags_not_executed(tmp_path: Path, tag: str) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    if tag.endswith("os.system"):
        path.write_text(f'quant: {tag} ["touch {sentinel}"]\n', encoding="utf-8")
    else:
        path.write_text(f'quant: {tag} [["touch", "{sentinel}"]]\n', encoding="utf-8")
    with pytest.raises(QCompileError) as excinfo:
        load_spec(path)
    assert str(path) in str(excinfo.value)
    assert not sentinel.exists()


def test_yaml_os_system_echo_raises(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text('!!python/object/apply:os.system ["echo hi"]\n', encoding="utf-8")
    with pytest.raises(QCompileError):
        load_spec(path)


def test_yaml_python_name_tag_rejected(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("cache_dir: !!python/name:os.getcwd\n", encoding="utf-8")
    with pytest.raises(QCompileError):
        load_spec(path)


def test_non_utf8_file_is_qcompile_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("cache_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(QCompileError):
        load_spec(path)


# ---------------------------------------------------------------------------------------
# JSON schema and torch-free import


def test_json_schema() -> None:
    schema = CompileSpec.model_json_schema()
    text = json.dumps(schema)
    assert json.loads(text) == schema
    props = schema["properties"]
    for key in ("version", "quant", "data_parallel", "pipeline", "cache_dir", "trace"):
        assert key in props
    assert schema.get("additionalProperties") is False
    defs = schema["$defs"]
    assert "Scheme" in defs
    assert defs["Scheme"].get("additionalProperties") is False
    assert set(defs["Scheme"]["properties"]["dtype"]["enum"]) == set(DTYPES)


def test_torch_free_import() -> None:
    code = (
        "import qcompile.specs, sys; s = qcompile.specs.load_spec('int8-qat'); "
        "assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_torch_free_full_use() -> None:
    code = (
        "import sys, json, tempfile, pathlib\n"
        "import qcompile.specs as s\n"
        "for n in s.presets(): s.load_spec(n)\n"
        "json.dumps(s.CompileSpec.model_json_schema())\n"
        "d = pathlib.Path(tempfile.mkdtemp())\n"
        "s.dump_spec(s.load_spec('int8-static'), d / 'x.yaml')\n"
        "s.load_spec(d / 'x.yaml')\n"
        "mods = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not mods, mods\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_public_names() -> None:
    for name in qcompile.specs.__all__:
        assert hasattr(qcompile.specs, name), name
