"""``fold_batchnorm``: BatchNorm after a conv (QAT graphs keep it) folded into the weight.

The integer weights stay as they are: the per-channel scales absorb
``gamma / sqrt(var + eps)`` (a negative factor mirrors the integers around the zero
point) and the conv gets the folded bias, which ``store_weights`` or ``use_kernels`` put
in place of its own. Only a conv whose single user is the BatchNorm and whose weight is
per-tensor or per-channel on its output-channel axis (not per-group) is folded.

A transposed convolution's weight is ``[in, out / groups, k...]``: its output channels
run along axis 1, where the scales absorb the factors (per-channel on axis 1 afterwards,
which torch's x86 transposed-conv kernel does not take: such a layer keeps the float op on
its integer weight). With ``groups > 1`` an output channel is not one slice of one axis,
so the BatchNorm stays (in eval mode, as the fake-quant graph computed it).

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    >>> gm = qc.qcompile(m, "int8-qat", example_inputs=(torch.randn(2, 3, 6, 6),))
    >>> with torch.no_grad():
    ...     _ = gm(torch.randn(2, 3, 6, 6))  # QAT observers learn ranges in train mode
    >>> int8 = qc.convert(gm)
    >>> [(c.path, c.op) for c in qc.report(int8).conversions if c.path == "fold"]
    [('fold', 'batchnorm')]
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.graph.context import Context
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import (
    CONV,
    CONV_TRANSPOSE,
    arg,
    attr_value,
    module_at,
    state,
)
from qcompile.runtime.modes import ModeAwareBatchNorm

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, ModeAwareBatchNorm)


@graph_pass(requires=("integer_weights",), provides=("batchnorm_folded",))
def fold_batchnorm(gm: GraphModule, ctx: Context) -> GraphModule:
    conv_state = state(ctx)
    g = gm.graph
    folded = 0
    for node in list(g.nodes):
        bn = module_at(gm, node)
        if not isinstance(bn, _BN) or not node.args:
            continue
        conv = node.args[0]
        if (not isinstance(conv, torch.fx.Node) or len(conv.users) != 1
                or (conv.target not in CONV and conv.target not in CONV_TRANSPOSE)):
            continue
        w_node = conv.args[1]
        if w_node not in conv_state.weights:
            continue
        t = conv_state.weights[w_node]
        axis = 1 if conv.target in CONV_TRANSPOSE else 0  # the output channels
        if t.group_size is not None or t.axis not in (None, axis) or len(w_node.users) != 1:
            continue
        if axis == 1 and arg(conv, 6, "groups", 1) != 1:
            ctx.note(f"{conv.name}: kept {node.name} (a transposed conv with groups: its "
                     "output channels are no single weight axis)")
            continue
        if isinstance(bn, ModeAwareBatchNorm):
            gamma, beta, mean, var = (attr_value(gm, a) for a in node.args[1:5])
        else:
            gamma, beta, mean, var = bn.weight, bn.bias, bn.running_mean, bn.running_var
        if mean is None or var is None:
            continue
        with torch.no_grad():
            factor = torch.rsqrt(var.float() + bn.eps)
            if gamma is not None:
                factor = factor * gamma.float()
            bias = attr_value(gm, arg(conv, 2, "bias", None))
            b = bias.float() if bias is not None else torch.zeros_like(factor)
            new_bias = (b - mean.float()) * factor + (beta.float() if beta is not None else 0.0)
            channels = factor.numel()
            scale = t.scale.expand(channels) if t.axis is None else t.scale
            sign = torch.where(factor < 0, -1, 1).to(torch.int32)
            view = [1] * t.q.dim()
            view[axis] = -1
            zp = t.zero_point.expand(channels) if t.axis is None else t.zero_point
            # The integers stay; a negative factor mirrors them around the zero point
            # (clamped: -128 has no mirror in int8, one step of error at most).
            q = torch.clamp((t.q - zp.view(view)) * sign.view(view) + zp.view(view),
                            t.quant_min, t.quant_max)
            conv_state.weights[w_node] = replace(t, q=q.to(t.q.dtype),
                                                 scale=(scale * factor.abs()).contiguous(),
                                                 zero_point=zp.contiguous(), axis=axis)
        conv_state.bias[conv] = new_bias.detach()
        node.replace_all_uses_with(conv)
        g.erase_node(node)
        note = f"folded {node.name} into the weight scales"
        conv_state.record(conv, "fold", "batchnorm", note)
        ctx.note(f"{conv.name}: {note}")
        folded += 1
    if not folded:
        ctx.note("no BatchNorm after a conv to fold")
    return gm
