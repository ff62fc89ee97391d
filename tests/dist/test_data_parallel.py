"""Data parallelism on 2 ranks (gloo, CPU): DDP / FSDP2 through ``qc.distributed.wrap``,
observer synchronisation, ``compile_once`` and the compile cache shared by the ranks.

Every case runs in ``_data_parallel_worker.py``: the tests selected in this session name
their cases, one launch of two worker processes (a FileStore rendezvous in a temporary
folder: no port to find) runs all of them in one process group, and each test asserts on
the JSON both ranks wrote. The launch is supervised: when one rank fails the other is
killed after a short grace period, and the whole launch has a deadline; both ranks use a
process-group timeout, so a crashed peer never leaves a test hanging.

Training data: each step's global batch is split between the ranks; the single-process
reference trains on the whole batch (loss = mean over it), which is what DDP's and FSDP2's
gradient averaging computes. "Fixed scales" means one observing forward on the same data on
both ranks, then ``qc.freeze``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from dist_cases import uses, wanted_cases

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_data_parallel_worker.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
TOL = 1e-6
GRAD_TOL = 1e-5
LAUNCH_DEADLINE = 120.0  # seconds for every case of a launch together (about 20 s normally)
GRACE = 5.0  # seconds a rank may outlive its failed peer before it is killed

# every case the worker knows, in the order one launch runs them; the cases after
# "wrong_order" record known failures, and compile_once_static_synced (which leaves the
# process group unusable) must stay last
ORDER = ["ddp_qat_observers", "ddp_fixed_scales", "static_calibration", "static_algorithms",
         "fused_sync",
         "fsdp2_fixed_scales", "fsdp2_learnable_grads", "fsdp2_bf16", "fsdp2_state_dict",
         "compile_once_qat", "compile_once_static", "cache_shared", "cache_concurrent",
         "hand_written_ddp", "wrong_order", "ddp_learnable_from_scratch",
         "fsdp2_learnable_from_scratch",
         "fsdp2_bf16_learnable", "compile_once_static_synced"]


@pytest.fixture(scope="module")
def dist_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             dist_launcher: Any
             ) -> Any:
    cases = wanted_cases(request, ORDER)
    return dist_launcher(WORKER, cases, tmp_path_factory.mktemp("data_parallel"), LAUNCH_DEADLINE)


def worst(diffs: dict[str, float]) -> tuple[str, float]:
    name = max(diffs, key=lambda k: diffs[k])
    return name, diffs[name]


# -- 1. DDP QAT with observers on -----------------------------------------------------------
@uses("ddp_qat_observers")
def test_ddp_qat_with_observers_stays_identical_across_ranks(dist_run: Any) -> None:
    """20 SGD steps, a different batch on each rank, observers on: after every step every
    parameter, buffer, observer statistic and qparam is bit-identical to rank 0's."""
    r0, r1 = dist_run.case("ddp_qat_observers")
    for rank, r in enumerate((r0, r1)):
        assert r["observing"], f"rank {rank}: the observers were switched off"
        assert sorted(r["differing"], key=int) == [str(s) for s in range(1, 21)]
        for step in ("1", "5", "10", "20"):  # named for the report; every step is checked
            assert r["differing"][step] == [], f"after step {step}: {r['differing'][step]}"
        bad = {step: names for step, names in r["differing"].items() if names}
        assert not bad, f"rank {rank}: tensors differing from rank 0's after steps {bad}"
    tensors = r0["tensors"]
    for kind in (".weight", ".bias", ".scale", ".zero_point", ".observer.min_val",
                 ".observer.max_val", ".mode_flags"):
        assert any(t.endswith(kind) for t in tensors), f"no {kind} tensor was compared"


@uses("ddp_qat_observers")
def test_ddp_observer_sync_reduces_like_one_observer(dist_run: Any) -> None:
    """After a step each observer holds exactly what the issue specifies from the ranks'
    own updates: the mean for moving averages, min of mins / max of maxes for min-max;
    the ranks' own activation statistics did differ (different data)."""
    r0, r1 = dist_run.case("ddp_qat_observers")
    for rank, r in enumerate((r0, r1)):
        for step, check in r["mean_check"].items():
            assert len(check["quantizers"]) == 7  # 3 layers x 2, the model input's
            assert check["wrong"] == [], f"rank {rank}, step {step}: {check['wrong']}"
            assert sorted(check["local_differs"]) == [
                "0.output_fake_quant", "2.output_fake_quant", "4.output_fake_quant",
                "input_input_fake_quant"], \
                f"rank {rank}, step {step}: the ranks' activation statistics did not differ"


# -- 2. DDP with fixed scales vs one process --------------------------------------------------
@uses("ddp_fixed_scales")
def test_ddp_fixed_scales_match_single_process(dist_run: Any) -> None:
    r0, r1 = dist_run.case("ddp_fixed_scales")
    for rank, r in enumerate((r0, r1)):
        assert r["qparams_fixed"]
        assert len(r["param_diff"]) == 6
        name, diff = worst(r["param_diff"])
        assert diff <= TOL, f"rank {rank}: {name} differs from one process by {diff}"
        assert r["moved"] > 1e-2, "training did not move the parameters"


# -- 3. static calibration, different data per rank -------------------------------------------
@uses("static_algorithms")
def test_data_driven_algorithms_use_every_ranks_data(dist_run: Any) -> None:
    """gptq + bias_correction with a different calibration set per rank: the weights and
    biases are bit-identical on both ranks, and match one process running on both ranks'
    batches (up to the order in which the statistics were summed), while a rank's own
    data alone gives other weights."""
    for rank, r in enumerate(dist_run.case("static_algorithms")):
        assert r["differ_across_ranks"] == [], f"rank {rank}: {r['differ_across_ranks']}"
        assert r["records"] == ["round_gptq.calibrate", "correct_bias.calibrate"]
        assert r["max_param_gap"] < 1e-4, r
        assert r["out_gap"] < 1e-4, r
        assert r["own_data_gap"] > 1e-3, r


@uses("static_calibration")
def test_static_calibration_syncs_to_all_data(dist_run: Any) -> None:
    """Each rank calibrates on its own batches; ``qc.calibrate`` syncs at its end, so every
    rank's observer statistics and qparams equal one process calibrating on both ranks'
    batches — bit for bit — although each rank's own data alone gives different qparams."""
    r0, r1 = dist_run.case("static_calibration")
    for rank, r in enumerate((r0, r1)):
        assert len(r["want"]) == 7  # 3 layers x 2, the model input's
        assert r["mismatch"] == [], (
            f"rank {rank}: " + "; ".join(f"{n}: {r['got'][n]} != {r['want'][n]}"
                                         for n in r["mismatch"]))
        assert r["own_data_differs"], f"rank {rank}: its own data gives the same qparams"
        assert all(f == [True, False] for f in r["flags"].values()), r["flags"]
    assert r0["scale_bits"] == r1["scale_bits"]
    assert r0["own_data_differs"] != [] and r1["own_data_differs"] != []


# -- 4. the sync is fused -----------------------------------------------------------------------
@uses("fused_sync")
def test_observer_sync_is_fused(dist_run: Any) -> None:
    """At most 3 collectives per training step (one per reduction kind), the same for 7 and
    13 quantizers (the layers' and the model input's), sending exactly the activation
    observers' float32 statistics (DDP replicas agree on their weights: weight statistics
    are never reduced)."""
    for rank, r in enumerate(dist_run.case("fused_sync")):
        layers3, layers6 = r["3"]["quantizers"] - 1, r["6"]["quantizers"] - 1
        assert layers3 >= 6 and layers6 == 2 * layers3
        counts = set()
        for layers, run in r.items():
            elements = run["observer_elements"]
            for step, s in enumerate(run["per_step"]):
                assert 1 <= len(s["calls"]) <= 3, \
                    f"rank {rank}, {layers} layers, step {step}: {s['calls']}"
                assert set(s["calls"]) == {"all_reduce"}, s["calls"]
                assert s["bytes"] == 4 * elements, (layers, step, s["bytes"], elements)
                counts.add(len(s["calls"]))
            # one collective per reduction kind the activation observers use
            assert run["direct"]["bytes"] == 4 * elements, run["direct"]
            assert run["direct"]["collectives"] == len(s["calls"]), run["direct"]
        assert len(counts) == 1, f"rank {rank}: the count grows with the quantizers: {counts}"


# -- 5. FSDP2 -------------------------------------------------------------------------------------
@uses("fsdp2_fixed_scales")
def test_fsdp2_fixed_scales_match_single_process(dist_run: Any) -> None:
    r0, r1 = dist_run.case("fsdp2_fixed_scales")
    for rank, r in enumerate((r0, r1)):
        assert r["qparams_fixed"]
        assert len(r["param_diff"]) == 6
        name, diff = worst(r["param_diff"])
        assert diff <= TOL, f"rank {rank}: full {name} differs from one process by {diff}"
        assert r["moved"] > 1e-2, "training did not move the parameters"


@uses("fsdp2_learnable_grads")
def test_fsdp2_learnable_weight_gradients_match_single_process(dist_run: Any) -> None:
    """Learnable (LSQ) scales: one step's gradients of the weights, biases and weight
    scales equal the single-process gradients on the concatenated batch."""
    for rank, r in enumerate(dist_run.case("fsdp2_learnable_grads")):
        assert r["learnable"] and r["no_grad"] == []
        checked = {n: d for n, d in r["grad_diff"].items() if n not in r["act_scales"]}
        assert set(r["weight_scales"]) <= set(checked) and len(checked) == 9
        name, diff = worst(checked)
        assert diff <= GRAD_TOL, f"rank {rank}: gradient of {name} differs by {diff}"


@uses("fsdp2_learnable_grads")
def test_fsdp2_learnable_activation_scale_gradients_match_single_process(
        dist_run: Any) -> None:
    for rank, r in enumerate(dist_run.case("fsdp2_learnable_grads")):
        for name in r["act_scales"]:
            assert r["grad_diff"][name] <= GRAD_TOL, (
                f"rank {rank}: gradient of {name} differs by {r['grad_diff'][name]} "
                f"(ratio to one process {r['ratio'].get(name)})")


@uses("fsdp2_bf16")
def test_fsdp2_bf16_mixed_precision_keeps_fp32_scales(dist_run: Any) -> None:
    """``mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16)`` through ``wrap``, fixed
    scales: 3 steps run, activations really are bf16, every quantizer's scale is float32
    in its forward and in storage."""
    for rank, r in enumerate(dist_run.case("fsdp2_bf16")):
        assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"])
        seen = r["scale_dtypes_in_forward"]
        assert "torch.bfloat16" in seen.pop("<inputs>"), "the bf16 policy was not applied"
        assert sorted(seen) == r["quantizers"], "some quantizer never ran"
        assert all(d == ["torch.float32"] for d in seen.values()), f"rank {rank}: {seen}"
        assert set(r["scale_dtypes_stored"].values()) == {"torch.float32"}


@uses("fsdp2_bf16_learnable")
def test_fsdp2_bf16_mixed_precision_with_learnable_scales(dist_run: Any) -> None:
    for rank, r in enumerate(dist_run.case("fsdp2_bf16_learnable")):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"])
        seen = r["scale_dtypes_in_forward"]
        seen.pop("<inputs>")
        assert sorted(seen) == r["quantizers"]
        assert all(d == ["torch.float32"] for d in seen.values()), seen
        assert set(r["scale_dtypes_stored"].values()) == {"torch.float32"}


@uses("fsdp2_state_dict")
def test_fsdp2_full_state_dict_round_trips(dist_run: Any) -> None:
    """``get_model_state_dict(full_state_dict=True)`` gives plain full tensors that load
    (strictly) into a freshly compiled single-process graph with the same outputs."""
    for rank, r in enumerate(dist_run.case("fsdp2_state_dict")):
        assert r["keys"] == r["fresh_keys"]
        assert r["plain"] == r["keys"], "some values are not plain (full) tensors"
        bad = {k: s for k, s in r["shapes"].items() if s[0] != s[1]}
        assert not bad, f"rank {rank}: shapes differ from the single-process graph: {bad}"
        assert r["out_norm"] > 0
        assert r["out_diff"] <= TOL, f"rank {rank}: outputs differ by {r['out_diff']}"
        assert r["fresh_flags"] == r["flags"]


# -- 6. compile_once ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["compile_once_qat", "compile_once_static"])
def test_compile_once_ranks_agree_bit_for_bit(dist_run: Any, case: str) -> None:
    """Every parameter, buffer and the output on one input are bit-identical across ranks
    and equal to compiling (and calibrating) the real model in one process; quantizer
    flags agree (static: calibrated, so observe off)."""
    r0, r1 = dist_run.case(case)
    for rank, r in enumerate((r0, r1)):
        assert r["differing"] == [], f"rank {rank}: differing from rank 0: {r['differing']}"
        assert r["meta_left"] == [], f"rank {rank}: still on meta: {r['meta_left']}"
        assert r["vs_local_compile"] == [], f"rank {rank}: {r['vs_local_compile']}"
    assert r0["flags"] == r1["flags"] and len(r0["flags"]) == 7  # + the model input's
    want = [True, False] if case == "compile_once_static" else [True, True]
    assert all(f == want for f in r0["flags"].values()), r0["flags"]


@uses("compile_once_qat", "compile_once_static")
def test_compile_once_only_rank0_materialises_the_model(dist_run: Any) -> None:
    """Every rank builds the model on meta first (free: how a wrapped model or the user's
    own model is recognised on every rank alike); only rank 0 builds it for real."""
    for case in ("compile_once_qat", "compile_once_static"):
        r0, r1 = dist_run.case(case)
        assert r0["built_on"] == ["meta", "cpu"], f"{case}: rank 0 built on {r0['built_on']}"
        assert r1["built_on"] == ["meta"], f"{case}: rank 1 built on {r1['built_on']}"


@uses("compile_once_static_synced")
def test_compile_once_calibrates_with_default_sync_observers(dist_run: Any) -> None:
    r0, r1 = dist_run.case("compile_once_static_synced")
    for rank, r in enumerate((r0, r1)):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["differing"] == [] and r["vs_local_compile"] == []
    assert r0["built_on"] == ["meta", "cpu"] and r1["built_on"] == ["meta"]
    assert all(f == [True, False] for f in r0["flags"].values())


# -- 7. the compile cache shared by the ranks ---------------------------------------------------
@uses("cache_shared")
def test_compile_once_cache_miss_then_hit(dist_run: Any) -> None:
    r0, r1 = dist_run.case("cache_shared")
    assert "compile cache: miss" in r0["first"]["notes"], r0["first"]["notes"]
    assert "compile cache: hit" in r0["second"]["notes"], r0["second"]["notes"]
    for rank, r in enumerate((r0, r1)):
        assert len(r["first"]["entries"]) == 1, f"rank {rank}: {r['first']['entries']}"
        assert r["second"]["entries"] == r["first"]["entries"], "the hit wrote a new entry"
        for call in ("first", "second"):
            assert r[call]["differing"] == [], f"rank {rank}, {call} call"
            assert all(f == [True, False] for f in r[call]["flags"].values())
        assert r["second_vs_first"] == [], f"rank {rank}: the hit restored other values"


@uses("cache_concurrent")
def test_concurrent_writers_leave_one_valid_entry(dist_run: Any) -> None:
    """Both ranks ``CompileCache(dir).store(key, gm)`` at the same moment, for a fresh key
    and again over the existing entry: one entry per key, no temporary leftovers, and it
    loads (hash-checked) with the stored state."""
    for rank, r in enumerate(dist_run.case("cache_concurrent")):
        assert len(r["rounds"]) == 8
        keys: list[str] = []
        for i, rnd in enumerate(r["rounds"]):
            if rnd["key"] not in keys:
                keys.append(rnd["key"])
            assert rnd["why"] == "hit", f"rank {rank}, round {i}: {rnd['why']}"
            assert rnd["same"], f"rank {rank}, round {i}: the entry holds another state"
            assert rnd["entries"] == sorted(keys), \
                f"rank {rank}, round {i}: folder holds {rnd['entries']}"


# -- 8. wrong order -----------------------------------------------------------------------------
@uses("wrong_order")
def test_compiling_a_wrapped_model_is_refused(dist_run: Any) -> None:
    for rank, r in enumerate(dist_run.case("wrong_order")):
        ddp, sharded = r["ddp"], r["fully_shard"]
        assert ddp["raised"] == "QCompileError", f"rank {rank}: {ddp}"
        assert "DistributedDataParallel" in ddp["message"]
        assert ".module" in ddp["fix"] and "qc.distributed.wrap(gm, spec)" in ddp["fix"], ddp["fix"]
        assert sharded["raised"] == "QCompileError", f"rank {rank}: {sharded}"
        assert "fully_shard" in sharded["message"] and "fsdp2" in sharded["fix"]


# -- 9. hand-written DDP loops ------------------------------------------------------------------
@uses("hand_written_ddp")
def test_hand_written_ddp_without_sync_warns_once(dist_run: Any) -> None:
    """A bare ``DistributedDataParallel(gm)`` with observers on and different data per rank:
    the scales drift apart, and each rank is told once, naming the two remedies."""
    for rank, r in enumerate(dist_run.case("hand_written_ddp")):
        run = r["ddp"]
        assert len(run["warnings"]) == 1, f"rank {rank}: {run['warnings']}"
        assert "qc.distributed.wrap(gm, spec)" in run["warnings"][0]
        assert "qc.distributed.sync_observers(gm)" in run["warnings"][0]
        assert run["differing"], "the unsynchronised scales did not drift (a weak test)"


@pytest.mark.parametrize("how", ["ddp+sync", "wrap"])
def test_synced_ddp_loops_do_not_warn_and_agree(dist_run: Any, how: str) -> None:
    """Calling ``qc.distributed.sync_observers(gm)`` by hand after every forward, or
    ``qc.distributed.wrap``: no warning, every scale and zero point bit-identical."""
    for rank, r in enumerate(dist_run.case("hand_written_ddp")):
        run = r[how]
        assert run["warnings"] == [], f"rank {rank}: {run['warnings']}"
        # 3 layers x 2 and the model input's
        assert run["quantizers"] == 7 and run["differing"] == [], run["differing"]


test_synced_ddp_loops_do_not_warn_and_agree.dist_cases = ("hand_written_ddp",)


# -- learnable scales from the first step --------------------------------------------------------
@uses("ddp_learnable_from_scratch")
def test_ddp_learnable_scales_train_from_the_first_step(dist_run: Any) -> None:
    """Compile with learnable scales, wrap in DDP, train 2 steps on different data per
    rank: it runs and the scales are initialised and identical across ranks."""
    for rank, r in enumerate(dist_run.case("ddp_learnable_from_scratch")):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["differing"] == [] and r["uninitialised"] == []


@uses("fsdp2_learnable_from_scratch")
def test_fsdp2_learnable_scales_train_from_the_first_step(dist_run: Any) -> None:
    for rank, r in enumerate(dist_run.case("fsdp2_learnable_from_scratch")):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["differing"] == [] and r["uninitialised"] == [], r["uninitialised"]
