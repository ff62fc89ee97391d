"""``collect_weights``: every enabled integer weight quantizer's weight as integers, once.

The first conversion step: it makes the ``Conversion`` the later steps share
(``ctx.conversion``) and fills its ``weights`` (weight quantizer node -> ``IntTensor``,
the fake-quant's exact grid). fp8 and switched-off quantizers have no integers. The graph
itself is not changed.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = qc.qcompile(m, "w8-weight-only", example_inputs=(torch.randn(2, 8),))
    >>> step = next(p for p in qc.report(qc.convert(gm)).passes
    ...             if p.name == "convert.collect_weights")
    >>> step.notes, step.added, step.removed
    (['2 weight(s) as integers'], [], [])
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import Conversion, attr_value, integers, module_at
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.specs.quant import FP8_MAX


def weight_source(node: Node) -> Node:
    """The ``get_attr`` node a weight quantizer reads: its input, or the parameter under a
    ``torch.t`` (``insert_quant`` quantizes a per-group [in, out] weight transposed)."""
    if (node.op == "call_function" and node.target is torch.t and node.args
            and isinstance(node.args[0], Node) and node.args[0].op == "get_attr"):
        return node.args[0]
    return node


@graph_pass(requires=("frozen_graph",), provides=("integer_weights",))
def collect_weights(gm: GraphModule, ctx: Context) -> GraphModule:
    # convert_graph may have prepared the Conversion with its options (rows_only)
    prepared = ctx.conversion if isinstance(ctx.conversion, Conversion) else None
    conv = ctx.conversion = Conversion(rows_only=prepared is not None and prepared.rows_only)
    for node in gm.graph.nodes:
        fq = module_at(gm, node)
        if not isinstance(fq, FakeQuantize) or not node.args:
            continue
        w = attr_value(gm, weight_source(node.args[0]))
        if isinstance(w, nn.Parameter) and fq.dtype not in FP8_MAX and fq.enabled:
            # a weight stored [in, out] and quantized per group as its [out, in] transpose
            conv.weights[node] = integers(fq, w if node.args[0].op == "get_attr" else w.t())
    ctx.note(f"{len(conv.weights)} weight(s) as integers")
    return gm
