"""The ``adapters`` suite: LoRA fine-tuning on a frozen quantized base, qcompile next to peft
and bitsandbytes.

Model (``AdapterLM``): a decoder-shaped language model written out so fx traces it:
token embedding, ``layers`` pre-norm blocks (``nn.RMSNorm``, causal self-attention through
``F.scaled_dot_product_attention`` with ``q``/``k``/``v``/``o`` projections, a GELU MLP
``up``/``down`` 4x wide; no biases), a final RMSNorm and a Linear ``head``. The full run
uses d 1024, 8 blocks, vocabulary 4096: 109 M parameters, 436 MB of fp32 weights, 96% of
them in the blocks' Linear layers.

Every variant puts LoRA (rank 16, alpha 32) on every Linear of the blocks (not the head),
freezes everything else (``model.requires_grad_(False)`` first: the adapters are the only
trainable parameters) and trains ``steps`` AdamW steps on one batch of random token ids
(next-token cross-entropy), each variant in a fresh process (``multiprocessing`` spawn,
one after the other, 2 torch threads):

- ``peft``: ``peft.get_peft_model(model, LoraConfig(...))`` on the float model;
- ``int8``, ``int4_g32``, ``nf4``, ``nvfp4``, ``mxfp4``: ``qc.qcompile(model, spec,
  inplace=True)`` with ``quant.mode: qat``, one rule giving the blocks' Linear layers the
  weight scheme (int8 per channel, int4 symmetric in groups of 32, NF4, NVFP4, MXFP4), the
  head skipped, and an ``adapters`` entry with ``base: frozen`` (the base stored as its
  codes and scales, ``FrozenWeight``); the float model is dropped after compiling;
- ``qat_int4_g32``: the same with ``base: qat`` (the float weight kept, frozen, behind its
  int4 fake-quantizer: torchao's QAT + LoRA recipe);
- ``bnb_nf4``: bitsandbytes ``Linear4bit`` (NF4, blocks of 64, double-quantized absmax,
  float32 compute) in place of the blocks' Linear layers, then peft's LoRA on them
  (skipped with the reason when bitsandbytes does not import or run here).

Per variant: resident memory (MB, over the process's RSS after its imports and a tiny run
of the same setup, which loads what loads lazily) after setup (``gc.collect()`` and
glibc's ``malloc_trim``) and its peak over the training steps (VmHWM, reset when setup
ends), the peak while setting up, and the bytes autograd keeps for backward beyond the
parameters (``saved_mb``, counted in a forward after the steps: no allocator in it); the
bytes holding the adapted base weights (``FrozenWeight.nbytes()``, bitsandbytes'
packed weights and absmax statistics, or fp32) and their share of fp32; the median step
time after one warm-up step and its ratio to peft's, in wall time, in process CPU time and
in units of a fixed matmul (an ``up`` layer's forward) timed before each step in the same
process (the processes run minutes apart on a machine whose load may change meanwhile);
the loss of each step and after the last one; and, where the base is stored quantized,
how long dequantizing one ``up`` layer takes next to that matmul, and both scaled to a
step (every layer dequantized twice, forward and backward; every weight multiplied
twice, forward and the input's gradient). ``--quick``: a tiny model, one step, all
variants in this process (memory not isolated; a smoke run).

Example (the tiny model and a spec):
    >>> import torch
    >>> from qcompile.tools.bench.suites.adapters import QUICK, AdapterLM, spec
    >>> model = AdapterLM(QUICK)
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 128])
    >>> s = spec("nf4")
    >>> s.quant.rules[1].weight.dtype, s.adapters[0].base, s.adapters[0].scaling
    ('nf4', 'frozen', 2.0)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.runtime.frozen import FrozenWeight
from qcompile.tools.bench.measure import median_seconds
from qcompile.tools.bench.workers import _reset_peak, _status

# -- model ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model, the batch and the training run."""

    dim: int = 1024
    layers: int = 8
    heads: int = 16
    vocab: int = 4096
    batch: int = 4
    seq: int = 128
    steps: int = 3  # the first is the warm-up
    lr: float = 1e-3


FULL = Shape()
QUICK = Shape(dim=64, layers=2, heads=2, vocab=128, batch=2, seq=16, steps=1)
TARGETS = ("q", "k", "v", "o", "up", "down")  # the adapted Linear layers of each block
RANK, ALPHA = 16, 32.0


class Block(nn.Module):
    """Pre-norm attention (``q``, ``k``, ``v``, ``o``) and GELU MLP (``up``, ``down``)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class AdapterLM(nn.Module):
    """Embedding, ``shape.layers`` blocks, RMSNorm, Linear ``head``: logits per token."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.dim)
        self.blocks = nn.ModuleList(Block(shape.dim, shape.heads) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def adapted_names(model: nn.Module) -> list[str]:
    """Qualified names of the Linear layers that get adapters (``blocks.<i>.<target>``)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.rpartition(".")[2] in TARGETS
            and n.startswith("blocks.")]


# -- variants ---------------------------------------------------------------------------

WEIGHTS: dict[str, dict[str, Any]] = {
    "int8": {"dtype": "int8", "granularity": "per_channel"},
    "int4_g32": {"dtype": "int4", "symmetric": True, "granularity": "per_group",
                 "group_size": 32},
    "nf4": {"dtype": "nf4"},
    "nvfp4": {"dtype": "nvfp4"},
    "mxfp4": {"dtype": "mxfp4"},
}
# variant -> (what it is, weight scheme key or None, base)
VARIANTS: dict[str, tuple[str, str | None, str]] = {
    "peft": ("peft LoRA, fp32 base", None, "float"),
    **{k: (f"qcompile, frozen {k} base", k, "frozen") for k in WEIGHTS},
    "qat_int4_g32": ("qcompile, qat int4 g32 base (fp32 kept)", "int4_g32", "qat"),
    "bnb_nf4": ("bitsandbytes Linear4bit nf4 + peft LoRA", None, "bnb"),
}


def spec(weight: str, base: str = "frozen") -> qc.CompileSpec:
    """QAT with ``WEIGHTS[weight]`` on the blocks' Linear layers (head skipped) and LoRA
    (``RANK``, ``ALPHA``) on the same layers with ``base``."""
    names = [f"*.{t}" for t in TARGETS]
    return qc.CompileSpec.model_validate({
        "quant": {"mode": "qat", "target": "generic", "rules": [
            {"match": {"name": "head"}, "skip": True},
            {"match": {"module": "Linear", "name": names}, "weight": WEIGHTS[weight]}]},
        "adapters": [{"match": {"module": "Linear", "name": names}, "rank": RANK,
                      "alpha": ALPHA, "base": base}]})


def bnb_problem() -> str | None:
    """None when bitsandbytes' 4-bit layer imports and runs a forward and backward here;
    else why not."""
    try:
        _bnb_linear(nn.Linear(64, 32, bias=False))(torch.randn(2, 64, requires_grad=True)
                                                   ).sum().backward()
    except Exception as e:  # any failure means: not on this machine
        return f"bitsandbytes 4-bit does not run here: {type(e).__name__}: {e}"[:300]
    return None


def _bnb_linear(lin: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False,
                          compute_dtype=torch.float32, quant_type="nf4")
    q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4")
    return q.to(lin.weight.device)  # quantizes (the float weight is let go)


def _bnb_bytes(q: nn.Module) -> int:
    """Bytes of a quantized ``Linear4bit``: the packed weight and its absmax statistics
    (with double quantization, the 8-bit absmax and their own float32 absmax)."""
    st = q.weight.quant_state
    total = q.weight.nbytes + st.absmax.nbytes
    if getattr(st, "state2", None) is not None:
        total += st.state2.absmax.nbytes
    return total


def _peft(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=int(ALPHA),
                                                target_modules=list(TARGETS)))


def _setup(variant: str, model: nn.Module, ids: torch.Tensor
           ) -> tuple[nn.Module, int, list[nn.Module]]:
    """(trainable module, bytes of the adapted base weights, the FrozenWeight modules)."""
    _, weight, base = VARIANTS[variant]
    names = adapted_names(model)
    if base == "float":
        fp32 = sum(model.get_submodule(n).weight.nbytes for n in names)
        return _peft(model), fp32, []
    if base == "bnb":
        stored = 0
        for n in names:
            parent, _, leaf = n.rpartition(".")
            owner = model.get_submodule(parent)
            q = _bnb_linear(getattr(owner, leaf))
            setattr(owner, leaf, q)
            stored += _bnb_bytes(q)
        return _peft(model), stored, []
    gm = qc.qcompile(model, spec(weight, base), example_inputs=(ids,), inplace=True)
    frozen = [m for m in gm.modules() if isinstance(m, FrozenWeight)]
    stored = sum(r.base_bytes_after for r in qc.report(gm).adapters)
    return gm, stored, frozen


def _trim() -> None:
    """Collect garbage and hand glibc's free heap pages back to the kernel (no-op elsewhere):
    the RSS after setup then counts what is still held, the same way for every variant."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def saved_beyond_parameters(m: nn.Module, forward: Callable[[], Any]) -> tuple[Any, int]:
    """``(forward(), bytes)``: the bytes of the unique storages autograd saved for backward
    during ``forward()`` that are not storages of ``m``'s parameters (a float layer saves
    its weight, which costs nothing more; a frozen base's codes are parameters too), counted
    when it returns: the activations and copies a training step keeps, whatever the
    allocator does with them.

    >>> lin = nn.Linear(64, 64)
    >>> _, kept = saved_beyond_parameters(lin, lambda: lin(torch.randn(8, 64)).sum())
    >>> kept  # the input (8 x 64 fp32); the weight is a parameter
    2048
    """
    own = {p.untyped_storage().data_ptr() for p in m.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, sum(kept.values())


def _train(m: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
           probe: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """``steps`` AdamW steps on the trainable parameters of ``m``: each step's loss, wall
    and process CPU seconds, and (with ``probe``) the wall seconds of ``probe()`` run
    before each step (a fixed matmul: how fast this machine is at that moment)."""
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)
    m.train()
    out: dict[str, list[float]] = {"losses": [], "wall": [], "cpu": [], "probe": []}
    for _ in range(steps):
        if probe is not None:
            out["probe"].append(median_seconds(probe, 3))
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        out["wall"].append(time.perf_counter() - t0)
        out["cpu"].append(time.process_time() - c0)
        out["losses"].append(loss.item())
    return out


def run_variant(variant: str, shape: Shape, warm: bool = True) -> dict[str, Any]:
    """Build, set up ``variant`` and train ``shape.steps`` steps in this process; the row.
    ``warm``: first set up and train a tiny model the same way (lazy imports, first-call
    paths), so the baseline and the step times leave them out."""
    base = VARIANTS[variant][2]
    row: dict[str, Any] = {"load": os.getloadavg()[0]}
    if base in ("float", "bnb") and importlib.util.find_spec("peft") is None:
        return {"skipped": "peft is not installed (pip install .[models])"}
    if base == "bnb" and (why := bnb_problem()) is not None:
        return {"skipped": why}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if warm:  # load what loads lazily (qcompile's passes, peft, bitsandbytes, the
        # optimizer's first step) before the baseline
        tiny = AdapterLM(dataclasses.replace(QUICK, vocab=shape.vocab)).requires_grad_(False)
        tiny = _setup(variant, tiny, x[:1, :8])[0]
        _train(tiny, x[:1, :8], y[:1, :8], 1, shape.lr)
        del tiny
    _trim()
    baseline = _status()["VmRSS"]
    _reset_peak()
    torch.manual_seed(0)
    model = AdapterLM(shape).requires_grad_(False)
    names = adapted_names(model)
    fp32 = sum(model.get_submodule(n).weight.nbytes for n in names)
    row["model_mb"] = sum(p.nbytes for p in model.parameters()) / 2**20
    row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    t0 = time.perf_counter()
    m, stored, frozen = _setup(variant, model, x)
    row["setup_s"] = time.perf_counter() - t0
    del model
    _trim()
    now = _status()
    row["setup_peak_mb"] = now["VmHWM"] - baseline
    row["after_setup_mb"] = now["VmRSS"] - baseline
    row["base_mb"] = stored / 2**20
    row["base_fp32_mb"] = fp32 / 2**20
    row["base_vs_fp32"] = stored / fp32
    row["trainable"] = sum(p.numel() for p in m.parameters() if p.requires_grad)
    _reset_peak()
    a = torch.randn(shape.batch * shape.seq, shape.dim)
    w = torch.randn(4 * shape.dim, shape.dim)

    def probe() -> torch.Tensor:  # an `up` layer's forward matmul
        return torch.mm(a, w.t())

    run = _train(m, x, y, shape.steps, shape.lr, probe=probe)
    row["steps_peak_mb"] = _status()["VmHWM"] - baseline
    first = 1 if shape.steps > 1 else 0  # the warm-up step
    row["step_s"] = statistics.median(run["wall"][first:])
    row["step_cpu_s"] = statistics.median(run["cpu"][first:])
    row["probe_ms"] = 1e3 * statistics.median(run["probe"][first:])
    row["step_times_s"] = run["wall"]
    row["losses"] = run["losses"]
    loss, kept = saved_beyond_parameters(
        m, lambda: F.cross_entropy(m(x).flatten(0, 1), y.flatten()))
    row["loss_after"] = loss.item()
    row["saved_mb"] = kept / 2**20
    del loss
    if frozen:  # one `up` layer: dequantize vs its forward matmul, timed together
        up = next(f for f in frozen if f.rows == 4 * shape.dim)
        eager = getattr(up, "dequantize_eager", None)  # the plain-torch path, if apart
        fns = {"dequantize_up_ms": up.dequantize, "matmul_up_ms": probe,
               **({"dequantize_eager_up_ms": eager} if eager is not None else {})}
        times: dict[str, list[float]] = {k: [] for k in fns}
        with torch.no_grad():
            for _ in range(5):
                for k, fn in fns.items():
                    times[k].append(1e3 * median_seconds(fn, 1))
        row.update({k: statistics.median(v) for k, v in times.items()})
        row["frozen_layers"] = len(frozen)
        # a step dequantizes every layer twice (forward, and backward's recompute) and
        # multiplies by every weight twice (forward, and the input's gradient)
        ups = 2 * sum(f.rows * f.cols for f in frozen) / (up.rows * up.cols)
        row["dequantize_per_step_s"] = ups * row["dequantize_up_ms"] / 1e3
        row["matmul_per_step_s"] = ups * row["matmul_up_ms"] / 1e3
    return row


def adapters_worker(variant: str, quick: bool, out: str) -> None:
    """One fresh process (``multiprocessing`` spawn): ``run_variant``'s row as JSON."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = run_variant(variant, QUICK if quick else FULL)
    with open(out, "w") as f:
        json.dump(row, f)


def bench_adapters(quick: bool) -> dict[str, Any]:
    """LoRA on a frozen quantized base: memory, base bytes, step time vs peft, loss."""
    import multiprocessing

    shape = QUICK if quick else FULL
    t0 = time.perf_counter()
    out: dict[str, Any] = {"shape": dataclasses.asdict(shape), "rank": RANK, "alpha": ALPHA,
                           "torch": torch.__version__, "threads": 1 if quick else 2,
                           "isolated": not quick}
    rows: dict[str, Any] = {}
    ctx = multiprocessing.get_context("spawn")
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            if quick:  # a smoke run: every variant in this process, one thread (tiny
                # ops; a busy machine makes 2 threads wait on each other for milliseconds)
                torch.set_num_threads(1)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        rows[variant] = run_variant(variant, shape, warm=False)
                finally:
                    torch.set_num_threads(threads)
                continue
            path = os.path.join(tmp, f"{variant}.json")
            p = ctx.Process(target=adapters_worker, args=(variant, quick, path))
            p.start()
            p.join()
            if p.exitcode != 0:
                rows[variant] = {"failed": f"worker exited with {p.exitcode}"}
                continue
            with open(path) as f:
                rows[variant] = json.load(f)
            print(f"adapters | {variant}: {rows[variant].get('step_s', 0):.2f} s/step",
                  file=sys.stderr)
    peft = rows["peft"]
    for row in rows.values():
        if "step_s" in row and "step_s" in peft and "probe_ms" in row:
            row["step_vs_peft"] = row["step_s"] / peft["step_s"]
            row["cpu_vs_peft"] = row["step_cpu_s"] / peft["step_cpu_s"]
            # in units of the probe matmul timed next to the steps in the same process:
            # the processes run minutes apart, on a machine whose load changes meanwhile
            row["probe_vs_peft"] = (row["step_s"] / row["probe_ms"]) / (
                peft["step_s"] / peft["probe_ms"])
    out["variants"] = rows
    out["seconds"] = time.perf_counter() - t0
    return out


# -- text -------------------------------------------------------------------------------

BASE_TARGET = {"int8": 0.30, "4bit": 0.17}
STEP_TARGET = 1.3


def _target(variant: str) -> float | None:
    _, weight, base = VARIANTS[variant]
    if base == "bnb":
        return BASE_TARGET["4bit"]
    if base != "frozen":
        return None
    return BASE_TARGET["int8" if weight == "int8" else "4bit"]


def adapters_text(result: dict[str, Any]) -> str:
    """A table, one line per variant, then the targets met or missed.

    >>> row = {"setup_peak_mb": 400.0, "after_setup_mb": 100.0, "steps_peak_mb": 150.0,
    ...        "saved_mb": 50.0, "base_mb": 97.0, "base_vs_fp32": 0.25, "step_s": 1.2,
    ...        "step_vs_peft": 1.2, "cpu_vs_peft": 1.1, "probe_vs_peft": 1.0,
    ...        "losses": [8.4], "loss_after": 8.3}
    >>> r = {"shape": {"dim": 64, "layers": 2, "vocab": 128, "batch": 2, "seq": 16,
    ...      "steps": 1}, "variants": {"peft": {**row, "base_vs_fp32": 1.0},
    ...      "int8": row, "bnb_nf4": {"skipped": "no"}}, "seconds": 3.0, "isolated": False}
    >>> print(adapters_text(r))  # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
    variant  setup peak MB  after setup MB  steps peak MB  saved MB  base MB  base/fp32 ...
    peft     400            100             150            50        97.0     100.0% ...
    int8     400            100             150            50        97.0     25.0% ok ...
    bnb_nf4  skipped: no
    ...
    """
    from qcompile.tools.output import table

    s = result["shape"]
    lines = []
    rows = []
    for variant, r in result["variants"].items():
        if "step_s" not in r:
            rows.append({"variant": variant,
                         "setup peak MB": "skipped: " + r.get("skipped", r.get("failed", "?"))})
            continue
        t = _target(variant)
        share = f"{100 * r['base_vs_fp32']:.1f}%"
        if t is not None:
            share += " ok" if r["base_vs_fp32"] <= t else f" >{100 * t:.0f}%"
        ratio = r.get("probe_vs_peft")
        ratio_s = "" if ratio is None else (
            f"{r['step_vs_peft']:.2f} / {r['cpu_vs_peft']:.2f} / {ratio:.2f}")
        if ratio is not None and variant != "peft":
            ratio_s += " ok" if ratio <= STEP_TARGET else f" >{STEP_TARGET}"
        deq = r.get("dequantize_up_ms")
        rows.append({
            "variant": variant, "setup peak MB": f"{r['setup_peak_mb']:.0f}",
            "after setup MB": f"{r['after_setup_mb']:.0f}",
            "steps peak MB": f"{r['steps_peak_mb']:.0f}", "saved MB": f"{r['saved_mb']:.0f}",
            "base MB": f"{r['base_mb']:.1f}",
            "base/fp32": share, "step s": f"{r['step_s']:.2f}",
            "vs peft: wall / cpu / probe": ratio_s,
            "loss first -> after": f"{r['losses'][0]:.3f} -> {r['loss_after']:.3f}",
            "deq/matmul up ms": "" if deq is None else f"{deq:.1f} / {r['matmul_up_ms']:.1f}"})
    cols = ["variant", "setup peak MB", "after setup MB", "steps peak MB", "saved MB",
            "base MB", "base/fp32", "step s", "vs peft: wall / cpu / probe",
            "loss first -> after", "deq/matmul up ms"]
    lines.append(table([{c: row.get(c) for c in cols} for row in rows], cols))
    lines.append(
        f"model: d {s['dim']}, {s['layers']} blocks, vocab {s['vocab']}; LoRA r "
        f"{RANK} alpha {ALPHA:g} on q,k,v,o,up,down; batch {s['batch']} x {s['seq']} "
        f"tokens, {s['steps']} AdamW step(s), step time the median after the first; MB over "
        "each process's RSS after imports (peaks include what glibc's heap keeps); saved: "
        "what autograd keeps beyond parameters; vs peft: wall time, process CPU time, and "
        "wall time in units of a fixed matmul timed before each step in the same process "
        "(the variants run minutes apart; the target is checked on this one); deq/matmul: "
        "one up layer's dequantize vs its forward matmul; targets: frozen base <= 30% of "
        f"fp32 (int8), <= 17% (4-bit), step <= {STEP_TARGET}x peft; "
        f"{result['seconds']:.0f} s"
        + ("" if result.get("isolated", True) else " (quick: one process, memory not "
           "isolated)"))
    return "\n".join(lines)
