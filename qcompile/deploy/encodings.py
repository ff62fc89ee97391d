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
freezes the quantizers); a file for a different graph is refused.

Example:
    >>> import tempfile, os, torch, qcompile as qc
    >>> gm = qc.qcompile(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int8-qat")
    >>> path = os.path.join(tempfile.mkdtemp(), "model.encodings")
    >>> qc.export_encodings(gm, path)
    >>> with open(path) as f:
    ...     sorted(json.load(f)["param_encodings"])
    ['0.weight']
    >>> _ = qc.load_encodings(gm, path)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qcompile.errors import QCompileError
from qcompile.graph.records import report
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


def export_encodings(gm: nn.Module, path: str | Path) -> None:
    """Write every quantizer's encoding to ``path`` (JSON)."""
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
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def load_encodings(gm: nn.Module, path: str | Path) -> nn.Module:
    """Apply an encodings file to ``gm``'s quantizers (then frozen and enabled)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise QCompileError(f"encodings file {path}: {e}",
                            fix="pass a file written by qc.export_encodings") from None
    names = _names(gm)
    expected = {key for section, key in names.values()}
    given = set(data.get("param_encodings", {})) | set(data.get("activation_encodings", {}))
    if expected != given:
        missing, extra = sorted(expected - given), sorted(given - expected)
        raise QCompileError(f"encodings file {path} is for a different graph (missing "
                            f"{missing[:5]}, unknown {extra[:5]})",
                            fix="export the encodings from a graph compiled with the same "
                            "model and spec")
    with torch.no_grad():
        for name, (section, key) in names.items():
            fq = gm.get_submodule(name)
            entries = data[section][key]
            if fq.dynamic or fq.granularity == "per_token":
                continue
            if len(entries) != fq.scale.numel():
                raise QCompileError(f"encodings file {path}: {key} has {len(entries)} "
                                    f"scale(s), the graph's quantizer {fq.scale.numel()}",
                                    fix="export the encodings from the same graph")
            fq.scale.copy_(torch.tensor([e["scale"] for e in entries],
                                        dtype=fq.scale.dtype).view_as(fq.scale))
            fq.zero_point.copy_(torch.tensor([e["zero_point"] for e in entries],
                                             dtype=fq.zero_point.dtype))
            fq.observe = False
            fq.enabled = True
    return gm
