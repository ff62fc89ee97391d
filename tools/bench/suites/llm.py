"""The ``llm`` suite: what quantization costs a small Llama-style language model, and how
much of it quantization-aware training wins back, per format.

Models (``qcompile.tools.bench.lm``, character level, trained here on English text that
ships with Python: the reference pages of ``pydoc_data.topics`` and the stdlib's source;
validation perplexity on held-out topic pages, lower is better): a dense decoder (4 blocks,
d=192, SwiGLU 512, ~1.8 M parameters) and a mixture-of-experts variant (4 experts of width
256 per block, top 2, ~3.0 M parameters). Their float weights are trained once (AdamW,
cosine schedule) and cached in ``~/.cache/qcompile-bench/``; later runs load them.

Formats (the head, and the MoE routers, stay float; ``target: generic``):

- ``w8a8``: int8 per-channel symmetric weights, the input of every Linear int8 per token
  (asymmetric, from each batch: torchao's ``Int8DynamicActivationInt8Weight``);
- ``8da4w``: int4 symmetric weights in groups of 32, int8 per-token inputs (torchao's
  ``Int8DynamicActivationInt4Weight``, the ``8da4w-qat`` preset);
- ``int4 wo``: int4 asymmetric weights in groups of 32, float activations;
- ``mxfp4``: OCP MXFP4 weights and Linear inputs (blocks of 32, E8M0 scales);
- ``nvfp4``: NVFP4 weights and Linear inputs (blocks of 16, E4M3 scales, an FP32 tensor
  scale: the ``nvfp4-qat`` preset);
- ``nf4``: NF4 weights (blocks of 64, absmax), float activations (QLoRA's base format).

Rows: ``fp32``; ``RTN``: round-to-nearest PTQ (``mode: dynamic``, weight scales from the
weights, activation scales from each batch); ``GPTQ``: the same with ``quant.algorithms:
[gptq]`` on calibration windows of the training topic pages; ``QAT``: the same rules in
``mode: qat`` (the graph computes exactly what RTN computes until it trains: checked on a
batch), fine-tuned from the fp32 weights on windows of the training topic pages for a fixed
token budget, the same for every format (``Recipe``). Recovery is
``(PTQ - QAT) / (PTQ - fp32)``, against RTN and against GPTQ (``n/a`` where PTQ is within
0.1% of fp32: nothing to recover).

The QAT loss is distillation from the fp32 model (KL divergence of the graph's next-token
distribution from the float model's), not the text's own next characters: it measures what
QAT wins back of the quantization loss alone. Fine-tuning on the text itself also adapts
the model to the topic pages: the fp32 model fine-tuned that way for 32 k characters
already gains more perplexity than 4-bit quantization costs, so a recovery measured that
way would mostly count the extra training.

Example (the formats and a spec):
    >>> from qcompile.tools.bench.suites.llm import FORMATS, spec
    >>> list(FORMATS)
    ['w8a8', '8da4w', 'int4 wo', 'mxfp4', 'nvfp4', 'nf4']
    >>> s = spec("nvfp4", "qat")
    >>> s.quant.rules[-1].weight.dtype, s.quant.rules[-1].activation_at
    ('nvfp4', 'input')
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
import qcompile.tools.bench.lm as lm

# -- models -----------------------------------------------------------------------------

DENSE = lm.LMConfig(text="english", layers=4, dim=192, heads=4, hidden=512, context=128,
                    train_chars=2_000_000, val_chars=32_769, val_every=7, steps=1000,
                    batch=32, lr=3e-3, warmup=100)
MOE = dataclasses.replace(DENSE, hidden=256, experts=4, top_k=2)
# --quick: a smoke run of the whole flow in seconds (numbers meaningless)
QUICK_DENSE = lm.LMConfig(text="english", layers=1, dim=64, heads=2, hidden=128, context=64,
                          train_chars=100_000, val_chars=16 * 64 + 1, val_every=7, steps=30,
                          batch=8, lr=3e-3, warmup=5)
QUICK_MOE = dataclasses.replace(QUICK_DENSE, hidden=64, experts=4, top_k=2)

# -- formats ----------------------------------------------------------------------------

_TOKEN8 = {"dtype": "int8", "symmetric": False, "granularity": "per_token"}
# name -> (weight scheme, activation scheme of each Linear's input or None)
FORMATS: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "w8a8": ({"dtype": "int8", "granularity": "per_channel"}, _TOKEN8),
    "8da4w": ({"dtype": "int4", "granularity": "per_group", "group_size": 32}, _TOKEN8),
    "int4 wo": ({"dtype": "int4", "symmetric": False, "granularity": "per_group",
                 "group_size": 32}, None),
    "mxfp4": ({"dtype": "mxfp4"}, {"dtype": "mxfp4"}),
    "nvfp4": ({"dtype": "nvfp4"}, {"dtype": "nvfp4"}),
    "nf4": ({"dtype": "nf4"}, None),
}
GPTQ = {"kind": "gptq", "block_size": 128, "damp": 0.01}


def spec(fmt: str, mode: str, algorithms: tuple[dict[str, Any], ...] = ()) -> qc.CompileSpec:
    """Format ``fmt`` on every Linear but the head and the routers, in ``mode``
    (``dynamic`` for PTQ, ``qat``)."""
    weight, act = FORMATS[fmt]
    rule: dict[str, Any] = {"match": {"module": "Linear"}, "weight": weight}
    if act is not None:
        rule.update(activation=act, activation_at="input")
    return qc.CompileSpec.model_validate({"version": 1, "quant": {
        "mode": mode, "target": "generic", "algorithms": list(algorithms),
        "rules": [{"match": {"name": "head"}, "skip": True},
                  {"match": {"name": "*.router"}, "skip": True, "optional": True}, rule]}})


# -- QAT ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Recipe:
    """QAT fine-tuning from the fp32 weights: distillation from the fp32 model, AdamW (no
    weight decay), linear warm-up then cosine decay to 0, gradients clipped at 1, seeded
    random windows. The token budget is ``steps * batch * context``, the same for every
    format."""

    steps: int = 128
    batch: int = 8
    lr: float = 2e-4
    warmup: int = 4
    seed: int = 11


QAT = Recipe()
QUICK_QAT = Recipe(steps=4, batch=4)


def english_train_ids(cfg: lm.LMConfig, data: lm.TextData) -> torch.Tensor:
    """The training topic pages (the start of ``data.train`` for ``text="english"``)."""
    pages = lm.english_topics()
    n = sum(len(t) for i, t in enumerate(pages) if i % cfg.val_every)
    return data.train[:min(n, len(data.train))]


def fine_tune(model: nn.Module, teacher: nn.Module, ids: torch.Tensor, context: int,
              recipe: Recipe) -> float:
    """Train ``model`` (a QAT graph) to match ``teacher``'s next-token distributions on
    random windows of ``ids``; the last loss (mean KL divergence per token)."""
    teacher.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return (step + 1) / recipe.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - recipe.warmup)
                                   / max(1, recipe.steps - recipe.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(recipe.seed)
    model.train()
    loss = torch.tensor(math.nan)
    for _ in range(recipe.steps):
        starts = torch.randint(0, len(ids) - context, (recipe.batch,), generator=gen)
        x = torch.stack([ids[s:s + context] for s in starts.tolist()])
        with torch.no_grad():
            target = F.log_softmax(teacher(x).flatten(0, 1), dim=-1)
        loss = F.kl_div(F.log_softmax(model(x).flatten(0, 1), dim=-1), target,
                        log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    model.eval()
    return loss.item()


# -- running --------------------------------------------------------------------------

def _recovery(ptq: float, qat: float, fp32: float) -> float | None:
    """Share of PTQ's perplexity loss QAT wins back (None: PTQ lost under 0.1%).

    >>> round(_recovery(4.0, 3.8, 3.6), 6), _recovery(3.6001, 3.7, 3.6)
    (0.5, None)
    """
    return (ptq - qat) / (ptq - fp32) if ptq > 1.001 * fp32 else None


def run_model(name: str, cfg: lm.LMConfig, formats: tuple[str, ...], recipe: Recipe,
              calib_batches: int) -> dict[str, Any]:
    """fp32, the control and every format's RTN / GPTQ / QAT perplexity for one model."""
    t0 = time.perf_counter()
    data = lm.load_text(cfg)
    model, info = lm.trained(cfg, data)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()), "vocab": len(data.vocab),
        "config": dataclasses.asdict(cfg), "train": {k: info[k] for k in
                                                     ("train_s", "final_loss", "cached")},
        "files": {"train": data.files[0], "val": data.files[1]},
        "val_tokens": (len(data.val) - 1) // cfg.context * cfg.context,
        "qat_tokens": recipe.steps * recipe.batch * cfg.context,
        "calibration_tokens": calib_batches * 16 * cfg.context}
    tune = english_train_ids(cfg, data)
    calib = [(b,) for b in lm.batches(tune, cfg.context, 16, calib_batches, cfg.seed + 2)]

    def ppl(m: nn.Module) -> float:
        return lm.perplexity(m, data.val, cfg.context, batch=64)

    def log(what: str, value: float, seconds: float) -> None:
        print(f"llm | {name} | {what}: {value:.4f} ({seconds:.1f} s)", file=sys.stderr)

    t = time.perf_counter()
    out["fp32"] = ppl(model)
    log("fp32", out["fp32"], time.perf_counter() - t)
    rows: dict[str, dict[str, Any]] = {}
    for fmt in formats:
        row: dict[str, Any] = {}
        t = time.perf_counter()
        rtn = qc.qcompile(model, spec(fmt, "dynamic"), example_inputs=calib[0])
        row["rtn"] = ppl(rtn)
        row["rtn_s"] = time.perf_counter() - t
        log(f"{fmt} RTN", row["rtn"], row["rtn_s"])
        t = time.perf_counter()
        gm = qc.qcompile(model, spec(fmt, "dynamic", (GPTQ,)), example_inputs=calib[0])
        qc.calibrate(gm, calib, progress=False)
        row["gptq_calibrate_s"] = time.perf_counter() - t
        row["gptq"] = ppl(gm)
        row["gptq_s"] = time.perf_counter() - t
        log(f"{fmt} GPTQ", row["gptq"], row["gptq_s"])
        t = time.perf_counter()
        qat = qc.qcompile(model, spec(fmt, "qat"), example_inputs=calib[0])
        with torch.no_grad():  # before training the QAT graph computes what RTN computes
            x = calib[0][0][:4]
            row["qat_step0_equals_rtn"] = bool(torch.allclose(qat.eval()(x), rtn(x),
                                                              rtol=1e-5, atol=1e-5))
        row["qat_final_kl"] = fine_tune(qat, model, tune, cfg.context, recipe)
        row["qat_train_s"] = time.perf_counter() - t
        row["qat"] = ppl(qat)
        row["qat_s"] = time.perf_counter() - t
        log(f"{fmt} QAT", row["qat"], row["qat_s"])
        row["recovery_rtn"] = _recovery(row["rtn"], row["qat"], out["fp32"])
        row["recovery_gptq"] = _recovery(row["gptq"], row["qat"], out["fp32"])
        rows[fmt] = row
    out["formats"] = rows
    out["seconds"] = time.perf_counter() - t0
    return out


def bench_llm(quick: bool) -> dict[str, Any]:
    """Perplexity of a dense and an MoE character LM: fp32, RTN, GPTQ, QAT per format."""
    recipe, calib = (QUICK_QAT, 2) if quick else (QAT, 8)
    dense, moe = (QUICK_DENSE, QUICK_MOE) if quick else (DENSE, MOE)
    moe_formats = ("8da4w", "nvfp4")
    t0 = time.perf_counter()
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                           "recipe": dataclasses.asdict(recipe), "gptq": GPTQ}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        out["dense"] = run_model("dense", dense, tuple(FORMATS), recipe, calib)
        out["moe"] = run_model("moe", moe, moe_formats, recipe, calib)
    out["seconds"] = time.perf_counter() - t0
    return out


# -- text -----------------------------------------------------------------------------

def _num(v: float | None, spec_: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec_)


def _share(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def model_table(name: str, r: dict[str, Any]) -> str:
    """Markdown table: rows fp32 / control / RTN / GPTQ / QAT / recoveries, columns formats."""
    fmts = list(r["formats"])
    rows = r["formats"]
    head = f"{name} ({r['params'] / 1e6:.2f} M params), val perplexity"
    lines = [f"| {head} | " + " | ".join(fmts) + " |", "|---|" + "--:|" * len(fmts)]

    def line(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(f) for f in fmts) + " |")

    line("fp32", lambda f: _num(r["fp32"]))
    line("RTN PTQ", lambda f: _num(rows[f]["rtn"]))
    line("GPTQ PTQ", lambda f: _num(rows[f]["gptq"]))
    line("QAT", lambda f: _num(rows[f]["qat"]))
    line("recovery vs RTN", lambda f: _share(rows[f]["recovery_rtn"]))
    line("recovery vs GPTQ", lambda f: _share(rows[f]["recovery_gptq"]))
    line("seconds: GPTQ / QAT", lambda f: f"{rows[f]['gptq_s']:.0f} / {rows[f]['qat_s']:.0f}")
    line("QAT graph before training = RTN", lambda f: "yes" if rows[f]["qat_step0_equals_rtn"]
         else "NO")
    return "\n".join(lines)


def llm_text(result: dict[str, Any]) -> str:
    parts = []
    for name in ("dense", "moe"):
        r = result[name]
        parts.append(model_table(name, r))
        cfg = r["config"]
        trained = ("loaded from the cache" if r["train"]["cached"]
                   else f"trained in {r['train']['train_s']:.0f} s and cached")
        parts.append(
            f"{name}: {cfg['layers']} blocks, d={cfg['dim']}, width {cfg['hidden']}"
            + (f", {cfg['experts']} experts top {cfg['top_k']}" if cfg["experts"] else "")
            + f", vocab {r['vocab']}; {cfg['steps']} steps x {cfg['batch']} x "
            f"{cfg['context']} characters ({trained}); perplexity on {r['val_tokens']:,} "
            f"characters of {r['files']['val']} held-out topic pages; QAT "
            f"{r['qat_tokens']:,} tokens; GPTQ on {r['calibration_tokens']:,} tokens; "
            f"{r['seconds']:.0f} s.")
    parts.append(f"torch {result['torch']}, {result['threads']} thread(s), "
                 f"{result['seconds']:.0f} s in all.")
    return "\n\n".join(parts)
