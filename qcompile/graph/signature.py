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

from torch import nn
from torch.fx import GraphModule

from qcompile.graph.meta import TENSOR_META
from qcompile.runtime.calibration import GraphInput


def graph_inputs(gm: nn.Module) -> list[GraphInput]:
    """One ``GraphInput`` per placeholder of ``gm``'s graph, looking through wrappers that
    keep the graph as ``.module`` (DDP); empty when there is no graph."""
    while not isinstance(gm, GraphModule) and isinstance(getattr(gm, "module", None),
                                                         nn.Module):
        gm = gm.module
    if not isinstance(gm, GraphModule):
        return []
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        meta = n.meta.get(TENSOR_META)
        target = str(n.target)
        out.append(GraphInput(name=target.lstrip("*"), shape=tuple(getattr(meta, "shape", ()))
                              if hasattr(meta, "shape") else None,
                              dtype=getattr(meta, "dtype", None),
                              variadic=target.startswith("*")))
    return out
