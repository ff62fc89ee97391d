"""One rank of the 2-process data-parallel tests (``test_data_parallel.py`` launches two).

Run as a script, never imported from the tests folder::

    python tests/dist/_data_parallel_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and either ``QC_DIST_INIT`` (an ``init_method`` URL, e.g.
``file:///tmp/x/store``) or torchrun's ``MASTER_ADDR``/``MASTER_PORT`` in the environment,
so ``torchrun --standalone --nproc_per_node=2 tests/dist/_data_parallel_worker.py OUT
ddp_qat_observers`` works too when debugging. Each rank writes ``OUTDIR/rank<r>.json``
(``{case: result}``) after every case; the test asserts on those.

Data: every step has a global batch of ``2 * LOCAL`` rows drawn from a generator seeded by
the step, so every rank can rebuild all of it; rank ``r`` trains on rows
``[r * LOCAL, (r + 1) * LOCAL)`` and the single-process reference on all rows (loss = mean
over the global batch, which is what DDP / FSDP2 gradient averaging computes).

An unexpected exception is recorded (``{"crash": traceback}``) and the rank exits at once
with status 1 so that its peer fails on the broken connection (or the process-group
timeout) instead of waiting forever. The ``*_from_scratch`` and ``fsdp2_bf16_learnable``
cases exercise known failures that raise on both ranks at the same point: their exception
is recorded as ``{"error": ...}`` and the launch goes on (they run late).
``compile_once_static_synced`` exercises a known deadlock: it re-creates the process group
with a short timeout, records the error, and ends the rank (it must run last).
"""

from __future__ import annotations

import datetime
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _worker_main import cases_in, error_of, run_cases
from torch import nn

import qcompile as qc
from qcompile.distributed.cache import CompileCache

LOCAL, D_IN, D_OUT = 8, 8, 4
LR = 0.05
PG_TIMEOUT = datetime.timedelta(seconds=30)
OUTDIR = Path(".")


# -- models and data ------------------------------------------------------------------------
def mlp(layers: int = 3, width: int = 16) -> nn.Module:
    """Linear/ReLU stack: every Linear gets a weight and an output quantizer under int8-*."""
    torch.manual_seed(0)
    dims = [D_IN] + [width] * (layers - 1) + [D_OUT]
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def global_batch(step: int, scale_rank1: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch (2 * LOCAL rows); rank 1's rows optionally scaled so the
    two ranks' statistics differ clearly."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(2 * LOCAL, D_IN, generator=g)
    x[LOCAL:] *= scale_rank1
    y = torch.randn(2 * LOCAL, D_OUT, generator=g)
    return x, y


def local(t: torch.Tensor) -> torch.Tensor:
    r = dist.get_rank()
    return t[r * LOCAL:(r + 1) * LOCAL]


def qat_spec(kind: str = "none", learnable: bool = False, sync: bool = True) -> dict[str, Any]:
    """int8-qat with observers updating in every forward (``observer_update: forward``):
    these cases test that per-forward synchronisation; step updates, and results that do
    not depend on the world size, are ``test_world_size_invariance.py``'s."""
    spec = qc.load_spec("int8-qat").model_dump()
    spec["data_parallel"] = {"kind": kind}
    spec["quant"]["sync_observers"] = sync
    spec["quant"]["observer_update"] = "forward"
    if learnable:
        for rule in spec["quant"]["rules"]:
            for role in ("weight", "activation"):
                if rule.get(role):
                    rule[role]["learnable"] = True
    return spec


def plain(name: str) -> str:
    """A graph's name without the child graph it sits in (``data_parallel: fsdp2`` compiles
    one child graph per block): the model's own name."""
    return re.sub(r"^stage_\d+\.", "", name)


def plain_items(items: Any) -> list[tuple[str, Any]]:
    return [(plain(n), v) for n, v in items]


def static_spec(sync: bool = True) -> dict[str, Any]:
    spec = qc.load_spec("int8-static").model_dump()
    spec["quant"]["sync_observers"] = sync
    return spec


def compiled(spec: dict[str, Any], layers: int = 3) -> Any:
    return qc.qcompile(mlp(layers), spec, example_inputs=(torch.randn(2, D_IN),))


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# -- comparing across ranks -----------------------------------------------------------------
def all_tensors(gm: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (qparams, observer statistics, flags) by name."""
    out = dict(gm.state_dict())
    out.update(dict(plain_items(gm.named_buffers())))
    out.update(dict(plain_items(gm.named_parameters())))
    return {k: full(v) for k, v in sorted(out.items())}


def differing_from_rank0(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensor is not bit-identical to rank 0's (every rank sends the same
    names in the same order)."""
    bad = []
    for name, t in tensors.items():
        theirs = t.clone().contiguous()
        dist.broadcast(theirs, src=0)
        if not torch.equal(theirs, t):
            bad.append(name)
    return bad


def gather_bad(local_bad: list[str]) -> list[str]:
    """The union of every rank's list."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local_bad)
    return sorted({n for b in everyone for n in b})


def flags(gm: nn.Module) -> dict[str, list[bool]]:
    return {n: [bool(q.enabled), bool(q.observe)]
            for n, q in plain_items(qc.quantizers(gm).items())}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: (a[k].float() - b[k].float()).abs().max().item() for k in sorted(a)}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def observed_then_frozen(spec: dict[str, Any], layers: int = 3) -> tuple[Any, Any]:
    """(graph, reference): one observing forward on the same data on every rank, then
    ``qc.freeze``; the reference is a second compile loaded with the same state."""
    gm = compiled(spec, layers)
    x, _ = global_batch(-1)
    with torch.no_grad():
        gm(x)
    qc.freeze(gm)
    ref = compiled({**spec, "data_parallel": {"kind": "none"}}, layers)
    ref.load_state_dict(gm.state_dict())
    return gm, ref


def train_against_reference(spec: dict[str, Any], steps: int) -> dict[str, Any]:
    """Fixed scales, ``spec.data_parallel`` on local rows vs one process on all rows."""
    gm, ref = observed_then_frozen(spec)
    start = {n: full(p) for n, p in ref.named_parameters()}
    model = qc.distributed.wrap(gm, spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        mse(model(local(x)), local(y)).backward()
        opt.step()
        ref_opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
    got = {n: full(p) for n, p in plain_items(gm.named_parameters())}
    want = {n: full(p) for n, p in ref.named_parameters()}
    return {"param_diff": max_diff(got, want),
            "moved": max(max_diff(want, start).values()),
            "qparams_fixed": all(not q.observe for q in qc.quantizers(gm).values())}


# -- 1. DDP QAT with observers on -----------------------------------------------------------
def case_ddp_qat_observers() -> dict[str, Any]:
    spec = qat_spec("ddp")
    gm = compiled(spec)
    ref = compiled({**spec, "data_parallel": {"kind": "none"}})  # unwrapped: never syncs
    model = qc.distributed.wrap(gm, spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    differing: dict[str, list[str]] = {}
    mean_check: dict[str, Any] = {}
    for step in range(20):
        x, y = global_batch(step, scale_rank1=3.0)
        if step in (0, 7):
            # what this rank's observers would hold without synchronisation
            ref.load_state_dict(gm.state_dict())
            with torch.no_grad():
                ref(local(x))
            mine = {n: torch.stack([q.observer.min_val, q.observer.max_val])
                    for n, q in qc.quantizers(ref).items()}
        opt.zero_grad()
        mse(model(local(x)), local(y)).backward()
        opt.step()
        differing[str(step + 1)] = gather_bad(differing_from_rank0(all_tensors(gm)))
        if step in (0, 7):
            names, wrong, local_differs = [], [], []
            for n, q in plain_items(qc.quantizers(gm).items()):
                everyone = [torch.empty_like(mine[n]) for _ in range(dist.get_world_size())]
                dist.all_gather(everyone, mine[n])
                stacked = torch.stack(everyone)
                if q.observer.__class__.__name__ == "MovingAverageObserver":
                    expected = stacked.sum(0) / len(everyone)
                else:  # min of mins, max of maxes
                    expected = torch.stack([stacked[:, 0].amin(0), stacked[:, 1].amax(0)])
                got = torch.stack([q.observer.min_val, q.observer.max_val])
                names.append(n)
                if not torch.equal(got, expected):
                    wrong.append(f"{n}: {got.tolist()} != {expected.tolist()}")
                if not torch.equal(everyone[0], everyone[1]):
                    local_differs.append(n)
            mean_check[str(step + 1)] = {"quantizers": names, "wrong": wrong,
                                         "local_differs": local_differs}
    return {"differing": differing, "mean_check": mean_check,
            "tensors": sorted(all_tensors(gm)),
            "observing": all(q.observe for q in qc.quantizers(gm).values())}


# -- 2. DDP with fixed scales vs one process ------------------------------------------------
def case_ddp_fixed_scales() -> dict[str, Any]:
    return train_against_reference(qat_spec("ddp"), steps=20)


# -- 3. static calibration, different data per rank -----------------------------------------
def calibration_batches(rank: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(500 + rank)
    shift = (3.0, -3.0)[rank]  # each rank holds some of the extremes
    return [(torch.randn(LOCAL, D_IN, generator=g) + shift,) for _ in range(3)]


def qparams(gm: nn.Module) -> dict[str, dict[str, list[Any]]]:
    return {n: {"scale": q.scale.tolist(), "zero_point": q.zero_point.tolist(),
                "min": q.observer.min_val.tolist(), "max": q.observer.max_val.tolist()}
            for n, q in plain_items(qc.quantizers(gm).items())}


def case_static_calibration() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gm = compiled(static_spec())
    qc.calibrate(gm, calibration_batches(rank))  # syncs at its end
    everything = [b for r in range(world) for b in calibration_batches(r)]
    ref = compiled(static_spec(sync=False))
    qc.calibrate(ref, everything)
    alone = compiled(static_spec(sync=False))
    qc.calibrate(alone, calibration_batches(rank))
    got, want, own = qparams(gm), qparams(ref), qparams(alone)
    scales_bits = {n: [q.scale.view(torch.int32).tolist(), q.zero_point.tolist()]
                   for n, q in plain_items(qc.quantizers(gm).items())}
    return {"got": got, "want": want,
            "mismatch": sorted(n for n in want if got[n] != want[n]),
            "own_data_differs": sorted(n for n in want if own[n] != want[n]),
            "flags": flags(gm), "scale_bits": scales_bits}


# -- 3b. data-driven PTQ algorithms, different data per rank ---------------------------------
def algorithms_spec(sync: bool = True) -> dict[str, Any]:
    spec = static_spec(sync)
    spec["quant"]["algorithms"] = [{"kind": "gptq", "block_size": 4}, {"kind": "bias_correction"}]
    for rule in spec["quant"]["rules"]:
        if rule.get("weight"):
            rule["weight"]["dtype"] = "int4"
    return spec


def case_static_algorithms() -> dict[str, Any]:
    """GPTQ's Hessians and bias correction's means are summed across the ranks: every rank
    rounds and corrects the same way, from both ranks' data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gm = compiled(algorithms_spec())
    qc.calibrate(gm, calibration_batches(rank))
    everything = [b for r in range(world) for b in calibration_batches(r)]
    ref = compiled(algorithms_spec(sync=False))
    qc.calibrate(ref, everything)
    alone = compiled(algorithms_spec(sync=False))
    qc.calibrate(alone, calibration_batches(rank))
    names = [n for n, _ in plain_items(gm.named_parameters())]
    got, want = dict(plain_items(gm.named_parameters())), dict(ref.named_parameters())
    mine = dict(alone.named_parameters())
    x = torch.cat([b[0] for b in everything])
    with torch.no_grad():
        out_gap = float((gm(x) - ref(x)).abs().max() / ref(x).abs().max())
    return {"differ_across_ranks": differing_from_rank0({n: got[n].detach() for n in names}),
            "max_param_gap": max(float((got[n] - want[n]).abs().max()) for n in names),
            "own_data_gap": max(float((mine[n] - want[n]).abs().max()) for n in names),
            "out_gap": out_gap, "records": [p.name for p in qc.report(gm).passes[-2:]]}


# -- 4. the sync is fused --------------------------------------------------------------------
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "reduce",
               "all_reduce_coalesced", "all_gather_object", "broadcast_object_list")


class CountCollectives:
    """Counts Python-level collectives (and all_reduce bytes) while active."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.bytes = 0
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> CountCollectives:
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def shim(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
                self.calls.append(_name)
                if _name == "all_reduce":
                    t = args[0] if args else kwargs["tensor"]
                    self.bytes += t.numel() * t.element_size()
                return _fn(*args, **kwargs)

            setattr(dist, name, shim)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def observer_elements(gm: nn.Module) -> int:
    """The activation observers' statistics: DDP replicas agree on the weights, so weight
    quantizers' statistics are never sent."""
    return sum(q.observer.min_val.numel() + q.observer.max_val.numel()
               for q in qc.quantizers(gm).values() if q.observer is not None and not q.weight)


def case_fused_sync() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layers in (3, 6):
        spec = qat_spec("ddp")
        gm = compiled(spec, layers)
        model = qc.distributed.wrap(gm, spec)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        per_step = []
        for step in range(3):
            x, y = global_batch(step, scale_rank1=2.0)
            with CountCollectives() as counter:
                opt.zero_grad()
                mse(model(local(x)), local(y)).backward()
                opt.step()
            per_step.append({"calls": counter.calls, "bytes": counter.bytes})
        direct = qc.distributed.sync_observers(gm, everything=True)
        out[str(layers)] = {"quantizers": len(qc.quantizers(gm)), "per_step": per_step,
                            "direct": direct, "observer_elements": observer_elements(gm)}
    return out


# -- 5. FSDP2 ---------------------------------------------------------------------------------
def case_fsdp2_fixed_scales() -> dict[str, Any]:
    return train_against_reference(qat_spec("fsdp2"), steps=10)


def initialised_learnable(spec: dict[str, Any]) -> tuple[Any, Any]:
    """(graph, reference) with learnable scales initialised by one observing forward on
    the same data on every rank; ``sync_observers`` marks the statistics as shared so the
    wrapped graph's first forward does not re-initialise them."""
    gm = compiled(spec)
    x, _ = global_batch(-1)
    with torch.no_grad():
        gm(x)
    qc.distributed.sync_observers(gm)
    ref = compiled({**spec, "data_parallel": {"kind": "none"}})
    ref.load_state_dict(gm.state_dict())
    return gm, ref


def case_fsdp2_learnable_grads() -> dict[str, Any]:
    spec = qat_spec("fsdp2", learnable=True)
    gm, ref = initialised_learnable(spec)
    weight_q = [plain(n) for n in qc.quantizers(gm) if n.endswith("weight_fake_quant")]
    # activation quantizers: the layers' outputs and the model input
    act_q = [plain(n) for n in qc.quantizers(gm) if not n.endswith("weight_fake_quant")]
    model = qc.distributed.wrap(gm, spec)
    x, y = global_batch(0, scale_rank1=2.0)
    mse(model(local(x)), local(y)).backward()
    mse(ref(x), y).backward()
    got = {n: full(p.grad) for n, p in plain_items(gm.named_parameters()) if p.grad is not None}
    want = {n: full(p.grad) for n, p in ref.named_parameters() if p.grad is not None}
    diff = {n: (got[n] - want[n]).abs().max().item() for n in want if n in got}
    ratio = {n: (got[n].norm() / want[n].norm()).item() for n in want
             if n in got and want[n].norm() > 0}
    return {"grad_diff": diff, "ratio": ratio, "no_grad": sorted(set(want) - set(got)),
            "weight_scales": [f"{n}.scale_offset" for n in weight_q],
            "act_scales": [f"{n}.scale_offset" for n in act_q],
            "learnable": all(q.learnable for q in qc.quantizers(gm).values())}


def bf16_run(learnable: bool) -> dict[str, Any]:
    """3 steps under ``MixedPrecisionPolicy(param_dtype=bfloat16)`` passed through
    ``qc.distributed.wrap``; records the scale dtype each quantizer sees in its forward.
    An exception is recorded as ``error`` (it is raised on both ranks at the same point)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    spec = qat_spec("fsdp2", learnable=learnable)
    gm = initialised_learnable(spec)[0] if learnable else observed_then_frozen(spec)[0]
    seen: dict[str, set[str]] = {}

    def record(module: nn.Module, args: Any) -> None:
        seen.setdefault(module._qc_name, set()).add(str(module.scale.dtype))  # type: ignore[attr-defined]
        seen.setdefault("<inputs>", set()).add(str(args[0].dtype))

    for name, q in plain_items(qc.quantizers(gm).items()):
        q._qc_name = name
        q.register_forward_pre_hook(record)
    model = qc.distributed.wrap(gm, spec,
                                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[float] = []
    error = None
    try:
        for step in range(3):
            x, y = global_batch(step)
            opt.zero_grad()
            loss = mse(model(local(x)), local(y))
            loss.backward()
            opt.step()
            losses.append(loss.item())
    except Exception as e:
        error = f"{type(e).__name__}: {e}".strip().splitlines()[-1][:400]
    return {"error": error, "losses": losses,
            "scale_dtypes_in_forward": {n: sorted(s) for n, s in seen.items()},
            "scale_dtypes_stored": {n: str(q.scale.dtype)
                                    for n, q in plain_items(qc.quantizers(gm).items())},
            "quantizers": sorted(plain(n) for n in qc.quantizers(gm))}


def case_fsdp2_bf16() -> dict[str, Any]:
    out = bf16_run(learnable=False)
    if out["error"]:
        raise RuntimeError(out["error"])
    return out


def case_fsdp2_state_dict() -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    spec = qat_spec("fsdp2")
    gm, _ = observed_then_frozen(spec)
    model = qc.distributed.wrap(gm, spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        x, y = global_batch(step)
        opt.zero_grad()
        mse(model(local(x)), local(y)).backward()
        opt.step()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    fresh = compiled({**spec, "data_parallel": {"kind": "none"}})
    fresh_state = fresh.state_dict()
    plain = sorted(k for k, v in state.items() if type(v) is torch.Tensor)
    shapes = {k: [list(v.shape), list(fresh_state[k].shape)] for k, v in state.items()
              if k in fresh_state}
    fresh.load_state_dict(state)  # strict
    x, _ = global_batch(99)
    with torch.no_grad():
        got = model(x)
        want = fresh(x)
    return {"keys": sorted(state), "fresh_keys": sorted(fresh_state), "plain": plain,
            "shapes": shapes, "out_diff": (got - want).abs().max().item(),
            "out_norm": want.norm().item(), "fresh_flags": flags(fresh), "flags": flags(gm)}


# -- 6. compile_once --------------------------------------------------------------------------
BUILT_ON: list[str] = []


def build_recording() -> nn.Module:
    model = mlp()
    BUILT_ON.append(next(model.parameters()).device.type)
    return model


def compile_once_case(spec: dict[str, Any], calibration: Any) -> dict[str, Any]:
    BUILT_ON.clear()
    gm = qc.distributed.compile_once(build_recording, spec, (torch.randn(2, D_IN),),
                                     calibration=calibration)
    built = list(BUILT_ON)
    tensors = all_tensors(gm)
    x, _ = global_batch(7)
    with torch.no_grad():
        tensors["<output>"] = gm.eval()(x)
    gm.train()
    # what compiling (and calibrating) the real model in this process gives
    ref = qc.qcompile(mlp(), {**spec, "quant": {**spec["quant"], "sync_observers": False}},
                      example_inputs=(torch.randn(2, D_IN),))
    if calibration is not None:
        qc.calibrate(ref, calibration)
    ref_tensors = all_tensors(ref)
    return {"built_on": built, "differing": gather_bad(differing_from_rank0(tensors)),
            "flags": flags(gm),
            "meta_left": sorted(n for n, t in tensors.items() if t.is_meta),
            "vs_local_compile": sorted(n for n in ref_tensors
                                       if not torch.equal(ref_tensors[n], tensors[n]))}


def case_compile_once_qat() -> dict[str, Any]:
    return compile_once_case(qat_spec(), None)


def case_compile_once_static() -> dict[str, Any]:
    # sync_observers off: rank 0 calibrates alone (see compile_once_static_synced)
    return compile_once_case(static_spec(sync=False), calibration_batches(0))


# -- 7. compile cache shared by the ranks ----------------------------------------------------
def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def case_cache_shared() -> dict[str, Any]:
    directory = OUTDIR / "cache_shared"
    spec = static_spec(sync=False)  # rank 0 calibrates alone (see compile_once_static_synced)
    out: dict[str, Any] = {}
    states = []
    for call in ("first", "second"):
        gm = qc.distributed.compile_once(mlp, spec, (torch.randn(2, D_IN),),
                                         calibration=calibration_batches(0),
                                         cache_dir=str(directory))
        dist.barrier()
        states.append(all_tensors(gm))
        out[call] = {"notes": list(qc.report(gm).passes[-1].notes),
                     "entries": entries(directory),
                     "differing": gather_bad(differing_from_rank0(states[-1])),
                     "flags": flags(gm)}
    out["second_vs_first"] = sorted(n for n in states[0]
                                    if not torch.equal(states[0][n], states[1][n]))
    return out


def case_cache_concurrent() -> dict[str, Any]:
    directory = OUTDIR / "cache_concurrent"
    gm = compiled(qat_spec())
    x, _ = global_batch(0)
    with torch.no_grad():
        gm(x)  # non-default state
    want = gm.state_dict()
    cache = CompileCache(directory)
    rounds = []
    for i in range(8):
        key = f"{i // 2:064x}"  # each key written twice: once fresh, once over an entry
        dist.barrier()
        cache.store(key, gm)
        dist.barrier()
        state, why = cache.load(key)
        same = state is not None and sorted(state) == sorted(want) and all(
            torch.equal(state[k], want[k]) for k in want)
        listing = entries(directory)
        dist.barrier()
        rounds.append({"key": key, "why": why, "same": same, "entries": listing})
    return {"rounds": rounds}


# -- 8. wrong order ---------------------------------------------------------------------------
def case_wrong_order() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(mlp())
    sharded = fully_shard(mlp())
    return {"ddp": error_of(lambda: qc.qcompile(ddp, "int8-qat")),
            "fully_shard": error_of(lambda: qc.qcompile(sharded, "int8-qat"))}


# -- 9. hand-written DDP loops -------------------------------------------------------------------
def hand_written_run(how: str, steps: int = 5) -> dict[str, Any]:
    """QAT with observers on, different data per rank, driven by ``how``: ``"ddp"`` (a bare
    ``DistributedDataParallel(gm)``, nothing syncing), ``"ddp+sync"`` (the same, calling
    ``qc.distributed.sync_observers(gm)`` after every forward) or ``"wrap"``."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    spec = qat_spec("ddp")
    gm = compiled(spec)
    model = qc.distributed.wrap(gm, spec) if how == "wrap" else DistributedDataParallel(gm)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(steps):
            x, y = global_batch(step, scale_rank1=3.0)
            opt.zero_grad()
            loss = mse(model(local(x)), local(y))
            if how == "ddp+sync":
                qc.distributed.sync_observers(gm)
            loss.backward()
            opt.step()
    unsynced = [str(w.message) for w in seen if "nothing synchronises" in str(w.message)]
    qparams = {f"{n}.{k}": full(getattr(q, k)) for n, q in plain_items(qc.quantizers(gm).items())
               for k in ("scale", "zero_point")}
    return {"warnings": unsynced, "differing": gather_bad(differing_from_rank0(qparams)),
            "quantizers": len(qc.quantizers(gm))}


def case_hand_written_ddp() -> dict[str, Any]:
    return {how: hand_written_run(how) for how in ("ddp", "ddp+sync", "wrap")}


# -- known failures (SOFT: recorded, run last) ------------------------------------------------
def from_scratch(kind: str) -> dict[str, Any]:
    """Compile with learnable scales, wrap, train 2 steps on different data per rank —
    the first forward initialises the scales from (synchronised) statistics."""
    spec = qat_spec(kind, learnable=True)
    gm = compiled(spec)
    model = qc.distributed.wrap(gm, spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    error = None
    try:
        for step in range(2):
            x, y = global_batch(step, scale_rank1=3.0)
            opt.zero_grad()
            mse(model(local(x)), local(y)).backward()
            opt.step()
    except Exception as e:
        error = f"{type(e).__name__}: {e}".splitlines()[0][:400]
    scales = {n: full(q.scale) for n, q in plain_items(qc.quantizers(gm).items())}
    return {"error": error,
            "scales": {n: s.tolist() for n, s in scales.items()},
            "differing": gather_bad(differing_from_rank0(scales)),
            "uninitialised": sorted(n for n, s in scales.items() if bool((s == 1.0).all()))}


def case_ddp_learnable_from_scratch() -> dict[str, Any]:
    return from_scratch("ddp")


def case_fsdp2_learnable_from_scratch() -> dict[str, Any]:
    return from_scratch("fsdp2")


def case_fsdp2_bf16_learnable() -> dict[str, Any]:
    return bf16_run(learnable=True)


SHORT_TIMEOUT = datetime.timedelta(seconds=4)


def case_compile_once_static_synced() -> dict[str, Any]:
    """compile_once with calibration and the default ``sync_observers: true``. Rank 0's
    ``calibrate`` currently issues an all_reduce that no other rank joins (they wait in the
    broadcast), so the process group is first re-created with a short timeout: the
    mismatch then fails within seconds on both ranks instead of hanging. Runs last: the
    group is unusable afterwards."""
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=(OUTDIR / "store_short").as_uri(),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=SHORT_TIMEOUT)
    try:
        out = compile_once_case(static_spec(), calibration_batches(0))
        out["error"] = None
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]}
    return out


BREAKS_PG = {"compile_once_static_synced"}

CASES = cases_in(globals())


# -- main -----------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT, BREAKS_PG)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
