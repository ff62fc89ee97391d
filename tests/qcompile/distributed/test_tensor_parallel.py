"""``qcompile.distributed.tensor_parallel``'s checks that need no process group: the mesh
a spec lays out on a world size, and what ``compile_once`` refuses with a
``tensor_parallel`` section (every rank raises it before any communication)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qcompile as qc
from qcompile.distributed.once import _across
from qcompile.distributed.tensor_parallel import (
    mesh_dims,
    refuse_differing_tp_batches,
    refuse_tensor_parallel_once,
)


def spec(**extra: Any) -> Any:
    d = qc.load_spec("int8-static").model_dump()
    d["tensor_parallel"] = {"size": 2}
    d.update(extra)
    return qc.specs.as_spec(d)


@pytest.mark.parametrize(("extra", "world", "dims"), [
    ({}, 2, {"tp": 2}),
    ({"data_parallel": {"kind": "fsdp2"}}, 8, {"dp": 4, "tp": 2}),
    ({"pipeline": {"stages": 2}}, 4, {"pp": 2, "tp": 2}),
    ({"pipeline": {"stages": 2}, "data_parallel": {"kind": "fsdp2"}}, 8,
     {"pp": 2, "dp": 2, "tp": 2}),
])
def test_mesh_dims(extra: dict[str, Any], world: int, dims: dict[str, int]) -> None:
    got = mesh_dims(spec(**extra), world)
    assert got == dims and list(got) == [d for d in ("pp", "dp", "tp") if d in dims]
    assert world == torch.tensor(list(got.values())).prod().item()


@pytest.mark.parametrize(("extra", "world", "field"), [
    ({}, 3, "multiple of 2"),
    ({}, 4, "fsdp2"),
    ({"data_parallel": {"kind": "ddp"}}, 4, "fsdp2"),
    ({"data_parallel": {"kind": "fsdp2"}}, 2, "none"),
])
def test_mesh_dims_refuses(extra: dict[str, Any], world: int, field: str) -> None:
    with pytest.raises(qc.QCompileError) as e:
        mesh_dims(spec(**extra), world)
    assert field in e.value.fix


def test_compile_once_refusals_name_the_fix() -> None:
    with pytest.raises(qc.QCompileError) as e:
        refuse_tensor_parallel_once(spec(pipeline={"stages": 2}), None)
    assert "qc.distributed.pipeline" in e.value.fix
    with pytest.raises(qc.QCompileError) as e:
        refuse_tensor_parallel_once(spec(), group=object())
    assert "group" in e.value.message
    qlora = qc.load_spec("qlora-nf4").model_dump()
    refuse_tensor_parallel_once(spec(), None)  # nothing to refuse
    refuse_tensor_parallel_once(spec(adapters=qlora["adapters"]), None)  # frozen bases too


def test_tp_groups_must_calibrate_on_one_batch() -> None:
    refuse_differing_tp_batches(["a", "a", "b", "b"], 2)  # two replicas, each its own
    refuse_differing_tp_batches([None, None], 2)  # no calibration
    with pytest.raises(qc.QCompileError) as e:
        refuse_differing_tp_batches(["a", "a", "b", "c"], 2)
    assert "ranks 2 and 3" in e.value.message


def test_columns_only_when_a_shard_cuts_across_rows() -> None:
    shape = torch.Size([8, 6])
    assert _across(None, shape) is None
    assert _across((slice(0, 4), slice(0, 6)), shape) is None  # FSDP2's rows: one range
    assert _across((slice(4, 8), slice(3, 6)), shape) == (slice(None), slice(3, 6))
