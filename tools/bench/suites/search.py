"""The ``search`` suite: what ``qc.search`` buys, measured after compiling what it chose.

Two models, each quantized weight-only (round-to-nearest PTQ as ``qcompile-bench llm``
does it: ``mode: dynamic``, rules with a weight scheme only, ``target: generic``):

- ``LM``: ``qcompile-bench llm``'s dense character LM (``llm.DENSE``, weights cached by
  ``qcompile.tools.bench.lm``); every Linear but the head searched; metric validation
  perplexity (lower is better). Candidates: int4 in groups of 32 (asymmetric, the ``llm``
  suite's ``int4 wo``) and int8 per channel.
- ``CNN``: the digits CNN of ``qcompile.tools.accuracy`` (fp32-trained as there); every
  Conv2d and Linear searched; metric test accuracy in % (higher is better). Candidates:
  int4 per channel (its convolutions' rows, 9 and 144 elements, take no groups of 32)
  and int8 per channel.

Rows: uniform int4 and uniform int8 (each candidate on every searched layer), then the
searched mix at 4.5 and 5.0 average weight bits for each metric (``sqnr`` and ``fisher``;
``loss`` too on the CNN, where it is cheap), each compiled from the spec ``qc.search``
returned and evaluated. ``gap closed`` is ``(int4 - mix) / (int4 - int8)`` of the metric
(``n/a`` where int4 and int8 differ by less than ``MIN_GAP``; on the CNN also of its test
loss, ``n/a`` within 2%). ``search / calibration`` is a search's seconds (the faster of
the budgets' searches, each a whole search) over one calibration pass per candidate: for
each candidate, compile its uniform spec in ``static`` mode and ``qc.calibrate`` it on the
same batches, summed over the candidates. ``fisher / loss`` (CNN) is the fisher search's
seconds over the loss search's.

Files (in ``$QCOMPILE_BENCH_OUT``, default ``./qcompile-bench-search``), per model and
metric: ``<model>-<metric>.details.json`` (the 4.5-bit search's ``SearchDetails``) and
``<model>-<metric>.measured.json`` (average weight bits -> the measured metric, for uniform
int4, each searched budget and uniform int8), so that
``qcompile-inspect search LM-sqnr.details.json --measured LM-sqnr.measured.json --plot
lm.svg`` draws the predicted and measured Pareto curves.

Example (the specs the suite compiles):
    >>> from qcompile.tools.bench.suites.search import CASES, search_spec, uniform_spec
    >>> s = search_spec(CASES["LM"], "fisher", 4.5)
    >>> s.quant.search.metric, s.quant.search.budget.value, s.quant.rules[0].skip
    ('fisher', 4.5, True)
    >>> uniform_spec(CASES["CNN"], 0).quant.rules[0].weight.dtype
    'int4'
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.files import write_atomically

BUDGETS = (4.5, 5.0)
MIN_GAP = {"LM": 1e-3, "CNN": 0.5}  # metric units: below this int4 and int8 tie
SECONDARY_MIN_GAP = 0.02  # the CNN's test loss: int4 and int8 within 2% tie
OUT_ENV = "QCOMPILE_BENCH_OUT"


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """What a model's specs quantize: the rules before the searched one (skips), the
    modules searched, the candidates (weight schemes) and the metrics searched with."""

    skips: tuple[dict[str, Any], ...]
    modules: tuple[str, ...]
    candidates: tuple[dict[str, Any], ...]
    metrics: tuple[str, ...]
    metric_name: str
    higher_is_better: bool


CASES = {
    "LM": CaseSpec(
        skips=({"match": {"name": "head"}, "skip": True},), modules=("Linear",),
        candidates=({"dtype": "int4", "symmetric": False, "granularity": "per_group",
                     "group_size": 32},
                    {"dtype": "int8", "granularity": "per_channel"}),
        metrics=("sqnr", "fisher"), metric_name="validation perplexity",
        higher_is_better=False),
    "CNN": CaseSpec(
        skips=(), modules=("Conv2d", "Linear"),
        candidates=({"dtype": "int4", "granularity": "per_channel"},
                    {"dtype": "int8", "granularity": "per_channel"}),
        metrics=("sqnr", "fisher", "loss"), metric_name="test accuracy %",
        higher_is_better=True),
}


def _spec(case: CaseSpec, weight: dict[str, Any], mode: str = "dynamic",
          search: dict[str, Any] | None = None) -> qc.CompileSpec:
    quant: dict[str, Any] = {"mode": mode, "target": "generic", "rules": [
        *case.skips, {"match": {"module": list(case.modules)}, "weight": weight}]}
    if search is not None:
        quant["search"] = search
    return qc.CompileSpec.model_validate({"version": 1, "quant": quant})


def uniform_spec(case: CaseSpec, candidate: int, mode: str = "dynamic") -> qc.CompileSpec:
    """Candidate ``candidate`` on every searched layer."""
    return _spec(case, case.candidates[candidate], mode)


def search_spec(case: CaseSpec, metric: str, bits: float,
                granularity: str = "layer") -> qc.CompileSpec:
    """The spec ``qc.search`` takes: the searched rule (its weight scheme only marks the
    layers searched) and ``quant.search`` with the case's candidates."""
    return _spec(case, case.candidates[-1], search={
        "candidates": [{"weight": w} for w in case.candidates],
        "budget": {"avg_weight_bits": bits}, "metric": metric, "granularity": granularity})


# -- models ------------------------------------------------------------------------------

@dataclasses.dataclass
class Model:
    """A trained model, its search batches (model inputs), its evaluation and loss."""

    name: str
    model: nn.Module
    batches: list[tuple[torch.Tensor, ...]]
    evaluate: Callable[[nn.Module], float]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    example: tuple[torch.Tensor, ...]
    info: dict[str, Any]
    # a second, finer measure (name, model -> value; lower is better): the CNN's test loss
    secondary: tuple[str, Callable[[nn.Module], float]] | None = None

    def measure(self, m: nn.Module) -> dict[str, float]:
        out = {"value": self.evaluate(m)}
        if self.secondary is not None:
            out[self.secondary[0]] = self.secondary[1](m)
        return out


def lm_model(quick: bool, n_batches: int) -> Model:
    import qcompile.tools.bench.lm as lm
    from qcompile.tools.bench.suites.llm import DENSE, QUICK_DENSE, english_train_ids

    cfg = QUICK_DENSE if quick else DENSE
    data = lm.load_text(cfg)
    model, info = lm.trained(cfg, data)
    tune = english_train_ids(cfg, data)
    batch = 4 if quick else 16
    batches = [(b,) for b in lm.batches(tune, cfg.context, batch, n_batches, cfg.seed + 2)]

    def evaluate(m: nn.Module) -> float:
        return lm.perplexity(m, data.val, cfg.context, batch=64)

    def loss_fn(out: torch.Tensor, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = b[0]  # next-character prediction on the batch itself
        return F.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    return Model("LM", model, batches, evaluate, loss_fn, batches[0], {
        "params": sum(p.numel() for p in model.parameters()), "cached": info["cached"],
        "config": dataclasses.asdict(cfg), "batch": [batch, cfg.context],
        "val_tokens": (len(data.val) - 1) // cfg.context * cfg.context})


class LabelledCNN(nn.Module):
    """The digits CNN taking the labels as a second (unused) input, so a search batch
    ``(images, labels)`` holds what the loss needs; evaluation calls it with images only."""

    def __init__(self, cnn: nn.Module) -> None:
        super().__init__()
        self.cnn = cnn

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.cnn(x)


def cnn_model(quick: bool, n_batches: int) -> Model:
    from qcompile.tools.accuracy import Settings, data, train_fp32
    from qcompile.tools.quickstart import accuracy

    settings = Settings(fp32_epochs={"CNN": 1 if quick else 8, "MLP": 1})
    t0 = time.perf_counter()
    model = LabelledCNN(train_fp32("CNN", settings)).eval()
    x, y, x_test, y_test = data(settings.seed)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(settings.seed + 2))
    b = 64
    batches = [(x[perm[i * b:(i + 1) * b]], y[perm[i * b:(i + 1) * b]])
               for i in range(n_batches)]

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad():
            return 100 * accuracy(m.eval(), x_test, y_test)

    def test_loss(m: nn.Module) -> float:
        with torch.no_grad():
            return F.cross_entropy(m.eval()(x_test), y_test).item()

    def loss_fn(out: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.cross_entropy(out, batch[1])

    return Model("CNN", model, batches, evaluate, loss_fn, batches[0], {
        "params": sum(p.numel() for p in model.parameters()),
        "train_s": time.perf_counter() - t0, "epochs": settings.fp32_epochs["CNN"],
        "test_images": len(x_test), "batch": b}, secondary=("test_loss", test_loss))


# -- measuring ---------------------------------------------------------------------------

def gap_closed(int4: float, int8: float, mix: float, min_gap: float) -> float | None:
    """Share of the int4 -> int8 gap the mix closes (None: int4 and int8 tie).

    >>> gap_closed(6.0, 5.0, 5.4, 1e-3), gap_closed(90.0, 92.0, 91.5, 0.5)
    (0.6, 0.75)
    >>> gap_closed(90.0, 90.2, 90.1, 0.5) is None
    True
    """
    if abs(int4 - int8) < min_gap:
        return None
    return round((int4 - mix) / (int4 - int8), 12)


def calibration_pass_s(m: Model, case: CaseSpec) -> list[float]:
    """Seconds of one calibration pass per candidate: compile its uniform spec in static
    mode and ``qc.calibrate`` it on the search's batches."""
    out = []
    for i in range(len(case.candidates)):
        t = time.perf_counter()
        gm = qc.qcompile(m.model, uniform_spec(case, i, "static"), example_inputs=m.example)
        qc.calibrate(gm, m.batches, progress=False)
        out.append(time.perf_counter() - t)
    return out


def _log(model: str, what: str, value: float, seconds: float) -> None:
    print(f"search | {model} | {what}: {value:.4f} ({seconds:.1f} s)", file=sys.stderr)


def run_model(m: Model, case: CaseSpec, budgets: tuple[float, ...], metrics: tuple[str, ...],
              out_dir: Path) -> dict[str, Any]:
    """Uniform int4 / int8, then every metric x budget: search, compile, evaluate."""
    t0 = time.perf_counter()
    snapshot = copy.deepcopy(m.model.state_dict())
    out: dict[str, Any] = {"metric": case.metric_name, "higher_is_better": case.higher_is_better,
                           "info": m.info, "batches": len(m.batches)}
    t = time.perf_counter()
    out["fp32"] = m.measure(m.model)
    _log(m.name, "fp32", out["fp32"]["value"], time.perf_counter() - t)
    labels = [_label(w) for w in case.candidates]
    uniform = {}
    for i, label in enumerate(labels):
        t = time.perf_counter()
        gm = qc.qcompile(m.model, uniform_spec(case, i), example_inputs=m.example)
        uniform[label] = {**m.measure(gm), "s": time.perf_counter() - t}
        _log(m.name, f"uniform {label}", uniform[label]["value"], uniform[label]["s"])
    out["uniform"] = uniform
    int4, int8 = uniform[labels[0]], uniform[labels[-1]]
    calib = calibration_pass_s(m, case)
    out["calibration_pass_s"] = dict(zip(labels, calib))
    searched: dict[str, dict[str, Any]] = {}
    files: dict[str, str] = {}
    for metric in metrics:
        rows: dict[str, Any] = {}
        measured: dict[str, float] = {}
        for bits in budgets:
            t = time.perf_counter()
            found, details = qc.search(m.model, search_spec(case, metric, bits), m.batches,
                                       example_inputs=m.example,
                                       loss_fn=m.loss_fn if metric != "sqnr" else None,
                                       details=True)
            search_s = time.perf_counter() - t
            t = time.perf_counter()
            gm = qc.qcompile(m.model, found, example_inputs=m.example)
            row: dict[str, Any] = m.measure(gm)
            row["gap_closed"] = gap_closed(int4["value"], int8["value"], row["value"],
                                           MIN_GAP[m.name])
            if m.secondary is not None:
                key = m.secondary[0]
                row[f"gap_closed_{key}"] = gap_closed(int4[key], int8[key], row[key],
                                                      SECONDARY_MIN_GAP * abs(int8[key]))
            counts = [sum(1 for c in details.chosen.values() if c == i)
                      for i in range(len(labels))]
            row.update(avg_weight_bits=details.avg_weight_bits,
                       weight_bytes=details.weight_bytes,
                       predicted_error=details.predicted_error,
                       groups_per_candidate=dict(zip(labels, counts)), search_s=search_s,
                       search_timings=details.seconds, eval_s=time.perf_counter() - t)
            rows[f"{bits:g}"] = row
            measured[f"{details.avg_weight_bits:.6g}"] = row["value"]
            _log(m.name, f"{metric} {bits:g} bits ({details.avg_weight_bits:.3f})",
                 row["value"], search_s)
            if bits == budgets[0]:  # its Pareto front spans all budgets
                path = out_dir / f"{m.name}-{metric}.details.json"
                write_atomically(path, details.model_dump_json(indent=1))
                files[f"{metric} details"] = str(path)
        # uniform int4 and int8: the ends of the front, at their candidates' bits
        ends = {f"{details.bits[0]:g}": int4["value"], f"{details.bits[-1]:g}": int8["value"]}
        path = out_dir / f"{m.name}-{metric}.measured.json"
        write_atomically(path, json.dumps({"metric": case.metric_name,
                                           "values": {**ends, **measured}}, indent=1))
        files[f"{metric} measured"] = str(path)
        best = min(row["search_s"] for row in rows.values())  # each budget: a whole search
        searched[metric] = {"budgets": rows, "search_s": best,
                            "search_vs_calibration": best / sum(calib)}
    out["searched"] = searched
    if "fisher" in searched and "loss" in searched:
        out["fisher_vs_loss"] = searched["fisher"]["search_s"] / searched["loss"]["search_s"]
    after = m.model.state_dict()  # the searches and compiles left the model alone
    out["model_unchanged"] = all(torch.equal(after[k], v) for k, v in snapshot.items())
    out["files"] = files
    out["seconds"] = time.perf_counter() - t0
    return out


def _label(weight: dict[str, Any]) -> str:
    from qcompile.specs.quant import Candidate

    return Candidate.model_validate({"weight": weight}).label()


def out_dir() -> Path:
    path = Path(os.environ.get(OUT_ENV, "qcompile-bench-search"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def bench_search(quick: bool) -> dict[str, Any]:
    """Uniform int4 / int8 and the searched mixes on the LM and the digits CNN."""
    from qcompile.tools.accuracy import threads

    budgets = BUDGETS
    n_batches = 2 if quick else 8
    folder = out_dir()
    t0 = time.perf_counter()
    out: dict[str, Any] = {"torch": torch.__version__, "budgets": list(budgets)}
    # one intra-op thread, as the algorithms suite: small models on a shared machine
    with warnings.catch_warnings(), threads(1):
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        out["threads"] = torch.get_num_threads()
        for name, build in (("LM", lm_model), ("CNN", cnn_model)):
            case = CASES[name]
            out[name] = run_model(build(quick, n_batches), case, budgets, case.metrics, folder)
    out["out_dir"] = str(folder)
    out["seconds"] = time.perf_counter() - t0
    return out


# -- text ---------------------------------------------------------------------------------

def _num(v: float | None, fmt: str = ".3f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _share(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def model_table(name: str, r: dict[str, Any]) -> str:
    """Markdown: columns uniform int4, each metric x budget, uniform int8."""
    labels = list(r["uniform"])
    cols = [(f"uniform {labels[0]}", r["uniform"][labels[0]], None)]
    for metric, s in r["searched"].items():
        for bits, row in s["budgets"].items():
            cols.append((f"{metric} @{bits}", row, metric))
    cols.append((f"uniform {labels[-1]}", r["uniform"][labels[-1]], None))
    head = f"{name} ({r['info']['params'] / 1e6:.2f} M params), {r['metric']}"
    lines = [f"| {head} | " + " | ".join(c[0] for c in cols) + " |",
             "|---|" + "--:|" * len(cols)]
    bits = {labels[0]: labels[0].split("/")[0], labels[-1]: labels[-1].split("/")[0]}

    def line(label: str, cell: Callable[[str, dict[str, Any], str | None], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(*c) for c in cols) + " |")

    line(r["metric"], lambda _h, row, _m: _num(row["value"]))
    if "test_loss" in r["fp32"]:
        line("test loss", lambda _h, row, _m: _num(row["test_loss"], ".4f"))
    line("avg weight bits", lambda h, row, m: _num(row["avg_weight_bits"]) if m
         else bits[h.removeprefix("uniform ")])
    line("gap int4 -> int8 closed", lambda _h, row, m: _share(row["gap_closed"]) if m else "")
    if "test_loss" in r["fp32"]:
        line("loss gap closed", lambda _h, row, m: _share(row["gap_closed_test_loss"]) if m
             else "")
    line("groups int4 / int8", lambda _h, row, m: " / ".join(
        str(v) for v in row["groups_per_candidate"].values()) if m else "")
    line("search s", lambda _h, row, m: f"{row['search_s']:.1f}" if m else "")
    return "\n".join(lines)


def search_text(result: dict[str, Any]) -> str:
    parts = []
    for name in ("LM", "CNN"):
        r = result[name]
        parts.append(model_table(name, r))
        calib = sum(r["calibration_pass_s"].values())
        cost = "; ".join(f"{metric} {s['search_s']:.1f} s = {s['search_vs_calibration']:.2f}x"
                         for metric, s in r["searched"].items())
        cost = f"(best of {len(result['budgets'])}, / calibration) {cost}"
        extra = (f"; fisher / loss search time {r['fisher_vs_loss']:.2f}x"
                 if "fisher_vs_loss" in r else "")
        parts.append(f"{name}: fp32 {r['fp32']['value']:.3f}; search on {r['batches']} "
                     f"batches; one calibration pass per candidate {calib:.1f} s in all; "
                     f"search: {cost}"
                     f"{extra}; model unchanged: {'yes' if r['model_unchanged'] else 'NO'}; "
                     f"{r['seconds']:.0f} s.")
    parts.append(f"files in {result['out_dir']} (qcompile-inspect search DETAILS --measured "
                 f"MEASURED --plot FILE.svg); torch {result['torch']}, {result['threads']} "
                 f"thread(s), {result['seconds']:.0f} s in all.")
    return "\n\n".join(parts)
