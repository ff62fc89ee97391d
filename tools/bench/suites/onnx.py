"""The ``onnx`` suite: onnxruntime (CPU) latency of the QDQ model ``qc.export_onnx`` writes
(after onnxruntime's graph optimisations fuse it into QLinear* / integer kernels) next to
the fp32 ONNX model and to ``qc.convert``'s torch integer kernels, and the QDQ file's size
relative to fp32 (MLP at batch 64 and 1, ResNet-style CNN at batch 32; int8 static, the
``convert`` suite's spec). Without the ``[onnx]`` extra the result is a one-line note.

Example:
    >>> from qcompile.tools.bench.suites.onnx import fused_kernels
    >>> fused_kernels(["QLinearConv", "Relu", "MatMulIntegerToFloat", "Conv"])
    2
"""

from __future__ import annotations

import importlib
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import qcompile as qc
from qcompile.tools.bench.models import QUICK_CNN_WIDTH, QUICK_WIDTH, deep_mlp, resnet_like
from qcompile.tools.bench.suites.convert import int8_spec

_INTEGER_OPS = ("QLinear", "QGemm", "MatMulInteger", "ConvInteger", "MatMulNBits",
                "DynamicQuantizeMatMul")


def fused_kernels(op_types: list[str]) -> int:
    """How many of the nodes onnxruntime runs are integer kernels."""
    return sum(t.startswith(_INTEGER_OPS) for t in op_types)


def _session(ort: Any, path: Path, optimized: Path | None = None) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = min(2, torch.get_num_threads())
    options.log_severity_level = 3  # no warning about serialising an optimised model
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _time_rounds(contenders: dict[str, Callable[[], Any]], repeat: int,
                 rounds: int = 5) -> dict[str, float]:
    """Median seconds per call: ``rounds`` rounds of back-to-back calls per contender,
    contenders interleaved round by round (warm caches for each, drift shared by all)."""
    runs: dict[str, list[float]] = {k: [] for k in contenders}
    for fn in contenders.values():
        fn()  # warm-up
    for _ in range(rounds):
        for label, fn in contenders.items():
            block = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                block.append(time.perf_counter() - t0)
            runs[label].append(statistics.median(block))
    return {k: statistics.median(v) for k, v in runs.items()}


def _case(ort: Any, onnx: Any, make: Callable[[], torch.nn.Module], shape: tuple[int, ...],
          batches: tuple[int, ...], quick: bool, folder: Path) -> dict[int, dict[str, Any]]:
    """One model compiled, calibrated, converted and exported once (both ONNX files take
    any batch), then timed at each batch size."""
    torch.manual_seed(0)
    model = make().eval()
    calib = [(torch.randn(shape),) for _ in range(2 if quick else 8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = qc.qcompile(model, int8_spec(), calib[0])
        qc.calibrate(gm, calib, progress=False)
        ours = qc.convert(gm)
        qdq = qc.export_onnx(gm, folder / "qdq.onnx", example_inputs=calib[0])
        fp32 = folder / "fp32.onnx"
        torch.onnx.export(model, calib[0], str(fp32), dynamo=True, verbose=False,
                          external_data=False, dynamic_shapes=({0: torch.export.Dim("batch")},))
    q_sess = _session(ort, qdq, optimized=folder / "qdq.opt.onnx")
    f_sess = _session(ort, fp32)
    fused = [n.op_type for n in onnx.load(str(folder / "qdq.opt.onnx")).graph.node]
    common = {"size_kb": qdq.stat().st_size / 1e3,
              "size_vs_fp32": qdq.stat().st_size / fp32.stat().st_size,
              "integer_kernels": fused_kernels(fused)}
    step = _output_step(gm)
    rows = {}
    for batch in batches:
        x = torch.randn(batch, *shape[1:])
        feed = {q_sess.get_inputs()[0].name: x.numpy()}
        fp32_feed = {f_sess.get_inputs()[0].name: x.numpy()}
        repeat = 3 if quick else (40 if batch == 1 else 8)
        with torch.inference_mode():
            times = _time_rounds({"fp32_onnx": lambda: f_sess.run(None, fp32_feed),  # noqa: B023
                                  "qdq_onnx": lambda: q_sess.run(None, feed),  # noqa: B023
                                  "qc_convert": lambda: ours(x),  # noqa: B023
                                  "fp32_eager": lambda: model(x)},  # noqa: B023
                                 repeat, rounds=2 if quick else 5)
            dev = float((torch.from_numpy(q_sess.run(None, feed)[0]) - gm.eval()(x)).abs().max())
        rows[batch] = {**{f"{k}_ms": v * 1e3 for k, v in times.items()},
                       "qdq_vs_fp32_onnx": times["fp32_onnx"] / times["qdq_onnx"],
                       "qdq_vs_qc_convert": times["qc_convert"] / times["qdq_onnx"],
                       **common, "max_dev_vs_fake_quant": dev, "max_dev_output_steps": dev / step}
    return rows


def _output_step(gm: torch.fx.GraphModule) -> float:
    """The scale of the quantizer that produces the graph's output."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    node = torch.utils._pytree.tree_leaves(out.args[0])[0]
    return float(gm.get_submodule(str(node.target)).scale.max())


def bench_onnx(quick: bool) -> dict[str, Any]:
    """Latency (ms, speedups as fp32-time / QDQ-time: > 1 means the QDQ model is faster)
    and file size of the QDQ ONNX model per case; a note when the extra is missing."""
    try:
        ort = importlib.import_module("onnxruntime")
        onnx = importlib.import_module("onnx")
        importlib.import_module("onnxscript")
    except ImportError:
        return {"note": "the onnx extra is not installed: pip install qcompile[onnx]"}
    # quick: a smoke run at smaller widths (the same layers), the exports dominate its time
    width = QUICK_WIDTH if quick else 1024
    cnn = (lambda: resnet_like(QUICK_CNN_WIDTH)) if quick else resnet_like
    models = {"mlp": (lambda: deep_mlp(4, width), (8, width), (64, 1)),
              "cnn": (cnn, (4, 3, 32, 32), (4 if quick else 32,))}
    out: dict[str, Any] = {}
    for name, (make, shape, batches) in models.items():
        with tempfile.TemporaryDirectory() as tmp:
            rows = _case(ort, onnx, make, shape, batches, quick, Path(tmp))
        # the CNN keeps the convert suite's name at either batch size
        out.update({f"{name}_b{32 if name == 'cnn' else b}": row for b, row in rows.items()})
    return out
