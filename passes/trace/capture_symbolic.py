"""The symbolic front end: torch.fx symbolic tracing with the spec's leaf modules and
concrete arguments (``spec.trace``), on a copy of the model (the model itself with
``inplace``).

When tracing fails, ``TraceFailure`` names the innermost module being traced and the
spec field that would get past it; ``trace.method: auto`` then tries torch.export.

What the forward does besides its tensor operations is kept or refused, never dropped in
silence (``forward_effects``): hooks of leaf modules run on every call of the graph; value-
returning hooks of the root and of traced-through modules are traced into the graph;
side-effect-only hooks, backward hooks there, assigned attributes and in-place tensor
updates (a ``TraceFailure``: torch.export keeps those) are refused; a class reading
``self.training`` is traced in both modes, and the graphs must agree (functional dropouts
aside, which become dropout modules that follow ``.train()`` / ``.eval()``).

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

import contextlib
import fnmatch
import re
from collections.abc import Sequence

from torch import nn
from torch.fx import Graph, GraphModule, Tracer

import qcompile.passes.trace.forward_effects as fx_effects
from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.state_layout import keep_root_persistence, keep_state_layout
from qcompile.passes.trace.explain import explain
from qcompile.passes.trace.model_copy import copy_model


class _Tracer(Tracer):
    """symbolic tracing with spec-given leaf modules; remembers which module it was in
    when tracing fails, so the error can name it, which modules it traced through
    (``entered``), and the hooks of those (and of the root) that the graph cannot keep
    (``dropped``; see ``forward_effects``). The root's forward hooks and pre-hooks run
    around its forward as ``nn.Module.__call__`` runs them (fx calls ``forward`` alone).

    Its class is recorded on the GraphModule (``_tracer_cls``), and torch.load re-traces a
    saved graph with a subclass built without arguments: hence the default."""

    def __init__(self, leaf_patterns: Sequence[str] = ()) -> None:
        super().__init__()
        self.leaf_patterns = list(leaf_patterns)
        self.used_patterns: set[str] = set()
        self.path: list[tuple[str, str]] = []
        self.entered: dict[str, type] = {}
        self.dropped: list[fx_effects.DroppedHook] = []

    def _is_leaf(self, m: nn.Module, module_qualified_name: str) -> bool:
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
        name = self.path_of_module(m)
        self.path.append((name, type(m).__name__))
        if fx_effects.has_hooks(m) and not self.is_leaf_module(m, name):
            def forward(*a, **k):  # the module's own forward, its hooks run by us
                return fx_effects.call_with_hooks(m, name, m.forward, a, k, self.dropped)
        out = super().call_module(m, forward, args, kwargs)
        self.path.pop()  # left in place when tracing raises: the innermost module failed
        return out

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        leaf = self._is_leaf(m, module_qualified_name)
        if not leaf:
            self.entered.setdefault(module_qualified_name, type(m))
        return leaf

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):  # type: ignore
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        root = self.root
        if not is_module or not fx_effects.has_hooks(root):
            return fn, args

        def with_hooks(this, *a):
            def forward(*b, **k):
                return fn(this, *b, **k)
            return fx_effects.call_with_hooks(root, "", forward, a, {}, self.dropped)
        return with_hooks, args


class TraceFailure(QCompileError):
    """Symbolic tracing could not capture the model (``auto`` then tries torch.export).
    ``reason``: why, in one sentence for the Report (``"<Class>.forward <what it does>
    (<where>; torch.fx said: ...)"``); the message when there is none."""

    def __init__(self, message: str, *, fix: str | None = None, reason: str | None = None
                 ) -> None:
        super().__init__(message, fix=fix)
        self.reason = reason or message.splitlines()[0]


def capture(ctx: Context) -> GraphModule:
    """torch.fx symbolic tracing; raises ``TraceFailure`` when the model cannot be traced."""
    model = ctx.model
    root = model if ctx.inplace else copy_model(model)
    marks = fx_effects.StateMarks.of(root)
    graph: Graph | None = None
    try:
        tracer, graph = _trace(root, ctx)
    finally:
        own = _tracer_constants(graph)
        changes = [c for c in marks.changes()
                   if not (c.module == "" and c.what == "attribute" and c.name in own)]
        if changes and ctx.inplace:
            # the model itself was traced: put back what forward assigned
            marks.restore(keep=own)
    _refuse_lost_effects(tracer, changes)
    _refuse_mode_branches(root, graph, tracer, ctx)
    for p in sorted(set(ctx.spec.trace.leaf_modules) - tracer.used_patterns):
        ctx.note(f"trace.leaf_modules entry {p!r} matched no module")
    _resolve_annotations(graph, model)
    gm = _graph_module(tracer.root, graph, type(model).__name__,
                       generate_code=not ctx.code_may_wait)
    keep_state_layout(gm, tracer.root)
    keep_root_persistence(gm)
    return gm


_CONSTANT = re.compile(r"_[a-z_]*constant\d+|_torchbind_obj\d+")


def _tracer_constants(graph: Graph | None) -> frozenset[str]:
    """The attributes torch.fx's tracer itself set on the root: tensors the forward
    created (``torch.tensor([...])``) are stored as ``_tensor_constant<i>`` and read by a
    ``get_attr`` node. Not the forward's own assignments."""
    if graph is None:
        return frozenset()
    return frozenset(str(n.target) for n in graph.nodes
                     if n.op == "get_attr" and _CONSTANT.fullmatch(str(n.target)))


def _trace(root: nn.Module, ctx: Context) -> tuple[_Tracer, Graph]:
    model = ctx.model
    tracer = _Tracer(list(ctx.spec.trace.leaf_modules))
    concrete = dict(ctx.spec.trace.concrete_args) or None
    try:
        graph = tracer.trace(root, concrete_args=concrete)
    except Exception as e:
        owner = root
        if tracer.path:
            name, cls = tracer.path[-1]
            where = f"module {name!r} ({cls})"
            with contextlib.suppress(AttributeError):
                owner = root.get_submodule(name)
            fix = (f"add it to trace.leaf_modules (e.g. leaf_modules: [{cls}]) so it stays one "
                   "node, or pass concrete_args for arguments used in Python control flow")
        else:
            where = f"the forward of {type(model).__name__}"
            fix = ("pass concrete_args for arguments used in Python control flow, or move the "
                   "control flow into a submodule listed in trace.leaf_modules")
        why = explain(e, getattr(type(owner), "forward", None))
        subject = f"{type(owner).__name__}.forward"
        inside = f" (module {tracer.path[-1][0]!r})" if tracer.path else ""
        raise TraceFailure(
            f"symbolic tracing failed in {where}: {subject} {why.what} ({why.detail()})",
            fix=fix, reason=f"symbolic tracing failed, it cannot follow {subject}{inside}: it "
                            f"{why.what} ({why.detail()})") from e
    return tracer, graph


def _refuse_lost_effects(tracer: _Tracer, changes: list[fx_effects.Change]) -> None:
    """Hooks the graph cannot run, then side effects of forward it would not repeat.
    In-place tensor updates are a ``TraceFailure``: ``trace.method: auto`` then captures
    the model with torch.export, which keeps them (as graph mutations). An assigned
    attribute is refused outright: torch.export restores the model's attributes after
    its run, so its graph would not assign it either."""
    if tracer.dropped:
        msg, fix = fx_effects.hook_refusal(tracer.dropped[0])
        raise QCompileError(msg, fix=fix)
    assigned = [c for c in changes if c.what == "attribute"]
    if assigned:  # not a TraceFailure: torch.export would drop the assignment too
        msg, fix = fx_effects.refusal_for(assigned[0], symbolic=True)
        raise QCompileError(msg, fix=fix)
    if changes:
        msg, fix = fx_effects.refusal_for(changes[0], symbolic=True)
        raise TraceFailure(msg, fix=fix)


def _refuse_mode_branches(root: nn.Module, graph: Graph, tracer: _Tracer, ctx: Context
                          ) -> None:
    """Symbolic tracing bakes in the branch of ``if self.training:`` taken in the mode the
    model is in, and the graph's ``.train()`` / ``.eval()`` would not switch it back.
    When a traced class reads ``training`` (only then: a second trace costs as much as
    the first), trace again with every module in the other mode. Graphs that differ only
    in functional dropouts' ``training`` argument are kept, each such dropout becoming a
    dropout module that follows the mode (``keep_mode_dropouts``); any other difference
    is refused, naming the module where the graphs part."""
    classes = {type(root), *tracer.entered.values()}
    readers = {c for c in classes if fx_effects.reads_training(c)}
    if not readers:
        return
    modules = list(root.modules())
    flags = [m.training for m in modules]
    for m, flag in zip(modules, flags):
        m.training = not flag
    try:
        _, other = _trace(root, ctx)
    except QCompileError:
        return  # the other mode does not trace at all: nothing to compare with
    finally:
        for m, flag in zip(modules, flags):
            m.training = flag
    ours, theirs = fx_effects.node_signature(graph), fx_effects.node_signature(other)
    if ours == theirs or fx_effects.keep_mode_dropouts(root, graph, other):
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
              min(len(ours), len(theirs)))
    owners = []  # the innermost module reading the flag around where the graphs part
    for g in (graph, other):
        nodes = list(g.nodes)
        stack = nodes[min(at, len(nodes) - 1)].meta.get("nn_module_stack", {}) if nodes else {}
        owners += [(name, cls) for name, cls in reversed(list(stack.values()))
                   if isinstance(cls, type) and cls in readers]
    owners += [(name, cls) for name, cls in tracer.entered.items() if cls in readers]
    name, cls = owners[0] if owners else ("", type(root))
    mode = "train" if root.training else "eval"
    where = f"module {name!r} ({cls.__name__})" if name else f"the model ({cls.__name__})"
    leaf = (f"list it in trace.leaf_modules (leaf_modules: [{cls.__name__}]) so it runs its "
            "own forward, which switches, or " if name else
            "move the branch into a submodule listed in trace.leaf_modules, or ")
    raise QCompileError(
        f"trace: {where} reads self.training in forward() and traces to a different graph "
        f"in train and eval mode; the graph would keep the {mode}-mode branch whatever "
        ".train() / .eval() says",
        fix=f"{leaf}remove the branch (e.g. use an nn.Dropout module instead of "
            "F.dropout(..., training=self.training))")


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


def refuse_lost_leaf_hooks(model: nn.Module, gm: GraphModule, leaf_patterns: Sequence[str],
                           mode: str) -> None:
    """After the passes: a module with hooks that symbolic tracing kept as a call (a leaf,
    whose hooks run on every call) but that a later pass replaced by operations (quantized
    weighted layers, folded BatchNorm) would lose its hooks in silence: refuse, naming the
    module and the hook. Modules traced through were checked while tracing."""
    tracer = _Tracer(leaf_patterns)
    called = {str(n.target) for sub in gm.modules() if isinstance(sub, GraphModule)
              for n in sub.graph.nodes if n.op == "call_module"}
    inside: list[str] = []  # leaves and what is under them: not called by the graph
    for name, m in model.named_modules():
        if not name or any(name.startswith(p + ".") for p in inside):
            continue
        if not tracer._is_leaf(m, name):
            continue
        inside.append(name)
        if not fx_effects.has_hooks(m) or name in called or any(
                t.endswith("." + name) for t in called):
            continue
        hooks = [("forward pre-hook", h) for h in m._forward_pre_hooks.values()] + [
            ("forward hook", h) for h in m._forward_hooks.values()] + [
            ("backward hook", h) for h in (*m._backward_pre_hooks.values(),
                                           *m._backward_hooks.values())]
        kind, hook = hooks[0]
        hook_name = getattr(hook, "__qualname__", None) or type(hook).__name__
        raise QCompileError(
            f"module {name!r} ({type(m).__name__}) has a {kind} {hook_name!r} that the "
            f"compiled graph would not run: quant.mode {mode!r} replaces the module's call "
            "by its quantized operations",
            fix=f"leave the module in float (a quant rule with match: {{name: {name!r}}} and "
                "skip: true) so the graph keeps calling it, or remove the hook before "
                "compiling and apply it outside the model")
