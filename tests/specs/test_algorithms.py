"""``quant.algorithms``: a discriminated list of implemented PTQ rewrites, validated
without torch: unknown kinds list the valid ones, bad parameters and modes name the field
and the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qcompile.specs import ALGORITHM_KINDS, CompileSpec, CrossLayerEqualization, SmoothQuant


def quant(mode: str = "static", **fields) -> dict:
    q = {"mode": mode, **fields}
    if mode != "none":
        q.setdefault("rules", [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}])
    return {"quant": q}


def test_default_is_empty():
    assert CompileSpec.model_validate(quant()).quant.algorithms == []


def test_entries_in_order_with_defaults():
    s = CompileSpec.model_validate(quant(algorithms=[
        {"kind": "smoothquant"}, {"kind": "cross_layer_equalization"},
        {"kind": "smoothquant", "alpha": 1}]))
    assert s.quant.algorithms == [SmoothQuant(alpha=0.5), CrossLayerEqualization(),
                                  SmoothQuant(alpha=1.0)]
    assert ALGORITHM_KINDS == ("cross_layer_equalization", "smoothquant")


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_ptq_modes_accept(mode):
    s = CompileSpec.model_validate(quant(mode, algorithms=[{"kind": "smoothquant"}]))
    assert s.quant.algorithms[0].kind == "smoothquant"


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant(algorithms=[{"kind": "gptq"}]))
    text = str(info.value)
    assert "quant.algorithms.0" in text and "'gptq'" in text
    assert "'cross_layer_equalization', 'smoothquant'" in text


@pytest.mark.parametrize("alpha", [-0.1, 1.5, True, "0.5", None])
def test_alpha_outside_0_1_or_not_a_number(alpha):
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant(algorithms=[{"kind": "smoothquant", "alpha": alpha}]))
    assert "quant.algorithms.0.smoothquant.alpha" in str(info.value)


@pytest.mark.parametrize("entry", [
    {"kind": "smoothquant", "alpa": 0.5},
    {"kind": "cross_layer_equalization", "alpha": 0.5},
    {"alpha": 0.5},
])
def test_unknown_keys_and_missing_kind(entry):
    with pytest.raises(ValidationError):
        CompileSpec.model_validate(quant(algorithms=[entry]))


def test_mode_none_is_refused():
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant("none", algorithms=[
            {"kind": "cross_layer_equalization"}]))
    assert ("quant.algorithms[0] (cross_layer_equalization): PTQ algorithms prepare weights "
            "for quantization, and mode none quantizes nothing") in str(info.value)


@pytest.mark.parametrize("mode", ["static", "dynamic", "qat"])
def test_function_preserving_rewrites_serve_every_quantizing_mode(mode):
    """CLE and SmoothQuant keep the float function: they prepare PTQ and give QAT a better
    start (the DESIGN.md spec example runs them with mode: qat)."""
    s = CompileSpec.model_validate(quant(mode, algorithms=[
        {"kind": "cross_layer_equalization"}, {"kind": "smoothquant", "alpha": 0.5}]))
    assert [a.kind for a in s.quant.algorithms] == ["cross_layer_equalization", "smoothquant"]


def test_frozen():
    s = CompileSpec.model_validate(quant(algorithms=[{"kind": "smoothquant"}]))
    with pytest.raises(ValidationError):
        s.quant.algorithms[0].alpha = 0.9  # type: ignore[misc]
