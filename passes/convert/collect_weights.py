"""``collect_weights``: every enabled integer weight quantizer's weight as integers, once.

The first conversion step: it makes the ``Conversion`` the later steps share
(``ctx.conversion``) and fills its ``weights`` (weight quantizer node -> ``IntTensor``,
the fake-quant's exact grid) and its ``blocks`` (a block-format weight quantizer's node
-> the weight's codes and scales, ``quantize_blocks``: exactly the fake-quant's values).
fp8 and switched-off quantizers have neither. The graph itself is not changed.

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
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import Conversion, attr_value, integers, module_at
from qcompile.runtime.block_formats import quantize_blocks
from qcompile.runtime.calibration import apply_view, weight_view
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.specs.quant import FP8_MAX


def weight_source(node: Node) -> Node:
    """The ``get_attr`` node a weight quantizer reads: its input, or the attribute under
    the views ``insert_quant`` put between them (``torch.t`` of a per-group [in, out]
    weight, the rows of a 3-D expert weight)."""
    view = weight_view(node)
    return view[0] if view is not None else node


@graph_pass(requires=("frozen_graph",), provides=("integer_weights",))
def collect_weights(gm: GraphModule, ctx: Context) -> GraphModule:
    # convert_graph may have prepared the Conversion with its options (rows_only)
    prepared = ctx.conversion if isinstance(ctx.conversion, Conversion) else None
    conv = ctx.conversion = Conversion(rows_only=prepared is not None and prepared.rows_only)
    for node in gm.graph.nodes:
        fq = module_at(gm, node)
        if not isinstance(fq, FakeQuantize) or not node.args:
            continue
        view = weight_view(node.args[0]) if isinstance(node.args[0], Node) else None
        if view is None:
            continue
        w = attr_value(gm, view[0])
        if not (isinstance(w, torch.Tensor) and w.is_floating_point() and fq.enabled):
            continue
        # what the quantizer sees: the weight, or its rows (an [in, out] weight
        # quantized per group as its transpose, a 3-D expert weight)
        if fq.block_format is not None:
            seen = apply_view(w, view[1]).detach()
            conv.blocks[node] = quantize_blocks(seen.contiguous(), fq.block_format,
                                                fq.group_size)
        elif fq.dtype not in FP8_MAX:
            conv.weights[node] = integers(fq, apply_view(w, view[1]))
    ctx.note(f"{len(conv.weights)} weight(s) as integers")
    if conv.blocks:
        ctx.note(f"{len(conv.blocks)} weight(s) as block-format codes")
    return gm
