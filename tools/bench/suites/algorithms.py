"""The ``algorithms`` suite: what each PTQ algorithm of ``quant.algorithms`` buys on real
data, as a table per model (rows: method, columns: quantization config).

Models: the digits CNN and MLP of ``qcompile.tools.accuracy`` (same split, same fp32
training; cells are test accuracy in %) and a 4-layer Llama-style character LM trained on
the Python standard library's source (``qcompile.tools.bench.lm``; cells are validation
perplexity, lower is better; its weights are cached after the first run).

Configs (static mode, the default ``x86`` target: 7-bit activation range):

- ``int8 pt``: int8 per-tensor weights and uint8 per-tensor activations;
- ``w4 g32``: int4 weights in groups of 32 (convolutions whose rows are not a multiple of
  32: int4 per-channel), activations float;
- ``w3 pc``: int3 per-channel weights, activations float;
- ``w8a8``: int8 per-channel weights and uint8 per-tensor activations.

Activation configs quantize each Linear / Conv output, and on the LM also the RMSNorm
outputs and the SwiGLU product (the inputs of the projections, which SmoothQuant
targets). The LM's ``head`` stays float in every config, as usual for weight-only LLM
quantization. Methods: ``round-to-nearest`` (no algorithm), each algorithm alone where it
applies (CLE on the CNN/MLP, SmoothQuant on the LM's activation configs, bias correction,
AdaRound, GPTQ) and one combination per family. Every cell is compiled from the fp32
model, calibrated on seeded training batches (``qc.calibrate``, which also runs the
data-driven algorithms), then evaluated in fake-quant; ``s`` is compile + calibrate time.

Example (the configs and methods of one family):
    >>> from qcompile.tools.bench.suites.algorithms import CONFIGS, methods
    >>> list(CONFIGS)
    ['int8 pt', 'w4 g32', 'w3 pc', 'w8a8']
    >>> [name for name, _, _ in methods("LM", quick=False)][:3]
    ['round-to-nearest', 'smoothquant', 'bias_correction']
    >>> applies = dict((n, a) for n, _, a in methods("LM", quick=False))["smoothquant"]
    >>> [c for c in CONFIGS if applies(c)]
    ['int8 pt', 'w8a8']
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# -- configs ---------------------------------------------------------------------------

_ACT = {"dtype": "uint8", "symmetric": False, "granularity": "per_tensor",
        "observer": "minmax"}
# config -> (weight scheme for Linear, weight scheme for Conv, quantize activations?)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], bool]] = {
    "int8 pt": ({"dtype": "int8", "granularity": "per_tensor"},
                {"dtype": "int8", "granularity": "per_tensor"}, True),
    "w4 g32": ({"dtype": "int4", "granularity": "per_group", "group_size": 32},
               {"dtype": "int4", "granularity": "per_channel"}, False),
    "w3 pc": ({"dtype": "int3", "granularity": "per_channel"},
              {"dtype": "int3", "granularity": "per_channel"}, False),
    "w8a8": ({"dtype": "int8", "granularity": "per_channel"},
             {"dtype": "int8", "granularity": "per_channel"}, True),
}
QUICK_CONFIGS = ("w4 g32", "w8a8")


def rules(family: str, config: str) -> list[dict[str, Any]]:
    """The spec rules of ``config`` for ``family`` ("digits" or "LM")."""
    linear, conv, act = CONFIGS[config]
    a = {"activation": _ACT} if act else {}
    if family == "LM":
        out: list[dict[str, Any]] = [{"match": {"name": "head"}, "skip": True},
                                     {"match": {"module": "Linear"}, "weight": linear, **a}]
        if act:
            # the projections' inputs: RMSNorm outputs (q/k/v, gate/up) and the SwiGLU
            # product (down); attention's output is o's input, quantized after SDPA
            out += [{"match": {"module": "RMSNorm"}, "activation": _ACT},
                    {"match": {"name": "*.mlp", "op": "mul"}, "activation": _ACT},
                    {"match": {"op": "scaled_dot_product_attention"}, "activation": _ACT}]
        return out
    out = [{"match": {"module": "Linear"}, "weight": linear, **a},
           {"match": {"module": "Conv2d"}, "weight": conv, **a, "optional": True}]
    if act:
        out.append({"match": {"op": ["add", "cat"]}, "activation": _ACT, "optional": True})
    return out


def spec(family: str, config: str, algorithms: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": 1, "quant": {"mode": "static", "rules": rules(family, config),
                                    "algorithms": algorithms, "fold_bn": True}}


# -- methods ---------------------------------------------------------------------------

def _always(config: str) -> bool:
    return True


def _activations(config: str) -> bool:
    return CONFIGS[config][2]


def methods(model: str, quick: bool) -> list[tuple[str, list[dict[str, Any]],
                                                   Callable[[str], bool]]]:
    """(name, quant.algorithms, applies to config?) for ``model`` (CNN, MLP or LM).

    AdaRound's iterations are per layer: the LM has 28 quantized layers, so it gets fewer
    than the digits models (4 or 3 layers) to keep the suite in minutes."""
    gptq = {"kind": "gptq", "block_size": 128, "damp": 0.01}
    bc = {"kind": "bias_correction"}
    # reg_weight, lr, warmup: the spec's defaults (tuned with the implementation)
    ada = {"kind": "adaround", "iterations": 20 if quick else (500 if model == "LM" else 1000)}
    if model == "LM":
        sq = {"kind": "smoothquant", "alpha": 0.5}
        out = [("round-to-nearest", [], _always), ("smoothquant", [sq], _activations),
               ("bias_correction", [bc], _always), ("adaround", [ada], _always),
               ("gptq", [gptq], _always), ("smoothquant + gptq", [sq, gptq], _activations)]
    else:
        cle = {"kind": "cross_layer_equalization"}
        out = [("round-to-nearest", [], _always), ("cross_layer_equalization", [cle], _always),
               ("bias_correction", [bc], _always), ("adaround", [ada], _always),
               ("gptq", [gptq], _always), ("cle + bias_correction", [cle, bc], _always)]
    if quick:
        keep = {"round-to-nearest", "gptq", "smoothquant", "cross_layer_equalization"}
        out = [m for m in out if m[0] in keep]
    return out


# -- models and data -------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One model with its data: calibration batches (input tuples), an evaluation
    function (model -> metric) and the example inputs to compile with."""

    name: str
    family: str
    model: nn.Module
    calib: list[tuple[torch.Tensor, ...]]
    evaluate: Callable[[nn.Module], float]
    metric: str
    info: dict[str, Any]


def digits_case(name: str, quick: bool, calib_batches: int) -> Case:
    from qcompile.tools.accuracy import Settings, data, train_fp32
    from qcompile.tools.quickstart import accuracy

    settings = Settings(fp32_epochs={"CNN": 3, "MLP": 10} if quick else {"CNN": 8, "MLP": 30})
    t0 = time.perf_counter()
    model = train_fp32(name, settings)
    x, _, x_test, y_test = data(settings.seed)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(settings.seed + 2))
    b = 64
    calib = [(x[perm[i * b:(i + 1) * b]],) for i in range(calib_batches)]

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad():
            return 100 * accuracy(m.eval(), x_test, y_test)

    return Case(name, "digits", model, calib, evaluate, "test accuracy %",
                {"train_s": time.perf_counter() - t0, "epochs": settings.fp32_epochs[name],
                 "test_images": len(x_test)})


def lm_case(quick: bool, calib_batches: int) -> Case:
    import qcompile.tools.bench.lm as lm

    cfg = (lm.LMConfig(layers=1, dim=32, heads=2, hidden=64, context=32, train_chars=100_000,
                       val_chars=32 * 32 + 1, steps=30, batch=16, warmup=5)
           if quick else lm.LMConfig())
    t0 = time.perf_counter()
    data = lm.load_text(cfg)
    model, info = lm.trained(cfg, data)
    batch = 8 if quick else 32
    # every batch [batch, context]: calibration, example inputs and evaluation share a shape
    calib = [(b,) for b in lm.batches(data.train, cfg.context, batch, calib_batches,
                                      cfg.seed + 2)]

    def evaluate(m: nn.Module) -> float:
        return lm.perplexity(m, data.val, cfg.context, batch=batch)

    info = {**info, "seconds": time.perf_counter() - t0, "config": dataclasses.asdict(cfg),
            "vocab": len(data.vocab), "files": {"train": data.files[0], "val": data.files[1]},
            "params": sum(p.numel() for p in model.parameters()),
            "val_tokens": (len(data.val) - 1) // cfg.context * cfg.context}
    return Case("LM", "LM", model, calib, evaluate, "validation perplexity", info)


# -- running ---------------------------------------------------------------------------

def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return "error: " + (text if len(text) <= 100 else text[:97] + "...")


def run_cell(case: Case, config: str, algorithms: list[dict[str, Any]]) -> dict[str, Any]:
    """Compile ``case.model`` with ``config`` and ``algorithms``, calibrate, evaluate.
    A failure is the cell's text (reported, never raised): one broken algorithm must not
    hide the others' numbers."""
    import qcompile as qc

    cell: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        gm = qc.qcompile(copy.deepcopy(case.model), spec(case.family, config, algorithms),
                         example_inputs=case.calib[0])
        t1 = time.perf_counter()
        qc.calibrate(gm, case.calib, progress=False)
        t2 = time.perf_counter()
        cell["value"] = case.evaluate(gm)
        cell.update(compile_s=t1 - t0, calibrate_s=t2 - t1, s=t2 - t0,
                    eval_s=time.perf_counter() - t2)
    except Exception as e:
        cell["value"] = _error(e)
    return cell


def run_case(case: Case, quick: bool) -> dict[str, Any]:
    configs = QUICK_CONFIGS if quick else tuple(CONFIGS)
    t0 = time.perf_counter()
    fp32 = case.evaluate(case.model)
    table: dict[str, dict[str, Any]] = {"fp32": {c: {"value": fp32} for c in configs}}
    for name, algorithms, applies in methods(case.name, quick):
        table[name] = {}
        for c in configs:
            if applies(c):
                table[name][c] = cell = run_cell(case, c, algorithms)
                # progress on stderr: a full run takes minutes, stdout is the result
                print(f"{case.name} | {name} | {c}: {_cell_text(cell, 3)}", file=sys.stderr)
    return {"metric": case.metric, "fp32": fp32, "configs": list(configs), "methods": table,
            "info": case.info, "seconds": time.perf_counter() - t0}


def bench_algorithms(quick: bool) -> dict[str, Any]:
    """Every model x method x config (see the module docstring), plus torchao's GPTQ and
    SmoothQuant on the LM where torchao has them (``n/a`` with the reason otherwise)."""
    from qcompile.tools.accuracy import threads

    # One intra-op thread, as tools/accuracy.py: the models are small, and on a shared
    # 2-core machine 2 threads made a Linear + RMSNorm of the LM 4-5x slower than 1
    # (barrier waits on busy cores); the trained LM's weights then do not depend on the
    # machine's core count either.
    with warnings.catch_warnings(), threads(1):
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return _bench_algorithms(quick)


def _bench_algorithms(quick: bool) -> dict[str, Any]:
    calib_batches = 2 if quick else 16
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                           "calibration_batches": calib_batches}
    names = ("MLP",) if quick else ("CNN", "MLP")
    for name in names:
        out[name] = run_case(digits_case(name, quick, calib_batches), quick)
    lm_case_ = lm_case(quick, calib_batches)
    out["LM"] = run_case(lm_case_, quick)
    if not quick:
        out["LM"]["torchao"] = torchao_ptq(lm_case_)
    return out


# -- torchao ----------------------------------------------------------------------------

def torchao_ptq(case: Case) -> dict[str, Any]:
    """torchao's PTQ on the LM, on the same calibration batches, where it runs on CPU.

    torchao has no static per-tensor activation recipe for Linear on CPU, so its w8a8 is
    ``Int8DynamicActivationInt8WeightConfig`` (int8 per-channel weights, int8 per-token
    activations computed per batch: an easier setting than qcompile's static per-tensor
    ones), plain and under ``SmoothQuantConfig`` (alpha 0.5, the smoothing applied as a
    pre-scale of each Linear's input). Its GPTQ (``torchao.prototype.gptq``, int4 groups
    of 32) is tried in the w4 column. The LM's head stays float, as in qcompile's configs.
    Returns row -> {config: cell}, or row -> "n/a: reason" when torchao is missing or
    refuses (never raises)."""
    from qcompile.tools.bench.competitors import has_torchao

    if not has_torchao():
        return {"(all)": "n/a: torchao not installed (pip install qcompile[bench])"}

    def head_stays_float(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn != "head"

    def timed(prepare: Callable[[nn.Module], None]) -> dict[str, Any]:
        model = copy.deepcopy(case.model)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prepare(model)
                s = time.perf_counter() - t0
                return {"value": case.evaluate(model), "s": s}
        except Exception as e:
            return {"value": "n/a: " + _error(e)[len("error: "):]}

    def int8_dynamic(model: nn.Module) -> None:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=head_stays_float)

    def smoothquant(model: nn.Module) -> None:
        from torchao.prototype.smoothquant import SmoothQuantConfig
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
        from torchao.quantization.quantize_.common.quantization_step import QuantizationStep

        config = SmoothQuantConfig(base_config=Int8DynamicActivationInt8WeightConfig(),
                                   step=QuantizationStep.PREPARE, alpha=0.5)
        quantize_(model, config, filter_fn=head_stays_float)
        with torch.no_grad():
            for batch in case.calib:
                model(*batch)
        config.step = QuantizationStep.CONVERT
        quantize_(model, config, filter_fn=head_stays_float)

    def gptq(model: nn.Module) -> None:
        from torchao.prototype.gptq import GPTQConfig
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        base = Int4WeightOnlyConfig(group_size=32)
        quantize_(model, GPTQConfig(step="observe", base_config=base),
                  filter_fn=head_stays_float)
        with torch.no_grad():
            for batch in case.calib:
                model(*batch)
        quantize_(model, GPTQConfig(step="convert", base_config=base),
                  filter_fn=head_stays_float)

    return {"w8a8 (dynamic per-token activations)": {"w8a8": timed(int8_dynamic)},
            "smoothquant (dynamic per-token activations)": {"w8a8": timed(smoothquant)},
            "gptq (int4 g32)": {"w4 g32": timed(gptq)}}


# -- text ------------------------------------------------------------------------------

def _cell_text(cell: dict[str, Any] | None, decimals: int) -> str:
    if cell is None:
        return "-"
    v = cell["value"]
    if isinstance(v, str):
        return v
    text = f"{v:.{decimals}f}"
    return f"{text} ({cell['s']:.1f} s)" if "s" in cell else text


def model_table(name: str, result: dict[str, Any]) -> str:
    """Markdown table: rows method, columns config; cells metric (compile+calibrate s)."""
    configs = result["configs"]
    decimals = 3 if name == "LM" else 2
    lines = [f"| {name}: {result['metric']} | " + " | ".join(configs) + " |",
             "|---|" + "--:|" * len(configs)]
    for method, row in result["methods"].items():
        lines.append(f"| {method} | "
                     + " | ".join(_cell_text(row.get(c), decimals) for c in configs) + " |")
    for key, value in result.get("torchao", {}).items():
        lines.append(f"| torchao {key} | " + " | ".join(
            _cell_text(value.get(c), decimals) if isinstance(value, dict) else
            (str(value) if i == 0 else "") for i, c in enumerate(configs)) + " |")
    return "\n".join(lines)


def algorithms_text(result: dict[str, Any]) -> str:
    parts = [model_table(name, result[name]) for name in ("CNN", "MLP", "LM") if name in result]
    lm_info = result["LM"]["info"]
    cfg = lm_info["config"]
    trained = ("loaded from the cache " + lm_info["path"] if lm_info.get("cached")
               else f"trained in {lm_info['train_s']:.0f} s, cached at {lm_info['path']}")
    parts.append(
        f"LM: {cfg['layers']} layer(s), d={cfg['dim']}, {lm_info['params']:,} parameters, "
        f"vocab {lm_info['vocab']}, {cfg['steps']} steps on {cfg['train_chars']:,} chars of "
        f"{lm_info['files']['train']} stdlib files; perplexity on {lm_info['val_tokens']:,} "
        f"chars of {lm_info['files']['val']} other files; {trained}.\n"
        f"Calibration: {result['calibration_batches']} training batches; cells: metric "
        f"(compile + calibrate seconds); torch {result['torch']}, {result['threads']} "
        "thread(s).")
    return "\n\n".join(parts)
