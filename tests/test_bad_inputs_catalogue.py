"""A catalogue of bad and unusual inputs across the public API (DESIGN.md) and both CLIs.

Each case of the table asserts, with the shared harness (``bad_inputs_harness``):

- the error class (``qc.QCompileError``, or pydantic's ``ValidationError`` for spec content);
- that the message names what is wrong (the spec field, node, input, file or argument) and
  that ``QCompileError.fix`` says the fix;
- that nothing changed: the model's state, training flags and structure, the example
  inputs, and every graph the case built before the call (code, state, quantizer flags);
- that nothing was written: a case writes its bad input files under ``tmp/in``; after the
  refused call no other file exists under ``tmp`` (no output, no temporary).

Compiled graphs are shared: each is compiled once per module (``graphs`` fixture) and
every case gets its own deep copy. Cases marked ``xfail(strict=True)`` are mistakes that
still give a raw traceback, a silent wrong result or a message without the fix, in files
owned elsewhere; the reason says what happens now. The CLI cases run ``main(argv)`` of
``qcompile-inspect`` / ``qcompile-bench`` and assert the exit code, the message and its
``fix:`` line, no traceback and no file written.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
import torch.nn.functional as F
from bad_inputs_harness import (
    MLP,
    Case,
    World,
    X,
    assert_unchanged,
    case_table,
    message_ok,
    spec_dict,
)
from torch import nn

import qcompile as qc

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")

CASES: list[Case] = []
case = case_table(CASES)


def xfail(reason: str) -> Callable[[Callable], Callable]:
    """Mark a case (below its ``@case``) as a known open bug: ``reason`` says what happens
    now and whose file it is."""
    def mark(run: Callable) -> Callable:
        run.xfail_reason = reason  # type: ignore[attr-defined]
        return run
    return mark


def _reason(c: Case) -> str | None:
    return getattr(c.run, "xfail_reason", None)


def S(raw: dict[str, Any]) -> qc.CompileSpec:
    return qc.CompileSpec.model_validate(raw)


def _in(w: World, name: str, data: str | bytes) -> Path:
    """A bad input file the case writes (under tmp/in: not counted as written)."""
    folder = w.tmp / "in"
    folder.mkdir(exist_ok=True)
    path = folder / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


def _out(w: World, name: str) -> Path:
    return w.tmp / name


# -- the shared graphs ----------------------------------------------------------------------------
@dataclass
class SharedWorld(World):
    """``World`` whose graphs are deep copies of graphs compiled once per module."""

    cache: dict[Any, nn.Module] = field(default_factory=dict)
    factory: Any = None

    def graph(self, mode: str = "static", target: str = "x86", **top: Any) -> nn.Module:
        key = json.dumps([mode, target, top], sort_keys=True, default=str)
        if key not in self._graphs:
            shared = (self.factory, key)
            if shared not in self.cache:
                self.cache[shared] = qc.qcompile(copy.deepcopy(self.model),
                                                 S(spec_dict(mode, target, **top)),
                                                 example_inputs=self.inputs)
            self._graphs[key] = copy.deepcopy(self.cache[shared])
        return self._graphs[key]

    def calibrated(self) -> nn.Module:
        key = "calibrated"
        if key not in self._graphs:
            shared = (self.factory, key)
            if shared not in self.cache:
                gm = qc.qcompile(copy.deepcopy(self.model), S(spec_dict()),
                                 example_inputs=self.inputs)
                self.cache[shared] = qc.calibrate(gm, [self.inputs], progress=False)
            self._graphs[key] = copy.deepcopy(self.cache[shared])
        return self._graphs[key]


def written(tmp: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")
                  if p.relative_to(tmp).parts[0] != "in")


# -- spec content: pydantic names the field -------------------------------------------------------
def _act(observer: Any) -> dict[str, Any]:
    return {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"}, "activation": {
        "dtype": "uint8", "symmetric": False, "observer": observer}}]}}


def _weight(**scheme: Any) -> dict[str, Any]:
    return {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
                                                "weight": scheme}]}}


def _algorithm(**algo: Any) -> dict[str, Any]:
    return {"quant": {"mode": "static", "algorithms": [algo], "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}]}}


def _search(**search: Any) -> dict[str, Any]:
    return {"quant": {"mode": "static", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}], "search": search}}


INT4G8 = {"weight": {"dtype": "int4", "granularity": "per_group", "group_size": 8}}
SPEC_CASES = [
    ("a NaN momentum", _act({"kind": "moving_average", "momentum": float("nan")}),
     ("quant.rules.0.activation.observer.moving_average.momentum", "finite")),
    ("a momentum of 2", _act({"kind": "moving_average", "momentum": 2.0}),
     ("observer.moving_average.momentum", "less than or equal to 1")),
    ("a histogram of 0 bins", _act({"kind": "histogram", "bins": 0}),
     ("observer.histogram.bins", "16")),
    ("an mse search of 0 steps", _act({"kind": "mse", "steps": 0}),
     ("observer.mse.steps", "greater than or equal to 2")),
    ("smoothquant alpha 2", _algorithm(kind="smoothquant", alpha=2),
     ("quant.algorithms.0.smoothquant.alpha",)),
    ("a GPTQ block of 0 columns", _algorithm(kind="gptq", block_size=0),
     ("quant.algorithms.0.gptq.block_size",)),
    ("a LoRA rank of 0", {"adapters": [{"match": {"module": "Linear"}, "rank": 0}]},
     ("adapters.0.lora.rank",)),
    ("a LoRA dropout of 1", {"adapters": [{"match": {"module": "Linear"}, "rank": 2,
                                           "dropout": 1.0}]},
     ("adapters.0.lora.dropout", "less than 1")),
    ("a negative LoRA alpha", {"adapters": [{"match": {"module": "Linear"}, "rank": 2,
                                             "alpha": -1.0}]},
     ("adapters.0.lora.alpha",)),
    ("group_size 0", _weight(dtype="int4", granularity="per_group", group_size=0),
     ("quant.rules.0.weight.group_size",)),
    ("an odd NF4 block", _weight(dtype="nf4", group_size=7),
     ("quant.rules.0.weight", "even", "7")),
    ("learnable NF4 scales", _weight(dtype="nf4", learnable=True),
     ("quant.rules.0.weight", "learnable")),
    ("a budget of two kinds", _search(candidates=[INT4G8, {"weight": {"dtype": "int8"}}],
                                      budget={"avg_weight_bits": 4, "weight_bytes": 10}),
     ("quant.search.budget", "exactly one")),
    ("a search with one candidate", _search(candidates=[INT4G8],
                                            budget={"avg_weight_bits": 4}),
     ("quant.search.candidates", "at least 2")),
    ("a search under quant.mode none", {"quant": {"mode": "none", "search": {
        "candidates": [INT4G8, {"weight": {"dtype": "int8"}}],
        "budget": {"avg_weight_bits": 6}}}}, ("quant.search", "quant.mode is none")),
    ("a dynamic dim named with a space", {"trace": {"method": "export", "dynamic_dims": {
        "x": {0: "ba tch"}}}}, ("trace.dynamic_dims", "'ba tch'")),
    ("a dynamic dim with min > max", {"trace": {"method": "export", "dynamic_dims": {
        "x": {0: {"name": "b", "min": 8, "max": 2}}}}}, ("trace.dynamic_dims", "min 8 > max 2")),
    ("a trace input of dtype float128", {"trace": {"inputs": [{"shape": [2, 8],
                                                                "dtype": "float128"}]}},
     ("trace.inputs.0.dtype", "float128")),
    ("a trace input of negative size", {"trace": {"inputs": [{"shape": [-2, 8],
                                                               "dtype": "float32"}]}},
     ("trace.inputs.0.shape", "negative")),
    ("a pipeline stage holding no modules", {"pipeline": {"stages": [{"modules": []}]}},
     ("pipeline.stages", "modules")),
    ("three devices for two stages", {"pipeline": {"stages": 2,
                                                   "devices": ["cpu", "cpu", "cpu"]}},
     ("pipeline", "3 devices for 2 stages")),
    ("train.check_finite -1", {"train": {"check_finite": -1}}, ("train.check_finite",)),
    ("a cache_dir that is a number", {"cache_dir": 5}, ("cache_dir", "string")),
]
for _id, _raw, _names in SPEC_CASES:
    case(f"spec: {_id}", pydantic.ValidationError, _names)(
        lambda w, raw=_raw: qc.qcompile(w.model, S(raw), example_inputs=w.inputs))


# -- spec files and save_spec ---------------------------------------------------------------------
@case("load_spec of a binary file", qc.QCompileError, ("bin.yaml", "not UTF-8"), ("UTF-8",))
def _(w: World) -> Any:
    return qc.load_spec(_in(w, "bin.yaml", bytes(range(256))))


@case("load_spec of a Latin-1 file", qc.QCompileError, ("latin.yaml", "not UTF-8"),
      ("UTF-8",))
def _(w: World) -> Any:
    return qc.load_spec(_in(w, "latin.yaml", "quant: {mode: qat}\n# caf\xe9\n".encode("latin-1")))


@case("load_spec of a YAML list", qc.QCompileError, ("list.yaml", "mapping at the top level",
                                                     "list"), ("version: 1",))
def _(w: World) -> Any:
    return qc.load_spec(_in(w, "list.yaml", "- quant\n- mode\n"))


@case("load_spec of an unclosed flow mapping", qc.QCompileError, ("not valid yaml", "line 1"),
      ("syntax",))
def _(w: World) -> Any:
    return qc.load_spec(_in(w, "open.yaml", "quant: {mode: qat\n"))


@case("load_spec of a python/object tag (never executed)", qc.QCompileError,
      ("tag.yaml", "python/object/apply:os.system"), ("syntax",))
def _(w: World) -> Any:
    marker = w.tmp / "in" / "ran"
    try:
        return qc.load_spec(_in(w, "tag.yaml", "quant: !!python/object/apply:os.system "
                                f"['touch {marker}']\n"))
    finally:
        assert not marker.exists(), "the YAML tag ran code"


@case("load_spec of JSON with a trailing comma", qc.QCompileError,
      ("comma.json", "not valid json", "line 1 column 27"), ("syntax",))
def _(w: World) -> Any:
    return qc.load_spec(_in(w, "comma.json", '{"quant": {"mode": "qat"},}'))


@case("load_spec of JSON with a NaN momentum", pydantic.ValidationError,
      ("observer.moving_average.momentum", "finite"))
def _(w: World) -> Any:
    text = json.dumps(_act({"kind": "moving_average", "momentum": 0.1})).replace("0.1", "NaN")
    return qc.load_spec(_in(w, "nan.json", text))


@case("load_spec of a folder", qc.QCompileError, ("is a directory",), ("file inside it",))
def _(w: World) -> Any:
    return qc.load_spec(_in(w, "x", "").parent)


@case("load_spec of an empty string", qc.QCompileError, ("empty string",), ("preset name",))
def _(w: World) -> Any:
    return qc.load_spec("")


@case("load_spec of a number", qc.QCompileError, ("load_spec", "int"), ("int8-qat",))
def _(w: World) -> Any:
    return qc.load_spec(5)


@case("save_spec onto a folder", qc.QCompileError, ("save_spec", "is a folder"),
      ("file path",))
def _(w: World) -> Any:
    (w.tmp / "sub").mkdir()
    try:
        return qc.save_spec(qc.load_spec("int8-qat"), w.tmp / "sub")
    finally:
        (w.tmp / "sub").rmdir()  # the folder the case made: empty, as it was


@case("save_spec into a missing folder", qc.QCompileError, ("save_spec", "does not exist"),
      ("create it",))
def _(w: World) -> Any:
    return qc.save_spec(qc.load_spec("int8-qat"), w.tmp / "no" / "spec.yaml")


@case("save_spec of None", qc.QCompileError, ("save_spec takes a CompileSpec", "NoneType"),
      ("qc.load_spec",))
def _(w: World) -> Any:
    return qc.save_spec(None, _out(w, "spec.yaml"))


@case("save_spec of an invalid dict", pydantic.ValidationError, ("quant.mode", "'qatt'"))
def _(w: World) -> Any:
    return qc.save_spec({"quant": {"mode": "qatt"}}, _out(w, "spec.yaml"))


# -- qcompile -------------------------------------------------------------------------------------
class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0])


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


@case("example_kwargs as a list", qc.QCompileError, ("example_kwargs", "list"),
      ("example_kwargs=",))
def _(w: World) -> Any:
    return qc.qcompile(w.model, S(spec_dict()), example_kwargs=[X])


@case("compiling None", qc.QCompileError, ("qcompile takes an nn.Module", "NoneType"),
      ("model instance",))
def _(w: World) -> Any:
    return qc.qcompile(None, S(spec_dict()), example_inputs=w.inputs)


@case("compiling a function", qc.QCompileError, ("qcompile takes an nn.Module", "function"),
      ("model instance",))
def _(w: World) -> Any:
    return qc.qcompile(lambda x: x, S(spec_dict()), example_inputs=w.inputs)


@case("a numpy example input", qc.QCompileError, ("fc1", "ndarray"), ("shapes and dtypes",))
def _(w: World) -> Any:
    return qc.qcompile(w.model, S(spec_dict()), example_inputs=(w.inputs[0].numpy(),))


@case("a weight axis beyond the weight's dims", qc.QCompileError,
      ("fc1.weight", "quant.rules[0].weight", "axis 7", "[16, 8]"), ("skip rule",))
def _(w: World) -> Any:
    return qc.qcompile(w.model, S(_weight(dtype="int8", granularity="per_channel", axis=7)),
                       example_inputs=w.inputs)


@case("an activation axis beyond the output's dims", qc.QCompileError,
      ("'act'", "quant.rules[0].activation", "axis 5"), ("skip rule",))
def _(w: World) -> Any:
    return qc.qcompile(w.model, S({"quant": {"mode": "qat", "rules": [
        {"match": {"module": "Linear"}, "activation": {
            "dtype": "uint8", "granularity": "per_channel", "axis": 5}}]}}),
        example_inputs=w.inputs)


@case("the export front end with no example values", qc.QCompileError,
      ("torch.export failed", "'x'"), ("exportable",))
def _(w: World) -> Any:
    return qc.qcompile(w.model, S({"quant": {"mode": "none"}, "trace": {"method": "export"}}),
                       example_inputs=())


@case("a bare nn.LSTM as the model", qc.QCompileError,
      ("weight_ih_l0", "the model itself is a LSTM"), ("nn.Sequential(model)",),
      model=lambda: nn.LSTM(8, 8, batch_first=True))
def _(w: World) -> Any:
    return qc.qcompile(w.model, "int8-qat", example_inputs=(torch.randn(2, 3, 8),))


@case("a recurrent layer compiled on a sequence of length 0", qc.QCompileError,
      ("'rnn'", "float32[2, 0, 8]"), ("shapes",), model=LSTMNet)
def _(w: World) -> Any:
    return qc.qcompile(w.model, "int8-qat", example_inputs=(torch.randn(2, 0, 8),))


@case("a compiled recurrent layer run on a sequence of length 0", qc.QCompileError,
      ("rnn", "length 0", "float32[2, 0, 8]"), ("at least one step",), model=LSTMNet)
def _(w: World) -> Any:
    gm = qc.qcompile(w.model, "int8-qat", example_inputs=(torch.randn(2, 3, 8),))
    return gm(torch.randn(2, 0, 8))


@case("a compiled recurrent layer run on a 4-D input", qc.QCompileError,
      ("rnn", "float32[1, 2, 3, 8]"), ("[batch, seq, features]",), model=LSTMNet)
def _(w: World) -> Any:
    gm = qc.qcompile(w.model, "int8-qat", example_inputs=(torch.randn(2, 3, 8),))
    return gm(torch.randn(1, 2, 3, 8))


@case("adapters matching no layer", qc.QCompileError,
      ("adapters[0]", "Conv2d", "fc1, fc2"), ("optional: true",))
def _(w: World) -> Any:
    return qc.qcompile(w.model, S({"quant": {"mode": "none"}, "adapters": [
        {"match": {"module": "Conv2d"}, "rank": 2}]}), example_inputs=w.inputs)


@case("adapters on an Embedding", qc.QCompileError, ("adapters[0]", "emb", "matched no Linear"),
      ("correct the match",), model=Embedded)
def _(w: World) -> Any:
    return qc.qcompile(w.model, S({"quant": {"mode": "none"}, "adapters": [
        {"match": {"name": "emb"}, "rank": 2}]}), example_inputs=(torch.tensor([[1, 2]]),))


# -- report, quantizers, freeze, calibrate, convert -----------------------------------------------
@case("report of the float model", qc.QCompileError, ("MLP has no qcompile report",),
      ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.report(w.model)


@case("report of None", qc.QCompileError, ("NoneType has no qcompile report",),
      ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.report(None)


@case("quantizers of None", qc.QCompileError, ("quantizers", "NoneType"), ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.quantizers(None)


@case("freeze of a model never compiled", qc.QCompileError, ("freeze", "MLP"),
      ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.freeze(w.model)


@case("freeze of None", qc.QCompileError, ("freeze", "NoneType"), ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.freeze(None)


@case("calibrating the float model", qc.QCompileError, ("calibrate", "MLP"), ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.calibrate(w.model, [w.inputs], progress=False)


@case("calibrating on one tensor instead of a list of batches", qc.QCompileError,
      ("calibrate", "one tensor", "float32[4, 8]", "rows"), ("[x]",),
      prepare=lambda w: w.graph())
def _(w: World) -> Any:
    return qc.calibrate(w.graph(), w.inputs[0], progress=False)


@case("calibrate with inputs= that is not a function", qc.QCompileError,
      ("calibrate", "inputs=", "int"), ("lambda batch",), prepare=lambda w: w.graph())
def _(w: World) -> Any:
    return qc.calibrate(w.graph(), [w.inputs], progress=False, inputs=3)


@case("a bfloat16 calibration batch", qc.QCompileError,
      ("batch 0", "x: bfloat16[4, 8]", "x: float32[4, 8]"), ("same dtypes",),
      prepare=lambda w: w.graph())
def _(w: World) -> Any:
    return qc.calibrate(w.graph(), [(X.bfloat16(),)], progress=False)


@case("a calibration batch with a keyword the graph lacks", qc.QCompileError,
      ("batch 0", "y: float32[4, 8]", "x: float32[4, 8]"), ("inputs=",),
      prepare=lambda w: w.graph())
def _(w: World) -> Any:
    return qc.calibrate(w.graph(), [{"y": X}], progress=False)


@case("converting with int64 example inputs", qc.QCompileError,
      ("convert", "x: int64[4, 8]", "x: float32[4, 8]"), ("leave example_inputs out",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.convert(w.calibrated(), example_inputs=(X.long(),))


@case("converting with one example input too many", qc.QCompileError,
      ("convert", "float32[4, 8], float32[4, 8]"), ("shaped like those",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.convert(w.calibrated(), example_inputs=(X, X))


@case("converting the float model", qc.QCompileError, ("MLP has no qcompile report",),
      ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.convert(w.model, example_inputs=w.inputs)


@case("converting a converted graph", qc.QCompileError, ("convert", "converted"),
      ("fake-quant graph",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    once = qc.convert(copy.deepcopy(w.calibrated()), example_inputs=w.inputs)
    return qc.convert(once, example_inputs=w.inputs)


# -- sqnr -----------------------------------------------------------------------------------------
@case("sqnr on one tensor instead of a list of batches", qc.QCompileError,
      ("qc.sqnr", "one tensor", "float32[4, 8]"), ("[x]",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.sqnr(w.calibrated(), w.model, X)


@case("sqnr on a batch with NaN", qc.QCompileError,
      ("qc.sqnr: batch 1", "input x", "32 NaN"), ("finite",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.sqnr(w.calibrated(), w.model, [(X,), (torch.full((4, 8), float("nan")),)])


@case("sqnr against a model of another architecture", qc.QCompileError,
      ("qc.sqnr", "Linear", "none of the graph's quantized layers"), ("float model",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.sqnr(w.calibrated(), nn.Linear(8, 4), [w.inputs])


@case("sqnr with reference_model None", qc.QCompileError,
      ("qc.sqnr", "reference_model", "NoneType"), ("float nn.Module",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.sqnr(w.calibrated(), None, [w.inputs])


# -- encodings ------------------------------------------------------------------------------------
def _encodings(w: World, edit: Callable[[dict[str, Any]], None], name: str) -> Path:
    """The calibrated graph's encodings (exported to tmp/in), then ``edit``ed."""
    path = _in(w, name, "")
    qc.export_encodings(copy.deepcopy(w.calibrated()), path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _first(data: dict[str, Any], kind: str) -> dict[str, Any]:
    entry = next(iter(data[kind].values()))
    return entry[0] if isinstance(entry, list) else entry


@case("export_encodings onto a folder", qc.QCompileError, ("export_encodings", "directory"),
      ("file path",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.export_encodings(w.calibrated(), _in(w, "x", "").parent)


@case("export_encodings into a missing folder", qc.QCompileError,
      ("export_encodings", "nodir' does not exist"), ("create it",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.export_encodings(w.calibrated(), w.tmp / "nodir" / "e.encodings")


@case("load_encodings of a missing file", qc.QCompileError, ("missing.encodings",
                                                             "No such file"),
      ("qc.export_encodings",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.load_encodings(w.calibrated(), w.tmp / "in" / "missing.encodings")


@case("load_encodings of a binary file", qc.QCompileError, ("bin.encodings", "utf-8"),
      ("qc.export_encodings",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.load_encodings(w.calibrated(), _in(w, "bin.encodings", bytes(range(256))))


@case("load_encodings of a JSON list", qc.QCompileError, ("list.encodings", "JSON object"),
      ("qc.export_encodings",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.load_encodings(w.calibrated(), _in(w, "list.encodings", "[1, 2]"))


@case("load_encodings without an activation entry", qc.QCompileError,
      ("different graph", "missing ['fc1.output']"), ("same model and spec",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    path = _encodings(w, lambda d: d["activation_encodings"].pop("fc1.output"), "m.encodings")
    return qc.load_encodings(w.calibrated(), path)


@case("load_encodings with an unknown entry", qc.QCompileError,
      ("different graph", "unknown ['nonexistent']"), ("same model and spec",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d["activation_encodings"]["nonexistent"] = d["activation_encodings"]["fc1.output"]
    return qc.load_encodings(w.calibrated(), _encodings(w, edit, "u.encodings"))


@case("load_encodings with a bitwidth string", qc.QCompileError,
      ("activation_encodings['fc1.output']", "bitwidth '8'", "7"), ("correct the entry",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    path = _encodings(w, lambda d: _first(d, "activation_encodings").update(bitwidth="8"),
                      "b.encodings")
    return qc.load_encodings(w.calibrated(), path)


@case("load_encodings with an infinite weight scale", qc.QCompileError,
      ("param_encodings['fc1.weight']", "scale inf", "finite"), ("re-export",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    path = _encodings(w, lambda d: _first(d, "param_encodings").update(scale=float("inf")),
                      "i.encodings")
    return qc.load_encodings(w.calibrated(), path)


@case("load_encodings into the float model", qc.QCompileError,
      ("MLP has no qcompile report",), ("qc.qcompile",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.load_encodings(w.model, _encodings(w, lambda d: None, "f.encodings"))


# -- ONNX -----------------------------------------------------------------------------------------
def _onnx() -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")


@case("export_onnx with more input_names than inputs", qc.QCompileError,
      ("export_onnx", "input_names", "'y'"), ("one name per input",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    _onnx()
    return qc.export_onnx(w.calibrated(), _out(w, "m.onnx"), example_inputs=w.inputs,
                          input_names=["x", "y"])


@case("export_onnx with more output_names than outputs", qc.QCompileError,
      ("export_onnx", "output_names", "'extra'"), ("one name per output",),
      prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    _onnx()
    return qc.export_onnx(w.calibrated(), _out(w, "m.onnx"), example_inputs=w.inputs,
                          output_names=["out", "extra"])


@case("export_onnx to a path that is a number", qc.QCompileError, ("export_onnx", "int"),
      ("file path",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    _onnx()
    return qc.export_onnx(w.calibrated(), 5, example_inputs=w.inputs)


@case("export_onnx of a graph cast to bfloat16", qc.QCompileError,
      ("export_onnx", "bfloat16"), (".float()",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    _onnx()
    # a cast copy: casting the case's graph there and back would round its weights
    gm = copy.deepcopy(w.calibrated()).to(torch.bfloat16)
    return qc.export_onnx(gm, _out(w, "m.onnx"), example_inputs=(X.bfloat16(),))


@case("export_onnx of a converted graph", qc.QCompileError, ("export_onnx", "qc.convert"),
      ("fake-quant graph",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    _onnx()
    int8 = qc.convert(copy.deepcopy(w.calibrated()), example_inputs=w.inputs)
    return qc.export_onnx(int8, _out(w, "m.onnx"), example_inputs=w.inputs)


# -- adapters -------------------------------------------------------------------------------------
@case("save_adapters of a graph without adapters", qc.QCompileError,
      ("save_adapters", "no adapters"), ("adapters:",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    return qc.save_adapters(w.calibrated(), _out(w, "adapter"))


@case("merge_adapters of the float model", qc.QCompileError,
      ("merge_adapters", "MLP", "not compiled by qcompile"), ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.merge_adapters(w.model)


@case("save_adapters onto a file", qc.QCompileError, ("save_adapters", "is a file"),
      ("directory",), prepare=lambda w: w.graph("none", adapters=[
          {"match": {"module": "Linear"}, "rank": 2}]))
def _(w: World) -> Any:
    gm = w.graph("none", adapters=[{"match": {"module": "Linear"}, "rank": 2}])
    return qc.save_adapters(gm, _in(w, "file", "x"))


# -- search ---------------------------------------------------------------------------------------
def _searched(**search: Any) -> qc.CompileSpec:
    raw = spec_dict()
    raw["quant"]["search"] = {"candidates": [INT4G8, {"weight": {"dtype": "int8"}}],
                              "budget": {"avg_weight_bits": 6}, **search}
    return S(raw)


@case("search without a search section", qc.QCompileError, ("qc.search", "no quant.search"),
      ("quant.search:",))
def _(w: World) -> Any:
    return qc.search(w.model, S(spec_dict()), [w.inputs])


@case("search with no batches", qc.QCompileError, ("qc.search", "no batches"), ("non-empty",))
def _(w: World) -> Any:
    return qc.search(w.model, _searched(), [])


@case("search by loss without a loss function", qc.QCompileError,
      ("qc.search", "need a loss"), ("loss_fn=",))
def _(w: World) -> Any:
    return qc.search(w.model, _searched(metric="loss"), [w.inputs])


@case("search on a wrong-shaped batch", qc.QCompileError, ("fc1", "float32[4, 5]"),
      ("shapes",))
def _(w: World) -> Any:
    return qc.search(w.model, _searched(), [(torch.randn(4, 5),)])


@case("search with candidates that fit no layer", qc.QCompileError,
      ("no candidate fits group 'fc1'", "group_size 3"), ("per_channel",))
def _(w: World) -> Any:
    return qc.search(w.model, _searched(candidates=[
        {"weight": {"dtype": "int4", "granularity": "per_group", "group_size": 3}},
        {"weight": {"dtype": "int2", "granularity": "per_group", "group_size": 5}}]), [w.inputs])


@case("search on a batch with NaN", qc.QCompileError, ("qc.search", "NaN"), ("finite",))
def _(w: World) -> Any:
    return qc.search(w.model, _searched(), [(torch.full((4, 8), float("nan")),)])


# -- distributed (no process group) ---------------------------------------------------------------
def _opt(gm: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(gm.parameters(), lr=0.1)


@case("wrap without a process group", qc.QCompileError,
      ("data_parallel.kind: ddp", "process group"), ("torchrun",),
      prepare=lambda w: w.graph("qat"))
def _(w: World) -> Any:
    return qc.distributed.wrap(w.graph("qat"), S(spec_dict("qat", data_parallel={"kind": "ddp"})))


@case("mesh without a process group", qc.QCompileError, ("process group",), ("torchrun",))
def _(w: World) -> Any:
    return qc.distributed.mesh(S(spec_dict("qat", data_parallel={"kind": "ddp"})))


@case("pipeline without a process group", qc.QCompileError,
      ("qc.distributed.pipeline", "process group"), ("torchrun",),
      prepare=lambda w: w.graph("qat", pipeline={"stages": 2}))
def _(w: World) -> Any:
    return qc.distributed.pipeline(w.graph("qat", pipeline={"stages": 2}),
                                   S(spec_dict("qat", pipeline={"stages": 2})),
                                   loss_fn=F.mse_loss)


@case("sync_observers of None", qc.QCompileError, ("sync_observers", "NoneType"),
      ("qc.qcompile",))
def _(w: World) -> Any:
    return qc.distributed.sync_observers(None)


@case("train_step with a loss that is not a scalar", qc.QCompileError,
      ("train_step", "loss_fn", "scalar"), ("mean",), prepare=lambda w: w.graph("qat"))
def _(w: World) -> Any:
    gm = w.graph("qat")
    return qc.distributed.train_step(gm, _opt(gm), X, torch.zeros(4, 4), lambda a, b: a - b)


@case("train_step with accumulate=0", qc.QCompileError, ("accumulate", "0"), ("1",),
      prepare=lambda w: w.graph("qat"))
def _(w: World) -> Any:
    gm = w.graph("qat")
    return qc.distributed.train_step(gm, _opt(gm), X, torch.zeros(4, 4), F.mse_loss,
                                     accumulate=0)


@case("train_step without an optimizer", qc.QCompileError, ("train_step", "optimizer",
                                                            "NoneType"),
      ("torch.optim",), prepare=lambda w: w.graph("qat"))
def _(w: World) -> Any:
    return qc.distributed.train_step(w.graph("qat"), None, X, torch.zeros(4, 4), F.mse_loss)


@case("compile_once given a model instead of its factory", qc.QCompileError,
      ("compile_once", "build_model", "MLP"), ("lambda",))
def _(w: World) -> Any:
    return qc.distributed.compile_once(w.model, S(spec_dict("qat")), w.inputs)


def _checkpoint(w: World, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path = _in(w, name, "")
    save_file(tensors, str(path))
    return path


@case("compile_once from a missing checkpoint", qc.QCompileError,
      ("none.safetensors", "does not exist"), (".safetensors",))
def _(w: World) -> Any:
    return qc.distributed.compile_once(MLP, S(spec_dict("qat")), w.inputs,
                                       checkpoint=str(w.tmp / "in" / "none.safetensors"))


@case("compile_once from a corrupt checkpoint", qc.QCompileError,
      ("bad.safetensors", "cannot be read"), ("save it again",))
def _(w: World) -> Any:
    return qc.distributed.compile_once(MLP, S(spec_dict("qat")), w.inputs,
                                       checkpoint=str(_in(w, "bad.safetensors", b"\0" * 100)))


@case("compile_once from a checkpoint of another model", qc.QCompileError,
      ("lacks tensor 'fc1.bias'", "MLP"), ("same model class",))
def _(w: World) -> Any:
    path = _checkpoint(w, "other.safetensors", {"other.weight": torch.zeros(2, 2)})
    return qc.distributed.compile_once(MLP, S(spec_dict("qat")), w.inputs, checkpoint=str(path))


@case("compile_once from a checkpoint with a wrong shape", qc.QCompileError,
      ("fc1.weight", "[3, 3]", "[16, 8]"), ("same model class",))
def _(w: World) -> Any:
    state = {k: v.clone() for k, v in MLP().state_dict().items()}
    state["fc1.weight"] = torch.zeros(3, 3)
    path = _checkpoint(w, "shape.safetensors", state)
    return qc.distributed.compile_once(MLP, S(spec_dict("qat")), w.inputs, checkpoint=str(path))


# -- running the table ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graphs() -> dict[Any, nn.Module]:
    """Compiled graphs shared by the module's cases (each case gets deep copies)."""
    return {}


def check(c: Case, tmp_path: Path, cache: dict[Any, nn.Module]) -> None:
    torch.manual_seed(0)
    model = c.model()
    world = SharedWorld(model=model, inputs=(X.clone(),), tmp=tmp_path, _graphs={},
                        cache=cache, factory=c.model)
    if c.prepare is not None:
        c.prepare(world)
    before = world.snapshot()
    with pytest.raises(c.error) as info:
        c.run(world)
    message_ok(info.value, c)
    assert_unchanged(before, world.snapshot())
    assert written(tmp_path) == [], f"a refused call wrote {written(tmp_path)}"


@pytest.mark.parametrize("c", [pytest.param(c, id=c.id, marks=pytest.mark.xfail(
    strict=True, reason=_reason(c))) if _reason(c) else pytest.param(c, id=c.id)
    for c in CASES])
def test_bad_input(c: Case, tmp_path: Path, graphs: dict[Any, nn.Module]) -> None:
    check(c, tmp_path, graphs)


# -- the CLIs -------------------------------------------------------------------------------------
FACTORY = '''import torch


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4))


def broken():
    raise ValueError("boom")


def number():
    return 3
'''


@dataclass(frozen=True)
class CliCase:
    id: str
    argv: Callable[[Path], list[str]]  # the folder of the case's input files -> argv
    rc: int
    names: tuple[str, ...]
    fix: tuple[str, ...] = ()
    tool: str = "inspect"
    xfail: str | None = None


def _m(d: Path, factory: str = "build") -> list[str]:
    return ["--model", f"{d / 'm.py'}:{factory}"]


CLI_CASES = [
    CliCase("validate a binary file", lambda d: ["validate", str(d / "bin.yaml")], 1,
            ("bin.yaml", "not UTF-8"), ("UTF-8",)),
    CliCase("validate a missing file", lambda d: ["validate", str(d / "nope.yaml")], 1,
            ("nope.yaml", "does not exist"), ("preset name",)),
    CliCase("show a factory that does not exist",
            lambda d: ["show", "int8-qat", *_m(d, "nope"), "--input-shape", "2x8"], 1,
            ("m.py has no callable 'nope'",), ("returns the model",)),
    CliCase("show a factory that raises",
            lambda d: ["show", "int8-qat", *_m(d, "broken"), "--input-shape", "2x8"], 1,
            ("m.py:broken raised ValueError: boom",), ("--debug",)),
    CliCase("show a factory returning a number",
            lambda d: ["show", "int8-qat", *_m(d, "number"), "--input-shape", "2x8"], 1,
            ("returned int, not a torch.nn.Module",), ("model instance",)),
    CliCase("show with a malformed input shape",
            lambda d: ["show", "int8-qat", *_m(d), "--input-shape", "2xa"], 2,
            ("--input-shape '2xa'", "1x3x32x32")),
    CliCase("show with an unknown dtype",
            lambda d: ["show", "int8-qat", *_m(d), "--input-shape", "2x8", "--dtype",
                       "float99"], 2, ("--dtype 'float99'",)),
    CliCase("show with a wrong-width input",
            lambda d: ["show", "int8-qat", *_m(d), "--input-shape", "2x9"], 1,
            ("float32[2, 9]", "mat1 and mat2"), ("shapes and dtypes",)),
    CliCase("show a module that does not import",
            lambda d: ["show", "int8-qat", "--model", "nomodule_xyz.sub:build",
                       "--input-shape", "2x8"], 1,
            ("importing nomodule_xyz.sub failed", "ModuleNotFoundError"), ("--debug",)),
    CliCase("show a model path without a factory",
            lambda d: ["show", "int8-qat", "--model", str(d / "m.py"), "--input-shape", "2x8"],
            1, ("is not MODULE:FACTORY",), ("file.py:factory",)),
    CliCase("explain a node that does not exist",
            lambda d: ["explain", "int8-qat", *_m(d), "--input-shape", "2x8", "--node", "nonode"],
            1, ("--node 'nonode'",), ("input_1",)),
    CliCase("sqnr with a calibration file that is not torch.save'd",
            lambda d: ["sqnr", "int8-static", *_m(d), "--input-shape", "2x8", "--calib",
                       str(d / "bin.yaml")], 2, ("--calib", "torch.load(weights_only=True)")),
    CliCase("sqnr with zero random batches",
            lambda d: ["sqnr", "int8-static", *_m(d), "--input-shape", "2x8", "--random", "0"],
            2, ()),
    CliCase("search on a YAML file", lambda d: ["search", str(d / "ok.yaml")], 1,
            ("ok.yaml", "not a search report"), ("model_dump_json",)),
    CliCase("a picture into a missing folder",
            lambda d: ["show", "int8-qat", *_m(d), "--input-shape", "2x8", "--graph", "svg",
                       "--out", str(d / "nodir" / "g.svg")], 1,
            ("nodir", "does not exist"), ("create the folder",)),
    CliCase("search on a binary file", lambda d: ["search", str(d / "bin.yaml")], 1,
            ("bin.yaml", "UTF-8"), ("JSON",)),
    CliCase("passes with --dump-dir on a file",
            lambda d: ["passes", "int8-qat", *_m(d), "--input-shape", "2x8", "--dump-dir",
                       str(d / "ok.yaml")], 1, ("--dump-dir", "ok.yaml"), ("folder",)),
    CliCase("bench: an unknown suite", lambda d: ["nosuch"], 2,
            ("invalid choice: 'nosuch'", "pipeline"), tool="bench"),
    CliCase("bench: an unknown format", lambda d: ["--format", "xml", "pipeline"], 2,
            ("--format", "'xml'"), tool="bench"),
    CliCase("bench: no suite", lambda d: [], 2, ("SUITE",), tool="bench"),
]


def _cli(tool: str, argv: list[str]) -> int:
    if tool == "bench":
        from qcompile.tools.bench import main as bench_main

        try:
            return int(bench_main(argv) or 0)
        except SystemExit as e:  # argparse's usage errors
            return int(e.code or 0)
    from qcompile.tools.inspect_cli import main as inspect_main

    return inspect_main(argv)


@pytest.mark.parametrize("c", [pytest.param(c, id=c.id, marks=pytest.mark.xfail(
    strict=True, reason=c.xfail)) if c.xfail else pytest.param(c, id=c.id) for c in CLI_CASES])
def test_cli_bad_input(c: CliCase, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "m.py").write_text(FACTORY, encoding="utf-8")
    (inputs / "bin.yaml").write_bytes(bytes(range(256)))
    (inputs / "ok.yaml").write_text("quant: {mode: qat}\n", encoding="utf-8")
    before = sorted(p.name for p in inputs.iterdir())
    monkeypatch.chdir(tmp_path)  # a default output name would land here
    rc = _cli(c.tool, c.argv(inputs))
    out, err = capsys.readouterr()
    assert rc == c.rc, (rc, out, err)
    assert "Traceback" not in err + out, err
    said = err + out  # `validate` prints its verdict (invalid: ...) as its output
    for name in c.names:
        assert name in said, f"the message does not name {name!r}:\n{said}"
    if c.fix:
        assert "fix:" in said, f"no fix line:\n{said}"
        for word in c.fix:
            assert word in said, f"the fix does not say {word!r}:\n{said}"
    assert written(tmp_path) == [], f"a refused command wrote {written(tmp_path)}"
    assert sorted(p.name for p in inputs.iterdir()) == before


# -- silent results: a word, or a refusal ---------------------------------------------------------
class TrainBranch(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc1(x))
        if self.training:
            y = y * 2
        return self.fc2(y)


def _notes(gm: nn.Module) -> list[str]:
    return [n for p in qc.report(gm).passes for n in p.notes]


def test_export_front_end_says_it_keeps_a_training_branch() -> None:
    model = TrainBranch().eval()
    try:
        gm = qc.qcompile(model, S({"quant": {"mode": "none"}, "trace": {"method": "export"}}),
                         example_inputs=(X,))
    except qc.QCompileError as e:  # refused, naming the module and the flag: fine too
        assert "self.training" in str(e) and e.fix
        return
    with torch.no_grad():
        same = torch.equal(gm.eval()(X), model.eval()(X))
    assert same or any("self.training" in n for n in _notes(gm)), _notes(gm)


def test_a_weight_norm_linear_is_quantized_or_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    torch.nn.utils.parametrizations.weight_norm(model[0])
    spec = qc.load_spec("int8-qat").model_dump()
    spec["trace"]["method"] = "export"
    gm = qc.qcompile(model, spec, example_inputs=(X,))
    quantized = "0.weight_fake_quant" in qc.quantizers(gm)
    assert quantized or any("'0'" in n and "float" in n for n in _notes(gm)), _notes(gm)


def test_onnx_per_channel_activation_on_3d_input_runs_or_is_refused(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    gm = qc.qcompile(MLP(), S({"quant": {"mode": "static", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
         "activation": {"dtype": "uint8", "symmetric": False, "granularity": "per_channel",
                        "axis": -1}}]}}), example_inputs=(x,))
    qc.calibrate(gm, [(x,)], progress=False)
    try:
        path = qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(x,))
    except qc.QCompileError as e:  # refused before writing, naming the quantizer
        assert "per_channel" in str(e) and e.fix and not list(tmp_path.iterdir())
        return
    session = ort.InferenceSession(str(path))
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = gm.eval()(x)
    step = float(qc.quantizers(gm)["fc2.output_fake_quant"].scale.max())
    assert float((torch.from_numpy(got) - want).abs().max()) <= step * 1.01


def test_enough_cases() -> None:
    """At least 60 new mistakes across the API and the CLIs, each id once."""
    ids = [c.id for c in CASES] + [c.id for c in CLI_CASES]
    assert len(ids) >= 60, len(ids)
    assert len(set(ids)) == len(ids), "case ids must be unique"
