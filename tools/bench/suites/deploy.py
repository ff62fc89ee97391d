"""``qcompile-bench llm --deploy``: character LMs like the ``llm`` suite's, dense and
mixture-of-experts, served by llama.cpp, their perplexity measured inside llama.cpp
(llama-cpp-python, the ``llama`` extra), on llama.cpp's Q4_0 and Q4_K grids.

The models are the ``llm`` suite's at width 256 (``DEPLOY_DENSE``, ``DEPLOY_MOE``: every
Linear's input a multiple of 256, as Q4_K's super-blocks need). The bench LM (RMSNorm,
rotate-half RoPE, SwiGLU, no biases; top-2 of 4 experts renormalised) computes what
transformers' ``LlamaForCausalLM`` / ``MixtralForCausalLM`` computes, so its trained float
weights are loaded into one (checked on a batch) and written as GGUF by
``qc.export_gguf``. Rows per grid, all evaluated by llama.cpp on the same held-out windows:

- ``fp32``: the float model (F32 tensors);
- ``llama.cpp``: llama.cpp's own quantizer (``llama_model_quantize``, ``pure``: every
  quantized tensor on the grid's type) applied to the F32 file, with qcompile's coverage:
  every Linear and expert, the head included; the token embedding and the routers F32;
- ``RTN`` and ``GPTQ``: qcompile's round-to-nearest and GPTQ on the grid (``mode:
  dynamic``, llama.cpp's activation blocks on each Linear's input), exported. GPTQ rounds
  the Linear layers (the head included); a fused expert tensor rounds to nearest;
- ``QAT``: the preset's rules fine-tuned from the float weights by distillation (the
  ``llm`` suite's recipe with more tokens: ``DEPLOY_QAT``), exported; one run per seed,
  each with its own data order;
- ``QAT from GPTQ``: the same, starting from GPTQ's rounded weights (``with_weights``).

Recovery is ``(llama.cpp - QAT) / (llama.cpp - fp32)``, per run. On Q4_0 ``RTN`` against
``llama.cpp`` checks the exporter (the same algorithm: its tensors are byte-identical,
``rtn_tensors_identical``); llama.cpp's Q4_K quantizer searches each sub-block's scale and
minimum, qcompile's takes each sub-block's range. File sizes are bits per parameter of the
whole file.

Example:
    >>> from qcompile.tools.bench.suites.deploy import GRIDS, spec
    >>> GRIDS["q4_k"].weight, GRIDS["q4_k"].activation
    ('q4_k', 'q8_k')
    >>> s = spec("qat", "q4_0")
    >>> [r.weight.dtype for r in s.quant.rules if not r.skip]
    ['q4_0', 'q4_0']
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import qcompile as qc
import qcompile.tools.bench.lm as lm
from qcompile.tools.bench.suites.llm import (
    DENSE,
    GPTQ,
    QUICK_DENSE,
    QUICK_QAT,
    Recipe,
    english_train_ids,
    fine_tune,
)

# QAT for the deploy rows: the llm suite's recipe with 4x its tokens at half its learning
# rate (Q4_0 on every Linear, the head included, costs these LMs well under 1% perplexity:
# the llm suite's 131k tokens at 2e-4 recovered between -16% and 50% of it over three seeds)
DEPLOY_QAT = Recipe(steps=512, batch=8, lr=1e-4)
# the llm suite's LMs at width 256: every Linear's input (256, and 512 for the dense
# down-projection) a whole number of Q4_K super-blocks
DEPLOY_DENSE = dataclasses.replace(DENSE, dim=256)
DEPLOY_MOE = dataclasses.replace(DEPLOY_DENSE, hidden=256, experts=4, top_k=2)
QUICK_DEPLOY_DENSE = dataclasses.replace(QUICK_DENSE, dim=256, heads=4, hidden=256)
QUICK_DEPLOY_MOE = dataclasses.replace(QUICK_DEPLOY_DENSE, experts=4, top_k=2)


@dataclasses.dataclass(frozen=True)
class Grid:
    """One of llama.cpp's weight grids, the activation blocks its CPU matmul makes of a
    layer's input for it, and what ``llama_model_quantize`` is asked for."""

    weight: str       # scheme dtype (the gguf-*-qat preset's)
    activation: str
    ftype: str        # llama_cpp.LLAMA_FTYPE_* of the reference file
    ggml: str         # gguf.GGMLQuantizationType name of its quantized tensors


GRIDS: dict[str, Grid] = {
    "q4_0": Grid("q4_0", "q8_0", "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_0"),
    "q4_k": Grid("q4_k", "q8_k", "LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q4_K"),
}
_WEIGHT_OPS = ["linear", "grouped_mm", "bmm", "einsum", "mm", "addmm", "matmul"]


def spec(mode: str, grid: str = "q4_0",
         algorithms: tuple[dict[str, Any], ...] = ()) -> qc.CompileSpec:
    """The ``gguf-<grid>-qat`` preset's rules (every Linear, the head included, and the
    weights functional ops read: fused experts) in ``mode``, the routers left float as
    llama.cpp's quantizer leaves them."""
    g = GRIDS[grid]
    scheme = {"weight": {"dtype": g.weight}, "activation": {"dtype": g.activation},
              "activation_at": "input", "optional": True}
    return qc.CompileSpec.model_validate({"version": 1, "quant": {
        "mode": mode, "target": "generic", "algorithms": list(algorithms), "rules": [
            {"match": {"name": "*.mlp.gate"}, "skip": True, "optional": True},
            {"match": {"module": ["Linear"]}, **scheme},
            {"match": {"op": _WEIGHT_OPS, "reads_weight": True}, **scheme}]}})


def hf_model(model: lm.TinyLlama, cfg: lm.LMConfig, vocab: int) -> nn.Module:
    """``model``'s weights in transformers' ``LlamaForCausalLM`` (dense) or
    ``MixtralForCausalLM`` (experts): the same computation."""
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=cfg.dim, intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads, max_position_embeddings=cfg.context,
        rms_norm_eps=torch.finfo(torch.float32).eps, rope_theta=10000.0, use_cache=False,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if cfg.experts:
        conf = transformers.MixtralConfig(
            **common, num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
            router_jitter_noise=0.0, sliding_window=None)
        hf = transformers.MixtralForCausalLM(conf).eval()
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
    parts = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
             "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
             "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj",
             "mlp.router": "mlp.gate"}
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], list[torch.Tensor | None]] = {}
    for key, value in model.state_dict().items():
        if key in names:
            state[names[key]] = value
            continue
        _, i, rest = key.split(".", 2)
        if rest.startswith("mlp.experts."):  # mlp.experts.<e>.<gate|up|down>.weight
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault((i, proj), [None] * cfg.experts)[int(e)] = value
            continue
        part, leaf = rest.rsplit(".", 1)
        state[f"model.layers.{i}.{parts[part]}.{leaf}"] = value
    for (i, proj), stack in experts.items():
        if proj == "down":
            state[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(stack)
    for i in {i for i, _ in experts}:  # transformers' fused [experts, 2 * hidden, dim]
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(experts[i, "gate"], experts[i, "up"])])
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"bench LM -> {type(hf).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    return hf


class _Logits(nn.Module):
    """ids -> logits of a transformers causal LM (or of its compiled graph)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids)["logits"]


def with_weights(model: nn.Module, gm: nn.Module) -> nn.Module:
    """A copy of ``model`` holding ``gm``'s parameters where their names match (a GPTQ
    graph's rounded weights, as QAT's starting point)."""
    out = copy.deepcopy(model)
    own = out.state_dict()
    theirs = {k: v.detach().clone() for k, v in gm.state_dict().items()
              if k in own and own[k].shape == v.shape}
    weights = [k for k, v in own.items() if v.dim() >= 2]
    if not all(k in theirs for k in weights):
        raise RuntimeError(f"the graph holds no {[k for k in weights if k not in theirs][:3]}")
    out.load_state_dict(theirs, strict=False)
    return out


def llama_cpp_perplexity(path: Path, ids: torch.Tensor, context: int) -> float:
    """exp(mean next-token cross-entropy) of the GGUF at ``path``, evaluated by llama.cpp on
    the non-overlapping windows of ``ids`` (the windows ``lm.perplexity`` scores)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_batch=context,
                          logits_all=True, n_threads=torch.get_num_threads(), verbose=False)
    x, y = lm.windows(ids, context)
    total = 0.0
    for row, target in zip(x.tolist(), y):
        llm.reset()
        llm.eval(row)
        logits = torch.tensor(llm.scores[:context]).float()
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
    llm.close()
    return math.exp(total / y.numel())


def llama_cpp_quantize(src: Path, dst: Path, grid: Grid) -> None:
    """llama.cpp's own quantization of the F32 file onto ``grid``: every tensor it
    quantizes on the grid's type (``pure``: no mix of types), the head included, the token
    embedding kept F32 (qcompile's coverage; llama.cpp never quantizes the routers)."""
    import gguf
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, grid.ftype)
    params.pure = True
    params.output_tensor_type = int(gguf.GGMLQuantizationType[grid.ggml])
    params.token_embedding_type = int(gguf.GGMLQuantizationType.F32)
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")


def _tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    import gguf

    return {t.name: (t.tensor_type.name, bytes(t.data.tobytes()))
            for t in gguf.GGUFReader(path).tensors}


def _bits_per_param(path: Path, params: int) -> float:
    return 8 * path.stat().st_size / params


def run_deploy(cfg: lm.LMConfig, recipe: Recipe, calib_batches: int, seeds: int,
               folder: Path, grids: tuple[str, ...] = tuple(GRIDS)) -> dict[str, Any]:
    """fp32 and, per grid, llama.cpp's quantizer, qcompile RTN / GPTQ / QAT, exported and
    evaluated inside llama.cpp, for the LM ``cfg``."""
    t0 = time.perf_counter()
    data = lm.load_text(cfg)
    model, info = lm.trained(cfg, data)
    vocab = len(data.vocab)
    hf = hf_model(model, cfg, vocab)
    tune = english_train_ids(cfg, data)
    calib = [(b,) for b in lm.batches(tune, cfg.context, 16, calib_batches, cfg.seed + 2)]
    x = calib[0][0][:4]
    with torch.no_grad():
        same = float((hf(input_ids=x)["logits"] - model(x)).abs().max())
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"params": params, "vocab": vocab, "config": dataclasses.asdict(cfg),
                           "architecture": type(hf).__name__, "cached": info["cached"],
                           "hf_vs_bench_lm_max_abs": same,
                           "val_tokens": (len(data.val) - 1) // cfg.context * cfg.context}
    example = {"input_ids": calib[0][0]}
    kind = "moe" if cfg.experts else "dense"

    def log(what: str, value: float, seconds: float) -> None:
        print(f"llm --deploy | {kind} {what}: {value:.4f} ({seconds:.1f} s)", file=sys.stderr)

    def export(gm: nn.Module, name: str) -> Path:
        path = folder / f"{kind}-{name}.gguf"
        qc.export_gguf(gm, path, config=hf.config)
        return path

    def measure(row: dict[str, Any], label: str, path: Path, t: float) -> float:
        ppl = llama_cpp_perplexity(path, data.val, cfg.context)
        row.setdefault("bits_per_param", {})[label] = _bits_per_param(path, params)
        log(label, ppl, time.perf_counter() - t)
        return ppl

    t = time.perf_counter()
    fp32 = export(qc.qcompile(hf, qc.CompileSpec.model_validate(
        {"version": 1, "quant": {"mode": "none"}}), example_kwargs=example), "fp32")
    out["fp32"] = measure(out, "fp32", fp32, t)
    out["fp32_torch"] = lm.perplexity(model, data.val, cfg.context)
    out["grids"] = {}
    for name in grids:
        grid, row = GRIDS[name], {}
        out["grids"][name] = row
        t = time.perf_counter()
        ref = folder / f"{kind}-llama-cpp-{name}.gguf"
        llama_cpp_quantize(fp32, ref, grid)
        row["llama_cpp"] = measure(row, f"llama.cpp {grid.ggml}", ref, t)
        t = time.perf_counter()
        rtn = export(qc.qcompile(hf, spec("dynamic", name), example_kwargs=example),
                     f"rtn-{name}")
        row["rtn"] = measure(row, f"{grid.ggml} RTN", rtn, t)
        ours, theirs = _tensors(rtn), _tensors(ref)
        held = [k for k, (ggml, _) in theirs.items() if ggml == grid.ggml]
        row["quantized_tensors"] = len(held)
        row["rtn_tensors_identical"] = sum(ours.get(k) == theirs[k] for k in held) / len(held)
        t = time.perf_counter()
        gm = qc.qcompile(hf, spec("dynamic", name, (GPTQ,)), example_kwargs=example)
        qc.calibrate(gm, [({"input_ids": b[0]},) for b in calib], progress=False)
        row["gptq"] = measure(row, f"{grid.ggml} GPTQ", export(gm, f"gptq-{name}"), t)
        starts = {"qat": hf, "gptq_qat": with_weights(hf, gm)}
        gap = row["llama_cpp"] - out["fp32"]
        for label, start in starts.items():
            ppl = []
            for seed in range(seeds):
                t = time.perf_counter()
                # traced at the fine-tuning batch size (the export front end fixes the batch)
                gm = qc.qcompile(start, spec("qat", name),
                                 example_kwargs={"input_ids": calib[0][0][:recipe.batch]})
                fine_tune(_Logits(gm), model, tune, cfg.context,
                          dataclasses.replace(recipe, seed=recipe.seed + seed))
                ppl.append(measure(row, f"{grid.ggml} {label} seed {seed}",
                                   export(gm, f"{label}-{name}-{seed}"), t))
            row[label] = ppl
            row[f"{label}_mean"] = statistics.fmean(ppl)
            row[f"{label}_spread"] = [min(ppl), max(ppl)]
            row[f"{label}_recovery"] = [(row["llama_cpp"] - q) / gap if gap > 0 else None
                                        for q in ppl]
        for path in folder.glob(f"{kind}-*{name}*.gguf"):  # a few MB each: keep the disk free
            path.unlink()
    out["seconds"] = time.perf_counter() - t0
    return out


def bench_deploy(quick: bool) -> dict[str, Any]:
    """The dense and MoE LMs' perplexity inside llama.cpp: fp32, llama.cpp's Q4_0 / Q4_K,
    qcompile RTN / GPTQ / QAT on the same grids, exported with qc.export_gguf."""
    models, recipe, calib, seeds = (
        ({"dense": QUICK_DEPLOY_DENSE, "moe": QUICK_DEPLOY_MOE}, QUICK_QAT, 2, 1) if quick
        else ({"dense": DEPLOY_DENSE, "moe": DEPLOY_MOE}, DEPLOY_QAT, 8, 3))
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                           "recipe": dataclasses.asdict(recipe), "seeds": seeds}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, cfg in models.items():
            out[kind] = run_deploy(cfg, recipe, calib, seeds, Path(tmp))
    return out


_LABELS = (("qat", "QAT"), ("gptq_qat", "QAT from GPTQ"))


def _recovered(what: str, values: list[float | None], grid: str) -> str | None:
    rec = [v for v in values if v is not None]
    if not rec:
        return None
    each = f" (per seed {', '.join(f'{v:.0%}' for v in rec)})" if len(rec) > 1 else ""
    return f"{what} recovers {statistics.fmean(rec):.0%}{each} of llama.cpp {grid}'s gap to fp32."


def deploy_text(result: dict[str, Any]) -> str:
    lines: list[str] = []
    for kind in ("dense", "moe"):
        r = result[kind]
        lines += [f"{kind} LM as {r['architecture']} ({r['params'] / 1e6:.2f} M params, vocab "
                  f"{r['vocab']}): perplexity inside llama.cpp on {r['val_tokens']:,} held-out "
                  "characters",
                  "| row | perplexity | bits per parameter (file) |", "|---|--:|--:|",
                  f"| fp32 | {r['fp32']:.4f} | {r['bits_per_param']['fp32']:.2f} |"]
        notes: list[str | None] = []
        for name, row in r["grids"].items():
            g, bits = GRIDS[name].ggml, row["bits_per_param"]
            gap = row["llama_cpp"] - r["fp32"]
            lines += [f"| llama.cpp {g} (its quantizer) | {row['llama_cpp']:.4f} | "
                      f"{bits[f'llama.cpp {g}']:.2f} |",
                      f"| qcompile {g} RTN, exported | {row['rtn']:.4f} | {bits[f'{g} RTN']:.2f} |",
                      f"| qcompile {g} GPTQ, exported | {row['gptq']:.4f} | "
                      f"{bits[f'{g} GPTQ']:.2f} |"]
            notes.append(_recovered(f"{g} GPTQ", [(row["llama_cpp"] - row["gptq"]) / gap
                                                  if gap > 0 else None], g))
            for label, text in _LABELS:
                lo, hi = row[f"{label}_spread"]
                lines.append(f"| qcompile {g} {text}, exported (mean of {len(row[label])}) "
                             f"| {row[f'{label}_mean']:.4f} ({lo:.4f}-{hi:.4f}) | "
                             f"{bits[f'{g} {label} seed 0']:.2f} |")
                notes.append(_recovered(f"{g} {text}", row[f"{label}_recovery"], g))
            notes.append(f"{g} RTN tensors byte-identical to llama.cpp's: "
                         f"{row['rtn_tensors_identical']:.0%} of {row['quantized_tensors']}.")
        lines += ["", *(n for n in notes if n),
                  f"fp32 in torch {r['fp32_torch']:.4f}; the LM as {r['architecture']} differs "
                  f"by {r['hf_vs_bench_lm_max_abs']:.1e} at most; {r['seconds']:.0f} s.", ""]
    return "\n".join(lines).rstrip()
