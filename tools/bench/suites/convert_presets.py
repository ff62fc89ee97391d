"""The ``convert-presets`` suite: inference latency of a model compiled with the shipped
``int8-static`` / ``int8-qat`` presets *as they are* (no spec edits), converted with
``qc.convert``, relative to fp32 eager and next to torch.ao's ``prepare_fx`` +
``convert_fx`` (x86 default qconfig mapping) on the same model and batches, at batch 1
and 64. All contenders run side by side in one process, interleaved round by round, and
are reported as ratios to fp32 (lower is faster).

The model is a 1024-2048-4096-1024 MLP (Linear-ReLU-Linear-ReLU-Linear): its first layer
reads the model's float input, which is what the presets' ``inputs: auto`` quantizes
(as torch.ao's input observer does) so that every layer runs an integer kernel.

Example:
    >>> from qcompile.tools.bench.suites.convert_presets import preset_mlp
    >>> [m.out_features for m in preset_mlp(64)[::2]]
    [128, 256, 64]
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.tools.bench.competitors import convert_fx


def preset_mlp(width: int = 1024) -> nn.Sequential:
    """``width``-``2 width``-``4 width``-``width``: Linear-ReLU-Linear-ReLU-Linear."""
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 4 * width),
                         nn.ReLU(), nn.Linear(4 * width, width))


def _prepared(model: nn.Module, preset: str, calib: list[tuple[torch.Tensor]]
              ) -> torch.fx.GraphModule:
    """``model`` compiled with ``preset`` as shipped: calibrated (static) or trained one
    SGD step and frozen (QAT)."""
    gm = qc.qcompile(model, preset, example_inputs=calib[0])
    if preset == "int8-static":
        return qc.calibrate(gm, calib, progress=False)
    opt = torch.optim.SGD(gm.parameters(), lr=1e-4)
    gm.train()
    for (x,) in calib:
        opt.zero_grad()
        gm(x).square().mean().backward()
    opt.step()
    return qc.freeze(gm).eval()


def _timed(contenders: dict[str, nn.Module], x: torch.Tensor, repeat: int) -> dict[str, float]:
    """Median seconds per call of each contender: 5 rounds of ``repeat`` back-to-back calls
    per contender (warm caches), contenders interleaved round by round."""
    runs: dict[str, list[float]] = {k: [] for k in contenders}
    with torch.inference_mode():
        for m in contenders.values():
            m(x)  # warm-up
        for _ in range(5):
            for label, m in contenders.items():
                block = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    m(x)
                    block.append(time.perf_counter() - t0)
                runs[label].append(statistics.median(block))
    return {k: statistics.median(v) for k, v in runs.items()}


def bench_convert_presets(quick: bool) -> dict[str, Any]:
    """Per preset and batch size: converted latency over fp32 (``qcompile_vs_fp32``), torch.ao
    ``convert_fx``'s over fp32 (``convert_fx_vs_fp32``), how many layers run an integer
    kernel, and the converted output's largest deviation from the fake-quant graph in
    output steps."""
    width = 256 if quick else 1024
    out: dict[str, Any] = {}
    for preset in ("int8-static", "int8-qat"):
        for batch in (1, 64):
            torch.manual_seed(0)
            model = preset_mlp(width).eval()
            calib = [(torch.randn(max(batch, 8), width),) for _ in range(2 if quick else 4)]
            x = torch.randn(batch, width)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gm = _prepared(copy.deepcopy(model), preset, calib)
                ours = qc.convert(gm, example_inputs=(x,))
                ao = convert_fx(copy.deepcopy(model).eval(), calib)
            rep = qc.report(ours)
            repeat = 3 if quick else (60 if batch == 1 else 10)
            t = _timed({"fp32": model, "qcompile": ours, "convert_fx": ao}, x, repeat)
            out[f"{preset}_b{batch}"] = {
                **{f"{k}_ms": round(v * 1e3, 4) for k, v in t.items()},
                "qcompile_vs_fp32": round(t["qcompile"] / t["fp32"], 3),
                "convert_fx_vs_fp32": round(t["convert_fx"] / t["fp32"], 3),
                "kernels": sum(c.path == "kernel" for c in rep.conversions),
                "max_dev_output_steps": round(rep.max_deviation.get("output0_steps", 0.0), 3),
            }
    return out
