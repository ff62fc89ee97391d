"""Results do not depend on the world size (gloo, CPU): with ``quant.observer_update:
step`` (the default), W data-parallel ranks and one process on the same global batch end
with the same weights and qparams, and k accumulated micro-batches equal one batch k times
their size.

Every case runs in ``_invariance_worker.py``: one launch of two ranks runs every two-rank
case the selected tests name, one launch of four ranks the four-rank ones (both launches
are module-scoped fixtures; see ``test_data_parallel.py`` for how a launch is supervised).

The model: an input Linear, two pre-norm residual blocks (LayerNorm, Linear, ReLU, add: no
statistic across the batch), a head; int8 QAT with min-max activation observers on the
blocks' Linears and moving averages (momentum 0.1) on the other Linears and the adds. Ten
SGD steps (lr 0.05) on a global batch of 16 rows whose slices have ranges of their own.
Each rank also trains the single-process reference on the whole batch and compares every
parameter, every quantizer's scale and zero point, and every observer's statistics with it.
"Float reduction order aside": DDP and FSDP2 sum the gradients in another order than one
process's mean does, so weights differ by a few ulps (at most 1.2e-7 after the ten steps,
on an AVX2 CPU; training the reference on 40 permutations of its batch rows, which moves
only the summation order, gave the same bound); the tolerance is 1e-6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_cases import uses, wanted_cases

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_invariance_worker.py")
TOL = 1e-6
# seconds for every case of a launch together (about 20 s normally, 40 s with
# observer_kinds; a 2-core machine shared with other jobs runs it several times slower)
LAUNCH_DEADLINE = 180.0
PARAMS, QUANTIZERS, ACTIVATION_QUANTIZERS = 12, 10, 6

ORDER_2 = ["float_ddp", "float_fsdp2", "ddp_step", "ddp_step_w1", "fsdp2_step",
           "compile_once_step", "accumulate_step", "ddp_forward", "accumulate_forward",
           "sync_bytes", "observer_kinds"]
ORDER_4 = ["ddp_step", "compile_once_step"]


def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             launcher: Any, order: list[str], world: int) -> Any:
    cases = wanted_cases(request, order)
    return launcher(WORKER, cases, tmp_path_factory.mktemp(f"invariance{world}"),
                    LAUNCH_DEADLINE, world=world)


@pytest.fixture(scope="module")
def run2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         dist_launcher: Any) -> Any:
    return launched(request, tmp_path_factory, dist_launcher, ORDER_2, 2)


@pytest.fixture(scope="module")
def run4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         dist_launcher: Any) -> Any:
    return launched(request, tmp_path_factory, dist_launcher, ORDER_4, 4)


def worst(diffs: dict[str, float], *prefixes: str) -> tuple[str, float]:
    picked = {k: v for k, v in diffs.items() if k.startswith(prefixes)}
    assert picked, f"nothing named {prefixes} was compared"
    name = max(picked, key=lambda k: picked[k])
    return name, picked[name]


def over(diffs: dict[str, float], tol: float) -> dict[str, float]:
    return {k: v for k, v in sorted(diffs.items()) if not v <= tol}


def check_same_as_one_process(r: dict[str, Any], where: str, quantized: bool = True) -> None:
    """``r`` (one rank's ``train`` result) matches the reference: every tensor compared,
    the comparison not vacuous, every difference within TOL."""
    assert r["only_got"] == [] and r["only_want"] == [], \
        f"{where}: names differ from the reference: {r['only_got']} / {r['only_want']}"
    names = r["diff"]
    assert sum(k.startswith("param:") for k in names) == PARAMS, sorted(names)
    if quantized:
        for kind in ("scale:", "zero_point:", "min:", "max:"):
            assert sum(k.startswith(kind) for k in names) == QUANTIZERS, (kind, sorted(names))
        # an observer that never receives statistics passes its inputs through on both
        # sides: the comparison would hold without quantizing anything
        assert r["uninitialised"] == {"graph": [], "reference": []}, \
            f"{where}: quantizers without statistics after training: {r['uninitialised']}"
    assert max(r["moved"].values()) > 1e-2, f"{where}: training did not move the weights"
    bad = over(names, TOL)
    assert not bad, (f"{where}: differs from one process on the global batch by more than "
                     f"{TOL}: {bad}")


# -- float: the harness itself ----------------------------------------------------------------
@pytest.mark.parametrize("case", ["float_ddp", "float_fsdp2"])
def test_float_training_is_world_size_invariant(run2: Any, case: str) -> None:
    """``quant.mode: none``: DDP / FSDP2 on 2 ranks equal one process (the harness: data
    split, loss scaling, reference) up to the gradient reduction's rounding."""
    for rank, r in enumerate(run2.case(case)):
        check_same_as_one_process(r, f"{case}, rank {rank}", quantized=False)


# -- step updates: the same result at every world size ------------------------------------------
@pytest.mark.parametrize(("world", "case"), [
    (1, "ddp_step_w1"),
    (2, "ddp_step"), (2, "fsdp2_step"), (2, "compile_once_step"),
    (4, "ddp_step"), (4, "compile_once_step")])
def test_step_updates_give_one_process_result(request: pytest.FixtureRequest, world: int,
                                             case: str) -> None:
    """W ranks (DDP through ``qc.distributed.wrap``; FSDP2 through ``wrap`` or sharded by
    ``compile_once``) and one process on the same global batch: every parameter, scale,
    zero point and observer statistic within 1e-6 after 10 SGD steps. At W = 1 each rank
    runs DDP over a group of its own (``dist.new_subgroups``) on the whole batch."""
    run = request.getfixturevalue("run4" if world == 4 else "run2")
    results = run.case(case)
    assert len(results) == max(world, 2)
    for rank, r in enumerate(results):
        assert r["world"] == world
        check_same_as_one_process(r, f"{case}, W={world}, rank {rank}")


@uses("ddp_step")
def test_moving_average_takes_one_update_per_step(run2: Any) -> None:
    """In the single-process reference each activation observer holds what one update per
    optimizer step with that step's batch gives: the running min / max, or the moving
    average over the 10 steps' values (the last step's included: it is applied when the
    observers are synced after training)."""
    check = run2.case("ddp_step")[0]["observer_check"]
    assert len(check) == ACTIVATION_QUANTIZERS
    kinds = {c["observer"] for c in check.values()}
    assert kinds == {"MinMaxObserver", "MovingAverageObserver"}, kinds
    for name, c in check.items():
        assert c["updates"] == 10, (name, c)
        assert c["diff"] <= TOL, f"{name} ({c['observer']}): {c['diff']} from one update per step"


@pytest.mark.parametrize("case", ["ddp_step", "accumulate_step"])
def test_no_statistics_pass_through_then_step_scales(run2: Any, case: str) -> None:
    """In the single-process reference every activation quantizer returns its input
    unchanged in the first step (no statistics yet) and quantizes in the second (with the
    first step's statistics, applied at the second step's forward)."""
    r = run2.case(case)[0]
    for run in (r["alone"], r["ddp"], r["fsdp2"]) if case == "accumulate_step" else (r,):
        seen = run["unchanged"]
        assert len(seen["activation_quantizers"]) == ACTIVATION_QUANTIZERS
        assert seen["first"] == seen["activation_quantizers"], seen
        assert seen["second"] == [], seen


# -- gradient accumulation ------------------------------------------------------------------------
@uses("accumulate_step")
def test_accumulated_micro_batches_equal_one_batch(run2: Any) -> None:
    """``qc.distributed.train_step(..., accumulate=k)``: 4 micro-batches of 4 rows in one
    process, and 2 micro-batches of 4 rows per rank under DDP and under FSDP2 on 2 ranks,
    each equal one batch of 16 rows per step."""
    for rank, r in enumerate(run2.case("accumulate_step")):
        assert [r[k]["world"] for k in ("alone", "ddp", "fsdp2")] == [1, 2, 2]
        check_same_as_one_process(r["alone"], f"accumulate=4 alone, rank {rank}")
        check_same_as_one_process(r["ddp"], f"accumulate=2 under DDP, rank {rank}")
        check_same_as_one_process(r["fsdp2"], f"accumulate=2 under FSDP2, rank {rank}")


# -- forward updates: the old semantics is not invariant (the test can fail) -----------------
@pytest.mark.parametrize("case", ["ddp_forward", "accumulate_forward"])
def test_forward_updates_depend_on_world_size(run2: Any, case: str) -> None:
    """``quant.observer_update: forward`` (each forward updates from its own slice): DDP on 2
    ranks, and 4 accumulated micro-batches in one process, end with other weights and
    qparams than one process on the whole batch; so the data and the comparison above can
    tell the two semantics apart."""
    for rank, r in enumerate(run2.case(case)):
        assert r["only_got"] == [] and r["only_want"] == []
        assert r["uninitialised"] == {"graph": [], "reference": []}
        for kind in ("param:", "scale:"):
            name, diff = worst(r["diff"], kind)
            assert diff > 10 * TOL, f"{case}, rank {rank}: every {kind} within {diff} ({name})"


# -- what the sync sends ---------------------------------------------------------------------------
def activation_bytes(r: dict[str, Any]) -> int:
    act = 4 * r["elements"]["activation"]
    assert act == 4 * 2 * ACTIVATION_QUANTIZERS  # per-tensor: one float32 min and max each
    assert r["elements"]["weight"] > r["elements"]["activation"]  # would show if sent
    return act


@uses("sync_bytes")
def test_train_step_sends_only_activation_statistics(run2: Any) -> None:
    """Under DDP a ``train_step`` of 2 micro-batches all-reduces (outside DDP's gradient
    buckets) exactly the activation observers' pending float32 min and max, once: the
    weight quantizers' per-channel min / max are never sent (the replicas agree)."""
    for rank, r in enumerate(run2.case("sync_bytes")):
        act = activation_bytes(r)
        # one fused collective per reduction kind (min, max) at most
        assert 1 <= r["train_step"]["calls"] <= 2, r["train_step"]
        assert r["train_step"]["bytes"] == act, (
            f"rank {rank}: one train_step all-reduced {r['train_step']}; the activation "
            f"statistics are {act} bytes, the weights' {4 * r['elements']['weight']}")


@uses("sync_bytes")
def test_sync_observers_sends_only_activation_statistics(run2: Any) -> None:
    """Under DDP ``qc.distributed.sync_observers(gm)`` after a hand-written step sends the
    step's pending activation statistics and nothing else (no weight min / max, no
    statistics applied already), and nothing when nothing is pending: called twice after
    a step, or after a ``train_step`` (which applied its step's statistics itself)."""
    for rank, r in enumerate(run2.case("sync_bytes")):
        act = activation_bytes(r)
        assert r["returned"]["bytes"] == act, (
            f"rank {rank}: sync_observers after a step sent {r['returned']}; the activation "
            f"statistics are {act} bytes, the weights' {4 * r['elements']['weight']}")
        assert 1 <= r["returned"]["collectives"] <= 2, r["returned"]
        assert r["again"] == {"collectives": 0, "bytes": 0}, f"rank {rank}: {r['again']}"
        assert r["after_train_step"] == {"collectives": 0, "bytes": 0}, (
            f"rank {rank}: sync_observers after a train_step sent {r['after_train_step']}")


# -- every observer kind ------------------------------------------------------------------------
KINDS = [(kind, how) for kind in ("minmax", "moving_average", "histogram", "percentile", "mse")
         for how in ("calibrate", "qat")]


@uses("observer_kinds")
@pytest.mark.parametrize(("kind", "how"), KINDS)
def test_every_observer_kind_gives_one_process_result(run2: Any, kind: str, how: str) -> None:
    """Every activation quantizer with observer ``kind``, under DDP on 2 ranks (each on
    its slice of the global batches): ``qc.calibrate`` on 3 batches, and 4 QAT steps, end
    with the qparams and observer ranges of one process on the global batches (the
    reference calibrates with ``sync=False``), within 1e-6."""
    for rank, r in enumerate(run2.case("observer_kinds")):
        got = r[kind][how]
        assert got["only_got"] == [] and got["only_want"] == [], (kind, how, got)
        assert got["uninitialised"] == {"graph": [], "reference": []}, got["uninitialised"]
        names = got["diff"]
        for k in ("scale:", "zero_point:", "min:", "max:"):
            assert sum(n.startswith(k) for n in names) == QUANTIZERS, (k, sorted(names))
        bad = over(names, TOL)
        assert not bad, f"{kind} ({how}), rank {rank}: differs from one process: {bad}"
