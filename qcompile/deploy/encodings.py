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
freezes the quantizers); a file for a different graph, or with a scale that is not a
finite number > 0 or a zero point outside the quantizer's range, is refused as a whole
(nothing is applied). ``export_encodings`` refuses a graph whose activation ranges were
never observed (static: not calibrated; QAT: not trained), as ``qc.convert`` does: its
qparams are placeholders. The file is written atomically (a temporary file, then renamed).

Example:
    >>> import tempfile, os, torch, qcompile as qc
    >>> x = torch.randn(2, 4)
    >>> gm = qc.qcompile(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int8-static", (x,))
    >>> path = os.path.join(tempfile.mkdtemp(), "model.encodings")
    >>> qc.export_encodings(gm, path)
    Traceback (most recent call last):
    ...
    qcompile.errors.QCompileError: export_encodings: 1 activation quantizer(s) have no ...
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
import os
import tempfile
from numbers import Real
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qcompile.errors import QCompileError
from qcompile.graph.algorithms import refuse_pending
from qcompile.graph.records import report
from qcompile.runtime.calibration import uncalibrated
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.version import __version__

VERSION = "1.0.0"


def _bits(fq: FakeQuantize) -> int:
    if fq.dtype.startswith("fp8"):
        return 8
    return int(math.log2(fq.quant_max - fq.quant_min + 1))


def _entries(fq: FakeQuantize) -> list[dict[str, Any]]:
    out = []
    for s, z in zip(fq.scale.detach().reshape(-1).tolist(),
                    fq.zero_point.detach().reshape(-1).tolist()):
        out.append({
            "bitwidth": _bits(fq), "dtype": "float" if fq.dtype.startswith("fp8") else "int",
            "is_symmetric": fq.symmetric, "scale": s, "offset": -int(z),
            "min": (fq.quant_min - z) * s, "max": (fq.quant_max - z) * s,
            "zero_point": int(z), "quant_min": fq.quant_min, "quant_max": fq.quant_max,
            "qcompile_dtype": fq.dtype, "granularity": fq.granularity, "axis": fq.axis,
            "group_size": fq.group_size,
        })
    return out


def _names(gm: nn.Module) -> dict[str, tuple[str, str]]:
    """quantizer qualified name -> (section, key) in the encodings file."""
    weights = {q.name: q.node for q in report(gm).quantizers if q.role == "weight"}
    names = {}
    for name, m in gm.named_modules():
        if isinstance(m, FakeQuantize):
            if name in weights:
                names[name] = ("param_encodings", weights[name])
            else:
                names[name] = ("activation_encodings", name.removesuffix("_fake_quant"))
    return names


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that it is either the whole new file or untouched:
    a temporary file in the same directory (same filesystem), then ``os.replace``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_encodings(gm: nn.Module, path: str | Path) -> None:
    """Write every quantizer's encoding to ``path`` (JSON), atomically.

    Refuses (``QCompileError``, no file written) a graph whose activation quantizers never
    observed data: a static graph before ``qc.calibrate``, a QAT graph before training."""
    mode = report(gm).mode
    refuse_pending(gm, "export_encodings")
    missing = uncalibrated(gm, mode)
    if missing:
        fix = ("run qc.calibrate(gm, batches) first" if mode == "static" else
               "train it for some steps first (observers learn ranges in train mode)")
        raise QCompileError(f"export_encodings: {len(missing)} activation quantizer(s) have "
                            f"no ranges yet (their scales are placeholders), e.g. "
                            f"{missing[0]}", fix=fix)
    data: dict[str, Any] = {"version": VERSION, "producer": f"qcompile {__version__}",
                            "param_encodings": {}, "activation_encodings": {}}
    for name, (section, key) in _names(gm).items():
        fq = gm.get_submodule(name)
        if fq.dynamic or fq.granularity == "per_token":
            data[section][key] = [{"dynamic": True, "bitwidth": _bits(fq),
                                   "is_symmetric": fq.symmetric,
                                   "granularity": fq.granularity}]
        else:
            data[section][key] = _entries(fq)
    target = Path(path)
    if target.is_dir():
        raise QCompileError(f"export_encodings: {str(path)!r} is a directory",
                            fix="give a file path, e.g. model.encodings")
    if not target.parent.is_dir():
        raise QCompileError(f"export_encodings: directory {str(target.parent)!r} does not "
                            "exist", fix="create it first or write somewhere else")
    # allow_nan=False: a NaN/inf scale that slipped through must not become a file that
    # only Python's json reads back.
    _write_atomically(target, json.dumps(data, indent=1, allow_nan=False) + "\n")


def _number(value: object) -> float | None:
    """``value`` as a float if it is a JSON number (not a bool, not a string), else None."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    return float(value)


def _checked(path: str | Path, section: str, key: str, name: str, fq: FakeQuantize,
             entries: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scale, zero_point) tensors of one quantizer's entries, or a ``QCompileError``
    naming the entry and its bad value."""
    fix = ("re-export the encodings with qc.export_encodings from a calibrated graph, or "
           "correct the entry")

    where = f"{section}[{key!r}] (quantizer {name})"

    def bad(what: str) -> QCompileError:
        return QCompileError(f"encodings file {path}: {where}: {what}", fix=fix)

    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise bad(f"expected a list of encoding objects, got {type(entries).__name__}")
    if len(entries) != fq.scale.numel():
        raise QCompileError(f"encodings file {path}: {key} has {len(entries)} scale(s), "
                            f"the graph's quantizer {name} {fq.scale.numel()}",
                            fix="export the encodings from the same graph")
    scales, zero_points = [], []
    for i, e in enumerate(entries):
        for field in ("scale", "zero_point"):
            if field not in e:
                raise bad(f"entry [{i}] has no {field!r}")
        s, z = _number(e["scale"]), _number(e["zero_point"])
        if s is None:
            raise bad(f"entry [{i}] scale {e['scale']!r} is not a number")
        if not math.isfinite(s) or s <= 0:
            raise bad(f"entry [{i}] scale {e['scale']!r}: a scale must be a finite number > 0")
        if z is None or not z.is_integer():
            raise bad(f"entry [{i}] zero_point {e['zero_point']!r} is not an integer")
        if not fq.quant_min <= z <= fq.quant_max:
            raise bad(f"entry [{i}] zero_point {e['zero_point']!r} is outside the quantizer's "
                      f"range [{fq.quant_min}, {fq.quant_max}]")
        scales.append(s)
        zero_points.append(int(z))
    scale = torch.tensor(scales, dtype=fq.scale.dtype).view_as(fq.scale)
    # A scale fine as a Python float can leave the quantizer's float32 range (1e-50 -> 0,
    # 1e39 -> inf): check what would be stored.
    if not bool((scale.isfinite() & (scale > 0)).all()):
        i = int((~(scale.isfinite() & (scale > 0))).reshape(-1).nonzero()[0])
        raise bad(f"entry [{i}] scale {scales[i]!r} is not a finite number > 0 in "
                  f"{str(fq.scale.dtype).removeprefix('torch.')}")
    return scale, torch.tensor(zero_points, dtype=fq.zero_point.dtype).view_as(fq.zero_point)


def load_encodings(gm: nn.Module, path: str | Path) -> nn.Module:
    """Apply an encodings file to ``gm``'s quantizers (then frozen and enabled).

    Every entry is checked before any is applied: a refused file leaves ``gm`` as it was."""
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
        if fq.dynamic or fq.granularity == "per_token":
            continue
        if key not in data.get(section, {}):
            raise QCompileError(f"encodings file {path}: {key!r} is not under {section} "
                                "(the graph's quantizer for it is of the other kind)",
                                fix="export the encodings from the same graph")
        updates.append((fq, *_checked(path, section, key, name, fq, data[section][key])))
    with torch.no_grad():
        for fq, scale, zero_point in updates:
            fq.scale.copy_(scale)
            fq.zero_point.copy_(zero_point)
            fq.observe = False
            fq.enabled = True
    return gm
