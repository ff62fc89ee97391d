"""Deterministic text dumps of a graph (golden tests, per-pass dumps, the inspect tool).

One line per node: name, op, target, arguments, and the qcompile annotations that
matter (shape, rule, scheme, fusion group). No memory addresses, so dumps compare across
runs. Floats (scales and clamp bounds baked into a converted graph) are printed to
``FLOAT_DIGITS`` significant digits, so dumps also compare across CPUs.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    >>> print(format_graph(gm))
    input_1  placeholder    input
    _0       call_module    0(input_1)
    output   output         output(_0)
"""

from __future__ import annotations

from pathlib import Path

import torch.fx
from torch.fx.node import Node, _get_qualified_name

from qcompile.files import write_atomically
from qcompile.graph.context import Context
from qcompile.graph.meta import FUSION_KEY, QSCHEME_KEY, TENSOR_META
from qcompile.graph.records import PassRecord, Report


def _target(node: Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    if hasattr(t, "overloadpacket") or hasattr(t, "_overloadpacket"):
        return str(t)
    try:
        return _get_qualified_name(t)
    except Exception:
        return getattr(t, "__name__", repr(t))


# Significant digits of the floats in a dump. Scales and ranges come from observed min/max
# of float32 kernels (convolutions, matmuls) whose rounding depends on the instruction set
# (AVX2, AVX-512 VNNI, baseline) and the summation order: they agree to a few float32 ulps,
# about 1e-6 relative, which already changes the 8th significant digit. Four digits (a
# 1e-3..1e-4 relative step) keep every structural fact of a dump and hold on every CPU;
# numbers that matter to more digits are asserted numerically by the tests, not by dumps.
FLOAT_DIGITS = 4


def _float(x: float) -> str:
    """``x`` rounded to ``FLOAT_DIGITS`` significant digits, written as Python writes a
    float (``0.05755``, ``3.0``, ``1e-05``, ``inf``) so it still reads as a float."""
    return repr(float(f"{x:.{FLOAT_DIGITS}g}"))


def _arg(a: object) -> str:
    if isinstance(a, float):
        return _float(a)
    if isinstance(a, Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return str(a)
    return repr(a)


def _annotations(node: Node) -> str:
    parts = []
    tm = node.meta.get(TENSOR_META)
    if tm is not None and hasattr(tm, "shape"):
        parts.append(f"shape={list(tm.shape)}")
    qs = node.meta.get(QSCHEME_KEY)
    if qs is not None:
        parts.append(qs.describe())
    fusion = node.meta.get(FUSION_KEY)
    if fusion is not None:
        parts.append("fusion=" + "+".join(fusion))
    return "  # " + " ".join(parts) if parts else ""


def format_graph(gm: torch.fx.GraphModule) -> str:
    nodes = list(gm.graph.nodes)
    width = max((len(n.name) for n in nodes), default=0)
    lines = []
    for n in nodes:
        args = ", ".join([_arg(a) for a in n.args]
                         + [f"{k}={_arg(v)}" for k, v in n.kwargs.items()])
        call = _target(n) if n.op in ("placeholder", "get_attr") else f"{_target(n)}({args})"
        lines.append(f"{n.name:<{width}}  {n.op:<13}  {call}{_annotations(n)}".rstrip())
    return "\n".join(lines)


class GraphDumps:
    """Instrument writing ``NN_<pass>.txt`` graph dumps and ``report.json`` into a folder.

    Example:
        >>> import torch, tempfile, qcompile as qc
        >>> d = tempfile.mkdtemp()
        >>> gm = qc.qcompile(torch.nn.Linear(2, 2), qc.CompileSpec(), instruments=[GraphDumps(d)])
        >>> sorted(p.name for p in Path(d).iterdir())[:1]
        ['01_trace.txt']
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def after_pass(
        self, index: int, record: PassRecord, gm: torch.fx.GraphModule, ctx: Context
    ) -> None:
        text = format_graph(gm) + "\n"
        write_atomically(self.directory / f"{index:02d}_{record.name}.txt", text)

    def finish(self, report: Report, gm: torch.fx.GraphModule) -> None:
        write_atomically(self.directory / "report.json", report.model_dump_json(indent=2) + "\n")
