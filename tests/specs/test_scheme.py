"""Validation of the ``quant`` section: Scheme, observers, Match, Rule, QuantSpec."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qcompile.specs import DTYPES, FP8_MAX, CompileSpec, Match, QuantSpec, Rule, Scheme
from qcompile.specs.quant import (
    BLOCK_DTYPES,
    FLOAT_DTYPES,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageObserver,
    MseObserver,
    PercentileObserver,
)

LINEAR = {"module": "Linear"}


def _errors(excinfo: pytest.ExceptionInfo[ValidationError]) -> list[dict]:
    return excinfo.value.errors()


def _locs(excinfo: pytest.ExceptionInfo[ValidationError]) -> list[tuple]:
    return [tuple(e["loc"]) for e in _errors(excinfo)]


# ---------------------------------------------------------------------------------------
# Scheme: defaults and dtypes


def test_scheme_defaults() -> None:
    s = Scheme()
    assert s.dtype == "int8"
    assert s.symmetric is True
    assert s.granularity == "per_tensor"
    assert s.axis is None
    assert s.group_size is None
    assert s.observer == MinMaxObserver()
    assert s.learnable is False
    assert s.is_float is False


def test_dtypes_cover_the_documented_range() -> None:
    expected = {f"int{b}" for b in range(2, 17)} | {f"uint{b}" for b in range(2, 17)}
    expected |= {"fp8_e4m3", "fp8_e5m2"}
    expected |= {"mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4", "nf4"}
    expected |= {"q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "q8_k"}  # llama.cpp's grids
    assert set(DTYPES) == expected
    assert len(DTYPES) == len(set(DTYPES))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_is_accepted(dtype: str) -> None:
    assert Scheme(dtype=dtype).dtype == dtype


@pytest.mark.parametrize(
    "dtype", ["int1", "int17", "uint1", "uint17", "int32", "float8", "fp8", "fp16", "INT8", ""]
)
def test_bad_dtype_rejected(dtype: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(dtype=dtype)
    assert _locs(excinfo) == [("dtype",)]
    assert _errors(excinfo)[0]["type"] == "literal_error"


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("int2", (-2, 1)),
        ("int4", (-8, 7)),
        ("int8", (-128, 127)),
        ("int16", (-32768, 32767)),
        ("uint2", (0, 3)),
        ("uint4", (0, 15)),
        ("uint8", (0, 255)),
        ("uint16", (0, 65535)),
        ("fp8_e4m3", (-448, 448)),
        ("fp8_e5m2", (-57344, 57344)),
    ],
)
def test_qrange(dtype: str, expected: tuple[int, int]) -> None:
    assert Scheme(dtype=dtype).qrange() == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_qrange_shape(dtype: str) -> None:
    lo, hi = Scheme(dtype=dtype).qrange()
    assert isinstance(lo, int)
    assert isinstance(hi, int)
    if dtype in FLOAT_DTYPES:
        assert (lo, hi) == (-int(FP8_MAX[dtype]), int(FP8_MAX[dtype]))
        assert Scheme(dtype=dtype).is_float
    elif dtype in BLOCK_DTYPES:  # the element format's largest magnitude, rounded up
        assert lo == -hi and hi >= 1
        assert Scheme(dtype=dtype).is_block and not Scheme(dtype=dtype).is_float
    else:
        bits = int(dtype.removeprefix("u").removeprefix("int"))
        assert hi - lo + 1 == 2**bits
        assert lo == (0 if dtype.startswith("u") else -(2 ** (bits - 1)))
        assert not Scheme(dtype=dtype).is_float


# ---------------------------------------------------------------------------------------
# Scheme: granularity fields


def test_per_group_needs_group_size() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(granularity="per_group")
    assert "group_size" in str(excinfo.value)
    assert "per_group" in str(excinfo.value)


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel", "per_token"])
def test_group_size_without_per_group(granularity: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(granularity=granularity, group_size=32)
    msg = str(excinfo.value)
    assert "group_size is only used with granularity per_group" in msg
    assert granularity in msg


@pytest.mark.parametrize("granularity", ["per_tensor", "per_group", "per_token"])
def test_axis_without_per_channel(granularity: str) -> None:
    extra = {"group_size": 16} if granularity == "per_group" else {}
    with pytest.raises(ValidationError) as excinfo:
        Scheme(granularity=granularity, axis=0, **extra)
    msg = str(excinfo.value)
    assert "axis is only used with granularity per_channel" in msg
    assert granularity in msg


@pytest.mark.parametrize("axis", [0, 1, -1, 3])
def test_per_channel_axis_accepted(axis: int) -> None:
    s = Scheme(granularity="per_channel", axis=axis)
    assert s.axis == axis


def test_per_channel_without_axis_accepted() -> None:
    assert Scheme(granularity="per_channel").axis is None


@pytest.mark.parametrize("group_size", [0, -1, -32])
def test_group_size_must_be_positive(group_size: int) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(granularity="per_group", group_size=group_size)
    assert ("group_size",) in _locs(excinfo)


def test_per_group_with_group_size_accepted() -> None:
    s = Scheme(dtype="int4", granularity="per_group", group_size=32)
    assert s.group_size == 32
    assert s.qrange() == (-8, 7)


def test_unknown_granularity_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(granularity="per_row")
    assert ("granularity",) in _locs(excinfo)


# ---------------------------------------------------------------------------------------
# Scheme: fp8 and learnable


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fp8_asymmetric_rejected(dtype: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(dtype=dtype, symmetric=False)
    msg = str(excinfo.value)
    assert dtype in msg
    assert "symmetric" in msg


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fp8_learnable_rejected(dtype: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(dtype=dtype, learnable=True)
    msg = str(excinfo.value)
    assert "learnable" in msg
    assert dtype in msg


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fp8_symmetric_accepted(dtype: str) -> None:
    s = Scheme(dtype=dtype, symmetric=True, granularity="per_channel")
    assert s.is_float


def test_learnable_int_scheme_accepted_alone() -> None:
    # A Scheme on its own does not know the mode; QuantSpec checks it.
    assert Scheme(dtype="int4", learnable=True).learnable


# ---------------------------------------------------------------------------------------
# Observers


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("minmax", MinMaxObserver),
        ("moving_average", MovingAverageObserver),
        ("histogram", HistogramObserver),
        ("percentile", PercentileObserver),
        ("mse", MseObserver),
    ],
)
def test_observer_short_form_equals_long_form(kind: str, cls: type) -> None:
    short = Scheme(observer=kind)
    long = Scheme(observer={"kind": kind})
    assert short == long
    assert isinstance(short.observer, cls)
    assert short.observer == cls()


def test_observer_moving_average_short_and_long_with_default_momentum() -> None:
    short = Scheme(observer="moving_average")
    long = Scheme(observer={"kind": "moving_average", "momentum": 0.01})
    assert short == long
    assert short.observer.momentum == 0.01


def test_observer_params_kept() -> None:
    s = Scheme(observer={"kind": "histogram", "bins": 256})
    assert s.observer == HistogramObserver(bins=256)
    s = Scheme(observer={"kind": "percentile", "percentile": 99.9})
    assert s.observer.percentile == 99.9
    s = Scheme(observer={"kind": "mse", "steps": 10})
    assert s.observer.steps == 10


@pytest.mark.parametrize("observer", ["ema", {"kind": "ema"}, "MinMax", {"kind": ""}])
def test_observer_unknown_kind_rejected(observer: object) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(observer=observer)
    assert all(loc[0] == "observer" for loc in _locs(excinfo))
    assert "minmax" in str(excinfo.value)  # the error lists the known kinds


def test_observer_dict_without_kind_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(observer={"momentum": 0.1})
    assert _locs(excinfo)[0][0] == "observer"
    assert "kind" in str(excinfo.value)


@pytest.mark.parametrize("momentum", [0.0, -0.1, 1.0001, 2.0])
def test_moving_average_momentum_out_of_range(momentum: float) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(observer={"kind": "moving_average", "momentum": momentum})
    assert _locs(excinfo) == [("observer", "moving_average", "momentum")]


@pytest.mark.parametrize("momentum", [1e-9, 0.5, 1.0])
def test_moving_average_momentum_in_range(momentum: float) -> None:
    s = Scheme(observer={"kind": "moving_average", "momentum": momentum})
    assert s.observer.momentum == momentum


@pytest.mark.parametrize(
    ("observer", "field"),
    [
        ({"kind": "histogram", "bins": 8}, "bins"),
        ({"kind": "histogram", "bins": 100000}, "bins"),
        ({"kind": "percentile", "percentile": 50.0}, "percentile"),
        ({"kind": "percentile", "percentile": 100.5}, "percentile"),
        ({"kind": "mse", "steps": 1}, "steps"),
    ],
)
def test_observer_params_out_of_range(observer: dict, field: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(observer=observer)
    assert _locs(excinfo) == [("observer", observer["kind"], field)]


@pytest.mark.parametrize(
    "observer",
    [
        {"kind": "minmax", "momentum": 0.1},  # a param of another kind
        {"kind": "moving_average", "averaging": 0.1},
        {"kind": "histogram", "bins": 64, "extra": 1},
    ],
)
def test_observer_dict_unknown_key_rejected(observer: dict) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme(observer=observer)
    errors = _errors(excinfo)
    assert errors[0]["type"] == "extra_forbidden"
    bad = next(k for k in observer if k not in ("kind", "bins"))
    assert errors[0]["loc"][-1] == bad
    assert bad in str(excinfo.value)


# ---------------------------------------------------------------------------------------
# Unknown keys and frozen


def test_scheme_unknown_key_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Scheme.model_validate({"dtype": "int8", "bits": 8})
    assert _locs(excinfo) == [("bits",)]
    assert _errors(excinfo)[0]["type"] == "extra_forbidden"


def test_match_unknown_key_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Match.model_validate({"module": "Linear", "names": "x"})
    assert _locs(excinfo) == [("names",)]


def test_rule_unknown_key_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Rule.model_validate({"match": LINEAR, "skip": True, "priority": 1})
    assert _locs(excinfo) == [("priority",)]


def test_quant_unknown_key_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        QuantSpec.model_validate({"mode": "qat", "fold_batchnorm": True})
    assert _locs(excinfo) == [("fold_batchnorm",)]


def test_unknown_keys_nested_path_in_compile_spec() -> None:
    data = {
        "quant": {
            "mode": "static",
            "rules": [
                {"match": {"module": "Linear"}, "skip": True},
                {
                    "match": {"module": "Conv2d"},
                    "weight": {"dtype": "int8", "observer": {"kind": "minmax", "foo": 1}},
                },
            ],
        }
    }
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate(data)
    assert _locs(excinfo) == [("quant", "rules", 1, "weight", "observer", "minmax", "foo")]
    assert "foo" in str(excinfo.value)


def test_scheme_is_frozen() -> None:
    s = Scheme()
    with pytest.raises(ValidationError) as excinfo:
        s.dtype = "int4"  # type: ignore[misc]
    assert _errors(excinfo)[0]["type"] == "frozen_instance"
    assert s.dtype == "int8"


def test_observer_is_frozen() -> None:
    s = Scheme(observer="moving_average")
    with pytest.raises(ValidationError):
        s.observer.momentum = 0.5  # type: ignore[misc]


def test_rule_and_match_are_frozen() -> None:
    r = Rule(match=LINEAR, skip=True)
    with pytest.raises(ValidationError):
        r.skip = False  # type: ignore[misc]
    with pytest.raises(ValidationError):
        r.match.module = ["Conv2d"]  # type: ignore[misc]


def test_equal_schemes_hash_equal() -> None:
    assert hash(Scheme(dtype="int4")) == hash(Scheme(dtype="int4"))


# ---------------------------------------------------------------------------------------
# Match


@pytest.mark.parametrize("field", ["module", "name", "op"])
def test_match_string_coerced_to_list(field: str) -> None:
    m = Match.model_validate({field: "x*"})
    assert getattr(m, field) == ["x*"]
    assert m == Match.model_validate({field: ["x*"]})


def test_match_list_kept() -> None:
    m = Match(module=["Conv2d", "Linear"], op=["add"])
    assert m.module == ["Conv2d", "Linear"]
    assert m.op == ["add"]
    assert m.name is None


@pytest.mark.parametrize("data", [{}, {"module": None}, {"module": [], "name": [], "op": []}])
def test_empty_match_rejected(data: dict) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Match.model_validate(data)
    assert "at least one of module, name, op" in str(excinfo.value)


def test_empty_match_in_rule_names_the_path() -> None:
    with pytest.raises(ValidationError) as excinfo:
        QuantSpec.model_validate({"rules": [{"match": {}, "skip": True}]})
    assert _locs(excinfo) == [("rules", 0, "match")]


@pytest.mark.parametrize("value", [1, {"a": 1}, [1, 2]])
def test_match_non_string_rejected(value: object) -> None:
    with pytest.raises(ValidationError):
        Match.model_validate({"module": value})


# ---------------------------------------------------------------------------------------
# Rule


def test_skip_rule() -> None:
    r = Rule(match={"name": "head"}, skip=True)
    assert r.skip
    assert r.weight is None
    assert r.activation is None
    assert r.optional is False


@pytest.mark.parametrize("role", ["weight", "activation"])
def test_skip_rule_with_scheme_rejected(role: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        Rule.model_validate({"match": LINEAR, "skip": True, role: {"dtype": "int8"}})
    assert "a skip rule takes no weight/activation scheme" in str(excinfo.value)


def test_non_skip_rule_without_schemes_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Rule.model_validate({"match": LINEAR})
    assert "weight and/or activation" in str(excinfo.value)
    assert "skip" in str(excinfo.value)


def test_rule_without_match_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Rule.model_validate({"skip": True})
    assert _locs(excinfo) == [("match",)]
    assert _errors(excinfo)[0]["type"] == "missing"


def test_rule_with_default_scheme_accepted() -> None:
    # `weight: {}` is a full int8 per-tensor scheme, not "no scheme".
    r = Rule.model_validate({"match": LINEAR, "weight": {}})
    assert r.weight == Scheme()


def test_per_token_weight_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Rule.model_validate({"match": LINEAR, "weight": {"granularity": "per_token"}})
    msg = str(excinfo.value)
    assert "weight" in msg
    assert "per_token" in msg


def test_per_group_activation_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Rule.model_validate(
            {"match": LINEAR, "activation": {"granularity": "per_group", "group_size": 8}}
        )
    msg = str(excinfo.value)
    assert "activation" in msg
    assert "per_group" in msg


def test_per_token_activation_and_per_group_weight_accepted() -> None:
    r = Rule.model_validate(
        {
            "match": LINEAR,
            "weight": {"dtype": "int4", "granularity": "per_group", "group_size": 32},
            "activation": {"dtype": "int8", "symmetric": False, "granularity": "per_token"},
        }
    )
    assert r.weight.group_size == 32
    assert r.activation.granularity == "per_token"


def test_scheme_error_inside_rule_names_the_path() -> None:
    with pytest.raises(ValidationError) as excinfo:
        QuantSpec.model_validate(
            {"rules": [{"match": LINEAR, "weight": {"granularity": "per_group"}}]}
        )
    assert _locs(excinfo) == [("rules", 0, "weight")]
    assert "group_size" in str(excinfo.value)


# ---------------------------------------------------------------------------------------
# QuantSpec


def test_quant_defaults() -> None:
    q = QuantSpec()
    assert q.mode == "none"
    assert q.rules == []
    assert q.inputs is None
    assert q.fold_bn is True
    assert q.sync_observers is True


@pytest.mark.parametrize("mode", ["none", "dynamic", "static", "qat"])
def test_modes_accepted(mode: str) -> None:
    assert QuantSpec(mode=mode).mode == mode


@pytest.mark.parametrize("mode", ["QAT", "ptq", "", "train"])
def test_bad_mode_rejected(mode: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        QuantSpec(mode=mode)
    assert _locs(excinfo) == [("mode",)]


@pytest.mark.parametrize("mode", ["none", "dynamic", "static"])
@pytest.mark.parametrize("role", ["weight", "activation"])
def test_learnable_outside_qat_rejected(mode: str, role: str) -> None:
    rules = [
        {"match": {"name": "head"}, "skip": True},
        {"match": LINEAR, role: {"dtype": "int8", "learnable": True}},
    ]
    with pytest.raises(ValidationError) as excinfo:
        QuantSpec.model_validate({"mode": mode, "rules": rules})
    msg = str(excinfo.value)
    assert f"rules[1].{role}.learnable" in msg
    assert f"mode is {mode}" in msg
    assert "qat" in msg


def test_learnable_inputs_outside_qat_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        QuantSpec.model_validate({"mode": "static", "inputs": {"learnable": True}})
    msg = str(excinfo.value)
    assert "inputs.learnable" in msg
    assert "mode is static" in msg


def test_learnable_error_path_inside_compile_spec() -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate(
            {"quant": {"rules": [{"match": LINEAR, "weight": {"learnable": True}}]}}
        )
    assert _locs(excinfo) == [("quant",)]
    assert "learnable" in str(excinfo.value)
    assert "mode is none" in str(excinfo.value)


def test_learnable_in_qat_accepted() -> None:
    q = QuantSpec.model_validate(
        {
            "mode": "qat",
            "rules": [{"match": LINEAR, "weight": {"dtype": "int4", "learnable": True}}],
            "inputs": {"dtype": "uint8", "symmetric": False, "learnable": True},
        }
    )
    assert q.rules[0].weight.learnable
    assert q.inputs.learnable


def test_rules_order_kept() -> None:
    rules = [
        {"match": {"name": "head"}, "skip": True},
        {"match": LINEAR, "weight": {"dtype": "int4", "granularity": "per_group",
                                     "group_size": 32}},
        {"match": {"op": ["add", "cat"]}, "activation": {"dtype": "uint8",
                                                          "symmetric": False},
         "optional": True},
    ]
    q = QuantSpec.model_validate({"mode": "qat", "rules": rules})
    assert [r.skip for r in q.rules] == [True, False, False]
    assert q.rules[1].weight.dtype == "int4"
    assert q.rules[2].match.op == ["add", "cat"]
    assert q.rules[2].optional


def test_quant_is_frozen() -> None:
    q = QuantSpec(mode="qat")
    with pytest.raises(ValidationError):
        q.mode = "static"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------
# Property: any valid scheme survives a dump/validate round trip


def block_scheme_dict(draw: st.DrawFn, dtype: str) -> dict:
    """A valid block-format scheme: granularity and block size implied, NF4's overridable."""
    d: dict = {"dtype": dtype}
    if draw(st.booleans()):
        d["granularity"] = "per_group"
    if dtype == "nf4" and draw(st.booleans()):
        d["group_size"] = 2 * draw(st.integers(1, 512))
    return d


@st.composite
def scheme_dicts(draw: st.DrawFn) -> dict:
    dtype = draw(st.sampled_from(DTYPES))
    d: dict = {"dtype": dtype}
    if dtype in BLOCK_DTYPES:
        return block_scheme_dict(draw, dtype)
    if dtype in FLOAT_DTYPES:
        if draw(st.booleans()):
            d["symmetric"] = True
    else:
        d["symmetric"] = draw(st.booleans())
        if draw(st.booleans()):
            d["learnable"] = draw(st.booleans())
    g = draw(st.sampled_from(["per_tensor", "per_channel", "per_group", "per_token"]))
    d["granularity"] = g
    if g == "per_channel" and draw(st.booleans()):
        d["axis"] = draw(st.integers(-4, 4))
    if g == "per_group":
        d["group_size"] = draw(st.integers(1, 4096))
    kind = draw(st.sampled_from(["minmax", "moving_average", "histogram", "percentile", "mse"]))
    d["observer"] = draw(st.sampled_from([kind, {"kind": kind}]))
    return d


@given(scheme_dicts())
@settings(deadline=None)
def test_scheme_dump_validate_round_trip(d: dict) -> None:
    s = Scheme.model_validate(d)
    assert Scheme.model_validate(s.model_dump()) == s
    assert Scheme.model_validate_json(s.model_dump_json()) == s
    assert s.dtype == d["dtype"]
    lo, hi = s.qrange()
    assert lo < 0 < hi or (lo == 0 and hi > 0)
