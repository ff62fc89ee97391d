"""No rank left hanging (2 ranks, gloo, CPU): a mistake made on one rank only is the same
clear ``QCompileError`` on every rank, the process group stays usable, and nothing was
changed; ``qc.calibrate`` takes a wrapped graph; ``train_step`` synchronises gradients on
the last micro-batch only.

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
LAUNCH_DEADLINE = 120.0  # seconds for every case together (about 15 s normally)
ORDER = ["mistakes", "calibrate_wrapped", "train_step"]


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
