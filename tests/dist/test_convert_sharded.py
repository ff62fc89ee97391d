"""``qc.convert`` of a sharded graph: refused with a ``QCompileError`` whose fix is the
recipe (gather the full state with ``get_model_state_dict(..., full_state_dict=True,
cpu_offload=True)``, convert an unsharded compile on rank 0). One test runs in one
process on a stand-in class named like FSDP2's; the other on 2 gloo ranks with the real
``fully_shard``, and follows the recipe to an integer model."""

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
    return dist_launcher(WORKER, ["convert_fsdp2"], tmp_path_factory.mktemp("convert"),
                         LAUNCH_DEADLINE)


def test_convert_fully_shard_graph_is_refused_and_the_recipe_converts(dist_run: Any) -> None:
    r0, r1 = dist_run.case("convert_fsdp2")
    for rank, r in enumerate((r0, r1)):
        err = r["error"]
        assert err is not None and "raw" not in err, f"rank {rank}: {err}"
        assert "sharded" in err["text"] and "get_model_state_dict" in err["text"]
    assert r1["keys"] == 0 and r0["keys"] > 0  # cpu_offload: the full state on rank 0 only
    assert r0["fresh_diff"] == 0.0  # the gathered state is the calibrated graph's
    assert r0["ops"], "nothing was converted"
    assert r0["max_deviation"]["output0_steps"] <= 1.0
