"""LoRA adapters on a frozen quantized base on 2 ranks (gloo, CPU): DDP and FSDP2 through
``qc.distributed.wrap``, and ``qc.distributed.compile_once`` from a safetensors checkpoint.

Every case runs in ``_adapters_worker.py``: the tests selected in this session name their
cases, one supervised launch of two worker processes runs all of them in one process group
(a FileStore rendezvous: no port), and each test asserts on the JSON both ranks wrote.

The model: an input Linear, two blocks of q/k/v/o projections and an MLP (every block
Linear adapted, rank 4, alpha 8, its weight stored as int4 per-group or NF4), a head; all
of it frozen. AdamW trains the adapters 3 steps, each rank on its own half of every step's
global batch; the single-process reference (computed in each worker without the process
group) trains the same graph on the whole batch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from dist_cases import uses, wanted_cases

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_adapters_worker.py")
LAUNCH_DEADLINE = 120.0  # seconds for every case together (about 20 s normally)
WORLD = 2
ADAPTED = 12  # 2 blocks x (q, k, v, o, up, down)
# stored tensors per frozen layer: int4 packed nibbles, scale (symmetric: no zero point);
# NF4 codes, scales
STORED = {"int4": 2, "nf4": 2}
TRAIN = ["ddp_int4", "fsdp2_nf4", "fsdp2_int4"]
ONCE = ["compile_once_int4", "compile_once_nf4"]
ORDER = [*TRAIN, "fsdp2_full", *ONCE, "compile_once_conv1d"]


@pytest.fixture(scope="module")
def dist_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             dist_launcher: Any) -> Any:
    cases = wanted_cases(request, ORDER)
    return dist_launcher(WORKER, cases, tmp_path_factory.mktemp("adapters"), LAUNCH_DEADLINE)


def scheme_of(case: str) -> str:
    return case.rsplit("_", 1)[1]


def trained(dist_run: Any, case: str) -> tuple[dict[str, Any], ...]:
    """Both ranks' results, once training ran."""
    results = dist_run.case(case)
    errors = [r["error"] for r in results]
    if any(errors):
        pytest.fail(f"{case}: {errors}\n{results[0].get('traceback', '')}")
    return results


def check_shards(rank: int, shards: dict[str, Any], count: int) -> None:
    """Every stored tensor of the frozen bases a ``Shard(0)`` DTensor holding this rank's
    ``ceil(n / 2)`` rows (rank 0) or the rest (rank 1): half the stored bytes per rank."""
    assert len(shards["params"]) == count, sorted(shards["params"])
    for name, s in shards["params"].items():
        assert s["dtensor"] and s["shard0"], f"rank {rank}: {name} is not sharded by rows: {s}"
        first = math.ceil(s["rows"] / WORLD)
        want = first if rank == 0 else s["rows"] - first
        assert s["local_rows"] == want, (
            f"rank {rank}: {name} holds {s['local_rows']} of {s['rows']} rows, not {want}")
    ratio = shards["local_bytes"] / shards["whole_bytes"]
    assert 0.49 <= ratio <= 0.51, f"rank {rank}: holds {ratio:.3f} of the stored base"


def check_frozen(rank: int, r: dict[str, Any], scheme: str) -> None:
    assert len(r["frozen_names"]) == ADAPTED * STORED[scheme], r["frozen_names"]
    assert r["frozen_changed"] == [], f"rank {rank}: training changed {r['frozen_changed']}"
    assert r["frozen_with_grad"] == [], f"rank {rank}: gradients on {r['frozen_with_grad']}"
    assert r["frozen_requires_grad"] == [], r["frozen_requires_grad"]
    assert r["float_weights_left"] == [], f"rank {rank}: float bases {r['float_weights_left']}"
    assert len(r["trainable"]) == 2 * ADAPTED
    assert all(".lora_A." in n or ".lora_B." in n for n in r["trainable"]), r["trainable"]


# -- DDP and FSDP2 through qc.distributed.wrap -------------------------------------------------
@pytest.mark.parametrize("case", TRAIN)
def test_adapters_identical_across_ranks(dist_run: Any, case: str) -> None:
    """After 3 AdamW steps on different data per rank, every lora_A / lora_B (FSDP2:
    gathered) is bit-identical on both ranks, and training moved them."""
    r0, r1 = trained(dist_run, case)
    assert r0["adapters"] == r1["adapters"] and len(r0["adapters"]) == 2 * ADAPTED
    assert r0["digest"] == r1["digest"], "the ranks' adapters differ"
    assert r0["moved"] > 1e-3, "training did not move the adapters"
    assert r0["losses"] != r1["losses"], "the ranks trained on the same data (a weak test)"
    want = "DistributedDataParallel" if case.startswith("ddp") else "FSDPModel"
    assert r0["kind"] == want


@pytest.mark.parametrize("case", TRAIN)
def test_adapters_match_single_process_on_the_global_batch(dist_run: Any, case: str) -> None:
    """The adapters equal one process training on the whole global batch (the mean of the
    ranks' losses is that process's loss at every step)."""
    for rank, r in enumerate(trained(dist_run, case)):
        assert r["start_vs_reference"]["not_equal"] == [], "the adapters started elsewhere"
        vs = r["vs_reference"]
        assert vs["compared"] == 2 * ADAPTED and vs["missing"] == [] and vs["extra"] == []
        assert vs["not_close"] == [], (
            f"rank {rank}: {vs['not_close']} differ from one process (max gap {vs['max_gap']})")
        assert r["mean_losses"] == pytest.approx(r["ref_losses"], rel=1e-5), r


@pytest.mark.parametrize("case", TRAIN)
def test_frozen_base_unchanged_and_without_gradient(dist_run: Any, case: str) -> None:
    """The stored base (FrozenWeight codes, scales, zero points) is what one process
    compiles, training leaves it bit-identical and gives it no gradient; the adapted
    layers' float weights are not in the graph; only the adapters train."""
    for rank, r in enumerate(trained(dist_run, case)):
        check_frozen(rank, r, scheme_of(case))
        same = r["ref_frozen_vs_before"]
        assert same["compared"] == ADAPTED * STORED[scheme_of(case)]
        assert same["not_equal"] == [], f"rank {rank}: stored base differs from one process"


@pytest.mark.parametrize("case", [c for c in TRAIN if c.startswith("fsdp2")])
def test_fsdp2_shards_the_frozen_base(dist_run: Any, case: str) -> None:
    for rank, r in enumerate(dist_run.case(case)):
        check_shards(rank, r["shards"], ADAPTED * STORED[scheme_of(case)])


@uses("fsdp2_full")
def test_fsdp2_full_module_saved_as_one_process(dist_run: Any) -> None:
    """The head trained in full (``kind: full``) next to the adapters under FSDP2: its
    parameters are sharded like the adapters', ``save_adapters`` (called by every rank)
    writes it whole with the adapters, and the file equals the one a single process
    writes after training on the whole global batch (same names, values within the
    tolerance of a different reduction order, the same adapter_config)."""
    for rank, r in enumerate(trained(dist_run, "fsdp2_full")):
        assert r["head_sharded"] == ["bias", "weight"], f"rank {rank}: {r['head_sharded']}"
        vs = r["saved_vs_reference"]
        assert vs["missing"] == [] and vs["extra"] == [], vs
        assert vs["compared"] == 2 * ADAPTED + 2 and r["saved_head"] == [
            "base_model.model.head.bias", "base_model.model.head.weight"]
        assert vs["not_close"] == [], (
            f"rank {rank}: {vs['not_close']} differ from one process (max gap {vs['max_gap']})")
        assert r["config_equal"] and r["modules_to_save"] == ["head"]
        assert r["head_moved"] > 1e-3, "training did not move the head"
        assert r["mean_losses"] == pytest.approx(r["ref_losses"], rel=1e-5), r


# -- compile_once from a safetensors checkpoint -----------------------------------------------
@pytest.mark.parametrize("case", ONCE)
def test_compile_once_stores_each_ranks_rows_as_one_process(dist_run: Any, case: str) -> None:
    """Each rank quantizes its rows of every adapted weight from the checkpoint: the
    gathered codes and scales are bit-identical to a single-process ``qc.qcompile`` of the
    float model, sharded by rows (half per rank); lora_A is the same deterministic init,
    lora_B zeros."""
    scheme = scheme_of(case)
    for rank, r in enumerate(dist_run.case(case)):
        assert r["error"] is None or not r["error"].startswith("compile_once"), (
            f"rank {rank}: {r['error']}\n{r.get('traceback', '')}")
        vs = r["stored_vs_reference"]
        assert vs["compared"] == ADAPTED * STORED[scheme] and vs["missing"] == []
        assert vs["not_equal"] == [], f"rank {rank}: stored base differs: {vs}"
        ad = r["adapters_vs_reference"]
        assert ad["compared"] == 2 * ADAPTED and ad["not_equal"] == [], ad
        assert r["b_zero"]
        check_shards(rank, r["shards"], ADAPTED * STORED[scheme])


@uses("compile_once_conv1d")
def test_compile_once_stores_conv1d_bases_by_output_rows(dist_run: Any) -> None:
    """GPT-2's Conv1D layers (weights stored [in, out]): each rank stores its output rows
    of every NF4 base from the checkpoint's columns, bit-identical to one process."""
    for rank, r in enumerate(trained(dist_run, "compile_once_conv1d")):
        vs = r["stored_vs_reference"]
        layers = 4  # 2 blocks x (c_fc, c_proj)
        assert vs["compared"] == layers * STORED["nf4"] and vs["missing"] == [], vs
        assert vs["not_equal"] == [], f"rank {rank}: stored base differs: {vs}"
        check_shards(rank, r["shards"], layers * STORED["nf4"])
        assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0])


@pytest.mark.parametrize("case", ONCE)
def test_compile_once_result_trains(dist_run: Any, case: str) -> None:
    """One AdamW step on each rank's half of the batch: finite losses, the adapters move
    as one process on the whole batch moves them, the stored base stays as it was."""
    for rank, r in enumerate(dist_run.case(case)):
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{r.get('traceback', '')}"
        assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0])
        assert r["moved"] > 1e-3
        vs = r["step_vs_reference"]
        assert vs["compared"] == 2 * ADAPTED and vs["not_close"] == [], vs
        check_frozen(rank, r, scheme_of(case))

