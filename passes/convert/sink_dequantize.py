"""``sink_dequantize``: shape ops and max-pooling run on the quantized tensor; dropout goes.

``dequantize`` commutes exactly with ops that only move, drop or compare values
(flatten, reshape, permute, relu, max-pool, ...), so such an op whose only tensor input
is a ``dequantize`` reads the quantized tensor and is dequantized after (as torch.ao's
convert does): the next kernel then finds a quantized input. Size arguments
(``x.view(x.size(0), -1)``) do not stop it: sizes are read from the quantized tensor,
which has the same shape, so no ``dequantize`` runs only to be measured. Dropout and
``Identity`` are identities at inference and are removed.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(), torch.nn.Flatten(),
    ...                         torch.nn.Linear(8, 4))
    >>> gm = qc.qcompile(m, "int8-static", example_inputs=(torch.randn(2, 8),))
    >>> gm = qc.calibrate(gm, [(torch.randn(16, 8),) for _ in range(2)], progress=False)
    >>> step = next(p for p in qc.report(qc.convert(gm)).passes
    ...             if p.name == "convert.sink_dequantize")
    >>> step.notes
    ['1 op(s) run on the quantized tensor', '1 dropout / identity module(s) removed']
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.matching import is_size_like
from qcompile.graph.meta import DQ_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import aten, module_at, state

# Ops through which a quantized tensor passes unchanged in value: dequantize commutes with
# them exactly, so they run on the integers (as torch.ao's convert does).
_SHAPE_METHODS = {"flatten", "reshape", "view", "permute", "transpose", "contiguous",
                  "squeeze", "unsqueeze", "relu"}
_SHAPE_FUNCTIONS = {torch.flatten, torch.reshape, torch.permute, torch.transpose,
                    torch.squeeze, torch.unsqueeze, torch.relu, F.relu, F.max_pool1d,
                    F.max_pool2d, aten.flatten.using_ints, aten.view.default,
                    aten.reshape.default, aten.permute.default, aten.transpose.int,
                    aten.squeeze.dim, aten.unsqueeze.default, aten.relu.default,
                    aten.max_pool2d.default}
_SHAPE_MODULES = (nn.Flatten, nn.MaxPool1d, nn.MaxPool2d, nn.ReLU, nn.Unflatten)
_DROP_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                 nn.Identity)
# What a quantized tensor answers like its dequantization: its size, never its values.
_SIZE_METHODS = {"size", "dim", "numel", "ndimension"}
_SIZE_ATTRS = (("shape",), ("ndim",))


def _reads_size(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    return (node.op == "call_function" and node.target is getattr
            and node.args[1:] in _SIZE_ATTRS)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


def _transparent(gm: GraphModule, node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    if node.op == "call_function":
        return node.target in _SHAPE_FUNCTIONS
    return isinstance(module_at(gm, node), _SHAPE_MODULES)


@graph_pass(requires=("quantized_activations",), provides=("dequantize_sunk",))
def sink_dequantize(gm: GraphModule, ctx: Context) -> GraphModule:
    conv = state(ctx)
    g = gm.graph
    sunk = dropped = 0
    for node in list(g.nodes):
        module = module_at(gm, node)
        # inference: identity; one with hooks does something else (torch's tensor-parallel
        # styles gather or scatter tokens through a hooked nn.Identity)
        if isinstance(module, _DROP_MODULES) and not _hooked(module):
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
            dropped += 1
            continue
        if not node.args:
            continue
        dq = node.args[0]
        if not (isinstance(dq, Node) and dq.meta.get(DQ_KEY)):
            continue
        if _reads_size(node):  # the quantized tensor has the same size
            node.replace_input_with(dq, dq.args[0])
            if not dq.users:
                g.erase_node(dq)
            continue
        if not _transparent(gm, node):
            continue
        # sizes (`x.view(x.size(0), -1)`) may be arguments; other tensors may not
        if any(a is not dq and not is_size_like(a) for a in node.all_input_nodes):
            continue
        node.replace_input_with(dq, dq.args[0])
        with g.inserting_after(node):
            new_dq = g.call_method("dequantize", (node,))
        new_dq.meta.update({DQ_KEY: True, TENSOR_META: node.meta.get(TENSOR_META)})
        if dq in conv.qparams_after:  # both now read the quantizer's output
            conv.qparams_after[node] = conv.qparams_after[new_dq] = conv.qparams_after[dq]
        node.replace_all_uses_with(new_dq, delete_user_cb=lambda u, d=new_dq: u is not d)
        if not dq.users:
            g.erase_node(dq)
        sunk += 1
    ctx.note(f"{sunk} op(s) run on the quantized tensor")
    if dropped:
        ctx.note(f"{dropped} dropout / identity module(s) removed")
    return gm
