"""Compiled graphs that ``torch.save`` / ``torch.load(weights_only=False)`` round-trip whole.

torch pickles a ``GraphModule`` as its generated code plus its ``__dict__`` and, on load,
re-traces the code into a fresh GraphModule. That fresh module keeps only what the code
names: a submodule the graph reaches only through a parameter (``0.weight``) becomes a
plain ``nn.Module`` holding that tensor, parameters the graph never reads (tied names
kept by ``keep_state_layout``) vanish, and ``meta`` (qcompile's Report and spec), the
forward and state-dict hooks and every ``node.meta`` start empty. ``keep_whole(gm)``
makes ``gm`` and every GraphModule inside it (pipeline stages) pickle through
``_load_whole``, which re-traces as torch does, then puts back the saved module tree,
``meta``, hooks (which must pickle: module-level functions or picklable objects) and the
picklable part of each node's meta.

The graph itself is saved as data (each node's name, op, target, arguments, type and
meta), so the loaded graph has the same nodes, names and order (torch's re-trace renames
torch.export's nodes); a graph with a target or argument pickle cannot save is saved as
torch saves it (its code, re-traced on load) with its node meta matched by name. Class references in
``meta`` are saved as dotted names (as torch.export records them), so loading needs the
classes of the modules the graph holds, not the class of the model it was traced from.

The override is set on the graph's own class (torch gives every GraphModule a private
subclass, which is where ``recompile`` puts ``forward``), and a deep-copy hook sets it
on copies (``qc.convert`` works on a deep copy). So is a ``recompile`` that keeps writing
there when FSDP2's ``fully_shard`` has subclassed that class (torch's writes onto the
subclass, whose ``__call__`` then recurses without end).

Example:
    >>> import io, torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> gm.meta["qcompile.report"] = "kept"
    >>> f = io.BytesIO(); torch.save(keep_whole(gm), f); _ = f.seek(0)
    >>> loaded = torch.load(f, weights_only=False)
    >>> loaded.meta["qcompile.report"], type(loaded.get_submodule("0")).__name__
    ('kept', 'Linear')
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.graph_module import reduce_graph_module
from torch.fx.node import map_aggregate, map_arg
from torch.fx.passes.shape_prop import TensorMetadata

from qcompile.graph.meta import (
    DQ_KEY,
    FINAL_NAME_KEY,
    FUSION_KEY,
    MODULE_KEY,
    NN_MODULE_STACK,
    QPARAMS_KEY,
    QSCHEME_KEY,
    ROOT_CLASS_KEY,
    STAGE_KEY,
    TENSOR_META,
    TYPE,
)

__all__ = ["keep_whole"]

# What GraphModule() rebuilds from the loaded graph: everything else in the saved
# __dict__ is put back as it was.
_REGENERATED = frozenset({"_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls",
                          "_tracer_extras", "_graphmodule_cls_name"})
# node.meta worth keeping: qcompile's own keys and the torch keys qcompile reads. Export's
# fake values (``val``) and provenance (``from_node``) are neither picklable nor needed.
_NODE_KEYS = (QSCHEME_KEY, MODULE_KEY, FUSION_KEY, FINAL_NAME_KEY, QPARAMS_KEY, DQ_KEY, STAGE_KEY,
              TENSOR_META, TYPE, NN_MODULE_STACK, "stack_trace")


def keep_whole(gm: nn.Module) -> nn.Module:
    """Make ``gm`` and every GraphModule inside it round-trip whole through pickle."""
    for m in gm.modules():
        if isinstance(m, GraphModule):
            _keep(m)
    return gm


def _keep(m: GraphModule) -> None:
    cls = type(m)
    # only torch's per-instance subclass: never patch a class other graphs share
    # (GraphModule renames it after the model; its qualified name stays torch's)
    if not cls.__qualname__.endswith(".GraphModuleImpl"):
        return
    cls.__reduce__ = _reduce_whole  # type: ignore[method-assign]
    cls.recompile = _recompile_own_class  # type: ignore[method-assign]
    hooks = m.__dict__.get("_deepcopy_hooks")
    if isinstance(hooks, list) and _keep_copy not in hooks:
        hooks.append(_keep_copy)


def _recompile_own_class(self: GraphModule) -> Any:
    """``GraphModule.recompile``, writing ``forward`` and ``__call__`` onto the graph's own
    class. torch writes them onto ``type(self)``; once a wrapper has subclassed the graph's
    class (FSDP2's ``fully_shard`` makes ``FSDP<class>``), that subclass's ``__call__``
    would then call itself without end (a RecursionError on the next forward)."""
    cls = type(self)
    own = next((c for c in cls.__mro__ if c.__qualname__.endswith(".GraphModuleImpl")), cls)
    if own is cls:
        return GraphModule.recompile(self)
    self.__class__ = own
    try:
        return GraphModule.recompile(self)
    finally:
        self.__class__ = cls


def _keep_copy(copy: GraphModule) -> None:
    """GraphModule's deep-copy hook: the copy gets a fresh class, so set it again."""
    keep_whole(copy)


def _dotted(value: Any) -> Any:
    return f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else value


def _plain(value: Any) -> bool:
    # torch.save's pickler, not pickle's: it refuses some values pickle takes
    # (torch.memory_format)
    try:
        torch.save(value, io.BytesIO())
    except Exception:  # whatever a value's pickling raises, it stays in memory only
        return False
    return True


class _SavedTensorMeta(tuple):
    """``TensorMetadata`` with its memory format by name (torch.save cannot pickle
    ``torch.memory_format``)."""

    def restore(self) -> TensorMetadata:
        fields = dict(zip(TensorMetadata._fields, self))
        if isinstance(fields["memory_format"], str):
            fields["memory_format"] = getattr(torch, fields["memory_format"])
        return TensorMetadata(**fields)


def _save_tensor_meta(tm: TensorMetadata) -> _SavedTensorMeta:
    mf = tm.memory_format
    return _SavedTensorMeta(tm._replace(memory_format=str(mf).rpartition(".")[2]
                                        if mf is not None else None))


def _saved_meta(gm: GraphModule) -> dict[str, Any]:
    meta = {k: _dotted(v) if k == ROOT_CLASS_KEY else v for k, v in gm.meta.items()}
    return meta if _plain(meta) else {k: v for k, v in meta.items() if _plain(v)}


def _target(node: Any) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__qualname__", None) or str(t)


def _saved_node_meta(gm: GraphModule) -> dict[str, tuple[str, str, dict[str, Any]]]:
    out: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for n in gm.graph.nodes:
        kept = {k: n.meta[k] for k in _NODE_KEYS if k in n.meta}
        if isinstance(kept.get(TENSOR_META), TensorMetadata):
            kept[TENSOR_META] = _save_tensor_meta(kept[TENSOR_META])
        stack = kept.get(NN_MODULE_STACK)
        if isinstance(stack, dict):
            kept[NN_MODULE_STACK] = {k: (path, _dotted(cls)) for k, (path, cls) in stack.items()}
        if kept:
            out[n.name] = (n.op, _target(n), kept)
    if not _plain(out):
        out = {name: (op, t, {k: v for k, v in kept.items() if _plain(v)})
               for name, (op, t, kept) in out.items()}
    return out


class _Ref(str):
    """A node argument that is another node (by name)."""


class _Op(tuple):
    """An operator target by name, ``(namespace, op, overload or None)``: torch.save cannot
    pickle ``torch.ops`` objects."""

    def resolve(self) -> Any:
        ns, name, overload = self
        packet = getattr(getattr(torch.ops, ns), name)
        return packet if overload is None else getattr(packet, overload)


def _saved_target(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::")
        return _Op((ns, name, target._overloadname))
    if isinstance(target, torch._ops.OpOverloadPacket):
        ns, name = target._qualified_op_name.split("::")
        return _Op((ns, name, None))
    return target


def _graph_state(gm: GraphModule, node_meta: dict) -> tuple | None:
    """The graph as plain data (nodes by name), or None if some target or argument does
    not pickle; node meta comes from ``_saved_node_meta``."""
    nodes = []
    for n in gm.graph.nodes:
        args = map_arg(n.args, lambda a: _Ref(a.name))
        kwargs = map_arg(n.kwargs, lambda a: _Ref(a.name))
        meta = node_meta.get(n.name, (None, None, {}))[2]
        nodes.append((n.name, n.op, _saved_target(n.target), args, kwargs, n.type, meta))
    state = (nodes, gm.graph._codegen)
    return state if _plain(state) else None


def _rebuilt_graph(state: tuple) -> Graph:
    nodes, codegen = state
    graph = Graph()
    graph._codegen = codegen
    env: dict[str, Node] = {}

    def arg(a: Any) -> Any:
        return map_aggregate(a, lambda v: env[v] if isinstance(v, _Ref) else v)

    for name, op, target, args, kwargs, type_expr, meta in nodes:
        target = target.resolve() if isinstance(target, _Op) else target
        node = graph.create_node(op, target, arg(args), arg(kwargs), name=name,
                                 type_expr=type_expr)
        node.meta.update(meta)
        if isinstance(node.meta.get(TENSOR_META), _SavedTensorMeta):
            node.meta[TENSOR_META] = node.meta[TENSOR_META].restore()
        env[name] = node
    return graph


def _reduce_whole(self: GraphModule) -> tuple[Any, ...]:
    body = self.__dict__.copy()  # what torch saves: the module's __dict__ but the graph
    body.pop("_graph", None)
    body["_graphmodule_cls_name"] = type(self).__name__  # torch's loader names it after this
    body["meta"] = _saved_meta(self)
    node_meta = _saved_node_meta(self)
    graph = _graph_state(self, node_meta)
    if graph is not None:  # the graph itself: the same nodes, names and order
        return _load_graph, (body, graph)
    # else as torch does: the generated code, re-traced on load
    _, (_, import_block) = GraphModule.__reduce__(self)
    return _load_whole, (body, import_block, node_meta)


def _complete(module: nn.Module, fresh: dict[str, Any], seen: set[int]) -> None:
    """Give ``module`` and its loaded submodules the ``nn.Module`` attributes their own
    ``__setstate__`` did not set (torch.ao's quantized conv restores its fields, not the
    module's hook dicts, so its forward would fail), as ``nn.Module.__setstate__`` does."""
    if id(module) in seen or not module.__dict__:  # still loading (no state yet): later
        return
    seen.add(id(module))
    for k, v in fresh.items():
        if k not in module.__dict__:
            module.__dict__[k] = copy.copy(v)
    for child in module.__dict__["_modules"].values():  # (set above if it was missing)
        if isinstance(child, nn.Module):
            _complete(child, fresh, seen)


def _restore(gm: GraphModule, saved: dict[str, Any]) -> GraphModule:
    for k, v in saved.items():
        if k not in _REGENERATED:
            gm.__dict__[k] = v
    _complete(gm, nn.Module().__dict__, set())
    # only this graph: its submodules may still be loading (pickle builds them after
    # this call when they refer back to it); each GraphModule among them loads itself here
    _keep(gm)
    return gm


def _load_graph(body: dict[str, Any], graph: tuple) -> GraphModule:
    """Unpickle a graph saved by ``keep_whole`` with its graph as data."""
    empty = Graph()
    empty.output(None)
    gm = GraphModule(nn.Module(), empty, body.get("_graphmodule_cls_name", "GraphModule"))
    _restore(gm, body)
    gm.graph = _rebuilt_graph(graph)  # regenerates the code; touches no submodule
    return gm


def _load_whole(body: dict[str, Any], import_block: str,
                node_meta: dict[str, tuple[str, str, dict[str, Any]]]) -> GraphModule:
    """Unpickle a graph saved by ``keep_whole`` as code: re-trace it (as torch does), then
    restore what the re-trace does not keep."""
    saved = dict(body)  # torch's loader hands ``body`` to the re-traced module as its root
    gm = reduce_graph_module(body, import_block)
    for n in gm.graph.nodes:
        entry = node_meta.get(n.name)
        # re-tracing the generated code gives the same nodes; a node that differs keeps
        # only what the re-trace gave it
        if entry is not None and entry[:2] == (n.op, _target(n)):
            n.meta.update(entry[2])
            if isinstance(n.meta.get(TENSOR_META), _SavedTensorMeta):
                n.meta[TENSOR_META] = n.meta[TENSOR_META].restore()
    return _restore(gm, saved)
