"""Encodings files that do not fit the graph, and scales no file may carry.

``qc.load_encodings`` checks every entry against the graph's quantizer before it applies
any: a refused file leaves the graph exactly as it was (the harness compares the graph's
state before and after). ``qc.export_encodings`` refuses a scale that is not a finite
number > 0 and writes nothing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bad_inputs_harness import MLP, Case, World, case_table, check_case, spec_dict

import qcompile as qc

CASES: list[Case] = []
case = case_table(CASES)


def _quant(weight: dict[str, Any] | None = None, activation: dict[str, Any] | None = None,
           target: str = "x86") -> dict[str, Any]:
    """A ``quant`` section like the harness's, with other weight / activation schemes."""
    return {"mode": "static", "target": target, "rules": [{
        "match": {"module": "Linear"}, "weight": weight or {"dtype": "int8"},
        "activation": activation or {"dtype": "uint8", "symmetric": False}}]}


INT4 = _quant(weight={"dtype": "int4"})
PER_CHANNEL = _quant(weight={"dtype": "int8", "granularity": "per_channel"})
FP8 = _quant(activation={"dtype": "fp8_e4m3"})


def _calibrated(w: World, **top: Any) -> torch.nn.Module:
    """``w``'s graph for ``top`` (a ``quant`` section), calibrated once."""
    gm = w.graph("static", **top)
    if not all(q.enabled for q in qc.quantizers(gm).values()):
        qc.calibrate(gm, [w.inputs], progress=False)
    return gm


def _file(w: World, gm: torch.nn.Module, edit: Callable[[dict[str, Any]], None] = lambda d: None
          ) -> Path:
    """``gm``'s encodings, ``edit``ed, in ``w.tmp/model.encodings``."""
    path = w.tmp / "model.encodings"
    qc.export_encodings(gm, path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _act(data: dict[str, Any], key: str = "fc1.output") -> dict[str, Any]:
    return data["activation_encodings"][key][0]


def _weight(data: dict[str, Any], key: str = "fc1.weight") -> dict[str, Any]:
    return data["param_encodings"][key][0]


def _edited(id: str, edit: Callable[[dict[str, Any]], None], names: tuple[str, ...],
            fix: tuple[str, ...] = ("re-export",)) -> None:
    """A case: the calibrated x86 graph's own file, ``edit``ed, loaded back into it."""
    case(f"encodings: {id}", qc.QCompileError, ("model.encodings", *names), fix,
         prepare=lambda w: w.calibrated())(
        lambda w: qc.load_encodings(w.calibrated(), _file(w, w.calibrated(), edit)))


# -- files for another graph, spec or target -------------------------------------------------
@case("encodings: int8 weights into an int4 graph", qc.QCompileError,
      ("param_encodings['fc1.weight']", "quantizer fc1.weight_fake_quant", "bitwidth 8",
       "the quantizer's is 4", "int4"), ("same model, spec and quant.target",),
      prepare=lambda w: (w.calibrated(), _calibrated(w, quant=INT4)))
def _(w: World) -> Any:
    return qc.load_encodings(_calibrated(w, quant=INT4), _file(w, w.calibrated()))


@case("encodings: x86 7-bit activations into a qnnpack graph", qc.QCompileError,
      ("activation_encodings", "bitwidth 7", "the quantizer's is 8", "range [0, 255]"),
      ("quant.target", "x86 keeps 8-bit activations in 7 bits"),
      prepare=lambda w: (w.calibrated(), _calibrated(w, quant=_quant(target="qnnpack"))))
def _(w: World) -> Any:
    return qc.load_encodings(_calibrated(w, quant=_quant(target="qnnpack")),
                             _file(w, w.calibrated()))


@case("encodings: qnnpack 8-bit activations into an x86 graph", qc.QCompileError,
      ("activation_encodings", "bitwidth 8", "the quantizer's is 7", "range [0, 127]"),
      ("quant.target",), prepare=lambda w: w.calibrated())
def _(w: World) -> Any:
    spec = qc.CompileSpec.model_validate({"quant": _quant(target="qnnpack")})
    other = qc.qcompile(copy.deepcopy(w.model), spec, example_inputs=w.inputs)
    qc.calibrate(other, [w.inputs], progress=False)
    return qc.load_encodings(w.calibrated(), _file(w, other))


@case("encodings: int encodings into an fp8 graph", qc.QCompileError,
      ("activation_encodings", "dtype 'int'", "the quantizer's is 'float'", "fp8_e4m3"),
      ("same model",),
      prepare=lambda w: (w.calibrated(), _calibrated(w, quant=FP8)))
def _(w: World) -> Any:
    return qc.load_encodings(_calibrated(w, quant=FP8), _file(w, w.calibrated()))


@case("encodings: per-tensor weights into a per-channel graph", qc.QCompileError,
      ("param_encodings['fc1.weight']", "granularity 'per_tensor'", "'per_channel'"),
      ("same model",), prepare=lambda w: (w.calibrated(), _calibrated(w, quant=PER_CHANNEL)))
def _(w: World) -> Any:
    return qc.load_encodings(_calibrated(w, quant=PER_CHANNEL), _file(w, w.calibrated()))


@case("encodings: a per-channel weight with one entry too few", qc.QCompileError,
      ("param_encodings['fc1.weight']", "15 entries", "16 scale(s)", "axis 0"),
      ("same model",), prepare=lambda w: _calibrated(w, quant=PER_CHANNEL))
def _(w: World) -> Any:
    gm = _calibrated(w, quant=PER_CHANNEL)
    return qc.load_encodings(gm, _file(w, gm, lambda d: d["param_encodings"]["fc1.weight"].pop()))


# -- entries that contradict their quantizer -------------------------------------------------
_edited("bitwidth contradicting the quantizer", lambda d: _act(d).update(bitwidth=8),
        ("activation_encodings['fc1.output']", "quantizer fc1.output_fake_quant", "bitwidth 8",
         "the quantizer's is 7"), ("quant.target",))
_edited("is_symmetric contradicting the quantizer", lambda d: _act(d).update(is_symmetric=True),
        ("fc1.output_fake_quant", "is_symmetric True", "uint8 asymmetric"), ("same model",))
_edited("a float dtype on an integer quantizer", lambda d: _weight(d).update(dtype="float"),
        ("fc1.weight_fake_quant", "dtype 'float'", "the quantizer's is 'int'", "int8"),
        ("same model",))
_edited("another qcompile dtype", lambda d: _act(d).update(qcompile_dtype="int8"),
        ("fc1.output_fake_quant", "qcompile_dtype 'int8'", "'uint8'"), ("same model",))
_edited("another quant_max", lambda d: _act(d).update(quant_max=255),
        ("fc1.output_fake_quant", "quant_max 255", "127"), ("quant.target",))
_edited("a static entry marked dynamic", lambda d: _act(d).update(dynamic=True),
        ("fc1.output_fake_quant", "is dynamic", "is static"), ("same model",))
_edited("a max beyond the quantizer's grid",
        lambda d: _act(d).update(max=(255 - _act(d)["zero_point"]) * _act(d)["scale"]),
        ("activation_encodings['fc1.output']", "entry [0] max", "levels 0..127"),
        ("quant.target",))
_edited("a min beyond the quantizer's grid",
        lambda d: _act(d).update(min=_act(d)["min"] - 64 * _act(d)["scale"]),
        ("entry [0] min",), ("quant.target",))
_edited("a subnormal scale", lambda d: _act(d).update(scale=1e-40, min=0.0, max=1e-38),
        ("fc1.output_fake_quant", "1e-40", "subnormal"))
_edited("a zero scale", lambda d: _weight(d).update(scale=0.0),
        ("fc1.weight_fake_quant", "scale 0.0", "finite number > 0"))
_edited("a zero point on a symmetric quantizer",
        lambda d: _weight(d).update(zero_point=3, offset=-3),
        ("param_encodings['fc1.weight']", "zero point 3 on a symmetric quantizer",
         "zero point is 0"))
_edited("an offset that is not -zero_point", lambda d: _act(d).update(offset=5),
        ("fc1.output_fake_quant", "offset 5", "-zero_point"))
_edited("a non-integer bitwidth", lambda d: _act(d).update(bitwidth="7"),
        ("fc1.output_fake_quant", "bitwidth '7'"), ("same model",))


# -- export: no file with a scale nothing could use ------------------------------------------
def _export_bad_scale(value: float) -> Callable[[World], Any]:
    def run(w: World) -> Any:
        # a graph of the case's own (not the harness's): its scale is broken on purpose
        spec = qc.CompileSpec.model_validate(spec_dict("static"))
        gm = qc.qcompile(copy.deepcopy(w.model), spec, example_inputs=w.inputs)
        qc.calibrate(gm, [w.inputs], progress=False)
        with torch.no_grad():
            qc.quantizers(gm)["fc2.output_fake_quant"].scale.fill_(value)
        target = w.tmp / "model.encodings"
        try:
            return qc.export_encodings(gm, target)
        finally:
            assert list(w.tmp.iterdir()) == [], "a refused export wrote a file"
    return run


for _value in (-0.25, 0.0, float("inf"), float("nan")):
    case(f"exporting a scale of {_value}", qc.QCompileError,
         ("export_encodings", "quantizer fc2.output_fake_quant", f"scale {_value!r}"),
         ("re-calibrate",))(_export_bad_scale(_value))


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path: Path) -> None:
    check_case(c, tmp_path)


def test_the_edited_entries_load_when_not_edited(tmp_path: Path) -> None:
    """The cases above fail for their edit, not for the file they start from: the same
    file unedited loads, and reproduces the graph's qparams."""
    torch.manual_seed(0)
    world = World(model=MLP(), inputs=(torch.randn(4, 8),), tmp=tmp_path, _graphs={})
    gm = world.calibrated()
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    qc.load_encodings(gm, _file(world, gm))
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())

