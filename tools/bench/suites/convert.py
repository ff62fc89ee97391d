"""The ``convert`` suite: int8 inference latency after ``qc.convert`` relative to fp32
eager, next to torch.ao ``convert_fx`` (MLP at batch 64 and 1, ResNet-style CNN at batch
32), both calibrated on the same batches. Prints as ``records`` (one line per case).
``convert_memory`` adds the memory row: peak RSS of ``qc.convert`` over the calibrated
graph's resident size, in a fresh process, next to the model and its largest layer.

Example:
    >>> from qcompile.tools.bench.suites.convert import int8_spec
    >>> spec = int8_spec()
    >>> spec.quant.mode, spec.quant.inputs is not None
    ('static', True)
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import torch

import qcompile as qc
from qcompile.tools.bench.competitors import convert_fx
from qcompile.tools.bench.models import QUICK_CNN_WIDTH, QUICK_WIDTH, deep_mlp, resnet_like


def int8_spec() -> qc.CompileSpec:
    """int8-static, plus quantized model inputs and pooled features, so every conv and
    linear reads integers (what torch.ao's prepare_fx does by default)."""
    d = qc.load_spec("int8-static").model_dump()
    d["quant"]["inputs"] = {"dtype": "uint8", "symmetric": False}
    d["quant"]["rules"].append({"match": {"module": "AdaptiveAvgPool2d"}, "optional": True,
                                "activation": {"dtype": "uint8", "symmetric": False}})
    return qc.CompileSpec.model_validate(d)


def bench_convert(quick: bool) -> dict[str, Any]:
    """Inference latency of converted int8 graphs relative to fp32 eager: ``qc.convert``
    next to torch.ao ``prepare_fx`` + ``convert_fx`` (x86 default qconfig) on the same
    models, calibrated on the same batches."""
    # quick: a smoke run at smaller widths (the same layers), under the same case names
    width = QUICK_WIDTH if quick else 1024
    cnn = (lambda: resnet_like(QUICK_CNN_WIDTH)) if quick else resnet_like
    cases = {"mlp_b64": (lambda: deep_mlp(4, width), (64, width)),
             "mlp_b1": (lambda: deep_mlp(4, width), (1, width)),
             "cnn_b32": (cnn, (4 if quick else 32, 3, 32, 32))}
    out: dict[str, Any] = {}
    for name, (make, shape) in cases.items():
        torch.manual_seed(0)
        model = make().eval()
        calib = [(torch.randn(shape),) for _ in range(2 if quick else 8)]
        x = torch.randn(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = qc.qcompile(model, int8_spec(), calib[0])
            qc.calibrate(gm, calib, progress=False)
            ours = qc.convert(gm)
        ao = convert_fx(copy.deepcopy(model), calib)
        kernels = sum(c.path in ("kernel", "dynamic_kernel") for c in qc.report(ours).conversions)
        repeat = 3 if quick else (40 if shape[0] == 1 else 8)
        runs: dict[str, list[float]] = {"fp32": [], "qcompile": [], "convert_fx": []}
        contenders = (("fp32", model), ("qcompile", ours), ("convert_fx", ao))
        with torch.inference_mode():
            for _, m in contenders:
                m(x)  # warm-up
            # Rounds of back-to-back calls per contender (warm caches: the fp32 model's
            # 16 MB of weights would evict the int8 ones for whoever runs right after it),
            # contenders interleaved round by round.
            for _ in range(2 if quick else 5):
                for label, m in contenders:
                    block = []
                    for _ in range(repeat):
                        t0 = time.perf_counter()
                        m(x)
                        block.append(time.perf_counter() - t0)
                    runs[label].append(statistics.median(block))
            dev = float((ours(x) - gm.eval()(x)).abs().max())
        times = {k: statistics.median(v) for k, v in runs.items()}
        out[name] = {**{f"{k}_ms": v * 1e3 for k, v in times.items()},
                     "qcompile_speedup": times["fp32"] / times["qcompile"],
                     "convert_fx_speedup": times["fp32"] / times["convert_fx"],
                     "kernels": kernels, "max_dev_vs_fake_quant": dev}
    return out


_MEMORY_SCRIPT = """
import gc, json, sys, torch, qcompile as qc
from qcompile.tools.bench.models import big_model
from qcompile.tools.bench.workers import _reset_peak, _status
torch.manual_seed(0)
gm = qc.qcompile(big_model(int(sys.argv[1]), 2048), "int8-static",
                 example_inputs=(torch.randn(4, 2048),), inplace=True)
qc.calibrate(gm, [(torch.randn(4, 2048),)], progress=False)
sizes = [p.numel() * p.element_size() / 2**20 for p in gm.parameters()]
gc.collect()
_reset_peak()
base = _status()
int8 = qc.convert(gm)
now = _status()
# what the result must hold: int8 weights, float32 biases (packed kernels hide theirs)
ints = sum(p.numel() * (1 if p.dim() > 1 else 4) for p in gm.parameters()) / 2**20
print(json.dumps({"model_mb": sum(sizes), "largest_layer_mb": max(sizes), "result_mb": ints,
                  "convert_peak_mb": now["VmHWM"] - base["VmRSS"]}))
"""


def convert_memory(quick: bool, mmap_threshold: int | None = None) -> dict[str, float]:
    """Peak RSS of ``qc.convert`` (MB over the calibrated graph, which stays resident: the
    source is untouched) for ``big_model`` (8 blocks, 256 MB; 2 with ``quick``), in a fresh
    process, default allocator unless ``mmap_threshold`` (``MALLOC_MMAP_THRESHOLD_``).
    The bound: the result plus one layer (``bound_mb``)."""
    env = dict(os.environ)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    run = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, "2" if quick else "8"],
                         capture_output=True, text=True, env=env, check=True)
    row = json.loads(run.stdout.strip().splitlines()[-1])
    row["bound_mb"] = row["result_mb"] + row["largest_layer_mb"]
    row["ok"] = row["convert_peak_mb"] <= row["bound_mb"] * 1.1
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
