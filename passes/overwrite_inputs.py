"""``overwrite_inputs``: let activation quantizers write their output over their input.

An activation quantizer's input is usually a value nothing else reads: a Linear's or a
matmul's output, a residual sum. The quantizer's output then need not take new memory:
this pass marks such calls ``overwrite=True`` (in the graph and in its dumps, as
``nn.ReLU(inplace=True)`` marks its own), and a training forward (step observer updates,
or fixed qparams: ``qcompile::fake_quant_minmax_overwrite`` / ``fake_quant_overwrite``)
writes the fake-quantized values over the input (``FakeQuantize.forward``); evaluation
forwards do not (measuring tools keep values). On a 12-layer transformer that is 2% of
the QAT step on a 2-core AVX-512 machine: 96 new outputs of 1-4 MB a step not
allocated, written or faulted in.

A call is marked when its input

- comes from an operator whose backward does not read its output: linear, matmul and
  its batched forms, convolutions, and tensor ``+ - * /`` (``_PRODUCERS``, torch's and
  the export front end's spellings), into a new tensor (no ``out=``). So autograd never
  saved the input, not even through a saved-tensor hook that holds it as a Python
  object (ReLU, softmax, sigmoid or tanh do read their output: a quantizer after them
  writes a new tensor). Not a graph input (the caller may hold it; a pipeline stage's
  inputs are in flight), not a weight, not a submodule's output (its hooks may keep it);
- has no other user in the graph (nor the graph's output).

The mark is the graph's own promise that its code reads nothing of the input after the
call, as ``nn.ReLU(inplace=True)`` in a graph is: something that keeps every value of a
run (an ``fx.Interpreter`` recording them) sees the quantized values there. What else
may hold the input is checked at run time, each call: a forward hook on the quantizer or
on every module (``FakeQuantize._may_overwrite``), another tensor on the same memory (a
view, a tensor autograd saved) or a leaf that needs a gradient
(``qcompile::fake_quant_minmax_overwrite``); with any of them the call writes a new
output, as unmarked calls do. The values are the same bits either way. Should anything
still have kept the input, its version has moved on: autograd refuses to use it.
The stages of a pipeline are marked each in its own graph.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = qc.qcompile(m, "int8-qat", example_inputs=(torch.randn(2, 8),))
    >>> [n.name for n in gm.graph.nodes if n.kwargs.get("overwrite")]  # not after the ReLU
    ['_2_output_fake_quant']
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.pipeline import graph_pass
from qcompile.runtime.fake_quant import FakeQuantize

_aten = torch.ops.aten
# Operators returning a new tensor that their backward never reads (it saves the inputs,
# or nothing), by call_function target and call_method name.
_PRODUCERS = frozenset({
    torch._C._nn.linear, F.linear, operator.matmul, torch.matmul, torch.mm, torch.bmm,
    torch.addmm, torch.baddbmm, F.conv1d, F.conv2d, F.conv3d,
    operator.add, operator.sub, operator.mul, operator.truediv,
    torch.add, torch.sub, torch.mul, torch.div,
    _aten.linear.default, _aten.matmul.default, _aten.mm.default, _aten.bmm.default,
    _aten.addmm.default, _aten.baddbmm.default, _aten.conv1d.default, _aten.conv2d.default,
    _aten.conv3d.default, _aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor,
    _aten.div.Tensor,
})
_METHODS = frozenset({"matmul", "mm", "bmm", "add", "sub", "mul", "div"})


def _fresh(n: Node) -> bool:
    """``n`` returns a new tensor that autograd does not keep."""
    if "out" in n.kwargs:  # written into a tensor someone else holds
        return False
    if n.op == "call_function":
        try:
            return n.target in _PRODUCERS
        except TypeError:  # an unhashable target
            return False
    return n.op == "call_method" and n.target in _METHODS


def _marks(gm: GraphModule) -> int:
    """Mark the calls of ``gm``'s own graph; returns how many."""
    marked = 0
    for n in gm.graph.nodes:
        if n.op != "call_module" or n.kwargs or len(n.args) != 1:
            continue
        source = n.args[0]
        if not isinstance(source, Node) or not _fresh(source):
            continue
        if list(source.users) != [n]:
            continue
        if not isinstance(gm.get_submodule(str(n.target)), FakeQuantize):
            continue
        n.kwargs = {"overwrite": True}
        marked += 1
    return marked


@graph_pass(requires=("quantizers",), provides=("overwrites",), needs_code=False)
def overwrite_inputs(gm: GraphModule, ctx: Context) -> GraphModule:
    """Mark the activation quantizer calls whose input nothing else reads."""
    total = 0
    for m in gm.modules():
        if not isinstance(m, GraphModule):
            continue
        count = _marks(m)
        if count and m is not gm:
            m.recompile()  # a stage's code; the pipeline regenerates the top graph's
        total += count
    ctx.note(f"{total} activation quantizer call(s) may write over their input")
    return gm
