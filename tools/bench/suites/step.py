"""The ``step`` suite: a QAT training step (forward, backward, SGD) relative to the fp32
eager step, qcompile int8-qat next to torch.ao ``prepare_qat_fx`` and, when installed,
torchao's QAT, on the MLP, the ResNet-18-style CNN and the transformer; and qcompile's
LLM schemes (full runs): NVFP4 weights only (``nvfp4_w``), ``nvfp4-qat`` (weights and the
inputs of Linear layers), ``8da4w-qat``, and llama.cpp's Q4_0 grid on the weights only
(``gguf_q4_0_w``) and with its Q8_0 activation blocks (``gguf-q4_0-qat``: ``gguf_q4_0``).
``qcompile_two_pass`` is int8-qat with its step-update activation quantizers reading each
input twice (``two_pass``), next to the one pass they make. Prints as ``records`` (one
line per model).

Every contender's minor page faults per step are in its row (``*_faults``): glibc returns a
large free block at the top of its heap to the system (``M_TRIM_THRESHOLD``, which it
raises and lowers by itself) and the next step faults its pages in again, one 4 KB page
at a time, inside whichever operator allocates there (a weight's gradient, mostly). Which
contender meets that, and how often, depends on where its tensors happened to land in the
heap, not on its step: 0 to 4,000 faults a step, about a microsecond each. So the suite
measures every model twice: in this process, with the allocator as it is (glibc's
defaults, unless the environment sets them), and in a fresh process whose heap is steady
(``STEADY_HEAP``: nothing returned, so nothing faulted back; the ``*_steady_heap`` rows).

Example:
    >>> from qcompile.tools.bench.suites.step import bench_step
    >>> bench_step.__doc__.splitlines()[0]
    'Training step (fwd + bwd + SGD) relative to fp32 eager.'
"""

from __future__ import annotations

import copy
import json
import os
import resource
import statistics
import subprocess
import sys
from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.graph.meta import CHECK_FINITE_KEY
from qcompile.tools.bench.competitors import has_torchao, prepare_qat_fx, torchao_qat
from qcompile.tools.bench.models import workloads
from qcompile.tools.bench.suites.fakequant import clock

# NVFP4 fake-quantized weights, float activations (Linear layers)
NVFP4_WEIGHTS = qc.CompileSpec.model_validate({"quant": {
    "mode": "qat", "target": "generic",
    "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "nvfp4"}}]}})
# llama.cpp's Q4_0 grid on the weights only (gguf-q4_0-qat without its activation blocks)
Q4_0_WEIGHTS = qc.CompileSpec.model_validate({"quant": {
    "mode": "qat", "target": "generic",
    "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "q4_0"}}]}})
# glibc's settings for a heap that never shrinks: no trimming, every block from the heap
# (a fixed mmap threshold also stops glibc moving its thresholds by itself)
STEADY_HEAP = {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}


def two_pass(gm: nn.Module) -> nn.Module:
    """``gm`` with its step-update activation quantizers reading each input twice (the
    range into the pending statistics, then the fake-quant), instead of once
    (``qcompile::fake_quant_minmax``): the same bits, for comparison."""
    for q in qc.quantizers(gm).values():
        q.__dict__["_one_pass_step"] = False  # a plain attribute (no __setattr__ work)
    return gm


def warm_up_steps(m: nn.Module) -> int:
    """1, plus the steps in which a qcompile graph still checks its quantizers' inputs for
    NaN and infinity (``train.check_finite``, the first 10 by default: one more pass over
    every quantized tensor, in the first steps of a training run only, not in the steady
    state the suite measures)."""
    meta = getattr(m, "meta", None)
    state = meta.get(CHECK_FINITE_KEY) if isinstance(meta, dict) else None
    return 1 + (max(int(state[0]), 0) if state else 0)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bench_step(quick: bool) -> dict[str, Any]:
    """Training step (fwd + bwd + SGD) relative to fp32 eager.

    The steps of all libraries are interleaved, round by round (a shared machine's load
    changes within seconds: timing one library's steps after another's measured the load
    as much as the step). Medians over the rounds; ``*_vs_fp32_range`` is the
    interquartile range of the per-round ratios. Each contender is warmed up first
    (``warm_up_steps``). ``QCOMPILE_BENCH_CLOCK=cpu``: see ``fakequant.clock``. Then the
    same in a fresh process with a steady heap (``steady_heap``): the ``<model>_steady_heap``
    rows."""
    out = measure_steps(quick)
    for name, row in steady_heap(quick).items():
        out[f"{name}_steady_heap" if name != "note" else name] = row
    return out


def steady_heap(quick: bool) -> dict[str, Any]:
    """``measure_steps`` in a fresh process with glibc's ``STEADY_HEAP`` settings and this
    process's torch threads."""
    code = ("import json, sys, torch\n"
            "from qcompile.tools.bench.suites.step import measure_steps\n"
            "torch.set_num_threads(int(sys.argv[1]))\n"
            "print(json.dumps(measure_steps(sys.argv[2] == '1')))")
    run = subprocess.run([sys.executable, "-c", code, str(torch.get_num_threads()),
                          "1" if quick else "0"], capture_output=True, text=True,
                         env={**os.environ, **STEADY_HEAP}, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"the steady-heap run failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure_steps(quick: bool) -> dict[str, Any]:
    """``bench_step``'s rows, measured in this process (its allocator as it is)."""
    out: dict[str, Any] = {}
    rounds = 3 if quick else 15
    for name, (make, x) in workloads(quick).items():
        torch.manual_seed(0)
        model = make()
        builds: list[tuple[str, Any]] = [
            ("fp32", lambda m: m),
            ("qcompile", lambda m, x=x: qc.qcompile(m, "int8-qat", (x,))),
            ("qcompile_two_pass", lambda m, x=x: two_pass(qc.qcompile(m, "int8-qat", (x,)))),
            ("prepare_qat_fx", lambda m, x=x: prepare_qat_fx(m, x))]
        if not quick:  # the LLM schemes
            builds += [("nvfp4_w", lambda m, x=x: qc.qcompile(m, NVFP4_WEIGHTS, (x,))),
                       ("nvfp4", lambda m, x=x: qc.qcompile(m, "nvfp4-qat", (x,))),
                       ("8da4w", lambda m, x=x: qc.qcompile(m, "8da4w-qat", (x,))),
                       ("gguf_q4_0_w", lambda m, x=x: qc.qcompile(m, Q4_0_WEIGHTS, (x,))),
                       ("gguf_q4_0", lambda m, x=x: qc.qcompile(m, "gguf-q4_0-qat", (x,)))]
        if has_torchao():  # optional competitor (fake-quantizes Linear layers only)
            builds.append(("torchao_qat", torchao_qat))
        steps: dict[str, Any] = {}
        for label, build in builds:
            m = build(copy.deepcopy(model).train())
            opt = torch.optim.SGD(m.parameters(), lr=1e-4)

            def step(m: nn.Module = m, opt: Any = opt, x: torch.Tensor = x) -> None:
                opt.zero_grad()
                m(x).float().square().mean().backward()
                opt.step()

            for _ in range(warm_up_steps(m)):  # first-call paths, observers initialised
                step()
            steps[label] = step
        times: dict[str, list[float]] = {label: [] for label in steps}
        faults: dict[str, list[int]] = {label: [] for label in steps}
        now = clock()
        for _ in range(rounds):
            for label, step in steps.items():
                f0, t0 = _faults(), now()
                step()
                times[label].append(now() - t0)
                faults[label].append(_faults() - f0)
        med = {k: statistics.median(v) for k, v in times.items()}
        row: dict[str, Any] = {f"{k}_s": v for k, v in med.items()}
        for k in steps:
            row[f"{k}_faults"] = statistics.median(faults[k])
            if k == "fp32":
                continue
            ratios = sorted(a / b for a, b in zip(times[k], times["fp32"]))
            row[f"{k}_vs_fp32"] = med[k] / med["fp32"]
            row[f"{k}_vs_fp32_range"] = [ratios[len(ratios) // 4],
                                         ratios[(3 * len(ratios)) // 4]]
        out[name] = row
    if not has_torchao():
        out["note"] = "torchao not installed (pip install .[bench]): its QAT is not compared"
    return out
