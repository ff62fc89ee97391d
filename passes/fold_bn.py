"""``fold_bn``: find fusion groups (conv-bn-relu, conv-relu, linear-relu, ...) and, for
static and dynamic quantization, fold BatchNorm into the preceding conv / linear.

Transposed convolutions (``ConvTranspose1d/2d/3d``) form the same groups. Their weight is
stored ``[in, out / groups, k...]``, so the BatchNorm factor of output channel
``g * (out / groups) + j`` scales ``weight[g * (in / groups):(g + 1) * (in / groups), j]``
(along the weight's axis 1, group by group).

Fusion groups are recorded as ``node.meta[FUSION_KEY]`` (member names, head
first) on every member; ``insert_quant`` then quantizes only the group's output, as the
fused integer kernel would produce it.

Folding uses BatchNorm's running statistics (``torch.nn.utils.fusion``), i.e. inference
semantics, so it runs only for ``static`` / ``dynamic`` modes with ``quant.fold_bn``.
For ``qat`` BatchNorm stays in the graph and keeps training: the conv weight is
fake-quantized and the activation quantizer sits after the conv-bn(-relu) group. (Folding
happens when the model is converted for inference.) That trades torch.ao's simulated
folding for an exact BatchNorm during training; the choice is noted in the Report.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2)).eval()
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "static", "rules": [
    ...     {"match": {"module": "Conv2d"}, "weight": {"dtype": "int8"}}]}})
    >>> gm = qc.qcompile(m, spec)
    >>> any(isinstance(m, torch.nn.BatchNorm2d) for m in gm.modules())
    False
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from qcompile.graph.context import Context
from qcompile.graph.matching import is_weighted_call, module_op, op_name, weight_use
from qcompile.graph.meta import FOLDS_KEY, FUSION_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# the ops a fusion group starts with (conv-bn-relu, linear-relu, ...)
_TRANSPOSED = ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
_HEADS = ("linear", "conv1d", "conv2d", "conv3d", *_TRANSPOSED)
_RELU_MODULES = (nn.ReLU, nn.ReLU6)


class _Modules:
    """The module each ``call_module`` node calls, resolved once per target rather than
    once per question asked about the node (``get_submodule`` walks the dotted path)."""

    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self.by_target: dict[str, nn.Module] = {}

    def __call__(self, node: Node) -> nn.Module | None:
        if node.op != "call_module":
            return None
        t = str(node.target)
        m = self.by_target.get(t)
        if m is None:
            m = self.by_target[t] = self.gm.get_submodule(t)
        return m


def _is_bn(mods: _Modules, node: Node) -> bool:
    return isinstance(mods(node), _BN)


def _is_relu(mods: _Modules, node: Node) -> bool:
    if node.op == "call_module":
        return isinstance(mods(node), _RELU_MODULES)
    # F.relu, torch.relu, x.relu(), aten.relu.default, F.relu6 alike
    return node.op in ("call_function", "call_method") and op_name(node) in ("relu", "relu6")


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _head_op(mods: _Modules, node: Node) -> str | None:
    m = mods(node)
    op = module_op(m) if m is not None else None
    if op is None and is_weighted_call(node):
        op = op_name(node)
    return op if op in _HEADS else None


def _fusion_groups(mods: _Modules) -> list[list[Node]]:
    groups = []
    for node in mods.gm.graph.nodes:
        op = _head_op(mods, node)
        if op is None:
            continue
        chain = [node]
        nxt = _only_user(node)
        if nxt is not None and _is_bn(mods, nxt):
            chain.append(nxt)
            nxt = _only_user(nxt)
        if nxt is not None and _is_relu(mods, nxt):
            chain.append(nxt)
        if len(chain) > 1:
            groups.append(chain)
    return groups


def fuse_conv_transpose_bn_weights(weight: torch.Tensor, bias: torch.Tensor | None,
                                   mean: torch.Tensor, var: torch.Tensor, eps: float,
                                   gamma: torch.Tensor | None, beta: torch.Tensor | None,
                                   groups: int = 1, first_row: int = 0,
                                   in_channels: int | None = None
                                   ) -> tuple[nn.Parameter, nn.Parameter]:
    """BatchNorm (running statistics) folded into a transposed convolution whose weight is
    ``[in, out / groups, k...]``: (folded weight, folded bias). ``weight`` may be rows
    ``first_row..`` of an ``in_channels``-row weight (a rank's shard); the bias and the
    statistics are whole (``[out]``). ``torch.nn.utils.fusion`` folds ``groups == 1``
    only.

    Example:
        >>> import torch
        >>> ct = torch.nn.ConvTranspose2d(4, 6, 3, groups=2).eval()
        >>> bn = torch.nn.BatchNorm2d(6).eval()
        >>> _ = bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
        >>> w, b = fuse_conv_transpose_bn_weights(ct.weight, ct.bias, bn.running_mean,
        ...     bn.running_var, bn.eps, bn.weight, bn.bias, groups=2)
        >>> x = torch.randn(1, 4, 5, 5)
        >>> y = torch.nn.functional.conv_transpose2d(x, w, b, groups=2)
        >>> torch.allclose(y, bn(ct(x)), atol=1e-5)
        True
    """
    factor = torch.rsqrt(var + eps)
    if gamma is not None:
        factor = factor * gamma
    b = bias if bias is not None else torch.zeros_like(mean)
    new_bias = (b - mean) * factor + (beta if beta is not None else 0.0)
    in_channels = weight.shape[0] if in_channels is None else in_channels
    rows = torch.arange(first_row, first_row + weight.shape[0])
    # row r belongs to group r // (in / groups); its column j is output channel
    # group * (out / groups) + j
    scale = factor.reshape(groups, -1)[rows // (in_channels // groups)]
    fused = weight * scale.reshape(*scale.shape, *([1] * (weight.dim() - 2))).to(weight.dtype)
    return (nn.Parameter(fused.detach(), weight.requires_grad),
            nn.Parameter(new_bias.detach().to(weight.dtype), weight.requires_grad))


def _groups(head: Node, layer: nn.Module | None) -> int:
    """The ``groups`` of a conv call: the module's, else the functional call's argument
    (conv: index 6, transposed conv: index 6 too)."""
    if layer is not None:
        return int(getattr(layer, "groups", 1))
    g = head.args[6] if len(head.args) > 6 else head.kwargs.get("groups", 1)
    return int(g) if isinstance(g, int) else 1


def _functional_params(gm: GraphModule, head: Node) -> tuple[str, str | None] | None:
    """(weight target, bias target or None) of a functional conv/linear reading its
    parameters straight from graph attributes (export graphs), else None."""
    use = weight_use(head)
    if use is None or use.consumer is not head:
        return None
    bias = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
    if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr"):
        return None
    return str(use.param.target), (str(bias.target) if bias is not None else None)


def _fold(gm: GraphModule, head: Node, bn_node: Node, calls: Counter, uses: Counter,
          ctx: Context) -> bool:
    """Fold ``bn_node`` into ``head`` in the traced copy; False (with a note) when unsafe.
    ``uses``: how many names each parameter (by id) has in ``gm``."""
    bn = gm.get_submodule(str(bn_node.target))
    layer = None
    if head.op == "call_module":
        layer = gm.get_submodule(str(head.target))
        where, weight, is_linear = str(head.target), layer.weight, isinstance(layer, nn.Linear)
        bias = layer.bias
    else:
        targets = _functional_params(gm, head)
        if targets is None:
            ctx.note(f"kept {bn_node.target}: {head.name} does not read its weight and bias "
                     "straight from parameters")
            return False
        where = targets[0].rpartition(".")[0] or head.name
        weight = gm.get_parameter(targets[0])
        bias = gm.get_parameter(targets[1]) if targets[1] else None
        is_linear = op_name(head) == "linear"
    if calls[head.target] > 1 or calls[bn_node.target] > 1:
        ctx.note(f"kept {bn_node.target}: {where} or {bn_node.target} is called twice")
        return False
    if bn.running_mean is None or bn.running_var is None:
        ctx.note(f"kept {bn_node.target}: it has no running statistics to fold")
        return False
    if uses[id(weight)] > 1:
        ctx.note(f"kept {bn_node.target}: {where}.weight is shared with another layer")
        return False
    transposed = _head_op(_Modules(gm), head) in _TRANSPOSED
    groups = _groups(head, layer)
    if is_linear:
        tm = head.meta.get(TENSOR_META)
        if tm is None:
            ctx.note(f"kept {bn_node.target}: Linear+BatchNorm folds only for 2-D outputs, "
                     "and the shape is unknown (pass example_inputs)")
            return False
        if len(tm.shape) != 2:
            ctx.note(f"kept {bn_node.target}: Linear+BatchNorm folds only for 2-D outputs")
            return False
        w, b = fuse_linear_bn_weights(weight, bias, bn.running_mean,
                                      bn.running_var, bn.eps, bn.weight, bn.bias)
    elif transposed:
        w, b = fuse_conv_transpose_bn_weights(weight, bias, bn.running_mean, bn.running_var,
                                              bn.eps, bn.weight, bn.bias, groups=groups)
    else:
        w, b = fuse_conv_bn_weights(weight, bias, bn.running_mean,
                                    bn.running_var, bn.eps, bn.weight, bn.bias)
    if head.op == "call_module":
        layer.weight, layer.bias = w, b
        targets = (f"{where}.weight", f"{where}.bias" if bias is not None else None)
        bias_target = f"{where}.bias"
    else:
        _set_param(gm, targets[0], w)
        bias_target = targets[1] or f"{targets[0].rpartition('.')[0]}.bias".lstrip(".")
        _set_param(gm, bias_target, b)
        if targets[1] is None:  # the op had no bias: feed it the folded one
            with gm.graph.inserting_before(head):
                b_node = gm.graph.get_attr(bias_target)
            args = list(head.args) + [None] * max(0, 3 - len(head.args))
            args[2] = b_node
            head.args = tuple(args)
    bn_name = str(bn_node.target)
    gm.meta.setdefault(FOLDS_KEY, {})[targets[0]] = Fold(
        weight=targets[0], bias=targets[1], out_bias=bias_target, bn=bn_name, eps=bn.eps,
        linear=is_linear, groups=groups if transposed else 0,
        in_channels=weight.shape[0] if transposed else 0)
    bn_node.replace_all_uses_with(head)
    gm.graph.erase_node(bn_node)
    ctx.note(f"folded {bn_node.target} into {where}")
    return True


@dataclass(frozen=True)
class Fold:
    """One BatchNorm folded into the conv/linear before it: ``weight`` and ``bias`` (None
    when the layer had none) name the layer's own tensors, ``out_bias`` the folded bias,
    ``bn`` the BatchNorm module (``<bn>.weight``, ``.bias``, ``.running_mean``,
    ``.running_var``). ``apply`` recomputes the folded values from those tensors, for any
    range of rows (a rank's shard): what a sharded ``compile_once`` needs. A transposed
    convolution (``groups`` > 0) has its input channels as weight rows: its rows are
    folded with the whole statistics (``in_channels`` rows in all)."""

    weight: str
    bias: str | None
    out_bias: str
    bn: str
    eps: float
    linear: bool
    groups: int = 0  # a transposed convolution's groups; 0: not transposed
    in_channels: int = 0  # a transposed convolution's weight rows

    def sources(self) -> list[str]:
        names = [self.weight, *(f"{self.bn}.{k}" for k in ("weight", "bias", "running_mean",
                                                            "running_var"))]
        return names + ([self.bias] if self.bias is not None else [])

    def apply(self, read: Callable[[str, slice | None], torch.Tensor], rows: slice | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(folded weight rows, folded bias rows), ``read(name, rows)`` giving the sources."""
        if self.groups:  # weight rows are input channels, the bias rows output channels
            w = read(self.weight, rows)
            whole = {k: read(f"{self.bn}.{k}", None) for k in ("weight", "bias",
                                                                 "running_mean", "running_var")}
            b = read(self.bias, None) if self.bias is not None else None
            fw, fb = fuse_conv_transpose_bn_weights(
                w, b, whole["running_mean"], whole["running_var"], self.eps, whole["weight"],
                whole["bias"], groups=self.groups,
                first_row=0 if rows is None else rows.start or 0, in_channels=self.in_channels)
            return fw.detach(), (fb if rows is None else fb[rows]).detach()
        w = read(self.weight, rows)
        b = read(self.bias, rows) if self.bias is not None else None
        bn = {k: read(f"{self.bn}.{k}", rows) for k in ("weight", "bias", "running_mean",
                                                         "running_var")}
        fuse = fuse_linear_bn_weights if self.linear else fuse_conv_bn_weights
        fw, fb = fuse(w, b, bn["running_mean"], bn["running_var"], self.eps, bn["weight"],
                      bn["bias"])
        return fw.detach(), fb.detach()


def _set_param(gm: GraphModule, target: str, value: nn.Parameter) -> None:
    parent, _, leaf = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, leaf, value)


@graph_pass(requires=("graph",), provides=("fusion_groups",), needs_code=False)
def fold_bn(gm: GraphModule, ctx: Context) -> GraphModule:
    """Record fusion groups; fold BatchNorm for static/dynamic quantization."""
    quant = ctx.spec.quant
    folding = quant.fold_bn and quant.mode in ("static", "dynamic")
    calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
    mods = _Modules(gm)
    # names per parameter, counted once (folding only adds new, unshared parameters)
    uses = Counter(id(p) for _, p in gm.named_parameters(remove_duplicate=False)) if (
        folding) else Counter()
    folded = False
    for chain in _fusion_groups(mods):
        if folding and len(chain) > 1 and _is_bn(mods, chain[1]) and _fold(
                gm, chain[0], chain[1], calls, uses, ctx):
            chain.pop(1)
            folded = True
        if len(chain) > 1:
            names = tuple(n.name for n in chain)
            for n in chain:
                n.meta[FUSION_KEY] = names
    if folded:
        gm.delete_all_unused_submodules()
        mods = _Modules(gm)  # folding removed BatchNorms
    if quant.mode == "qat" and quant.fold_bn and any(_is_bn(mods, n) for n in gm.graph.nodes):
        ctx.note("qat: BatchNorm kept unfolded (trains exactly); conv weights are "
                 "fake-quantized and activations quantized after each conv-bn(-relu) group")
    return gm
