"""The ``fakequant`` suite: fake-quant throughput (GB/s, forward and forward+backward) of
qcompile's quantizers per-tensor / per-channel / per-group / LSQ next to ``y.copy_(x)``
and torch's built-in fake-quant op of the same kind, the block-scaled formats (MX, NVFP4,
NF4) next to the int4 per-group quantizer and the copy, plus the per-call time on a small
tensor. Prints as ``records`` (one line per kind).

Example:
    >>> import torch
    >>> from qcompile.tools.bench.suites.fakequant import fakequant_cases
    >>> x = torch.randn(4, 1024)
    >>> fq, builtin = fakequant_cases(x, ("per_channel",))["per_channel"]
    >>> bool((fq(x) - builtin(x)).abs().max() < 1e-6)
    True
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def clock() -> Callable[[], float]:
    """The clock the ``fakequant`` and ``step`` suites time with: wall time, or this
    thread's CPU time with ``QCOMPILE_BENCH_CLOCK=cpu`` (only meaningful with
    ``OMP_NUM_THREADS=1``: on a machine shared with other jobs it leaves out the time the
    process waits for a core, which wall time on 2 busy cores mostly measures)."""
    cpu = os.environ.get("QCOMPILE_BENCH_CLOCK") == "cpu"
    return time.thread_time if cpu else time.perf_counter


def fakequant_cases(x: torch.Tensor, only: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
    """name -> (qcompile FakeQuantize, torch's built-in op of the same kind) on ``x``
    ([rows, 1024]); per-group has no built-in op of its own: torch's per-channel op on
    the [rows * groups, group_size] view computes the same thing."""
    from qcompile.runtime.fake_quant import FakeQuantize

    rows, cols = x.shape
    kinds = {"per_tensor": {},
             "per_channel": {"granularity": "per_channel", "axis": 0, "channels": rows},
             "per_channel_last": {"granularity": "per_channel", "axis": -1, "channels": cols},
             "per_group": {"granularity": "per_group", "group_size": 128,
                           "channels": rows * cols // 128},
             "lsq": {"learnable": True},
             "lsq_per_channel": {"learnable": True, "granularity": "per_channel", "axis": 0,
                                 "channels": rows}}
    cases: dict[str, tuple[Any, Any]] = {}
    for name, kw in kinds.items():
        if only and name not in only:
            continue
        fq = FakeQuantize("int8", **kw).to(x.device)
        # calibrated on a narrower range than x's, so some elements clamp (as activations
        # under a moving average do): the backward then has a mask to apply. (A weight
        # under its own min-max range clamps nothing, and its backward passes the gradient
        # on without touching it.)
        fq(x * 0.9)
        fq.observe = False
        s, z = fq.scale.detach().clone(), fq.zero_point.clone()
        sp, zf = s.clone().requires_grad_(True), z.float()
        builtin = {
            "per_tensor": lambda t, s=s, z=z: torch.fake_quantize_per_tensor_affine(
                t, float(s), int(z), -128, 127),
            "per_channel": lambda t, s=s, z=z: torch.fake_quantize_per_channel_affine(
                t, s, z, 0, -128, 127),
            "per_channel_last": lambda t, s=s, z=z: torch.fake_quantize_per_channel_affine(
                t, s, z, 1, -128, 127),
            "per_group": lambda t, s=s, z=z: torch.fake_quantize_per_channel_affine(
                t.reshape(-1, 128), s, z, 0, -128, 127).view_as(t),
            "lsq": lambda t, sp=sp, zf=zf: torch._fake_quantize_learnable_per_tensor_affine(
                t, sp, zf, -128, 127, 1.0),
            "lsq_per_channel": lambda t, sp=sp, zf=zf:
                torch._fake_quantize_learnable_per_channel_affine(t, sp, zf, 0, -128, 127, 1.0),
        }[name]
        cases[name] = (fq, builtin)
    return cases


def bench_fakequant(quick: bool) -> dict[str, Any]:
    """Fake-quant throughput (GB/s), qcompile vs torch's built-in op of the same kind, next
    to ``y.copy_(x)``, all interleaved in one run (medians of the rounds).

    GB/s counts the bytes every implementation must move: the forward reads x and writes
    the output (2 x 4 bytes per element, like the copy); forward+backward also reads the
    output's gradient and writes x's (4 x 4 bytes; saved state such as a mask is not
    counted). The backward gets a dense upstream gradient (``out.backward(g)``).
    ``small_64x64_us``: per-call time on a 64x64 tensor (dispatch overhead), next to
    ``autograd_floor_fwd_bwd_us``, the same harness around ``torch.neg``, and
    ``mul_one_fwd_bwd_us``, around ``t * 1.0``.

    ``QCOMPILE_BENCH_DEVICE=cuda`` runs it on a GPU (where qcompile runs the eager formula
    unless compiled); ``QCOMPILE_BENCH_COMPILED=1`` adds ``<kind>_compiled`` rows:
    the quantizer under ``torch.compile`` (Inductor's fused kernel, compile time not
    counted)."""
    from qcompile.runtime import kernels

    device = torch.device(os.environ.get("QCOMPILE_BENCH_DEVICE", "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = (1 if quick else 16) * 1024 * 1024
    rounds = 3 if quick else 7
    x = torch.randn(n // 1024, 1024, device=device)
    g = torch.randn_like(x)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()

    def fwd(fn: Any, t: torch.Tensor = x) -> Any:
        def run() -> None:
            fn(t)
            sync()
        return run

    def fwd_bwd(fn: Any, t: torch.Tensor = x, grad: torch.Tensor = g) -> Any:
        def run() -> None:
            fn(t.detach().requires_grad_(True)).backward(grad)
            sync()
        return run

    cases = fakequant_cases(x)
    if os.environ.get("QCOMPILE_BENCH_COMPILED") == "1":
        for name in ("per_tensor", "per_channel", "lsq"):
            fq, builtin = cases[name]
            cases[f"{name}_compiled"] = (torch.compile(fq, dynamic=False), builtin)
    runs: list[tuple[str, Any]] = []
    for name, (fq, builtin) in cases.items():
        runs.append(("copy", fwd(lambda t: y.copy_(t))))  # a copy next to every case
        for impl, fn in (("qcompile", fq), ("torch", builtin)):
            runs.append((f"{name}.{impl}_fwd", fwd(fn)))
            runs.append((f"{name}.{impl}_fwd_bwd", fwd_bwd(fn)))
    times: dict[str, list[float]] = {k: [] for k, _ in runs}
    for _, fn in runs:  # warm up (allocator, first-call paths)
        fn()
    now = clock()
    for _ in range(rounds):
        for key, fn in runs:
            t0 = now()
            fn()
            times[key].append(now() - t0)
    t = {k: statistics.median(v) for k, v in times.items()}
    copy_gbps = 2 * nbytes / t["copy"] / 1e9
    out: dict[str, Any] = {"elements": n, "copy_GBps": copy_gbps,
                           "kernels": 1 if kernels.available() else 0}
    out.update(bench_block_formats(x, g, rounds, quick))
    for name in cases:
        row: dict[str, Any] = {}
        for key, tensors in (("fwd", 2), ("fwd_bwd", 4)):
            for impl in ("qcompile", "torch"):
                row[f"{impl}_{key}_GBps"] = tensors * nbytes / t[f"{name}.{impl}_{key}"] / 1e9
            row[f"speedup_{key}"] = t[f"{name}.torch_{key}"] / t[f"{name}.qcompile_{key}"]
            row[f"{key}_vs_copy"] = row[f"qcompile_{key}_GBps"] / copy_gbps
        out[name] = row
    # per-call overhead: a 64x64 per-tensor quantizer, forward and forward+backward, next
    # to the floor under any fake-quant's fwd+bwd here: one built-in elementwise op (a C++
    # autograd node) in the same harness (the Python backward() round trip dominates it)
    small = torch.randn(64, 64, device=device)
    fq, builtin = fakequant_cases(small, ("per_tensor",))["per_tensor"]
    gs = torch.randn_like(small)
    calls = 50 if quick else 500
    small_runs = {f"{impl}_{key}_us": run
                  for impl, fn in (("qcompile", fq), ("torch", builtin))
                  for key, run in (("fwd", fwd(fn, small)), ("fwd_bwd", fwd_bwd(fn, small, gs)))}
    small_runs["autograd_floor_fwd_bwd_us"] = fwd_bwd(torch.neg, small, gs)
    # the cheapest binary op (MulBackward0 keeps its scalar): what one node with state costs
    small_runs["mul_one_fwd_bwd_us"] = fwd_bwd(lambda t: t * 1.0, small, gs)
    small_times: dict[str, list[float]] = {k: [] for k in small_runs}
    for r in range(rounds + 1):  # interleaved; round 0 warms up
        for key, run in small_runs.items():
            t0 = now()
            for _ in range(calls):
                run()
            if r:
                small_times[key].append((now() - t0) / calls * 1e6)
    row = {k: statistics.median(v) for k, v in small_times.items()}
    out["small_64x64_us"] = row
    return out


def block_cases(x: torch.Tensor, formats: tuple[str, ...] = ()) -> dict[str, Any]:
    """name -> forward of each block-scaled format (or of ``formats``) at its default block
    (``fake_quantize_block``: the C++ kernel on CPU tensors), and of the int4 per-group (32)
    quantizer they replace."""
    from qcompile.runtime.block_formats import BLOCK_DTYPES, default_block, fake_quantize_block
    from qcompile.runtime.fake_quant import FakeQuantize

    cases: dict[str, Any] = {
        fmt: lambda t, fmt=fmt: fake_quantize_block(t, fmt, default_block(fmt))
        for fmt in formats or BLOCK_DTYPES}
    fq = FakeQuantize("int4", granularity="per_group", group_size=32,
                      channels=x.numel() // 32).to(x.device)
    fq(x)  # a weight under its own min-max range
    fq.observe = False
    cases["int4_per_group32"] = fq
    return cases


def bench_block_formats(x: torch.Tensor, g: torch.Tensor, rounds: int,
                        quick: bool) -> dict[str, Any]:
    """The block-scaled formats' fake-quant throughput, interleaved (medians of the rounds):
    forward, forward+backward (the identity gradient, handed back by ``torch.autograd.grad``:
    ``.backward(g)`` on a leaf would add a copy of ``g``, which the caller still holds, into
    ``.grad``) and the bfloat16 forward, each next to a copy of the same bytes;
    ``<kind>_vs_copy`` is the share of the copy's bandwidth. NVFP4 reads x twice (its tensor
    scale first): its GB/s still count one read and one write. ``block_eager``: the eager
    formula (``fake_quant_eager``) on a smaller tensor and, in full runs, its
    ``torch.compile`` (Inductor, compile time not counted). ``quick``: one format per kind,
    one round."""
    from qcompile.runtime.block_formats import default_block, fake_quant_eager

    device = x.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    xb, y, yb = x.bfloat16(), torch.empty_like(x), torch.empty_like(x, dtype=torch.bfloat16)
    cases = block_cases(x, ("mxfp4", "nvfp4", "nf4") if quick else ())
    runs: list[tuple[str, Any]] = []

    def timed(key: str, fn: Any) -> None:
        def run() -> None:
            fn()
            sync()
        runs.append((key, run))

    def fwd_bwd(fn: Any) -> None:
        leaf = x.detach().requires_grad_(True)
        torch.autograd.grad(fn(leaf), leaf, g)

    for name, fn in cases.items():
        timed("copy", lambda: y.copy_(x))
        timed(f"{name}.fwd", lambda fn=fn: fn(x))
        timed(f"{name}.fwd_bwd", lambda fn=fn: fwd_bwd(fn))
        timed("copy_bf16", lambda: yb.copy_(xb))
        timed(f"{name}.bf16_fwd", lambda fn=fn: fn(xb))
    # the eager formula (and Inductor's kernel of it): [N, 16] intermediates for NF4
    m = 1 << (14 if quick else 20)
    xe = x.reshape(-1)[:m].reshape(-1, 1024)
    eager = {fmt: (lambda t, fmt=fmt: fake_quant_eager(t, fmt, default_block(fmt)))
             for fmt in ("mxfp4", "nvfp4", "nf4")}
    for fmt, fn in eager.items():
        timed("copy_eager_size", lambda: y.reshape(-1)[:m].copy_(xe.reshape(-1)))
        timed(f"{fmt}.eager", lambda fn=fn: fn(xe))
        if not quick:
            compiled = torch.compile(fn, dynamic=False)
            timed(f"{fmt}.compiled", lambda fn=compiled: fn(xe))
    times: dict[str, list[float]] = {k: [] for k, _ in runs}
    for _, fn in runs:  # warm up (and compile)
        fn()
    now = clock()
    for _ in range(1 if quick else rounds):
        for key, fn in runs:
            t0 = now()
            fn()
            times[key].append(now() - t0)
    t = {k: statistics.median(v) for k, v in times.items()}
    nbytes, nbf16 = x.numel() * x.element_size(), x.numel() * 2
    out: dict[str, Any] = {}
    for name in cases:
        row: dict[str, Any] = {}
        for key, tensors, size, copy in (("fwd", 2, nbytes, "copy"),
                                         ("fwd_bwd", 4, nbytes, "copy"),
                                         ("bf16_fwd", 2, nbf16, "copy_bf16")):
            row[f"{key}_GBps"] = tensors * size / t[f"{name}.{key}"] / 1e9
            row[f"{key}_vs_copy"] = row[f"{key}_GBps"] / (2 * size / t[copy] / 1e9)
        out[f"block_{name}"] = row
    row = {"elements": m}
    for fmt in eager:
        for kind in ("eager", "compiled"):
            if f"{fmt}.{kind}" in t:
                row[f"{fmt}_{kind}_vs_copy"] = t["copy_eager_size"] / t[f"{fmt}.{kind}"]
    out["block_eager"] = row
    return out
