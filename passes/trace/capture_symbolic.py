"""The symbolic front end: torch.fx symbolic tracing with the spec's leaf modules and
concrete arguments (``spec.trace``), on a copy of the model (the model itself with
``inplace``).

When tracing fails, ``TraceFailure`` names the innermost module being traced and the
spec field that would get past it; ``trace.method: auto`` then tries torch.export.

Example:
    >>> import torch
    >>> from qcompile.graph.context import Context
    >>> from qcompile.passes.trace import capture_symbolic
    >>> from qcompile.specs import CompileSpec
    >>> class Gate(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x if x.sum() > 0 else -x  # branches on a value: not traceable
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), Gate())
    >>> try:
    ...     capture_symbolic.capture(Context(spec=CompileSpec(), model=model))
    ... except capture_symbolic.TraceFailure as e:
    ...     print(e.message.split(":")[0])
    symbolic tracing failed in module '1' (Gate)
    >>> spec = CompileSpec.model_validate({"trace": {"leaf_modules": ["Gate"]}})
    >>> gm = capture_symbolic.capture(Context(spec=spec, model=model))
    >>> [(n.op, n.target) for n in gm.graph.nodes if n.op == "call_module"]
    [('call_module', '0'), ('call_module', '1')]
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn
from torch.fx import Graph, GraphModule, Tracer

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.state_layout import keep_state_layout
from qcompile.passes.trace.model_copy import copy_model


class _Tracer(Tracer):
    """symbolic tracing with spec-given leaf modules; remembers which module it was in
    when tracing fails, so the error can name it.

    Its class is recorded on the GraphModule (``_tracer_cls``), and torch.load re-traces a
    saved graph with a subclass built without arguments: hence the default."""

    def __init__(self, leaf_patterns: Sequence[str] = ()) -> None:
        super().__init__()
        self.leaf_patterns = list(leaf_patterns)
        self.used_patterns: set[str] = set()
        self.path: list[tuple[str, str]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if not self.leaf_patterns:
            return super().is_leaf_module(m, module_qualified_name)
        cls = type(m)
        names = (cls.__name__, f"{cls.__module__}.{cls.__qualname__}", module_qualified_name)
        hits = [p for p in self.leaf_patterns if any(fnmatch.fnmatchcase(v, p) for v in names)]
        if hits:
            self.used_patterns.update(hits)
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):  # type: ignore[override]
        self.path.append((self.path_of_module(m), type(m).__name__))
        out = super().call_module(m, forward, args, kwargs)
        self.path.pop()  # left in place when tracing raises: the innermost module failed
        return out


class TraceFailure(QCompileError):
    """Symbolic tracing could not capture the model (``auto`` then tries torch.export)."""


def capture(ctx: Context) -> GraphModule:
    """torch.fx symbolic tracing; raises ``TraceFailure`` when the model cannot be traced."""
    model = ctx.model
    root = model if ctx.inplace else copy_model(model)
    tracer = _Tracer(list(ctx.spec.trace.leaf_modules))
    concrete = dict(ctx.spec.trace.concrete_args) or None
    try:
        graph = tracer.trace(root, concrete_args=concrete)
    except Exception as e:
        if tracer.path:
            name, cls = tracer.path[-1]
            where = f"module {name!r} ({cls})"
            fix = (f"add it to trace.leaf_modules (e.g. leaf_modules: [{cls}]) so it stays one "
                   "node, or pass concrete_args for arguments used in Python control flow")
        else:
            where = f"the forward of {type(model).__name__}"
            fix = ("pass concrete_args for arguments used in Python control flow, or move the "
                   "control flow into a submodule listed in trace.leaf_modules")
        raise TraceFailure(f"symbolic tracing failed in {where}: {type(e).__name__}: {e}",
                           fix=fix) from e
    for p in sorted(set(ctx.spec.trace.leaf_modules) - tracer.used_patterns):
        ctx.note(f"trace.leaf_modules entry {p!r} matched no module")
    _resolve_annotations(graph, model)
    gm = _graph_module(tracer.root, graph, type(model).__name__,
                       generate_code=not ctx.code_may_wait)
    keep_state_layout(gm, tracer.root)
    return gm


def _graph_module(root: nn.Module, graph: Graph, name: str, *, generate_code: bool
                  ) -> GraphModule:
    """``GraphModule(root, graph, name)``; without ``generate_code``, minus the code of the
    graph, which its constructor generates (the graph setter recompiles) and the pipeline
    generates again after the passes that rewrite the graph next. Until then the module
    has no ``forward`` or ``code`` (either raises), so stale code never runs."""
    if generate_code:
        return GraphModule(root, graph, name)
    gm = GraphModule.__new__(GraphModule, root, graph, name)
    gm.__dict__["recompile"] = _no_code  # shadows the method for the constructor only
    try:
        GraphModule.__init__(gm, root, graph, name)
    finally:
        del gm.__dict__["recompile"]
    return gm


def _no_code() -> None:
    return None


def _resolve_annotations(graph: Graph, model: nn.Module) -> None:
    """Turn string annotations (``from __future__ import annotations`` in the model's
    file) into the types they name, or drop them: fx puts a string type into the
    generated code's globals, where torch.save cannot name it."""
    namespace = dict(getattr(type(model).forward, "__globals__", {}))
    for node in graph.nodes:
        if isinstance(node.type, str):
            try:
                node.type = eval(node.type, namespace)
            except Exception:  # an annotation that does not evaluate here: no annotation
                node.type = None
            if not isinstance(node.type, type) and node.type is not None and not hasattr(
                    node.type, "__origin__"):
                node.type = None
