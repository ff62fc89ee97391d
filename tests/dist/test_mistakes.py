"""No rank left hanging (2 ranks, gloo, CPU): a mistake made on one rank only is the same
clear ``QCompileError`` on every rank, the process group stays usable, and nothing was
changed: a scheme, schedule, ``cache_dir`` or bad batch on one rank; every public call that
communicates made by one rank only; different models on the two ranks; a misshaped batch.
``qc.calibrate`` takes a wrapped graph; ``train_step`` synchronises gradients on the last
micro-batch only.

All cases run in one launch of ``_mistakes_worker.py`` (one process group; the mistakes
one after the other in it, each followed by a barrier and an all-reduce).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_cases import uses, wanted_cases

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_mistakes_worker.py")
LAUNCH_DEADLINE = 180.0  # seconds for every case together (about 20 s normally)
ORDER = ["mistakes", "calls", "calibrate_wrapped", "train_step"]


@pytest.fixture(scope="module")
def dist_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, wanted_cases(request, ORDER),
                         tmp_path_factory.mktemp("mistakes"), LAUNCH_DEADLINE)


# mistake -> (words every rank's message names, words the fix says)
AGREED = {
    "cache_dir_on_rank0": (["compile_once", "cache_dir", "rank 0", "rank 1", "None"],
                           ["same cache_dir"]),
    "cache_dir_on_rank1": (["compile_once", "cache_dir", "rank 0", "rank 1", "None"],
                           ["same cache_dir"]),
    "scheme_calibrate": (["calibrate", "spec.quant.rules[0].weight.granularity",
                          "per_channel", "per_tensor"], ["same spec"]),
    "scheme_wrap": (["qc.distributed.wrap", "spec.quant.rules[0].weight.granularity"],
                    ["same spec"]),
    "scheme_compile_once": (["compile_once", "spec.quant.rules[0].weight.granularity"],
                            ["same spec"]),
    "schedule": (["qc.distributed.pipeline", "spec.pipeline.schedule", "gpipe", "1f1b"],
                 ["same spec"]),
    "mesh": (["qc.distributed.mesh", "data_parallel.kind", "ddp", "fsdp2"],
             ["same data_parallel"]),
    "factory_ddp_existing": (["DistributedDataParallel", "before"], ["bare module"]),
    "factory_ddp_built": (["DistributedDataParallel", "before"], ["bare module"]),
}


@uses("mistakes")
@pytest.mark.parametrize("what", sorted(AGREED))
def test_a_mistake_on_one_rank_is_the_same_error_on_every_rank(dist_run: Any,
                                                               what: str) -> None:
    names, fix = AGREED[what]
    results = [r[what] for r in dist_run.case("mistakes")]
    for rank, err in enumerate(results):
        assert err["raised"] == "QCompileError", f"rank {rank}: {err}"
        for word in names:
            assert word in err["message"], f"rank {rank}: {word!r} not in {err['message']!r}"
        for word in fix:
            assert word in err["fix"], f"rank {rank}: {word!r} not in fix {err['fix']!r}"
        assert err["group_works"], f"rank {rank}: the process group broke"
    assert results[0]["message"] == results[1]["message"]
    if what == "scheme_calibrate":
        assert all(err["unchanged"] for err in results), "a refused calibration changed qparams"


@uses("mistakes")
def test_a_bad_batch_on_one_rank_fails_every_rank(dist_run: Any) -> None:
    """Rank 1's batch 1 is misshaped: rank 1 raises its own misfit error, rank 0 says rank 1
    failed and why; both graphs are unchanged, and calibrate works afterwards."""
    r0, r1 = (r["bad_batch"] for r in dist_run.case("mistakes"))
    assert r1["raised"] == "QCompileError" and "calibration batch 1" in r1["message"], r1
    assert r0["raised"] == "QCompileError", r0
    assert r0["message"].startswith("rank 1 failed in calibrate: calibration batch 1"), r0
    assert "[6, 11]" in r0["message"] and r0["fix"], r0
    for rank, r in enumerate((r0, r1)):
        assert r["unchanged"], f"rank {rank}: the refused calibration changed the graph"
        assert r["group_works"] and r["after_equal_across_ranks"], (rank, r)
    # the same batches given to compile_once
    r0, r1 = (r["bad_batch_compile_once"] for r in dist_run.case("mistakes"))
    assert r1["raised"] == "QCompileError" and "calibration batch 1" in r1["message"], r1
    assert r0["raised"] == "QCompileError", r0
    assert r0["message"].startswith("rank 1 failed in compile_once (calibrating): "
                                    "calibration batch 1"), r0
    assert r0["group_works"] and r1["group_works"]


# -- a call made by one rank only, different models, a misshaped batch --------------------------
# the worker's name of a public call -> the call the error names
CALLS = {"train_step": "qc.distributed.train_step", "wrap": "qc.distributed.wrap",
         "search": "qc.search", "save_adapters": "save_adapters",
         "compile_once": "compile_once", "calibrate": "calibrate",
         "pipeline_step": "PipelineSchedule.step",
         "sync_observers": "qc.distributed.sync_observers"}


def same_error_on_both(results: tuple[dict[str, Any], ...], names: list[str],
                       fix: list[str]) -> None:
    for rank, err in enumerate(results):
        assert err["raised"] == "QCompileError", f"rank {rank}: {err}"
        for word in names:
            assert word in err["message"], f"rank {rank}: {word!r} not in {err['message']!r}"
        for word in fix:
            assert word in err["fix"], f"rank {rank}: {word!r} not in fix {err['fix']!r}"
        assert err["group_works"], f"rank {rank}: the process group broke"
    assert results[0]["message"] == results[1]["message"]


@uses("calls")
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_made_by_one_rank_only_is_the_same_error_on_both(dist_run: Any,
                                                                call: str) -> None:
    """Rank 0 makes the call, rank 1 goes on to its next call (``train_step`` after a
    ``save_adapters`` only rank 0 makes, ``sync_observers`` otherwise): both raise at once,
    naming each rank's call."""
    theirs = CALLS["train_step" if call in ("save_adapters", "sync_observers")
                   else "sync_observers"]
    results = tuple(r[f"only_{call}"] for r in dist_run.case("calls"))
    same_error_on_both(results, ["different qcompile calls", f"rank 0: {CALLS[call]!r}",
                                 f"rank 1: {theirs!r}"], ["same qcompile calls"])


@uses("calls")
def test_a_rank_that_never_comes_is_named_and_the_next_call_still_meets(dist_run: Any) -> None:
    """Rank 0 saves the FSDP2 graph's adapters, rank 1 makes no qcompile call: rank 0 gives
    up after QCOMPILE_AGREE_TIMEOUT (2 s here) naming rank 1; rank 1's next call skips the
    meeting it missed (with a warning), and both ranks' next train_step meets."""
    r0, r1 = (r["absent"] for r in dist_run.case("calls"))
    assert r0["raised"] == "QCompileError", r0
    assert "rank 1 did not reach save_adapters within 2 s (rank 0 did)" in r0["message"], r0
    assert "QCOMPILE_AGREE_TIMEOUT" in r0["fix"] and "every rank" in r0["fix"], r0
    assert r1["raised"] is None, r1
    assert r0["group_works"] and r1["group_works"]
    a0, a1 = (r["after_absent"] for r in dist_run.case("calls"))
    assert a0["raised"] is None and a1["raised"] is None, (a0, a1)
    assert a0["warnings"] == [], a0
    assert len(a1["warnings"]) == 1 and "called save_adapters without this rank" in (
        a1["warnings"][0]), a1


@uses("calls")
def test_a_rank_that_comes_after_the_others_gave_up_is_told_so(dist_run: Any) -> None:
    """Rank 1 calls save_adapters only once rank 0 gave up waiting for it: rank 0 names
    rank 1, rank 1 learns it came too late; the next train_step meets on both ranks."""
    r0, r1 = (r["late"] for r in dist_run.case("calls"))
    assert r0["raised"] == "QCompileError" and "rank 1 did not reach save_adapters" in (
        r0["message"]), r0
    assert r1["raised"] == "QCompileError", r1
    assert ("rank 0 waited 2 s for this rank (rank 1) in save_adapters and gave up: it came "
            "too late") in r1["message"], r1
    assert "QCOMPILE_AGREE_TIMEOUT" in r1["fix"], r1
    for rank, r in enumerate(dist_run.case("calls")):
        assert r["after_late"]["raised"] is None, (rank, r["after_late"])


# case -> (words both ranks' message names, words the fix says)
DIFFERENT = {
    # (the first tensor that differs: the first layer's bias or weight, 16 vs 32 rows)
    "models_wrap": (["qc.distributed.wrap", "tensors.0.", "rank 0: 'float32[16",
                     "rank 1: 'float32[32"], ["same model"]),
    "models_calibrate": (["calibrate", "tensors.0.", "rank 0: 'float32[16",
                          "rank 1: 'float32[32"], ["same model"]),
    "models_search": (["qc.search", "model.weights", "rank 0", "rank 1"],
                      ["same model", "weights"]),
    "models_train_step": (["qc.distributed.train_step", "model.graph", "rank 0", "rank 1"],
                          ["same model"]),
    "misshaped": (["qc.distributed.train_step", "inputs[0]", "rank 0: 'float32[*, 8]'",
                   "rank 1: 'float32[*, 11]'"], ["same shape"]),
    "split": (["qc.distributed.train_step", "split",
               "rank 1: 'a batch of 7 rows does not split into 2 micro-batches'"],
              ["multiple of train.accumulate"]),
}


@uses("calls")
@pytest.mark.parametrize("what", sorted(DIFFERENT))
def test_different_models_or_batches_are_the_same_error_on_both(dist_run: Any,
                                                                what: str) -> None:
    results = tuple(r[what] for r in dist_run.case("calls"))
    same_error_on_both(results, *DIFFERENT[what])


@uses("calls")
def test_the_group_steps_together_after_every_mistake(dist_run: Any) -> None:
    for rank, r in enumerate(dist_run.case("calls")):
        good = r["good_step"]
        assert good["raised"] is None, f"rank {rank}: {good}"
        assert good["equal_to_rank0"], f"rank {rank}: the ranks' weights differ"


@uses("calibrate_wrapped")
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_calibrate_accepts_a_wrapped_graph(dist_run: Any, kind: str) -> None:
    for rank, r in enumerate(dist_run.case("calibrate_wrapped")):
        got = r[kind]
        assert got["returned_wrapper"], f"rank {rank}: calibrate did not return the wrapper"
        # the layers' scales and the model input's (inputs: auto)
        assert got["compared"] == 7 and got["not_equal"] == [], (
            f"rank {rank}: scales differ from one process on both ranks' batches: {got}")
        assert got["flags"] == [[True, False]], got["flags"]


@uses("train_step")
def test_train_step_synchronises_only_the_last_micro_batch(dist_run: Any) -> None:
    """With train.accumulate = 2, one all-reduce per bucket per step (as with k = 1: the
    first micro-batch runs under no_sync), the ranks' weights bit-identical, and equal to
    one process stepping on the global batch (up to float summation order)."""
    r0, r1 = dist_run.case("train_step")
    for rank, r in enumerate((r0, r1)):
        k1, k2 = r["k1"], r["k2"]
        assert k1["allreduces"] >= 1
        assert k2["allreduces"] == k1["allreduces"], (
            f"rank {rank}: {k2['allreduces']} all-reduces with 2 micro-batches, "
            f"{k1['allreduces']} with 1: a micro-batch other than the last synchronised")
        for k, got in (("k1", k1), ("k2", k2)):
            assert got["equal_to_rank0"], f"rank {rank}, {k}: the ranks' weights drifted apart"
            assert got["moved"] > 1e-3, got
            assert got["max_diff"] < 1e-5, (
                f"rank {rank}, {k}: weights differ from one process on the global batch by "
                f"{got['max_diff']}")
