"""Accuracy study (issue 6): qcompile next to torch.ao FX on scikit-learn's digits.

A small CNN (``quickstart.DigitsCNN``) and an MLP (``DigitsMLP``) are trained in fp32 on
the quick start's fixed 80/20 split of the digits (1,437 train / 360 test images, shipped
with scikit-learn), then quantized five ways: dynamic int8 (Linear layers, per-channel
weights), static int8 (per-channel weights, histogram activations, calibrated on training
batches), QAT int8 and QAT w4a8 (both fine-tuned from the fp32 weights). Every graph is
evaluated in fake-quant, and as real integer kernels when ``qc.convert`` exists. torch.ao
FX (``prepare_fx`` / ``prepare_qat_fx`` / ``convert_to_reference_fx`` / ``convert_fx``)
runs the same recipes on the same data, seeds and batches.

Run ``python -m qcompile.tools.accuracy`` for the markdown table (``--json`` for the raw
numbers, ``--quick`` for the qcompile columns only: the numbers the tests assert).

Targets (accuracy points lost vs the fp32 model, at most): dynamic int8 0.5, static int8
0.5, QAT int8 0.2, QAT w4a8 1.0. The test set has 360 images, so one image is 0.28 points:
a drop is a whole number of images, and a target is checked in images, rounded up to the
test set's resolution (``allowed_images``: 2, 2, 1 and 4 images). Asking for "no image
lost" instead would fail on float rounding alone: another instruction set (AVX-512 VNNI
vs AVX2) moves a borderline activation across a rounding step and flips one image.

Example (one cheap row: an MLP trained for one epoch, then dynamic int8):
    >>> from qcompile.tools.accuracy import Settings, evaluate, train_fp32
    >>> settings = Settings(fp32_epochs={"MLP": 1})
    >>> model = train_fp32("MLP", settings)
    >>> result = evaluate("MLP", "dynamic int8", model, settings)
    >>> 0.0 <= result.fake_quant <= 1.0
    True
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.tools.quickstart import DigitsCNN, accuracy, load_digits, train

MODELS = ("CNN", "MLP")
METHODS = ("fp32", "dynamic int8", "static int8", "QAT int8", "QAT w4a8")
# The largest accepted drop, in accuracy points (percent), vs the fp32 model; checked in
# whole test images (``allowed_images``).
TARGETS = {"dynamic int8": 0.5, "static int8": 0.5, "QAT int8": 0.2, "QAT w4a8": 1.0}

_QUANTIZED = ["Conv1d", "Conv2d", "Conv3d", "Linear"]
_HISTOGRAM_ACT = {"dtype": "uint8", "symmetric": False, "observer": "histogram"}
# Static int8 with histogram activation observers (the int8-static preset uses minmax).
STATIC_HISTOGRAM_SPEC = {
    "version": 1,
    "quant": {
        "mode": "static",
        "rules": [
            {"match": {"module": _QUANTIZED},
             "weight": {"dtype": "int8", "symmetric": True, "granularity": "per_channel",
                        "observer": "minmax"},
             "activation": _HISTOGRAM_ACT},
            {"match": {"op": ["add", "matmul", "cat"]}, "activation": _HISTOGRAM_ACT,
             "optional": True},
        ],
        "fold_bn": True,
    },
}
# method -> qcompile spec (a preset name or a spec dict)
SPECS: dict[str, Any] = {
    "dynamic int8": "int8-dynamic",
    "static int8": STATIC_HISTOGRAM_SPEC,
    "QAT int8": "int8-qat",
    "QAT w4a8": "w4a8-qat",
}


class DigitsMLP(nn.Module):
    """Flatten the 8x8 image, then 64 -> 128 -> 64 -> 10 with ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(128, 64)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.fc1(torch.flatten(x, 1)))
        return self.fc3(self.relu2(self.fc2(x)))


def _default_epochs() -> dict[str, int]:
    return {"CNN": 8, "MLP": 30}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that fixes the numbers: seed (split, init, batch order), epochs, lrs."""

    seed: int = 0
    fp32_epochs: dict[str, int] = dataclasses.field(default_factory=_default_epochs)
    fp32_lr: float = 3e-3
    qat_epochs: int = 3         # QAT fine-tuning from the fp32 weights
    qat_lr: float = 1e-4
    calib_batches: int = 2      # static PTQ: batches of the shuffled train set
    calib_batch: int = 256
    batch: int = 64
    threads: int = 1            # intra-op threads (see ``threads``)


@dataclasses.dataclass
class Result:
    """Test accuracies in [0, 1] of one (model, method); None where not computed, a
    string where a step failed (the tool prints it in the cell)."""

    model: str
    method: str
    fake_quant: float | None = None
    converted: float | str | None = None
    torch_ao_fake_quant: float | str | None = None
    torch_ao_converted: float | str | None = None
    fp32_twin: float | None = None   # QAT rows: fp32 fine-tuned on the same batches
    seconds: float = 0.0


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads, then restore. The study uses one: the models are
    tiny (threads add barrier overhead, several times the compute on busy cores) and the
    numbers then do not depend on the machine's core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=4)
def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): the quick start's fixed split."""
    return load_digits(seed)


def make_model(name: str) -> nn.Module:
    return {"CNN": DigitsCNN, "MLP": DigitsMLP}[name]()


def train_fp32(name: str, settings: Settings = Settings()) -> nn.Module:
    """The fp32 baseline: seeded init, Adam on seeded mini-batches."""
    x, y, _, _ = data(settings.seed)
    torch.manual_seed(settings.seed)
    model = make_model(name)
    with threads(settings.threads):
        train(model, x, y, epochs=settings.fp32_epochs[name], seed=settings.seed,
              lr=settings.fp32_lr, batch=settings.batch)
    return model.eval()


def test_accuracy(model: nn.Module, settings: Settings = Settings()) -> float:
    _, _, x, y = data(settings.seed)
    return accuracy(model, x, y)


test_accuracy.__test__ = False  # not a pytest test


def n_test_images(seed: int = 0) -> int:
    """Images in the test split (360 for every seed: a fixed 80/20 split)."""
    return len(data(seed)[3])


def allowed_images(method: str, n_test: int) -> int:
    """The target of ``method`` in test images: its points rounded up to whole images, the
    test set's resolution (``0.2`` points of 360 images is 0.72 images: 1).

    Example:
        >>> [allowed_images(m, 360) for m in TARGETS]
        [2, 2, 1, 4]
    """
    return math.ceil(TARGETS[method] / 100 * n_test - 1e-9)


def images_lost(base: float, accuracy: float, n_test: int) -> int:
    """Test images lost against the fp32 accuracy ``base`` (negative: gained); both are
    fractions of the same ``n_test`` images, so the difference is a whole number."""
    return round((base - accuracy) * n_test)


def within_target(method: str, base: float, accuracy: float, n_test: int) -> bool:
    """Whether ``accuracy`` loses at most ``allowed_images(method, n_test)`` images."""
    return images_lost(base, accuracy, n_test) <= allowed_images(method, n_test)


def calibration_batches(settings: Settings) -> list[tuple[torch.Tensor]]:
    x, _, _, _ = data(settings.seed)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(settings.seed + 2))
    b = settings.calib_batch
    return [(x[perm[i * b:(i + 1) * b]],) for i in range(settings.calib_batches)]


def _finetune(model: nn.Module, settings: Settings) -> None:
    x, y, _, _ = data(settings.seed)
    train(model, x, y, epochs=settings.qat_epochs, seed=settings.seed + 1,
          lr=settings.qat_lr, batch=settings.batch)


def fp32_twin(model: nn.Module, settings: Settings = Settings()) -> float:
    """Test accuracy of a copy of ``model`` fine-tuned in fp32 exactly as the QAT runs
    are (same epochs, lr, batches): how much of a QAT change is the extra training."""
    twin = copy.deepcopy(model)
    with threads(settings.threads):
        _finetune(twin, settings)
        return test_accuracy(twin, settings)


def qcompile_method(method: str, model: nn.Module, settings: Settings = Settings()) -> nn.Module:
    """The qcompile graph for ``method``, ready for evaluation (fake-quant)."""
    x, _, _, _ = data(settings.seed)
    gm = qc.qcompile(model, SPECS[method], example_inputs=(x[:2],))
    if method == "static int8":
        qc.calibrate(gm, calibration_batches(settings), progress=False)
    elif method.startswith("QAT"):
        _finetune(gm, settings)
        qc.freeze(gm)
    # dynamic: weights were quantized at compile time, activations per batch: nothing to do
    return gm.eval()


def has_convert() -> bool:
    return hasattr(qc, "convert")


def qcompile_convert(gm: nn.Module) -> nn.Module:
    """``qc.convert(gm)``: integer kernels (``gm`` itself is left as it is)."""
    return qc.convert(gm).eval()


# -- torch.ao FX ----------------------------------------------------------------------

def _ao_w4a8_qconfig() -> Any:
    """int4 per-channel symmetric weights (int8 storage, quant range [-8, 7]) and uint8
    per-tensor moving-average activations. torch.ao's FakeQuantize has no per-group
    granularity and no per-token activations for FX, so this is the closest QConfig."""
    from torch.ao.quantization import (
        FusedMovingAvgObsFakeQuantize,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        QConfig,
    )

    return QConfig(
        activation=FusedMovingAvgObsFakeQuantize.with_args(
            observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
            dtype=torch.quint8, reduce_range=False),
        weight=FusedMovingAvgObsFakeQuantize.with_args(
            observer=MovingAveragePerChannelMinMaxObserver, quant_min=-8, quant_max=7,
            dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


def torch_ao_method(method: str, model: nn.Module,
                    settings: Settings = Settings()) -> tuple[nn.Module | None, nn.Module]:
    """(fake-quant model or None, converted model) from torch.ao FX, same recipe.

    PTQ (dynamic, static): fake-quant is ``convert_to_reference_fx`` (quantize/dequantize
    around float ops), converted is ``convert_fx``. QAT: ``prepare_qat_fx``, the same
    fine-tuning, observers off, then the prepared model (fake-quant) and ``convert_fx``.
    """
    from torch.ao.quantization import (
        QConfigMapping,
        disable_observer,
        get_default_qat_qconfig_mapping,
        get_default_qconfig_mapping,
        per_channel_dynamic_qconfig,
    )
    from torch.ao.quantization.quantize_fx import (
        convert_fx,
        convert_to_reference_fx,
        prepare_fx,
        prepare_qat_fx,
    )

    x, _, _, _ = data(settings.seed)
    example = (x[:2],)
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notices
        if method in ("dynamic int8", "static int8"):
            if method == "dynamic int8":
                # global: fused neighbours need the same qconfig; x86 has no dynamic conv,
                # so only Linear layers are quantized (as quantize_dynamic would)
                qmap = QConfigMapping().set_global(per_channel_dynamic_qconfig)
            else:
                qmap = get_default_qconfig_mapping("x86")
            prepared = prepare_fx(model.eval(), qmap, example)
            with torch.no_grad():
                for (batch,) in calibration_batches(settings):
                    prepared(batch)
            fake = convert_to_reference_fx(copy.deepcopy(prepared)).eval()
            return fake, convert_fx(prepared).eval()
        qmap = (get_default_qat_qconfig_mapping("x86") if method == "QAT int8"
                else QConfigMapping().set_global(_ao_w4a8_qconfig()))
        prepared = prepare_qat_fx(model.train(), qmap, example)
        _finetune(prepared, settings)
        prepared.apply(disable_observer)
        prepared.eval()
        return prepared, convert_fx(copy.deepcopy(prepared)).eval()


# -- the study ------------------------------------------------------------------------

def _cell_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return "error: " + (text if len(text) <= 80 else text[:77] + "...")


def evaluate(name: str, method: str, model: nn.Module, settings: Settings = Settings(), *,
             torch_ao: bool = False, catch_convert: bool = False) -> Result:
    """Accuracies of ``method`` applied to the trained fp32 ``model`` (``name``: CNN/MLP).

    The converted column is computed when ``qc.convert`` exists; if it raises, the error
    propagates unless ``catch_convert`` (then the cell holds the message). torch.ao
    failures are always caught into the cell: they are reported, not asserted.
    """
    with threads(settings.threads):
        return _evaluate(name, method, model, settings, torch_ao=torch_ao,
                         catch_convert=catch_convert)


def _evaluate(name: str, method: str, model: nn.Module, settings: Settings, *,
              torch_ao: bool, catch_convert: bool) -> Result:
    t0 = time.perf_counter()
    result = Result(name, method)
    if method == "fp32":
        result.fake_quant = test_accuracy(model, settings)
        result.seconds = time.perf_counter() - t0
        return result
    gm = qcompile_method(method, model, settings)
    result.fake_quant = test_accuracy(gm, settings)
    if has_convert():
        try:
            result.converted = test_accuracy(qcompile_convert(gm), settings)
        except Exception as e:
            if not catch_convert:
                raise
            result.converted = _cell_error(e)
    if torch_ao:
        try:
            fake, converted = torch_ao_method(method, model, settings)
        except Exception as e:
            result.torch_ao_fake_quant = result.torch_ao_converted = _cell_error(e)
        else:
            result.torch_ao_fake_quant = test_accuracy(fake, settings)
            try:
                result.torch_ao_converted = test_accuracy(converted, settings)
            except Exception as e:
                result.torch_ao_converted = _cell_error(e)
    result.seconds = time.perf_counter() - t0
    return result


def run(models: tuple[str, ...] = MODELS, methods: tuple[str, ...] = METHODS,
        settings: Settings = Settings(), *, torch_ao: bool = True,
        echo: Callable[..., Any] = print) -> Iterator[Result]:
    """Train each model in fp32 once, then yield a Result per (model, method); progress
    goes to ``echo(..., file=sys.stderr)``."""
    for name in models:
        t0 = time.perf_counter()
        model = train_fp32(name, settings)
        echo(f"{name}: fp32 trained in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        twin = fp32_twin(model, settings) if torch_ao else None
        for method in methods:
            result = evaluate(name, method, model, settings, torch_ao=torch_ao,
                              catch_convert=True)
            if method.startswith("QAT"):
                result.fp32_twin = twin
            echo(f"  {method}: {result.seconds:.1f} s", file=sys.stderr)
            yield result


def _pct(v: float | str | None) -> str:
    if v is None:
        return "-"
    return v if isinstance(v, str) else f"{100 * v:.2f}"


def _drop(base: float, v: float | str | None) -> str | None:
    return f"{100 * (base - v):+.2f}" if isinstance(v, float) else None


def table(results: list[Result], n_test: int | None = None) -> str:
    """The markdown table: accuracies in %, drops in points vs that model's fp32 row; the
    target column checks both qcompile columns in images of the ``n_test`` test images
    (``within_target``; default: the digits split's size)."""
    n = n_test_images() if n_test is None else n_test
    head = ("| model | method | qcompile fake-quant | qcompile converted | drop (pts, "
            "fake-quant / converted) | torch.ao fake-quant | torch.ao converted | target "
            "(max drop) |")
    lines = [head, "|---|---|--:|--:|--:|--:|--:|---|"]
    base = {r.model: r.fake_quant for r in results if r.method == "fp32"}
    for r in results:
        if r.method == "fp32":
            cells = [r.model, r.method, _pct(r.fake_quant), "-", "-", "-", "-", "-"]
        else:
            b = base[r.model]
            drops = [d for d in (_drop(b, r.fake_quant), _drop(b, r.converted)) if d]
            ok = all(within_target(r.method, b, v, n) for v in (r.fake_quant, r.converted)
                     if isinstance(v, float)) and not isinstance(r.converted, str)
            k = allowed_images(r.method, n)
            cells = [r.model, r.method, _pct(r.fake_quant), _pct(r.converted),
                     " / ".join(drops), _pct(r.torch_ao_fake_quant),
                     _pct(r.torch_ao_converted),
                     f"≤ {TARGETS[r.method]} ({k} image{'s' if k != 1 else ''}) "
                     f"{'✓' if ok else '✗'}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(settings: Settings, results: list[Result]) -> str:
    """The settings behind the table, as markdown bullets."""
    epochs = ", ".join(f"{k} {v}" for k, v in settings.fp32_epochs.items())
    lines = [
        f"- seed {settings.seed} (split, init, batch order); fp32: Adam lr "
        f"{settings.fp32_lr}, batch {settings.batch}, epochs {epochs}; QAT (both "
        f"libraries, same batches): {settings.qat_epochs} epochs from the fp32 weights, "
        f"Adam lr {settings.qat_lr}; static calibration: {settings.calib_batches} x "
        f"{settings.calib_batch} training images; {settings.threads} intra-op thread(s).",
        "- drop = fp32 accuracy - quantized accuracy (points; negative = better than "
        "fp32); the target column checks qcompile fake-quant and converted, in whole test "
        "images (the target's points rounded up to the test set's resolution).",
        "- torch.ao fake-quant: `convert_to_reference_fx` (dynamic, static) or the "
        "`prepare_qat_fx` model with observers off (QAT); converted: `convert_fx`. "
        "dynamic: `per_channel_dynamic_qconfig`; static: `get_default_qconfig_mapping"
        "(\"x86\")` (HistogramObserver, reduce_range=True: 7-bit activations); QAT int8: "
        "`get_default_qat_qconfig_mapping(\"x86\")`; QAT w4a8: per-channel int4 weights "
        "(qint8, quant_min=-8, quant_max=7) and uint8 per-tensor activations, since "
        "torch.ao's FakeQuantize has no per-group weights or per-token activations "
        "(qcompile's w4a8-qat: int4 groups of 32 on Linear, per-token int8 activations).",
    ]
    twins = {r.model: r.fp32_twin for r in results if r.fp32_twin is not None}
    if twins:
        lines.append("- fp32 twin fine-tuned exactly like the QAT runs (same epochs, lr, "
                     "batches): " + ", ".join(f"{k} {_pct(v)}%" for k, v in twins.items())
                     + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qcompile.tools.accuracy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quick", action="store_true",
                   help="qcompile columns only (no torch.ao, no fp32 twins)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
    settings = Settings(seed=args.seed)
    t0 = time.perf_counter()
    results = list(run(settings=settings, torch_ao=not args.quick,
                       echo=lambda *a, **k: print(*a, **k)))
    total = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"settings": dataclasses.asdict(settings), "targets": TARGETS,
                          "torch": torch.__version__, "seconds": total,
                          "results": [dataclasses.asdict(r) for r in results]}, indent=2))
        return 0
    print(table(results, n_test_images(settings.seed)))
    print()
    print(notes(settings, results))
    print(f"\n{len(results)} rows in {total:.0f} s (torch {torch.__version__}, "
          f"{settings.threads} thread(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
