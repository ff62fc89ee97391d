"""The distributed suites: ``pipeline``, ``compile-once`` and ``observer-sync``.

- ``pipeline``: partitioning time on a ~10,000-node graph (``quick``: ~1,800), bytes
  crossing the cut with ``transfer: fp32`` vs ``int8``, and a 2-stage GPipe training step
  on 2 ranks next to the same 4 micro-batches in one process;
- ``compile-once``: per-rank peak RSS (over the post-import baseline) of getting a ~400 MB
  model of 12 blocks int8-QAT and FSDP2-sharded on 1, 2 and 4 ranks: ``compile_once``
  from a safetensors checkpoint, the same int8-static and calibrated through the sharded
  graph (8 batches per rank), ``compile_once`` streamed from rank 0, and the naive way
  (every rank builds and compiles the whole model), against the bound model/N + 2 blocks
  + 10%, with glibc's malloc defaults and with a 1 MB mmap threshold (``quick``: a ~2 MB
  model on 1 and 2 ranks, defaults only, one launch of 2 ranks);
- ``observer-sync``: collectives and bytes per step keeping observers identical on 2 DDP
  ranks;
- ``hybrid``: traffic per training step of one int8-QAT MLP on 4 ranks laid out as 2
  stages x 2 DDP replicas, 4 DDP replicas, or 4 GPipe stages (a fresh launch of the 4
  ranks per layout; ``quick``: one launch runs the three in turn).

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
from qcompile.tools.bench.measure import median_seconds, read_ranks, spawn, spawn_ranks
from qcompile.tools.bench.models import deep_mlp
from qcompile.tools.bench.workers import (
    CALIBRATION_BATCHES,
    compile_once_jobs_rank,
    compile_once_rank,
    hybrid_layouts_rank,
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


COMPILE_ONCE_VARIANTS = {"checkpoint": "fsdp2 + checkpoint",
                         "calibrated": "fsdp2 + checkpoint, calibrated",
                         "stream": "fsdp2 stream from rank 0",
                         "naive": "naive (build + qcompile + wrap)"}


def compile_once_bound(model_mb: float, block_mb: float, world: int) -> float:
    """The target peak per rank: (model/N + 2 blocks) + 10%."""
    return 1.1 * (model_mb / world + 2 * block_mb)


def bench_compile_once(blocks: int, width: int, worlds: tuple[int, ...],
                       one_process_per_variant: bool = True,
                       mmap_thresholds: tuple[int | None, ...] = (None,)) -> dict[str, Any]:
    """Per world size and variant, every rank's peak RSS over its baseline (MB), its local
    parameter MB, the most file-backed RSS it held (the memory-mapped checkpoint's pages)
    and its RSS after each phase; the checkpoint is written once beforehand.
    ``one_process_per_variant=False`` (quick) runs the variants one after another in the
    same ranks, resetting the peak in between, and every world size in one launch. Per
    ``mmap_thresholds`` entry the ranks run with glibc's defaults (None) or with
    ``MALLOC_MMAP_THRESHOLD_`` fixed at that many bytes, so that every large freed tensor
    goes back to the OS at once: the peak is then what was live, not what the allocator
    kept (glibc raises its mmap threshold up to 32 MB after the first large free and keeps
    freed heap chunks)."""
    from safetensors.torch import save_file

    from qcompile.tools.bench.models import big_model

    model = big_model(blocks, width)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    block_mb = model_mb / blocks
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model.safetensors")
        save_file(dict(model.state_dict()), ckpt)
        del model
        groups = ([[v] for v in COMPILE_ONCE_VARIANTS] if one_process_per_variant
                  else [list(COMPILE_ONCE_VARIANTS)])
        runs = [(m, w, i, v) for m in mmap_thresholds for w in worlds
                for i, v in enumerate(groups)]
        if not one_process_per_variant:  # one launch per allocator setting: every world
            # size in turn in the same ranks (starting ranks costs more than the work)
            for m in mmap_thresholds:
                jobs = [(w, os.path.join(tmp, f"m{m}-w{w}-{i}", "store"), v, blocks, width,
                         ckpt, os.path.join(tmp, f"m{m}-w{w}-{i}"))
                        for threshold, w, i, v in runs if threshold == m]
                for job in jobs:
                    os.makedirs(job[-1])
                spawn(compile_once_jobs_rank, (jobs,), max(worlds), m)
        for threshold, world, i, variants in runs:
            out = os.path.join(tmp, f"m{threshold}-w{world}-{i}")
            if one_process_per_variant:
                os.makedirs(out)
                ranks = spawn_ranks(compile_once_rank,
                                    (world, os.path.join(out, "store"), variants, blocks,
                                     width, ckpt, out), world, out, threshold)
            else:
                ranks = read_ranks(out, world)
            bound = compile_once_bound(model_mb, block_mb, world)
            for v in variants:
                peaks = [rank[v]["peak_mb"] for rank in ranks]
                rows.append({"mmap_threshold": threshold, "world": world, "variant": v,
                             "peaks_mb": peaks,
                             "bound_mb": bound, "ok": max(peaks) <= bound,
                             "local_param_mb": [rank[v]["local_param_mb"] for rank in ranks],
                             "file_mb": [max([p[3] for p in rank[v]["phases"]], default=0.0)
                                         for rank in ranks],
                             "phases": [rank[v]["phases"] for rank in ranks]})
    return {"model_mb": model_mb, "block_mb": block_mb, "blocks": blocks, "rows": rows}


def run_compile_once(quick: bool) -> dict[str, Any]:
    if quick:
        return bench_compile_once(4, 256, (1, 2), one_process_per_variant=False)
    return bench_compile_once(12, 2048, (1, 2, 4), mmap_thresholds=(None, 1 << 20))


def compile_once_text(r: dict[str, Any]) -> str:
    """The table: world size, variant, each rank's peak, the bound, whether it holds, and
    the most file-backed RSS each rank held (part of its peak: the checkpoint's mapped
    pages); one section per allocator setting. The calibrated variant is int8-static with
    8 calibration batches per rank (the others int8-qat, uncalibrated).

    >>> print(compile_once_text({"model_mb": 400.0, "block_mb": 50.0, "blocks": 8, "rows": [
    ...     {"world": 2, "variant": "checkpoint", "peaks_mb": [250.0, 240.0],
    ...      "bound_mb": 330.0, "ok": True, "file_mb": [100.0, 90.0]}]}))
    ... # doctest: +NORMALIZE_WHITESPACE
    compile_once: peak RSS per rank over the post-import baseline, 400 MB model of 8 blocks
    (50 MB each); bound (model/N + 2 blocks) + 10%
    glibc malloc defaults:
     N  variant                          peak per rank (MB)     bound   ok   mapped file (MB)
     2  fsdp2 + checkpoint               250 / 240                330  yes  100 / 90
    """
    lines = [f"compile_once: peak RSS per rank over the post-import baseline, "
             f"{r['model_mb']:.0f} MB model of {r['blocks']} blocks ({r['block_mb']:.0f} MB "
             f"each); bound (model/N + 2 blocks) + 10%"]
    if any(row["variant"] == "calibrated" for row in r["rows"]):
        lines.append(f"calibrated: int8-static, {CALIBRATION_BATCHES} calibration batches per "
                     "rank through the sharded graph; the other rows int8-qat, uncalibrated")
    section: Any = ()
    for row in r["rows"]:
        threshold = row.get("mmap_threshold")
        if threshold != section:
            section = threshold
            lines += ["glibc malloc defaults:" if threshold is None else
                      f"MALLOC_MMAP_THRESHOLD_={threshold} (freed tensors return to the OS: "
                      "the peak is what was live):",
                      f"{'N':>2}  {'variant':<31}  {'peak per rank (MB)':<21} {'bound':>6}   "
                      f"ok   mapped file (MB)"]
        peaks = " / ".join(f"{p:.0f}" for p in row["peaks_mb"])
        files = " / ".join(f"{p:.0f}" for p in row.get("file_mb", ()))
        lines.append(f"{row['world']:>2}  {COMPILE_ONCE_VARIANTS[row['variant']]:<31}  "
                     f"{peaks:<21} {row['bound_mb']:>6.0f}  {'yes' if row['ok'] else 'no ':<3}  "
                     f"{files}")
    return "\n".join(lines)


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
        if quick:  # one launch of 4 ranks runs every layout (starting ranks dominates)
            torch.multiprocessing.spawn(hybrid_layouts_rank,
                                        args=(os.path.join(tmp, "store"),
                                              list(HYBRID_LAYOUTS), steps, tmp),
                                        nprocs=4, join=True)
        for layout in HYBRID_LAYOUTS:
            if not quick:  # a fresh launch per layout
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
