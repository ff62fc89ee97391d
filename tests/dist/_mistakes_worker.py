"""One rank of the 2-process "no rank left hanging" tests (``test_mistakes.py`` launches
two; run as a script, never imported from the tests folder)::

    python tests/dist/_mistakes_worker.py OUTDIR CASE [CASE ...]

``mistakes`` makes, one after the other in one process group, the mistakes that used to
hang a rank until the process-group timeout or abort it (a ``cache_dir``, a schedule, a
scheme or a bad batch on one rank only, a model factory that wraps in DDP); each must raise
a ``QCompileError`` on both ranks, and the group must still work afterwards (the next
mistake runs in it). The group's timeout is short (``PG_TIMEOUT``): a hang fails in seconds.
``calls`` makes the mistakes of a call made on some ranks only, of different models on
the two ranks and of a misshaped batch, for every public call that communicates
(``train_step``, ``wrap``, ``qc.search``, ``save_adapters`` of an FSDP2 graph,
``compile_once``, ``qc.calibrate``, a pipeline schedule's ``step``, ``sync_observers``):
each is the same ``QCompileError`` on both ranks, and the group, and the agreement itself,
still work afterwards (a good step on both ranks ends the case).
``calibrate_wrapped`` calibrates graphs ``qc.distributed.wrap`` returned; ``train_step``
checks which micro-batch synchronises gradients under DDP.
"""

from __future__ import annotations

import copy
import datetime
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _worker_main import cases_in, error_of, run_cases
from torch import nn

import qcompile as qc

D_IN, WIDTH, D_OUT, LOCAL = 8, 16, 4, 6
PG_TIMEOUT = datetime.timedelta(seconds=15)
OUTDIR = Path(".")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, D_OUT))


def static_spec(**top: Any) -> dict[str, Any]:
    spec = qc.load_spec("int8-static").model_dump(mode="json")
    spec.update(top)
    return spec


def batches(rank: int, n: int = 3) -> list[torch.Tensor]:
    """Rank ``rank``'s calibration batches (different data per rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(LOCAL, D_IN, generator=g) * (1 + rank) for _ in range(n)]


def qstate(gm: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.detach().clone() for n, q in qc.quantizers(gm).items()
            for k, v in q.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def group_works() -> bool:
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item() == 3.0


def mistake(out: dict[str, Any], name: str, fn: Any) -> None:
    """Record what ``fn`` raised on this rank, then meet the other rank (a rank still stuck
    in a collective would make this barrier time out) and check the group still works."""
    out[name] = error_of(fn)
    dist.barrier()
    out[name]["group_works"] = group_works()


# -- the mistakes ------------------------------------------------------------------------------
def case_mistakes() -> dict[str, Any]:
    rank = dist.get_rank()
    x = torch.randn(2, D_IN)
    out: dict[str, Any] = {}

    # compile_once with cache_dir on one rank only (either rank)
    for who in (0, 1):
        mistake(out, f"cache_dir_on_rank{who}", lambda w=who: qc.distributed.compile_once(
            mlp, static_spec(), (x,), calibration=batches(rank),
            cache_dir=str(OUTDIR / "cache") if rank == w else None))

    # a different scheme on one rank: the synced calibration's all-reduce sizes would differ
    spec = static_spec(quant={**static_spec()["quant"], "rules": [
        {"match": {"module": "Linear"},
         "weight": {"dtype": "int8", "granularity": "per_channel" if rank == 0
                    else "per_tensor"},
         "activation": {"dtype": "uint8", "symmetric": False}}]})
    gm = qc.qcompile(mlp(), spec, example_inputs=(x,))
    before = qstate(gm)
    mistake(out, "scheme_calibrate", lambda: qc.calibrate(gm, batches(rank), progress=False))
    out["scheme_calibrate"]["unchanged"] = same(before, qstate(gm))
    ddp_spec = {**spec, "data_parallel": {"kind": "ddp"}}
    mistake(out, "scheme_wrap", lambda: qc.distributed.wrap(gm, ddp_spec))
    mistake(out, "scheme_compile_once", lambda: qc.distributed.compile_once(
        mlp, spec, (x,), calibration=batches(rank)))

    # a bad batch on rank 1 only: its own error there, "rank 1 failed" on rank 0; the graph
    # is left as it was on both ranks
    gm = qc.qcompile(mlp(), static_spec(), example_inputs=(x,))
    before = qstate(gm)
    mine = batches(rank)
    if rank == 1:
        mine[1] = torch.randn(LOCAL, D_IN + 3)
    mistake(out, "bad_batch", lambda: qc.calibrate(gm, mine, progress=False))
    out["bad_batch"]["unchanged"] = same(before, qstate(gm))
    # ... and the same graph calibrates fine afterwards, the same qparams on both ranks
    qc.calibrate(gm, batches(rank), progress=False)
    scales = torch.cat([q.scale.reshape(-1) for q in qc.quantizers(gm).values()])
    theirs = scales.clone()
    dist.broadcast(theirs, src=0)
    out["bad_batch"]["after_equal_across_ranks"] = torch.equal(theirs, scales)

    mistake(out, "bad_batch_compile_once", lambda: qc.distributed.compile_once(
        mlp, static_spec(), (x,), calibration=mine))

    # different pipeline schedules per rank
    pipe = {"pipeline": {"stages": 2, "devices": ["cpu", "cpu"], "microbatches": 2,
                         "schedule": "gpipe" if rank == 0 else "1f1b"}}
    pgm = qc.qcompile(mlp(), pipe, example_inputs=(x,))
    mistake(out, "schedule", lambda: qc.distributed.pipeline(
        pgm, pipe, loss_fn=nn.functional.mse_loss))

    # the (pp, dp) mesh with another data_parallel kind on one rank
    hyb = {"pipeline": {"stages": 1}, "data_parallel": {"kind": "ddp" if rank == 0
                                                        else "fsdp2"}}
    mistake(out, "mesh", lambda: qc.distributed.mesh(hyb))

    # a factory that wraps the model in DDP: the existing model, and one built inside
    from torch.nn.parallel import DistributedDataParallel

    model = mlp()
    mistake(out, "factory_ddp_existing", lambda: qc.distributed.compile_once(
        lambda: DistributedDataParallel(model), static_spec(), (x,)))
    mistake(out, "factory_ddp_built", lambda: qc.distributed.compile_once(
        lambda: DistributedDataParallel(mlp()), static_spec(), (x,)))
    return out


# -- a call on some ranks only, different models, a misshaped batch ------------------------------
class Doubled(nn.Module):
    """``mlp()``'s layers (the same parameters) and one more operation: another graph that
    DistributedDataParallel's own parameter-shape check lets through."""

    def __init__(self, double: bool) -> None:
        super().__init__()
        self.net, self.double = mlp(), double

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        return y * 2.0 if self.double else y


def wide_mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, width), nn.ReLU(), nn.Linear(width, D_OUT))


SEARCH = {"quant": {"mode": "static",
                    "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}],
                    "search": {"candidates": [
                        {"weight": {"dtype": "int4", "granularity": "per_group",
                                    "group_size": 8}},
                        {"weight": {"dtype": "int8", "granularity": "per_channel"}}],
                        "budget": {"avg_weight_bits": 6.0}}}}


def timed(out: dict[str, Any], name: str, fn: Any) -> None:
    """``mistake``, with the seconds this rank spent in ``fn``."""
    start = time.monotonic()
    mistake(out, name, fn)
    out[name]["seconds"] = round(time.monotonic() - start, 2)


def case_calls() -> dict[str, Any]:
    rank = dist.get_rank()
    x, y = torch.randn(LOCAL, D_IN), torch.randn(LOCAL, D_OUT)
    mse = nn.functional.mse_loss
    out: dict[str, Any] = {}
    # what every call below needs, built on both ranks (these calls agree: no mistake yet)
    ddp_spec = {"quant": {"mode": "none"}, "data_parallel": {"kind": "ddp"}}
    gm = qc.qcompile(mlp(), ddp_spec, example_inputs=(x,))
    ddp = qc.distributed.wrap(gm, ddp_spec)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    other = qc.qcompile(mlp(), static_spec(), example_inputs=(x,))  # for sync_observers
    lora = {"quant": {"mode": "none"}, "data_parallel": {"kind": "fsdp2"},
            "adapters": [{"match": {"module": "Linear"}, "rank": 2}]}
    sharded = qc.distributed.wrap(qc.qcompile(mlp(), lora, example_inputs=(x,)), lora)
    pipe = {"pipeline": {"stages": 2, "devices": ["cpu", "cpu"], "microbatches": 2}}
    stage, schedule = qc.distributed.pipeline(qc.qcompile(mlp(), pipe, example_inputs=(x,)),
                                              pipe, loss_fn=mse)
    static = qc.qcompile(mlp(), static_spec(), example_inputs=(x,))

    def pipeline_step() -> None:
        if stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])

    # each public call on rank 0 only, while rank 1 goes on to another call
    calls = {
        "train_step": lambda: qc.distributed.train_step(ddp, opt, x, y, mse),
        "wrap": lambda: qc.distributed.wrap(gm, ddp_spec),
        "search": lambda: qc.search(mlp(), SEARCH, batches(rank, 2)),
        "save_adapters": lambda: qc.save_adapters(sharded, OUTDIR / "adapters"),
        "compile_once": lambda: qc.distributed.compile_once(mlp, static_spec(), (x,)),
        "calibrate": lambda: qc.calibrate(static, batches(rank), progress=False),
        "pipeline_step": pipeline_step,
        "sync_observers": lambda: qc.distributed.sync_observers(other),
    }
    for name, call in calls.items():
        theirs = (calls["train_step"] if name in ("save_adapters", "sync_observers")
                  else calls["sync_observers"])
        timed(out, f"only_{name}", call if rank == 0 else theirs)

    # save_adapters on rank 0 while rank 1 makes no qcompile call at all: rank 0 gives up
    # after QCOMPILE_AGREE_TIMEOUT; rank 1's next call skips the meeting it missed
    os.environ["QCOMPILE_AGREE_TIMEOUT"] = "2"
    timed(out, "absent", calls["save_adapters"] if rank == 0 else lambda: None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        timed(out, "after_absent", calls["train_step"])
    out["after_absent"]["warnings"] = [str(w.message) for w in seen
                                       if "without this rank" in str(w.message)]
    # ... and rank 1 making the same call after rank 0 gave up on it: it came too late
    gave_up = OUTDIR / "rank0_gave_up"
    if rank == 0:
        out["late"] = error_of(calls["save_adapters"])
        gave_up.touch()
    else:
        while not gave_up.exists():
            time.sleep(0.05)
        out["late"] = error_of(calls["save_adapters"])
    del os.environ["QCOMPILE_AGREE_TIMEOUT"]
    dist.barrier()
    timed(out, "after_late", calls["train_step"])

    # different models on the two ranks
    wide = {"quant": {"mode": "none"}, "data_parallel": {"kind": "ddp"}}
    mine = qc.qcompile(wide_mlp(16 if rank == 0 else 32), wide, example_inputs=(x,))
    timed(out, "models_wrap", lambda: qc.distributed.wrap(mine, wide))
    mine = qc.qcompile(wide_mlp(16 if rank == 0 else 32), static_spec(), example_inputs=(x,))
    timed(out, "models_calibrate", lambda: qc.calibrate(mine, batches(rank), progress=False))
    torch.manual_seed(rank)  # the same architecture, other weights on rank 1
    timed(out, "models_search", lambda: qc.search(
        nn.Sequential(nn.Linear(D_IN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, D_OUT)), SEARCH,
        batches(rank, 2)))
    from torch.nn.parallel import DistributedDataParallel

    mine = qc.qcompile(Doubled(rank == 1), {"quant": {"mode": "none"}}, example_inputs=(x,))
    hand = DistributedDataParallel(mine)  # a hand-written DDP: no wrap to check the models
    timed(out, "models_train_step", lambda: qc.distributed.train_step(
        hand, torch.optim.SGD(hand.parameters(), lr=0.1), x, y, mse))

    # a misshaped batch on rank 1 (its features), a batch the micro-batches do not divide
    bad = torch.randn(LOCAL, D_IN + 3) if rank == 1 else x
    timed(out, "misshaped", lambda: qc.distributed.train_step(ddp, opt, bad, y, mse))
    rows = 7 if rank == 1 else 6
    timed(out, "split", lambda: qc.distributed.train_step(
        ddp, opt, torch.randn(rows, D_IN), torch.randn(rows, D_OUT), mse, accumulate=2))

    # after all that, a good step on both ranks: the group and the meetings are in step
    timed(out, "good_step", calls["train_step"])
    weights = torch.cat([p.detach().reshape(-1) for p in gm.parameters()])
    theirs = weights.clone()
    dist.broadcast(theirs, src=0)
    out["good_step"]["equal_to_rank0"] = torch.equal(theirs, weights)
    return out


# -- calibrating a wrapped graph -----------------------------------------------------------------
def case_calibrate_wrapped() -> dict[str, Any]:
    """``qc.calibrate(qc.distributed.wrap(gm, spec), batches)`` (DDP, FSDP2): the wrapper
    comes back, and the qparams equal one process calibrating an unwrapped graph on both
    ranks' batches (min-max observers: bit-identical)."""
    rank = dist.get_rank()
    x = torch.randn(2, D_IN)
    union = batches(0) + batches(1)
    ref = qc.qcompile(mlp(), static_spec(quant={**static_spec()["quant"],
                                                "sync_observers": False}),
                      example_inputs=(x,))
    qc.calibrate(ref, union, progress=False)
    want = {n: q.scale.detach().clone() for n, q in qc.quantizers(ref).items()}
    out: dict[str, Any] = {}
    for kind in ("ddp", "fsdp2"):
        spec = static_spec(data_parallel={"kind": kind})
        gm = qc.qcompile(mlp(), spec, example_inputs=(x,))
        wrapped = qc.distributed.wrap(gm, spec)
        got = qc.calibrate(wrapped, batches(rank), progress=False)
        # (fsdp2: one child graph per block, stage_<i>.: the model's names without it)
        scales = {re.sub(r"^stage_\d+\.", "", n):
                  (q.scale.full_tensor() if hasattr(q.scale, "full_tensor") else q.scale)
                  .detach().clone() for n, q in qc.quantizers(gm).items()}
        out[kind] = {"returned_wrapper": got is wrapped,
                     "compared": len(want),
                     "not_equal": sorted(n for n in want if n not in scales
                                         or not torch.equal(scales[n], want[n])),
                     "flags": sorted({(q.enabled, q.observe)
                                      for q in qc.quantizers(gm).values()})}
        dist.barrier()
    return out


# -- train_step: which micro-batch synchronises ----------------------------------------------------
def count_allreduces(ddp: nn.Module) -> list[int]:
    """A DDP comm hook that counts the gradient buckets it all-reduces (then averages them
    as DDP's default does)."""
    calls = [0]

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks the annotations
        calls[0] += 1
        t = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    return calls


def case_train_step() -> dict[str, Any]:
    """Float graph (mode none, so the arithmetic is plain float), DDP, k = 1 and k = 2:
    per step, the number of all-reduced buckets, the weights on both ranks, and the weights
    of one process stepping on the global batch (loss = mean over it)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(2 * 2 * LOCAL, D_IN, generator=g)
    ys = torch.randn(2 * 2 * LOCAL, D_OUT, generator=g)
    xs[2 * LOCAL:] *= 3.0  # rank 1's rows differ clearly from rank 0's
    mine = slice(rank * 2 * LOCAL, (rank + 1) * 2 * LOCAL)
    out: dict[str, Any] = {}
    for k in (1, 2):
        spec = {"quant": {"mode": "none"}, "data_parallel": {"kind": "ddp"},
                "train": {"accumulate": k}}
        gm = qc.qcompile(mlp(), spec, example_inputs=(xs[:2],))
        ref = copy.deepcopy(gm)
        ddp = qc.distributed.wrap(gm, spec)
        calls = count_allreduces(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        qc.distributed.train_step(ddp, opt, xs[mine], ys[mine], nn.functional.mse_loss,
                                  spec=spec)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(xs), ys).backward()  # the global batch, one process
        ref_opt.step()
        got = torch.cat([p.detach().reshape(-1) for p in gm.parameters()])
        want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        theirs = got.clone()
        dist.broadcast(theirs, src=0)
        out[f"k{k}"] = {"allreduces": calls[0], "equal_to_rank0": torch.equal(theirs, got),
                        "max_diff": (got - want).abs().max().item(),
                        "moved": (want - torch.cat([p.detach().reshape(-1)
                                                    for p in mlp().parameters()]))
                        .abs().max().item()}
        dist.barrier()
    return out


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
