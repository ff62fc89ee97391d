"""Specs that would silently mean something else are errors (issue 15 §2).

A key given twice, an empty file, ``true`` or ``2.0`` where an integer belongs, rules
under ``mode: none``, a mistyped preset name and a non-path argument to ``load_spec``:
each is refused with a message naming the key / field / argument and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from qcompile.errors import QCompileError
from qcompile.specs import CompileSpec, QuantSpec, load_spec, presets

ROOT = Path(__file__).resolve().parents[2]
ADD = {"match": {"op": "add"}, "activation": {"dtype": "uint8", "symmetric": False}}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _load_error(path: Path) -> QCompileError:
    with pytest.raises(QCompileError) as excinfo:
        load_spec(path)
    return excinfo.value


def _locs(excinfo: pytest.ExceptionInfo[ValidationError]) -> list[tuple[Any, ...]]:
    return [tuple(e["loc"]) for e in excinfo.value.errors()]


# ---------------------------------------------------------------------------------------
# Duplicate keys


def test_duplicate_yaml_key_names_key_path_and_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, "s.yaml", "version: 1\nquant:\n  mode: qat\n  rules: []\n"
                  "  mode: none\n")
    err = _load_error(path)
    msg = str(err)
    assert str(path) in msg
    assert "duplicate key 'mode' at quant.mode, line 5 (first given at line 3)" in msg
    assert err.fix == "keep one `mode:` under `quant:` and delete the other"


@pytest.mark.parametrize(
    ("text", "where", "line"),
    [
        ("version: 1\nversion: 1\n", "version", 2),
        ("quant:\n  mode: qat\n  rules:\n    - match: {op: add, op: mul}\n      skip: true\n",
         "quant.rules[0].match.op", 4),
        ("trace:\n  dynamic_dims:\n    x: {0: batch, 0: seq}\n", "trace.dynamic_dims.x.0", 3),
        ("quant: {mode: qat}\ntrace: {method: auto}\nquant: {mode: none}\n", "quant", 3),
    ],
)
def test_duplicate_yaml_keys_anywhere(tmp_path: Path, text: str, where: str,
                                      line: int) -> None:
    msg = str(_load_error(_write(tmp_path, "s.yaml", text)))
    assert f"at {where}, line {line}" in msg


def test_yaml_merge_keys_and_aliases_are_not_duplicates(tmp_path: Path) -> None:
    # An explicit key overriding a merged one is what `<<` is for; an alias repeats a node.
    text = ("quant:\n  <<: {mode: qat, fold_bn: false}\n  mode: static\n  rules:\n"
            "    - &add {match: {op: add}, activation: {dtype: uint8}}\n    - *add\n")
    spec = load_spec(_write(tmp_path, "s.yaml", text))
    assert spec.quant.mode == "static" and spec.quant.fold_bn is False
    assert len(spec.quant.rules) == 2


def test_duplicate_check_constructs_no_python_objects(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    path = _write(tmp_path, "evil.yaml",
                  f'quant: !!python/object/apply:os.system ["touch {sentinel}"]\n'
                  "quant: {mode: qat}\n")
    _load_error(path)  # the duplicate is found first; nothing ever runs
    assert not sentinel.exists()


def test_duplicate_json_key_names_key_path_and_line(tmp_path: Path) -> None:
    text = '{\n  "quant": {\n    "mode": "qat",\n    "mode": "none"\n  }\n}\n'
    err = _load_error(_write(tmp_path, "s.json", text))
    assert "duplicate key 'mode' at quant.mode, line 4 (first given at line 3)" in str(err)
    assert err.fix == "keep one `mode:` under `quant:` and delete the other"


def test_duplicate_json_key_inside_a_list(tmp_path: Path) -> None:
    data = '{"quant": {"mode": "qat", "rules": [{"match": {"op": "add", "op": "mul"}, ' \
           '"skip": true}]}}'
    msg = str(_load_error(_write(tmp_path, "s.json", data)))
    assert "duplicate key 'op' at quant.rules[0].match.op" in msg


def test_json_without_duplicates_still_loads(tmp_path: Path) -> None:
    data = {"quant": {"mode": "static", "rules": [ADD]},
            "trace": {"dynamic_dims": {"x": {"0": "batch"}}}}  # JSON keys are strings
    spec = load_spec(_write(tmp_path, "s.json", json.dumps(data)))
    assert spec.trace.dynamic_dims == {"x": {0: "batch"}}


# ---------------------------------------------------------------------------------------
# Empty files


@pytest.mark.parametrize(("name", "text"), [("e.json", ""), ("e.json", " \n"),
                                            ("e.json", "null"), ("e.yml", "# nothing\n")])
def test_empty_file_is_an_error(tmp_path: Path, name: str, text: str) -> None:
    path = _write(tmp_path, name, text)
    err = _load_error(path)
    assert f"spec file {str(path)!r} is empty" in str(err)
    for preset in presets():
        assert preset in err.fix


def test_explicit_float_spec_still_loads(tmp_path: Path) -> None:
    assert load_spec(_write(tmp_path, "f.yaml", "quant: {mode: none}\n")) == CompileSpec()


# ---------------------------------------------------------------------------------------
# Strict integers: `true` is never 1, 2.0 is never 2


INT_FIELDS = [
    ({"version": "V"}, ("version",)),
    ({"pipeline": {"stages": "V"}}, ("pipeline", "stages", "int")),
    ({"pipeline": {"stages": 2, "microbatches": "V"}}, ("pipeline", "microbatches")),
    ({"train": {"accumulate": "V"}}, ("train", "accumulate")),
    ({"trace": {"inputs": [{"shape": [2, "V"]}]}}, ("trace", "inputs", 0, "shape", 1)),
    ({"trace": {"dynamic_dims": {"x": {0: {"name": "b", "max": "V"}}}}},
     ("trace", "dynamic_dims", "x", 0, "*", "max")),
    ({"quant": {"mode": "static", "rules": [{"match": {"op": "add"}, "weight": {
        "granularity": "per_group", "group_size": "V"}}]}},
     ("quant", "rules", 0, "weight", "group_size")),
    ({"quant": {"mode": "static", "rules": [{"match": {"op": "add"}, "activation": {
        "granularity": "per_channel", "axis": "V"}}]}},
     ("quant", "rules", 0, "activation", "axis")),
    ({"quant": {"mode": "static", "rules": [{"match": {"op": "add"}, "activation": {
        "observer": {"kind": "histogram", "bins": "V"}}}]}},
     ("quant", "rules", 0, "activation", "observer", "histogram", "bins")),
    ({"quant": {"mode": "static", "rules": [{"match": {"op": "add"}, "activation": {
        "observer": {"kind": "mse", "steps": "V"}}}]}},
     ("quant", "rules", 0, "activation", "observer", "mse", "steps")),
]


def _put(d: Any, value: object) -> Any:
    if d == "V":
        return value
    if isinstance(d, dict):
        return {k: _put(v, value) for k, v in d.items()}
    if isinstance(d, list):
        return [_put(v, value) for v in d]
    return d


def _good_value(loc: tuple[Any, ...]) -> int:
    return {"bins": 64, "steps": 10, "group_size": 32, "axis": 1}.get(str(loc[-1]), 1)


@pytest.mark.parametrize(("template", "loc"), INT_FIELDS)
@pytest.mark.parametrize("bad", [True, False, 2.0, "2"])
def test_int_fields_reject_bools_floats_and_strings(template: dict, loc: tuple[Any, ...],
                                                    bad: object) -> None:
    # The same field takes a real int (the test's template is otherwise valid).
    CompileSpec.model_validate(_put(template, _good_value(loc)))
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate(_put(template, bad))
    # "*": pydantic's name for a union member (here DynamicDim behind its validator)
    assert any(len(got) == len(loc) and all(w in ("*", g) for w, g in zip(loc, got))
               for got in _locs(excinfo)), _locs(excinfo)


def test_microbatches_true_from_yaml_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "s.yaml", "pipeline: {stages: 2, microbatches: true}\n")
    with pytest.raises(ValidationError) as excinfo:
        load_spec(path)
    assert _locs(excinfo) == [("pipeline", "microbatches")]
    assert "valid integer" in str(excinfo.value)


@pytest.mark.parametrize("key", [True, 1.0])
def test_dynamic_dim_index_must_be_an_int(key: object) -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"trace": {"dynamic_dims": {"x": {key: "batch"}}}})
    assert "dynamic_dims.x: dim index" in str(excinfo.value)


@pytest.mark.parametrize(("kind", "field", "good"), [("moving_average", "momentum", 1),
                                                     ("percentile", "percentile", 99)])
def test_float_fields_take_ints_but_not_bools(kind: str, field: str, good: int) -> None:
    def spec(v: object) -> dict:
        return {"quant": {"mode": "static", "rules": [{"match": {"op": "add"}, "activation": {
            "observer": {"kind": kind, field: v}}}]}}

    rule = CompileSpec.model_validate(spec(good)).quant.rules[0]
    assert getattr(rule.activation.observer, field) == float(good)
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate(spec(True))
    assert _locs(excinfo)[0][-1] == field


def test_concrete_args_keep_their_bools() -> None:
    # A forward() argument may well be a bool: there `true` stays True.
    spec = CompileSpec.model_validate({"trace": {"concrete_args": {"use_cache": True, "n": 1}}})
    assert spec.trace.concrete_args["use_cache"] is True
    assert spec.trace.concrete_args["n"] == 1 and spec.trace.concrete_args["n"] is not True


# ---------------------------------------------------------------------------------------
# quant.mode none with rules / inputs


def test_mode_none_with_rules_is_an_error() -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"quant": {"mode": "none", "rules": [ADD]}})
    msg = str(excinfo.value)
    assert _locs(excinfo) == [("quant",)]
    assert "quant.rules" in msg and "would be ignored" in msg
    assert "set quant.mode to static, qat or dynamic, or remove quant.rules" in msg


def test_default_mode_with_rules_is_an_error(tmp_path: Path) -> None:
    # Forgetting `mode:` altogether is the same mistake.
    path = _write(tmp_path, "s.yaml", "quant:\n  rules:\n    - match: {op: add}\n"
                  "      activation: {dtype: uint8}\n")
    with pytest.raises(ValidationError, match=r"quant\.rules"):
        load_spec(path)


def test_mode_none_with_inputs_is_an_error() -> None:
    with pytest.raises(ValidationError, match=r"quant\.inputs: quant\.mode is none"):
        QuantSpec.model_validate({"mode": "none", "inputs": {"dtype": "int8"}})


def test_mode_none_without_rules_is_fine() -> None:
    assert QuantSpec.model_validate({"mode": "none", "rules": []}).rules == []


@pytest.mark.parametrize("name", sorted(presets()))
def test_presets_still_load(name: str) -> None:
    assert load_spec(name).quant.mode != "none"


def _yaml_blocks(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    blocks = text.split("```yaml\n")[1:]
    return [b.split("```", 1)[0] for b in blocks]


@pytest.mark.parametrize("doc", ["README.md", "docs/concepts/spec.md"])
def test_documented_specs_validate(doc: str) -> None:
    """Every YAML spec example of the page that is a whole spec still validates."""
    checked = 0
    for block in _yaml_blocks(ROOT / doc):
        data = yaml.safe_load(block)
        if isinstance(data, dict) and data.get("version") == 1:
            CompileSpec.model_validate(data)
            checked += 1
    assert checked >= 1


# ---------------------------------------------------------------------------------------
# load_spec arguments and preset names


@pytest.mark.parametrize("arg", [None, 3, 2.5, b"int8-qat", ["int8-qat"]])
def test_load_spec_refuses_other_argument_types(arg: object) -> None:
    with pytest.raises(QCompileError) as excinfo:
        load_spec(arg)  # type: ignore[arg-type]
    msg = str(excinfo.value)
    assert f"got {type(arg).__name__}" in msg
    assert "a spec file path (str or pathlib.Path), a preset name, a dict or a CompileSpec" \
        in msg


def test_load_spec_takes_dicts_and_specs() -> None:
    spec = load_spec({"quant": {"mode": "static", "rules": [ADD]}})
    assert spec.quant.mode == "static"
    assert load_spec(spec) is spec


def test_load_spec_refuses_an_empty_string() -> None:
    with pytest.raises(QCompileError, match="empty string"):
        load_spec("")


@pytest.mark.parametrize(("typo", "meant"), [("int8-qta", "int8-qat"),
                                             ("int8_static", "int8-static"),
                                             ("w4a8qat", "w4a8-qat")])
def test_mistyped_preset_names_the_nearest(typo: str, meant: str) -> None:
    with pytest.raises(QCompileError) as excinfo:
        load_spec(typo)
    assert f"did you mean {meant!r}?" in str(excinfo.value)


def test_far_off_name_suggests_nothing() -> None:
    with pytest.raises(QCompileError) as excinfo:
        load_spec("my-spec.yaml")
    assert "did you mean" not in str(excinfo.value)
    assert "int8-qat" in excinfo.value.fix
