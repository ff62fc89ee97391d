"""The ``tensor_parallel`` section: what it accepts and what it refuses, by field."""

from __future__ import annotations

import pydantic
import pytest

import qcompile as qc


def test_defaults_and_a_named_plan() -> None:
    spec = qc.specs.as_spec({"tensor_parallel": {"size": 4}})
    assert spec.tensor_parallel.size == 4 and spec.tensor_parallel.plan == "auto"
    plan = {"*.q_proj": "colwise", "*.o_proj": "rowwise", "lm_head": "replicate"}
    spec = qc.specs.as_spec({"tensor_parallel": {"size": 2, "plan": plan}})
    assert spec.tensor_parallel.plan == plan
    assert qc.specs.as_spec({}).tensor_parallel is None


@pytest.mark.parametrize(("section", "field"), [
    ({"size": 0}, "tensor_parallel.size"),
    ({"size": 2.0}, "tensor_parallel.size"),
    ({}, "tensor_parallel.size"),
    ({"size": 2, "plan": {}}, "tensor_parallel.plan"),
    ({"size": 2, "plan": {"*.q_proj": "columnwise"}}, "tensor_parallel.plan"),
    ({"size": 2, "plan": "manual"}, "tensor_parallel.plan"),
    ({"size": 2, "mesh": "tp"}, "tensor_parallel.mesh"),
])
def test_mistakes_name_the_field(section: dict, field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as e:
        qc.specs.as_spec({"tensor_parallel": section})
    where = {".".join(str(p) for p in err["loc"][:2]) for err in e.value.errors()}
    assert field in where, e.value
