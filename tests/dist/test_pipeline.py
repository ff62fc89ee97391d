"""``qc.distributed.pipeline`` on 2 ranks (gloo, CPU) against the single-process graph.

Every multi-process case runs in ``_pipeline_worker.py``: the tests selected in this session
name their cases, one launch of two worker processes (a FileStore rendezvous in a temporary
folder: no port to find) runs all of them in one process group, and each test asserts on
the JSON both ranks wrote. The launch is supervised: when one rank fails the other is
killed after a short grace period, and the whole launch has a deadline; both ranks use a
process-group timeout, so a crashed peer never leaves a test hanging.

Models are int8-qat with fixed scales (one forward over the batch, then ``qc.freeze``),
except the ``live_*`` cases (observers live, as QAT runs); the reference is the unsplit
compiled graph with the same state_dict: per-micro-batch losses of a mean-reduced loss,
gradients of the mean of those losses.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_cases import uses, wanted_cases
from torch import nn

import qcompile as qc

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_pipeline_worker.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
MICRO = 4  # the worker's pipeline.microbatches
TOL = 1e-6
LAUNCH_DEADLINE = 150.0  # seconds for every case of a launch together (about 15 s normally)
GRACE = 5.0  # seconds a rank may outlive its failed peer before it is killed

# every case the worker knows, in the order one launch runs them
ORDER = ["gpipe", "1f1b", "global_skip_gpipe", "global_skip_1f1b", "inputs_by_name", "tied",
         "bad_batch", "gpipe_3_stages", "interleaved", "tied_interleaved_cross_rank",
         "tied_interleaved_same_rank", "live_gpipe", "live_1f1b", "live_interleaved"]


@pytest.fixture(scope="module")
def dist_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             dist_launcher: Any
             ) -> Any:
    cases = wanted_cases(request, ORDER)
    return dist_launcher(WORKER, cases, tmp_path_factory.mktemp("pipeline"), LAUNCH_DEADLINE)


# -- checks ---------------------------------------------------------------------------------
def check_step(r0: dict[str, Any], r1: dict[str, Any]) -> None:
    """Losses and every gradient of each rank's stage(s) match the reference."""
    assert r0["losses"] == [], "only the last stage's rank computes losses"
    assert len(r1["losses"]) == MICRO, r1["losses"]
    for i, (got, want) in enumerate(zip(r1["losses"], r1["ref_losses"])):
        assert abs(got - want) <= TOL, f"micro-batch {i}: loss {got} vs reference {want}"
    for rank, r in enumerate((r0, r1)):
        assert r["stages"] and all(r["stages"].values()), f"rank {rank}: a stage without params"
        assert not r["unknown"], f"rank {rank}: stage parameters not named as in the model"
        assert not r["no_grad"], f"rank {rank}: no gradient for {r['no_grad']}"
        bad = {name: d for name, d in r["grad_diff"].items() if d > TOL}
        assert not bad, f"rank {rank}: gradients differ from the reference by {bad}"
    held = {name for r in (r0, r1) for names in r["stages"].values() for name in names}
    assert held == set(r0["ref_params"]), "every parameter is held by some stage"


# -- training steps against the single-process graph ----------------------------------------
@pytest.mark.parametrize("case", [
    "gpipe",                # 1. GPipe; the model's skip from emb to head crosses the cut
    "1f1b",                 # 2. 1F1B, same model
    "global_skip_gpipe",    # 3. the model input is added to its output
    "global_skip_1f1b",
    "inputs_by_name",       # step(x=...) instead of step(x)
    "interleaved",          # 5. interleaved_1f1b: 4 stages, 2 per rank
])
def test_step_matches_single_process(dist_run: Any, case: str) -> None:
    r0, r1 = dist_run.case(case)
    check_step(r0, r1)


@uses("interleaved")
def test_interleaved_puts_two_stages_on_each_rank(dist_run: Any) -> None:
    r0, r1 = dist_run.case("interleaved")
    assert sorted(r0["stages"]) == ["0", "2"] and sorted(r1["stages"]) == ["1", "3"]


@uses("tied")
def test_tied_embedding_and_head_on_two_ranks(dist_run: Any) -> None:
    """4. emb on stage 0, the head (F.linear with emb.weight) on stage 1: each rank holds
    the tied weight, its gradient is the full one on both, and an SGD step keeps the copies
    identical."""
    r0, r1 = dist_run.case("tied")
    check_step(r0, r1)
    for rank, r in enumerate((r0, r1)):
        assert r["holds_tied"], f"rank {rank} does not hold emb.weight"
        assert r["grad_diff"]["emb.weight"] <= TOL, f"rank {rank}: partial tied gradient"
        assert r["tied_ref_diff"] <= TOL, f"rank {rank}: tied weight after SGD vs reference"
    assert r0["tied_rank_diff"] == 0.0 and r1["tied_rank_diff"] == 0.0, \
        "the tied weights differ across ranks after one SGD step"


@uses("tied_interleaved_cross_rank")
def test_tied_weight_interleaved_on_different_ranks(dist_run: Any) -> None:
    r0, r1 = dist_run.case("tied_interleaved_cross_rank")
    assert "emb.weight" in r0["stages"]["0"] and "emb.weight" in r1["stages"]["3"]
    check_step(r0, r1)


@uses("tied_interleaved_same_rank")
def test_tied_weight_interleaved_on_one_rank(dist_run: Any) -> None:
    r0, r1 = dist_run.case("tied_interleaved_same_rank")
    assert "emb.weight" in r0["stages"]["0"] and "emb.weight" in r0["stages"]["2"]
    check_step(r0, r1)


# -- live observers: torch's shape-inference forward reaches no observer --------------------
@pytest.mark.parametrize("case", ["live_gpipe", "live_1f1b", "live_interleaved"])
def test_live_observers_see_real_data_only(dist_run: Any, case: str) -> None:
    """Int8 QAT, observers live (not frozen): the first step equals the unsplit graph run
    micro-batch by micro-batch (losses, gradients, every observer statistic and qparam),
    which it cannot if the stage's shape inference (a forward on ``torch.empty``) were
    observed; then 20 Adam steps: finite losses that fall."""
    r0, r1 = dist_run.case(case)
    check_step(r0, r1)
    for rank, r in enumerate((r0, r1)):
        assert r["buffers_compared"] > 0
        assert r["buffer_diff"] <= TOL, f"rank {rank}: observer state differs by {r['buffer_diff']}"
    history = r1["history"]
    assert len(history) == 20 and all(math.isfinite(v) for v in history), history
    assert history[-1] < 0.8 * history[0], f"loss does not fall: {history}"


# -- bad input: a clear QCompileError on every rank, nothing left hanging -------------------
@uses("bad_batch")
def test_batch_not_divisible_by_microbatches(dist_run: Any) -> None:
    r0, r1 = dist_run.case("bad_batch")
    for rank, r in enumerate((r0, r1)):
        assert r["raised"] == "QCompileError", f"rank {rank}: {r['raised']}: {r['message']}"
        assert "batch size 6" in r["message"] and "microbatches = 4" in r["message"]
        assert r["fix"]
    # raised before anything was sent: the same schedule then runs a good batch
    assert r1["then_losses"] == MICRO


@uses("gpipe_3_stages")
def test_gpipe_with_more_stages_than_ranks(dist_run: Any) -> None:
    r0, r1 = dist_run.case("gpipe_3_stages")
    for rank, r in enumerate((r0, r1)):
        assert r["raised"] == "QCompileError", f"rank {rank}: {r['raised']}: {r['message']}"
        assert "3 stages" in r["message"] and "2 ranks" in r["message"], r["message"]
        assert "pipeline.stages" in r["fix"] or "nproc_per_node" in r["fix"]


# -- single process -------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 2))


def test_pipeline_without_a_process_group() -> None:
    """6. No process group: a QCompileError saying how to start one."""
    assert not (dist.is_available() and dist.is_initialized())
    spec = {**qc.load_spec("int8-qat").model_dump(),
            "pipeline": {"stages": 2, "microbatches": MICRO}}
    gm = qc.qcompile(_mlp(), spec, example_inputs=(torch.randn(2, 8),))
    with pytest.raises(qc.QCompileError) as info:
        qc.distributed.pipeline(gm, spec, loss_fn=lambda out, tgt: (out - tgt).pow(2).mean())
    assert "process group" in info.value.message
    assert info.value.fix and "init_process_group" in info.value.fix
