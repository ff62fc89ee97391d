"""``qc.convert`` of a sharded graph. A ``fully_shard``-ed graph converts per rank into
sharded integer storage (2 gloo ranks, one launch: outputs equal the unsharded convert's,
each rank holds its rows of the integers); ``fully_shard`` of a converted graph shards its
integer weights. What a rank cannot convert alone (here: a stand-in class named like
FSDP2's over plain parameters) is refused with the gather recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import qcompile as qc

# every test in tests/dist carries the mark (tests/test_collection.py checks the folder)
pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_convert_worker.py")
LAUNCH_DEADLINE = 90.0


class FSDPModule:  # stands in for torch.distributed.fsdp.FSDPModule (matched by name)
    pass


def calibrated() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    gm = qc.qcompile(m, "int8-static", example_inputs=(torch.randn(2, 8),))
    return qc.calibrate(gm, [(torch.randn(4, 8),)], progress=False)


def test_convert_refuses_a_module_sharded_like_fsdp2_with_the_recipe():
    gm = calibrated()
    inner = gm.get_submodule("0")
    inner.__class__ = type("FSDPLinear", (FSDPModule, type(inner)), {})  # as fully_shard does
    with pytest.raises(qc.QCompileError) as info:
        qc.convert(gm)
    text = str(info.value)
    assert "module '0' is a FSDPModule" in text and "sharded" in text
    for part in ("get_model_state_dict", "full_state_dict=True", "cpu_offload=True",
                 "rank == 0", "qc.convert(gm)"):
        assert part in text, part


def test_convert_of_an_unsharded_graph_is_unaffected():
    int8 = qc.convert(calibrated())
    assert qc.report(int8).conversions


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory: pytest.TempPathFactory, dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, ["convert_sharded", "fully_shard_converted"],
                         tmp_path_factory.mktemp("convert"), LAUNCH_DEADLINE)


def test_a_sharded_graph_converts_per_rank_into_sharded_integer_weights(dist_run: Any) -> None:
    ranks = dist_run.case("convert_sharded")
    for r in ranks:
        assert r["dtensors"], "every parameter of the result is FSDP2-sharded"
        # int storage (no kernels): the same numbers as the unsharded convert's kernels,
        # within one output step (the convert contract), and as the fake-quant graph
        assert r["diff_steps"] <= 1.0 and r["fake_diff_steps"] <= 1.0, r
        assert r["max_deviation"]["output0"] <= r["diff_steps"] + 1.0
        assert r["paths"] == ["int_storage", "quantize"]
        assert r["gm_unchanged"] == 0.0  # the sharded source graph computes as before
    total = ranks[0]["int_total"]
    assert ranks[1]["int_total"] == total
    assert sum(r["int_here"] for r in ranks) == total  # the rows add up, nothing twice
    for r in ranks:  # 5 rows split 3 / 2: about half of the integer bytes each
        assert r["int_here"] <= 0.6 * total, r


def test_fully_shard_of_a_converted_graph_shards_its_integer_weights(dist_run: Any) -> None:
    ranks = dist_run.case("fully_shard_converted")
    for r in ranks:
        assert r["int_params"] == 6  # integers, scales, zero points: parameters
        assert r["before"] == r["int_total"]
        assert r["diff"] == 0.0  # the gathered integers are the same integers
        assert r["int_here"] <= 0.6 * r["int_total"], r
    assert sum(r["int_here"] for r in ranks) == ranks[0]["int_total"]
