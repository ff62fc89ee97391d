"""One flat graph from a graph whose blocks are child graphs (``data_parallel: fsdp2``
compiles each repeated block as a ``stage_<i>`` child, the group ``fully_shard`` makes):
each call of a child is replaced by the child's nodes, and the result reads the very same
modules, parameters and buffers under the names the child graphs use (the model's own).

Nothing is copied and nothing of ``gm`` changes: the flat graph is a view for code that
reads one graph (the exporters). It holds sharded parameters as ``gm`` does, so it is not
meant to run under FSDP2 (its hooks are on the children it no longer calls).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from torch.fx import symbolic_trace
    >>> block = symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    >>> outer = symbolic_trace(nn.Sequential(nn.Identity(), nn.Identity()))
    >>> outer.add_submodule("stage_0", block)
    True
    >>> for n in outer.graph.nodes:
    ...     if n.op == "call_module" and n.target == "0":
    ...         n.target = "stage_0"
    >>> _ = outer.recompile()
    >>> flat = inline_children(outer, ["stage_0"])
    >>> [n.target for n in flat.graph.nodes if n.op == "call_module"]
    ['0', '1', '1_1']
    >>> flat.get_submodule("0") is block.get_submodule("0")
    True
    >>> x = torch.randn(2, 4)
    >>> torch.equal(flat(x), outer(x))
    True
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn
from torch.fx import Graph, GraphModule, Node, map_arg


def _resolve(owner: nn.Module, target: str) -> Any:
    value: Any = owner
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _first_under(order: Sequence[str]) -> dict[str, int]:
    """Each name of ``order`` and each of its prefixes (``a.b`` of ``a.b.c``) -> the
    position of the first name at or under it."""
    out: dict[str, int] = {}
    for i, name in enumerate(order):
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:k]), i)
    return out


def _reorder(module: nn.Module, prefix: str, rank: dict[str, int], made: set[int]) -> None:
    """Order the containers the flat graph made (``made``; never the graph's own modules)
    by the first name under each in ``rank`` (``_first_under``)."""
    def first(name: str) -> int:
        return rank.get(f"{prefix}{name}", len(rank))

    if id(module) in made:
        module._modules = dict(sorted(module._modules.items(), key=lambda kv: first(kv[0])))
        module._parameters = dict(sorted(module._parameters.items(),
                                         key=lambda kv: first(kv[0])))
        module._buffers = dict(sorted(module._buffers.items(), key=lambda kv: first(kv[0])))
    for name, child in module._modules.items():
        if child is not None:
            _reorder(child, f"{prefix}{name}.", rank, made)


def inline_children(gm: GraphModule, names: Iterable[str],
                    order: Sequence[str] = ()) -> GraphModule:
    """``gm`` with each call of its child graphs ``names`` replaced by the child's nodes
    (see the module). A name two graphs use for different objects (each child's own
    ``_guards_fn``) gets a suffix in the flat graph; the model's names are unique.
    ``order``: the state names in the order the flat graph lists its parameters and
    buffers (``named_parameters``: the model's order, not the graph's)."""
    children = {n: gm.get_submodule(n) for n in names}
    graph = Graph()
    attrs: dict[str, Any] = {}
    env: dict[Node, Any] = {}

    def copy(node: Node, owner: nn.Module, values: dict[Node, Any]) -> Node:
        new = graph.node_copy(node, lambda n: values[n])
        if node.op in ("get_attr", "call_module"):
            target, value = str(node.target), _resolve(owner, str(node.target))
            name, i = target, 0
            while name in attrs and attrs[name] is not value:
                i += 1
                name = f"{target}_{i}"
            attrs[name] = value
            new.target = name
        return new

    for node in gm.graph.nodes:
        child = children.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(child, GraphModule):
            args = list(map_arg(node.args, lambda n: env[n]))
            kwargs = dict(map_arg(node.kwargs, lambda n: env[n]))
            inner: dict[Node, Any] = {}
            for cn in child.graph.nodes:
                if cn.op == "placeholder":
                    name = str(cn.target)
                    inner[cn] = (args.pop(0) if args else kwargs.pop(name) if name in kwargs
                                 else cn.args[0])
                elif cn.op == "output":
                    env[node] = map_arg(cn.args[0], inner.__getitem__)
                else:
                    inner[cn] = copy(cn, child, inner)
        elif (node.op == "call_function" and node.target is operator.getitem
              and isinstance(node.args[0], Node) and isinstance(env[node.args[0]], (tuple, list))):
            env[node] = env[node.args[0]][node.args[1]]  # an item of an inlined child's outputs
        elif node.op == "output":
            graph.output(map_arg(node.args[0], lambda n: env[n]))
        else:
            env[node] = copy(node, gm, env)
    flat = GraphModule(attrs, graph, class_name=type(gm).__name__)
    flat.meta = dict(gm.meta)
    if order:
        ours = {id(m) for v in attrs.values() if isinstance(v, nn.Module) for m in v.modules()}
        made = {id(m) for m in flat.modules() if id(m) not in ours}
        _reorder(flat, "", _first_under(order), made)
    return flat
