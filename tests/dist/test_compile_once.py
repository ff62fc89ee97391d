"""``qc.distributed.compile_once`` on 2 ranks (gloo, CPU): sharded (FSDP2, one group per
block) and replicated results loaded from safetensors checkpoints or streamed from rank 0,
calibrated on each rank's own batches, checked against one process; bad checkpoints refused
on every rank; the compile cache.

Every case runs in ``_compile_once_worker.py``: the tests selected in this session name
their cases, one supervised launch of two worker processes runs all of them in one process
group (a FileStore rendezvous: no port), and each test asserts on the JSON both ranks
wrote. The single-process reference compiles the real model with ``sync_observers: false``
and calibrates on the union of both ranks' batches (min-max observers: bit-identical).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from dist_cases import uses, wanted_cases

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_compile_once_worker.py")
LAUNCH_DEADLINE = 150.0  # seconds for every case together (about 25 s normally)
WORLD = 2
BLOCKS = 3  # the worker's BlockModel: inp, layers.0..2 (LayerNorm + Linear), head
WEIGHTS = 16  # its parameters
# weight + output quantizer per Linear (5), one per residual add (3), and the model input
# the first Linear reads (the presets' inputs: auto)
QUANTIZERS = 14
# per quantizer in the state dict: scale, zero_point, observer min/max, mode_flags and the
# extra state (step updates' pending statistics and initialised)
STATE = WEIGHTS + 6 * QUANTIZERS
QPARAMS = 4 * QUANTIZERS  # scale, zero_point, observer min/max

# every case the worker knows, in launch order; fsdp2_calibration_memory first (the
# process's allocator as fresh as it gets); fsdp2_unequal_batches (a known failure that
# leaves the process group unusable) must stay last
ORDER = ["fsdp2_calibration_memory", "fsdp2_static_ckpt", "fsdp2_static_stream",
         "fsdp2_qat_train", "fsdp2_cnn_fold", "ddp_static_folder", "errors", "cache",
         "fsdp2_unequal_batches"]


@pytest.fixture(scope="module")
def dist_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             dist_launcher: Any) -> Any:
    cases = wanted_cases(request, ORDER)
    return dist_launcher(WORKER, cases, tmp_path_factory.mktemp("compile_once"),
                         LAUNCH_DEADLINE)


def check_sharded(rank: int, shards: dict[str, dict[str, Any]], count: int) -> None:
    """Every parameter a ``Shard(0)`` DTensor holding this rank's ``ceil(n / 2)`` rows
    (rank 0) or the rest (rank 1)."""
    assert len(shards) == count, sorted(shards)
    for name, s in shards.items():
        assert s["dtensor"], f"rank {rank}: {name} is not a DTensor"
        assert s["placements"] == ["S(0)"], f"rank {rank}: {name}: {s['placements']}"
        first = math.ceil(s["rows"] / WORLD)
        want = first if rank == 0 else s["rows"] - first
        assert s["local_rows"] == want, (
            f"rank {rank}: {name} holds {s['local_rows']} of {s['rows']} rows, not {want}")


def check_equal_to_reference(rank: int, r: dict[str, Any], state: int, qparams: int) -> None:
    vs = r["vs_reference"]
    assert vs["missing"] == [] and vs["extra"] == [], (
        f"rank {rank}: state-dict names differ from one process: missing {vs['missing']}, "
        f"extra {vs['extra']}")
    assert vs["compared"] == state
    assert vs["not_equal"] == [], (
        f"rank {rank}: not bit-identical to one process on both ranks' batches: "
        f"{vs['not_equal']} (gaps {vs['gaps']})")
    qp = r["qparams_vs_reference"]
    assert qp["compared"] == qparams and qp["missing"] == [] and qp["not_equal"] == [], (
        f"rank {rank}: qparams: {qp}")
    assert r["out_equal"], f"rank {rank}: output differs from one process by {r['out_diff']}"
    assert r["out_norm"] > 0
    assert all(f == [True, False] for f in r["flags"].values()), r["flags"]


# -- 1 & 2. fsdp2 + static on a block model ---------------------------------------------------
@pytest.mark.parametrize("case", ["fsdp2_static_ckpt", "fsdp2_static_stream"])
def test_fsdp2_static_equals_one_process_on_all_batches(dist_run: Any, case: str) -> None:
    """From a safetensors file (each rank reads its rows) or streamed from rank 0: the
    gathered state, the qparams and the output are bit-identical to one process
    calibrating on both ranks' batches — which each rank's own batches alone would not
    give; every parameter is sharded in halves; one FSDP2 child per block."""
    r0, r1 = dist_run.case(case)
    for rank, r in enumerate((r0, r1)):
        check_equal_to_reference(rank, r, STATE, QPARAMS)
        assert r["own_only"], f"rank {rank}: its own batches alone give the same qparams"
        check_sharded(rank, r["shards"], WEIGHTS)
        assert r["blocks"] == [f"layers.{i}" for i in range(BLOCKS)]
        assert r["children"] == [f"stage_{i}" for i in range(BLOCKS)], r["children"]
        assert (f"compile_once: {BLOCKS} blocks as FSDP2 groups (layers.0 .. "
                f"layers.{BLOCKS - 1})") in r["notes"], r["notes"]
        assert "compile cache: no cache_dir" in r["notes"]
    assert r0["keys"] == r1["keys"]


# -- 3. fsdp2 + QAT from a checkpoint ----------------------------------------------------------
@uses("fsdp2_qat_train")
def test_fsdp2_qat_from_checkpoint_trains_with_synced_observers(dist_run: Any) -> None:
    """Loaded exactly from the checkpoint, ready to train without ``wrap``: 2 SGD steps
    on different data per rank give finite losses, move the weights, update the
    observers, and leave weights and qparams identical on both ranks (unsynchronised, the
    same steps give the ranks different qparams)."""
    r0, r1 = dist_run.case("fsdp2_qat_train")
    for rank, r in enumerate((r0, r1)):
        loaded = r["loaded_vs_checkpoint"]
        assert loaded["compared"] == WEIGHTS and loaded["not_equal"] == [], loaded
        assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"]), r["losses"]
        assert r["moved"] > 1e-3, f"rank {rank}: the optimizer did not move the weights"
        assert len(r["qparam_names"]) == QPARAMS and len(r["weights"]) == WEIGHTS
        assert r["qparams_differing"] == [], f"qparams differ: {r['qparams_differing']}"
        assert r["weights_differing"] == [], f"weights differ: {r['weights_differing']}"
        assert r["unsynced_would_differ"], "the ranks' data give the same qparams unsynced"
        assert any(".output_fake_quant." in n for n in r["qparams_changed"]), \
            "training did not update the activation observers"
        assert all(f == [True, True] for f in r["flags"].values()), r["flags"]
        check_sharded(rank, r["shards"], WEIGHTS)
    assert r0["losses"] != r1["losses"], "the ranks trained on the same data"


# -- 4. fsdp2 + static on a CNN whose BatchNorms fold ------------------------------------------
CNN_WEIGHTS = 10  # stem, 3 convs (each with its folded bias), head
# weight + output quantizer per conv/linear (5), one per residual add (3), the model input
CNN_QUANTIZERS = 14


@uses("fsdp2_cnn_fold")
@pytest.mark.parametrize("how", ["checkpoint", "stream"])
def test_fsdp2_static_cnn_folds_batchnorm_like_one_process(dist_run: Any, how: str) -> None:
    """Conv2d+BatchNorm2d blocks, BN statistics far from their defaults (negative gammas):
    each rank recomputes its rows of every fold. A fold is elementwise per output channel
    (correctly rounded multiply, divide and square root), so a rank's rows are the same
    bits as one process's: state, qparams and output are bit-identical (``torch.equal``)."""
    r0, r1 = dist_run.case("fsdp2_cnn_fold")
    for rank, r in enumerate((r0, r1)):
        assert r["negative_gammas"] > 0 and r["ref_bn_left"] == []
        got = r[how]
        assert got["bn_left"] == [], f"rank {rank}: BatchNorm left in the graph"
        assert got["unfolded"] == [], f"rank {rank}: conv weights equal to the checkpoint's"
        assert got["sign_flipped"], f"rank {rank}: a negative gamma did not flip its channel"
        vs = got["vs_reference"]
        assert vs["missing"] == [] and vs["extra"] == [], vs
        assert vs["compared"] == CNN_WEIGHTS + 6 * CNN_QUANTIZERS
        assert vs["not_equal"] == [], (
            f"rank {rank}: not bit-identical to one process: {vs['not_equal']} "
            f"(gaps {vs['gaps']})")
        assert got["qparams_vs_reference"]["not_equal"] == []
        assert got["out_equal"], f"rank {rank}: output differs by {got['out_diff']}"
        assert got["children"] == [f"stage_{i}" for i in range(BLOCKS)]
        check_sharded(rank, got["shards"], CNN_WEIGHTS)


# -- 5. ddp + static from a sharded checkpoint folder ------------------------------------------
@uses("ddp_static_folder")
def test_ddp_static_from_sharded_folder_is_a_full_replica(dist_run: Any) -> None:
    """Two safetensors shards and ``model.safetensors.index.json``: every rank holds one
    full replica of plain tensors; calibration is synced, so state, qparams and output
    equal one process on both ranks' batches."""
    r0, r1 = dist_run.case("ddp_static_folder")
    for rank, r in enumerate((r0, r1)):
        assert r["files"] == ["model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors",
                              "model.safetensors.index.json"]
        assert r["plain"], f"rank {rank}: a DTensor in a replicated result"
        assert len(r["shards"]) == WEIGHTS
        for name, s in r["shards"].items():
            assert not s["dtensor"] and s["local_rows"] == s["rows"], (rank, name, s)
        assert not any(c.startswith("stage_") for c in r["children"]), r["children"]
        check_equal_to_reference(rank, r, STATE, QPARAMS)
        assert r["own_only"], f"rank {rank}: its own batches alone give the same qparams"


# -- 6. checkpoints that do not fit ------------------------------------------------------------
NAMED = {"missing": ["'layers.1.fc.weight'", "lacks"],
         "extra": ["'layers.9.fc.weight'"],
         "misshaped": ["'head.weight'", "[6, 16]", "[5, 16]"],
         "dtype": ["'layers.0.ln.bias'", "float64", "float32"],
         "truncated": ["bad_truncated.safetensors"]}


@uses("errors")
@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
@pytest.mark.parametrize("what", sorted(NAMED))
def test_bad_checkpoint_is_refused_on_every_rank(dist_run: Any, kind: str, what: str) -> None:
    """A missing, extra, misshaped or retyped tensor, or a truncated file: a
    ``QCompileError`` naming it on both ranks, at once (before any collective), and the
    process group still works afterwards."""
    r0, r1 = dist_run.case("errors")
    for rank, r in enumerate((r0, r1)):
        err = r[f"{kind}/{what}"]
        assert err["raised"] == "QCompileError", f"rank {rank}: {err}"
        for part in NAMED[what]:
            assert part in err["message"], f"rank {rank}: {part} not in {err['message']!r}"
        assert err["fix"], f"rank {rank}: no fix"
        # both ranks met at the barrier after every mistake (the worker's barrier would
        # time out otherwise) and the group still works
        assert r["all_reduce_after"] == 3.0


# -- 7. the compile cache ----------------------------------------------------------------------
@uses("cache")
def test_cache_stores_no_weights_and_hits_the_second_time(dist_run: Any) -> None:
    """fsdp2 + static + checkpoint + cache_dir: a miss, then a hit with the same gathered
    state (equal to one process); the entry holds quantizer state only, no model weight;
    changing rank 1's calibration data alone is a miss (the key covers every rank's)."""
    r0, r1 = dist_run.case("cache")
    for rank, r in enumerate((r0, r1)):
        calls = r["calls"]
        assert "compile cache: miss" in calls["first"]["notes"], calls["first"]["notes"]
        assert "compile cache: hit" in calls["second"]["notes"], calls["second"]["notes"]
        assert "compile cache: miss" in calls["rank1_data_changed"]["notes"]
        same = r["second_vs_first"]
        assert same["compared"] == STATE and same["not_equal"] == [], same
        assert r["first_vs_reference"]["not_equal"] == [], r["first_vs_reference"]
        assert r["changed_vs_first"]["not_equal"], "other calibration data, same state"
        assert calls["first"]["out"] == calls["second"]["out"]
        assert all(f == [True, False] for f in calls["second"]["flags"].values())
        check_sharded(rank, calls["second"]["shards"], WEIGHTS)
        assert len(r["entries"]) == 2 and sorted(r["stored"]) == r["entries"], r["entries"]
        for key, names in r["stored"].items():
            leaked = sorted(set(names) & set(r["weights"]))
            assert not leaked, f"entry {key} stores model weights {leaked}"
            assert len(names) == STATE - WEIGHTS, names
            assert any(n.endswith(".scale") for n in names)
    assert r0["entries"] == r1["entries"]


# -- 8. calibration at 1/N per rank -----------------------------------------------------------
@uses("fsdp2_calibration_memory")
def test_fsdp2_calibration_peaks_within_one_nth_plus_two_blocks(dist_run: Any) -> None:
    """A 96 MiB model of 3 blocks, int8-static from a checkpoint, 2 calibration batches
    per rank through the sharded graph, glibc's malloc defaults: every rank's peak RSS
    over its RSS before the call is at most (model/N + 2 blocks) + 10% (all-gather buffer
    and unsharded weights of one block at a time over the shards), and at least its
    shards (so the measurement sees the call). Freed memory kept by the allocator used to
    put a rank at 2.4x the model."""
    for rank, r in enumerate(dist_run.case("fsdp2_calibration_memory")):
        if not r["measurable"]:
            pytest.skip("/proc/self/clear_refs cannot reset the peak RSS here")
        world, model, block = r["world"], r["model_mb"], r["block_mb"]
        assert 90 < model < 100 and r["children"] == ["stage_0", "stage_1", "stage_2"]
        assert abs(r["local_param_mb"] - model / world) < 0.01 * model, r["local_param_mb"]
        bound = 1.1 * (model / world + 2 * block)
        assert model / world <= r["peak_mb"] <= bound, (
            f"rank {rank}: peak {r['peak_mb']:.1f} MB over the RSS before the call, bound "
            f"{bound:.1f} MB (model {model:.1f} MB / {world} + 2 blocks of {block:.1f} MB "
            "+ 10%)")
        assert all(f == [True, False] for f in r["flags"].values()), r["flags"]


# -- uneven calibration ------------------------------------------------------------------------
@uses("fsdp2_unequal_batches")
def test_fsdp2_unequal_calibration_batches_are_refused_on_every_rank(dist_run: Any) -> None:
    """Sharded, every forward is a collective: a different number of batches per rank
    would leave rank 0's extra forward waiting for rank 1 until the process group times
    out. A ``QCompileError`` on both ranks names the counts, before any forward (the
    group's timeout is 4 s: a rank that waited would raise a gloo timeout instead)."""
    r0, r1 = dist_run.case("fsdp2_unequal_batches")
    assert (r0["batches"], r1["batches"]) == (3, 2)
    for rank, r in enumerate((r0, r1)):
        assert r["raised"] == "QCompileError", f"rank {rank}: {r['raised']}: {r['message']}"
        assert "batch" in r["message"] and "[3, 2]" in r["message"], r["message"]
