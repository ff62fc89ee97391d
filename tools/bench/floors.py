"""Lower bounds for the ``compile`` suite: what any torch.fx rewrite that returns
qcompile's graph must spend, measured with the same libraries, so a compile-time ratio can
be read against what is possible rather than against ``symbolic_trace`` alone.

``rewrite_floor`` redoes, on its own, only the work that the graph ``qcompile`` returned
cannot exist without:

- what the contract adds: a copy of the model (``copy_model``; the user's model is never
  mutated) and its shapes in ``node.meta`` (``propagate_shapes``);
- tracing the model (``torch.fx.Tracer``, no code generated for the traced graph);
- the quantizers, built from the spec's schemes, every weight read once for its range
  (an untrained QAT graph carries real weight scales);
- every node of the final graph, created with fx (``Graph.graph_copy``), and its code
  (``GraphModule``).

It leaves out everything else qcompile does: rule matching, fusion groups, checks and
their errors, node edits (erasing and replacing nodes), reports. So no implementation of
the same contract built on the same parts (torch.fx, qcompile's copy-on-write copy, its
shape propagation and quantizers) can go below it.

Example:
    >>> import torch
    >>> import qcompile as qc
    >>> from qcompile.tools.bench.floors import rewrite_floor
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> spec, x = qc.load_spec("int8-qat"), torch.randn(2, 8)
    >>> gm = qc.qcompile(model, spec, (x,))
    >>> floor = rewrite_floor(model, x, gm, spec)
    >>> len(floor.graph.nodes) == len(gm.graph.nodes)
    True
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import Graph, GraphModule

from qcompile.graph.context import Context
from qcompile.graph.meta import REPORT_KEY, TENSOR_META
from qcompile.passes.trace.capture_symbolic import _graph_module
from qcompile.passes.trace.model_copy import copy_model
from qcompile.passes.trace.shape_prop import propagate_shapes
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.specs import CompileSpec


def rewrite_floor(model: nn.Module, x: torch.Tensor, compiled: GraphModule,
                  spec: CompileSpec) -> GraphModule:
    """The floor's work for ``compiled`` = ``qc.qcompile(model, spec, (x,))`` (symbolic
    front end): returns a GraphModule with ``compiled``'s graph (the quantizers it calls
    are ``compiled``'s; the ones built here are only built and observed)."""
    root = copy_model(model)
    traced = _graph_module(root, torch.fx.Tracer().trace(root), type(model).__name__,
                           generate_code=False)
    propagate_shapes(traced, [x], Context(spec=spec, model=model))
    inputs = {n.target: n.args[0] for n in compiled.graph.nodes
              if n.op == "call_module" and n.args}
    for rec in compiled.meta[REPORT_KEY].quantizers:
        if rec.rule is None:
            scheme = spec.quant.inputs
        else:
            rule = spec.quant.rules[rec.rule]
            scheme = rule.weight if rec.role == "weight" else rule.activation
        weight = root.get_parameter(rec.node) if rec.role == "weight" else None
        meta = inputs[rec.name].meta.get(TENSOR_META)
        shape = tuple(weight.shape) if weight is not None else (
            tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None)
        fq = FakeQuantize.from_scheme(scheme, role=rec.role, shape=shape, dynamic=rec.dynamic,
                                      channel_axis=compiled.get_submodule(rec.name).axis,
                                      target=spec.quant.target)
        if weight is not None:
            fq.observe_tensor(weight)
    graph = Graph()
    graph.output(graph.graph_copy(compiled.graph, {}))
    return GraphModule(compiled, graph, type(model).__name__)
