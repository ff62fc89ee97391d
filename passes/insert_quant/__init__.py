"""``insert_quant``: put ``FakeQuantize`` modules where the annotations say.

- Activations: a quantizer after each annotated node with an activation scheme, or after
  the last member of its fusion group (conv-bn-relu is quantized once, at its output).
- Weights: Linear / Conv1-3d / Embedding calls are re-expressed with the functional op
  (``F.linear(x, fc.weight_fake_quant(fc.weight), fc.bias)``) so the graph shows
  weight -> quantizer -> op, exactly as on ``torch.export`` graphs; functional
  linear/conv/embedding calls on parameters get the same treatment. One quantizer per
  parameter, named ``<module>.<param>_fake_quant``; parameter names are unchanged. A weight
  stored [in, out] (Hugging Face GPT-2's ``Conv1D``: ``addmm(b, x, W)``, or ``x @ W``) is
  quantized per channel along its output dimension (axis 1); per group, its quantizer
  sees ``W.t()`` so that groups run along the input dimension, as for a Linear.
- Inputs: with ``quant.inputs``, a quantizer after each floating-point model input.
- Ranges: weights take their dtype's full range; activation, dynamic-input and input
  quantizers of 8-bit integer dtypes take the 7-bit range when ``quant.target`` needs it
  (``x86``: uint8 [0, 127], int8 [-64, 63]; see ``qcompile.specs.quant.QuantSpec``).

Mode decides how quantizers start: ``qat`` observes and fake-quantizes; ``static``
observes activations with fake-quant off until ``qc.calibrate``; ``dynamic`` computes
activation qparams from each batch, at the *input* of weighted ops (Linear, Conv...,
``<module>.input_fake_quant``; for a module whose one weighted op is not what it returns,
such as ``Conv1D``'s ``addmm`` before its ``view``, that op's input), which is what dynamic
integer kernels quantize. Weight
qparams are computed here from the weights (and keep tracking them during QAT), so a
compiled graph's weight scales are real before any forward: export, ``qc.sqnr`` and
inspection of an untrained QAT graph read them as they are.

Example:
    >>> import torch, qcompile as qc
    >>> gm = qc.qcompile(torch.nn.Sequential(torch.nn.Linear(4, 4)), qc.load_spec("int8-qat"))
    >>> print(gm.code)  # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
    <BLANKLINE>
    <BLANKLINE>
    <BLANKLINE>
    def forward(self, input):
        input_1 = input
        _0_weight = getattr(self, "0").weight
        _0_weight_fake_quant = getattr(self, "0").weight_fake_quant(_0_weight);  _0_weight = None
        _0_bias = getattr(self, "0").bias
        linear = torch._C._nn.linear(input_1, _0_weight_fake_quant, _0_bias);  ...
        _0_output_fake_quant = getattr(self, "0").output_fake_quant(linear);  linear = None
        return _0_output_fake_quant
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.matching import (
    innermost_owner,
    layer_of,
    module_output,
    op_name,
    weight_use,
    weighted_module_op,
)
from qcompile.graph.meta import FUSION_KEY, MODULE_KEY, NN_MODULE_STACK, QSCHEME_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.insert_quant.common import (
    add_quantizer,
    attr,
    build,
    insert_after,
    model_device,
    move_to,
    param_attr,
    quantizer_call,
    quantizer_record,
    set_activation_mode,
    set_flag,
    tensor_shape,
)

_CONV = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}
















def _functionalize(gm: GraphModule, node: Node, op: str) -> Node:
    """Replace ``call_module`` on a stock Linear/Conv/Embedding by its functional op on
    the same parameters (the module's own forward does exactly this)."""
    t = str(node.target)
    m = gm.get_submodule(t)
    g = gm.graph
    x = node.args[0] if node.args else next(iter(node.kwargs.values()))
    with g.inserting_before(node):
        w = param_attr(g, m, t, "weight")
        b = param_attr(g, m, t, "bias") if getattr(m, "bias", None) is not None else None
        if op == "linear":
            new = g.call_function(F.linear, (x, w, b))
        elif op == "embedding":
            new = g.call_function(F.embedding, (x, w, m.padding_idx, m.max_norm, m.norm_type,
                                                m.scale_grad_by_freq, m.sparse))
        else:
            padding = m.padding
            if m.padding_mode != "zeros":
                x = g.call_function(F.pad, (x, m._reversed_padding_repeated_twice),
                                    {"mode": m.padding_mode})
                padding = 0
            new = g.call_function(_CONV[op], (x, w, b, m.stride, padding, m.dilation, m.groups))
    new.meta = dict(node.meta)
    new.meta[MODULE_KEY] = t
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new














def _activation_name(gm: GraphModule, head: Node) -> str:
    """``<module>.output_fake_quant`` for what a module returns (either front end), else
    ``<owner>.<node>_fake_quant``."""
    module = head.meta.get(MODULE_KEY) or (
        head.target if head.op == "call_module" else None)
    if module is not None:
        return f"{module}.output_fake_quant"
    owner = innermost_owner(head)
    if owner and module_output(head):
        return f"{owner}.output_fake_quant"
    return f"{owner}.{head.name}_fake_quant" if owner else f"{head.name}_fake_quant"


def _weighted(gm: GraphModule, node: Node) -> bool:
    return weighted_module_op(gm, node) is not None or weight_use(node) is not None


def _data_input(op: Node) -> Any:
    """What a weighted op multiplies its weight with: ``addmm(bias, x, W)`` reads ``x``
    second, every other weighted op (linear, conv, mm, matmul) first."""
    index = 1 if op_name(op) == "addmm" else 0
    return op.args[index] if len(op.args) > index else None


def _weighted_ops(gm: GraphModule) -> dict[tuple[int, str], list[Node]]:
    """(rule, matched module) -> the weighted ops that module rule selected: a module whose
    weighted op is not what it returns (GPT-2's Conv1D: ``addmm`` then ``view``)."""
    found: dict[tuple[int, str], list[Node]] = {}
    for node in gm.graph.nodes:
        qs = node.meta.get(QSCHEME_KEY)
        if qs is not None and not qs.skip and qs.weight is not None and _weighted(gm, node):
            found.setdefault((qs.rule, qs.matched), []).append(node)
    return found


def _dynamic_input(gm: GraphModule, ctx: Context, op: Node, qs: Any) -> None:
    """Dynamic mode quantizes what a weighted op reads, per batch, as dynamic integer
    kernels do (torch.ao's quantize_dynamic): a quantizer on the op's input, for this op
    only."""
    x = _data_input(op)
    if not isinstance(x, Node):
        return
    is_float, shape = tensor_shape(x, ctx)
    if not is_float:
        ctx.note(f"rule {qs.rule}: the input of {op.name} is not a floating-point tensor; "
                 "it is not quantized")
        return
    fq = build(qs.activation, ctx, role="activation", shape=shape, dynamic=True,
                where=f"node {op.name!r}", field=f"quant.rules[{qs.rule}].activation")
    move_to(fq, model_device(gm))
    module = layer_of(op)
    base = f"{module}.input_fake_quant" if module else f"{op.name}_input_fake_quant"
    name = add_quantizer(gm, base, fq)
    with gm.graph.inserting_before(op):
        q = quantizer_call(gm, name, x)
    q.meta[TENSOR_META] = x.meta.get(TENSOR_META)
    if NN_MODULE_STACK in op.meta:
        q.meta[NN_MODULE_STACK] = op.meta[NN_MODULE_STACK]
    op.replace_input_with(x, q)
    ctx.quantizers.append(quantizer_record(name, fq, "activation", op.name, qs.rule))


def _activations(gm: GraphModule, ctx: Context) -> None:
    mode = ctx.spec.quant.mode
    dev = model_device(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    done: set[tuple[str, ...]] = set()
    weighted_ops = _weighted_ops(gm) if mode == "dynamic" else {}
    for node in list(gm.graph.nodes):
        qs = node.meta.get(QSCHEME_KEY)
        if qs is None or qs.skip or qs.activation is None:
            continue
        group = node.meta.get(FUSION_KEY)
        if group is not None:
            if group in done:
                continue
            done.add(group)
            head, last = by_name[group[0]], by_name[group[-1]]
        else:
            head = last = node
        if mode == "dynamic" and _weighted(gm, head):
            _dynamic_input(gm, ctx, head, qs)
            continue
        ops = weighted_ops.get((qs.rule, qs.matched), [])
        if len(ops) == 1:  # the module's one weighted op reads what dynamic mode quantizes
            _dynamic_input(gm, ctx, ops[0], qs)
            continue
        is_float, shape = tensor_shape(last, ctx)
        if not is_float:
            ctx.note(f"rule {qs.rule}: {last.name} does not output a floating-point tensor; "
                     "its activation is not quantized")
            continue
        field = f"quant.rules[{qs.rule}].activation"
        fq = build(qs.activation, ctx, role="activation", shape=shape,
                    dynamic=mode == "dynamic",
                    where=f"node {last.name!r}", field=field)
        set_activation_mode(fq, mode)
        move_to(fq, dev)
        name = add_quantizer(gm, _activation_name(gm, head), fq)
        insert_after(gm, last, name)
        ctx.quantizers.append(quantizer_record(name, fq, "activation", last.name, qs.rule))


def _weights(gm: GraphModule, ctx: Context) -> None:
    mode = ctx.spec.quant.mode
    # One quantizer per Parameter, also when it is tied under several names. Keyed by
    # id() in this call only: the dict dies with the pass, so nothing outlives the graph.
    by_param: dict[int, Node] = {}
    no_weight: dict[int, list[str]] = {}
    for node in list(gm.graph.nodes):
        qs = node.meta.get(QSCHEME_KEY)
        if qs is None or qs.skip or qs.weight is None:
            continue
        op = weighted_module_op(gm, node)
        if op is not None:
            node = _functionalize(gm, node, op)
        use = weight_use(node)
        if use is None:
            no_weight.setdefault(qs.rule, []).append(node.name)
            continue
        w_node = use.param
        target = str(w_node.target)
        weight = attr(gm, target)
        if not isinstance(weight, nn.Parameter):
            no_weight.setdefault(qs.rule, []).append(node.name)
            continue
        if id(weight) in by_param:
            use.consumer.replace_input_with(w_node, by_param[id(weight)])
            if not w_node.users:
                gm.graph.erase_node(w_node)
            continue
        where = f"parameter {target!r} (node {node.name!r})"
        field = f"quant.rules[{qs.rule}].weight"
        # A weight stored [in, out] (GPT-2's Conv1D, ``x @ W``): per-group groups run
        # along the input dimension, so its quantizer sees the [out, in] transpose.
        transposed = use.axis % weight.dim() != 0 and qs.weight.granularity == "per_group"
        if transposed and weight.dim() != 2:
            raise QCompileError(
                f"{where}: {field}: per_group needs the weight stored as [out, in]; "
                f"{node.name} uses it as [in, out]",
                fix="use granularity per_channel for this layer, or skip it with a rule")
        shape = tuple(weight.shape[::-1]) if transposed else tuple(weight.shape)
        fq = build(qs.weight, ctx, role="weight", shape=shape, dynamic=False,
                    where=where, field=field,
                    channel_axis=0 if transposed else use.axis % weight.dim())
        move_to(fq, weight.device)  # a quantizer lives where its tensor does (cuda, meta, ...)
        fq.observe_tensor(weight.detach().t() if transposed else weight)
        # Weights move only in QAT: keep tracking them there, freeze them otherwise.
        set_flag(fq, "observe", mode == "qat" and not fq.learnable)
        name = add_quantizer(gm, f"{target}_fake_quant", fq)
        stack = {k: v for k, v in node.meta.items() if k == NN_MODULE_STACK}
        with gm.graph.inserting_after(w_node):
            src = gm.graph.call_function(torch.t, (w_node,)) if transposed else w_node
        with gm.graph.inserting_after(src):
            q = quantizer_call(gm, name, src)
        out = q
        if transposed:
            with gm.graph.inserting_after(q):
                out = gm.graph.call_function(torch.t, (q,))
            src.meta.update(stack)
            out.meta.update(stack)
        q.meta.update(stack)
        if transposed:
            ctx.note(f"{target} is stored [in, out]: its per-group quantizer {name} sees the "
                     "[out, in] transpose (groups along the input dimension)")
        use.consumer.replace_input_with(w_node, out)
        by_param[id(weight)] = out
        ctx.quantizers.append(quantizer_record(name, fq, "weight", target, qs.rule))
    for rule, names in sorted(no_weight.items()):
        ctx.note(f"rule {rule}: weight scheme not applied to {len(names)} node(s) without a "
                 f"Linear/Conv/Embedding weight ({', '.join(names[:4])})")


def _inputs(gm: GraphModule, ctx: Context) -> None:
    scheme = ctx.spec.quant.inputs
    if scheme is None:
        return
    dev = model_device(gm)
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        is_float, shape = tensor_shape(node, ctx)
        if not is_float:
            continue
        fq = build(scheme, ctx, role="activation", shape=shape,
                    dynamic=ctx.spec.quant.mode == "dynamic",
                    where=f"input {node.target!r}", field="quant.inputs")
        set_activation_mode(fq, ctx.spec.quant.mode)
        move_to(fq, dev)
        name = add_quantizer(gm, f"{node.target}_input_fake_quant", fq)
        insert_after(gm, node, name)
        ctx.quantizers.append(quantizer_record(name, fq, "input", node.name, None))


@graph_pass(requires=("annotations", "fusion_groups"), provides=("quantizers",),
            needs_code=False)
def insert_quant(gm: GraphModule, ctx: Context) -> GraphModule:
    """Insert activation, weight and input quantizers."""
    # Activations first: fusion groups name the nodes as traced, before weights are
    # re-expressed functionally.
    _activations(gm, ctx)
    _weights(gm, ctx)
    _inputs(gm, ctx)
    return gm
