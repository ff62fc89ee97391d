"""``trace``: capture the model as a ``torch.fx.GraphModule`` and record tensor shapes.

Two front ends, chosen by ``trace.method``: ``symbolic`` (torch.fx symbolic tracing, with
leaf modules and concrete arguments from ``spec.trace``), ``export`` (torch.export, see
``qcompile.export_capture``; needs example inputs), and ``auto`` (symbolic first, export
when symbolic tracing fails; the Report notes why). Both work on a copy: the user's
model is never touched. On symbolic graphs with example inputs (the argument, or
``spec.trace.inputs``), ``ShapeProp`` records ``node.meta["tensor_meta"]``; it runs in
eval mode under ``no_grad`` so BatchNorm statistics and the RNG are left as they were.
Export graphs take their shapes from export's own fake values.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.context import Context
    >>> from qcompile.passes import trace
    >>> ctx = Context(spec=qc.CompileSpec(), model=torch.nn.Sequential(torch.nn.Linear(3, 2)),
    ...               example_inputs=(torch.randn(1, 3),))
    >>> gm = trace(None, ctx)
    >>> [n.meta["tensor_meta"].shape for n in gm.graph.nodes if n.op == "call_module"]
    [torch.Size([1, 2])]
"""

from __future__ import annotations

import copy
import fnmatch
import inspect
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node, Tracer
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import ShapeProp, _extract_tensor_metadata

from qcompile.context import Context
from qcompile.distributed import refuse_wrapped
from qcompile.errors import QCompileError
from qcompile.export_capture import export_graph
from qcompile.matching import ROOT_CLASS_KEY
from qcompile.pipeline import graph_pass
from qcompile.state_layout import keep_state_layout


class _Tracer(Tracer):
    """symbolic tracing with spec-given leaf modules; remembers which module it was in
    when tracing fails, so the error can name it."""

    def __init__(self, leaf_patterns: list[str]) -> None:
        super().__init__()
        self.leaf_patterns = leaf_patterns
        self.used_patterns: set[str] = set()
        self.path: list[tuple[str, str]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
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


class _TraceFailure(QCompileError):
    """Symbolic tracing could not capture the model (``auto`` then tries torch.export)."""


class _ShapeProp(ShapeProp):
    """ShapeProp that records which node ran last and leaves error reporting to us
    (torch's prints a traceback to stderr before raising)."""

    def run_node(self, n: Node) -> Any:
        self.current = n
        result = Interpreter.run_node(self, n)
        tensors = []

        def extract(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
                return _extract_tensor_metadata(obj)
            return obj

        meta = map_aggregate(result, extract)
        if tensors:
            n.meta["tensor_meta"] = meta
        n.meta["type"] = type(result)
        return result


def example_args(gm: GraphModule, ctx: Context) -> list[Any] | None:
    """Positional arguments for the graph's placeholders from the example inputs (or the
    spec's ``trace.inputs``), with keyword inputs placed by name; None without inputs."""
    inputs = _inputs(ctx)
    if inputs is None:
        return None
    kwargs = dict(ctx.example_kwargs or {})
    concrete = ctx.spec.trace.concrete_args
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # fx may rename a placeholder (``double`` -> ``double_1``); the forward() signature
    # gives the real parameter names, one per placeholder, in order.
    names = _forward_params(ctx.model)
    if len(names) != len(placeholders):
        names = [str(p.target) for p in placeholders]
    args = list(inputs)
    for p, name in list(zip(placeholders, names))[len(args):]:
        if name in concrete:
            args.append(concrete[name])
        elif name in kwargs:
            args.append(kwargs.pop(name))
        elif p.args:
            args.append(p.args[0])  # the parameter's default
        else:
            raise QCompileError(
                f"input {name!r} of the model has no example value",
                fix=f"pass it in example_inputs or example_kwargs={{'{name}': ...}}")
    if len(args) > len(placeholders):
        raise QCompileError(
            f"{len(args)} example inputs given, the traced model takes {len(placeholders)} "
            f"({', '.join(str(p.target) for p in placeholders)})",
            fix="pass one example value per model input")
    if kwargs:
        raise QCompileError(f"example_kwargs names {sorted(kwargs)}, which the model does not "
                            "take", fix="remove them or check the forward() signature")
    return args


def _forward_params(model: nn.Module) -> list[str]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _propagate_shapes(gm: GraphModule, args: list[Any]) -> None:
    modes = {name: m.training for name, m in gm.named_modules()}
    gm.eval()
    prop = _ShapeProp(gm)
    try:
        with torch.no_grad():
            prop.propagate(*args)
    except Exception as e:
        node = getattr(prop, "current", None)
        where = f"node {node.name!r} ({node.format_node()})" if node is not None else "the model"
        cause = e.__cause__ or e
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise QCompileError(
            f"running {where} on the example inputs failed: {type(cause).__name__}: {first}",
            fix="check the shapes and dtypes of example_inputs / trace.inputs",
        ) from e
    finally:
        for name, m in gm.named_modules():
            m.training = modes.get(name, m.training)


def _inputs(ctx: Context) -> tuple[Any, ...] | None:
    if ctx.example_inputs is not None:
        return ctx.example_inputs
    if ctx.spec.trace.inputs is not None:
        return tuple(torch.zeros(i.shape, dtype=getattr(torch, i.dtype))
                     for i in ctx.spec.trace.inputs)
    return () if ctx.example_kwargs else None


def _symbolic(ctx: Context) -> GraphModule:
    """torch.fx symbolic tracing; raises ``_TraceFailure`` when the model cannot be traced."""
    model = ctx.model
    root = model if ctx.inplace else copy.deepcopy(model)
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
        raise _TraceFailure(f"symbolic tracing failed in {where}: {type(e).__name__}: {e}",
                            fix=fix) from e
    for p in sorted(set(ctx.spec.trace.leaf_modules) - tracer.used_patterns):
        ctx.note(f"trace.leaf_modules entry {p!r} matched no module")
    gm = GraphModule(tracer.root, graph, type(model).__name__)
    keep_state_layout(gm, tracer.root)
    return gm


def _export(ctx: Context, symbolic_error: _TraceFailure | None) -> GraphModule:
    inputs = _inputs(ctx)
    earlier = f"{symbolic_error.message}\n  " if symbolic_error is not None else ""
    if inputs is None:
        raise QCompileError(
            f"{earlier}the torch.export front end needs example inputs",
            fix="pass example_inputs (and example_kwargs) to qcompile, or set trace.inputs"
            + (f"; or for symbolic tracing: {symbolic_error.fix}" if symbolic_error else ""))
    try:
        gm, notes = export_graph(ctx.model, inputs, dict(ctx.example_kwargs or {}),
                                 ctx.spec.trace.dynamic_dims, inplace=ctx.inplace)
    except QCompileError:
        raise
    except Exception as e:
        text = str(e).strip()
        first = text.splitlines()[0] if text else ""
        if ctx.spec.trace.dynamic_dims and ("Constraints violated" in text
                                            or "Suggested fixes" in text):
            hints = text.split("Suggested fixes:", 1)[1].strip() if (
                "Suggested fixes:" in text) else ""
            hints = " ".join(line.strip() for line in hints.splitlines()[:6] if line.strip())
            raise QCompileError(
                f"trace.dynamic_dims: torch.export cannot keep these dims dynamic: {first} "
                f"{hints}".rstrip(),
                fix="bound the dims in the spec, e.g. {1: {name: seq, max: 64}} for export's "
                "Dim('seq', max=64), or leave them static") from e
        fix = ("make the failing code exportable (torch.export guidance: "
               "https://pytorch.org/docs/stable/export.html, e.g. torch.cond for data-dependent "
               "branches, no .item() in forward), or keep the module out of the graph with "
               "trace.leaf_modules and trace.method: symbolic")
        if symbolic_error is not None:
            fix = f"{symbolic_error.fix}; or {fix}"
        raise QCompileError(f"{earlier}torch.export failed: {type(e).__name__}: {first}",
                            fix=fix) from e
    for note in notes:
        ctx.note(note)
    return gm


@graph_pass(requires=("model",), provides=("graph",))
def trace(gm: GraphModule | None, ctx: Context) -> GraphModule:
    """Capture ``ctx.model`` (a copy of it) as a GraphModule: symbolic tracing, torch.export,
    or symbolic first and export when it fails (``trace.method: auto``)."""
    model = ctx.model
    refuse_wrapped(model)
    params = _forward_params(model)
    unknown = sorted(set(ctx.spec.trace.concrete_args) - set(params)) if params else []
    if unknown:
        raise QCompileError(f"trace.concrete_args names {unknown}, which forward() does not "
                            f"take (it takes {', '.join(params)})",
                            fix="use the names of forward()'s parameters")
    method = ctx.spec.trace.method
    failure: _TraceFailure | None = None
    if method in ("auto", "symbolic"):
        try:
            gm = _symbolic(ctx)
        except _TraceFailure as e:
            if method == "symbolic":
                raise QCompileError(e.message, fix=e.fix) from e.__cause__
            failure = e
        else:
            gm.meta[ROOT_CLASS_KEY] = type(model)
            ctx.trace_method = "symbolic"
            args = example_args(gm, ctx)
            if args is not None:
                _propagate_shapes(gm, args)
                ctx.has_shapes = True
            else:
                ctx.note("no example inputs: shapes unknown (pass example_inputs or "
                         "trace.inputs)")
            return gm
    gm = _export(ctx, failure)
    gm.meta[ROOT_CLASS_KEY] = type(model)
    ctx.trace_method = "export"
    ctx.has_shapes = True
    if failure is not None:
        ctx.note(f"captured with torch.export: {failure.message.splitlines()[0]}")
    return gm
