"""``correct_bias``: empirical bias correction (``quant.algorithms: [{kind:
bias_correction}]``; Nagel et al. 2019, as AIMET's and NNCF's empirical variants do it).

Quantizing a layer's weights shifts the mean of its output: ``E[W_q x] != E[W x]``, and
the shift adds up layer after layer. For every conv/linear layer with an integer weight
quantizer, bias correction measures, per output channel, the float model's mean output
(every quantizer off, the weights as they were before any data-driven algorithm) and the
quantized model's (weights fake-quantized, with the layers before it already corrected),
both on the calibration batches, and adds the difference to the layer's bias; a layer
without a bias gets one (a new parameter ``<layer>.bias`` read by the layer's node).
Layers go level by level, so each correction also absorbs the shift left by the layers
before it.

It runs in ``qc.calibrate`` before the observers (a static graph's activations are not
quantized yet), so it corrects the weights' error; run after ``gptq`` or ``adaround`` it
corrects what is left of theirs. The compile-time pass checks there are layers and records
the entry; the record ``correct_bias.calibrate`` notes each layer's largest correction.

Example:
    >>> import torch, qcompile as qc
    >>> torch.manual_seed(0) and None
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "static",
    ...     "algorithms": [{"kind": "bias_correction"}],
    ...     "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "int4"}}]}})
    >>> gm = qc.qcompile(torch.nn.Linear(16, 8), spec, example_inputs=(torch.randn(2, 16),))
    >>> gm = qc.calibrate(gm, [torch.randn(64, 16) + 3 for _ in range(4)])
    >>> qc.report(gm).passes[-1].notes[0]  # doctest: +ELLIPSIS
    'linear: mean output shift ... corrected (8 channels, largest correction ...)'
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.graph.algorithms import Data, no_data, plan, set_parameter, usable, where
from qcompile.graph.context import Context
from qcompile.graph.layerwise import QuantLayer
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.equalize import algorithm_entry
from qcompile.specs.quant import BiasCorrection


@graph_pass(requires=("quantizers",), provides=("bias_correction",))
def correct_bias(gm: GraphModule, ctx: Context) -> GraphModule:
    """Check there are layers to correct and record the entry for ``qc.calibrate``."""
    index, _ = algorithm_entry(ctx, "bias_correction")
    return plan(gm, ctx, index, "bias_correction", gram=False, verb="correct")


def _add_bias(gm: GraphModule, layer: QuantLayer, channels: int, like: torch.Tensor) -> str:
    """Give ``layer`` a zero bias: a new parameter beside its weight, read by a new
    ``get_attr`` node passed as the op's bias. Returns its target in the owner graph."""
    owner = layer.module(gm)
    parent, _, _ = layer.weight.rpartition(".")
    holder = owner.get_submodule(parent) if parent else owner
    leaf = "bias"
    # a free name: Linear(bias=False) registers ``bias`` as None; anything else is taken
    while holder._parameters.get(leaf, 0) is not None and hasattr(holder, leaf):
        leaf = f"_{leaf}"
    holder.register_parameter(leaf, nn.Parameter(torch.zeros(channels, dtype=like.dtype,
                                                             device=like.device)))
    target = f"{parent}.{leaf}" if parent else leaf
    node = next(n for n in owner.graph.nodes if n.name == layer.node)
    with owner.graph.inserting_before(node):
        getter: Node = owner.graph.get_attr(target)
    if len(node.args) > 2:
        node.args = (*node.args[:2], getter, *node.args[3:])
    elif "bias" in node.kwargs:
        node.kwargs = {**node.kwargs, "bias": getter}
    else:
        node.args = (*node.args, getter)
    owner.recompile()
    return target


def apply(data: Data, index: int, entry: BiasCorrection) -> list[str]:
    """Correct every usable layer's bias, level by level (``qc.calibrate``)."""
    gm, here = data.gm, where(index, "bias_correction")
    layers, skipped = usable(gm, gram=False)
    reference = data.sweep(mean=layers, float_model=True)
    notes = []
    for group, stats in data.by_level(layers, mean=True, desc="bias_correction"):
        for layer in group:
            if not stats.out_count.get(layer) or not reference.out_count.get(layer):
                raise no_data(here, layer)
            want = reference.out_sum[layer] / reference.out_count[layer]
            got = stats.out_sum[layer] / stats.out_count[layer]
            shift = want - got
            weight = layer.get_weight(gm)
            target = layer.bias
            if target is None:
                target = _add_bias(gm, layer, shift.numel(), weight)
            bias = layer.module(gm).get_parameter(target)
            name = f"{layer.owner}.{target}" if layer.owner else target
            set_parameter(gm, name, bias.detach().double() + shift.to(bias.device))
            notes.append(f"{layer.name}: mean output shift {float(shift.abs().mean()):.3g} "
                         f"corrected ({shift.numel()} channels, largest correction "
                         f"{float(shift.abs().max()):.3g})"
                         + ("; bias added" if layer.bias is None else ""))
    notes += [f"{name} left uncorrected: {reason}" for name, reason in skipped]
    return notes
