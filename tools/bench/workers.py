"""What runs in the benchmarks' fresh processes: the 2-rank workers (gloo, CPU, one thread
each, started by ``torch.multiprocessing.spawn``) and the memory worker (one process per
contender, started with ``multiprocessing``'s spawn context). Each writes its numbers to
a JSON file the parent reads; none prints.

- ``pipeline_rank``: a 2-stage GPipe training step (4 micro-batches), median step time;
- ``compile_once_rank``: ``qc.distributed.compile_once`` of ``big_model``, peak RSS;
- ``observer_sync_rank``: collectives and bytes of ``qc.distributed.sync_observers``;
- ``memory_worker``: peak RSS of compile + 2 QAT steps of the transformer, one way.

Example:
    >>> from qcompile.tools.bench.workers import memory_worker, pipeline_rank
    >>> callable(pipeline_rank) and callable(memory_worker)
    True
"""

from __future__ import annotations

import json
import os
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


def compile_once_rank(rank: int, store: str, layers: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    base = peak_rss_mb()
    torch.manual_seed(0)
    gm = qc.distributed.compile_once(lambda: big_model(layers), "int8-qat",
                                     (torch.randn(2, 2048),))
    params = sum(p.numel() for p in gm.parameters()) * 4 / 2**20
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_mb": peak_rss_mb(), "import_mb": base, "model_mb": params}, f)
    dist.destroy_process_group()


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
            stats = qc.distributed.sync_observers(gm)
        finally:
            dist.all_reduce = original
        opt.step()
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
