"""The inputs a compiled graph takes, as its example inputs were (for messages about
batches that do not fit).

Example:
    >>> import torch
    >>> from torch.fx import symbolic_trace
    >>> from torch.fx.passes.shape_prop import ShapeProp
    >>> from qcompile.graph.signature import graph_inputs
    >>> gm = symbolic_trace(torch.nn.Linear(8, 2))
    >>> ShapeProp(gm).propagate(torch.randn(4, 8))
    tensor(...)
    >>> [str(i) for i in graph_inputs(gm)]
    ['input: float32[4, 8]']
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.graph.meta import TENSOR_META
from qcompile.runtime.calibration import GraphInput

# Embedding lookups in a graph: modules (nn.Embedding, EmbeddingBag, quantized ones: anything
# with num_embeddings) and functions, with the position of the ids and of the weight.
_EMBEDDING_FUNCTIONS = {
    torch.nn.functional.embedding: (0, 1),
    torch.nn.functional.embedding_bag: (0, 1),
    torch.embedding: (1, 0),
    torch.ops.aten.embedding.default: (1, 0),
}
# Ops that pass ids through unchanged (dtype or layout changes): an input used through them
# still indexes the embedding.
_ID_PRESERVING = {"to", "long", "int", "view", "reshape", "flatten", "contiguous", "squeeze",
                  "unsqueeze", "transpose", "permute", "t"}


def graph_inputs(gm: nn.Module) -> list[GraphInput]:
    """One ``GraphInput`` per placeholder of ``gm``'s graph, looking through wrappers that
    keep the graph as ``.module`` (DDP); empty when there is no graph."""
    while not isinstance(gm, GraphModule) and isinstance(getattr(gm, "module", None),
                                                         nn.Module):
        gm = gm.module
    if not isinstance(gm, GraphModule):
        return []
    indexes = _embedding_inputs(gm)
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        meta = n.meta.get(TENSOR_META)
        target = str(n.target)
        out.append(GraphInput(name=target.lstrip("*"), shape=tuple(getattr(meta, "shape", ()))
                              if hasattr(meta, "shape") else None,
                              dtype=getattr(meta, "dtype", None),
                              variadic=target.startswith("*"),
                              indexes=tuple(indexes.get(n, ()))))
    return out


def _embedding_inputs(gm: GraphModule) -> dict[Node, list[tuple[str, int]]]:
    """Placeholder -> ``(module, num_embeddings)`` of each embedding it indexes, directly
    or through ops that keep ids (``ids.long()``, ``ids.view(-1)``), in ``gm``'s graph."""
    found: dict[Node, list[tuple[str, int]]] = {}
    for node in gm.graph.nodes:
        looked_up = _lookup(gm, node)
        if looked_up is None:
            continue
        ids, entry = looked_up
        while (ids.op == "call_method" and ids.target in _ID_PRESERVING and ids.args
               and isinstance(ids.args[0], Node)):
            ids = ids.args[0]
        if ids.op == "placeholder" and entry not in found.setdefault(ids, []):
            found[ids].append(entry)
    return found


def _lookup(gm: GraphModule, node: Node) -> tuple[Node, tuple[str, int]] | None:
    """``(ids node, (module, num_embeddings))`` when ``node`` looks up an embedding."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        n = getattr(m, "num_embeddings", None)
        if isinstance(n, int) and node.args and isinstance(node.args[0], Node):
            return node.args[0], (str(node.target), n)
        return None
    where = _EMBEDDING_FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if where is None or len(node.args) <= max(where):
        return None
    ids, weight = node.args[where[0]], node.args[where[1]]
    while isinstance(weight, Node) and weight.op == "call_module" and weight.args:
        weight = weight.args[0]  # through the weight's quantizer to the parameter
    if not (isinstance(ids, Node) and isinstance(weight, Node) and weight.op == "get_attr"):
        return None
    target = str(weight.target)
    parent, _, leaf = target.rpartition(".")
    try:
        value = getattr(gm.get_submodule(parent) if parent else gm, leaf)
    except AttributeError:
        value = None
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    return ids, (target.rpartition(".")[0] or target, int(value.shape[0]))
