"""Pipeline x data parallel on 4 gloo ranks (2 stages x 2 replicas) against one process.

The cases run in ``_hybrid_worker.py``: one supervised launch of four worker processes
(``dist_launcher(..., world=4)``) runs every case the selected tests name; each test
asserts on the JSON the ranks wrote. Ranks 0, 1 hold stage 0 (dp index 0, 1); ranks 2, 3
hold stage 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_cases import uses, wanted_cases
from torch import nn

import qcompile as qc
from qcompile.distributed.hybrid import mesh_shape

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_hybrid_worker.py")
WORLD = 4
LAUNCH_DEADLINE = 150.0  # seconds for every case together (about 20 s normally)
ORDER = ["none_ddp", "none_ddp_accumulate", "none_ddp_tied", "qat_ddp", "qat_fsdp2", "bad_shapes"]


@pytest.fixture(scope="module")
def dist_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             dist_launcher: Any) -> Any:
    cases = wanted_cases(request, ORDER)
    return dist_launcher(WORKER, cases, tmp_path_factory.mktemp("hybrid"), LAUNCH_DEADLINE,
                         world=WORLD)


@pytest.mark.parametrize("case", ["none_ddp", "none_ddp_accumulate", "none_ddp_tied"])
def test_no_quantization_equals_one_process_on_the_global_batch(dist_run: Any, case: str
                                                               ) -> None:
    """``quant.mode: none``, DDP over each stage's dp group: three SGD steps give the
    losses and parameters of one process trained on the whole batch (also with
    ``train.accumulate: 2``: two schedule steps per optimizer step; and with a weight
    tied across the two stages, summed over its pp holders)."""
    results = dist_run.case(case)
    if case == "none_ddp_tied":
        for r in results:
            assert "inp.weight" in r["params"], "every rank holds the tied weight"
            assert r["tied_holders"] == 4 and r["tied_rank_diff"] == 0.0
    assert [r["pp_dp"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    for rank, r in enumerate(results):
        assert r["wrapped"] == "DistributedDataParallel", "the schedule drives the DDP module"
        assert r["param_diff"] <= 1e-5, f"rank {rank}: parameters differ by {r['param_diff']}"
    for r in results[2:]:  # the last stage's ranks
        assert len(r["losses"]) == 3
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5, (r["losses"], r["ref_losses"])


@pytest.mark.parametrize("case", ["qat_ddp", "qat_fsdp2"])
def test_qat_replicas_identical_within_each_dp_group(dist_run: Any, case: str) -> None:
    """Int8 QAT with live observers: after training, parameters (DDP; FSDP2 shards them)
    and every observer statistic and qparam are bit-identical across a stage's replicas;
    observers synced over the dp group in at most one collective per reduction kind per
    step; losses finite."""
    results = dist_run.case(case)
    for rank, r in enumerate(results):
        assert r["finite"], f"rank {rank}: {r['losses']}"
        for kind, diff in r["replica_diff"].items():
            assert diff == 0.0, f"rank {rank}: {kind} differ across the dp group by {diff}"
        assert all(0 < s["collectives"] <= 3 for s in r["syncs"]), r["syncs"]
    for r in results[2:]:
        assert r["losses"] and r["losses"][-1] < r["losses"][0], r["losses"]
    if case == "qat_fsdp2":
        assert all(r["wrapped"].startswith("FSDP") for r in results)


@uses("bad_shapes")
def test_bad_mesh_shapes_refused_before_any_communication(dist_run: Any) -> None:
    for rank, r in enumerate(dist_run.case("bad_shapes")):
        for name, want in (("not_divisible", "4 ranks do not split into 3 stages"),
                           ("dp_of_one", "data-parallel group of 1")):
            got = r[name]
            assert got["raised"] == "QCompileError", f"rank {rank} {name}: {got}"
            assert want in got["message"] and got["fix"], got


# -- single process -------------------------------------------------------------------------
def test_mesh_shape() -> None:
    spec = {"pipeline": {"stages": 2}, "data_parallel": {"kind": "ddp"}}
    assert mesh_shape(spec, 4) == (2, 2)
    assert mesh_shape(spec, 8) == (2, 4)
    with pytest.raises(qc.QCompileError, match="data-parallel group of 1"):
        mesh_shape(spec, 2)
    with pytest.raises(qc.QCompileError, match="do not split"):
        mesh_shape(spec, 5)
    with pytest.raises(qc.QCompileError, match="kind is none"):
        mesh_shape({"pipeline": {"stages": 2}}, 4)


def test_data_parallel_without_a_process_group() -> None:
    assert not (dist.is_available() and dist.is_initialized())
    spec = {"pipeline": {"stages": 2, "microbatches": 2}, "data_parallel": {"kind": "ddp"}}
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    gm = qc.qcompile(m, spec, example_inputs=(torch.randn(2, 4),))
    for call in (lambda: qc.distributed.pipeline(gm, spec, loss_fn=nn.functional.mse_loss),
                 lambda: qc.distributed.mesh(spec)):
        with pytest.raises(qc.QCompileError) as info:
            call()
        assert "process group" in info.value.message
        assert "init_process_group" in (info.value.fix or "")
