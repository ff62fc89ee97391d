"""``lower_activations``: activation quantizers -> ``quantize_per_tensor`` -> ``dequantize``.

An 8-bit per-tensor static activation quantizer on a float32 value becomes a real
``quint8`` tensor and its dequantization, so what is not a kernel reads the same numbers
as the fake-quant graph (``use_kernels`` later takes the quantized tensors directly).
Other activation quantizers (per-token, fp8, not 8-bit, block-scaled formats) stay
``FakeQuantize`` with their observers frozen: simulated, with a record saying so (a
block-scaled activation computes its blocks' scales from each input, as it did before).
A switched-off quantizer is removed (its value passes as is); dynamic quantizers are left
to ``use_kernels``.

The scale and zero point are not constants in the code: each lowered quantizer becomes an
``ActivationQParams`` module in its place (state dict ``<quantizer>.scale`` /
``<quantizer>.zero_point``, the zero point on the quint8 grid) whose buffers the code
reads, so a converted graph's state dict carries its activation qparams.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = qc.qcompile(m, "int8-static", example_inputs=(torch.randn(2, 8),))
    >>> gm = qc.calibrate(gm, [(torch.randn(16, 8),) for _ in range(2)], progress=False)
    >>> step = next(p for p in qc.report(qc.convert(gm)).passes
    ...             if p.name == "convert.lower_activations")
    >>> step.notes  # the model input's and the two layers' outputs
    ['3 activation quantizer(s) -> quantize_per_tensor / dequantize']
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.meta import DQ_KEY, QPARAMS_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import (
    Conversion,
    act_qparams,
    level_bounds,
    module_at,
    state,
)
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.quantized import ActivationQParams, clamp_levels


def _place(gm: GraphModule, conv: Conversion, lowered: list[tuple[Node, tuple]]
           ) -> dict[str, str]:
    """quantizer name -> where its ``ActivationQParams`` live: in the quantizer's place
    (state dict ``<quantizer>.scale`` / ``.zero_point``, the fake-quant graph's keys) when
    no node other than the lowered calls reads the quantizer any more, else beside it."""
    calls = {n for n, _ in lowered}
    by_name: dict[str, tuple] = {}
    for node, qp in lowered:
        by_name.setdefault(str(node.target), qp)
    still_read = {str(n.target) for n in gm.graph.nodes
                  if n.op in ("call_module", "get_attr") and n not in calls}
    placed = {}
    for name, (_, zp, levels) in by_name.items():
        fq = gm.get_submodule(name)
        module = ActivationQParams(fq.scale, zp, levels=levels)
        if any(t == name or t.startswith(name + ".") for t in still_read):
            # e.g. pipeline.transfer: int8 sends the quantizer's scale across a cut
            placed[name] = conv.add_module(gm, name, module)
        else:
            gm.delete_submodule(name)
            gm.add_submodule(name, module)
            placed[name] = name
    return placed


@graph_pass(requires=("integer_weights",), provides=("quantized_activations",))
def lower_activations(gm: GraphModule, ctx: Context) -> GraphModule:
    conv = state(ctx)
    g = gm.graph
    simulated = 0
    lowered: list[tuple[Node, tuple[float, int, int]]] = []
    for node in list(g.nodes):
        fq = module_at(gm, node)
        if not isinstance(fq, FakeQuantize) or node in conv.weights or node in conv.blocks:
            continue
        if not fq.enabled and not fq.dynamic:  # switched off: the value passes as is
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
            continue
        qp = act_qparams(fq)
        tm = node.meta.get(TENSOR_META)
        if qp is None or (tm is not None and getattr(tm, "dtype", None) != torch.float32):
            if not fq.dynamic:
                fq.observe = False
                simulated += 1
                what = (f"{fq.dtype} blocks of {fq.group_size}: its block scales come "
                        "from each input and no integer kernel takes it"
                        if fq.block_format is not None else
                        f"{fq.dtype} {fq.granularity}: no integer tensor type for it")
                conv.record(node, "fake_quant", "FakeQuantize", f"{what}; stays simulated",
                            layer=str(node.target))
            continue
        lowered.append((node, qp))
    placed = _place(gm, conv, lowered)
    for node, qp in lowered:
        # The qparams are buffers the code reads (get_attr), not constants in it: the
        # state dict carries them and load_state_dict changes what the graph computes.
        owner = placed[str(node.target)]
        with g.inserting_after(node):
            scale = g.get_attr(f"{owner}.scale")
        with g.inserting_after(scale):
            zero_point = g.get_attr(f"{owner}.zero_point")
        with g.inserting_after(zero_point):
            q = g.call_function(torch.quantize_per_tensor,
                                (node.args[0], scale, zero_point, torch.quint8))
        held = q
        bounds = level_bounds(qp)
        if bounds is not None:
            # A 7-bit grid: quint8 (and the kernels writing it later, which replace `q`)
            # clamps at 255, the fake-quant graph at 127. Clamping the quantized tensor
            # keeps the two equal beyond the calibrated range, and keeps every kernel's
            # input within the range its int16 pair sums are exact for. The bounds come
            # from the tensor's own qparams, whatever state dict was loaded.
            with g.inserting_after(q):
                held = g.call_function(clamp_levels, (q, qp[2]))
        with g.inserting_after(held):
            dq = g.call_method("dequantize", (held,))
        q.meta[QPARAMS_KEY] = qp
        dq.meta[DQ_KEY] = True
        dq.meta[TENSOR_META] = node.meta.get(TENSOR_META)
        conv.qparams_after[held] = conv.qparams_after[dq] = owner
        node.replace_all_uses_with(dq)
        g.erase_node(node)
        conv.record(q, "quantize", "quantize_per_tensor",
                    f"scale={qp[0]:.6g} zero_point={qp[1]} (quint8"
                    f"{'' if bounds is None else f', levels 0..{qp[2]}'})",
                    layer=str(node.target))
    ctx.note(f"{len(lowered)} activation quantizer(s) -> quantize_per_tensor / dequantize")
    if simulated:
        ctx.note(f"{simulated} activation quantizer(s) stay simulated (FakeQuantize)")
    return gm
