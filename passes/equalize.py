"""``equalize``: cross-layer equalization (``quant.algorithms: [{kind:
cross_layer_equalization}]``; Nagel et al. 2019, "Data-Free Quantization", as AIMET does it).

For two consecutive weighted layers ``L1 -> [ReLU] -> L2`` (Linear -> Linear, or convs of
one dimensionality) whose intermediate value has no other user, output channel ``i`` of
``L1`` (weight row and bias) is divided by ``s_i = sqrt(r1_i * r2_i) / r2_i`` and input
channel ``i`` of ``L2`` multiplied by it, where ``r1_i`` / ``r2_i`` are the largest
magnitudes of those weight channels: afterwards both channels have the range
``sqrt(r1_i * r2_i)``, which per-tensor weight quantization serves far better than
channels of very different ranges. Chains (a layer in two pairs) are swept until the
scales settle. ReLU is positively homogeneous (``relu(x / s) =
relu(x) / s`` for ``s > 0``), so the float function is unchanged. ReLU6, GELU and other
activations are not: such pairs are skipped with a note. A depthwise conv (``groups ==
channels``) equalizes as either member of a pair, so a conv -> depthwise -> conv chain is
equalized pair by pair; other grouped convs are skipped.

The pass rewrites the parameters of the traced copy (new ``nn.Parameter`` objects: the
user's model is untouched), under both front ends: ``call_module`` Linear/Conv layers
(symbolic graphs) and functional linear/conv ops reading their weights from graph
attributes (export graphs). It records one note per pair with the range of scales chosen.
The helpers here (``weighted_layer``, ``algorithm_entry``,
``skip_on_meta``) serve the other algorithm passes too.

Example:
    >>> import torch, qcompile as qc
    >>> torch.manual_seed(0) and None
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "static",
    ...     "algorithms": [{"kind": "cross_layer_equalization"}],
    ...     "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}]}})
    >>> gm = qc.qcompile(m, spec)
    >>> [n for n in qc.report(gm).passes[2].notes]  # doctest: +ELLIPSIS
    ['equalized 0 -> 2 (8 channels): scales 0.8... .. 1.6...']
    >>> for q in qc.quantizers(gm).values():
    ...     q.enabled = False
    >>> x = torch.randn(3, 4)
    >>> torch.allclose(gm(x), m(x), atol=1e-6)
    True
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.errors import QCompileError
from qcompile.graph.algorithms import set_parameter
from qcompile.graph.context import Context
from qcompile.graph.matching import module_op, op_name, weight_use
from qcompile.graph.meta import ALGORITHMS_SKIPPED_KEY
from qcompile.graph.pipeline import graph_pass
from qcompile.specs.quant import Algorithm

_OPS = ("linear", "conv1d", "conv2d", "conv3d")
_MAX_SWEEPS = 20  # chains of pairs: sweeps until no scale moves more than
_SETTLED = 1e-4  # this (|log s|)


@dataclass(frozen=True)
class Layer:
    """A linear/conv computation and the parameters it reads, under either front end."""

    node: Node
    name: str  # the layer's qualified name (module target, or the weight's owner)
    op: str  # linear | conv1d | conv2d | conv3d
    weight: str  # target of the weight parameter
    bias: str | None  # target of the bias parameter, None without one
    groups: int


def _param_target(value: object) -> str | bool | None:
    """The get_attr target of an op argument; None for no argument; False otherwise."""
    if value is None:
        return None
    if isinstance(value, Node) and value.op == "get_attr":
        return str(value.target)
    return False


def weighted_layer(gm: GraphModule, node: Node) -> Layer | None:
    """The ``Layer`` a node computes (a stock Linear/Conv module call, or a functional
    linear/conv reading weight and bias straight from graph attributes), else None."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        op = module_op(m)
        if op not in _OPS:
            return None
        t = str(node.target)
        return Layer(node, t, op, f"{t}.weight", f"{t}.bias" if m.bias is not None else None,
                     int(getattr(m, "groups", 1)))
    op = op_name(node)
    if op not in _OPS:
        return None
    use = weight_use(node)
    if use is None or use.consumer is not node:  # a transposed weight: not ours
        return None
    bias = _param_target(node.args[2] if len(node.args) > 2 else node.kwargs.get("bias"))
    if bias is False:
        return None
    groups = 1
    if op != "linear":
        g = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
        if not isinstance(g, int):
            return None
        groups = g
    weight = str(use.param.target)
    return Layer(node, weight.rpartition(".")[0] or node.name, op, weight, bias, groups)


def algorithm_entry(ctx: Context, kind: str) -> tuple[int, Algorithm]:
    """(index, entry) of the ``quant.algorithms`` entry this run of an algorithm pass
    serves: the pipeline runs one pass per entry, in order."""
    i = ctx.algorithms_run
    entries = ctx.spec.quant.algorithms
    if i >= len(entries) or entries[i].kind != kind:
        raise QCompileError(
            f"the {kind} pass runs for quant.algorithms[{i}], which is "
            + (f"{entries[i].kind}" if i < len(entries) else "not in the spec"),
            fix=f"list {{kind: {kind}}} in quant.algorithms and run the passes "
            "default_passes(spec) gives, in that order")
    ctx.algorithms_run += 1
    return i, entries[i]


def shared_names(gm: GraphModule) -> tuple[Counter, Counter]:
    """(how many names each parameter has, by id; how often each module / attribute is
    called or read): a parameter counted twice belongs to two layers and is left alone."""
    names = Counter(id(p) for _, p in gm.named_parameters(remove_duplicate=False))
    calls = Counter(str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "get_attr"))
    return names, calls


def skip_on_meta(gm: GraphModule, ctx: Context, targets: list[str], where: str) -> bool:
    """Whether the weights are on the meta device (no values to rewrite): then the pass is
    skipped with a note and ``gm.meta[ALGORITHMS_SKIPPED_KEY]`` names the entry. That is
    right where the real graph's tensors are copied in afterwards (``compile_once``'s
    ranks other than 0); ``compile_once`` refuses it where the model's own weights are
    loaded instead (sharded, or from a checkpoint)."""
    if not any(gm.get_parameter(t).device.type == "meta" for t in targets):
        return False
    gm.meta.setdefault(ALGORITHMS_SKIPPED_KEY, []).append(where)
    ctx.note(f"{where}: skipped, the weights are on the meta device (no values to rewrite)")
    return True


def exclusive(layer: Layer, gm: GraphModule, names: Counter, calls: Counter) -> bool:
    """Whether ``layer``'s parameters belong to it alone (not shared, not called twice)."""
    targets = [layer.weight] + ([layer.bias] if layer.bias else [])
    if layer.node.op == "call_module" and calls[str(layer.node.target)] > 1:
        return False
    return all(names[id(gm.get_parameter(t))] == 1 and
               (layer.node.op == "call_module" or calls[t] == 1) for t in targets)


def _is_relu(gm: GraphModule, node: Node) -> bool | None:
    """True for ReLU, None for ReLU6 (not positively homogeneous), else False."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        return True if type(m) is nn.ReLU else None if type(m) is nn.ReLU6 else False
    if node.op in ("call_function", "call_method"):
        op = op_name(node)
        if op in ("relu", "relu_"):
            return True
        if op in ("relu6", "hardtanh", "hardtanh_"):
            return None
    return False


def _depthwise(layer: Layer, w: torch.Tensor) -> bool:
    return layer.op != "linear" and layer.groups > 1 and w.shape[1] == 1 and (
        w.shape[0] == layer.groups)


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _pairs(gm: GraphModule, ctx: Context) -> list[tuple[Layer, Layer]]:
    names, calls = shared_names(gm)
    pairs = []
    for node in gm.graph.nodes:
        first = weighted_layer(gm, node)
        if first is None:
            continue
        nxt, via = _only_user(node), None
        if nxt is not None:
            relu = _is_relu(gm, nxt)
            if relu is None:
                ctx.note(f"not equalized after {first.name}: {nxt.name} is not positively "
                         "homogeneous (only ReLU is)")
                continue
            if relu:
                via, nxt = nxt, _only_user(nxt)
        second = weighted_layer(gm, nxt) if nxt is not None else None
        if second is None or not second.node.args or second.node.args[0] is not (
                via or node):
            continue
        if second.op != first.op:
            ctx.note(f"not equalized: {first.name} ({first.op}) -> {second.name} "
                     f"({second.op}) lay out channels differently")
            continue
        w1, w2 = gm.get_parameter(first.weight), gm.get_parameter(second.weight)
        if any(lay.groups > 1 and not _depthwise(lay, w) for lay, w in
               ((first, w1), (second, w2))):
            ctx.note(f"not equalized: {first.name} -> {second.name} has a grouped conv "
                     "(only depthwise ones are equalized)")
            continue
        if not (exclusive(first, gm, names, calls) and exclusive(second, gm, names, calls)):
            ctx.note(f"not equalized: {first.name} -> {second.name} shares parameters or "
                     "calls with another layer")
            continue
        pairs.append((first, second))
    return pairs


def _channel_ranges(w: torch.Tensor, dim: int) -> torch.Tensor:
    return w.detach().abs().transpose(0, dim).reshape(w.shape[dim], -1).amax(dim=1)


def equalize_pair(gm: GraphModule, first: Layer, second: Layer) -> torch.Tensor:
    """Equalize one pair in place (new parameters); returns the scales ``s``."""
    w1, w2 = gm.get_parameter(first.weight), gm.get_parameter(second.weight)
    with torch.no_grad():
        r1 = _channel_ranges(w1, 0).double()
        in_dim = 0 if _depthwise(second, w2) else 1
        r2 = _channel_ranges(w2, in_dim).double()
        s = torch.where((r1 > 0) & (r2 > 0), (r1 * r2).sqrt() / r2.clamp_min(1e-300),
                        torch.ones_like(r1))
        shape1 = (-1,) + (1,) * (w1.dim() - 1)
        set_parameter(gm, first.weight, w1.double() / s.view(shape1))
        if first.bias is not None:
            set_parameter(gm, first.bias, gm.get_parameter(first.bias).double() / s)
        shape2 = [1] * w2.dim()
        shape2[in_dim] = -1
        set_parameter(gm, second.weight, w2.double() * s.view(shape2))
    return s


@graph_pass(requires=("fusion_groups",), provides=("equalized",))
def equalize(gm: GraphModule, ctx: Context) -> GraphModule:
    """Cross-layer equalization of every conv/linear pair joined through ReLU or nothing."""
    i, _ = algorithm_entry(ctx, "cross_layer_equalization")
    where = f"quant.algorithms[{i}] (cross_layer_equalization)"
    pairs = _pairs(gm, ctx)
    if not pairs:
        ctx.note(f"{where}: no conv/linear pair to equalize (layer -> [ReLU] -> layer, "
                 "same kind, the value used by the second layer only); graph unchanged")
        return gm
    if skip_on_meta(gm, ctx, [t for p in pairs for lay in p for t in (lay.weight, lay.bias)
                              if t], where):
        return gm
    # A layer in two pairs (a chain) moves its neighbours' ranges: sweep until the scales
    # settle (the paper's iteration); every sweep preserves the function.
    total = [torch.ones(1, dtype=torch.float64) for _ in pairs]
    sweeps = 0
    while sweeps < _MAX_SWEEPS:
        sweeps += 1
        moved = 0.0
        for k, (first, second) in enumerate(pairs):
            s = equalize_pair(gm, first, second)
            total[k] = total[k] * s
            moved = max(moved, float(s.log().abs().max()))
        if moved < _SETTLED:
            break
    for (first, second), s in zip(pairs, total):
        ctx.note(f"equalized {first.name} -> {second.name} ({s.numel()} channels): "
                 f"scales {s.min().item():.3g} .. {s.max().item():.3g}")
    if len(pairs) > 1:
        ctx.note(f"{len(pairs)} pairs in {sweeps} sweeps")
    return gm
