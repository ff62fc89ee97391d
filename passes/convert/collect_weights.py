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

from torch import nn
from torch.fx import GraphModule

from qcompile.graph.context import Context
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import Conversion, attr_value, integers, module_at
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.specs.quant import FP8_MAX


@graph_pass(requires=("frozen_graph",), provides=("integer_weights",))
def collect_weights(gm: GraphModule, ctx: Context) -> GraphModule:
    conv = ctx.conversion = Conversion()
    for node in gm.graph.nodes:
        fq = module_at(gm, node)
        if not isinstance(fq, FakeQuantize) or not node.args:
            continue
        w = attr_value(gm, node.args[0])
        if isinstance(w, nn.Parameter) and fq.dtype not in FP8_MAX and fq.enabled:
            conv.weights[node] = integers(fq, w)
    ctx.note(f"{len(conv.weights)} weight(s) as integers")
    return gm
