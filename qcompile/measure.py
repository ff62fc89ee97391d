"""Measuring a compiled graph against its float model: per-layer SQNR (``qc.sqnr``).

Measuring never changes what it measures: ``qcompile.graph.running.untouched`` runs the
graph in eval mode with every observer off and afterwards puts back each module's
training flag, each quantizer's ``enabled`` / ``observe`` flags and every buffer
(observer statistics, BatchNorm running statistics), so the state_dict is bit-identical
and an uncalibrated graph is not calibrated by the batches it was measured on.

Example:
    >>> import torch, qcompile as qc
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> batches = [torch.randn(4, 8) for _ in range(2)]
    >>> gm = qc.calibrate(qc.qcompile(model, "int8-static", example_inputs=(batches[0],)), batches)
    >>> [r["sqnr_db"] > 20 for r in qc.sqnr(gm, model, batches)]  # the ReLU's output
    [True]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.fx import Interpreter

from qcompile.compile import qcompile
from qcompile.errors import QCompileError
from qcompile.graph.meta import MODULE_KEY, SPEC_KEY
from qcompile.graph.running import untouched
from qcompile.runtime.fake_quant import FakeQuantize


def _sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    noise = (ref - out).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def sqnr(gm: nn.Module, reference_model: nn.Module, batches: Iterable[Any]
         ) -> list[dict[str, Any]]:
    """Per quantized activation, SQNR (dB) of the node's output against the float
    model's, averaged over ``batches``, worst first: ``[{"node": ..., "sqnr_db": ...}]``.

    ``gm`` is used as it is (qparams as they are; freeze or calibrate it first), in eval
    mode with its observers off; afterwards it (and ``reference_model``, which is only
    copied) is exactly as before: measuring never calibrates or trains anything."""
    if any(name.startswith("stage_") for name, _ in gm.named_children()):
        raise QCompileError("qc.sqnr measures unsplit graphs",
                            fix="compile without the pipeline section for the error report")
    batches = [b if isinstance(b, (tuple, list)) else (b,) for b in batches]
    if not batches:
        raise QCompileError("qc.sqnr: no batches were given", fix="pass a non-empty iterable")
    spec = gm.meta.get(SPEC_KEY)
    trace = spec.trace.model_dump() if spec is not None else {}
    float_gm = qcompile(reference_model, {"quant": {"mode": "none"}, "trace": trace},
                        batches[0]).eval()
    float_names = {n.name for n in float_gm.graph.nodes}
    by_module = {str(n.target): n.name for n in float_gm.graph.nodes if n.op == "call_module"}

    def float_name(src: Any) -> str | None:
        # re-expressed Linear/Conv calls are renamed: match them by their module
        module = src.meta.get(MODULE_KEY)
        if module is not None and module in by_module:
            return by_module[module]
        return src.name if src.name in float_names else None

    class Record(Interpreter):
        def __init__(self, g: Any) -> None:
            super().__init__(g)
            self.values: dict[str, Any] = {}

        def run_node(self, n: Any) -> Any:
            out = super().run_node(n)
            self.values[n.name] = out
            return out

    results: dict[str, list[float]] = {}
    with untouched(gm):
        for batch in batches:
            q, f = Record(gm), Record(float_gm)
            q.run(*batch)
            f.run(*batch)
            for n in gm.graph.nodes:
                if n.op != "call_module" or not isinstance(gm.get_submodule(str(n.target)),
                                                           FakeQuantize):
                    continue
                src = n.args[0]
                name = float_name(src) if src.op != "get_attr" else None
                if name is None or name not in f.values:
                    continue
                a, b = f.values[name], q.values[n.name]
                if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
                        a.shape == b.shape):
                    results.setdefault(name, []).append(_sqnr_db(a, b))
    return sorted(({"node": k, "sqnr_db": sum(v) / len(v)} for k, v in results.items()),
                  key=lambda r: r["sqnr_db"])
