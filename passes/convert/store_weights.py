"""``store_weights``: every weight no kernel took is stored as integers (``IntWeight``),
every block-format weight in its format's bits (``BlockWeight``).

int4 is packed two per byte, int8 and int16 as they are; per-group scales of 4-bit
weights are stored as float16 when they fit. The ``IntWeight`` module returns the
dequantized weight to the float op (embedding, matmul, an op without a quantized input,
a weight no kernel takes) and the float parameter leaves the state dict (``tidy``). An op
whose BatchNorm was folded reads the folded bias from a new buffer.

A block-format weight (MXFP8 / MXFP6 / MXFP4, NVFP4, NF4) becomes a ``BlockWeight``: its
element codes (``float8_e4m3fn`` / ``float8_e5m2``, fp6 four in three bytes,
``float4_e2m1fn_x2``, NF4 indices two per byte) and block scales (``float8_e8m0fnu``,
``float8_e4m3fn`` with NVFP4's float32 tensor scale, float32 absmax), dequantized in the
layer's dtype for the float op: the same values as the fake-quant graph's, exactly.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = qc.qcompile(m, "w8-weight-only", example_inputs=(torch.randn(2, 8),))
    >>> int8 = qc.convert(gm)
    >>> [(c.module, c.op) for c in qc.report(int8).conversions]
    [('0.weight', 'int8 weight'), ('2.weight', 'int8 weight')]
    >>> sorted(k for k in int8.state_dict() if k.startswith("0."))  # no float weight
    ['0.bias', '0.weight.packed', '0.weight.scale', '0.weight.zero_point']
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.meta import FINAL_NAME_KEY
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.collect_weights import weight_source
from qcompile.passes.convert.common import (
    CONV,
    CONV_TRANSPOSE,
    LINEAR,
    Conversion,
    IntTensor,
    arg,
    attr_value,
    grid_dtype,
    module_at,
    qint8,
    state,
    transposed_kernel_refusal,
    where,
)
from qcompile.runtime.block_formats import bits_per_element
from qcompile.runtime.block_storage import BlockWeight
from qcompile.runtime.quantized import IntWeight


def _fits_fp16(scale: torch.Tensor) -> bool:
    """float16 keeps ~3 significant digits for normal values (6.1e-5 .. 65504)."""
    return bool(((scale >= 6.2e-5) & (scale <= 65504)).all())


def _storage(t: IntTensor, rows_only: bool) -> tuple[torch.Tensor, int]:
    """The integers in their storage dtype (the grid's, whatever the values: every rank
    of a sharded conversion picks the same) and the bits ``IntWeight`` packs them at."""
    bits = t.bits
    q = t.q if t.q.dtype == grid_dtype(t.quant_min, t.quant_max) else t.q.to(
        grid_dtype(t.quant_min, t.quant_max))
    if rows_only and bits <= 4:
        return q.to(torch.int8), 8  # two per byte would cut rows apart: one per byte
    return q, 4 if bits <= 4 else 8 if bits <= 8 else 16


@graph_pass(requires=("kernels",), provides=("int_storage",))
def store_weights(gm: GraphModule, ctx: Context) -> GraphModule:
    conv = state(ctx)
    g = gm.graph
    stored = 0
    for w_node in list(conv.weights):
        if w_node._erased or not w_node.users:
            conv.weights.pop(w_node)  # consumed by a kernel (the node was erased with it)
            continue
        # taken out of the conversion as it is stored: its integers live in one place
        t = conv.weights.pop(w_node)
        users = list(w_node.users)
        fq = module_at(gm, w_node)
        param_node = weight_source(w_node.args[0])  # a transposed weight: its parameter
        param_name = str(param_node.target)
        param = attr_value(gm, param_node)
        scale = t.scale
        note = ""
        if conv.rows_only and t.bits <= 4:
            note = "int4 stored one per byte (each rank converts its rows)"
        elif (t.group_size is not None and t.bits <= 4 and _fits_fp16(scale)
              and not conv.rows_only):  # ranks would disagree on fitting
            # 4-bit groups of 32: fp32 scales alone would be 25% of the int4 payload
            scale = scale.half()
            note = "per-group scales stored as float16"
        elif qint8(t) is None and any(u.target in LINEAR or u.target in CONV for u in users):
            note = f"{fq.dtype} {fq.granularity}: no integer kernel for this weight"
        elif transposed := next((u for u in users if u.target in CONV_TRANSPOSE), None):
            groups = arg(transposed, 6, "groups", 1)
            note = transposed_kernel_refusal(
                t, CONV_TRANSPOSE[transposed.target], groups if isinstance(groups, int) else 0,
                torch.backends.quantized.engine) or ""
        q, bits = _storage(t, conv.rows_only)
        zero_point, axis, group_size = t.zero_point, t.axis, t.group_size
        del t  # the IntWeight holds the integers from here on
        module = IntWeight(q, scale, zero_point, axis=axis, group_size=group_size, bits=bits,
                           dtype=param.dtype, by_rows=conv.rows_only)
        del q
        new = _in_place_of(gm, conv, w_node, module, param_name)
        stored += 1
        conv.record(new, "int_storage", f"int{module.bits} weight",
                    note or "dequantized for the float op", layer=param_name)
        for user in users:  # a folded BatchNorm's bias replaces the op's own
            if user in conv.bias:
                # rows of a sharded graph: a parameter, which fully_shard shards
                b = conv.add_buffer(gm, f"{where(user)}.bias", conv.bias[user],
                                    parameter=conv.rows_only)
                with g.inserting_before(user):
                    b_node = g.get_attr(b)
                args = list(user.args)
                while len(args) < 3:
                    args.append(None)
                args[2] = b_node
                user.args = tuple(args)
    ctx.note(f"{stored} weight(s) stored as integers")
    blocks = 0
    for w_node in list(conv.blocks):
        codes = conv.blocks.pop(w_node)  # the BlockWeight holds them from here on
        if w_node._erased or not w_node.users:
            continue
        param_node = weight_source(w_node.args[0])
        param_name = str(param_node.target)
        block = BlockWeight(codes, dtype=attr_value(gm, param_node).dtype)
        del codes
        new = _in_place_of(gm, conv, w_node, block, param_name)
        blocks += 1
        conv.record(new, "block_storage", f"{block.fmt} weight",
                    f"blocks of {block.block}, "
                    f"{bits_per_element(block.fmt, block.block):g} bits per weight; "
                    "dequantized for the float op", layer=param_name)
    if blocks:
        ctx.note(f"{blocks} weight(s) stored in their block formats")
    return gm


def _in_place_of(gm: GraphModule, conv: Conversion, w_node: Node, module: torch.nn.Module,
                 param_name: str) -> Node:
    """``module`` (called without arguments) in place of the weight quantizer ``w_node``;
    ``tidy`` names it ``param_name``."""
    g = gm.graph
    name = conv.add_module(gm, param_name, module)
    with g.inserting_before(w_node):
        new = g.call_module(name, ())
    new.meta[FINAL_NAME_KEY] = param_name
    w_node.replace_all_uses_with(new)
    g.erase_node(w_node)
    return new
