"""``convert``: lower a fake-quant graph to integer kernels for inference (``qc.convert``).

Runs on a copy that ``qc.convert`` made and checked (calibrated or trained, eval mode).
What each quantized node becomes, in order of preference:

1. **Integer kernels** (``torch.ops.quantized`` through torch's own modules, on the
   current ``torch.backends.quantized.engine``: x86/fbgemm, onednn, qnnpack):
   ``linear`` / ``conv1-3d`` (+ ReLU) whose input comes out of an 8-bit per-tensor
   activation quantizer, whose weight is int8 symmetric per-tensor or per-channel (axis 0)
   and whose output (or the following ReLU) goes into an 8-bit per-tensor activation
   quantizer become ``nnq.Linear`` / ``nniq.LinearReLU`` / ``nnq.Conv2d`` / ... reading and
   writing ``quint8`` tensors; ``add`` (+ ReLU) between two such tensors becomes
   ``quantized::add``. Shape ops and max-pooling run on the quantized tensor directly
   (``dequantize`` commutes with them exactly); dropout is removed.
   Dynamic graphs: ``linear`` whose input has an 8-bit per-tensor dynamic quantizer
   becomes ``quantized::linear_dynamic`` (``DynamicLinear``).
2. **Activation quantizers** that are 8-bit per-tensor become ``quantize_per_tensor`` ->
   ``dequantize`` (real uint8 values in between), so what is not a kernel reads the same
   numbers as the fake-quant graph.
3. **Int-storage weights** for everything else (int4 packed two per byte, per-group
   scales, weights used by embedding/matmul, ops without a quantized input): an
   ``IntWeight`` module returns the dequantized weight to the float op. The float
   parameter is dropped from the state dict.
4. Other activation quantizers (per-token, fp8, not 8-bit) stay ``FakeQuantize``
   (observers frozen): simulated, with a note saying so.

In QAT graphs BatchNorm after a conv is folded here: the integer weights stay as they
are and the per-channel scales absorb ``gamma / sqrt(var + eps)``.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> spec = qc.load_spec("int8-static").model_copy(deep=True)
    >>> gm = qc.qcompile(m, spec, example_inputs=(torch.randn(2, 8),))
    >>> gm = qc.calibrate(gm, [(torch.randn(16, 8),) for _ in range(4)], progress=False)
    >>> int8 = qc.convert(gm)
    >>> sorted({r.path for r in qc.report(int8).conversions})
    ['int_storage', 'kernel', 'quantize']
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.graph.matching import layer_of, op_name
from qcompile.graph.meta import DQ_KEY, FINAL_NAME_KEY, MODULE_KEY, QPARAMS_KEY, TENSOR_META
from qcompile.graph.records import ConversionRecord
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.modes import ModeAwareBatchNorm
from qcompile.runtime.quantized import DynamicLinear, IntWeight
from qcompile.specs.quant import FP8_MAX

aten = torch.ops.aten
_LINEAR = {F.linear, aten.linear.default}
_CONV = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2,
         torch.conv3d: 3, aten.conv1d.default: 1, aten.conv2d.default: 2,
         aten.conv3d.default: 3}
_QCONV = {1: (nnq.Conv1d, nniq.ConvReLU1d), 2: (nnq.Conv2d, nniq.ConvReLU2d),
          3: (nnq.Conv3d, nniq.ConvReLU3d)}
_ADD = {operator.add, torch.add, aten.add.Tensor}
_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# Ops through which a quantized tensor passes unchanged in value: dequantize commutes with
# them exactly, so they run on the integers (as torch.ao's convert does).
_SHAPE_METHODS = {"flatten", "reshape", "view", "permute", "transpose", "contiguous",
                  "squeeze", "unsqueeze", "relu"}
_SHAPE_FUNCTIONS = {torch.flatten, torch.reshape, torch.permute, torch.transpose,
                    torch.squeeze, torch.unsqueeze, torch.relu, F.relu, F.max_pool1d,
                    F.max_pool2d, aten.flatten.using_ints, aten.view.default,
                    aten.reshape.default, aten.permute.default, aten.transpose.int,
                    aten.squeeze.dim, aten.unsqueeze.default, aten.relu.default,
                    aten.max_pool2d.default}
_SHAPE_MODULES = (nn.Flatten, nn.MaxPool1d, nn.MaxPool2d, nn.ReLU, nn.Unflatten)
_DROP_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                 nn.Identity)


@dataclass(frozen=True)
class IntTensor:
    """A weight as integers with its qparams (the fake-quant's exact grid)."""

    q: torch.Tensor  # int32, the weight's shape
    scale: torch.Tensor  # float32, 1-D
    zero_point: torch.Tensor  # int32, 1-D
    axis: int | None
    group_size: int | None
    quant_min: int
    quant_max: int

    @property
    def bits(self) -> int:
        return max(1, math.ceil(math.log2(self.quant_max - self.quant_min + 1)))


def integers(fq: FakeQuantize, w: torch.Tensor) -> IntTensor:
    """``w`` on ``fq``'s grid: ``clamp(round(w / scale) + zp)``, as its forward computes."""
    x = w.detach().float()
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
    q = torch.clamp(torch.round(xs / s) + z, fq.quant_min, fq.quant_max)
    return IntTensor(q.to(torch.int32).reshape(x.shape), scale.clone(), zp.to(torch.int32),
                     fq.axis % x.dim() if fq.axis is not None else None, fq.group_size,
                     fq.quant_min, fq.quant_max)


def _qint8(t: IntTensor) -> torch.Tensor | None:
    """The weight as a ``qint8`` tensor for torch's kernels, or None when it does not fit
    (more than 8 bits, asymmetric, per-group, channel axis other than 0)."""
    if t.group_size is not None or (t.axis not in (None, 0)) or t.quant_max - t.quant_min > 255:
        return None
    shift = 128 if t.quant_min >= 0 else 0  # uint8 grid -> int8 grid, same values
    q, zp = t.q - shift, t.zero_point - shift
    if bool((zp != 0).any()) or int(q.min()) < -128 or int(q.max()) > 127:
        return None
    if t.axis is None:
        return torch._make_per_tensor_quantized_tensor(q.to(torch.int8), float(t.scale[0]), 0)
    return torch._make_per_channel_quantized_tensor(
        q.to(torch.int8), t.scale.double(), zp.long(), 0)


def _act_qparams(fq: Any) -> tuple[float, int] | None:
    """(scale, zero point on the uint8 grid) for an 8-bit per-tensor static quantizer."""
    if (not isinstance(fq, FakeQuantize) or fq.dynamic or not fq.enabled
            or fq.granularity != "per_tensor" or fq.dtype in FP8_MAX
            or fq.quant_max - fq.quant_min != 255):
        return None
    return float(fq.scale.detach()[0]), int(fq.zero_point[0]) - fq.quant_min


def _module(gm: GraphModule, node: Node) -> nn.Module | None:
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


def _arg(node: Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_relu(gm: GraphModule, node: Node | None) -> bool:
    if node is None:
        return False
    if node.op == "call_module":
        return type(_module(gm, node)) is nn.ReLU
    return node.op in ("call_function", "call_method") and op_name(node) == "relu"


def _attr_value(gm: GraphModule, node: Any) -> torch.Tensor | None:
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    parent, _, leaf = str(node.target).rpartition(".")
    return getattr(gm.get_submodule(parent) if parent else gm, leaf)


def _where(node: Node) -> str:
    """The layer a node belongs to: its module (either front end), else the node."""
    return layer_of(node) or node.name


class _Converter:
    """State of one conversion: the graph, the integer weights, the records."""

    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self.g = gm.graph
        # (node, layer, path, op, note); names are read at the end, after renaming
        self.records: list[tuple[Node, str, str, str, str]] = []
        self.weights: dict[Node, IntTensor] = {}  # weight quantizer node -> integers
        self.bias: dict[Node, torch.Tensor | None] = {}  # op -> bias replacing its own
        self.count = 0

    def record(self, node: Node, path: str, op: str, note: str = "",
               layer: str | None = None) -> None:
        self.records.append((node, layer or _where(node), path, op, note))

    def add_module(self, base: str, module: nn.Module) -> str:
        self.count += 1
        name = f"_qc_{self.count}_{base.replace('.', '_')}"
        self.gm.add_submodule(name, module)
        return name

    def add_buffer(self, base: str, value: torch.Tensor) -> str:
        self.count += 1
        name = f"_qc_{self.count}_{base.replace('.', '_')}"
        self.gm.register_buffer(name, value)
        return name

    # -- 0. integer weights ---------------------------------------------------------------
    def collect_weights(self) -> None:
        for node in self.g.nodes:
            fq = _module(self.gm, node)
            if not isinstance(fq, FakeQuantize) or not node.args:
                continue
            w = _attr_value(self.gm, node.args[0])
            if isinstance(w, nn.Parameter) and fq.dtype not in FP8_MAX and fq.enabled:
                self.weights[node] = integers(fq, w)

    # -- 1. BatchNorm after a conv (QAT keeps it in the graph) --------------------------
    def fold_batchnorm(self) -> None:
        for node in list(self.g.nodes):
            bn = _module(self.gm, node)
            if not isinstance(bn, (*_BN, ModeAwareBatchNorm)) or not node.args:
                continue
            conv = node.args[0]
            if (not isinstance(conv, Node) or conv.target not in _CONV
                    or len(conv.users) != 1):
                continue
            w_node = conv.args[1]
            if w_node not in self.weights:
                continue
            t = self.weights[w_node]
            if t.group_size is not None or t.axis not in (None, 0) or len(w_node.users) != 1:
                continue
            if isinstance(bn, ModeAwareBatchNorm):
                gamma, beta, mean, var = (_attr_value(self.gm, a) for a in node.args[1:5])
            else:
                gamma, beta, mean, var = bn.weight, bn.bias, bn.running_mean, bn.running_var
            if mean is None or var is None:
                continue
            with torch.no_grad():
                factor = torch.rsqrt(var.float() + bn.eps)
                if gamma is not None:
                    factor = factor * gamma.float()
                bias = _attr_value(self.gm, _arg(conv, 2, "bias", None))
                b = bias.float() if bias is not None else torch.zeros_like(factor)
                new_bias = (b - mean.float()) * factor + (
                    beta.float() if beta is not None else 0.0)
                channels = factor.numel()
                scale = t.scale.expand(channels) if t.axis is None else t.scale
                sign = torch.where(factor < 0, -1, 1).to(torch.int32)
                view = [-1] + [1] * (t.q.dim() - 1)
                zp = t.zero_point.expand(channels) if t.axis is None else t.zero_point
                # The integers stay; a negative factor mirrors them around the zero point
                # (clamped: -128 has no mirror in int8, one step of error at most).
                q = torch.clamp((t.q - zp.view(view)) * sign.view(view) + zp.view(view),
                                t.quant_min, t.quant_max)
                self.weights[w_node] = replace(t, q=q.to(torch.int32),
                                               scale=(scale * factor.abs()).contiguous(),
                                               zero_point=zp.contiguous(), axis=0)
            self.bias[conv] = new_bias.detach()
            node.replace_all_uses_with(conv)
            self.g.erase_node(node)
            self.record(conv, "fold", "batchnorm", f"folded {node.name} into the weight scales")

    # -- 2. activation quantizers -> quantize / dequantize --------------------------------
    def lower_activations(self) -> None:
        for node in list(self.g.nodes):
            fq = _module(self.gm, node)
            if not isinstance(fq, FakeQuantize) or node in self.weights:
                continue
            if not fq.enabled and not fq.dynamic:  # switched off: the value passes as is
                node.replace_all_uses_with(node.args[0])
                self.g.erase_node(node)
                continue
            qp = _act_qparams(fq)
            tm = node.meta.get(TENSOR_META)
            if qp is None or (tm is not None and getattr(tm, "dtype", None) != torch.float32):
                if not fq.dynamic:
                    fq.observe = False
                    self.record(node, "fake_quant", "FakeQuantize",
                                f"{fq.dtype} {fq.granularity}: no integer tensor type for it; "
                                "stays simulated", layer=str(node.target))
                continue
            with self.g.inserting_after(node):
                q = self.g.call_function(torch.quantize_per_tensor,
                                         (node.args[0], qp[0], qp[1], torch.quint8))
            with self.g.inserting_after(q):
                dq = self.g.call_method("dequantize", (q,))
            q.meta[QPARAMS_KEY] = qp
            dq.meta[DQ_KEY] = True
            dq.meta[TENSOR_META] = node.meta.get(TENSOR_META)
            node.replace_all_uses_with(dq)
            self.g.erase_node(node)
            self.record(q, "quantize", "quantize_per_tensor",
                        f"scale={qp[0]:.6g} zero_point={qp[1]} (quint8)", layer=str(node.target))

    # -- 3. shape ops run on the integers --------------------------------------------------
    def _transparent(self, node: Node) -> bool:
        if node.op == "call_method":
            return node.target in _SHAPE_METHODS
        if node.op == "call_function":
            return node.target in _SHAPE_FUNCTIONS
        return isinstance(_module(self.gm, node), _SHAPE_MODULES)

    def sink_dequantize(self) -> None:
        for node in list(self.g.nodes):
            if isinstance(_module(self.gm, node), _DROP_MODULES):  # inference: identity
                node.replace_all_uses_with(node.args[0])
                self.g.erase_node(node)
                continue
            if not self._transparent(node) or not node.args:
                continue
            dq = node.args[0]
            if not (isinstance(dq, Node) and dq.meta.get(DQ_KEY)):
                continue
            others = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, Node)]
            if others:
                continue
            node.replace_input_with(dq, dq.args[0])
            with self.g.inserting_after(node):
                new_dq = self.g.call_method("dequantize", (node,))
            new_dq.meta.update({DQ_KEY: True, TENSOR_META: node.meta.get(TENSOR_META)})
            node.replace_all_uses_with(new_dq, delete_user_cb=lambda u, d=new_dq: u is not d)
            if not dq.users:
                self.g.erase_node(dq)

    # -- 4. kernels -----------------------------------------------------------------------
    def _quantized_output(self, node: Node) -> tuple[Node, bool, Node | None]:
        """(the quantize node consuming ``node``'s value, whether a ReLU sits between,
        the ReLU node) or (node, False, None) when the value is not quantized."""
        user = _only_user(node)
        relu = None
        if _is_relu(self.gm, user):
            relu, user = user, _only_user(user)
        if user is not None and user.target is torch.quantize_per_tensor:
            return user, relu is not None, relu
        return node, False, None

    def _replace_chain(self, op: Node, out_q: Node, relu: Node | None, new: Node) -> None:
        out_q.replace_all_uses_with(new)
        for n in (out_q, relu, op):
            if n is not None:
                self.g.erase_node(n)

    def _static_kernel(self, node: Node) -> bool:
        x, w_node = node.args[0], node.args[1] if len(node.args) > 1 else None
        if not (isinstance(x, Node) and x.meta.get(DQ_KEY)) or w_node not in self.weights:
            return False
        out_q, has_relu, relu = self._quantized_output(node)
        if out_q is node:
            return False
        qweight = _qint8(self.weights[w_node])
        if qweight is None:
            return False
        bias = self.bias.get(node, _attr_value(self.gm, _arg(node, 2, "bias", None)))
        bias = None if bias is None else bias.detach().float()
        scale, zp = out_q.meta[QPARAMS_KEY]
        shape = tuple(qweight.shape)
        if node.target in _LINEAR:
            module = (nniq.LinearReLU(shape[1], shape[0], bias=bias is not None) if has_relu
                      else nnq.Linear(shape[1], shape[0], bias_=bias is not None))
        else:
            dims = _CONV[node.target]
            padding = _arg(node, 4, "padding", 0)
            if isinstance(padding, str):
                if padding != "valid":
                    return False
                padding = 0
            cls = _QCONV[dims][1 if has_relu else 0]
            groups = _arg(node, 6, "groups", 1)
            module = cls(shape[1] * groups, shape[0], shape[2:], stride=_arg(node, 3, "stride", 1),
                         padding=padding, dilation=_arg(node, 5, "dilation", 1), groups=groups,
                         bias=bias is not None)
        module.set_weight_bias(qweight, bias)
        module.scale, module.zero_point = scale, zp
        name = self.add_module(_where(node), module)
        with self.g.inserting_before(node):
            new = self.g.call_module(name, (x.args[0],))
        new.meta[MODULE_KEY] = new.meta[FINAL_NAME_KEY] = _where(node)
        self._replace_chain(node, out_q, relu, new)
        op = f"quantized::{'linear' if node.target in _LINEAR else 'conv'}" + (
            "_relu" if has_relu else "")
        self.record(new, "kernel", op,
                    f"{torch.backends.quantized.engine} engine, weight {tuple(shape)} int8")
        return True

    def _dynamic_kernel(self, node: Node) -> bool:
        x, w_node = node.args[0], node.args[1] if len(node.args) > 1 else None
        if node.target not in _LINEAR or w_node not in self.weights:
            return False
        fq = _module(self.gm, x) if isinstance(x, Node) else None
        if not (isinstance(fq, FakeQuantize) and fq.dynamic and fq.enabled
                and fq.granularity == "per_tensor" and not fq.symmetric
                and fq.quant_min == 0 and fq.quant_max == 255):
            return False
        qweight = _qint8(self.weights[w_node])
        if qweight is None:
            return False
        bias = _attr_value(self.gm, _arg(node, 2, "bias", None))
        module = DynamicLinear(qweight.shape[1], qweight.shape[0], bias_=bias is not None)
        module.set_weight_bias(qweight, None if bias is None else bias.detach().float())
        name = self.add_module(_where(node), module)
        with self.g.inserting_before(node):
            new = self.g.call_module(name, (x.args[0],))
        new.meta[MODULE_KEY] = new.meta[FINAL_NAME_KEY] = _where(node)
        node.replace_all_uses_with(new)
        self.g.erase_node(node)
        self.record(new, "dynamic_kernel", "quantized::linear_dynamic",
                    f"weight {tuple(qweight.shape)} int8")
        return True

    def _add_kernel(self, node: Node) -> bool:
        args = [a for a in node.args if isinstance(a, Node)]
        if (len(node.args) != 2 or len(args) != 2 or node.kwargs
                or not all(a.meta.get(DQ_KEY) for a in args)):
            return False
        out_q, has_relu, relu = self._quantized_output(node)
        if out_q is node:
            return False
        scale, zp = out_q.meta[QPARAMS_KEY]
        fn = torch.ops.quantized.add_relu if has_relu else torch.ops.quantized.add
        with self.g.inserting_before(node):
            new = self.g.call_function(fn, (args[0].args[0], args[1].args[0], scale, zp))
        self._replace_chain(node, out_q, relu, new)
        self.record(new, "kernel", f"quantized::add{'_relu' if has_relu else ''}")
        return True

    def kernels(self) -> None:
        on_cpu = all(t.device.type == "cpu" for t in self.gm.parameters())
        for node in list(self.g.nodes):
            if node.op != "call_function" or not on_cpu:
                continue
            if node.target in _LINEAR or node.target in _CONV:
                self._static_kernel(node) or self._dynamic_kernel(node)
            elif node.target in _ADD:
                self._add_kernel(node)

    # -- 5. what is left: int-storage weights ---------------------------------------------
    def store_weights(self) -> None:
        for w_node, t in self.weights.items():
            if w_node._erased or not w_node.users:
                continue  # consumed by a kernel (the node was erased with it)
            users = list(w_node.users)
            fq = _module(self.gm, w_node)
            param_name = str(w_node.args[0].target)
            param = _attr_value(self.gm, w_node.args[0])
            bits = t.bits
            scale = t.scale
            note = ""
            if t.group_size is not None and bits <= 4 and _fits_fp16(scale):
                # 4-bit groups of 32: fp32 scales alone would be 25% of the int4 payload
                scale = scale.half()
                note = "per-group scales stored as float16"
            elif _qint8(t) is None and any(u.target in _LINEAR or u.target in _CONV
                                           for u in users):
                note = f"{fq.dtype} {fq.granularity}: no integer kernel for this weight"
            module = IntWeight(t.q.to(torch.int16 if bits > 8 else torch.int8), scale,
                               t.zero_point, axis=t.axis, group_size=t.group_size,
                               bits=4 if bits <= 4 else 8 if bits <= 8 else 16,
                               dtype=param.dtype)
            name = self.add_module(param_name, module)
            with self.g.inserting_before(w_node):
                new = self.g.call_module(name, ())
            new.meta[FINAL_NAME_KEY] = param_name
            w_node.replace_all_uses_with(new)
            self.g.erase_node(w_node)
            self.record(new, "int_storage", f"int{module.bits} weight",
                        note or "dequantized for the float op", layer=param_name)
            for user in users:  # a folded BatchNorm's bias replaces the op's own
                if user in self.bias:
                    b = self.add_buffer(f"{_where(user)}.bias", self.bias[user])
                    with self.g.inserting_before(user):
                        b_node = self.g.get_attr(b)
                    args = list(user.args)
                    while len(args) < 3:
                        args.append(None)
                    args[2] = b_node
                    user.args = tuple(args)

    # -- 6. tidy: drop what no node reads, give new modules their layers' names ------------
    def tidy(self) -> None:
        self.g.eliminate_dead_code()
        used = {str(n.target) for n in self.g.nodes if n.op in ("get_attr", "call_module")}
        called = {str(n.target) for n in self.g.nodes if n.op == "call_module"}

        def needed(path: str) -> bool:  # read by a node, or inside a called module
            parts = path.split(".")
            return path in used or any(".".join(parts[:i]) in called
                                       for i in range(1, len(parts)))

        for mod_name, module in list(self.gm.named_modules()):
            for kind in ("_parameters", "_buffers"):
                for leaf in list(getattr(module, kind)):
                    path = f"{mod_name}.{leaf}" if mod_name else leaf
                    if not needed(path):
                        del getattr(module, kind)[leaf]
        self.gm.delete_all_unused_submodules()
        # `_qc_<k>_<layer>` -> `<layer>` (fc -> QuantizedLinear) and `<layer>.weight` ->
        # IntWeight, where the name is free now, so state dicts read like the model's
        for node in self.g.nodes:
            wanted = node.meta.get(FINAL_NAME_KEY)
            if node.op != "call_module" or not wanted:
                continue
            parent, _, leaf = wanted.rpartition(".")
            try:
                owner = self.gm.get_submodule(parent) if parent else self.gm
            except AttributeError:
                owner = None  # the container went away with its last tensor: recreate it
            if owner is not None and hasattr(owner, leaf):
                continue
            module = self.gm.get_submodule(str(node.target))
            self.gm.delete_submodule(str(node.target))
            self.gm.add_submodule(wanted, module)
            node.target = wanted
        for node in self.g.nodes:  # `_qc_1_fc` -> `fc` in the code, too
            wanted = node.meta.get(FINAL_NAME_KEY)
            if node.op == "call_module" and wanted and node.name.startswith("_qc_"):
                node._rename(wanted.replace(".", "_"))


def _fits_fp16(scale: torch.Tensor) -> bool:
    """float16 keeps ~3 significant digits for normal values (6.1e-5 .. 65504)."""
    return bool(((scale >= 6.2e-5) & (scale <= 65504)).all())


def convert_graph(gm: GraphModule) -> list[ConversionRecord]:
    """Rewrite ``gm`` (a checked copy, in eval mode) in place; returns what became what."""
    c = _Converter(gm)
    c.collect_weights()
    c.fold_batchnorm()
    c.lower_activations()
    c.sink_dequantize()
    c.kernels()
    c.store_weights()
    c.tidy()
    gm.graph.lint()
    gm.recompile()
    # a quantize node a kernel absorbed is not in the result: report what is
    return [ConversionRecord(node=node.name, module=layer, path=path, op=op, note=note)
            for node, layer, path, op, note in c.records
            if not node._erased or path == "fold"]  # (a fold's conv became a kernel)
