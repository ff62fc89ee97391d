"""The distributed suites: ``pipeline``, ``compile-once`` and ``observer-sync``.

- ``pipeline``: partitioning time on a ~10,000-node graph (``quick``: ~1,800), bytes
  crossing the cut with ``transfer: fp32`` vs ``int8``, and a 2-stage GPipe training step
  on 2 ranks next to the same 4 micro-batches in one process;
- ``compile-once``: peak RSS of each of 2 ranks sharing one compile of a ~400 MB model
  (``quick``: ~100 MB);
- ``observer-sync``: collectives and bytes per step keeping observers identical on 2 DDP
  ranks;
- ``hybrid``: traffic per training step of one int8-QAT MLP on 4 ranks laid out as 2
  stages x 2 DDP replicas, 4 DDP replicas, or 4 GPipe stages.

Each has a ``run_*(quick)`` giving its result dict and a ``*_text(result)`` saying it in
sentences.

Example:
    >>> from qcompile.tools.bench.suites.distributed import observer_sync_text
    >>> print(observer_sync_text({"quantizers": 32, "collectives": 3, "bytes": 8320,
    ...                           "all_reduce_calls": 3}))  # doctest: +ELLIPSIS
    observer sync on 2 DDP ranks: 32 quantizers, 3 collective(s) and 8320 bytes per step ...
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.tools.bench.measure import median_seconds
from qcompile.tools.bench.models import deep_mlp
from qcompile.tools.bench.workers import (
    compile_once_rank,
    hybrid_rank,
    observer_sync_rank,
    pipeline_rank,
)


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
    single = median_seconds(step, steps)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(pipeline_rank,
                                    args=(os.path.join(tmp, "store"), steps, result),
                                    nprocs=2, join=True)
        with open(result) as f:
            piped = json.load(f)["pipeline_step_s"]
    return {"one_process_step_s": single, "pipeline_step_s": piped,
            "pipeline_vs_one_process": piped / single}


def run_pipeline(quick: bool) -> dict[str, Any]:
    blocks = 300 if quick else 1667  # 6 nodes per block in an int8-qat graph: ~10,000
    return {
        "partition": bench_partition(blocks, 4),
        "transfer_bytes": bench_transfer(),
        "step": bench_pipeline_step(3 if quick else 10),
    }


def pipeline_text(r: dict[str, Any]) -> str:
    p, t, s = r["partition"], r["transfer_bytes"], r["step"]
    return "\n".join([
        f"partition: {p['graph_nodes']} nodes into {p['stages']} stages in "
        f"{p['partition_s'] * 1e3:.0f} ms (place {p['place_s'] * 1e3:.0f} ms), "
        f"balance max/mean {p['balance_ratio']:.3f}",
        f"bytes across the cut per forward: fp32 {t['fp32']}, int8 {t['int8']} "
        f"({t['ratio']:.2f}x fewer)",
        f"train step (4 micro-batches): one process {s['one_process_step_s'] * 1e3:.1f} ms, "
        f"2-stage GPipe on 2 ranks {s['pipeline_step_s'] * 1e3:.1f} ms "
        f"(ratio {s['pipeline_vs_one_process']:.2f})",
    ])


def bench_compile_once(layers: int) -> dict[str, Any]:
    """Peak RSS per rank of compile_once on two ranks (rank 1 builds on meta)."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(compile_once_rank,
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


def run_compile_once(quick: bool) -> dict[str, Any]:
    return bench_compile_once(6 if quick else 24)


def compile_once_text(r: dict[str, Any]) -> str:
    return (f"compile_once of a {r['model_mb']:.0f} MB model on 2 ranks: peak RSS rank 0 "
            f"{r['rank0_peak_mb']:.0f} MB, rank 1 {r['rank1_peak_mb']:.0f} MB "
            f"({r['rank1_vs_rank0']:.0%} of rank 0); above the torch import: rank 0 "
            f"{r['rank0_net_mb']:.0f} MB, rank 1 {r['rank1_net_mb']:.0f} MB "
            f"({r['net_ratio']:.0%})")


def bench_observer_sync(layers: int = 16) -> dict[str, Any]:
    """Collectives and bytes per step of observer synchronisation on 2 DDP ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(observer_sync_rank,
                                    args=(os.path.join(tmp, "store"), layers, tmp),
                                    nprocs=2, join=True)
        with open(os.path.join(tmp, "sync.json")) as f:
            return json.load(f)


def run_observer_sync(quick: bool) -> dict[str, Any]:
    return bench_observer_sync()  # already small: the same workload with --quick


def observer_sync_text(r: dict[str, Any]) -> str:
    return (f"observer sync on 2 DDP ranks: {r['quantizers']} quantizers, "
            f"{r['collectives']} collective(s) and {r['bytes']} bytes per step "
            f"({r['all_reduce_calls']} all_reduce call(s) from qcompile in the step)")


HYBRID_LAYOUTS = {"2x2": "2 stages x 2 DDP replicas", "dp4": "4 DDP replicas",
                  "pp4": "4 GPipe stages"}


def run_hybrid(quick: bool) -> dict[str, Any]:
    """Per layout, rank 0's traffic per step and the slowest rank's median step time."""
    steps = 3 if quick else 10
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in HYBRID_LAYOUTS:
            store = os.path.join(tmp, f"store-{layout}")
            torch.multiprocessing.spawn(hybrid_rank, args=(store, layout, steps, tmp),
                                        nprocs=4, join=True)
            ranks = []
            for r in range(4):
                with open(os.path.join(tmp, f"{layout}-rank{r}.json")) as f:
                    ranks.append(json.load(f))
            row = {k: sum(r[k] for r in ranks) for k in ranks[0] if k != "step_s"}
            row["step_s"] = max(r["step_s"] for r in ranks)
            out[layout] = row
    return out


def hybrid_text(r: dict[str, Any]) -> str:
    lines = ["traffic per training step on 4 ranks, summed over ranks (int8-QAT MLP, "
             "global batch 32):"]
    for layout, what in HYBRID_LAYOUTS.items():
        row = r[layout]
        lines.append(
            f"  {layout} ({what}): {row['grad_buckets']} gradient bucket(s) "
            f"{row['grad_bytes']} B, {row['all_reduce']} observer all_reduce(s) "
            f"{row['all_reduce_bytes']} B, {row['p2p_sends']} pipeline send(s) "
            f"{row['p2p_bytes']} B; step {row['step_s'] * 1e3:.1f} ms")
    return "\n".join(lines)
