"""``qcompile-bench``: side-by-side measurements, medians and ratios in one run.

Subcommands:

- ``pipeline``: partitioning time on a ~10,000-node graph, bytes crossing each cut with
  ``transfer: fp32`` vs ``int8``, and the step time of a 2-stage GPipe pipeline (2 ranks,
  gloo, CPU) next to the same model trained in one process.
- ``compile-once``: peak RSS of each rank when two ranks share one compile of a ~400 MB
  model (``qc.distributed.compile_once``: rank 1 builds on the meta device).
- ``observer-sync``: collectives and bytes per step that keep observers identical on 2
  DDP ranks (one flattened collective per reduction kind, whatever the quantizer count).

Example:
    >>> from qcompile.tools.bench import deep_mlp
    >>> len(list(deep_mlp(3).modules())) > 3
    True
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import qcompile as qc


def deep_mlp(blocks: int, width: int = 64) -> nn.Sequential:
    """``blocks`` x (Linear + ReLU): the scaling workload."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _median(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_partition(blocks: int, stages: int) -> dict[str, Any]:
    model = deep_mlp(blocks)
    x = torch.randn(8, 64)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["pipeline"] = {"stages": stages, "balance": "flops"}
    gm = qc.qcompile(model, spec, example_inputs=(x,))
    report = qc.report(gm)
    seconds = {p.name: p.seconds for p in report.passes}
    nodes = next(p.nodes_after for p in report.passes if p.name == "partition")
    return {"graph_nodes": nodes, "stages": stages, "partition_s": seconds["partition"],
            "place_s": seconds["place"], "balance_ratio": report.balance_ratio}


def bench_transfer(blocks: int = 8, batch: int = 64) -> dict[str, Any]:
    model = deep_mlp(blocks, 256)
    x = torch.randn(batch, 256)
    out = {}
    for transfer in ("fp32", "int8"):
        spec = qc.load_spec("int8-qat").model_dump()
        spec["pipeline"] = {"stages": 2, "transfer": transfer}
        gm = qc.qcompile(model, spec, example_inputs=(x,))
        out[transfer] = qc.report(gm).stages[0].bytes_out
    out["ratio"] = out["fp32"] / out["int8"]
    return out


def _rank(rank: int, store: str, steps: int, result: str) -> None:
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
    seconds = _median(step, steps)
    if rank == 0:
        with open(result, "w") as f:
            json.dump({"pipeline_step_s": seconds}, f)
    dist.destroy_process_group()


def bench_pipeline_step(steps: int = 10) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = deep_mlp(16, 256)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    gm = qc.qcompile(model, "int8-qat", example_inputs=(x[:16],))
    opt = torch.optim.SGD(gm.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(4), y.chunk(4)):  # the same 4 micro-batches
            (nn.functional.mse_loss(gm(xm), ym) / 4).backward()
        opt.step()

    step()
    single = _median(step, steps)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_rank, args=(os.path.join(tmp, "store"), steps, result),
                                    nprocs=2, join=True)
        with open(result) as f:
            piped = json.load(f)["pipeline_step_s"]
    return {"one_process_step_s": single, "pipeline_step_s": piped,
            "pipeline_vs_one_process": piped / single}


def _big_model(layers: int = 24, width: int = 2048) -> nn.Sequential:
    """~400 MB of fp32 weights at the defaults."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _compile_once_rank(rank: int, store: str, layers: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    base = _peak_rss_mb()
    torch.manual_seed(0)
    gm = qc.distributed.compile_once(lambda: _big_model(layers), "int8-qat",
                                     (torch.randn(2, 2048),))
    params = sum(p.numel() for p in gm.parameters()) * 4 / 2**20
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_mb": _peak_rss_mb(), "import_mb": base, "model_mb": params}, f)
    dist.destroy_process_group()


def bench_compile_once(layers: int) -> dict[str, Any]:
    """Peak RSS per rank of compile_once on two ranks (rank 1 builds on meta)."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_compile_once_rank,
                                    args=(os.path.join(tmp, "store"), layers, tmp),
                                    nprocs=2, join=True)
        ranks = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    net = [r["peak_mb"] - r["import_mb"] for r in ranks]  # above the torch-import baseline
    return {"model_mb": ranks[0]["model_mb"], "rank0_peak_mb": ranks[0]["peak_mb"],
            "rank1_peak_mb": ranks[1]["peak_mb"],
            "rank1_vs_rank0": ranks[1]["peak_mb"] / ranks[0]["peak_mb"],
            "rank0_net_mb": net[0], "rank1_net_mb": net[1], "net_ratio": net[1] / net[0]}


def _sync_rank(rank: int, store: str, quantized_layers: int, out_dir: str) -> None:
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


def bench_observer_sync(layers: int = 16) -> dict[str, Any]:
    """Collectives and bytes per step of observer synchronisation on 2 DDP ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_sync_rank, args=(os.path.join(tmp, "store"), layers, tmp),
                                    nprocs=2, join=True)
        with open(os.path.join(tmp, "sync.json")) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qcompile-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=["pipeline", "compile-once", "observer-sync"])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.suite == "observer-sync":
        r = bench_observer_sync()
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"observer sync on 2 DDP ranks: {r['quantizers']} quantizers, "
                  f"{r['collectives']} collective(s) and {r['bytes']} bytes per step "
                  f"({r['all_reduce_calls']} all_reduce call(s) from qcompile in the step)")
        return 0
    if args.suite == "compile-once":
        r = bench_compile_once(6 if args.quick else 24)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"compile_once of a {r['model_mb']:.0f} MB model on 2 ranks: peak RSS rank 0 "
                  f"{r['rank0_peak_mb']:.0f} MB, rank 1 {r['rank1_peak_mb']:.0f} MB "
                  f"({r['rank1_vs_rank0']:.0%} of rank 0); above the torch import: rank 0 "
                  f"{r['rank0_net_mb']:.0f} MB, rank 1 {r['rank1_net_mb']:.0f} MB "
                  f"({r['net_ratio']:.0%})")
        return 0
    blocks = 300 if args.quick else 1667  # 6 nodes per block in an int8-qat graph: ~10,000
    results = {
        "partition": bench_partition(blocks, 4),
        "transfer_bytes": bench_transfer(),
        "step": bench_pipeline_step(3 if args.quick else 10),
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    p, t, s = results["partition"], results["transfer_bytes"], results["step"]
    print(f"partition: {p['graph_nodes']} nodes into {p['stages']} stages in "
          f"{p['partition_s'] * 1e3:.0f} ms (place {p['place_s'] * 1e3:.0f} ms), "
          f"balance max/mean {p['balance_ratio']:.3f}")
    print(f"bytes across the cut per forward: fp32 {t['fp32']}, int8 {t['int8']} "
          f"({t['ratio']:.2f}x fewer)")
    print(f"train step (4 micro-batches): one process {s['one_process_step_s'] * 1e3:.1f} ms, "
          f"2-stage GPipe on 2 ranks {s['pipeline_step_s'] * 1e3:.1f} ms "
          f"(ratio {s['pipeline_vs_one_process']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
