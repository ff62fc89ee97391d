"""The compile-cost suites: ``compile`` (time) and ``memory`` (peak RSS).

- ``compile``: compile time of qcompile int8-qat (also ``inplace=True``), torch.ao
  ``prepare_qat_fx`` and, when installed, torchao's QAT, relative to
  ``torch.fx.symbolic_trace``, on the MLP, the ResNet-18-style CNN and the transformer,
  next to ``floors.rewrite_floor`` (a lower bound for any fx rewrite returning qcompile's
  graph under its contract); the export front end (``trace: {method: export}``) relative
  to ``torch.export.export``, next to ``ep.module()`` (torch's own unlifting, which the
  front end calls); then compile time of 50..400-block MLPs (scaling);
- ``memory``: peak RSS of compile + 2 QAT steps of the transformer, each way in a fresh
  process; then the training-step rows (``qcompile.tools.bench.train_memory``): per-rank
  memory of one SGD step under FSDP2 on 1, 2 and 4 gloo ranks, float vs qcompile QAT vs
  torch.ao ``prepare_qat_fx``.

``compile`` prints as ``records`` (one line per model); ``memory_text`` says ``memory``
as records and a table.

Example:
    >>> from qcompile.tools.bench.suites.compile import bench_compile, bench_memory
    >>> bench_compile.__doc__.split(":")[0]
    'Compile time'
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

import qcompile as qc
from qcompile.tools.bench.competitors import (
    has_torchao,
    prepare_qat_fx,
    symbolic_trace,
    torchao_qat,
)
from qcompile.tools.bench.floors import rewrite_floor
from qcompile.tools.bench.measure import median_seconds
from qcompile.tools.bench.models import deep_mlp, workloads
from qcompile.tools.bench.train_memory import bench_train_memory, train_memory_text
from qcompile.tools.bench.workers import memory_worker
from qcompile.tools.output import records


def bench_compile(quick: bool) -> dict[str, Any]:
    """Compile time: symbolic_trace vs qcompile int8-qat (also ``inplace=True``, which skips
    qcompile's copy of the model) vs prepare_qat_fx (on a copy, as qcompile makes one); the
    export front end (qcompile with ``trace.method: export`` and ``quant.mode: none``, so
    the trace pass alone) vs ``torch.export.export(strict=False)``; and scaling with depth.
    Two floors run alongside: ``rewrite_floor`` (``floors``: the work any fx rewrite
    returning qcompile's graph under its contract cannot skip; ``qcompile_vs_floor``) and
    ``torch.export`` followed by ``ep.module()`` (``export_module_vs_export``: torch's
    unlifting, which the export front end calls, on its own).
    Each model's contenders run once untimed (warm-up), then in interleaved rounds, where
    each contender runs twice back to back and the second run is timed; medians of the
    rounds, and each ratio's range over the rounds (round by round, side by side).
    ``quick`` (a smoke run of every contender, on smaller models): one round, each
    contender once, timed, no warm-up.
    Models and specs are built outside the timings (``spec_load_s``: parsing the preset)."""
    rounds = 1 if quick else 5  # quick: a smoke run of every contender, not a measurement
    spec = qc.load_spec("int8-qat")
    export_spec = qc.CompileSpec.model_validate({"quant": {"mode": "none"},
                                                 "trace": {"method": "export"}})
    out: dict[str, Any] = {"spec_load_s": median_seconds(lambda: qc.load_spec("int8-qat"), 5)}
    for name, (make, x) in workloads(quick).items():
        torch.manual_seed(0)
        model = make()
        compiled = qc.qcompile(model, spec, (x,))  # the graph the floor rebuilds
        runs = {
            "symbolic_trace": lambda m, x=x: symbolic_trace(m),
            "qcompile": lambda m, x=x: qc.qcompile(m, spec, (x,)),
            "qcompile_inplace": lambda m, x=x: qc.qcompile(m, spec, (x,), inplace=True),
            "prepare_qat_fx": lambda m, x=x: prepare_qat_fx(copy.deepcopy(m), x),
            "torch_export": lambda m, x=x: torch.export.export(m, (x,), strict=False),
            "qcompile_export": lambda m, x=x: qc.qcompile(m, export_spec, (x,)),
            "rewrite_floor": lambda m, x=x, gm=compiled: rewrite_floor(m, x, gm, spec),
            "torch_export_module": lambda m, x=x: torch.export.export(
                m, (x,), strict=False).module(),
        }
        if has_torchao():  # optional competitor (Linear layers only)
            runs["torchao_qat"] = lambda m: torchao_qat(copy.deepcopy(m))
        times: dict[str, list[float]] = {k: [] for k in runs}
        warmup = 0 if quick else 1  # quick: each contender runs once, timed
        for r in range(warmup + rounds):
            for key, fn in runs.items():
                # each contender runs twice in a row and the second run is timed: it finds
                # the caches and the garbage collector as its own work left them, not as
                # the contender before it did (torch.export leaves much cyclic garbage, and
                # the CNN's 7 ms symbolic_trace took 8.5-9 ms timed after other contenders)
                if not quick:
                    fn(copy.deepcopy(model) if key == "qcompile_inplace" else model)
                m = copy.deepcopy(model) if key == "qcompile_inplace" else model
                t0 = time.perf_counter()
                fn(m)
                if r >= warmup:  # round 0 warms up
                    times[key].append(time.perf_counter() - t0)
        t = {k: statistics.median(v) for k, v in times.items()}
        out[name] = {f"{k}_s": v for k, v in t.items()}
        for k in t:
            if k in ("symbolic_trace", "torch_export", "qcompile_export",
                     "torch_export_module"):
                continue
            out[name][f"{k}_vs_trace"] = t[k] / t["symbolic_trace"]
            out[name][f"{k}_vs_trace_range"] = _range(times[k], times["symbolic_trace"])
        for key, num, den in (("qcompile_vs_floor", "qcompile", "rewrite_floor"),
                              ("export_front_end_vs_export", "qcompile_export", "torch_export"),
                              ("export_module_vs_export", "torch_export_module",
                               "torch_export")):
            out[name][key] = t[num] / t[den]
            out[name][f"{key}_range"] = _range(times[num], times[den])
    sizes = (50, 100) if quick else (50, 100, 200, 400)
    qc.qcompile(deep_mlp(10), spec, (torch.randn(4, 64),))  # warm up imports and caches
    scaling: dict[int, float] = {}
    for n in sizes:
        times_n = []
        for _ in range(rounds):
            m, x = deep_mlp(n), torch.randn(4, 64)
            t0 = time.perf_counter()
            qc.qcompile(m, spec, (x,))
            times_n.append(time.perf_counter() - t0)
        scaling[n] = statistics.median(times_n)
    out["scaling_s"] = scaling
    out["scaling_ratio"] = scaling[sizes[-1]] / scaling[sizes[0]]
    return out


def _range(a: list[float], b: list[float]) -> list[float]:
    """[lowest, highest] of the round-by-round ratios a[i] / b[i] (each round runs the
    contenders back to back, so a ratio shares its round's machine load)."""
    ratios = [x / y for x, y in zip(a, b)]
    return [min(ratios), max(ratios)]


def bench_memory(quick: bool) -> dict[str, Any]:
    """Peak RSS (MB) of compile + 2 QAT steps of the transformer (12 layers; 4 with
    ``quick``), each way in a fresh process: qcompile (which compiles a copy and leaves the
    model alone), qcompile ``inplace=True``, and torch.ao ``prepare_qat_fx`` (in place).
    ``*_net_mb`` is above the process's RSS after imports (torch, qcompile, torch.ao).

    ``train_step``: per-rank memory of one SGD training step under FSDP2 (float,
    qcompile QAT through ``compile_once``, the same keeping the fake-quantized weights for
    backward, torch.ao ``prepare_qat_fx`` + ``fully_shard``), one fresh process group per
    variant and world size (``train_memory.bench_train_memory``): a 256 MB model of 8
    blocks at batch 8 on 1, 2 and 4 ranks, with glibc's malloc defaults and with
    ``MALLOC_MMAP_THRESHOLD_=1048576``; ``quick``: a 2 MB model on 1 and 2 ranks."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {}
    hows = ("qcompile", "qcompile_inplace", "prepare_qat_fx")
    with tempfile.TemporaryDirectory() as tmp:
        # concurrently: each process's peak RSS is its own, and the imports dominate the time
        procs = {how: ctx.Process(target=memory_worker,
                                  args=(how, quick, os.path.join(tmp, f"{how}.json")))
                 for how in hows}
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join()
        for how, p in procs.items():
            if p.exitcode != 0:
                raise RuntimeError(f"memory worker {how!r} exited with {p.exitcode}")
            with open(os.path.join(tmp, f"{how}.json")) as f:
                r = json.load(f)
            out[how] = {"peak_mb": r["peak_mb"], "net_mb": r["peak_mb"] - r["import_mb"],
                        "after_compile_mb": r["compile_mb"], "import_mb": r["import_mb"],
                        "weights_mb": r["weights_mb"]}
    ao = out["prepare_qat_fx"]
    for how in ("qcompile", "qcompile_inplace"):
        out[f"{how}_vs_prepare_qat_fx"] = out[how]["peak_mb"] / ao["peak_mb"]
        out[f"{how}_vs_prepare_qat_fx_net"] = out[how]["net_mb"] / ao["net_mb"]
    if quick:  # a smoke run of every variant
        out["train_step"] = bench_train_memory(4, 256, 8, (1, 2))
    else:  # 8 blocks of 2 x Linear(2048): 256 MB, weights >> activations at batch 8
        out["train_step"] = bench_train_memory(8, 2048, 8, (1, 2, 4),
                                               mmap_thresholds=(None, 1 << 20))
    return out


def memory_text(r: dict[str, Any]) -> str:
    """``bench_memory``'s result: the compile + QAT-step rows as records, then the
    training-step table (``train_memory.train_memory_text``).

    >>> row = {"peak_mb": 900.0, "net_mb": 500.0}
    >>> print(memory_text({"qcompile": row, "qcompile_vs_prepare_qat_fx": 0.9,
    ...                    "train_step": {"model_mb": 2.0, "blocks": 4, "batch": 8,
    ...                                   "rows": []}}))  # doctest: +NORMALIZE_WHITESPACE
    qcompile: peak_mb 900, net_mb 500
    qcompile_vs_prepare_qat_fx: 0.9
    training step under FSDP2 (SGD; one warm-up step first): per-rank MB, 2 MB model of 4
    blocks (0.5 MB each), batch 8; a QAT step within 10% of the float step
    """
    rest = {k: v for k, v in r.items() if k != "train_step"}
    lines = [records(rest)] if rest else []
    if "train_step" in r:
        lines.append(train_memory_text(r["train_step"]))
    return "\n".join(lines)
