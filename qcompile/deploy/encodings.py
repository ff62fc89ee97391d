"""Quantization encodings out of and back into a compiled graph, and per-layer SQNR.

``export_encodings(gm, path)`` writes what a deployment toolchain needs to reproduce the
numerics, modelled on AIMET's ``.encodings`` JSON:

```json
{"version": "1.0.0", "producer": "qcompile 0.1.0",
 "param_encodings": {"fc.weight": [{"bitwidth": 8, "dtype": "int", "is_symmetric": true,
                                     "scale": 0.01, "offset": 0, "min": -1.28, "max": 1.27,
                                     ...}, ...one per channel / group]},
 "activation_encodings": {"fc.output": [{...}], "add": [{...}]}}
```

Per entry: ``bitwidth``, ``dtype`` (``int`` or ``float`` for fp8), ``is_symmetric``,
``scale``, ``offset`` (AIMET's convention: ``-zero_point``), ``min`` / ``max`` (the
representable range, ``(quant_min - zero_point) * scale`` and ``(quant_max - zero_point) *
scale``), and qcompile's own ``zero_point``, ``quant_min``, ``quant_max``, ``granularity``,
``axis``, ``group_size``. Parameters are keyed by their qualified name, activations by the
quantizer's name without ``_fake_quant``. ``load_encodings`` applies a file back (and
freezes the quantizers). Every entry is checked against the graph's quantizer first, and
one bad entry refuses the whole file (nothing is applied): a file for a different graph;
a ``dtype``, ``bitwidth``, ``is_symmetric``, ``quant_min`` / ``quant_max``, granularity or
entry count other than the quantizer's (int8 encodings into an int4 graph; x86's 7-bit
activation ranges into a qnnpack graph); a scale that is not a finite, normal float32
number > 0; a zero point (``offset``) outside the quantizer's range, or other than the
symmetric one on a symmetric quantizer; ``min`` / ``max`` that are not the ends of the
quantizer's grid. Fields a file leaves out (AIMET writes none of qcompile's own) are not
required; ``offset`` stands for ``-zero_point`` when ``zero_point`` is missing.
Block-scaled quantizers (``mxfp8_e4m3`` ... ``mxfp4``, ``nvfp4``, ``nf4``) compute their
block scales from each tensor, so their entry names the format instead of qparams, one
entry per quantizer: ``{"bitwidth": 4, "dtype": "float", "is_symmetric": true,
"block_format": "mxfp4", "block_size": 32, "scale_format": "e8m0", ...}`` (``bitwidth``:
the element's bits; ``scale_format``: ``e8m0`` for MX, ``e4m3*fp32`` for NVFP4's E4M3 block
scales under one FP32 tensor scale, ``fp32`` for NF4's absmax, and for llama.cpp's grids
(``dtype`` ``int``) ``fp16`` (Q8_0, Q4_0), ``fp16+fp16_min`` (Q4_1),
``u6*fp16+u6_min*fp16`` (Q4_K), ``int8*fp16`` (Q6_K), ``fp32`` (Q8_K)). ``load_encodings`` checks
that the format and block size are the quantizer's and refuses any other.
``export_encodings`` refuses a graph whose activation ranges were never observed (static:
not calibrated; QAT: not trained), as ``qc.convert`` does: its qparams are placeholders;
and a scale that is not a finite number > 0. The file is written atomically
(``qcompile.files``).

Example:
    >>> import tempfile, os, torch, qcompile as qc
    >>> x = torch.randn(2, 4)
    >>> gm = qc.qcompile(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int8-static", (x,))
    >>> path = os.path.join(tempfile.mkdtemp(), "model.encodings")
    >>> qc.export_encodings(gm, path)
    Traceback (most recent call last):
    ...
    qcompile.errors.QCompileError: export_encodings: 2 activation quantizer(s) have no ...
      fix: run qc.calibrate(gm, batches) first
    >>> gm = qc.calibrate(gm, [(x,)])
    >>> qc.export_encodings(gm, path)
    >>> with open(path) as f:
    ...     sorted(json.load(f)["param_encodings"])
    ['0.weight']
    >>> _ = qc.load_encodings(gm, path)
"""

from __future__ import annotations

import json
import math
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qcompile.deploy.adapters import refuse_adapters
from qcompile.deploy.stages import refuse_sharded_stage, spread
from qcompile.deploy.whole_graph import agree_and_share, writes_here
from qcompile.errors import QCompileError
from qcompile.files import write_atomically
from qcompile.graph.algorithms import refuse_pending
from qcompile.graph.records import report
from qcompile.runtime.block_formats import FORMATS, GGML_FORMATS
from qcompile.runtime.calibration import uncalibrated
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.quant_math import symmetric_zero_point
from qcompile.version import __version__

VERSION = "1.0.0"


#: how each kind of block format stores its block scales
_SCALE_FORMATS = {"mx": "e8m0", "nvfp4": "e4m3*fp32", "nf4": "fp32",
                  # llama.cpp's grids: fp16 block scales (Q4_1 with an fp16 minimum); 6-bit
                  # (Q4_K) or int8 (Q6_K) sub-block scales under fp16 ones; Q8_K's float32
                  "q8_0": "fp16", "q4_0": "fp16", "q4_1": "fp16+fp16_min",
                  "q4_k": "u6*fp16+u6_min*fp16", "q6_k": "int8*fp16", "q8_k": "fp32"}


def quantizer_bits(fq: FakeQuantize) -> int:
    """Bits of one stored value of ``fq`` (a block format's element, fp8's 8, an integer
    range's width)."""
    if fq.block_format is not None:
        return FORMATS[fq.block_format].bits
    if fq.dtype.startswith("fp8"):
        return 8
    return int(math.log2(fq.quant_max - fq.quant_min + 1))


def _entries(fq: FakeQuantize) -> list[dict[str, Any]]:
    out = []
    for s, z in zip(fq.scale.detach().reshape(-1).tolist(),
                    fq.zero_point.detach().reshape(-1).tolist()):
        out.append({
            "bitwidth": quantizer_bits(fq),
            "dtype": "float" if fq.dtype.startswith("fp8") else "int",
            "is_symmetric": fq.symmetric, "scale": s, "offset": -int(z),
            "min": (fq.quant_min - z) * s, "max": (fq.quant_max - z) * s,
            "zero_point": int(z), "quant_min": fq.quant_min, "quant_max": fq.quant_max,
            "qcompile_dtype": fq.dtype, "granularity": fq.granularity, "axis": fq.axis,
            "group_size": fq.group_size,
        })
    return out


def _block_entry(fq: FakeQuantize) -> dict[str, Any]:
    """The one entry of a block-format quantizer: its format, not qparams (each tensor's
    blocks have their own scales)."""
    assert fq.block_format is not None
    return {"bitwidth": quantizer_bits(fq), "dtype": _kind(fq), "is_symmetric": fq.symmetric,
            "block_format": fq.block_format, "block_size": fq.group_size,
            "scale_format": _SCALE_FORMATS.get(fq.block_format)
            or _SCALE_FORMATS[FORMATS[fq.block_format].kind],
            "qcompile_dtype": fq.dtype, "granularity": fq.granularity,
            "group_size": fq.group_size}


def _names(gm: nn.Module) -> dict[str, tuple[str, str]]:
    """quantizer qualified name -> (section, key) in the encodings file. A quantizer inside
    a ``stage_<i>`` child graph (pipeline stages, FSDP2 blocks) is keyed by the model's
    name, without the child's prefix: the file is the one of the model compiled whole."""
    weights = {q.name: q.node for q in report(gm).quantizers if q.role == "weight"}
    names = {}
    for name, m in gm.named_modules():
        if isinstance(m, FakeQuantize):
            head, _, rest = name.partition(".")
            model = rest if head.startswith("stage_") and rest else name
            if model in weights:
                names[name] = ("param_encodings", weights[model])
            else:
                names[name] = ("activation_encodings", model.removesuffix("_fake_quant"))
    return names


def _refuse_sharded(gm: nn.Module, where: str) -> None:
    """A tensor-parallel graph keeps a colwise layer's per-row qparams for this rank's rows
    (``qcompile.runtime.sharded.keep_local_rows``): an encodings file holds whole ones."""
    from qcompile.runtime.sharded import holds_rows

    for name, m in gm.named_modules():
        if isinstance(m, FakeQuantize) and holds_rows(m):
            raise QCompileError(
                f"{where}: {name} holds one tensor-parallel rank's rows of its qparams (the "
                "graph is sharded across tp)", fix="gather the full state dict "
                "(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))"
                ", load it into the graph qc.qcompile returned, and use that")


def export_encodings(gm: nn.Module, path: str | Path) -> None:
    """Write every quantizer's encoding to ``path`` (JSON), atomically.

    Refuses (``QCompileError``, no file written) a graph whose activation quantizers never
    observed data: a static graph before ``qc.calibrate``, a QAT graph before training.
    For a graph whose stages ``qc.distributed.pipeline`` spread over ranks every rank calls
    it: each stage's trained state reaches the others' copies first
    (``qcompile.deploy.stages.share_stages``), and the pipeline's lowest rank writes."""
    refuse_adapters(gm, "export_encodings")
    _refuse_sharded(gm, "export_encodings")
    refuse_sharded_stage(gm, "export_encodings")
    if spread(gm) is not None:  # every rank: the stages' trained state first
        agree_and_share(gm, gm, "export_encodings", {"path": str(path)},
                        lambda: _target(path) if writes_here(gm) else None)
    mode = report(gm).mode
    refuse_pending(gm, "export_encodings")
    missing = uncalibrated(gm, mode)
    if missing:
        fix = ("run qc.calibrate(gm, batches) first" if mode == "static" else
               "train it for some steps first (observers learn ranges in train mode; a "
               "training step's observations take effect after optimizer.step(), or call "
               "qc.freeze(gm))")
        raise QCompileError(f"export_encodings: {len(missing)} activation quantizer(s) have "
                            f"no ranges yet (their scales are placeholders), e.g. "
                            f"{missing[0]}", fix=fix)
    names = _names(gm)
    for name in names:  # a file must not carry a scale no quantizer could use
        fq = gm.get_submodule(name)
        if fq.dynamic or fq.granularity == "per_token" or fq.block_format is not None:
            continue
        scale = fq.scale.detach().reshape(-1)
        wrong = ~(scale.isfinite() & (scale > 0))
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0])
            raise QCompileError(
                f"export_encodings: quantizer {name} has scale {float(scale[i])!r} "
                f"(entry [{i}] of {scale.numel()}): a scale must be a finite number > 0",
                fix="re-calibrate the graph (qc.calibrate), or retrain it with a smaller "
                "learning rate if its scales are learned, then export again")
    data: dict[str, Any] = {"version": VERSION, "producer": f"qcompile {__version__}",
                            "param_encodings": {}, "activation_encodings": {}}
    for name, (section, key) in names.items():
        fq = gm.get_submodule(name)
        if fq.block_format is not None:
            data[section][key] = [_block_entry(fq)]
        elif fq.dynamic or fq.granularity == "per_token":
            data[section][key] = [{"dynamic": True, "bitwidth": quantizer_bits(fq),
                                   "is_symmetric": fq.symmetric,
                                   "granularity": fq.granularity}]
        else:
            data[section][key] = _entries(fq)
    if not writes_here(gm):  # a pipeline's other ranks: the lowest one writes
        return
    target = _target(path)
    # allow_nan=False: a NaN/inf scale that slipped through must not become a file that
    # only Python's json reads back.
    write_atomically(target, json.dumps(data, indent=1, allow_nan=False) + "\n")


def _target(path: str | Path) -> Path:
    target = Path(path)
    if target.is_dir():
        raise QCompileError(f"export_encodings: {str(path)!r} is a directory",
                            fix="give a file path, e.g. model.encodings")
    if not target.parent.is_dir():
        raise QCompileError(f"export_encodings: directory {str(target.parent)!r} does not "
                            "exist", fix="create it first or write somewhere else")
    return target


def _number(value: object) -> float | None:
    """``value`` as a float if it is a JSON number (not a bool, not a string), else None."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    return float(value)


def _kind(fq: FakeQuantize) -> str:
    if fq.block_format in GGML_FORMATS:  # integer codes under block scales
        return "int"
    return "float" if fq.dtype.startswith("fp8") or fq.block_format is not None else "int"


def _describe(fq: FakeQuantize) -> str:
    """``uint8 asymmetric per_tensor, range [0, 127] (7-bit)``: what a file must match."""
    if fq.block_format is not None:
        return f"{fq.block_format} in blocks of {fq.group_size}"
    return (f"{fq.dtype} {'symmetric' if fq.symmetric else 'asymmetric'} {fq.granularity}, "
            f"range [{fq.quant_min}, {fq.quant_max}] ({quantizer_bits(fq)}-bit)")


#: what a file written for another graph, spec or quant.target needs
_OTHER_GRAPH_FIX = ("export the encodings from a graph compiled with the same model, spec and "
                    "quant.target, or correct the entry")
_OTHER_TARGET_FIX = ("export the encodings from a graph compiled with the same model, spec and "
                     "quant.target (x86 keeps 8-bit activations in 7 bits, [0, 127]; qnnpack "
                     "and onednn_vnni use all 8), or correct the entry")


def _fix_for(section: str, fq: FakeQuantize) -> str:
    """8-bit activations: their range depends on quant.target, say how."""
    eight_bit = section == "activation_encodings" and fq.dtype in ("uint8", "int8")
    return _OTHER_TARGET_FIX if eight_bit else _OTHER_GRAPH_FIX
_FIX = ("re-export the encodings with qc.export_encodings from a calibrated graph, or "
        "correct the entry")


def _scheme_mismatch(e: dict[str, Any], fq: FakeQuantize) -> str | None:
    """What in entry ``e`` contradicts the quantizer's scheme (None when nothing does).
    Fields a file may leave out (AIMET writes no qcompile fields) are not required."""
    if "dtype" in e and e["dtype"] != _kind(fq):
        return f"dtype {e['dtype']!r}, the quantizer's is {_kind(fq)!r}"
    if "bitwidth" in e:
        b = e["bitwidth"]
        if isinstance(b, bool) or not isinstance(b, Integral) or b != quantizer_bits(fq):
            return f"bitwidth {b!r}, the quantizer's is {quantizer_bits(fq)}"
    if "is_symmetric" in e and e["is_symmetric"] is not fq.symmetric:
        return f"is_symmetric {e['is_symmetric']!r}, the quantizer's is {fq.symmetric}"
    if "qcompile_dtype" in e and e["qcompile_dtype"] != fq.dtype:
        return f"qcompile_dtype {e['qcompile_dtype']!r}, the quantizer's is {fq.dtype!r}"
    for field, mine in (("quant_min", fq.quant_min), ("quant_max", fq.quant_max),
                        ("granularity", fq.granularity), ("axis", fq.axis),
                        ("group_size", fq.group_size)):
        if field in e and (e[field] != mine or isinstance(e[field], bool)):
            return f"{field} {e[field]!r}, the quantizer's is {mine!r}"
    return None


def _scale_of(e: dict[str, Any], i: int, bad: _Bad) -> float:
    if "scale" not in e:
        raise bad(f"entry [{i}] has no 'scale'")
    s = _number(e["scale"])
    if s is None:
        raise bad(f"entry [{i}] scale {e['scale']!r} is not a number")
    if not math.isfinite(s) or s <= 0:
        raise bad(f"entry [{i}] scale {e['scale']!r}: a scale must be a finite number > 0")
    return s


def _zero_point_of(e: dict[str, Any], i: int, fq: FakeQuantize, bad: _Bad) -> int:
    """The entry's zero point: ``zero_point``, else ``-offset`` (AIMET's convention)."""
    if "zero_point" not in e and "offset" not in e:
        raise bad(f"entry [{i}] has no 'zero_point'")
    field = "zero_point" if "zero_point" in e else "offset"
    z = _number(e[field])
    if z is None or not z.is_integer():
        raise bad(f"entry [{i}] {field} {e[field]!r} is not an integer")
    zp = int(z) if field == "zero_point" else -int(z)
    if not fq.quant_min <= zp <= fq.quant_max:
        raise bad(f"entry [{i}] {field} {e[field]!r} is outside the quantizer's range "
                  f"[{fq.quant_min}, {fq.quant_max}]")
    if field == "zero_point" and "offset" in e:
        o = _number(e["offset"])
        if o is None or o != -zp:
            raise bad(f"entry [{i}] offset {e['offset']!r} is not -zero_point ({-zp}), as "
                      "the format defines it")
    return zp


def _check_range(e: dict[str, Any], i: int, fq: FakeQuantize, s: float, zp: int,
                 bad: _Bad, fix: str) -> None:
    """``min`` / ``max``, where given, must be the grid's ends ``(quant_min - zp) * scale``
    and ``(quant_max - zp) * scale`` (to half a step): a range with other ends was
    computed for another number of levels (another target or bit width)."""
    for field, level in (("min", fq.quant_min), ("max", fq.quant_max)):
        if field not in e:
            continue
        v = _number(e[field])
        expected = (level - zp) * s
        if v is None or not math.isfinite(v) or abs(v - expected) > 0.5 * s:
            raise QCompileError(
                f"{bad.where}: entry [{i}] {field} {e[field]!r} is not the quantizer's "
                f"{field} {expected:.6g} (levels {fq.quant_min}..{fq.quant_max} with scale "
                f"{s:.6g}, zero point {zp}): the range was made for another grid", fix=fix)


class _Bad:
    """Makes the ``QCompileError`` of one quantizer's entries (names file, entry, quantizer)."""

    def __init__(self, path: str | Path, section: str, key: str, name: str) -> None:
        self.where = f"encodings file {path}: {section}[{key!r}] (quantizer {name})"

    def __call__(self, what: str, fix: str = _FIX) -> QCompileError:
        return QCompileError(f"{self.where}: {what}", fix=fix)


def _checked(path: str | Path, section: str, key: str, name: str, fq: FakeQuantize,
             entries: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (scale, zero_point) tensors of one quantizer's entries (None for a dynamic or
    block-format quantizer: nothing to apply), or a ``QCompileError`` naming the entry, the
    quantizer and what contradicts it."""
    bad = _Bad(path, section, key, name)
    other = _fix_for(section, fq)
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise bad(f"expected a list of encoding objects, got {type(entries).__name__}")
    if fq.block_format is not None or any("block_format" in e for e in entries):
        _check_block(bad, fq, entries, other)
        return None  # nothing to apply: the blocks' scales come from each tensor
    dynamic = fq.dynamic or fq.granularity == "per_token"
    for i, e in enumerate(entries):
        if bool(e.get("dynamic", False)) != dynamic:
            raise bad(f"entry [{i}] is {'dynamic' if e.get('dynamic') else 'static'}, the "
                      f"quantizer {'computes its qparams per input' if dynamic else 'is static'}"
                      f" ({_describe(fq)})", fix=other)
        mismatch = _scheme_mismatch(e, fq)
        if mismatch is not None:
            raise bad(f"entry [{i}] {mismatch} ({_describe(fq)})", fix=other)
    if dynamic:
        return None
    if len(entries) != fq.scale.numel():
        raise bad(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, the quantizer "
                  f"has {fq.scale.numel()} scale(s) ({_describe(fq)}"
                  f"{'' if fq.axis is None else f', axis {fq.axis}'})", fix=other)
    tiny = torch.finfo(fq.scale.dtype).tiny
    sym_zp = 0 if _kind(fq) == "float" else symmetric_zero_point(fq.quant_min, fq.quant_max)
    scales, zero_points = [], []
    for i, e in enumerate(entries):
        s = _scale_of(e, i, bad)
        zp = _zero_point_of(e, i, fq, bad)
        stored = float(torch.tensor(s, dtype=fq.scale.dtype))
        # A scale fine as a Python float can leave the quantizer's float32 range (1e-50 ->
        # 0, 1e39 -> inf): check what would be stored.
        if not math.isfinite(stored) or stored <= 0:
            raise bad(f"entry [{i}] scale {e['scale']!r} is not a finite number > 0 in "
                      f"{str(fq.scale.dtype).removeprefix('torch.')}")
        if stored < tiny:
            # subnormal: x / scale overflows to inf for ordinary inputs, and kernels flush
            # such scales to zero
            raise bad(f"entry [{i}] scale {e['scale']!r} is subnormal in "
                      f"{str(fq.scale.dtype).removeprefix('torch.')} (below {tiny:.3g})")
        if fq.symmetric and zp != sym_zp:
            raise bad(f"entry [{i}] zero point {zp} on a symmetric quantizer, whose zero "
                      f"point is {sym_zp} ({_describe(fq)})")
        _check_range(e, i, fq, s, zp, bad, other)
        scales.append(s)
        zero_points.append(zp)
    scale = torch.tensor(scales, dtype=fq.scale.dtype).view_as(fq.scale)
    return scale, torch.tensor(zero_points, dtype=fq.zero_point.dtype).view_as(fq.zero_point)


def _check_block(bad: _Bad, fq: FakeQuantize, entries: list[dict[str, Any]],
                 fix: str) -> None:
    """A block-format quantizer's entries: one, naming its format and block size."""
    if fq.block_format is None:
        e = next(e for e in entries if "block_format" in e)
        raise bad(f"entry [{entries.index(e)}] is a block-format encoding "
                  f"({e['block_format']!r}), the quantizer is {_describe(fq)}", fix=fix)
    if len(entries) != 1:
        raise bad(f"{len(entries)} entries, a block-format quantizer has one ("
                  f"{_describe(fq)}: its scales come from each tensor)", fix=fix)
    e = entries[0]
    for field, mine in (("block_format", fq.block_format), ("block_size", fq.group_size)):
        if field not in e:
            raise bad(f"entry [0] has no {field!r}, the quantizer is {_describe(fq)}",
                      fix=fix)
        if e[field] != mine or isinstance(e[field], bool):
            raise bad(f"entry [0] {field} {e[field]!r}, the quantizer's is {mine!r} "
                      f"({_describe(fq)})", fix=fix)
    mismatch = _scheme_mismatch(e, fq)
    if mismatch is not None:
        raise bad(f"entry [0] {mismatch} ({_describe(fq)})", fix=fix)


def load_encodings(gm: nn.Module, path: str | Path) -> nn.Module:
    """Apply an encodings file to ``gm``'s quantizers (then frozen and enabled).

    Every entry is checked before any is applied: a refused file leaves ``gm`` as it was."""
    _refuse_sharded(gm, "load_encodings")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QCompileError(f"encodings file {path}: {e}",
                            fix="pass a file written by qc.export_encodings") from None
    sections = ("param_encodings", "activation_encodings")
    if not isinstance(data, dict) or not all(isinstance(data.get(s, {}), dict)
                                             for s in sections):
        raise QCompileError(f"encodings file {path}: expected a JSON object with "
                            "param_encodings and activation_encodings objects",
                            fix="pass a file written by qc.export_encodings")
    names = _names(gm)
    expected = {key for section, key in names.values()}
    given = set(data.get("param_encodings", {})) | set(data.get("activation_encodings", {}))
    if expected != given:
        missing, extra = sorted(expected - given), sorted(given - expected)
        raise QCompileError(f"encodings file {path} is for a different graph (missing "
                            f"{missing[:5]}, unknown {extra[:5]})",
                            fix="export the encodings from a graph compiled with the same "
                            "model and spec")
    # Check everything first, apply after: a bad entry anywhere leaves the graph unchanged.
    updates = []
    for name, (section, key) in names.items():
        fq = gm.get_submodule(name)
        if key not in data.get(section, {}):
            raise QCompileError(f"encodings file {path}: {key!r} is not under {section} "
                                "(the graph's quantizer for it is of the other kind)",
                                fix="export the encodings from the same graph")
        checked = _checked(path, section, key, name, fq, data[section][key])
        if checked is not None:
            updates.append((fq, *checked))
    with torch.no_grad():
        for fq, scale, zero_point in updates:
            fq.set_qparams(scale, zero_point)  # a learnable scale's parameter too
            fq.observe = False
            fq.enabled = True
    return gm
