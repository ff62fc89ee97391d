"""Every float field of a spec is a finite number: ``.inf`` and ``.nan`` (YAML) are
refused at the field's location, for every spec model, so a new float field cannot slip
through (``reg_weight: .inf`` would otherwise run AdaRound with an infinite loss)."""

from __future__ import annotations

import inspect
import math

import pytest
from pydantic import ValidationError

import qcompile.specs as specs
import qcompile.specs.adapters as adapter_specs
import qcompile.specs.compile as compile_specs
import qcompile.specs.quant as quant_specs
from qcompile.specs import CompileSpec
from qcompile.specs.quant import Frozen


def _float_fields() -> list[tuple[type[Frozen], str]]:
    out = []
    classes = {c for m in (specs, adapter_specs, compile_specs, quant_specs)
               for _, c in inspect.getmembers(m, inspect.isclass) if issubclass(c, Frozen)}
    for cls in sorted(classes, key=lambda c: c.__name__):
        for name, info in cls.model_fields.items():
            if info.annotation is float:
                out.append((cls, name))
    return out


FIELDS = _float_fields()


def test_the_audit_sees_the_known_float_fields() -> None:
    names = {f"{cls.__name__}.{name}" for cls, name in FIELDS}
    assert {"MovingAverageObserver.momentum", "PercentileObserver.percentile",
            "SmoothQuant.alpha", "AdaRound.reg_weight", "AdaRound.lr", "AdaRound.warmup",
            "GPTQ.damp", "AdapterSpec.alpha", "AdapterSpec.dropout"} <= names


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize(("cls", "name"), FIELDS,
                         ids=[f"{c.__name__}.{n}" for c, n in FIELDS])
def test_non_finite_float_refused(cls: type[Frozen], name: str, value: float) -> None:
    with pytest.raises(ValidationError) as info:
        cls.model_validate({name: value})
    # (a model with required fields, AdapterSpec's match, also reports those as missing)
    assert [tuple(e["loc"]) for e in info.value.errors() if e["type"] != "missing"] == [(name,)]


def test_infinite_reg_weight_in_a_spec_names_the_field() -> None:
    # what YAML's `reg_weight: .inf` loads as
    spec = {"quant": {"mode": "static",
                      "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}],
                      "algorithms": [{"kind": "adaround", "reg_weight": math.inf}]}}
    with pytest.raises(ValidationError) as info:
        CompileSpec.model_validate(spec)
    (err,) = info.value.errors()
    assert err["loc"] == ("quant", "algorithms", 0, "adaround", "reg_weight")
    assert err["type"] == "finite_number"


def test_finite_values_still_accepted() -> None:
    assert specs.AdaRound(reg_weight=1e6).reg_weight == 1e6
    assert specs.SmoothQuant(alpha=1).alpha == 1.0
