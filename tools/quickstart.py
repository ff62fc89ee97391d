"""Quick start: compile a small CNN for int8 QAT, train it on real data, compare with fp32.

The data is scikit-learn's handwritten digits (1,797 8x8 images shipped inside the
package, no download). A CNN is trained in fp32, compiled by qcompile with a preset spec,
and fine-tuned with fake-quant next to an fp32 twin fine-tuned on the same batches. The
compile report and both test accuracies are printed.

Example:
    >>> from qcompile.tools.quickstart import run
    >>> result = run(epochs=1, finetune=1, samples=256, echo=lambda *a: None)
    >>> 0.0 <= result["qat_accuracy"] <= 1.0
    True
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import qcompile as qc


class DigitsCNN(nn.Module):
    """conv-bn-relu x2, max-pool, two Linear layers: 8x8 grey digits -> 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.pool(self.relu2(self.bn2(self.conv2(x))))
        return self.fc2(self.relu3(self.fc1(torch.flatten(x, 1))))


def load_digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): a fixed 80/20 split, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits as _load

    data = _load()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, seed: int,
          lr: float = 3e-3, batch: int = 64) -> list[float]:
    """Adam on shuffled mini-batches (the order depends on ``seed`` only); epoch losses."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        total = 0.0
        for i in range(0, len(x), batch):
            idx = perm[i:i + batch]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(x))
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return (model(x).argmax(1) == y).float().mean().item()


def run(*, spec: str = "int8-qat", epochs: int = 6, finetune: int = 2, seed: int = 0,
        samples: int | None = None, echo: Callable[..., Any] = print) -> dict[str, Any]:
    """The usual QAT workflow: train in fp32, compile the trained model, fine-tune it with
    fake-quant. An fp32 twin gets the same fine-tuning, so the two are trained the same
    way. A static preset (``quant.mode: static``) is post-training quantization: the
    compiled graph is calibrated on the training digits instead, and neither model is
    fine-tuned. ``samples``: train on the first that many training digits (a quick look;
    None, the default: all of them); the test digits are all used. Returns accuracies,
    losses and the compile report."""
    compile_spec = qc.load_spec(spec)  # a bad name is refused before any training
    static = compile_spec.quant.mode == "static"
    label = "PTQ" if static else "QAT"
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_digits(seed)
    if samples is not None:
        x_train, y_train = x_train[:samples], y_train[:samples]
    model = DigitsCNN()
    t0 = time.perf_counter()
    pre_losses = train(model, x_train, y_train, epochs=epochs, seed=seed)
    pre_s = time.perf_counter() - t0
    echo(f"fp32 pre-training: {epochs} epochs on {len(x_train)} digits in {pre_s:.1f} s, "
         f"loss {pre_losses[0]:.3f} -> {pre_losses[-1]:.3f}, "
         f"test accuracy {accuracy(model, x_test, y_test):.2%}")

    t0 = time.perf_counter()
    gm = qc.qcompile(model, compile_spec, example_inputs=(x_train[:2],))
    compile_ms = (time.perf_counter() - t0) * 1e3
    echo(f"\ncompiled DigitsCNN with {spec!r} in {compile_ms:.0f} ms\n")
    echo(qc.report(gm).text())

    fp32 = copy.deepcopy(model)  # the compiled graph holds its own copy of the weights
    if static:
        # static PTQ trains nothing: observe the training digits, then fake-quant is on
        fp32_losses: list[float] = []
        qat_losses: list[float] = []
        fp32_s = qat_s = 0.0
        t0 = time.perf_counter()
        qc.calibrate(gm, [x_train[i:i + 64] for i in range(0, len(x_train), 64)],
                     progress=False)
        echo(f"\ncalibrated on {len(x_train)} digits in {time.perf_counter() - t0:.1f} s "
             f"(static PTQ: no fine-tuning)")
    else:
        t0 = time.perf_counter()
        fp32_losses = train(fp32, x_train, y_train, epochs=finetune, seed=seed + 1, lr=1e-3)
        fp32_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        qat_losses = train(gm, x_train, y_train, epochs=finetune, seed=seed + 1, lr=1e-3)
        qat_s = time.perf_counter() - t0
        qc.freeze(gm)  # fix qparams before evaluation, as for deployment

    result = {
        "fp32_accuracy": accuracy(fp32, x_test, y_test),
        "qat_accuracy": accuracy(gm, x_test, y_test),
        "fp32_losses": fp32_losses,
        "qat_losses": qat_losses,
        "fp32_seconds": fp32_s,
        "qat_seconds": qat_s,
        "report": qc.report(gm),
    }
    if static:
        echo(f"  test accuracy ({len(x_test)} digits): fp32 {result['fp32_accuracy']:.2%}   "
             f"PTQ ({spec}) {result['qat_accuracy']:.2%}")
    else:
        echo(f"\nfine-tuned {finetune} epochs: fp32 {fp32_s:.1f} s, QAT {qat_s:.1f} s "
             f"(QAT/fp32 step time {qat_s / fp32_s:.2f}x)")
        echo(f"  loss  fp32 {fp32_losses[-1]:.4f}   QAT {qat_losses[-1]:.4f}")
        echo(f"  test accuracy ({len(x_test)} digits): fp32 {result['fp32_accuracy']:.2%}   "
             f"QAT ({spec}) {result['qat_accuracy']:.2%}")

    # For deployment: integer kernels, checked against the fake-quant graph.
    import io

    # LoRA adapters (qlora-nf4) are folded into the weights they adapt before lowering
    base = gm
    if qc.report(gm).adapters:
        base = qc.merge_adapters(gm)
        echo(f"\nmerged {len(qc.report(gm).adapters)} LoRA adapter(s) into their weights, "
             f"quantized again as the spec says (merged accuracy "
             f"{accuracy(base, x_test, y_test):.2%})")
    from qcompile.runtime.block_formats import GGML_FORMATS

    if any(q.block_format in GGML_FORMATS for q in qc.quantizers(base).values()):
        # llama.cpp's grids: the model leaves for llama.cpp (qc.export_gguf), which runs an
        # LLM's layers; convert says so
        try:
            qc.convert(base)
        except qc.QCompileError as e:
            echo(f"\nnot converted: {e.message.removeprefix('convert: ')}\n  {e.fix}")
        result["converted_accuracy"] = None
        result["onnx_accuracy"] = None
        accs = {"fp32": result["fp32_accuracy"], label: result["qat_accuracy"]}
        echo("\ntest accuracy: " + "   ".join(f"{k} {v:.2%}" for k, v in accs.items()))
        return result
    int8 = qc.convert(base, example_inputs=(x_test[:64],))
    conv = qc.report(int8)
    paths: dict[str, int] = {}
    for c in conv.conversions:
        paths[c.op] = paths.get(c.op, 0) + 1
    sizes = []
    for m in (model, int8):
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
        sizes.append(len(buf.getvalue()))
    result["converted_accuracy"] = accuracy(int8, x_test, y_test)
    made = ", ".join(f"{n} x {op}" for op, n in paths.items())
    echo(f"\nconverted for inference: {made}")
    echo(f"  state dict {sizes[1] / 1e3:.0f} kB vs fp32 {sizes[0] / 1e3:.0f} kB, max |converted "
         f"- fake-quant| {conv.max_deviation.get('output0', 0.0):.2g}, test accuracy "
         f"{result['converted_accuracy']:.2%}")
    result["onnx_accuracy"] = onnx_accuracy(base, x_test, y_test, echo)
    accs = {"fp32": result["fp32_accuracy"], label: result["qat_accuracy"],
            "converted": result["converted_accuracy"], "onnxruntime": result["onnx_accuracy"]}
    echo("\ntest accuracy: " + "   ".join(f"{k} {v:.2%}" for k, v in accs.items()
                                          if v is not None))
    return result


def onnx_accuracy(gm: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  echo: Callable[..., Any]) -> float | None:
    """Export ``gm`` as QDQ ONNX and return onnxruntime's test accuracy; None, with a
    line saying why, without the ``[onnx]`` extra or when ``qc.export_onnx`` refuses the
    graph (block formats such as mxfp4 / nvfp4 activations have no form onnxruntime runs)."""
    import importlib.util
    import tempfile
    from pathlib import Path

    if any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxscript", "onnxruntime")):
        echo("\nONNX export skipped: pip install qcompile[onnx] to run the model in onnxruntime")
        return None
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = qc.export_onnx(gm, Path(tmp) / "digits.onnx", example_inputs=(x[:2],))
        except qc.QCompileError as e:  # a refusal names the quantizer and the way out
            fix = f"\n  {e.fix}" if e.fix else ""
            reason = e.message.removeprefix("export_onnx: ")
            echo(f"\nONNX export skipped, onnxruntime cannot run this graph: {reason}{fix}")
            return None
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        logits = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
        size = path.stat().st_size
    acc = (logits.argmax(1) == y).float().mean().item()
    with torch.no_grad():
        dev = float((logits - gm.eval()(x)).abs().max())
    echo(f"\nexported to ONNX (QDQ, opset 21): {size / 1e3:.0f} kB, onnxruntime (CPU) on "
         f"{len(x)} digits: max |onnxruntime - fake-quant| {dev:.2g}, test accuracy {acc:.2%}")
    return acc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="int8-qat",
                   help=f"preset name ({', '.join(qc.specs.presets())}) or spec file "
                        f"(default: int8-qat)")
    p.add_argument("--epochs", type=int, default=6, help="fp32 pre-training epochs")
    p.add_argument("--finetune", type=int, default=2, help="fine-tuning epochs (QAT and fp32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=None,
                   help="train on the first N training digits only (a quick look; default: all)")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        run(spec=args.spec, epochs=args.epochs, finetune=args.finetune, seed=args.seed,
            samples=args.samples)
    except qc.QCompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
