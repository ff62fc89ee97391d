"""What the conversion steps share: weights as integers (``IntTensor``) or as block-format
codes (``BlockCodes``), the state of one conversion (``Conversion``, held by
``ctx.conversion``), and small node helpers.

A ``Conversion`` is made by the first step (``collect_weights``) and read by the others,
so it lives as long as the ``Context`` of one graph's conversion: there is no module-level
state.

Example:
    >>> import torch
    >>> from qcompile.runtime.fake_quant import FakeQuantize
    >>> fq = FakeQuantize("int4", symmetric=True)
    >>> fq.scale.fill_(0.5)
    tensor([0.5000])
    >>> t = integers(fq, torch.tensor([[-1.0, 0.2, 0.8, 9.0]]))
    >>> t.q.tolist(), t.bits, qint8(t).int_repr().tolist()
    ([[-2, 0, 2, 7]], 4, [[-2, 0, 2, 7]])
"""

from __future__ import annotations

import contextlib
import math
import operator
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.matching import layer_of, op_name
from qcompile.graph.records import ConversionRecord
from qcompile.runtime.block_formats import BlockCodes
from qcompile.runtime.fake_quant import FakeQuantize

aten = torch.ops.aten
LINEAR = frozenset({F.linear, aten.linear.default})
CONV = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2,
        torch.conv3d: 3, aten.conv1d.default: 1, aten.conv2d.default: 2,
        aten.conv3d.default: 3}
QCONV = {1: (nnq.Conv1d, nniq.ConvReLU1d), 2: (nnq.Conv2d, nniq.ConvReLU2d),
         3: (nnq.Conv3d, nniq.ConvReLU3d)}
# transposed convolutions: weight [in, out / groups, k...], output channels along axis 1;
# call arguments (x, weight, bias, stride, padding, output_padding, groups, dilation)
CONV_TRANSPOSE = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3,
                  torch.conv_transpose1d: 1, torch.conv_transpose2d: 2,
                  torch.conv_transpose3d: 3, aten.conv_transpose1d.default: 1,
                  aten.conv_transpose2d.input: 2, aten.conv_transpose3d.input: 3}
QCONV_TRANSPOSE = {1: nnq.ConvTranspose1d, 2: nnq.ConvTranspose2d, 3: nnq.ConvTranspose3d}
ADD = frozenset({operator.add, torch.add, aten.add.Tensor})


@dataclass(frozen=True)
class IntTensor:
    """A weight as integers with its qparams (the fake-quant's exact grid)."""

    q: torch.Tensor  # the weight's shape, the smallest integer dtype holding the grid
    scale: torch.Tensor  # float32, 1-D
    zero_point: torch.Tensor  # int32, 1-D
    axis: int | None
    group_size: int | None
    quant_min: int
    quant_max: int

    @property
    def bits(self) -> int:
        return max(1, math.ceil(math.log2(self.quant_max - self.quant_min + 1)))


@contextlib.contextmanager
def torch_deprecations_silenced() -> Iterator[None]:
    """Inside: two torch deprecation warnings that converting cannot avoid are not shown
    (every other warning is). Scoped to our own calls (the conversion steps, the copy
    ``qc.convert`` makes, its check run of the result), never installed globally.

    Example:
        >>> import warnings, torch
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error")
        ...     with torch_deprecations_silenced():
        ...         q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
        >>> q.int_repr().tolist()
        [10, 10]
    """
    with warnings.catch_warnings():
        # torch (ATen Quantizer.cpp, pytorch/pytorch#184982): "torch.quantize_per_tensor,
        # torch.quantize_per_channel and other quantized tensor creation functions ... are
        # deprecated". Every quint8/qint8 tensor is made through it (torch's quantized
        # modules, their packed weights and outputs, torch._make_per_channel_quantized_tensor):
        # they are the integer kernels convert targets, so the notice is not the user's to act on.
        warnings.filterwarnings(
            "ignore", category=UserWarning,
            message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other "
                    r"quantized tensor creation functions")
        # torch.utils._pytree's deprecated LeafSpec: deep-copying an exported graph
        # (torch.fx Graph.__deepcopy__ -> copyreg's ``cls.__new__(cls, *args)``) re-creates
        # its pytree LeafSpec through the deprecated constructor, which warns
        # "`isinstance(treespec, LeafSpec)` is deprecated"; the copy is torch's own code.
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        yield


def grid_dtype(quant_min: int, quant_max: int) -> torch.dtype:
    """The smallest integer dtype holding ``quant_min..quant_max``: a weight's integers
    take a quarter of its float32 bytes at 8 bits (int32 would take as many)."""
    for dtype in (torch.int8, torch.uint8, torch.int16):
        info = torch.iinfo(dtype)
        if info.min <= quant_min and quant_max <= info.max:
            return dtype
    return torch.int32


def integers(fq: FakeQuantize, w: torch.Tensor) -> IntTensor:
    """``w`` on ``fq``'s grid: ``clamp(round(w / scale) + zp)``, as its forward computes.
    One float temporary of the weight's size (rounded and clamped in place), then the
    integers in ``grid_dtype``: converting a layer costs about its own size."""
    x = w.detach()
    x = x if x.dtype == torch.float32 else x.float()
    scale, zp = fq.scale.detach().float(), fq.zero_point.detach()
    if fq.group_size is not None:
        xs = x.reshape(x.shape[0], -1, fq.group_size)
        s, z = scale.view(x.shape[0], -1, 1), zp.view(x.shape[0], -1, 1)
    elif fq.axis is not None:
        view = [1] * x.dim()
        view[fq.axis] = -1
        xs, s, z = x, scale.view(view), zp.view(view)
    else:
        xs, s, z = x, scale, zp
    q = xs / s  # the only float temporary of the weight's size
    q.round_().add_(z).clamp_(fq.quant_min, fq.quant_max)
    q = q.to(grid_dtype(fq.quant_min, fq.quant_max))
    q = q.reshape(x.shape)
    return IntTensor(q, scale.clone(), zp.to(torch.int32),
                     fq.axis % x.dim() if fq.axis is not None else None, fq.group_size,
                     fq.quant_min, fq.quant_max)


def qint8(t: IntTensor, axis: int = 0) -> torch.Tensor | None:
    """The weight as a ``qint8`` tensor for torch's kernels, or None when it does not fit
    (more than 8 bits, asymmetric, per-group, channel axis other than ``axis``: 0, the
    output channels of a linear / conv weight)."""
    if (t.group_size is not None or (t.axis not in (None, axis))
            or t.quant_max - t.quant_min > 255):
        return None
    shift = 128 if t.quant_min >= 0 else 0  # uint8 grid -> int8 grid, same values
    q, zp = t.q.to(torch.int16) - shift, t.zero_point - shift
    if bool((zp != 0).any()) or int(q.min()) < -128 or int(q.max()) > 127:
        return None
    if t.axis is None:
        return torch._make_per_tensor_quantized_tensor(q.to(torch.int8), float(t.scale[0]), 0)
    return torch._make_per_channel_quantized_tensor(
        q.to(torch.int8), t.scale.double(), zp.long(), axis)


def transposed_kernel_refusal(t: IntTensor, dims: int, groups: int, engine: str) -> str | None:
    """Why torch's quantized transposed convolution on ``engine`` cannot take this weight
    (``[in, out / groups, k...]``, output channels on axis 1), or None when it can.

    fbgemm (the ``x86`` engine) takes per-tensor weights only; qnnpack takes per-channel
    ones (axis 1) without groups, and is not used for 3-D (its results differ from the
    float op's). On ``x86`` the kernel is packed with fbgemm: torch's ``x86`` engine hands
    some transposed convolutions to oneDNN, whose results differ from the float op's."""
    if qint8(t, axis=1) is None:
        kind = ("per_group" if t.group_size is not None else "per_tensor" if t.axis is None
                else f"per_channel axis {t.axis}")
        return (f"int{t.bits} {kind} weight: transposed-conv kernels take symmetric int8 "
                "weights, per tensor or per channel along axis 1 (the output channels)")
    if engine in ("x86", "fbgemm", "onednn"):
        if t.axis is not None:
            return ("per-channel weight: torch's x86 transposed-conv kernels (fbgemm) take a "
                    "per-tensor weight only")
        return None
    if dims == 3:
        return "qnnpack's 3-D transposed convolution is not used (it computes something else)"
    if t.axis is not None and groups != 1:
        return "qnnpack takes a per-channel transposed-conv weight only without groups"
    return None


#: activation dtypes with an 8-bit integer tensor type (quint8 after the grid shift)
EIGHT_BIT = ("uint8", "int8")


def act_qparams(fq: Any) -> tuple[float, int, int] | None:
    """(scale, zero point on the uint8 grid, highest level on that grid) for an 8-bit
    per-tensor static quantizer: 255, or 127 where ``quant.target`` keeps activations in
    7 bits (x86). The quantizer's lowest level maps to 0 on the uint8 grid."""
    if (not isinstance(fq, FakeQuantize) or fq.dynamic or not fq.enabled
            or fq.granularity != "per_tensor" or fq.dtype not in EIGHT_BIT
            or not 0 < fq.quant_max - fq.quant_min <= 255):
        return None
    return (float(fq.scale.detach()[0]), int(fq.zero_point[0]) - fq.quant_min,
            fq.quant_max - fq.quant_min)


def level_bounds(qparams: tuple[float, int, int]) -> tuple[float, float] | None:
    """The float range of a reduced grid (None for the full uint8 range): quint8 kernels
    clamp to [0, 255], the fake-quant graph to [0, levels]; a clamp to these bounds
    (exact grid values) makes the two agree beyond the calibrated range too."""
    scale, zp, levels = qparams
    if levels == 255:
        return None
    return (0 - zp) * scale, (levels - zp) * scale


def module_at(gm: GraphModule, node: Node) -> nn.Module | None:
    """The module a ``call_module`` node calls, else None."""
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


def arg(node: Node, index: int, name: str, default: Any) -> Any:
    """Argument ``index`` of a call, or its keyword ``name``, or ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def is_relu(gm: GraphModule, node: Node | None) -> bool:
    if node is None:
        return False
    if node.op == "call_module":
        return type(module_at(gm, node)) is nn.ReLU
    return node.op in ("call_function", "call_method") and op_name(node) == "relu"


def attr_value(gm: GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads, else None."""
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    parent, _, leaf = str(node.target).rpartition(".")
    return getattr(gm.get_submodule(parent) if parent else gm, leaf)


def where(node: Node) -> str:
    """The layer a node belongs to: its module (either front end), else the node."""
    return layer_of(node) or node.name


@dataclass
class Conversion:
    """The state the steps of one graph's conversion share (``ctx.conversion``)."""

    # weight quantizer node -> its integers (collected once, BatchNorm folds rewrite them)
    weights: dict[Node, IntTensor] = field(default_factory=dict)
    # block-format weight quantizer node -> its codes and scales (no kernel takes them:
    # store_weights keeps them as a BlockWeight)
    blocks: dict[Node, BlockCodes] = field(default_factory=dict)
    # op -> the bias replacing its own (a folded BatchNorm's)
    bias: dict[Node, torch.Tensor | None] = field(default_factory=dict)
    # (node, layer, path, op, note); names are read at the end, after renaming
    steps: list[tuple[Node, str, str, str, str]] = field(default_factory=list)
    count: int = 0  # modules and buffers added: `_qc_<count>_<layer>`
    # node reading a lowered quantizer's output -> the path of its ActivationQParams: a
    # kernel that later takes the quantizer's place (quantized::add) reads them from there
    qparams_after: dict[Node, str] = field(default_factory=dict)
    # each rank converts its own rows of an FSDP2-sharded graph (``qc.convert``): no
    # kernels (they need whole weights), and every tensor of an ``IntWeight`` is laid out
    # by rows whatever its values, so that the ranks' shards fit one global tensor
    rows_only: bool = False

    def release(self, node: Node) -> None:
        """Forget ``node``'s integers once nothing reads its weight any more (a kernel or
        an ``IntWeight`` holds them now): the conversion then holds each weight's
        integers once, not twice, and a converted layer's temporaries go with it."""
        if not node.users:
            self.weights.pop(node, None)

    def record(self, node: Node, path: str, op: str, note: str = "",
               layer: str | None = None) -> None:
        self.steps.append((node, layer or where(node), path, op, note))

    def _name(self, base: str) -> str:
        self.count += 1
        return f"_qc_{self.count}_{base.replace('.', '_')}"

    def add_module(self, gm: GraphModule, base: str, module: nn.Module) -> str:
        name = self._name(base)
        gm.add_submodule(name, module)
        return name

    def add_buffer(self, gm: GraphModule, base: str, value: torch.Tensor, *,
                   parameter: bool = False) -> str:
        """A new tensor of ``gm``: a buffer, or a parameter without gradient."""
        name = self._name(base)
        if parameter:
            gm.register_parameter(name, nn.Parameter(value, requires_grad=False))
        else:
            gm.register_buffer(name, value)
        return name

    def records(self) -> list[ConversionRecord]:
        """What became what, under the nodes' final names. A quantize node a kernel
        absorbed is not in the result (a fold's conv is: it became a kernel)."""
        return [ConversionRecord(node=node.name, module=layer, path=path, op=op, note=note)
                for node, layer, path, op, note in self.steps
                if not node._erased or path == "fold"]


def state(ctx: Context) -> Conversion:
    """``ctx.conversion``; the ``Pipeline`` puts ``collect_weights`` first, which makes it."""
    if not isinstance(ctx.conversion, Conversion):
        raise QCompileError("a conversion step ran without collect_weights before it",
                            fix="run the steps through qcompile.passes.convert's pipeline")
    return ctx.conversion
