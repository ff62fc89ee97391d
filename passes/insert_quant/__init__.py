"""``insert_quant``: put ``FakeQuantize`` modules where the annotations say.

- Activations: a quantizer after each annotated node with an activation scheme, or after
  the last member of its fusion group (conv-bn-relu is quantized once, at its output).
- Weights: Linear / Conv1-3d / ConvTranspose1-3d / Embedding / EmbeddingBag calls are
  re-expressed with the functional op (``F.linear(x, fc.weight_fake_quant(fc.weight),
  fc.bias)``) so the graph shows weight -> quantizer -> op, exactly as on ``torch.export``
  graphs; any op reading a parameter, buffer or tensor attribute as its weight
  (``qcompile.graph.matching.weight_use``) gets the same treatment. One quantizer per
  tensor, named ``<module>.<param>_fake_quant``; parameter names are unchanged. A weight
  stored [in, out] (Hugging Face GPT-2's ``Conv1D``: ``addmm(b, x, W)``, or ``x @ W``) is
  quantized per channel along its output dimension (axis 1); per group, its quantizer
  sees ``W.t()`` so that groups run along the input dimension, as for a Linear. A 3-D
  expert weight (``[experts, out, in]`` or ``[experts, in, out]``) is seen as its
  ``[experts * out, in]`` rows: scales per expert and output channel.
- Recurrent layers (LSTM, GRU, RNN and their cells): ``insert_quant.recurrent``.
- Inputs: ``quant.inputs``: a scheme quantizes each float model input; ``auto`` (the
  int8-static / int8-qat presets) quantizes a float input where a quantized Linear / Conv
  reads it, with that layer's activation scheme (torch.ao's input observer).
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
        input_input_fake_quant = self.input_input_fake_quant(input_1);  input_1 = None
        _0_weight = getattr(self, "0").weight
        _0_weight_fake_quant = getattr(self, "0").weight_fake_quant(_0_weight);  _0_weight = None
        _0_bias = getattr(self, "0").bias
        linear = torch._C._nn.linear(input_input_fake_quant, _0_weight_fake_quant, _0_bias);  ...
        _0_output_fake_quant = getattr(self, "0").output_fake_quant(linear, overwrite = True);  ...
        return _0_output_fake_quant
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
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
    owners,
    product_weights,
    weight_use,
    weighted_module_op,
)
from qcompile.graph.meta import FUSION_KEY, MODULE_KEY, NN_MODULE_STACK, QSCHEME_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass
from qcompile.graph.records import WeightCoverage
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
from qcompile.passes.insert_quant.recurrent import quantize_recurrent_layers
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.specs import Scheme

_CONV = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d,
         "conv_transpose1d": F.conv_transpose1d, "conv_transpose2d": F.conv_transpose2d,
         "conv_transpose3d": F.conv_transpose3d}


def _bound(m: nn.Module, node: Node) -> dict[str, Any]:
    """The call's arguments by the name of the module's ``forward`` parameter."""
    try:
        bound = inspect.signature(m.forward).bind(*node.args, **node.kwargs)
    except TypeError as e:
        raise QCompileError(f"node {node.name!r}: {type(m).__name__} called with arguments "
                            f"its forward does not take: {e}",
                            fix="check the call in the model's forward") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _functionalize(gm: GraphModule, node: Node, op: str) -> Node:
    """Replace ``call_module`` on a stock Linear/Conv/ConvTranspose/Embedding(Bag) by its
    functional op on the same parameters (the module's own forward does exactly this)."""
    t = str(node.target)
    m = gm.get_submodule(t)
    g = gm.graph
    a = _bound(m, node)
    x = next(iter(a.values()))
    if op.startswith("conv_transpose") and a.get("output_size") is not None:
        raise QCompileError(
            f"node {node.name!r}: {t} is called with output_size, which fixes its output "
            "padding from the input's shape on each call; its weight cannot be quantized here",
            fix=f"drop output_size (set output_padding on {t} instead), or skip {t} with a rule")
    with g.inserting_before(node):
        w = param_attr(g, m, t, "weight")
        b = param_attr(g, m, t, "bias") if getattr(m, "bias", None) is not None else None
        if op == "linear":
            new = g.call_function(F.linear, (x, w, b))
        elif op == "embedding":
            new = g.call_function(F.embedding, (x, w, m.padding_idx, m.max_norm, m.norm_type,
                                                m.scale_grad_by_freq, m.sparse))
        elif op == "embedding_bag":
            new = g.call_function(F.embedding_bag, (
                x, w, a["offsets"], m.max_norm, m.norm_type, m.scale_grad_by_freq, m.mode,
                m.sparse, a["per_sample_weights"], m.include_last_offset, m.padding_idx))
        elif op.startswith("conv_transpose"):
            new = g.call_function(_CONV[op], (x, w, b, m.stride, m.padding, m.output_padding,
                                              m.groups, m.dilation))
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
    """What a weighted op multiplies its weight with: the operand that is not the weight
    (``addmm(bias, x, W)`` reads ``x`` second, ``W @ x`` and ``einsum`` either side;
    linear, conv and the rest first)."""
    if op_name(op) == "addmm":
        return op.args[1] if len(op.args) > 1 else None
    operands = list(op.args[:2])
    if op_name(op) == "einsum":
        operands = list(op.args[1] if len(op.args) == 2 and isinstance(
            op.args[1], (list, tuple)) else op.args[1:])
    use = weight_use(op)
    weight = None if use is None else use.param if use.consumer is op else use.consumer
    return next((a for a in operands if isinstance(a, Node) and a is not weight),
                operands[0] if operands else None)


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
    only. So does a rule with ``activation_at: input`` in any mode (torchao's 8da4w and
    the block formats quantize the operand a matmul reads); its quantizer observes as the
    mode says unless its scheme is per-token or block-scaled (qparams from each input)."""
    x = _data_input(op)
    if not isinstance(x, Node):
        return
    is_float, shape = tensor_shape(x, ctx)
    if not is_float:
        ctx.note(f"rule {qs.rule}: the input of {op.name} is not a floating-point tensor; "
                 "it is not quantized")
        return
    mode = ctx.spec.quant.mode
    fq = build(qs.activation, ctx, role="activation", shape=shape, dynamic=mode == "dynamic",
                where=f"node {op.name!r}", field=f"quant.rules[{qs.rule}].activation")
    if mode != "dynamic":
        set_activation_mode(fq, mode)
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


def _activations(gm: GraphModule, ctx: Context, handled: set[Node]) -> None:
    mode = ctx.spec.quant.mode
    dev = model_device(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    done: set[tuple[str, ...]] = set()
    rules = ctx.spec.quant.rules
    at_input = [mode == "dynamic" or r.activation_at == "input" for r in rules]
    weighted_ops = _weighted_ops(gm) if any(at_input) else {}
    for node in list(gm.graph.nodes):
        qs = node.meta.get(QSCHEME_KEY)
        if qs is None or qs.skip or qs.activation is None or node in handled:
            continue
        group = node.meta.get(FUSION_KEY)
        if group is not None:
            if group in done:
                continue
            done.add(group)
            head, last = by_name[group[0]], by_name[group[-1]]
        else:
            head = last = node
        if at_input[qs.rule] and _weighted(gm, head):
            _dynamic_input(gm, ctx, head, qs)
            continue
        ops = weighted_ops.get((qs.rule, qs.matched), []) if at_input[qs.rule] else []
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


@dataclass(frozen=True)
class _Layout:
    """How a weight quantizer sees its tensor: as stored, or through views that make it
    [out, in] rows (an [in, out] weight quantized per group; 3-D expert weights, whose
    scales run per expert and output channel). ``to_rows`` and ``back`` are (function,
    extra args) applied in order, to the tensor and as graph nodes."""

    to_rows: tuple[tuple[Any, tuple[Any, ...]], ...]
    back: tuple[tuple[Any, tuple[Any, ...]], ...]
    axis: int

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        for fn, args in self.to_rows:
            t = fn(t, *args)
        return t


def weight_layout(weight: torch.Tensor, use: Any, scheme: Scheme, where: str, field: str,
                  node: Node) -> _Layout:
    """How the quantizer of ``weight`` (read by ``node`` as ``use`` says) sees it: the views
    to its rows (scales per output channel and group, along dim 0) and back; ``qc.search``
    quantizes weights the same way."""
    axis = use.axis % weight.dim()
    if use.experts:  # [experts, out, in] (axis 1) or [experts, in, out] (axis 2)
        e, a, b = weight.shape
        if axis == 1:
            return _Layout(((torch.reshape, ((e * a, b),)),),
                           ((torch.reshape, ((e, a, b),)),), 0)
        return _Layout(((torch.transpose, (1, 2)), (torch.reshape, ((e * b, a),))),
                       ((torch.reshape, ((e, b, a),)), (torch.transpose, (1, 2))), 0)
    if axis != 0 and scheme.granularity == "per_group":
        # A weight stored [in, out] (GPT-2's Conv1D, ``x @ W``): per-group groups run
        # along the input dimension, so its quantizer sees the [out, in] transpose.
        if weight.dim() != 2:
            raise QCompileError(
                f"{where}: {field}: per_group needs the weight stored as [out, in]; "
                f"{node.name} uses it as [in, out]",
                fix="use granularity per_channel for this layer, or skip it with a rule")
        return _Layout(((torch.t, ()),), ((torch.t, ()),), 0)
    return _Layout((), (), axis)


def _chain(gm: GraphModule, start: Node, steps: tuple[tuple[Any, tuple[Any, ...]], ...],
           meta: dict[str, Any]) -> Node:
    """Graph nodes applying ``steps`` to ``start``, right after it."""
    node = start
    for fn, args in steps:
        with gm.graph.inserting_after(node):
            node = gm.graph.call_function(fn, (node, *args))
        node.meta.update(meta)
    return node


def _weights(gm: GraphModule, ctx: Context, handled: set[Node]) -> None:
    mode = ctx.spec.quant.mode
    # One quantizer per weight tensor, also when it is tied under several names. Keyed by
    # id() in this call only: the dict dies with the pass, so nothing outlives the graph.
    by_param: dict[int, Node] = {}
    no_weight: dict[int, list[str]] = {}
    for node in list(gm.graph.nodes):
        qs = node.meta.get(QSCHEME_KEY)
        if qs is None or qs.skip or qs.weight is None or node in handled:
            continue
        op = weighted_module_op(gm, node)
        if op is not None:
            node = _functionalize(gm, node, op)
        use = weight_use(node)
        weight = attr(gm, str(use.param.target)) if use is not None else None
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            no_weight.setdefault(qs.rule, []).append(node.name)
            continue
        w_node = use.param
        target = str(w_node.target)
        if id(weight) in by_param:
            use.consumer.replace_input_with(w_node, by_param[id(weight)])
            if not w_node.users:
                gm.graph.erase_node(w_node)
            continue
        where = f"{'parameter' if isinstance(weight, nn.Parameter) else 'tensor'} " \
                f"{target!r} (node {node.name!r})"
        field = f"quant.rules[{qs.rule}].weight"
        layout = weight_layout(weight, use, qs.weight, where, field, node)
        rows = layout.apply(weight.detach())
        fq = build(qs.weight, ctx, role="weight", shape=tuple(rows.shape), dynamic=False,
                   where=where, field=field, channel_axis=layout.axis)
        move_to(fq, weight.device)  # a quantizer lives where its tensor does (cuda, meta, ...)
        fq.observe_tensor(rows)
        del rows
        # Weights move only in QAT (a buffer or constant never does): keep tracking them
        # there, freeze them otherwise.
        trains = isinstance(weight, nn.Parameter) and weight.requires_grad
        set_flag(fq, "observe", mode == "qat" and trains and not fq.learnable)
        name = add_quantizer(gm, f"{target}_fake_quant", fq)
        stack = {k: v for k, v in node.meta.items() if k == NN_MODULE_STACK}
        src = _chain(gm, w_node, layout.to_rows, stack)
        with gm.graph.inserting_after(src):
            q = quantizer_call(gm, name, src)
        q.meta.update(stack)
        out = _chain(gm, q, layout.back, stack)
        if layout.to_rows and not use.experts:
            ctx.note(f"{target} is stored [in, out]: its per-group quantizer {name} sees the "
                     "[out, in] transpose (groups along the input dimension)")
        use.consumer.replace_input_with(w_node, out)
        by_param[id(weight)] = out
        ctx.quantizers.append(quantizer_record(name, fq, "weight", target, qs.rule))
    for rule, names in sorted(no_weight.items()):
        ctx.note(f"rule {rule}: weight scheme not applied to {len(names)} node(s) that read "
                 f"no weight ({', '.join(names[:4])})")


def _auto_inputs(gm: GraphModule, ctx: Context) -> None:
    """``quant.inputs: auto``: a quantizer where a quantized weighted op reads a float model
    input (directly or through shape ops), with that op's activation scheme."""
    dev = model_device(gm)
    reshapes = {"view", "reshape", "flatten", "permute", "transpose", "contiguous",
                "squeeze", "unsqueeze", "t", "unsafe_view"}
    views = reshapes | {"getitem", "select", "index", "T"}
    weights = {r.name for r in ctx.quantizers if r.role == "weight"}

    def quantized_weight(n: Any) -> bool:  # a weight quantizer's output, or a view of it
        while (isinstance(n, Node) and n.op in ("call_function", "call_method")
               and n.args and op_name(n) in views):
            n = n.args[0]
        return isinstance(n, Node) and n.op == "call_module" and str(n.target) in weights

    def model_input(v: Any) -> Node | None:  # the float placeholder v reshapes, if any
        while isinstance(v, Node) and v.op != "placeholder":
            flatten = v.op == "call_module" and isinstance(
                gm.get_submodule(str(v.target)), nn.Flatten)
            if not (flatten or op_name(v) in reshapes) or not v.args or any(
                    a is not v.args[0] and tensor_shape(a, ctx)[0] for a in v.all_input_nodes):
                return None
            v = v.args[0]
        return v if isinstance(v, Node) and tensor_shape(v, ctx)[0] else None

    readers: dict[tuple[Node, Any], list[Node]] = {}
    for op in list(gm.graph.nodes):
        qs = op.meta.get(QSCHEME_KEY)
        if (op.op != "call_function" or qs is None or qs.skip or qs.weight is None
                or qs.activation is None
                or not any(quantized_weight(a) for a in op.all_input_nodes)):
            continue
        x = _data_input(op)
        if isinstance(x, Node) and model_input(x) is not None:
            readers.setdefault((x, qs.activation), []).append(op)
    for (x, act), ops in readers.items():
        rule = ops[0].meta[QSCHEME_KEY].rule
        source = model_input(x)
        fq = build(act, ctx, role="activation", shape=tensor_shape(x, ctx)[1],
                    dynamic=False, where=f"input {source.target!r} (read by {ops[0].name})",
                    field=f"quant.inputs (auto: quant.rules[{rule}].activation)")
        set_activation_mode(fq, ctx.spec.quant.mode)
        move_to(fq, dev)
        name = add_quantizer(gm, f"{source.target}_input_fake_quant", fq)
        with gm.graph.inserting_after(x):
            q = quantizer_call(gm, name, x)
        q.meta[TENSOR_META] = x.meta.get(TENSOR_META)
        for op in ops:
            op.replace_input_with(x, q)
        ctx.quantizers.append(quantizer_record(name, fq, "input", source.name, rule))
    if readers:
        read = ", ".join(op.name for ops in readers.values() for op in ops)
        ctx.note(f"quant.inputs auto: {len(readers)} input quantizer(s), where quantized "
                 f"layers read model inputs ({read})")


def _inputs(gm: GraphModule, ctx: Context) -> None:
    """``quant.inputs``: a scheme quantizes every float model input with it; ``auto``
    quantizes what a quantized weighted op (weight and activation schemes) reads when that
    is a float model input, directly or through shape ops (``x.flatten(1)``), with the
    op's own activation scheme, for that op only (torch.ao's input observer): the first
    layer of a converted graph then reads integers. Dynamic mode already quantizes every
    weighted op's input per batch, so ``auto`` adds nothing there."""
    scheme = ctx.spec.quant.inputs
    if scheme is None:
        return
    if scheme == "auto":
        if ctx.spec.quant.mode != "dynamic":  # dynamic mode quantizes them per batch already
            _auto_inputs(gm, ctx)
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
    # recurrent layers (LSTM, GRU, RNN and their cells) are done whole, their own way
    handled = quantize_recurrent_layers(gm, ctx)
    _activations(gm, ctx, handled)
    _weights(gm, ctx, handled)
    _inputs(gm, ctx)
    _check_named_weights(gm, ctx)
    return gm


def _check_named_weights(gm: GraphModule, ctx: Context) -> None:
    """A weight a rule names stays float only by another rule's skip: a module rule with a
    weight scheme names its module's own matrices and kernels (2-D and up); one the graph
    reads but no quantizer took is an error, naming the parameter. Also counts the
    parameters behind a quantizer (``Report.parameters_quantized``)."""
    quantized = {q.node for q in ctx.quantizers if q.role == "weight"}
    rules = ctx.spec.quant.rules
    named: dict[str, int] = {}  # module -> the rule naming its weights
    skipped: set[str] = set()  # modules owning a node a skip rule selected
    for node in gm.graph.nodes:
        qs = node.meta.get(QSCHEME_KEY)
        if qs is None:
            continue
        if qs.skip:
            skipped.update(o.name for o in owners(node, gm))
        elif qs.weight is not None and rules[qs.rule].match.op is None:
            named.setdefault(qs.matched, qs.rule)
    read = {str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for module, rule in named.items():
        if module in skipped:
            continue
        try:
            m = gm.get_submodule(module)
        except AttributeError:
            continue
        for pname, p in m.named_parameters(recurse=False):
            target = f"{module}.{pname}" if module else pname
            if (p.dim() < 2 or not p.is_floating_point() or target in quantized
                    or not (target in read or module in read)):
                continue
            if not module and isinstance(ctx.model, (nn.RNNBase, nn.RNNCellBase)):
                # the model is the recurrent layer itself: traced through, not called
                raise QCompileError(
                    f"quant.rules[{rule}] names {target}: the model itself is a "
                    f"{type(m).__name__}, which qcompile quantizes only as a layer of a model",
                    fix=f"compile a module that holds it, e.g. nn.Sequential(model) (its "
                        f"{type(m).__name__} becomes layer '0')")
            raise QCompileError(
                f"quant.rules[{rule}] names {target} ({type(m).__name__}) with a weight scheme, "
                f"but no op the graph runs reads it as a weight qcompile quantizes",
                fix=(f"skip {module} with a rule (match: {{name: {module!r}}}, skip: true), "
                     "or match the op that reads it") if module else
                    "drop the weight scheme from that rule, or match the op that reads it")
    _cover_products(gm, ctx, quantized, skipped)
    counted: dict[int, torch.Tensor] = {}
    for name, p in gm.named_parameters():
        if not isinstance(_owner_module(gm, name), FakeQuantize):
            counted.setdefault(id(p), p)
    behind = {id(attr(gm, t)) for t in quantized}
    total = sum(p.numel() for p in counted.values())
    ctx.parameters_quantized = (sum(p.numel() for k, p in counted.items() if k in behind),
                                total)


def _cover_products(gm: GraphModule, ctx: Context, quantized: set[str],
                    skipped: set[str]) -> None:
    """``Report.weights_quantized``: the weights linear ops and products read
    (``product_weights``), how many elements a quantizer reads, how many a skip rule keeps
    float; those left float by no rule are named in a note (a weight-sized parameter read
    in a way no rule recognises, or matched by none)."""
    reads = product_weights(gm, through=(FakeQuantize,))
    behind = {id(attr(gm, t)) for t in quantized}
    seen: set[int] = set()
    read = done = kept = 0
    left: list[str] = []
    for target, op in sorted(reads.items()):
        t = attr(gm, target)
        if id(t) in seen:
            continue
        seen.add(id(t))
        read += t.numel()
        qs = op.meta.get(QSCHEME_KEY)
        if id(t) in behind:
            done += t.numel()
        elif (qs is not None and qs.skip) or any(o.name in skipped
                                                 for o in owners(op, gm) if o.name):
            kept += t.numel()
        else:
            left.append(target)
    ctx.weights_quantized = WeightCoverage(read=read, quantized=done, skipped=kept, float=left)
    if left:
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        ctx.note(f"{len(left)} weight(s) read by a linear op or matrix product stay in float, "
                 f"no rule quantizes them: {shown}")


def _owner_module(gm: GraphModule, name: str) -> nn.Module:
    return gm.get_submodule(name.rpartition(".")[0]) if "." in name else gm
