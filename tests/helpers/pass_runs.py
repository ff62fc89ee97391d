"""Running the compile passes up to a pass under test, for golden before/after dumps."""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.passes.annotate import annotate
from qcompile.passes.fold_bn import fold_bn
from qcompile.passes.trace import trace


def annotated(model: nn.Module, spec_dict: dict,
              *inputs: torch.Tensor) -> tuple[GraphModule, Context, str]:
    """(the graph after trace, fold_bn and annotate, its Context with the notes so far
    cleared, the graph's dump): what ``insert_quant`` and its helpers start from."""
    ctx = Context(spec=qc.CompileSpec.model_validate(spec_dict), model=model,
                  example_inputs=inputs or None)
    gm = None
    for p in (trace, fold_bn, annotate):
        gm = p(gm, ctx)
        gm.graph.lint()
        gm.recompile()
    ctx.notes = []
    return gm, ctx, format_graph(gm)
