"""Specs shared by the conversion tests (``from convert_specs import spec``)."""

from __future__ import annotations

import qcompile as qc


def spec(preset: str, *, inputs: bool = True, **extra) -> qc.CompileSpec:
    """``preset`` with the model inputs quantized too (uint8, asymmetric), so the first
    layer reads integers, or (``inputs=False``) left in float whatever the preset says;
    and any top-level sections in ``extra`` replaced."""
    d = qc.load_spec(preset).model_dump()
    d["quant"]["inputs"] = {"dtype": "uint8", "symmetric": False} if inputs else None
    d.update(extra)
    return qc.CompileSpec.model_validate(d)
