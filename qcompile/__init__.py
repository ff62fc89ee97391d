"""qcompile: a declarative graph-rewrite compiler for quantized, distributed PyTorch models.

The public names are loaded lazily so that ``import qcompile.specs`` (and
``qcompile-inspect validate``) never import torch.

Example:
    >>> import torch, qcompile as qc
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> gm = qc.qcompile(model, qc.load_spec("int8-qat"), example_inputs=(torch.randn(2, 8),))
    >>> sorted(qc.quantizers(gm))
    ['0.output_fake_quant', '0.weight_fake_quant', 'input_input_fake_quant']
"""

from __future__ import annotations

import importlib
from typing import Any

from qcompile.errors import QCompileError
from qcompile.version import __version__

# public name -> module that defines it
_LAZY = {
    "qcompile": "qcompile.compile",
    "report": "qcompile.api",
    "quantizers": "qcompile.api",
    "freeze": "qcompile.api",
    "calibrate": "qcompile.api",
    "convert": "qcompile.api",
    "export_encodings": "qcompile.deploy.encodings",
    "load_encodings": "qcompile.deploy.encodings",
    "export_onnx": "qcompile.deploy.onnx",
    "export_gguf": "qcompile.deploy.gguf",
    "save_pretrained": "qcompile.deploy.pretrained",
    "save_adapters": "qcompile.deploy.adapters",
    "merge_adapters": "qcompile.deploy.adapters",
    "sqnr": "qcompile.measure",
    "search": "qcompile.mixed_precision",
    "save_spec": "qcompile.specs",
    "Report": "qcompile.graph.records",
    "FakeQuantize": "qcompile.runtime.fake_quant",
    "Pass": "qcompile.graph.pipeline",
    "Pipeline": "qcompile.graph.pipeline",
    "Context": "qcompile.graph.context",
    "load_spec": "qcompile.specs",
    "CompileSpec": "qcompile.specs",
}
_SUBMODULES = ("distributed", "specs", "passes", "tools")

__all__ = ["QCompileError", "__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"qcompile.{name}")
    raise AttributeError(f"module 'qcompile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
