"""``quant.algorithms``: a discriminated list of implemented PTQ rewrites, validated
without torch: unknown kinds list the valid ones, bad parameters and modes name the field
and the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qcompile.specs import (
    ALGORITHM_KINDS,
    GPTQ,
    AdaRound,
    BiasCorrection,
    CompileSpec,
    CrossLayerEqualization,
    SmoothQuant,
)


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
    assert ALGORITHM_KINDS == ("cross_layer_equalization", "smoothquant", "bias_correction",
                               "adaround", "gptq")


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_ptq_modes_accept(mode):
    s = CompileSpec.model_validate(quant(mode, algorithms=[{"kind": "smoothquant"}]))
    assert s.quant.algorithms[0].kind == "smoothquant"


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant(algorithms=[{"kind": "awq"}]))
    text = str(info.value)
    assert "quant.algorithms.0" in text and "'awq'" in text
    assert "'cross_layer_equalization', 'smoothquant', 'bias_correction'" in text


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


def test_data_algorithms_defaults():
    s = CompileSpec.model_validate(quant(algorithms=[
        {"kind": "cross_layer_equalization"}, {"kind": "gptq"}, {"kind": "bias_correction"}]))
    assert s.quant.algorithms[1] == GPTQ(block_size=128, damp=0.01, act_order=False)
    assert s.quant.algorithms[2] == BiasCorrection()
    a = CompileSpec.model_validate(quant(algorithms=[{"kind": "adaround", "iterations": 50}]))
    assert a.quant.algorithms[0] == AdaRound(iterations=50, reg_weight=3.0, lr=0.05, warmup=0.2)


@pytest.mark.parametrize(("entry", "field"), [
    ({"kind": "gptq", "block_size": 0}, "gptq.block_size"),
    ({"kind": "gptq", "damp": 0}, "gptq.damp"),
    ({"kind": "gptq", "damp": 2.0}, "gptq.damp"),
    ({"kind": "gptq", "act_order": "yes"}, "gptq.act_order"),
    ({"kind": "gptq", "block_size": 2.0}, "gptq.block_size"),
    ({"kind": "adaround", "iterations": 0}, "adaround.iterations"),
    ({"kind": "adaround", "warmup": 1.0}, "adaround.warmup"),
    ({"kind": "adaround", "lr": -1e-3}, "adaround.lr"),
    ({"kind": "bias_correction", "alpha": 0.5}, "bias_correction.alpha"),
])
def test_data_algorithm_bad_parameters_name_the_field(entry, field):
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant(algorithms=[entry]))
    assert f"quant.algorithms.0.{field}" in str(info.value)


@pytest.mark.parametrize("kind", ["bias_correction", "adaround", "gptq"])
def test_data_algorithms_refused_in_qat(kind):
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant("qat", algorithms=[{"kind": kind}]))
    text = str(info.value)
    assert f"quant.algorithms[0] ({kind})" in text and "QAT training moves them" in text
    assert "quant.mode static or dynamic" in text


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_data_algorithms_accepted_in_ptq_modes(mode):
    s = CompileSpec.model_validate(quant(mode, algorithms=[{"kind": "gptq"},
                                                           {"kind": "bias_correction"}]))
    assert [a.kind for a in s.quant.algorithms] == ["gptq", "bias_correction"]


def test_rewrite_after_a_data_algorithm_is_refused():
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant(algorithms=[{"kind": "gptq"}, {"kind": "smoothquant"}]))
    assert ("quant.algorithms[1] (smoothquant) comes after quant.algorithms[0] (gptq)"
            in str(info.value)) and "list it first" in str(info.value)


def test_two_rounding_algorithms_are_refused():
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant(algorithms=[{"kind": "adaround"}, {"kind": "gptq"}]))
    assert "keep one of adaround and gptq" in str(info.value)


def test_a_data_algorithm_listed_twice_is_refused():
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(quant(algorithms=[{"kind": "bias_correction"},
                                                     {"kind": "bias_correction"}]))
    assert "quant.algorithms[1] (bias_correction) is listed twice" in str(info.value)
