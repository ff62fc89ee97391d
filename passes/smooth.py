"""``smooth``: SmoothQuant (``quant.algorithms: [{kind: smoothquant, alpha: 0.5}]``; Xiao et
al. 2023): migrate activation outliers into the weights of the Linear layers reading them.

For every value ``x`` read by Linear layers only (the q/k/v projections of one norm
form one group), with ``a_j = max|x_j|`` over the example inputs (per input channel ``j``)
and ``w_j`` the largest ``|W[:, j]|`` over the group's weights, the scale is
``s_j = a_j^alpha / w_j^(1 - alpha)`` (clamped to at least 1e-5): the producer of ``x``
absorbs ``1 / s_j`` (a LayerNorm's weight and bias, an RMSNorm's weight, the 1-D weight
a hand-written RMSNorm multiplies by last, or a Linear's output row and bias)
and each Linear's weight column ``j`` is multiplied by ``s_j``. Exact in float; the
activation's outlier channels shrink, the weights' grow to match (``alpha`` chooses how
far). A value whose producer cannot absorb the scale (a GELU, an input, a LayerNorm
without affine parameters) or that something other than Linear layers reads is skipped
with a note.

Statistics come from one run of the traced float graph (eval mode, no grad, state
restored) on the compile's ``example_inputs`` / ``example_kwargs``: without them the pass
refuses (``spec.trace.inputs`` holds shapes, not data). Both front ends: ``call_module``
Linear / LayerNorm (symbolic graphs) and functional ``linear`` / ``layer_norm`` reading
their parameters from graph attributes (export graphs).

Example:
    >>> import torch, qcompile as qc
    >>> torch.manual_seed(0) and None
    >>> m = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "static",
    ...     "algorithms": [{"kind": "smoothquant", "alpha": 0.5}],
    ...     "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}]}})
    >>> x = torch.randn(5, 8)
    >>> gm = qc.qcompile(m, spec, example_inputs=(x,))
    >>> qc.report(gm).passes[2].notes  # doctest: +ELLIPSIS
    ['smoothed 0 -> 1 (8 channels, alpha 0.5): scales ... .. ...']
    >>> for q in qc.quantizers(gm).values():
    ...     q.enabled = False
    >>> torch.allclose(gm(x), m(x), atol=1e-5)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

from qcompile.errors import QCompileError
from qcompile.graph.algorithms import set_parameter
from qcompile.graph.context import Context
from qcompile.graph.matching import op_name
from qcompile.graph.pipeline import graph_pass
from qcompile.graph.running import fresh, untouched
from qcompile.passes.equalize import (
    Layer,
    algorithm_entry,
    exclusive,
    shared_names,
    skip_on_meta,
    weighted_layer,
)
from qcompile.passes.trace import example_args


class _Stats(Interpreter):
    """Runs the graph, keeping the per-channel (last dim) max |value| of chosen nodes."""

    def __init__(self, gm: GraphModule, watch: set[Node]) -> None:
        super().__init__(gm)
        self.watch = watch
        self.amax: dict[Node, torch.Tensor] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n in self.watch and isinstance(out, torch.Tensor) and out.dim() >= 1:
            a = out.detach().abs().reshape(-1, out.shape[-1]).amax(dim=0).double()
            self.amax[n] = torch.maximum(self.amax[n], a) if n in self.amax else a
        return out


def _statistics(gm: GraphModule, ctx: Context, watch: set[Node], where: str
                ) -> dict[Node, torch.Tensor]:
    if ctx.example_inputs is None and not ctx.example_kwargs:
        raise QCompileError(f"{where}: smoothing scales come from activation statistics, and "
                            "no example inputs were given",
                            fix="pass example_inputs (representative data) to qcompile")
    args = example_args(gm, ctx)
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta"
           for t in torch.utils._pytree.tree_leaves(args)):
        raise QCompileError(f"{where}: the example inputs are meta tensors (no values)",
                            fix="pass real example inputs")
    stats = _Stats(gm, watch)
    with untouched(gm):
        stats.run(*fresh(args), enable_io_processing=False)
    return stats.amax


def _param_node(value: Any) -> str | None:
    return str(value.target) if isinstance(value, Node) and value.op == "get_attr" else None


def _layer_norm(gm: GraphModule, node: Node) -> tuple[str, str | None, int] | None:
    """(weight target, bias target, channels) of a producer that ends in a per-channel
    affine over the last dim, else None: a LayerNorm or RMSNorm with affine parameters
    (module or functional), or a product with a 1-D parameter (a hand-written RMSNorm's
    ``x * rsqrt(...) * self.weight``, as Llama-style models write it)."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if type(m) not in (nn.LayerNorm, nn.RMSNorm) or m.weight is None or len(
                m.normalized_shape) != 1:
            return None
        t = str(node.target)
        bias = getattr(m, "bias", None)
        return f"{t}.weight", (f"{t}.bias" if bias is not None else None), m.weight.numel()
    if node.op != "call_function":
        return None
    op = op_name(node)
    if op == "mul" and len(node.args) == 2 and not node.kwargs:
        for this, other in (node.args, node.args[::-1]):
            target = _param_node(this)
            if target is None or not isinstance(other, Node):
                continue
            try:
                w = gm.get_parameter(target)
            except AttributeError:
                return None
            return (target, None, w.numel()) if w.dim() == 1 else None
        return None
    if op not in ("layer_norm", "rms_norm"):
        return None
    shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
    w = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    b = None
    if op == "layer_norm":
        b = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    if not (isinstance(shape, (list, tuple)) and len(shape) == 1):
        return None
    if _param_node(w) is None:
        return None
    if b is not None and _param_node(b) is None:
        return None
    return str(w.target), (str(b.target) if b is not None else None), int(shape[0])


def _groups(gm: GraphModule, ctx: Context) -> dict[Node, list[Layer]]:
    """Each value read by Linear layers (as their input) -> those layers, in graph order."""
    groups: dict[Node, list[Layer]] = {}
    for node in gm.graph.nodes:
        layer = weighted_layer(gm, node)
        if layer is not None and layer.op == "linear" and node.args and isinstance(
                node.args[0], Node):
            groups.setdefault(node.args[0], []).append(layer)
    return groups


def _producer_params(gm: GraphModule, x: Node, linears: list[Layer], names: Any,
                     calls: Any) -> tuple[list[str], str] | str:
    """(parameters absorbing 1/s as [weight, bias?], producer name), or why not."""
    if len(x.users) != len(linears):
        others = sorted(u.name for u in x.users if u not in {lay.node for lay in linears})
        return f"{x.name} is also read by {', '.join(others)}"
    ln = _layer_norm(gm, x)
    if ln is not None and ln[2] != gm.get_parameter(linears[0].weight).shape[1]:
        return f"{_describe(gm, x)} scales {ln[2]} channel(s), not the layers' inputs"
    if ln is not None:
        weight, bias, _ = ln
        if x.op == "call_module" and calls[str(x.target)] > 1:
            return f"{x.name} is called twice"
        targets = [weight] + ([bias] if bias else [])
        if any(names[id(gm.get_parameter(t))] > 1 or (x.op != "call_module" and calls[t] > 1)
               for t in targets):
            return f"{x.name} shares its parameters"
        return targets, (str(x.target) if x.op == "call_module" else weight.rpartition(".")[0])
    producer = weighted_layer(gm, x)
    if producer is not None and producer.op == "linear":
        if not exclusive(producer, gm, names, calls):
            return f"{producer.name} shares its parameters or is called twice"
        return [producer.weight] + ([producer.bias] if producer.bias else []), producer.name
    return (f"{_describe(gm, x)} is not a LayerNorm / RMSNorm with affine parameters, a "
            "product with a per-channel parameter or a Linear, so it cannot absorb the scales")


def _describe(gm: GraphModule, x: Node) -> str:
    if x.op == "call_module":
        return f"{x.target} ({type(gm.get_submodule(str(x.target))).__name__})"
    if x.op == "placeholder":
        return f"model input {x.target!r}"
    return f"{x.name} ({op_name(x) or x.op})"


@graph_pass(requires=("fusion_groups",), provides=("smoothed",))
def smooth(gm: GraphModule, ctx: Context) -> GraphModule:
    """SmoothQuant every group of Linear layers whose input's producer absorbs scales."""
    i, entry = algorithm_entry(ctx, "smoothquant")
    alpha = entry.alpha
    where = f"quant.algorithms[{i}] (smoothquant)"
    names, calls = shared_names(gm)
    plans = []
    for x, linears in _groups(gm, ctx).items():
        who = ", ".join(lay.name for lay in linears)
        if any(not exclusive(lay, gm, names, calls) for lay in linears):
            ctx.note(f"not smoothed {who}: a weight is shared or a layer called twice")
            continue
        found = _producer_params(gm, x, linears, names, calls)
        if isinstance(found, str):
            ctx.note(f"not smoothed {who}: {found}")
            continue
        plans.append((x, linears, *found))
    if not plans:
        ctx.note(f"{where}: no Linear layer whose input a LayerNorm or Linear produces "
                 "(and nothing else reads); graph unchanged")
        return gm
    if skip_on_meta(gm, ctx, [t for _, linears, targets, _ in plans
                              for t in targets + [lay.weight for lay in linears]], where):
        return gm
    amax = _statistics(gm, ctx, {x for x, *_ in plans}, where)
    for x, linears, targets, producer in plans:
        a = amax.get(x)
        channels = gm.get_parameter(linears[0].weight).shape[1]
        if a is None or a.numel() != channels:
            ctx.note(f"not smoothed {', '.join(lay.name for lay in linears)}: the input "
                     f"statistics of {x.name} do not have {channels} channels")
            continue
        with torch.no_grad():
            w = torch.stack([gm.get_parameter(lay.weight).detach().abs().amax(dim=0).double()
                             for lay in linears]).amax(dim=0)
            s = (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)
            s = torch.where((a > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))
            pw = gm.get_parameter(targets[0])
            if pw.dim() == 2:  # a Linear producer: output rows
                set_parameter(gm, targets[0], pw.double() / s[:, None])
            else:  # a LayerNorm's weight
                set_parameter(gm, targets[0], pw.double() / s)
            if len(targets) > 1:
                set_parameter(gm, targets[1], gm.get_parameter(targets[1]).double() / s)
            for lay in linears:
                set_parameter(gm, lay.weight, gm.get_parameter(lay.weight).double() * s[None, :])
        ctx.note(f"smoothed {producer} -> {', '.join(lay.name for lay in linears)} "
                 f"({s.numel()} channels, alpha {alpha:g}): scales "
                 f"{s.min().item():.3g} .. {s.max().item():.3g}")
    return gm
