"""The ``torch-models`` suite: coverage of torch's own quantization test models, qcompile
next to torch.ao, one row per model and preset.

The models are the ``nn.Module`` classes of ``torch.testing._internal.common_quantization``
(module level and one level of nesting, e.g. ``TestHelperModules.Conv2dWithCat``) that
build without arguments, plus the ones that need them built with the arguments torch's
tests use (``_VARIANTS``); ``DummyObserver`` (an observer, not a model) is left out.
Each is built under ``torch.manual_seed(0)``.

Example inputs, first match wins:

1. ``_inputs_table()``: models with several inputs whose shapes no rule can guess, models
   whose reshape after the first layer needs one size, and one whose own inputs are a
   single sample (BatchNorm cannot train on it);
2. the model's own ``get_example_inputs()`` (or ``example_inputs()``);
3. the rule: the first module (in ``model.modules()`` order) with a weight sets the
   shape of the first input: ``Linear(i, o)`` -> ``randn(2, i)``; ``ConvNd`` /
   ``ConvTransposeNd`` -> ``randn(2, in_channels, 8, ...)``; ``Embedding(n, d)`` ->
   ``randint(n, (2, 4))``; ``EmbeddingBag`` -> indices ``randint(n, (8,))`` and offsets
   ``[0, 4]`` (``[0, 4, 8]`` with ``include_last_offset``); ``LSTM`` / ``GRU`` / ``RNN``
   -> ``randn(3, 2, input_size)`` (sequence first unless ``batch_first``); cells ->
   ``randn(2, input_size)``; a plain tensor attribute ``weight`` (functional
   ``F.linear`` / ``F.conv2d``) -> ``randn(2, weight.shape[1])`` or
   ``randn(2, weight.shape[1], 8, 8)``; no weight at all -> ``randn(2, 3, 8, 8)``.
   Every other positional input without a default gets a tensor like the first.

Calibration / training batches are the example inputs with every float tensor redrawn
(``randn_like``, seeded), integer tensors (indices, offsets) kept; rel-L2 is measured on
one more such batch: ``||y - y_fp32|| / ||y_fp32||`` over all float outputs.

Per model and preset (qcompile | torch.ao):

- ``int8-qat``: ``qc.qcompile(model.train(), "int8-qat")``, 8 forwards in train mode,
  ``qc.freeze``, eval | ``prepare_qat_fx`` (``get_default_qat_qconfig_mapping("x86")``),
  the same forwards, eval. The fp32 reference is a copy of the model that ran the same
  forwards (BatchNorm statistics move alike). Converted: ``qc.convert`` | ``convert_fx``.
- ``int8-static``: ``qc.qcompile`` + ``qc.calibrate`` on 8 batches | ``prepare_fx``
  (``get_default_qconfig_mapping("x86")``) + the same batches. Fake-quant output: the
  calibrated graph | ``convert_to_reference_fx`` (torch.ao's simulated-quantization graph).
  Converted: ``qc.convert`` | ``convert_fx``.
- ``int8-dynamic``: ``qc.qcompile`` | ``quantize_dynamic`` (eager, no fake-quant stage:
  compiled means it ran). Converted: ``qc.convert`` | the ``quantize_dynamic`` model.

(``quick``: 2 batches.) Most example inputs are one or two samples, so the test batch
often leaves the calibrated range. There the two libraries differ by design: torch.ao's x86
kernels quantize activations on the full uint8 grid with qparams observed for 0..127, so
values up to twice the observed range pass its converted model unclipped (its own
fake-quant graph clips them), while qcompile's converted graph clips where its fake-quant
graph does (``quant.target: x86`` keeps activations in 0..127 so that no CPU saturates).
On such rows torch.ao's converted rel-L2 is below its fake-quant rel-L2.

``compiled``: the compile (prepare) and its batches ran; ``converted``: the conversion
and its output on the test batch ran. ``quantized``: the fraction of the model's weight
elements (parameters and plain tensor attributes) behind a quantizer: qcompile counts a
tensor ``<name>`` when ``qc.quantizers(gm)`` has ``<name>_fake_quant``; torch.ao counts the
quantized tensors its converted model holds (module weights and packed functional
weights). Failures keep the stage and the first line of the error.

Needs ``expecttest`` (torch's test helpers import it): without it the result is a note.

Example (the input rule, no torch test import needed):
    >>> import torch
    >>> from qcompile.tools.bench.suites.torch_models import rule_inputs
    >>> [tuple(t.shape) for t in rule_inputs(torch.nn.Sequential(torch.nn.Conv1d(4, 2, 3)))]
    [(2, 4, 8)]
    >>> [t.dtype for t in rule_inputs(torch.nn.EmbeddingBag(10, 3))]
    [torch.int64, torch.int64]
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import io
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.tools.output import table

_SOURCE = "torch.testing._internal.common_quantization"
PRESETS = ("int8-qat", "int8-static", "int8-dynamic")
SIDES = ("qcompile", "torch_ao")
_EXCLUDED = {"DummyObserver": "an observer, not a model"}
_QUICK = ("SingleLayerLinearModel", "ConvBnReLUModel", "ConvTransposeModel",
          "RNNDynamicModel(LSTM)", "EmbeddingBagModule", "FunctionalLinearAddModel",
          "TestHelperModules.ThreeAdd", "TestHelperModules.Conv2dWithCat")


@dataclass(frozen=True)
class Case:
    """One model of the sweep: its name, how to build it, and where its inputs come from
    (``get_example_inputs``, ``example_inputs``, ``table`` or ``rule``)."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[nn.Module], tuple[Any, ...]]
    source: str


# -- the catalogue ---------------------------------------------------------------------


def _variants(cq: Any) -> dict[str, list[tuple[str, tuple[Any, ...], dict[str, Any]]]]:
    """Constructor arguments for the classes that need them: (label, args, kwargs), the
    values torch's own tests build them with."""
    from torch.ao.quantization import default_qconfig

    engine = [("x86", ("x86",), {})]
    return {
        "RNNDynamicModel": [(t, (t,), {}) for t in ("LSTM", "GRU")],
        "RNNCellDynamicModel": [(t, (t,), {}) for t in
                                ("LSTMCell", "GRUCell", "RNNReLU", "RNNTanh")],
        "AnnotatedConvModel": engine, "AnnotatedConvTransposeModel": engine,
        "AnnotatedNestedModel": engine, "AnnotatedSkipQuantModel": engine,
        "ManualLinearQATModel": engine, "ManualDropoutQATModel": engine,
        "ModelForFusion": [("default_qconfig", (default_qconfig,), {})],
        # SparseNNModel's sizes
        "DenseTopMLP": [("4,2,5,2,2", (4, 2, 5, 2, 2), {})],
        "EmbBagWrapper": [("10,5", (10, 5), {})],
        "TestHelperModules.ConvWithBNRelu": [(f"dim={d}", (True,), {"dim": d})
                                             for d in (1, 2, 3)],
        "TestHelperModules.ConvTWithBNRelu": [(f"dim={d}", (True,), {"dim": d})
                                              for d in (1, 2)],
    }


def _bag(n: int, last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    offsets = [0, 4, 8] if last else [0, 4]
    return torch.randint(n, (8,), generator=g), torch.tensor(offsets)


def _inputs_table() -> dict[str, Callable[[nn.Module], tuple[Any, ...]]]:
    """Models with several inputs whose shapes the rule cannot guess."""
    r = torch.randn
    return {
        "LSTMwithHiddenDynamicModel": lambda m: (r(3, 2, 2), (r(1, 2, 2), r(1, 2, 2))),
        "DenseTopMLP(4,2,5,2,2)": lambda m: (r(2, 5), r(2, 4)),
        "EmbBagWrapper(10,5)": lambda m: _bag(10),
        "SparseNNModel": lambda m: (*_bag(10), r(2, 4)),
        "EmbeddingWithStaticLinear": lambda m: (*_bag(10), r(2, 4)),
        "ManualEmbeddingBagLinear": lambda m: _bag(10),
        "EmbeddingBagModule": lambda m: (*_bag(10, last=True), torch.rand(8)),
        "TestHelperModules.Conv2dWithTwoCat": lambda m: (r(1, 3, 5, 5), r(1, 3, 5, 5),
                                                         r(1, 6, 3, 3), r(1, 6, 3, 3)),
        # the rule's guess does not fit the reshape / squeeze after the first layer
        "ManualConvLinearQATModel": lambda m: (r(2, 3, 10, 10),),
        "ManualConvLinearSymmQATModel": lambda m: (r(2, 3, 10, 10),),
        "ModelForFusion(default_qconfig)": lambda m: (r(2, 3, 1, 10),),
        "ModelWithSequentialFusion": lambda m: (r(2, 3, 10, 10),),
        "ModelWithFunctionals": lambda m: (r(4, 4),),
        "TestHelperModules.Conv2dWithTwoLinear": lambda m: (r(2, 3, 4, 4),),
        # its own inputs are one sample, which BatchNorm1d cannot train on (QAT)
        "LinearBnLeakyReluModel": lambda m: (r(2, 5),),
    }


def _weighted(m: nn.Module) -> tuple[str, Any] | None:
    """The kind of input the first weighted module ``m`` reads: (kind, size)."""
    if isinstance(m, nn.Linear):
        return "features", m.in_features
    if isinstance(m, nn.modules.conv._ConvNd):
        return f"conv{len(m.kernel_size)}", m.in_channels
    if isinstance(m, nn.EmbeddingBag):
        return "bag", (m.num_embeddings, m.include_last_offset)
    if isinstance(m, nn.Embedding):
        return "indices", m.num_embeddings
    if isinstance(m, nn.RNNBase):
        return "sequence", (m.input_size, m.batch_first)
    if isinstance(m, nn.RNNCellBase):
        return "features", m.input_size
    w = vars(m).get("weight")
    if isinstance(w, torch.Tensor) and w.dim() in (2, 4):  # functional F.linear / F.conv2d
        return ("features", w.shape[1]) if w.dim() == 2 else ("conv2", w.shape[1])
    return None


def rule_inputs(model: nn.Module) -> tuple[Any, ...]:
    """Example inputs by the rule in the module docstring."""
    kind, size = next((k for k in map(_weighted, model.modules()) if k is not None),
                      ("conv2", 3))
    if kind == "features":
        first: tuple[Any, ...] = (torch.randn(2, size),)
    elif kind.startswith("conv"):
        first = (torch.randn(2, size, *[8] * int(kind[4:])),)
    elif kind == "indices":
        first = (torch.randint(size, (2, 4)),)
    elif kind == "bag":
        return _bag(size[0], last=size[1])
    else:  # sequence
        n, batch_first = size
        first = (torch.randn(2, 3, n) if batch_first else torch.randn(3, 2, n),)
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return first
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    like = first[0]
    more = [torch.randn_like(like) if like.is_floating_point() else like.clone()
            for _ in required[1:]]
    return (*first, *more)


def _own_inputs(m: nn.Module) -> tuple[tuple[Any, ...], str] | None:
    for attr in ("get_example_inputs", "example_inputs"):
        fn = getattr(m, attr, None)
        if callable(fn):
            try:
                return tuple(fn()), attr
            except Exception:  # a helper needing arguments: fall through to the rule
                continue
    return None


def catalogue(cq: Any | None = None) -> list[Case]:
    """Every model of the sweep, in the order torch defines them."""
    cq = cq if cq is not None else importlib.import_module(_SOURCE)
    variants, inputs = _variants(cq), _inputs_table()
    classes: dict[str, type] = {}

    def walk(ns: Any, prefix: str, depth: int) -> None:
        for name, c in vars(ns).items():
            if (inspect.isclass(c) and c.__module__ == _SOURCE
                    and c.__qualname__ == prefix + name):
                if issubclass(c, nn.Module) and c.__qualname__ not in _EXCLUDED:
                    classes[c.__qualname__] = c
                if depth < 1:
                    walk(c, prefix + name + ".", depth + 1)

    walk(cq, "", 0)
    cases = []
    for qualname, cls in classes.items():
        builds = [(f"{qualname}({label})", args, kwargs)
                  for label, args, kwargs in variants.get(qualname, [])]
        if not builds:
            try:
                inspect.signature(cls).bind()
            except TypeError:
                continue  # needs arguments nobody gave: not in the sweep
            builds = [(qualname, (), {})]
        for name, args, kwargs in builds:
            def build(cls: type = cls, args: tuple[Any, ...] = args,
                      kwargs: dict[str, Any] = kwargs) -> nn.Module:
                torch.manual_seed(0)
                return cls(*args, **kwargs)

            if name in inputs:
                make, source = inputs[name], "table"
            elif any(callable(getattr(cls, a, None))
                     for a in ("get_example_inputs", "example_inputs")):
                def make(m: nn.Module) -> tuple[Any, ...]:
                    own = _own_inputs(m)
                    return own[0] if own is not None else rule_inputs(m)
                source = next(a for a in ("get_example_inputs", "example_inputs")
                              if callable(getattr(cls, a, None)))
            else:
                make, source = rule_inputs, "rule"
            cases.append(Case(name, build, make, source))
    return cases


# -- measuring -------------------------------------------------------------------------


def _redraw(inputs: Any, g: torch.Generator) -> Any:
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return torch.randn(t.shape, generator=g, dtype=t.dtype)
        return t
    return torch.utils._pytree.tree_map(one, inputs)


def _floats(value: Any) -> list[torch.Tensor]:
    out = []
    for t in torch.utils._pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            t = t.dequantize() if t.is_quantized else t
            if t.is_floating_point():
                out.append(t.detach().float().flatten())
    return out


def rel_l2(out: Any, ref: Any) -> float | None:
    """``||out - ref|| / ||ref||`` over all float outputs (None when they do not line up).

    >>> import torch
    >>> rel_l2((torch.tensor([3.0, 4.0]),), (torch.tensor([3.0, 4.0]),))
    0.0
    """
    a, b = _floats(out), _floats(ref)
    if not a or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    x, y = torch.cat(a), torch.cat(b)
    return float((x - y).norm() / y.norm().clamp_min(1e-12))


def weight_tensors(model: nn.Module) -> dict[str, int]:
    """Qualified name -> element count of the model's weights: its float parameters and
    the plain float tensor attributes of its modules (functional layers' weights)."""
    out = {n: p.numel() for n, p in model.named_parameters() if p.is_floating_point()}
    for mname, m in model.named_modules():
        for attr, v in vars(m).items():
            if (isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
                    and v.is_floating_point() and not attr.startswith("_")):
                out[f"{mname}.{attr}" if mname else attr] = v.numel()
    return out


def _qcompile_fraction(gm: nn.Module, weights: dict[str, int]) -> float | None:
    total = sum(weights.values())
    if not total:
        return None
    names = set(qc.quantizers(gm))
    hit = sum(n for w, n in weights.items() if f"{w}_fake_quant" in names)
    return hit / total


def _ao_fraction(converted: nn.Module, weights: dict[str, int]) -> float | None:
    total = sum(weights.values())
    if not total:
        return None
    seen: set[int] = set()
    count = 0

    def visit(v: Any) -> None:
        nonlocal count
        if isinstance(v, torch.Tensor):
            if v.is_quantized:
                count += v.numel()
        elif isinstance(v, (tuple, list)):
            for x in v:
                visit(x)
        elif isinstance(v, torch.ScriptObject) and id(v) not in seen:
            seen.add(id(v))
            with contextlib.suppress(Exception):  # a packed object that does not unpack
                visit(v.__getstate__())

    for m in converted.modules():  # quantized weights live packed in script objects
        for v in (*vars(m).values(), *m._parameters.values(), *m._buffers.values()):
            if isinstance(v, torch.ScriptObject | torch.Tensor):
                visit(v)
    return min(count / total, 1.0)


def _error(stage: str, e: BaseException) -> str:
    lines = str(e).strip().splitlines() or [""]
    first = lines[0]
    if "validation error" in first:  # pydantic: the field and the reason follow
        first = " ".join(line.strip() for line in lines[:3])
    return f"{stage}: {type(e).__name__}: {first}"[:300]


def _row() -> dict[str, Any]:
    return {"compiled": False, "converted": False, "quantized": None,
            "fake_quant_rel_l2": None, "converted_rel_l2": None, "error": None}


def _run(m: nn.Module, batch: tuple[Any, ...]) -> Any:
    with torch.no_grad():
        return m(*batch)


def run_qcompile(model: nn.Module, preset: str, batches: list[tuple[Any, ...]],
                 test: tuple[Any, ...], ref: Any) -> dict[str, Any]:
    """One qcompile row: compile with ``preset``, train / calibrate, fake-quant output,
    ``qc.convert`` output (see the module docstring)."""
    row, stage = _row(), "compile"
    try:
        m = copy.deepcopy(model).train(preset == "int8-qat")
        gm = qc.qcompile(m, preset, example_inputs=batches[0])
        row["quantized"] = _qcompile_fraction(gm, weight_tensors(model))
        if preset == "int8-qat":
            stage = "train"
            gm.train()
            for b in batches:
                _run(gm, b)
            qc.freeze(gm)
        elif preset == "int8-static":
            stage = "calibrate"
            qc.calibrate(gm, batches, progress=False)
        else:
            stage = "run"
            _run(gm.eval(), batches[0])
        row["compiled"] = True
        stage = "fake-quant run"
        row["fake_quant_rel_l2"] = rel_l2(_run(gm.eval(), test), ref)
        stage = "convert"
        int8 = qc.convert(gm)
        stage = "converted run"
        row["converted_rel_l2"] = rel_l2(_run(int8, test), ref)
        row["converted"] = True
    except Exception as e:
        row["error"] = _error(stage, e)
    return row


def run_torch_ao(model: nn.Module, preset: str, batches: list[tuple[Any, ...]],
                 test: tuple[Any, ...], ref: Any) -> dict[str, Any]:
    """The torch.ao row for ``preset`` (FX graph mode; ``quantize_dynamic`` for dynamic)."""
    from torch.ao.quantization import (
        get_default_qat_qconfig_mapping,
        get_default_qconfig_mapping,
        quantize_dynamic,
    )
    from torch.ao.quantization.quantize_fx import (
        convert_fx,
        convert_to_reference_fx,
        prepare_fx,
        prepare_qat_fx,
    )

    row, stage = _row(), "prepare"
    weights = weight_tensors(model)
    try:
        m = copy.deepcopy(model)
        if preset == "int8-dynamic":
            stage = "quantize_dynamic"
            int8 = quantize_dynamic(m.eval())
            _run(int8, batches[0])
            row["compiled"] = True
        else:
            if preset == "int8-qat":
                p = prepare_qat_fx(m.train(), get_default_qat_qconfig_mapping("x86"),
                                   batches[0])
            else:
                p = prepare_fx(m.eval(), get_default_qconfig_mapping("x86"), batches[0])
            stage = "train" if preset == "int8-qat" else "calibrate"
            for b in batches:
                _run(p, b)
            row["compiled"] = True
            p.eval()
            stage = "fake-quant run"
            if preset == "int8-qat":
                fq = _run(p, test)
            else:
                stage = "convert_to_reference_fx"
                fq = _run(convert_to_reference_fx(copy.deepcopy(p)), test)
            row["fake_quant_rel_l2"] = rel_l2(fq, ref)
            stage = "convert_fx"
            int8 = convert_fx(p)
        stage = "converted run"
        row["converted_rel_l2"] = rel_l2(_run(int8, test), ref)
        row["converted"] = True
        row["quantized"] = _ao_fraction(int8, weights)
    except Exception as e:
        row["error"] = _error(stage, e)
    return row


def _reference(model: nn.Module, preset: str, batches: list[tuple[Any, ...]],
               test: tuple[Any, ...]) -> Any:
    m = copy.deepcopy(model)
    if preset == "int8-qat":  # the same train-mode forwards as the QAT graphs
        m.train()
        for b in batches:
            _run(m, b)
    return _run(m.eval(), test)


def layer_kinds(model: nn.Module) -> str:
    """The weighted layer classes of ``model`` (and ``functional`` for a plain tensor
    weight), comma-separated, in first-seen order; ``-`` when it has no weights."""
    kinds: list[str] = []
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            kinds.append(type(m).__name__)
        elif _weighted(m) is not None and not list(m.children()):
            kinds.append(f"functional({type(m).__name__})")
    return ",".join(dict.fromkeys(kinds)) or "-"


def measure_case(case: Case, quick: bool = False) -> list[dict[str, Any]]:
    """The rows of one model: one per preset, qcompile and torch.ao side by side."""
    base = {"model": case.name, "inputs": case.source}
    try:
        model = case.build()
        torch.manual_seed(1)
        example = case.inputs(model)
        g = torch.Generator().manual_seed(2)
        batches = [example] + [_redraw(example, g) for _ in range(1 if quick else 7)]
        test = _redraw(example, g)
        model.eval()
        _run(copy.deepcopy(model), example)
    except Exception as e:
        return [{**base, "preset": p, "kinds": "?", "fp32_error": _error("fp32 run", e)}
                for p in PRESETS]
    base["kinds"] = layer_kinds(model)
    rows = []
    for preset in PRESETS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                ref = _reference(model, preset, batches, test)
            except Exception as e:
                rows.append({**base, "preset": preset, "fp32_error": _error("fp32 run", e)})
                continue
            rows.append({**base, "preset": preset,
                         "qcompile": run_qcompile(model, preset, batches, test, ref),
                         "torch_ao": run_torch_ao(model, preset, batches, test, ref)})
    return rows


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per preset and side: models compiled / converted (/ converted with some weight
    stored as integers), median rel-L2 (fake-quant and
    converted) and median quantized fraction; and the medians over the models both sides
    converted (the like-for-like comparison)."""
    out: dict[str, Any] = {}
    for preset in PRESETS:
        mine = [r for r in rows if r["preset"] == preset and "qcompile" in r]
        entry: dict[str, Any] = {"models": len(mine)}
        for side in SIDES:
            cells = [r[side] for r in mine]
            entry[side] = {
                "compiled": sum(c["compiled"] for c in cells),
                "converted": sum(c["converted"] for c in cells),
                # converted with some weight integer (a conversion that kept every weight
                # float also counts as converted)
                "converted_int8_weights": sum(c["converted"] and bool(c["quantized"])
                                              for c in cells),
                "median_fake_quant_rel_l2": _median([c["fake_quant_rel_l2"] for c in cells]),
                "median_converted_rel_l2": _median([c["converted_rel_l2"] for c in cells]),
                "median_quantized": _median([c["quantized"] for c in cells
                                             if c["converted"]]),
            }
        both = [r for r in mine if r["qcompile"]["converted"] and r["torch_ao"]["converted"]]
        entry["both_converted"] = len(both)
        entry["both_median_converted_rel_l2"] = {
            side: _median([r[side]["converted_rel_l2"] for r in both]) for side in SIDES}
        out[preset] = entry
    return out


def bench_torch_models(quick: bool) -> dict[str, Any]:
    """The sweep: every model of ``catalogue()`` (``quick``: eight of them, one per layer
    family, and fewer batches) under the three presets, qcompile and torch.ao."""
    try:
        cq = importlib.import_module(_SOURCE)
    except ImportError as e:
        return {"note": f"torch's quantization test models need {e.name or 'a module'}: "
                        "pip install expecttest"}
    cases = catalogue(cq)
    if quick:
        cases = [c for c in cases if c.name in _QUICK]
    with contextlib.redirect_stderr(io.StringIO()):  # torch.fx prints failing graph lines
        rows = [r for c in cases for r in measure_case(c, quick)]
    return {"models": len(cases), "summary": summarize(rows), "rows": rows}


# -- text ------------------------------------------------------------------------------


def _g(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def torch_models_text(data: dict[str, Any]) -> str:
    """The summary table (per preset and side), the per-model table and the failures."""
    if "note" in data:
        return data["note"]
    lines = [f"{data['models']} models of {_SOURCE}", ""]
    summary = []
    for preset, e in data["summary"].items():
        for side in SIDES:
            s = e[side]
            summary.append({"preset": preset, "side": side, "models": e["models"],
                            "compiled": s["compiled"], "converted": s["converted"],
                            "int8_weights": s["converted_int8_weights"],
                            "median_fq_rel_l2": _g(s["median_fake_quant_rel_l2"]),
                            "median_int8_rel_l2": _g(s["median_converted_rel_l2"]),
                            "median_quantized": _g(s["median_quantized"]),
                            "both_converted": e["both_converted"],
                            "both_median_int8_rel_l2":
                                _g(e["both_median_converted_rel_l2"][side])})
    lines.append(table(summary, list(summary[0])))
    lines.append("")
    per_model, failures = [], []
    for r in data["rows"]:
        if "fp32_error" in r:
            failures.append(f"{r['model']} [{r['preset']}] {r['fp32_error']}")
            continue
        cell = {"model": r["model"], "preset": r["preset"].removeprefix("int8-")}
        for side, short in (("qcompile", "qc"), ("torch_ao", "ao")):
            c = r[side]
            cell[f"{short}_conv"] = "ok" if c["converted"] else (
                "compiled" if c["compiled"] else "no")
            cell[f"{short}_quant"] = _g(c["quantized"])
            cell[f"{short}_fq"] = _g(c["fake_quant_rel_l2"])
            cell[f"{short}_int8"] = _g(c["converted_rel_l2"])
            if c["error"]:
                failures.append(f"{r['model']} [{r['preset']}] {side}: {c['error']}")
        per_model.append(cell)
    if per_model:
        lines.append(table(per_model, list(per_model[0])))
    lines += ["", f"failures ({len(failures)}):", *failures]
    return "\n".join(lines)
