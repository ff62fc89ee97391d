"""Deterministic text dumps of a graph (golden tests, per-pass dumps, the inspect tool).

One line per node: name, op, target, arguments, and the qcompile annotations that
matter (shape, rule, scheme, fusion group). No memory addresses, so dumps compare across
runs.

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


def _arg(a: object) -> str:
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
        (self.directory / f"{index:02d}_{record.name}.txt").write_text(text, encoding="utf-8")

    def finish(self, report: Report, gm: torch.fx.GraphModule) -> None:
        (self.directory / "report.json").write_text(report.model_dump_json(indent=2) + "\n",
                                                    encoding="utf-8")
