"""``use_kernels``: linear / conv / add between quantized tensors become integer kernels.

Kernels are ``torch.ops.quantized`` through torch's own modules, on the current
``torch.backends.quantized.engine`` (x86/fbgemm, onednn, qnnpack), and run on CPU only:

- ``linear`` / ``conv1-3d`` (+ ReLU) whose input is a ``dequantize`` (an 8-bit per-tensor
  activation, ``lower_activations``), whose weight fits ``qint8`` (symmetric, per-tensor
  or per-channel on axis 0) and whose output (or the following ReLU) goes into a
  ``quantize_per_tensor`` become ``nnq.Linear`` / ``nniq.LinearReLU`` / ``nnq.Conv2d`` /
  ... reading and writing ``quint8`` tensors; a folded BatchNorm's bias replaces the op's.
- ``conv_transpose1-3d`` (+ ReLU, run on the quantized output) between such tensors
  becomes ``nnq.ConvTranspose1d`` / ``2d`` / ``3d`` where the engine's kernel takes the
  weight: per-tensor on x86 (packed with fbgemm), per-tensor or per-channel without
  groups on qnnpack, 1-D and 2-D (``common.transposed_kernel_refusal``); other
  transposed convolutions keep the float op on an ``IntWeight``, with the reason.
- ``add`` (+ ReLU) between two such tensors becomes ``quantized::add`` (``add_relu``).
- Dynamic graphs: ``linear`` whose input has an 8-bit per-tensor asymmetric dynamic
  quantizer becomes ``quantized::linear_dynamic`` (``DynamicLinear``); so does
  ``addmm(bias, x, W)`` with a 2-D ``x`` and a weight stored [in, out] (Hugging Face
  GPT-2's ``Conv1D``), with the transposed integer weight.

torch's quantized convolutions return channels-last tensors, where the float op returned
contiguous ones: a ``view`` after one (``x.view(x.size(0), -1)`` before a classifier)
then fails. Every ``view`` / ``view_as`` reading such a value (directly or through other
ops) becomes ``reshape`` / ``reshape_as``, which returns the same view wherever ``view``
would succeed and copies only where the layout needs it (an int8 copy, when
``sink_dequantize`` moved the view onto the quantized tensor).

A kernel module is added as ``_qc_<k>_<layer>``; ``tidy`` gives it its layer's name.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
    ...                         torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = qc.qcompile(m, "int8-static", example_inputs=(torch.randn(2, 8),))
    >>> gm = qc.calibrate(gm, [(torch.randn(16, 8),) for _ in range(2)], progress=False)
    >>> int8 = qc.convert(gm)
    >>> [c.op for c in qc.report(int8).conversions if c.path == "kernel"]
    ['quantized::linear_relu', 'quantized::linear_relu', 'quantized::linear']
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.meta import DQ_KEY, FINAL_NAME_KEY, MODULE_KEY, QPARAMS_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import (
    ADD,
    CONV,
    CONV_TRANSPOSE,
    LINEAR,
    QCONV,
    QCONV_TRANSPOSE,
    Conversion,
    IntTensor,
    arg,
    attr_value,
    is_relu,
    module_at,
    only_user,
    qint8,
    state,
    transposed_kernel_refusal,
    where,
)
from qcompile.runtime.engines import use_engine
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.quantized import DynamicLinear

ADDMM = frozenset({torch.addmm, torch.ops.aten.addmm.default})
# Kernels whose output is channels-last (fbgemm / onednn / qnnpack conv, transposed too).
_CHANNELS_LAST = (nnq.Conv1d, nnq.Conv2d, nnq.Conv3d, nnq.ConvTranspose1d, nnq.ConvTranspose2d,
                  nnq.ConvTranspose3d)
_RESHAPE_METHODS = {"view": "reshape", "view_as": "reshape_as"}
_RESHAPE_FUNCTIONS = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                      torch.Tensor.view: torch.Tensor.reshape}


def _quantized_output(gm: GraphModule, node: Node) -> tuple[Node, bool, Node | None]:
    """(the quantize node consuming ``node``'s value, whether a ReLU sits between, the ReLU
    node) or (node, False, None) when the value is not quantized."""
    user = only_user(node)
    relu = None
    if is_relu(gm, user):
        relu, user = user, only_user(user)
    if user is not None and user.target is torch.quantize_per_tensor:
        return user, relu is not None, relu
    return node, False, None


def _replace_chain(gm: GraphModule, op: Node, out_q: Node, relu: Node | None,
                   new: Node) -> None:
    out_q.replace_all_uses_with(new)
    for n in (out_q, relu, op):
        if n is not None:
            gm.graph.erase_node(n)


@dataclass(frozen=True)
class _Between:
    """A weighted op between quantized tensors: its dequantized input ``x``, weight
    quantizer node, output quantizer (and the ReLU before it, if any) and float bias."""

    x: Node
    w_node: Node
    out_q: Node
    has_relu: bool
    relu: Node | None
    bias: torch.Tensor | None


def _between_quantized(gm: GraphModule, conv: Conversion, node: Node) -> _Between | None:
    """What a static kernel for ``node`` needs, or None where its input is not a
    dequantized tensor, its weight has no integers or its output is not quantized."""
    x, w_node = node.args[0], node.args[1] if len(node.args) > 1 else None
    if not (isinstance(x, Node) and x.meta.get(DQ_KEY)) or w_node not in conv.weights:
        return None
    out_q, has_relu, relu = _quantized_output(gm, node)
    if out_q is node:
        return None
    bias = conv.bias.get(node, attr_value(gm, arg(node, 2, "bias", None)))
    # a copy: the packed kernel keeps the tensor it is given, and the graph's float
    # parameters are the source graph's own (qc.convert shares them while converting)
    bias = None if bias is None else bias.detach().float().clone()
    return _Between(x, w_node, out_q, has_relu, relu, bias)


def _static_kernel(gm: GraphModule, conv: Conversion, node: Node) -> bool:
    b = _between_quantized(gm, conv, node)
    if b is None:
        return False
    x, w_node, out_q, has_relu, relu, bias = b.x, b.w_node, b.out_q, b.has_relu, b.relu, b.bias
    qweight = qint8(conv.weights[w_node])
    if qweight is None:
        return False
    scale, zp = out_q.meta[QPARAMS_KEY][:2]
    shape = tuple(qweight.shape)
    if node.target in LINEAR:
        module = (nniq.LinearReLU(shape[1], shape[0], bias=bias is not None) if has_relu
                  else nnq.Linear(shape[1], shape[0], bias_=bias is not None))
    else:
        dims = CONV[node.target]
        padding = arg(node, 4, "padding", 0)
        if isinstance(padding, str):
            if padding != "valid":
                return False
            padding = 0
        cls = QCONV[dims][1 if has_relu else 0]
        groups = arg(node, 6, "groups", 1)
        module = cls(shape[1] * groups, shape[0], shape[2:], stride=arg(node, 3, "stride", 1),
                     padding=padding, dilation=arg(node, 5, "dilation", 1), groups=groups,
                     bias=bias is not None)
    module.set_weight_bias(qweight, bias)
    module.scale, module.zero_point = scale, zp
    name = conv.add_module(gm, where(node), module)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(name, (x.args[0],))
    new.meta[MODULE_KEY] = new.meta[FINAL_NAME_KEY] = where(node)
    _replace_chain(gm, node, out_q, relu, new)
    conv.release(w_node)
    op = f"quantized::{'linear' if node.target in LINEAR else 'conv'}" + (
        "_relu" if has_relu else "")
    conv.record(new, "kernel", op,
                f"{torch.backends.quantized.engine} engine, weight {tuple(shape)} int8")
    return True


def _transposed_kernel(gm: GraphModule, conv: Conversion, node: Node) -> bool:
    """``conv_transpose1-3d`` between quantized tensors -> ``nnq.ConvTranspose1-3d`` where
    the engine's kernel takes the weight (``transposed_kernel_refusal``); a ReLU after it
    runs on the quantized output (exact: quantizing is monotone)."""
    b = _between_quantized(gm, conv, node)
    if b is None:
        return False
    x, w_node, out_q, has_relu, relu, bias = b.x, b.w_node, b.out_q, b.has_relu, b.relu, b.bias
    t, dims, groups = conv.weights[w_node], CONV_TRANSPOSE[node.target], arg(node, 6, "groups", 1)
    engine = torch.backends.quantized.engine
    if not isinstance(groups, int) or transposed_kernel_refusal(t, dims, groups, engine):
        return False
    qweight = qint8(t, axis=1)
    shape = tuple(qweight.shape)
    module = QCONV_TRANSPOSE[dims](
        shape[0], shape[1] * groups, shape[2:], stride=arg(node, 3, "stride", 1),
        padding=arg(node, 4, "padding", 0), output_padding=arg(node, 5, "output_padding", 0),
        groups=groups, bias=bias is not None, dilation=arg(node, 7, "dilation", 1))
    packer = "fbgemm" if engine == "x86" and "fbgemm" in (
        torch.backends.quantized.supported_engines) else engine
    with use_engine(packer):  # packed weights keep their engine
        module.set_weight_bias(qweight, bias)
    module.scale, module.zero_point = out_q.meta[QPARAMS_KEY][:2]
    name = conv.add_module(gm, where(node), module)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(name, (x.args[0],))
        out = gm.graph.call_function(torch.relu, (new,)) if has_relu else new
    new.meta[MODULE_KEY] = new.meta[FINAL_NAME_KEY] = where(node)
    _replace_chain(gm, node, out_q, relu, out)
    conv.release(w_node)
    conv.record(new, "kernel", "quantized::conv_transpose" + ("_relu" if has_relu else ""),
                f"{packer} engine, weight {shape} int8")
    return True


def _transposed(t: IntTensor) -> IntTensor | None:
    """A 2-D [in, out] weight's integers as the [out, in] weight a Linear kernel takes
    (GPT-2's Conv1D: ``addmm(bias, x, W)`` is ``linear(x, W.t(), bias)``)."""
    if t.q.dim() != 2 or t.group_size is not None:
        return None
    return replace(t, q=t.q.t().contiguous(), axis=None if t.axis is None else 1 - t.axis)


def _dynamic_kernel(gm: GraphModule, conv: Conversion, node: Node) -> bool:
    x, w_node = node.args[0], node.args[1] if len(node.args) > 1 else None
    weight = conv.weights.get(w_node) if isinstance(w_node, Node) else None
    bias_node = arg(node, 2, "bias", None)
    if node.target in ADDMM:  # addmm(bias, x, W [in, out]): a Linear on W.t()
        if len(node.args) != 3 or node.kwargs or node.args[2] not in conv.weights:
            return False
        bias_node, x, w_node = node.args
        weight = _transposed(conv.weights[w_node])
        x_meta = x.meta.get(TENSOR_META) if isinstance(x, Node) else None
        bias = attr_value(gm, bias_node)
        if weight is None or bias is None or bias.dim() != 1 or (
                x_meta is not None and len(x_meta.shape) != 2):
            return False
    elif node.target not in LINEAR or weight is None:
        return False
    fq = module_at(gm, x) if isinstance(x, Node) else None
    if not (isinstance(fq, FakeQuantize) and fq.dynamic and fq.enabled
            and fq.granularity == "per_tensor" and not fq.symmetric
            and fq.dtype == "uint8" and fq.quant_min == 0 and fq.quant_max in (127, 255)):
        return False
    qweight = qint8(weight)
    if qweight is None:
        return False
    bias = attr_value(gm, bias_node)
    # reduce_range: the kernel picks 7-bit activation qparams per batch, as the x86
    # target's dynamic fake-quant does (fbgemm's int16 pair sums stay exact on every CPU)
    module = DynamicLinear(qweight.shape[1], qweight.shape[0], bias_=bias is not None,
                           reduce_range=fq.quant_max == 127)
    module.set_weight_bias(qweight, None if bias is None else bias.detach().float().clone())
    name = conv.add_module(gm, where(node), module)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(name, (x.args[0],))
    new.meta[MODULE_KEY] = new.meta[FINAL_NAME_KEY] = where(node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    conv.release(w_node)
    conv.record(new, "dynamic_kernel", "quantized::linear_dynamic",
                f"weight {tuple(qweight.shape)} int8, "
                f"{'7' if fq.quant_max == 127 else '8'}-bit activations")
    return True


def _add_kernel(gm: GraphModule, conv: Conversion, node: Node) -> bool:
    args = [a for a in node.args if isinstance(a, Node)]
    if (len(node.args) != 2 or len(args) != 2 or node.kwargs
            or not all(a.meta.get(DQ_KEY) for a in args)):
        return False
    out_q, has_relu, relu = _quantized_output(gm, node)
    if out_q is node:
        return False
    scale, zp = out_q.meta[QPARAMS_KEY][:2]
    fn = torch.ops.quantized.add_relu if has_relu else torch.ops.quantized.add
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(fn, (args[0].args[0], args[1].args[0], scale, zp))
    _replace_chain(gm, node, out_q, relu, new)
    conv.record(new, "kernel", f"quantized::add{'_relu' if has_relu else ''}")
    return True


def _views_as_reshapes(gm: GraphModule) -> int:
    """``view`` -> ``reshape`` on every value computed from a channels-last kernel's output
    (conservatively: through any op); how many. ``reshape`` is ``view`` wherever the
    strides allow it, so nothing changes where a view would have worked."""
    tainted: set[Node] = set()
    rewritten = 0
    for node in gm.graph.nodes:
        if isinstance(module_at(gm, node), _CHANNELS_LAST):
            tainted.add(node)
            continue
        data = node.args[0] if node.args else None
        if not any(a in tainted for a in node.all_input_nodes):
            continue
        tainted.add(node)
        if data not in tainted or any(isinstance(a, torch.dtype) for a in node.args[1:]):
            continue  # a view of another tensor, or a reinterpretation (`x.view(torch.int8)`)
        if node.op == "call_method" and node.target in _RESHAPE_METHODS:
            node.target = _RESHAPE_METHODS[str(node.target)]
        elif node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS:
            node.target = _RESHAPE_FUNCTIONS[node.target]
        else:
            continue
        rewritten += 1
    return rewritten


@graph_pass(requires=("batchnorm_folded", "dequantize_sunk"), provides=("kernels",))
def use_kernels(gm: GraphModule, ctx: Context) -> GraphModule:
    conv = state(ctx)
    if conv.rows_only:
        ctx.note("each rank converts its rows of a sharded graph: no integer kernels (they "
                 "need whole weights); every weight is stored as integers")
        return gm
    if not all(t.device.type == "cpu" for t in gm.parameters()):
        ctx.note("parameters not on the CPU: no integer kernels (they run on CPU only)")
        return gm
    used = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in LINEAR or node.target in CONV:
            used += _static_kernel(gm, conv, node) or _dynamic_kernel(gm, conv, node)
        elif node.target in CONV_TRANSPOSE:
            used += _transposed_kernel(gm, conv, node)
        elif node.target in ADDMM:
            used += _dynamic_kernel(gm, conv, node)
        elif node.target in ADD:
            used += _add_kernel(gm, conv, node)
    ctx.note(f"{used} integer kernel(s), {torch.backends.quantized.engine} engine")
    reshaped = _views_as_reshapes(gm)
    if reshaped:
        ctx.note(f"{reshaped} view(s) of a channels-last kernel output -> reshape")
    return gm
