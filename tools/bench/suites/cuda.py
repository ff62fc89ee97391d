"""The ``cuda`` suite: GPU measurements, side by side in one run on one device.

- ``fakequant``: forward and forward+backward throughput of every quantizer kind (integer
  per-tensor / per-channel / per-group / per-token, fp8, LSQ, the block formats MXFP8 /
  MXFP4 / NVFP4 / NF4 and llama.cpp's Q4_0 / Q8_0 / Q4_K grids) as a share of the
  device's copy bandwidth (``y.copy_(x)``, bytes read plus written), eager and under
  ``torch.compile`` (Inductor fuses the formula into one kernel each way). Bytes counted
  as the CPU ``fakequant`` suite counts them: the forward reads x and writes the output,
  forward+backward also reads the output's gradient and writes x's (2 and 4 x 4 bytes per
  element).
- ``step``: a training step (forward, backward, fused AdamW) of a Llama-style decoder
  (``qcompile.tools.bench.lm.TinyLlama``, ~340M parameters, 4 x 1024 tokens) under
  ``torch.compile`` and bf16 autocast: the float model, qcompile ``8da4w-qat`` (int8
  per-token activations read by each Linear, int4 weights in groups of 32; ``w4a8-qat``
  where that preset is missing), ``gguf-q4_0-qat`` (llama.cpp's Q4_0 weights and Q8_0
  activation blocks) and, where it installs, torchao's
  QAT (``QATConfig`` over ``Int8DynamicActivationInt4WeightConfig(group_size=32)``, or its
  successor ``Int8DynamicActivationIntxWeightConfig``) on the same model; each as a ratio
  to the float step. The steps are interleaved round by round.

Times are medians of CUDA-event timings after a warm-up (the first calls compile). Without
a CUDA device the suite returns ``{"skipped": ...}``. ``python -m
qcompile.tools.bench.suites.cuda --out FILE --budget SECONDS`` writes the JSON after every
measurement (a run cut short keeps what it measured) and stops a part that outlives its
share of the budget; ``--device cpu`` runs the same code on the CPU (timed with the wall
clock), to check it on a machine without a GPU.

Example:
    >>> import torch
    >>> from qcompile.tools.bench.suites.cuda import bench_cuda
    >>> torch.cuda.is_available() or bench_cuda(quick=True)["skipped"].startswith("no CUDA")
    True
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from qcompile.tools.output import table

# name -> (FakeQuantize arguments, or ("block", format))
KINDS: dict[str, Any] = {
    "int8_per_tensor": {"dtype": "int8"},
    "int8_per_channel": {"dtype": "int8", "granularity": "per_channel", "axis": 0},
    "int4_per_group32": {"dtype": "int4", "granularity": "per_group", "group_size": 32},
    "int8_per_token": {"dtype": "int8", "symmetric": False, "granularity": "per_token"},
    "fp8_e4m3": {"dtype": "fp8_e4m3"},
    "lsq_int8": {"dtype": "int8", "learnable": True},
    "mxfp8_e4m3": ("block", "mxfp8_e4m3"),
    "mxfp4": ("block", "mxfp4"),
    "nvfp4": ("block", "nvfp4"),
    "nf4": ("block", "nf4"),
    "q4_0": ("block", "q4_0"),  # llama.cpp's grids
    "q8_0": ("block", "q8_0"),
    "q4_k": ("block", "q4_k"),
}
COMPILED = ("int8_per_channel", "int4_per_group32", "int8_per_token", "lsq_int8", "mxfp4",
            "nvfp4", "q4_0")


class Timer:
    """Median milliseconds of a callable: CUDA events on a GPU, the wall clock (after a
    synchronisation) elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def once(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def median(self, fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        return statistics.median(self.once(fn) for _ in range(iters))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Budget:
    """Seconds left of the run and of the part in progress; ``part(seconds)`` raises
    ``TimeoutError`` in this (main) thread once a part has run that long (a Python-level
    interrupt: a kernel in progress finishes first). The parts catch it where they can
    keep what they measured, and check ``part_left()`` before each measurement."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.part_end = self.deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def part_left(self) -> float:
        return min(self.part_end, self.deadline) - time.monotonic()

    @contextlib.contextmanager
    def part(self, seconds: float) -> Iterator[None]:
        seconds = max(1.0, min(seconds, self.left()))
        self.part_end = time.monotonic() + seconds
        main = threading.current_thread() is threading.main_thread()
        if not main or not hasattr(signal, "setitimer"):
            try:
                yield
            finally:
                self.part_end = self.deadline
            return

        def stop(signum: int, frame: Any) -> None:
            raise TimeoutError(f"part stopped after its {seconds:.0f} s")

        old = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            self.part_end = self.deadline


def _error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    where = traceback.extract_tb(e.__traceback__)
    last = next((f for f in reversed(where) if "/qcompile/" in f.filename
                 or "/tools/" in f.filename), where[-1] if where else None)
    at = f" (at {Path(last.filename).name}:{last.lineno})" if last is not None else ""
    return f"{type(e).__name__}: {first}{at}"


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, memory_GiB=round(props.total_memory / 2**30, 1),
                   sms=props.multi_processor_count, cuda=torch.version.cuda)
    with contextlib.suppress(ImportError):
        import triton

        env["triton"] = triton.__version__
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except Exception as e:  # an incompatible build raises more than ImportError
        env["torchao"] = f"unavailable ({_error(e)})"
    return env


def copy_bandwidth(timer: Timer, n: int, device: torch.device, iters: int) -> float:
    """GB/s of ``y.copy_(x)`` on ``n`` float32 elements, counting bytes read and written."""
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    ms = timer.median(lambda: y.copy_(x), iters)
    return 2 * 4 * n / (ms * 1e-3) / 1e9


def quantizer(kind: str, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fake-quant of ``kind`` for ``x`` ([rows, cols]): a ``FakeQuantize`` with fixed
    qparams from ``0.9 * x`` (some elements clamp, so the backward applies a mask), or
    the block fake-quant (scales from each block)."""
    from qcompile.runtime.block_formats import default_block, fake_quantize_block
    from qcompile.runtime.fake_quant import FakeQuantize

    spec = KINDS[kind]
    if isinstance(spec, tuple):
        fmt = spec[1]
        block = default_block(fmt)
        return lambda t: fake_quantize_block(t, fmt, block)
    kw = dict(spec)
    rows, cols = x.shape
    if kw.get("granularity") == "per_channel":
        kw["channels"] = rows
    elif kw.get("granularity") == "per_group":
        kw["channels"] = rows * cols // kw["group_size"]
    fq = FakeQuantize(kw.pop("dtype"), **kw).to(x.device)
    with torch.no_grad():
        fq(x * 0.9)
    fq.observe = False
    return fq


def bench_fakequant(device: torch.device, quick: bool, out: dict[str, Any],
                    save: Callable[[], None], budget: Budget) -> None:
    """Fills ``out["fakequant"]`` (one row per kind) and ``out["copy_GBps"]``."""
    timer = Timer(device)
    iters = 3 if quick else 10
    rows, cols = (256, 1024) if quick else (8192, 8192)  # 256 MB of float32: not cached
    n = rows * cols
    copy_gbps = copy_bandwidth(timer, n, device, iters)
    out["copy_GBps"] = copy_gbps
    out["fakequant_elements"] = n
    table_: dict[str, Any] = out.setdefault("fakequant", {})
    save()
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, cols, device=device, generator=g)
    grad = torch.randn(rows, cols, device=device, generator=g)
    nbytes = 4 * n

    def fwd(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
        def run() -> None:
            with torch.no_grad():
                fn(x)
        return run

    def fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
        def run() -> None:
            leaf = x.detach().requires_grad_(True)
            fn(leaf).backward(grad)
        return run

    for kind in KINDS:
        if budget.part_left() < 5:
            table_[kind] = {"error": "out of time"}
            break
        row: dict[str, Any] = {}
        table_[kind] = row
        try:
            fq = quantizer(kind, x)
            for key, make, tensors in (("eager_fwd", fwd, 2), ("eager_fwd_bwd", fwd_bwd, 4)):
                ms = timer.median(make(fq), iters)
                row[f"{key}_ms"] = ms
                row[f"{key}_vs_copy"] = tensors * nbytes / (ms * 1e-3) / 1e9 / copy_gbps
            if kind in COMPILED and budget.part_left() > 15:
                torch._dynamo.reset()
                try:
                    compiled = torch.compile(fq, fullgraph=True, dynamic=False)
                    t0 = time.perf_counter()
                    fwd_bwd(compiled)()
                    row["fullgraph"] = 1
                except Exception as e:  # a graph break: compile it with the break
                    row["fullgraph"] = 0
                    row["fullgraph_error"] = _error(e)
                    torch._dynamo.reset()
                    compiled = torch.compile(fq, dynamic=False)
                    t0 = time.perf_counter()
                    fwd_bwd(compiled)()
                timer.sync()
                row["compile_s"] = time.perf_counter() - t0
                ms = timer.median(fwd_bwd(compiled), iters)
                row["compiled_fwd_bwd_ms"] = ms
                row["compiled_fwd_bwd_vs_copy"] = 4 * nbytes / (ms * 1e-3) / 1e9 / copy_gbps
        except Exception as e:
            row["error"] = _error(e)
        save()


# -- the training step --------------------------------------------------------------------
def llama_config(quick: bool) -> tuple[Any, int, int]:
    """(LMConfig, vocabulary size, batch): ~340M parameters (4 layers of width 2048, SwiGLU
    5632, 32000-token vocabulary, untied head), 4 sequences of 1024 tokens."""
    from qcompile.tools.bench.lm import LMConfig

    if quick:
        return LMConfig(layers=1, dim=128, heads=4, hidden=256, context=64), 512, 2
    return LMConfig(layers=4, dim=2048, heads=16, hidden=5632, context=1024), 32000, 4


def _torchao_8da4w(model: torch.nn.Module) -> torch.nn.Module:
    """torchao's QAT prepare for 8da4w: ``QATConfig`` over
    ``Int8DynamicActivationInt4WeightConfig(group_size=32)``, or over its successor
    ``Int8DynamicActivationIntxWeightConfig(torch.int4, PerGroup(32))`` in the torchao
    releases that dropped it (the same recipe: int8 per-token asymmetric activations,
    int4 symmetric weights in groups of 32)."""
    import warnings

    import torchao.quantization as tq
    from torchao.quantization.qat import QATConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(tq, "Int8DynamicActivationInt4WeightConfig"):
            base = tq.Int8DynamicActivationInt4WeightConfig(group_size=32)
        else:
            base = tq.Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4, weight_granularity=tq.PerGroup(32))
        tq.quantize_(model, QATConfig(base, step="prepare"))
    return model


def bench_step(device: torch.device, quick: bool, out: dict[str, Any],
               save: Callable[[], None], budget: Budget) -> None:
    """Fills ``out["step"]``: per variant the median step time, its ratio to the bf16 float
    step, the first (compiling) step's time and the tokens per second."""
    import qcompile as qc
    from qcompile.specs import presets
    from qcompile.tools.bench.lm import TinyLlama

    cfg, vocab, batch = llama_config(quick)
    rounds = 3 if quick else 10
    res: dict[str, Any] = out.setdefault("step", {})
    # torchao's recipe: int8 per-token activations read by each Linear (full range), int4
    # weights in groups of 32 (w4a8-qat is the same with x86's 7-bit activations)
    preset = "8da4w-qat" if "8da4w-qat" in presets() else "w4a8-qat"
    res["qcompile_preset"] = preset
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, vocab, (batch, cfg.context + 1), device=device, generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    tokens = x.numel()
    res["config"] = {"layers": cfg.layers, "dim": cfg.dim, "hidden": cfg.hidden,
                     "heads": cfg.heads, "vocab": vocab, "batch": batch, "seq": cfg.context}

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            return TinyLlama(cfg, vocab)

    builds: list[tuple[str, Callable[[torch.nn.Module], torch.nn.Module]]] = [
        ("bf16", lambda m: m),
        ("qcompile_8da4w", lambda m: qc.qcompile(m, preset, example_inputs=(x[:1],),
                                                 inplace=True)),
        # llama.cpp's Q4_0 weights, Q8_0 activation blocks (what its CPU matmul computes)
        ("qcompile_gguf_q4_0", lambda m: qc.qcompile(m, "gguf-q4_0-qat", example_inputs=(
            x[:1],), inplace=True)),
    ]
    try:
        import torchao  # noqa: F401

        builds.append(("torchao_8da4w", _torchao_8da4w))
    except Exception as e:
        res["torchao_8da4w"] = {"skipped": f"torchao does not import: {_error(e)}"}
    timer = Timer(device)
    steps: dict[str, Callable[[], Any]] = {}
    for label, make in builds:
        if budget.part_left() < 20:
            res[label] = {"error": "out of time before building"}
            continue
        row: dict[str, Any] = res.setdefault(label, {})
        try:
            model = make(build()).train()
            row["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
            compiled = torch.compile(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5,
                                    fused=device.type == "cuda")

            def step(compiled: Any = compiled, opt: Any = opt) -> None:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    logits = compiled(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            t0 = time.perf_counter()
            step()  # compiles
            timer.sync()
            row["first_step_s"] = time.perf_counter() - t0
            step()
            timer.sync()
            steps[label] = step
        except Exception as e:
            row["error"] = _error(e)
        save()
    times: dict[str, list[float]] = {k: [] for k in steps}
    try:
        for _ in range(rounds):
            if budget.left() < 3:
                res["note"] = "stopped early: out of time"
                break
            for label, step in steps.items():
                times[label].append(timer.once(step))
    except TimeoutError:
        res["note"] = "stopped early: out of time"
    for label, ts in times.items():
        if ts:
            res[label].update(step_ms=statistics.median(ts), rounds=len(ts),
                              tokens_per_s=tokens / (statistics.median(ts) * 1e-3))
    base = res.get("bf16", {}).get("step_ms")
    for label in times:
        ms = res[label].get("step_ms")
        if base and ms and label != "bf16":
            res[label]["vs_bf16"] = ms / base
    save()


PARTS = {"fakequant": (bench_fakequant, 0.35), "step": (bench_step, 0.65)}


def run(device: torch.device, quick: bool, budget_s: float, out_path: str | None = None,
        parts: tuple[str, ...] = tuple(PARTS)) -> dict[str, Any]:
    """Every part in turn, each in its share of ``budget_s`` (what one leaves goes to the
    next); the result is written to ``out_path`` (atomically) after every measurement."""
    result: dict[str, Any] = {"suite": "cuda", "quick": quick, "errors": {}}
    t_start = time.monotonic()

    def save() -> None:
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if out_path is None:
            return
        folder = os.path.dirname(os.path.abspath(out_path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cuda-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, out_path)

    result["environment"] = environment(device)
    save()
    budget = Budget(budget_s)
    shares = {p: PARTS[p][1] for p in parts}
    for i, name in enumerate(parts):
        fn = PARTS[name][0]
        rest = sum(shares[p] for p in parts[i:])
        seconds = budget.left() * shares[name] / rest
        try:
            with budget.part(seconds):
                fn(device, quick, result, save, budget)
        except Exception as e:
            result["errors"][name] = _error(e)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        save()
    return result


def bench_cuda(quick: bool) -> dict[str, Any]:
    """The suite on the first CUDA device (``{"skipped": ...}`` without one)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the cuda suite measures GPUs only"}
    return run(torch.device("cuda", 0), quick, budget_s=240 if quick else 900)


def cuda_text(result: dict[str, Any]) -> str:
    """Two tables: the quantizer kinds (shares of copy bandwidth) and the training steps."""
    if "skipped" in result:
        return f"cuda: skipped ({result['skipped']})"
    env = result.get("environment", {})
    lines = [f"{env.get('gpu', env.get('device'))}, torch {env.get('torch')}, copy "
             f"{result.get('copy_GBps', 0):.3g} GB/s"]
    cols = ["kind", "eager_fwd_vs_copy", "eager_fwd_bwd_vs_copy", "compiled_fwd_bwd_vs_copy",
            "fullgraph", "error"]
    rows = [{"kind": k, **{c: _short(v.get(c)) for c in cols[1:]}}
            for k, v in result.get("fakequant", {}).items()]
    if rows:
        lines += ["", table(rows, cols)]
    step = result.get("step", {})
    cols = ["variant", "step_ms", "vs_bf16", "tokens_per_s", "first_step_s", "params_M",
            "error"]
    rows = [{"variant": k, **{c: _short(v.get(c)) for c in cols[1:]}}
            for k, v in step.items() if isinstance(v, dict) and k != "config"]
    if rows:
        lines += ["", table(rows, cols)]
    lines += [f"error in {k}: {v}" for k, v in result.get("errors", {}).items()]
    return "\n".join(lines)


def _short(v: Any) -> Any:
    if isinstance(v, float):
        return float(f"{v:.3g}")
    return v[:60] if isinstance(v, str) else v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qcompile.tools.bench.suites.cuda",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    p.add_argument("--out", help="write the JSON here after every measurement")
    p.add_argument("--budget", type=float, default=900.0, help="seconds for all parts")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: "
                   + ", ".join(PARTS))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        result: dict[str, Any] = {"skipped": "no CUDA device: the cuda suite measures GPUs only"}
        if args.out:
            Path(args.out).write_text(json.dumps(result))
    else:
        parts = tuple(s for s in args.parts.split(",") if s)
        unknown = [s for s in parts if s not in PARTS]
        if unknown:
            p.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
        result = run(device, args.quick, args.budget, args.out, parts)
    print(cuda_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
