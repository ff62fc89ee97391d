"""What a model's forward does besides computing its outputs, and what a traced graph keeps.

A traced graph replays the tensor operations its forward did while it was traced; whatever
else the forward did happened once, at trace time, on the copy being traced. So the trace
checks what would otherwise be lost in silence, and keeps or refuses it:

- **Hooks.** A module the graph calls (a leaf: ``call_module``) runs its own hooks on every
  call: kept. Forward hooks and pre-hooks of a module that tracing goes through (and of the
  root, which ``torch.export`` also runs) are traced into the graph like its forward, when
  they return a value (they change the module's inputs or outputs): kept. A hook that
  returns None works by its side effects only (logging, collecting activations, a counter),
  which the graph would never repeat, and a backward hook there has no module to run on:
  refused (``hook_problems``), with the leaf-module fix.
- **Side effects.** A forward that assigns an attribute (``self.calls += 1``), or updates a
  parameter, buffer or tensor attribute in place (``self.count.add_(1)``) would do it only
  at trace time: ``StateMarks`` notes every module's attributes and tensor versions before
  the trace and names what changed after it (a cost of one dict per module).
- **``self.training`` branches.** Symbolic tracing takes the branch of the mode the model
  is in; ``.train()`` / ``.eval()`` on the graph would not switch it. Only classes whose
  code reads an attribute named ``training`` (``reads_training``) can branch on it; for
  those the trace is repeated in the other mode, and a different graph is refused. The
  torch.export front end traces in train mode (a second export would cost as much as the
  first) and notes the modules of such classes in the report instead
  (``capture_export.mode_branch_note``): dropout, BatchNorm and attention dropout follow
  the graph's mode there, other branches keep their train-mode path.
- **Names fx cannot write.** fx writes a module or parameter name that is not an identifier
  as ``getattr(self, "<name>")``, unescaped: a quote, a backslash or a line break in a
  ``ModuleDict`` / ``ParameterDict`` key would be a SyntaxError or another name
  (``unwritable_name``).
- **Old-style ``torch.nn.utils.weight_norm``** keeps its weight as a computed tensor that
  no copy of the model can hold (``old_weight_norm``); its successor
  ``torch.nn.utils.parametrizations.weight_norm`` compiles and trains ``g`` and ``v``.

Example:
    >>> import torch
    >>> class Counter(torch.nn.Linear):
    ...     def forward(self, x):
    ...         self.calls = getattr(self, "calls", 0) + 1
    ...         return super().forward(x)
    >>> m = Counter(2, 2)
    >>> marks = StateMarks.of(m)
    >>> _ = m(torch.ones(1, 2))
    >>> [(c.module, c.what, c.name) for c in marks.changes()]
    [('', 'attribute', 'calls')]
    >>> reads_training(Counter), reads_training(torch.nn.Linear)
    (False, False)
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.weight_norm import WeightNorm

# Attributes of every module that a forward never sets and the checks need not read.
_STRUCTURE = frozenset({"_parameters", "_buffers", "_modules", "training"})


@dataclass(frozen=True)
class Change:
    """One thing a module's forward changed: ``what`` is ``attribute``, ``parameter``,
    ``buffer`` or ``tensor attribute``; ``module`` the module's qualified name ('' is
    the root)."""

    module: str
    cls: str
    what: str
    name: str


@dataclass(frozen=True)
class StateMarks:
    """Each module's attribute values (by identity) and tensor versions (``_version``,
    which every in-place write bumps) at one moment; ``changes()`` names what differs
    now. Read-only: nothing is copied but the attribute dicts' items."""

    marks: tuple[tuple[str, nn.Module, dict[str, Any], dict[str, int]], ...]

    @staticmethod
    def of(root: nn.Module) -> StateMarks:
        return StateMarks(tuple((name, m, *_mark(m)) for name, m in root.named_modules()))

    def changes(self) -> list[Change]:
        out = []
        for name, m, attrs, versions in self.marks:
            now, now_versions = _mark(m)
            cls = type(m).__name__
            for k in sorted(set(attrs) | set(now)):
                if k not in now or k not in attrs or now[k] is not attrs[k]:
                    out.append(Change(name, cls, "attribute", k))
            for k, v in versions.items():
                if now_versions.get(k, v) != v:
                    kind = ("parameter" if k in m._parameters else
                            "buffer" if k in m._buffers else "tensor attribute")
                    out.append(Change(name, cls, kind, k))
        return out

    def restore(self, keep: frozenset[str] = frozenset()) -> None:
        """Put back the attributes a forward assigned (tensors written in place stay
        written): for a model traced in place. ``keep``: new attributes of the root to
        leave (the tracer's own constants, which the graph reads)."""
        for i, (_, m, attrs, _) in enumerate(self.marks):
            d = m.__dict__
            for k in [k for k in d if k not in _STRUCTURE and k not in attrs
                      and not (i == 0 and k in keep)]:
                del d[k]
            d.update(attrs)


def _mark(m: nn.Module) -> tuple[dict[str, Any], dict[str, int]]:
    attrs = {k: v for k, v in m.__dict__.items() if k not in _STRUCTURE}
    versions = {}
    for table in (m._parameters, m._buffers, attrs):
        for k, t in table.items():
            if isinstance(t, torch.Tensor):
                # inference tensors have no version counter (and no in-place writes)
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    versions[k] = t._version
    return attrs, versions


def refusal_for(change: Change, *, symbolic: bool) -> tuple[str, str]:
    """The message and the fix for a forward side effect the graph would drop."""
    where = f"module {change.module!r} ({change.cls})" if change.module else (
        f"the model's forward ({change.cls})")
    if change.what == "attribute":
        done = f"assigns attribute {change.name!r}"
    else:
        done = f"updates {change.what} {change.name!r} in place"
    tool = "symbolic tracing" if symbolic else "torch.export"
    msg = (f"trace: {where} {done} in forward(); {tool} ran forward() once to capture "
           "the graph, and the compiled graph would never do it again")
    leaf = (f"list it in trace.leaf_modules (leaf_modules: [{change.cls}]) so its forward "
            "runs on every call, or " if change.module else "")
    export = ("use trace.method: export (or auto), which keeps in-place buffer updates, or "
              if symbolic and change.what != "attribute" else "")
    return msg, f"{export}{leaf}move the update out of forward() (e.g. into the training loop)"


# -- hooks ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DroppedHook:
    """A hook a traced graph could not keep: ``kind`` is ``forward pre-hook``, ``forward
    hook`` or ``backward hook``; ``why`` says what it did."""

    module: str
    cls: str
    kind: str
    hook: str
    why: str


def has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_hooks
                or m._backward_pre_hooks)


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def call_with_hooks(m: nn.Module, name: str, forward: Callable[..., Any], args: tuple,
                    kwargs: dict[str, Any], dropped: list[DroppedHook]) -> Any:
    """``m(*args, **kwargs)`` as ``nn.Module.__call__`` runs it (pre-hooks, ``forward``,
    hooks; each hook's result replaces the inputs or output), while tracing: a hook that
    returns None only had side effects, and a backward hook has nothing to run on in the
    traced graph; both are entered in ``dropped``."""
    cls = type(m).__name__
    for hook in list(m._backward_pre_hooks.values()) + list(m._backward_hooks.values()):
        dropped.append(DroppedHook(name, cls, "backward hook", _hook_name(hook),
                                   "a graph traced through the module has no module call "
                                   "for it to run on"))
    for hid, hook in list(m._forward_pre_hooks.items()):
        if hid in m._forward_pre_hooks_with_kwargs:
            got = hook(m, args, kwargs)
            if got is not None:
                args, kwargs = got
        else:
            got = hook(m, args)
            if got is not None:
                args = got if isinstance(got, tuple) else (got,)
        if got is None:
            dropped.append(DroppedHook(name, cls, "forward pre-hook", _hook_name(hook),
                                       "it returned None, so it works by side effects only"))
    out = forward(*args, **kwargs)
    for hid, hook in list(m._forward_hooks.items()):
        if hid in m._forward_hooks_with_kwargs:
            got = hook(m, args, kwargs, out)
        else:
            got = hook(m, args, out)
        if got is None:
            dropped.append(DroppedHook(name, cls, "forward hook", _hook_name(hook),
                                       "it returned None, so it works by side effects only"))
        else:
            out = got
    return out


def hook_refusal(d: DroppedHook) -> tuple[str, str]:
    """The message and the fix for a hook the traced graph would not run."""
    where = f"module {d.module!r} ({d.cls})" if d.module else f"the model ({d.cls})"
    msg = (f"trace: {where} has a {d.kind} {d.hook!r} that the compiled graph would not run "
           f"({d.why}; tracing ran it once)")
    if d.module:
        fix = (f"list the module in trace.leaf_modules (leaf_modules: [{d.cls}]) so the graph "
               f"calls it and its hooks run on every call, or remove the hook before "
               f"compiling and register it on the returned graph")
    else:
        fix = ("remove the hook before compiling and register it on the returned graph "
               f"(gm.register_{'forward_pre_hook' if 'pre' in d.kind else 'forward_hook'}"
               "(hook); for a backward hook gm.register_full_backward_hook(hook))")
    return msg, fix


# -- self.training branches ------------------------------------------------------------------
def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def reads_training(cls: type) -> bool:
    """Whether code of ``cls`` (its methods and those of its bases outside torch) reads an
    attribute named ``training``: only such modules can trace differently in train and
    eval mode. torch's own modules either run as graph calls (leaves) or do not branch."""
    for klass in cls.__mro__:
        if klass is object or klass.__module__.split(".")[0] == "torch":
            continue
        for value in vars(klass).values():
            fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if isinstance(value, property):
                fn = value.fget
            code = getattr(fn, "__code__", None)
            if isinstance(code, types.CodeType) and "training" in _names(code):
                return True
    return False


def node_signature(graph: torch.fx.Graph) -> list[tuple[str, str, str, str]]:
    """A graph's operations in order, comparable across two traces of one model."""
    return [(n.op, str(n.target), str(n.args), str(n.kwargs)) for n in graph.nodes]


# -- names and old weight norm ----------------------------------------------------------------
def unwritable_name(model: nn.Module) -> tuple[str, str] | None:
    """The first (kind, qualified name) of a module, parameter or buffer whose name
    contains an atom fx cannot write into generated code, or None. (Each module's own
    key and its tables' keys: every atom once.)"""
    for name, m in model.named_modules():
        atom = name.rpartition(".")[2]
        if name and not atom.isidentifier() and not _writable(atom):
            return "module", name
        for kind, table in (("parameter", m._parameters), ("buffer", m._buffers)):
            for key in table:
                if not key.isidentifier() and not _writable(key):
                    return kind, f"{name}.{key}" if name else key
    return None


def _writable(atom: str) -> bool:
    try:
        return ast.literal_eval(f'"{atom}"') == atom
    except (SyntaxError, ValueError):
        return False


def old_weight_norm(model: nn.Module) -> str | None:
    """The qualified name of the first module with an old-style ``weight_norm``."""
    for name, m in model.named_modules():
        if any(isinstance(h, WeightNorm) for h in m._forward_pre_hooks.values()):
            return name
    return None


# Functional dropouts whose ``training`` argument a forward passes from ``self.training``,
# and the modules that do the same while reading their own flag.
_DROPOUT_MODULES: dict[Callable[..., Any], type[nn.Module]] = {
    nn.functional.dropout: nn.Dropout, nn.functional.dropout1d: nn.Dropout1d,
    nn.functional.dropout2d: nn.Dropout2d, nn.functional.dropout3d: nn.Dropout3d,
    nn.functional.alpha_dropout: nn.AlphaDropout,
    nn.functional.feature_alpha_dropout: nn.FeatureAlphaDropout,
}


def _bound(node: torch.fx.Node) -> dict[str, Any] | None:
    try:
        b = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    b.apply_defaults()
    return dict(b.arguments)


def keep_mode_dropouts(root: nn.Module, graph: torch.fx.Graph, other: torch.fx.Graph
                       ) -> bool:
    """When ``graph`` and ``other`` (the same model traced in the other mode) differ only
    in the ``training`` argument of functional dropouts (``F.dropout(x, p,
    self.training)``), replace each of those calls in ``graph`` by a dropout module added
    next to the module that made the call (``<owner>.<node>_mode``; no state, so the
    state dict is unchanged), which reads its own flag and so follows ``.train()`` /
    ``.eval()``: the same op, the same random numbers. Returns False, changing nothing,
    on any other difference."""
    ours, theirs = list(graph.nodes), list(other.nodes)
    if len(ours) != len(theirs):
        return False
    swaps = []
    for a, b in zip(ours, theirs):
        if (a.op, str(a.target), str(a.args), str(a.kwargs)) == (
                b.op, str(b.target), str(b.args), str(b.kwargs)):
            continue
        if a.op != "call_function" or a.target not in _DROPOUT_MODULES or a.target != b.target:
            return False
        x, y = _bound(a), _bound(b)
        if x is None or y is None or set(x) != set(y) or "training" not in x:
            return False
        if any(str(x[k]) != str(y[k]) for k in x if k != "training"):
            return False
        if not isinstance(x["p"], (int, float)) or not isinstance(x.get("inplace"), bool):
            return False
        swaps.append((a, x))
    for node, args in swaps:
        stack = list(node.meta.get("nn_module_stack", {}).values())
        owner = stack[-1][0] if stack else ""
        parent = root.get_submodule(owner)
        name = f"{node.name}_mode"
        module = _DROPOUT_MODULES[node.target](args["p"], args["inplace"])
        module.train(parent.training)
        parent.add_module(name, module)
        with graph.inserting_before(node):
            call = graph.call_module(f"{owner}.{name}" if owner else name, (args["input"],))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    return True
