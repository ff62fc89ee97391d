"""``qcompile-bench llm --deploy``: the ``llm`` suite's dense character LM served by
llama.cpp, its perplexity measured inside llama.cpp (llama-cpp-python, the ``llama``
extra).

The bench LM (``qcompile.tools.bench.lm``: RMSNorm, rotate-half RoPE, SwiGLU, no biases)
computes what transformers' ``LlamaForCausalLM`` computes, so its trained float weights
are loaded into one (checked on a batch) and written as GGUF by ``qc.export_gguf``. Rows,
all evaluated by llama.cpp on the same held-out windows:

- ``fp32``: the float model (F32 tensors);
- ``llama.cpp Q4_0``: llama.cpp's own quantizer (``llama_model_quantize``) applied to the
  F32 file, with the same coverage as qcompile's (every Linear, the head included, on
  Q4_0; the token embedding F32);
- ``RTN`` and ``GPTQ``: qcompile's round-to-nearest and GPTQ on llama.cpp's Q4_0 grid
  (``mode: dynamic``, Q8_0 blocks on each Linear's input), exported;
- ``QAT``: the ``gguf-q4_0-qat`` rules fine-tuned from the float weights by distillation
  (the ``llm`` suite's recipe with more tokens: ``DEPLOY_QAT``), exported; three runs with
  different data orders;
- ``QAT from GPTQ``: the same, starting from GPTQ's rounded weights (``with_weights``).

Recovery is ``(llama.cpp Q4_0 - QAT) / (llama.cpp Q4_0 - fp32)``, per run. ``RTN`` against
``llama.cpp Q4_0`` checks the exporter (the same algorithm: its tensors are byte-identical,
``rtn_tensors_identical``). File sizes are bits per parameter of the whole file.

Example:
    >>> from qcompile.tools.bench.suites.deploy import RULE
    >>> RULE["weight"], RULE["activation"]
    ({'dtype': 'q4_0'}, {'dtype': 'q8_0'})
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
# rate (Q4_0 on every Linear, the head included, costs this LM only 0.27% perplexity: the
# llm suite's 131k tokens at 2e-4 recovered between -16% and 50% of it over three seeds)
DEPLOY_QAT = Recipe(steps=512, batch=8, lr=1e-4)
# llama.cpp's Q4_0 weights and the Q8_0 blocks its CPU matmul makes of each Linear's input
RULE: dict[str, Any] = {"match": {"module": "Linear"}, "weight": {"dtype": "q4_0"},
                        "activation": {"dtype": "q8_0"}, "activation_at": "input"}


def spec(mode: str, algorithms: tuple[dict[str, Any], ...] = ()) -> qc.CompileSpec:
    """``gguf-q4_0-qat``'s rule on every Linear (the head included), in ``mode``."""
    return qc.CompileSpec.model_validate({"version": 1, "quant": {
        "mode": mode, "target": "generic", "algorithms": list(algorithms), "rules": [RULE]}})


def hf_llama(model: lm.TinyLlama, cfg: lm.LMConfig, vocab: int) -> nn.Module:
    """``model``'s weights in transformers' ``LlamaForCausalLM`` (the same computation)."""
    import transformers

    conf = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.dim, intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads, max_position_embeddings=cfg.context,
        rms_norm_eps=torch.finfo(torch.float32).eps, rope_theta=10000.0, use_cache=False,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = transformers.LlamaForCausalLM(conf).eval()
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
    parts = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
             "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
             "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    state = {}
    for key, value in model.state_dict().items():
        if key in names:
            state[names[key]] = value
            continue
        _, i, rest = key.split(".", 2)
        part, leaf = rest.rsplit(".", 1)
        state[f"model.layers.{i}.{parts[part]}.{leaf}"] = value
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"bench LM -> Llama: missing {missing}, unexpected {unexpected}")
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
    weights = [k for k, v in own.items() if v.dim() == 2]
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


def llama_cpp_q4_0(src: Path, dst: Path) -> None:
    """llama.cpp's own Q4_0 quantization of the F32 file: every 2-D weight on Q4_0, the
    head included, the token embedding kept F32 (qcompile's coverage)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.output_tensor_type = 2  # GGML_TYPE_Q4_0
    params.token_embedding_type = 0  # GGML_TYPE_F32
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
               folder: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    data = lm.load_text(cfg)
    model, info = lm.trained(cfg, data)
    vocab = len(data.vocab)
    hf = hf_llama(model, cfg, vocab)
    tune = english_train_ids(cfg, data)
    calib = [(b,) for b in lm.batches(tune, cfg.context, 16, calib_batches, cfg.seed + 2)]
    x = calib[0][0][:4]
    with torch.no_grad():
        same = float((hf(input_ids=x)["logits"] - model(x)).abs().max())
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"params": params, "vocab": vocab, "config": dataclasses.asdict(cfg),
                           "cached": info["cached"], "hf_vs_bench_lm_max_abs": same,
                           "val_tokens": (len(data.val) - 1) // cfg.context * cfg.context}
    example = {"input_ids": calib[0][0]}

    def log(what: str, value: float, seconds: float) -> None:
        print(f"llm --deploy | {what}: {value:.4f} ({seconds:.1f} s)", file=sys.stderr)

    def export(gm: nn.Module, name: str) -> Path:
        path = folder / f"{name}.gguf"
        qc.export_gguf(gm, path, config=hf.config)
        return path

    def measure(label: str, path: Path, t: float) -> float:
        ppl = llama_cpp_perplexity(path, data.val, cfg.context)
        out.setdefault("bits_per_param", {})[label] = _bits_per_param(path, params)
        log(label, ppl, time.perf_counter() - t)
        return ppl

    t = time.perf_counter()
    fp32 = export(qc.qcompile(hf, qc.CompileSpec.model_validate(
        {"version": 1, "quant": {"mode": "none"}}), example_kwargs=example), "fp32")
    out["fp32"] = measure("fp32", fp32, t)
    out["fp32_torch"] = lm.perplexity(model, data.val, cfg.context)
    t = time.perf_counter()
    ref = folder / "llama-cpp-q4_0.gguf"
    llama_cpp_q4_0(fp32, ref)
    out["llama_cpp_q4_0"] = measure("llama.cpp Q4_0", ref, t)
    t = time.perf_counter()
    rtn = export(qc.qcompile(hf, spec("dynamic"), example_kwargs=example), "rtn")
    out["rtn"] = measure("RTN", rtn, t)
    ours, theirs = _tensors(rtn), _tensors(ref)
    out["rtn_tensors_identical"] = sum(ours[k] == theirs.get(k) for k in ours) / len(ours)
    t = time.perf_counter()
    gm = qc.qcompile(hf, spec("dynamic", (GPTQ,)), example_kwargs=example)
    qc.calibrate(gm, [({"input_ids": b[0]},) for b in calib], progress=False)
    out["gptq"] = measure("GPTQ", export(gm, "gptq"), t)
    starts = {"qat": hf, "gptq_qat": with_weights(hf, gm)}
    gap = out["llama_cpp_q4_0"] - out["fp32"]
    for row, start in starts.items():
        ppl = []
        for seed in range(seeds):
            t = time.perf_counter()
            # traced at the fine-tuning batch size (the export front end fixes the batch)
            gm = qc.qcompile(start, spec("qat"),
                             example_kwargs={"input_ids": calib[0][0][:recipe.batch]})
            fine_tune(_Logits(gm), model, tune, cfg.context,
                      dataclasses.replace(recipe, seed=recipe.seed + seed))
            ppl.append(measure(f"{row} seed {seed}", export(gm, f"{row}{seed}"), t))
        out[row] = ppl
        out[f"{row}_mean"] = statistics.fmean(ppl)
        out[f"{row}_spread"] = [min(ppl), max(ppl)]
        out[f"{row}_recovery"] = [(out["llama_cpp_q4_0"] - q) / gap if gap > 0 else None
                                  for q in ppl]
    out["seconds"] = time.perf_counter() - t0
    return out


def bench_deploy(quick: bool) -> dict[str, Any]:
    """The dense LM's perplexity inside llama.cpp: fp32, llama.cpp's Q4_0, qcompile RTN /
    GPTQ / QAT on the Q4_0 grid, exported with qc.export_gguf."""
    cfg, recipe, calib, seeds = ((QUICK_DENSE, QUICK_QAT, 2, 1) if quick
                                 else (DENSE, DEPLOY_QAT, 8, 3))
    with tempfile.TemporaryDirectory() as tmp:
        out = run_deploy(cfg, recipe, calib, seeds, Path(tmp))
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "recipe": dataclasses.asdict(recipe), "dense": out}


def deploy_text(result: dict[str, Any]) -> str:
    r = result["dense"]
    bits = r["bits_per_param"]
    lines = [f"dense LM ({r['params'] / 1e6:.2f} M params, vocab {r['vocab']}): perplexity "
             f"inside llama.cpp on {r['val_tokens']:,} held-out characters",
             "| row | perplexity | bits per parameter (file) |", "|---|--:|--:|",
             f"| fp32 | {r['fp32']:.3f} | {bits['fp32']:.2f} |",
             f"| llama.cpp Q4_0 (its quantizer) | {r['llama_cpp_q4_0']:.3f} | "
             f"{bits['llama.cpp Q4_0']:.2f} |",
             f"| qcompile RTN, exported | {r['rtn']:.3f} | {bits['RTN']:.2f} |",
             f"| qcompile GPTQ, exported | {r['gptq']:.3f} | {bits['GPTQ']:.2f} |",
             *(f"| qcompile {label}, exported (mean of {len(r[row])}) | {r[row + '_mean']:.3f} "
               f"({r[row + '_spread'][0]:.3f}-{r[row + '_spread'][1]:.3f}) | "
               f"{bits[row + ' seed 0']:.2f} |"
               for row, label in (("qat", "QAT"), ("gptq_qat", "QAT from GPTQ")))]
    lines.append("")
    for row, label in (("qat", "QAT"), ("gptq_qat", "QAT from GPTQ's weights")):
        rec = [v for v in r[f"{row}_recovery"] if v is not None]
        if rec:
            lines.append(f"{label} recovers {statistics.fmean(rec):.0%} (per seed "
                         f"{', '.join(f'{v:.0%}' for v in rec)}) of llama.cpp Q4_0's gap "
                         "to fp32.")
    lines.append(
        f"RTN's tensors byte-identical to llama.cpp's: {r['rtn_tensors_identical']:.0%}; "
        f"fp32 in torch {r['fp32_torch']:.3f}; the LM as a transformers Llama differs by "
        f"{r['hf_vs_bench_lm_max_abs']:.1e} at most; {r['seconds']:.0f} s.")
    return "\n".join(lines)
