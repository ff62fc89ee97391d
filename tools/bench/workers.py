"""What runs in the benchmarks' fresh processes: the 2-rank workers (gloo, CPU, one thread
each, started by ``torch.multiprocessing.spawn``) and the memory worker (one process per
contender, started with ``multiprocessing``'s spawn context). Each writes its numbers to
a JSON file the parent reads; none prints.

- ``pipeline_rank``: a 2-stage GPipe training step (4 micro-batches), median step time;
- ``compile_once_rank``: one of N ranks getting ``big_model`` sharded with FSDP2, one or
  more ways (``compile_once`` from a checkpoint, the same int8-static calibrated on 8
  batches per rank, ``compile_once`` streamed from rank 0, or naive: build,
  ``qc.qcompile``, ``wrap``): peak RSS over the post-import baseline, local parameter
  bytes and RSS after each phase (``compile_once_jobs_rank``: several world sizes in turn,
  in one process);
- ``observer_sync_rank``: collectives and bytes of ``qc.distributed.sync_observers``;
- ``hybrid_rank``: one of 4 ranks training 2 stages x 2 replicas, 4 replicas or 4 stages:
  collectives, gradient buckets and pipeline sends per step (``hybrid_layouts_rank``: each
  of several layouts in turn, in one process);
- ``memory_worker``: peak RSS of compile + 2 QAT steps of the transformer, one way.

Example:
    >>> from qcompile.tools.bench.workers import memory_worker, pipeline_rank
    >>> callable(pipeline_rank) and callable(memory_worker)
    True
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import qcompile as qc
from qcompile.tools.bench.measure import median_seconds, peak_rss_mb
from qcompile.tools.bench.models import big_model, deep_mlp, transformer


def pipeline_rank(rank: int, store: str, steps: int, result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = deep_mlp(16, 256)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["pipeline"] = {"stages": 2, "microbatches": 4}
    gm = qc.qcompile(model, spec, example_inputs=(x[:16],))
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()

    step()
    dist.barrier()
    seconds = median_seconds(step, steps)
    if rank == 0:
        with open(result, "w") as f:
            json.dump({"pipeline_step_s": seconds}, f)
    dist.destroy_process_group()


def _status() -> dict[str, float]:
    """This process's VmRSS (current), VmHWM (peak) and RssFile (file-backed pages, such
    as a memory-mapped checkpoint's) in MB, from /proc/self/status."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile"):
                values[key] = int(rest.split()[0]) / 1024  # kB
    return values


def _rss() -> tuple[float, float]:
    """(current, peak) resident set size of this process (MB)."""
    values = _status()
    return values["VmRSS"], values["VmHWM"]


def _reset_peak() -> None:
    """Set the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Phases:
    """[step, current RSS, peak RSS, file-backed RSS] (MB over the baseline) when each
    step of ``compile_once`` returns: the benchmark wraps ``qcompile.distributed.once``'s
    helpers (measuring only; the library is unchanged)."""

    STEPS = {"unwrap_compiled": "built", "compile_model": "compiled", "_sharded": "sharded",
             "_observe_weights": "loaded+observed", "collect_statistics": "calibrated"}

    def __init__(self) -> None:
        self.base = _status()
        self.rows: list[list[Any]] = []
        self.saved: list[tuple[Any, str, Any]] = []

    def mark(self, label: str) -> None:
        now = _status()
        self.rows.append([label] + [round(now[k] - self.base[k], 1)
                                    for k in ("VmRSS", "VmHWM", "RssFile")])

    def __enter__(self) -> _Phases:
        from qcompile.distributed import once

        def wrapped(fn: Any, label: str) -> Any:
            def inner(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                self.mark(label)
                return out
            return inner

        for name, label in self.STEPS.items():
            self.saved.append((once, name, getattr(once, name)))
            setattr(once, name, wrapped(getattr(once, name), label))
        init = once._Loader.__init__  # runs after to_empty (and rank 0's real model)

        def loader_init(loader: Any, *args: Any, **kwargs: Any) -> None:
            if not any(row[0] == "allocated" for row in self.rows):  # not the cache's
                self.mark("allocated")
            init(loader, *args, **kwargs)

        self.saved.append((once._Loader, "__init__", init))
        once._Loader.__init__ = loader_init  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)


def _local_bytes(gm: nn.Module) -> int:
    """Bytes of this rank's parameters (a sharded DTensor counts its local shard)."""
    total = 0
    for p in gm.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


CALIBRATION_BATCHES = 8  # per rank, in compile_once_rank's calibrated variant


def compile_once_rank(rank: int, world: int, store: str, variants: list[str], blocks: int,
                      width: int, checkpoint: str, out_dir: str) -> None:
    """One of ``world`` ranks (gloo, CPU, one thread) getting ``big_model(blocks, width)``
    int8-QAT and sharded with FSDP2, each of ``variants`` in turn: ``checkpoint``
    (``compile_once`` reading ``checkpoint``), ``calibrated`` (the same, int8-static, with
    ``CALIBRATION_BATCHES`` batches of this rank's own data), ``stream``
    (``compile_once``, rank 0 streams) or ``naive`` (every rank builds the model,
    ``qc.qcompile``s it and ``qc.distributed.wrap``s it). The baseline is the RSS after
    importing torch and qcompile, initialising the process group and compiling a tiny
    model (qcompile's modules load lazily); the peak is VmHWM, reset to the current RSS
    before each variant (one variant per process for clean numbers: freed memory may stay
    in the allocator)."""
    import functools

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["data_parallel"] = {"kind": "fsdp2"}
    static = {**qc.load_spec("int8-static").model_dump(), "data_parallel": {"kind": "fsdp2"}}
    import safetensors.torch  # noqa: F401  (the checkpoint reader: in the baseline)
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    import qcompile.distributed.once  # noqa: F401
    qc.qcompile(big_model(2, 8), "int8-qat", (torch.randn(2, 8),))  # lazy modules load
    dist.barrier()
    build = functools.partial(big_model, blocks, width)
    x = torch.randn(2, width)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data (KBs)
    batches = [torch.randn(2, width, generator=g) for _ in range(CALIBRATION_BATCHES)]
    results = {}
    for variant in variants:
        dist.barrier()
        _reset_peak()
        torch.manual_seed(0)
        with _Phases() as phases:
            if variant == "naive":
                model = build()
                phases.mark("built")
                gm = qc.qcompile(model, spec, (x,))
                del model
                phases.mark("compiled")
                gm = qc.distributed.wrap(gm, spec)
                phases.mark("sharded")
            elif variant == "calibrated":
                gm = qc.distributed.compile_once(build, static, (x,), checkpoint=checkpoint,
                                                 calibration=batches)
                phases.mark("returned")
            else:
                gm = qc.distributed.compile_once(
                    build, spec, (x,), checkpoint=checkpoint if variant == "checkpoint" else None)
                phases.mark("returned")
        base, (_, peak) = phases.base["VmRSS"], _rss()
        results[variant] = {"base_mb": base, "peak_mb": peak - base,
                            "local_param_mb": _local_bytes(gm) / 2**20, "phases": phases.rows}
        del gm
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def compile_once_jobs_rank(rank: int, jobs: list[tuple[Any, ...]]) -> None:
    """``compile_once_rank`` for each of ``jobs`` (its arguments after ``rank``: world,
    store, variants, blocks, width, checkpoint, out_dir) in turn, in this one process; a
    rank beyond a job's world sits it out (``--quick``: one launch for every world size)."""
    for job in jobs:
        if rank < job[0]:
            compile_once_rank(rank, *job)


def observer_sync_rank(rank: int, store: str, quantized_layers: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = deep_mlp(quantized_layers, 64)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["data_parallel"] = {"kind": "ddp"}
    gm = qc.qcompile(model, spec, example_inputs=(torch.randn(2, 64),))
    ddp = DistributedDataParallel(gm)  # the observer sync itself is measured directly
    counts = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:  # count every all_reduce of a step
        counts[-1] += 1
        return original(*args, **kwargs)

    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(3):
        counts.append(0)
        dist.all_reduce = counting
        try:
            ddp(torch.randn(16, 64)).square().mean().backward()
            opt.step()
            # once per step, after it; DDP replicas agree on their weights
            stats = qc.distributed.sync_observers(gm, weights=False)
        finally:
            dist.all_reduce = original
    if rank == 0:
        with open(os.path.join(out_dir, "sync.json"), "w") as f:
            json.dump({"quantizers": len(qc.quantizers(gm)), "collectives": stats["collectives"],
                       "bytes": stats["bytes"], "all_reduce_calls": counts[-1]}, f)
    dist.destroy_process_group()


def memory_worker(how: str, quick: bool, out: str) -> None:
    """One fresh process: import, build the transformer, compile it ``how`` (qcompile
    int8-qat with its copy of the model, qcompile ``inplace=True``, or torch.ao
    ``prepare_qat_fx``, which rewrites the model in place), train 2 QAT steps; peak RSS
    (ru_maxrss) after each stage."""
    import resource  # noqa: F401  (the peak comes from peak_rss_mb)
    import warnings

    from torch.ao.quantization import get_default_qat_qconfig_mapping  # both sides import it
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    torch.set_num_threads(min(2, torch.get_num_threads()))
    assert qc.qcompile is not None  # qcompile's modules load lazily: in the baseline too
    stages = {"import_mb": peak_rss_mb()}
    torch.manual_seed(0)
    model = transformer(4 if quick else 12).train()
    x = torch.randn(2 if quick else 8, 32 if quick else 128, 256)
    stages["model_mb"] = peak_rss_mb()
    if how == "prepare_qat_fx":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = prepare_qat_fx(model, get_default_qat_qconfig_mapping("x86"), (x,))
    else:
        gm = qc.qcompile(model, "int8-qat", (x,), inplace=how == "qcompile_inplace")
    stages["compile_mb"] = peak_rss_mb()
    opt = torch.optim.SGD(gm.parameters(), lr=1e-4)
    for _ in range(2):
        opt.zero_grad()
        gm(x).square().mean().backward()
        opt.step()
    stages["peak_mb"] = peak_rss_mb()
    stages["weights_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with open(out, "w") as f:
        json.dump(stages, f)


class _Traffic:
    """Counts what one training step sends: Python-level all_reduce calls (observer sync),
    gradient buckets (a DDP communication hook: DDP's reducer all-reduces in C++, out of
    Python's sight) and point-to-point sends between pipeline stages."""

    def __init__(self) -> None:
        self.in_grad_hook = False  # the hook's own all_reduce is a bucket, counted there
        self.counts = {"all_reduce": 0, "all_reduce_bytes": 0, "grad_buckets": 0,
                       "grad_bytes": 0, "p2p_sends": 0, "p2p_bytes": 0}

    def reset(self) -> None:
        for k in self.counts:
            self.counts[k] = 0

    def all_reduce(self, original: Any) -> Any:
        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.in_grad_hook:
                self.counts["all_reduce"] += 1
                self.counts["all_reduce_bytes"] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        return counting

    def p2p(self, original: Any) -> Any:
        import torch.distributed as dist

        def counting(ops: list[Any], *args: Any, **kwargs: Any) -> Any:
            for op in ops:
                if op.op is dist.isend:
                    self.counts["p2p_sends"] += 1
                    self.counts["p2p_bytes"] += op.tensor.numel() * op.tensor.element_size()
            return original(ops, *args, **kwargs)
        return counting

    def grad_hook(self, state: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        buffer = bucket.buffer()
        self.counts["grad_buckets"] += 1
        self.counts["grad_bytes"] += buffer.numel() * buffer.element_size()
        self.in_grad_hook = True
        try:
            return default_hooks.allreduce_hook(state, bucket)
        finally:
            self.in_grad_hook = False


def hybrid_rank(rank: int, store: str, layout: str, steps: int, out_dir: str) -> None:
    """One of 4 ranks training the same int8-QAT MLP (global batch 32, 4 micro-batches)
    laid out as ``2x2`` (2 stages x 2 DDP replicas), ``dp4`` (4 DDP replicas) or ``pp4``
    (4 GPipe stages): traffic per step (the last of ``steps``) and the median step time."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    torch.manual_seed(0)
    model = deep_mlp(8, 64)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    spec = qc.load_spec("int8-qat").model_dump()
    traffic = _Traffic()
    loss_fn = nn.functional.mse_loss
    if layout == "dp4":
        spec["data_parallel"] = {"kind": "ddp"}
        gm = qc.qcompile(model, spec, example_inputs=(x[:8],))
        module = qc.distributed.wrap(gm, spec)
        # DDP checks hook annotations against dist.GradBucket: an unannotated lambda passes
        module.register_comm_hook(dist.group.WORLD,
                                  lambda state, bucket: traffic.grad_hook(state, bucket))
        mine = slice(8 * rank, 8 * rank + 8)
        params = module.parameters()

        def run() -> None:
            loss_fn(module(x[mine]), y[mine]).backward()
    else:
        stages, dp = (2, 2) if layout == "2x2" else (4, 1)
        spec["pipeline"] = {"stages": stages, "microbatches": 4, "schedule": "gpipe"}
        if dp > 1:
            spec["data_parallel"] = {"kind": "ddp"}
        gm = qc.qcompile(model, spec, example_inputs=(x[:8],))
        stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=loss_fn)
        if isinstance(stage.submod, DistributedDataParallel):
            stage.submod.register_comm_hook(schedule.dp_group,
                                           lambda state, bucket: traffic.grad_hook(state, bucket))
        per = 32 // dp
        replica = rank % dp
        mine = slice(per * replica, per * replica + per)
        params = stage.submod.parameters()

        def run() -> None:
            if stage.is_first:
                schedule.step(x[mine], target=y[mine] if stage.is_last else None)
            elif stage.is_last:
                schedule.step(target=y[mine])
            else:
                schedule.step()
    opt = torch.optim.SGD(params, lr=1e-3)
    # Counting only (a benchmark, not the library): the schedules send every micro-batch's
    # activations and gradients through their module's _batch_p2p
    original_ar, original_p2p = dist.all_reduce, schedules._batch_p2p
    dist.all_reduce = traffic.all_reduce(original_ar)
    schedules._batch_p2p = traffic.p2p(original_p2p)
    times = []
    try:
        for _ in range(steps):
            traffic.reset()
            opt.zero_grad()
            t0 = time.perf_counter()
            run()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        dist.all_reduce, schedules._batch_p2p = original_ar, original_p2p
    counts = dict(traffic.counts)
    counts["step_s"] = sorted(times)[len(times) // 2]
    with open(os.path.join(out_dir, f"{layout}-rank{rank}.json"), "w") as f:
        json.dump(counts, f)
    dist.barrier()
    dist.destroy_process_group()


def hybrid_layouts_rank(rank: int, store: str, layouts: list[str], steps: int,
                        out_dir: str) -> None:
    """``hybrid_rank`` for each of ``layouts`` in turn in this one process, a fresh process
    group each (store ``<store>-<layout>``): one launch of 4 ranks instead of one per
    layout (``--quick``: the traffic is counted the same; the step times share a
    process)."""
    for layout in layouts:
        hybrid_rank(rank, f"{store}-{layout}", layout, steps, out_dir)
