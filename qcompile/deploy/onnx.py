"""QDQ ONNX export: ``export_onnx(gm, path, example_inputs)``.

A compiled graph (QAT, static after ``qc.calibrate``, or dynamic; either front end; a
pipeline graph exports whole) becomes an ONNX model (opset 21) that onnxruntime runs and,
after its graph optimisations, fuses into QLinear* / integer kernels. The route is
``torch.onnx.export`` (the dynamo exporter): a deep copy of the graph (the *twin*; ``gm``
itself is never touched) has every ``FakeQuantize`` replaced by a call to one of three
small torch ops (``qcompile_onnx::qdq``, ``::dq``, ``::dynamic_qdq``), and a
``custom_translation_table`` gives each op its ONNX form:

- activations (per-tensor, per-channel ``axis``): ``QuantizeLinear -> DequantizeLinear``;
  when the quantizer's range is narrower than its container (the x86 target's 7-bit
  activations, int2..int7) a ``Clip`` on the integers sits between them, so onnxruntime
  computes exactly ``clamp(round(x / scale) + zero_point, quant_min, quant_max)``. A
  per-channel activation read by a ``MatMul`` (a Linear on 3-D inputs) is dequantized
  there as ``(Cast(q) - zero_point) * scale`` (the same float32 values): onnxruntime would
  fuse a DequantizeLinear into MatMulIntegerToFloat, which takes one zero point only;
- weights: the integers are computed once and stored as initializers (INT8/UINT8, INT4/
  UINT4 for 4 bits or less, INT16/UINT16, FLOAT8E4M3FN/FLOAT8E5M2) feeding a
  ``DequantizeLinear`` (per-group: blocked, ``block_size``), so the file is small;
- fp8 (``fp8_e4m3``, ``fp8_e5m2``): the saturating fp8 QuantizeLinear / DequantizeLinear;
- block-format weights: MXFP8 (``mxfp8_e4m3``, ``mxfp8_e5m2``) as FLOAT8E4M3FN / FLOAT8E5M2
  initializers and a blocked ``DequantizeLinear`` (``block_size`` 32 along each row) whose
  float32 scales are the E8M0 powers of two (exact). The other block formats are refused,
  naming the layer: onnxruntime's CPU provider has no ``DequantizeLinear`` or ``Cast``
  kernel for ONNX's FLOAT4E2M1 (``mxfp4``, ``nvfp4``), and ONNX has no 6-bit float
  (``mxfp6_*``) or NF4 element type; block-format activations (scales computed from each
  input, an exponent read from a float's bits) are refused too;
- dynamic per-tensor activations: ``DynamicQuantizeLinear`` for the full uint8 range, else
  the same qparam formula in ONNX ops (ReduceMin/ReduceMax, Div, Round) feeding
  QuantizeLinear; per-token quantizers: that formula with float arithmetic (their scales
  have one value per row, which QuantizeLinear has no form for).

The batch dimension (dim 0 of every input tensor) is dynamic unless ``dynamic_batch=False``;
a graph from the torch.export front end that baked its example batch into a shape (a
``reshape(4, -1)``) is refused with the fix (compile with ``trace.dynamic_dims``).
Quantizers export their current qparams as they are: a QAT graph not yet frozen exports
what it computes with its observers off (with a warning: call ``qc.freeze`` first).

Refused before anything is traced or written (``QCompileError`` with the fix): a model
qcompile did not compile, activation quantizers that never saw data (a static graph before
``qc.calibrate``, a QAT graph before training), example inputs that do not fit the graph
(the input and its shape named, checked by running the graph on them), a missing folder.
A pipeline graph exports whole, ``transfer: int8`` included (its integers crossing a cut
are the quantizer's own values, so the file keeps the float). The file is written to a
temporary beside ``path`` and moved into place: an interrupted export leaves the previous
file as it was.

Signed 8-bit activations (asymmetric ``int8``, the ``x86`` target's -64..63) keep int8 Q/DQ
pairs; every MaxPool / Reshape / Transpose / Squeeze / Unsqueeze / Slice they cross gets its
own pair (exact: the ops commute with quantization), because onnxruntime's own copies of a
pair across those ops get mismatched types from its int8 -> uint8 rewrite and the session
then refuses to load the file.

Numerics: the file computes the fake-quant graph's values (onnxruntime with basic
optimisations: exact on the tests' models). With all optimisations onnxruntime runs
integer kernels that round each requantization their own way: within one output step per
layer, occasionally two after several layers. Full-range 8-bit activations (targets
``onednn_vnni``, ``generic``) saturate in its u8 x s8 kernels on CPUs without VNNI, which is
what the ``x86`` target's 7-bit activations avoid.

Needs the ``[onnx]`` extra (onnx, onnxscript, onnxruntime).

Example:
    >>> import os, tempfile, torch, onnx, qcompile as qc
    >>> gm = qc.qcompile(torch.nn.Sequential(torch.nn.Linear(8, 4)), "int8-qat",
    ...                  example_inputs=(torch.randn(2, 8),))
    >>> _ = gm(torch.randn(2, 8)); _ = qc.freeze(gm)
    >>> path = qc.export_onnx(gm, os.path.join(tempfile.mkdtemp(), "m.onnx"),
    ...                       example_inputs=(torch.randn(2, 8),))
    >>> sorted({n.op_type for n in onnx.load(path).graph.node})
    ['Clip', 'DequantizeLinear', 'Gemm', 'QuantizeLinear']
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import itertools
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.deploy.adapters import refuse_adapters, unwrap
from qcompile.deploy.stages import refuse_sharded_stage, spread
from qcompile.deploy.whole_graph import agree_and_share, agree_to_gather, writes_here
from qcompile.errors import QCompileError
from qcompile.files import atomic_paths, write_atomically
from qcompile.graph.algorithms import refuse_pending
from qcompile.graph.matching import layer_of
from qcompile.graph.meta import REPORT_KEY, TP_SHARDED_KEY
from qcompile.graph.signature import graph_inputs
from qcompile.runtime.block_formats import quantize_blocks
from qcompile.runtime.calibration import GraphInput, describe, quiet_fx_trace, uncalibrated
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.transfer import pack, unpack
from qcompile.specs.quant import FP8_MAX

__all__ = ["export_onnx"]

OPSET = 21
NAMESPACE = "qcompile_onnx"
_EXTRA = "pip install qcompile[onnx]"
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# torch.onnx's own limit: initializers beyond it go to an external data file
_EXTERNAL_DATA_BYTES = 1536 * 1024 * 1024


# -- the carrier ops -----------------------------------------------------------------------
def _shaped(t: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    """A per-axis qparam shaped to broadcast along ``axis`` of an ``ndim``-D tensor (a 0-D
    qparam is per-tensor and broadcasts as is)."""
    if t.dim() == 0:
        return t
    shape = [1] * ndim
    shape[axis] = -1
    return t.reshape(shape)


def _blocked(t: torch.Tensor, like: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """Blocked qparams (ONNX's ``block_size``) repeated to ``like``'s shape."""
    return t.repeat_interleave(block, dim=axis)[tuple(slice(0, n) for n in like.shape)]


def _qdq_eager(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
               quant_min: int, quant_max: int, axis: int, fmt: str) -> torch.Tensor:
    s = _shaped(scale, x.dim(), axis)
    z = _shaped(zero_point, x.dim(), axis).float()
    if fmt in _FP8:
        xs = torch.clamp(x.float() / s, -FP8_MAX[fmt], FP8_MAX[fmt])
        return (xs.to(_FP8[fmt]).float() * s).to(x.dtype)
    q = torch.clamp(torch.round(x.float() / s) + z, quant_min, quant_max)
    return ((q - z) * s).to(x.dtype)


def _dq_eager(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
              axis: int, block: int, fmt: str) -> torch.Tensor:
    if block:
        s, z = _blocked(scale, q, axis, block), _blocked(zero_point, q, axis, block)
    else:
        s, z = _shaped(scale, q.dim(), axis), _shaped(zero_point, q.dim(), axis)
    return (q.float() - z.float()) * s


def _dynamic_eager(x: torch.Tensor, quant_min: int, quant_max: int, symmetric: bool,
                   per_token: bool) -> torch.Tensor:
    scale, zp = _dynamic_qparams(x.float(), quant_min, quant_max, symmetric, per_token)
    q = torch.clamp(torch.round(x.float() / scale) + zp, quant_min, quant_max)
    return ((q - zp) * scale).to(x.dtype)


def _dynamic_qparams(x: torch.Tensor, quant_min: int, quant_max: int, symmetric: bool,
                     per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """qcompile's ``qparams_from_minmax`` over the whole tensor or each row."""
    if per_token:
        mn, mx = torch.aminmax(x, dim=-1, keepdim=True)
    else:
        mn, mx = torch.aminmax(x)
    mn, mx = torch.clamp(mn, max=0.0), torch.clamp(mx, min=0.0)
    eps = torch.finfo(torch.float32).eps
    if symmetric:
        zp = 0 if quant_min < 0 else (quant_min + quant_max + 1) // 2
        steps = min(quant_max - zp, zp - quant_min)
        scale = torch.clamp(torch.maximum(-mn, mx) / steps, min=eps)
        return scale, torch.full_like(scale, zp)
    scale = torch.clamp((mx - mn) / (quant_max - quant_min), min=eps)
    return scale, torch.clamp(quant_min - torch.round(mn / scale), quant_min, quant_max)


def _ops() -> Any:
    """``torch.ops.qcompile_onnx``, defining its three ops on first use (not at import:
    importing qcompile registers nothing with torch)."""
    lib = getattr(torch.ops, NAMESPACE)
    if hasattr(lib, "qdq"):
        return lib
    qdq = torch.library.custom_op(f"{NAMESPACE}::qdq", mutates_args=())(_qdq_sig)
    qdq.register_fake(lambda x, *args: torch.empty_like(x))
    dq = torch.library.custom_op(f"{NAMESPACE}::dq", mutates_args=())(_dq_sig)
    dq.register_fake(lambda q, *args: torch.empty(q.shape, dtype=torch.float32,
                                                  device=q.device))
    dyn = torch.library.custom_op(f"{NAMESPACE}::dynamic_qdq", mutates_args=())(_dynamic_sig)
    dyn.register_fake(lambda x, *args: torch.empty_like(x))
    return getattr(torch.ops, NAMESPACE)


# torch.library reads the schema from these annotations, so they are spelled out in full
def _qdq_sig(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
             quant_max: int, axis: int, fmt: str) -> torch.Tensor:
    return _qdq_eager(x, scale, zero_point, quant_min, quant_max, axis, fmt)


def _dq_sig(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int,
            block: int, fmt: str) -> torch.Tensor:
    return _dq_eager(q, scale, zero_point, axis, block, fmt)


def _dynamic_sig(x: torch.Tensor, quant_min: int, quant_max: int, symmetric: bool,
                 per_token: bool) -> torch.Tensor:
    return _dynamic_eager(x, quant_min, quant_max, symmetric, per_token)


# -- the twin's stand-ins for FakeQuantize -------------------------------------------------
def _container(fq: FakeQuantize, *, weight: bool) -> str:
    """The ONNX element type holding ``fq``'s values: fp8 as is; integers in 8 bits when
    they fit (the QLinear kernels' type), weights of 4 bits or less in INT4/UINT4."""
    if fq.dtype in _FP8:
        return fq.dtype
    sign = "int" if fq.quant_min < 0 else "uint"
    lo, hi = (-8, 7) if sign == "int" else (0, 15)
    if weight and lo <= fq.quant_min and fq.quant_max <= hi:
        return f"{sign}4"
    lo, hi = (-128, 127) if sign == "int" else (0, 255)
    return f"{sign}8" if lo <= fq.quant_min and fq.quant_max <= hi else f"{sign}16"


class _QDQ(nn.Module):
    """A static activation quantizer as ``qcompile_onnx::qdq``."""

    def __init__(self, fq: FakeQuantize) -> None:
        super().__init__()
        per_tensor = fq.axis is None
        scale = fq.scale.detach().float().clone()
        zp = fq.zero_point.detach().clone()
        # 0-D qparams: what QuantizeLinear calls per-tensor (and ORT's fusions look for)
        self.register_buffer("scale", scale.reshape(()) if per_tensor else scale)
        self.register_buffer("zero_point", zp.reshape(()) if per_tensor else zp)
        self.qrange = (fq.quant_min, fq.quant_max)
        self.axis = 1 if per_tensor else int(fq.axis)
        self.fmt = _container(fq, weight=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        return _ops().qdq(x, self.scale, self.zero_point, *self.qrange, self.axis, self.fmt)


class _DynamicQDQ(nn.Module):
    """A dynamic or per-token quantizer as ``qcompile_onnx::dynamic_qdq``."""

    def __init__(self, fq: FakeQuantize) -> None:
        super().__init__()
        self.qrange = (fq.quant_min, fq.quant_max)
        self.symmetric = fq.symmetric
        self.per_token = fq.granularity == "per_token"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        return _ops().dynamic_qdq(x, *self.qrange, self.symmetric, self.per_token)


class _WeightDQ(nn.Module):
    """A weight quantizer with its weight: the stored integers (fp8 values), dequantized by
    ``qcompile_onnx::dq``. Takes no input: the float weight leaves the graph."""

    def __init__(self, fq: FakeQuantize, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().float()
        self.shape = tuple(w.shape)
        self.fmt = _container(fq, weight=True)
        scale, zp = fq.scale.detach().float(), fq.zero_point.detach()
        self.axis, self.block = 1, 0
        if fq.granularity == "per_group":
            # qcompile groups run along the flattened trailing dims: a 2-D [rows, row]
            # tensor blocked along axis 1 (reshaped back after dequantizing)
            w = w.reshape(w.shape[0], -1)
            scale, zp = scale.reshape(w.shape[0], -1), zp.reshape(w.shape[0], -1)
            self.block = int(fq.group_size)
        elif fq.axis is not None:
            self.axis = int(fq.axis) % w.dim()
        else:
            scale, zp = scale.reshape(()), zp.reshape(())
        self.register_buffer("scale", scale.clone())
        self.register_buffer("zero_point", zp.clone())
        self.register_buffer("q", self._quantize(w, fq))

    def _quantize(self, w: torch.Tensor, fq: FakeQuantize) -> torch.Tensor:
        if self.block:
            s, z = (_blocked(t, w, 1, self.block) for t in (self.scale, self.zero_point))
        else:
            s, z = (_shaped(t, w.dim(), self.axis) for t in (self.scale, self.zero_point))
        if self.fmt in _FP8:
            xs = torch.clamp(w / s, -FP8_MAX[self.fmt], FP8_MAX[self.fmt])
            return xs.to(_FP8[self.fmt])
        q = torch.clamp(torch.round(w / s) + z.float(), fq.quant_min, fq.quant_max)
        # the narrowest torch integer type holding the values; ONNX casts to the container
        storage = torch.int8 if self.fmt in ("int8", "int4", "uint4") else torch.int32
        if self.fmt == "uint8":
            storage = torch.uint8
        elif self.fmt == "int16":
            storage = torch.int16
        return q.to(storage)

    def forward(self) -> torch.Tensor:
        w = _ops().dq(self.q, self.scale, self.zero_point, self.axis, self.block, self.fmt)
        return w.reshape(self.shape) if self.block else w


#: block formats whose elements ONNX and onnxruntime's CPU provider both have
_BLOCK_ELEMENTS = {"mxfp8_e4m3": "fp8_e4m3", "mxfp8_e5m2": "fp8_e5m2"}
_FP4_MISSING = ("ONNX's FLOAT4E2M1 elements (opset 23) have no DequantizeLinear or Cast kernel "
                "in onnxruntime's CPU execution provider, so the file would not run")
#: why each other block format has no ONNX form onnxruntime runs
_NO_BLOCK_FORM = {"mxfp4": _FP4_MISSING, "nvfp4": _FP4_MISSING,
                  "mxfp6_e3m2": "ONNX has no 6-bit float element type",
                  "mxfp6_e2m3": "ONNX has no 6-bit float element type",
                  "nf4": "ONNX has no NF4 element type (16 levels read from a table)"}


class _BlockWeightDQ(nn.Module):
    """An MXFP8 weight with its weight: the element codes as FLOAT8 values, blocked along
    each row (the weight's trailing dims flattened), dequantized by ``qcompile_onnx::dq``
    with float32 scales, the E8M0 powers of two (NaN for a NaN block), exact."""

    def __init__(self, fq: FakeQuantize, weight: torch.Tensor) -> None:
        super().__init__()
        assert fq.block_format is not None and fq.group_size is not None
        self.shape = tuple(weight.shape)
        rows = self.shape[0] if weight.dim() > 1 else 1
        codes = quantize_blocks(weight.detach().contiguous(), fq.block_format, fq.group_size)
        self.fmt = _BLOCK_ELEMENTS[fq.block_format]
        self.axis, self.block = 1, int(fq.group_size)
        scale = codes.scales.reshape(rows, -1).view(torch.float8_e8m0fnu).float()
        self.register_buffer("q", codes.codes.reshape(rows, -1).view(_FP8[self.fmt]))
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", torch.zeros(scale.shape, dtype=torch.int8))

    def forward(self) -> torch.Tensor:
        w = _ops().dq(self.q, self.scale, self.zero_point, self.axis, self.block, self.fmt)
        return w.reshape(self.shape)


def _block_stand_in(gm: GraphModule, node: Node, fq: FakeQuantize) -> nn.Module:
    """A block-format quantizer's stand-in, or the ``QCompileError`` saying why it has no
    ONNX form onnxruntime runs (naming the layer, the format and what is missing)."""
    fmt = fq.block_format
    weight = _weight_input(gm, node)
    what = f"weight {node.args[0].target!r}" if weight is not None else \
        f"quantizer {layer_of(node) or node.target!r}"
    where = f"export_onnx: {what} (graph node {node.name!r})"
    if weight is None or not weight.is_floating_point():
        what = ("its weight through a view (a transposed or 3-D weight)" if fq.weight else
                "an activation, whose block scales come from each input: the exponent of "
                "each block's maximum, read from the float's bits")
        raise QCompileError(f"{where}: the {fmt} quantizer (blocks of {fq.group_size}) "
                            f"quantizes {what}, which has no ONNX form here",
                            fix="quantize it with an integer or fp8 scheme in the spec, or "
                            "deploy the graph from qc.convert (it keeps block-format "
                            "activations simulated)")
    if fmt not in _BLOCK_ELEMENTS:
        raise QCompileError(f"{where} is {fmt} (blocks of {fq.group_size}), which has no "
                            f"ONNX form onnxruntime runs: {_NO_BLOCK_FORM[fmt]}",
                            fix=f"give this layer mxfp8_e4m3 / mxfp8_e5m2 (a blocked FLOAT8 "
                            "DequantizeLinear) or int4 per_group in the spec for the ONNX "
                            f"file, or deploy the graph from qc.convert (it stores {fmt} in "
                            "its own bits)")
    return _BlockWeightDQ(fq, weight)


# -- building the twin ---------------------------------------------------------------------
def _weight_input(gm: GraphModule, node: Node) -> torch.Tensor | None:
    """The tensor a quantizer node reads when it is a ``get_attr`` (a weight), else None."""
    arg = node.args[0] if node.args else None
    if not isinstance(arg, Node) or arg.op != "get_attr":
        return None
    value = gm
    for part in str(arg.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _stand_in(gm: GraphModule, node: Node, fq: FakeQuantize) -> nn.Module | None:
    """What replaces ``fq`` at ``node``: None for the identity (a disabled quantizer)."""
    if not fq.enabled:
        return None
    if fq.block_format is not None:
        return _block_stand_in(gm, node, fq)
    if fq.dynamic or fq.granularity == "per_token":
        return _DynamicQDQ(fq)
    weight = _weight_input(gm, node)
    if weight is not None and weight.is_floating_point():
        # the current qparams, as they are (a quantizer still observing is warned about)
        return _WeightDQ(fq, weight)
    if fq.granularity == "per_group":
        raise QCompileError(
            f"graph node {node.name!r} ({node.target}): a per-group activation quantizer "
            "has scales tied to the example batch size and no ONNX form",
            fix="quantize this activation per_tensor or per_channel in the spec")
    return _QDQ(fq)


def _drop_transfer(gm: GraphModule) -> None:
    """``pipeline.transfer: int8`` sends a quantizer's output across a cut as its integers
    (``pack``) and the next stage dequantizes them (``unpack``): the same values as the
    float itself, so the exported model (one device, no cut) keeps the float."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (pack, unpack):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()


def _rewrite(gm: GraphModule, observing: list[str]) -> None:
    """Replace every quantizer node of ``gm``'s own graph by its stand-in."""
    _drop_transfer(gm)
    # a quantizer whose output nothing reads (a layer's unused result) went with its node
    gm.delete_all_unused_submodules()
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        fq = gm.get_submodule(str(node.target))
        if not isinstance(fq, FakeQuantize):
            continue
        if fq.observe and fq.enabled and fq.observer is not None and not fq.dynamic \
                and fq.granularity != "per_token":
            observing.append(str(node.target))
        module = _stand_in(gm, node, fq)
        if module is None:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            gm.delete_submodule(str(node.target))
            continue
        owner, _, leaf = str(node.target).rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, leaf, module)
        node.kwargs = {}  # overwrite=True (passes.overwrite_inputs) is FakeQuantize's alone
        if isinstance(module, (_WeightDQ, _BlockWeightDQ)):
            weight = node.args[0]
            node.args = ()
            if not weight.users:
                gm.graph.erase_node(weight)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _twin(gm: nn.Module) -> nn.Module:
    """A copy of ``gm`` whose quantizers are the carrier ops (every GraphModule in it, so
    pipeline stages too), in eval mode."""
    twin = copy.deepcopy(gm).eval()
    observing: list[str] = []
    with torch.no_grad():
        for module in list(twin.modules()):
            if isinstance(module, GraphModule):
                _rewrite(module, observing)
    for name, module in twin.named_modules():
        if isinstance(module, FakeQuantize):
            raise QCompileError(
                f"quantizer {name!r} is not called from a graph node, so it has no ONNX form",
                fix="compile the model with qcompile so that quantizers are graph nodes")
    if observing:
        warnings.warn(f"export_onnx: {len(observing)} quantizer(s) still observe (e.g. "
                      f"{observing[0]}); the file holds their current qparams, which the "
                      "graph's next forward would update. Call qc.freeze(gm) first.",
                      stacklevel=3)
    return twin


# -- ONNX translations ---------------------------------------------------------------------
def _require_onnx() -> tuple[Any, Any]:
    """``(onnxscript, onnxscript.ir)``, or the error naming the extra."""
    try:
        importlib.import_module("onnx")
        onnxscript = importlib.import_module("onnxscript")
        return onnxscript, importlib.import_module("onnxscript.ir")
    except ImportError as e:
        raise QCompileError(f"ONNX export needs the onnx and onnxscript packages ({e})",
                            fix=f"{_EXTRA} (onnx, onnxscript, onnxruntime)") from None


def _translations(onnxscript: Any, ir: Any) -> dict[Callable, Callable]:
    """The custom_translation_table: each carrier op as opset-21 ONNX ops."""
    op = onnxscript.opset21
    types = {"int8": ir.DataType.INT8, "uint8": ir.DataType.UINT8,
             "int4": ir.DataType.INT4, "uint4": ir.DataType.UINT4,
             "int16": ir.DataType.INT16, "uint16": ir.DataType.UINT16,
             "fp8_e4m3": ir.DataType.FLOAT8E4M3FN, "fp8_e5m2": ir.DataType.FLOAT8E5M2}
    full = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767),
            "uint16": (0, 65535)}

    def const(value: float, to: Any) -> Any:
        return op.Cast(op.Constant(value_float=float(value)), to=to)

    def clip(q: Any, quant_min: int, quant_max: int, fmt: str) -> Any:
        # QuantizeLinear saturates to the container's range; a narrower quantizer range
        # (x86's 7-bit activations, int2..int7) is the same clamp on the integers
        if fmt not in full or full[fmt] == (quant_min, quant_max):
            return q
        return op.Clip(q, const(quant_min, types[fmt]), const(quant_max, types[fmt]))

    def broadcastable(t, x, axis: int):
        if len(t.shape) == 0:
            return t
        shape = [1] * len(x.shape)
        shape[axis] = -1
        return op.Reshape(t, op.Constant(value_ints=shape))

    def qdq(x, scale, zero_point, quant_min: int, quant_max: int, axis: int, fmt: str):
        shaped = op.CastLike(broadcastable(scale, x, axis), x)  # before CastLike: known shape
        scale = op.CastLike(scale, x)
        zp = op.Cast(zero_point, to=types[fmt])
        if fmt.startswith("fp8"):
            # onnxruntime's ReluQuantFusion deletes a Relu feeding a QuantizeLinear whose
            # zero point is 0, which is wrong for fp8 (negatives are representable): so fp8
            # divides first (the same IEEE division) and quantizes with a unit scale
            zero = op.Cast(op.Constant(value_float=0.0), to=types[fmt])
            one = op.CastLike(op.Constant(value_float=1.0), x)
            q = op.QuantizeLinear(op.Div(x, shaped), one, zero)
            return op.DequantizeLinear(q, scale, axis=axis)
        q = clip(op.QuantizeLinear(x, scale, zp, axis=axis), quant_min, quant_max, fmt)
        return op.DequantizeLinear(q, scale, zp, axis=axis)

    def dq(q, scale, zero_point, axis: int, block: int, fmt: str):
        t = types[fmt]
        if fmt.startswith("fp8"):  # a float8 zero point can only be 0: left out
            return op.DequantizeLinear(op.Cast(q, to=t), scale, axis=axis, block_size=block)
        return op.DequantizeLinear(op.Cast(q, to=t), scale, op.Cast(zero_point, to=t),
                                   axis=axis, block_size=block)

    def dynamic_qdq(x, quant_min: int, quant_max: int, symmetric: bool, per_token: bool):
        if (quant_min, quant_max) == (0, 255) and not symmetric and not per_token:
            y, scale, zp = op.DynamicQuantizeLinear(x)
            return op.DequantizeLinear(y, scale, zp)
        xf = op.Cast(x, to=ir.DataType.FLOAT)
        scale, zp = dynamic_qparams(xf, quant_min, quant_max, symmetric, per_token)
        if per_token:  # one scale per row: float arithmetic, the same formula
            q = op.Clip(op.Add(op.Round(op.Div(xf, scale)), zp),
                        op.Constant(value_float=float(quant_min)),
                        op.Constant(value_float=float(quant_max)))
            return op.CastLike(op.Mul(op.Sub(q, zp), scale), x)
        fmt = "int8" if quant_min < 0 else "uint8"
        fmt = fmt if max(abs(quant_min), quant_max) <= 255 else fmt.replace("8", "16")
        zq = op.Cast(zp, to=types[fmt])
        q = clip(op.QuantizeLinear(xf, scale, zq), quant_min, quant_max, fmt)
        return op.CastLike(op.DequantizeLinear(q, scale, zq), x)

    def dynamic_qparams(xf, quant_min: int, quant_max: int, symmetric: bool, per_token: bool):
        axes = op.Constant(value_ints=[-1]) if per_token else None
        keep = 1 if per_token else 0
        zero = op.Constant(value_float=0.0)
        mn = op.Min(op.ReduceMin(xf, axes, keepdims=keep), zero)
        mx = op.Max(op.ReduceMax(xf, axes, keepdims=keep), zero)
        eps = op.Constant(value_float=float(torch.finfo(torch.float32).eps))
        if symmetric:
            mid = 0 if quant_min < 0 else (quant_min + quant_max + 1) // 2
            steps = op.Constant(value_float=float(min(quant_max - mid, mid - quant_min)))
            scale = op.Max(op.Div(op.Max(op.Neg(mn), mx), steps), eps)
            return scale, op.Constant(value_float=float(mid))
        span = op.Constant(value_float=float(quant_max - quant_min))
        scale = op.Max(op.Div(op.Sub(mx, mn), span), eps)
        lo = op.Constant(value_float=float(quant_min))
        zp = op.Clip(op.Sub(lo, op.Round(op.Div(mn, scale))), lo,
                     op.Constant(value_float=float(quant_max)))
        return scale, zp

    ops = _ops()
    return {ops.qdq.default: qdq, ops.dq.default: dq, ops.dynamic_qdq.default: dynamic_qdq}


# -- export --------------------------------------------------------------------------------
def _batch_inputs(model: nn.Module, args: tuple, kwargs: dict, dynamic: bool
                  ) -> tuple[tuple, dict, Any]:
    """Inputs to trace with, and their dynamic shapes: dim 0 of every tensor, one shared
    ``batch`` dim for the tensors whose dim 0 is the first tensor's, a dim of its own for
    any other (``EmbeddingBag``'s indices and offsets differ in length). torch.export
    specialises sizes 0 and 1, so a batch of 1 is traced as a batch of 2 (the values do
    not matter to the exported graph)."""
    if not dynamic:
        return args, kwargs, None
    batch = torch.export.Dim("batch")

    def widen(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 1:
            return v.expand(2, *v.shape[1:]).clone()
        return v

    args = tuple(widen(v) for v in args)
    kwargs = {k: widen(v) for k, v in kwargs.items()}
    first = next((v.shape[0] for v in (*args, *kwargs.values())
                  if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    own = itertools.count(1)

    def dims(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return None
        return {0: batch if v.shape[0] == first else torch.export.Dim(f"dim0_{next(own)}")}

    shapes: Any = tuple(dims(v) for v in args)
    if kwargs:  # torch.export then wants every input's dims by forward() parameter name
        names = list(inspect.signature(model.forward).parameters)
        shapes = {**dict(zip(names, shapes)), **{k: dims(v) for k, v in kwargs.items()}}
    return args, kwargs, shapes


def _fold_weight_casts(program: Any, onnxscript: Any) -> None:
    """Fold the ``Cast`` of each stored integer weight into a typed initializer (INT4,
    UINT16...), whatever its size: the optimizer's default size limit would keep int8
    storage plus a Cast node."""
    onnxscript.optimizer.fold_constants(
        program.model, should_fold=lambda node: True if node.op_type == "Cast" else None)
    onnxscript.optimizer.remove_unused_nodes(program.model)


# the ops onnxruntime's QDQPropagationTransformer moves Q/DQ pairs across
_PROPAGATING = ("MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice")


def _int8_qparams(node: Any, ir: Any) -> tuple[Any, Any] | None:
    """``(scale, zero_point)`` of a QuantizeLinear / DequantizeLinear with constant scalar
    qparams and an INT8 zero point (what onnxruntime's int8 -> uint8 rewrite touches)."""
    if node is None or node.op_type not in ("QuantizeLinear", "DequantizeLinear") \
            or len(node.inputs) < 3:
        return None
    scale, zp = node.inputs[1], node.inputs[2]
    if scale is None or zp is None or zp.dtype != ir.DataType.INT8:
        return None
    if any(v.const_value is None or v.const_value.size != 1 for v in (scale, zp)):
        return None
    return scale, zp


def _requantize(graph: Any, ir: Any, after: Any, value: Any, scale: Any, zp: Any,
                clip: Any) -> Any:
    """Q (-> the same Clip) -> DQ of ``value`` with the given qparams, inserted after
    node ``after``; returns the DQ's output."""
    q = ir.Node("", "QuantizeLinear", [value, scale, zp])
    nodes = [q]
    out = q.outputs[0]
    if clip is not None:
        nodes.append(ir.Node("", "Clip", [out, *clip.inputs[1:]]))
        out = nodes[-1].outputs[0]
    nodes.append(ir.Node("", "DequantizeLinear", [out, scale, zp]))
    graph.insert_after(after, nodes)
    return nodes[-1].outputs[0]


def _pin_int8_pairs(model: Any, ir: Any) -> None:
    """Give every MaxPool / Reshape / Transpose / Squeeze / Unsqueeze / Slice that reads an
    int8 activation's DequantizeLinear a Q -> DQ pair of its own (the same qparams, and the
    same Clip), so that onnxruntime finds nothing to propagate: its propagation copies int8
    pairs across these ops, and its int8 -> uint8 rewrite then leaves each copy's output
    typed INT8 with a UINT8 zero point, and the session refuses the file. Exact: these ops
    commute with the (monotone, elementwise) quantization, and re-quantizing values already
    on the grid returns them unchanged."""
    graph = model.graph
    for node in list(graph):
        if node.op_type not in _PROPAGATING or not node.inputs or node.inputs[0] is None:
            continue
        dq = node.inputs[0].producer()
        qp = _int8_qparams(dq, ir)
        if qp is None or dq.op_type != "DequantizeLinear" or dq.inputs[0] is None \
                or dq.inputs[0].const_value is not None:  # a weight: nothing propagates
            continue
        out = node.outputs[0]
        uses = list(out.uses())
        if not uses or out.is_graph_output() \
                or all(user.op_type == "QuantizeLinear" for user, _ in uses):
            continue
        before = dq.inputs[0].producer()
        clip = before if before is not None and before.op_type == "Clip" else None
        dq_out = _requantize(graph, ir, node, out, *qp, clip)
        for user, i in uses:
            user.replace_input_with(i, dq_out)


def _unfuse_per_channel_matmul(model: Any, ir: Any) -> None:
    """Write a per-channel activation's ``DequantizeLinear`` that feeds a ``MatMul`` as its
    arithmetic, ``(Cast(q) - zero_point) * scale`` (the zero point and scale reshaped along
    the axis), for that MatMul only. onnxruntime fuses DequantizeLinear -> MatMul (a 3-D
    Linear exports as MatMul, not Gemm) into MatMulIntegerToFloat / QLinearMatMul, whose
    activation input takes one zero point only ("Per-Channel is not supported yet"): the
    session loads and then fails at run time. The same float32 operations, exact (what
    DequantizeLinear computes), fuse into nothing. QuantizeLinear with an ``axis`` stays
    (onnxruntime runs it), and so does every per-tensor pair."""
    graph = model.graph
    for node in list(graph):
        if node.op_type != "MatMul":
            continue
        for i, value in enumerate(node.inputs):
            dq = value.producer() if value is not None else None
            if dq is None or dq.op_type != "DequantizeLinear" or len(dq.inputs) < 3:
                continue
            q, scale, zp = dq.inputs[:3]
            if q is None or q.const_value is not None or scale is None or zp is None:
                continue  # a weight (constant integers): MatMul's B takes per-channel
            rank = len(q.shape) if q.shape is not None else None
            if scale.shape is None or len(scale.shape) == 0 or rank is None:
                continue  # per-tensor, or an unknown rank
            axis = dq.attributes.get("axis")
            axis = (axis.value if axis is not None else 1) % rank
            shape = [1] * rank
            shape[axis] = -1
            to = scale.dtype or ir.DataType.FLOAT
            dims = ir.Node("", "Constant", [],
                           attributes=[ir.AttrInt64s("value_ints", shape)])
            nodes = [dims,
                     ir.Node("", "Cast", [q], attributes=[ir.AttrInt64("to", to)]),
                     ir.Node("", "Cast", [zp], attributes=[ir.AttrInt64("to", to)])]
            nodes += [ir.Node("", "Reshape", [nodes[2].outputs[0], dims.outputs[0]]),
                      ir.Node("", "Reshape", [scale, dims.outputs[0]])]
            nodes.append(ir.Node("", "Sub", [nodes[1].outputs[0], nodes[3].outputs[0]]))
            nodes.append(ir.Node("", "Mul", [nodes[5].outputs[0], nodes[4].outputs[0]]))
            graph.insert_before(node, nodes)
            node.replace_input_with(i, nodes[-1].outputs[0])
            if not list(dq.outputs[0].uses()) and not dq.outputs[0].is_graph_output():
                graph.remove(dq, safe=True)


def _strip_trace_metadata(model: Any) -> None:
    """Drop the exporter's per-node debugging metadata (stack traces with local paths, fx
    node text): a third of a small model's file, and nothing a runtime reads. The
    ``namespace`` entry (which module a node came from) stays."""
    for node in model.graph.all_nodes():
        for key in [k for k in node.metadata_props if k.startswith("pkg.torch")]:
            del node.metadata_props[key]


# terminal colour codes torch.onnx puts into its messages ("\x1b[96m...\x1b[0m")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _conversion_error(e: Exception, twin: nn.Module) -> QCompileError:
    """The exporter's failure, naming the graph node whose op has no ONNX form when the
    message names an op (terminal colour codes removed)."""
    text = _ANSI.sub("", str(e))
    nodes = [f"{n.name} ({n.target})" for m in twin.modules() if isinstance(m, GraphModule)
             for n in m.graph.nodes if n.op == "call_function" and _named_in(n.target, text)]
    where = f"graph node {nodes[0]} has no ONNX form" if nodes else "the exporter failed"
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return QCompileError(
        f"export_onnx: {where}: {type(e).__name__}: {first}",
        fix="replace the op by ONNX-exportable torch ops, give it a torch.onnx translation, "
        "or keep it out of the quantized model")


def _named_in(target: Any, text: str) -> bool:
    name = getattr(target, "_name", None) or getattr(target, "__name__", None)
    if not isinstance(name, str) or name.startswith(("aten::", "qcompile_onnx::")):
        return False
    short = name.replace("::", ".")
    return name in text or short in text


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """The exporter's own log lines (skipped torchvision ops...) off for the call only."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _check_batch_dynamic(program: Any) -> None:
    """torch.onnx falls back to capture strategies that specialise shapes instead of
    failing: a batch that came out fixed is refused here, with the way to keep it."""
    fixed = [v.name for v in program.model.graph.inputs
             if v.shape is not None and len(v.shape) > 0 and isinstance(v.shape[0], int)]
    if fixed:
        raise QCompileError(
            f"export_onnx: the graph fixes the batch size of input(s) {fixed}, so the ONNX "
            "model could not take any batch",
            fix="compile with trace.dynamic_dims: {<input>: {0: batch}} (the torch.export "
            "front end otherwise specialises the batch), or pass dynamic_batch=False")


def _compiled(gm: nn.Module) -> nn.Module:
    """The graph ``qcompile`` returned, looking through wrappers that keep it as
    ``.module`` (DDP); a model qcompile never compiled is refused (its quantizers, if any,
    were never placed or observed by qcompile)."""
    inner = unwrap(gm)
    meta = getattr(inner, "meta", None)
    if not isinstance(inner, GraphModule) or not isinstance(meta, dict) \
            or REPORT_KEY not in meta:
        raise QCompileError(
            f"export_onnx: the model ({type(gm).__name__}) was not compiled by qcompile: it "
            "has no qcompile report, so nothing says how to quantize it",
            fix="pass the graph returned by qc.qcompile(model, spec, example_inputs=...) "
                "(calibrated or trained), not the original model")
    if any(p.name.startswith("convert.") for p in meta[REPORT_KEY].passes):
        raise QCompileError(
            "export_onnx: this graph is qc.convert's result: torch's quantized kernels "
            "(quantized::linear, packed weights), which the ONNX exporter cannot trace",
            fix="export the fake-quant graph itself (qc.qcompile's, after qc.calibrate or "
                "training): the QDQ file is what onnxruntime fuses into integer kernels")
    return inner


def _check_path(path: Any) -> Path:
    """``path`` as a ``Path``; anything but a string or path-like is refused by type."""
    if not isinstance(path, (str, os.PathLike)):
        raise QCompileError(f"export_onnx: path is a {type(path).__name__} ({path!r}), not "
                            "a file path", fix="pass a file path, e.g. 'model.onnx' or "
                            "pathlib.Path('out') / 'model.onnx'")
    return Path(path)


def _refuse_cast(gm: nn.Module) -> None:
    """A graph cast to a 16-bit float after compiling (``gm.to(torch.bfloat16)``,
    ``.half()``) while its float inputs were compiled as float32: the exporter traces the
    fake-quant arithmetic in float32 (the qparams stay float32), so it is refused, with
    the way to export it."""
    compiled = {i.dtype for i in graph_inputs(gm) if i.dtype is not None
                and i.dtype.is_floating_point}
    if torch.float32 not in compiled:
        return
    inside = tuple(f"{n}." for n, m in gm.named_modules() if isinstance(m, FakeQuantize))
    cast = next(((n, p.dtype) for n, p in gm.named_parameters()
                 if not n.startswith(inside) and p.dtype in (torch.bfloat16, torch.float16)),
                None)
    if cast is None:
        return
    name, dtype = cast
    shown = str(dtype).removeprefix("torch.")
    raise QCompileError(
        f"export_onnx: the graph itself was cast to {shown} after compiling (e.g. {name} is "
        f"{shown}; its inputs were compiled as float32): the QDQ file is exported from the "
        "float32 graph (its quantizers' qparams are float32 either way)",
        fix="export a float32 copy: qc.export_onnx(copy.deepcopy(gm).float(), path, "
            "example_inputs=(x.float(),)) (gm itself stays as it is)")


def _check_names(program: Any, input_names: list[str] | None,
                 output_names: list[str] | None) -> None:
    """More names than the exported graph has inputs / outputs: torch.onnx would drop
    the extra ones silently (the caller expects every name in the file)."""
    for what, names, values in (("input", input_names, program.model.graph.inputs),
                                ("output", output_names, program.model.graph.outputs)):
        if names is None:
            continue
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise QCompileError(f"export_onnx: {what}_names must be a list of strings, got "
                                f"{names!r}", fix=f"pass {what}_names=[...], one name per "
                                f"{what}")
        if len(names) > len(values):
            extra = ", ".join(repr(n) for n in names[len(values):])
            raise QCompileError(
                f"export_onnx: {what}_names gives {len(names)} names, but the graph has "
                f"{len(values)} {what}(s): {extra} name(s) nothing",
                fix=f"give at most one name per {what} ({len(values)}), in the order of the "
                    f"graph's {what}s")


def _refuse_uncalibrated(gm: nn.Module) -> None:
    """Activation quantizers with placeholder qparams would be written as real ones."""
    mode = gm.meta[REPORT_KEY].mode
    missing = uncalibrated(gm, mode)
    if missing:
        fix = ("run qc.calibrate(gm, batches) first" if mode == "static" else
               "train it for some steps first (observers learn ranges in train mode; a "
               "training step's observations take effect after optimizer.step()), then "
               "qc.freeze(gm)")
        raise QCompileError(f"export_onnx: {len(missing)} activation quantizer(s) have no "
                            f"ranges yet (their qparams are placeholders), e.g. {missing[0]}",
                            fix=fix)


def _check_target(path: Path) -> None:
    """Refuse a path the file cannot be written to, before the (long) export."""
    if path.is_dir():
        raise QCompileError(f"export_onnx: {str(path)!r} is a folder",
                            fix=f"give a file path, e.g. {str(path / 'model.onnx')!r}")
    folder = path.parent
    if not folder.is_dir():
        raise QCompileError(f"export_onnx: the folder {str(folder)!r} of {str(path)!r} does "
                            "not exist", fix=f"create it first (os.makedirs({str(folder)!r}))"
                            " or write into an existing folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise QCompileError(f"export_onnx: the folder {str(folder)!r} is not writable",
                            fix="write into a folder you may write to")


def _example(example_inputs: Any, example_kwargs: dict[str, Any] | None
             ) -> tuple[tuple, dict]:
    """``(args, kwargs)``: one tensor is one input (as ``qc.calibrate`` takes it), a dict
    is keyword inputs."""
    kwargs = dict(example_kwargs or {})
    if example_inputs is None:
        args: tuple = ()
    elif isinstance(example_inputs, torch.Tensor):
        args = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    elif isinstance(example_inputs, dict) and not kwargs:
        args, kwargs = (), dict(example_inputs)
    else:
        raise QCompileError(
            f"export_onnx: example_inputs is a {type(example_inputs).__name__}",
            fix="pass a tensor, a tuple of the model's positional inputs, or "
                "example_kwargs={name: tensor}")
    if not args and not kwargs:
        raise QCompileError("export_onnx needs example inputs to trace the graph",
                            fix="pass example_inputs=(x,) (or example_kwargs)")
    return args, kwargs


def _mismatch(args: tuple, kwargs: dict, sig: list[GraphInput]) -> str:
    """The first input whose dtype, rank or non-batch dims differ from the compiled ones."""
    by_name = {i.name: i for i in sig}
    given = [(i.name, v) for i, v in zip(sig, args)] + [
        (k, v) for k, v in kwargs.items() if k in by_name]
    for name, v in given:
        want = by_name[name]
        if not isinstance(v, torch.Tensor) or want.shape is None or want.dtype is None:
            continue
        if v.dtype != want.dtype or v.dim() != len(want.shape) \
                or tuple(v.shape[1:]) != tuple(want.shape[1:]):
            got = f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
            return f"example input {name!r} is {got}, but the graph was compiled for {want}"
    return ""


def _check_fit(twin: nn.Module, gm: nn.Module, args: tuple, kwargs: dict) -> None:
    """Run the twin on the example inputs (it computes what the file will): inputs that do
    not fit the graph are named here, not as an op the exporter could not convert."""
    sig = graph_inputs(gm)
    names = [i.name for i in sig if not i.variadic]
    unknown = [k for k in kwargs if sig and not any(i.variadic for i in sig)
               and k not in names]
    if unknown:
        raise QCompileError(f"export_onnx: example_kwargs names {unknown[0]!r}, which is not "
                            f"an input of the graph ({', '.join(names)})",
                            fix="name the inputs as the model's forward() does")
    if sig and not any(i.variadic for i in sig) and len(args) > len(sig):
        raise QCompileError(f"export_onnx: example_inputs has {len(args)} values, but the "
                            f"graph takes {len(sig)} input(s): {', '.join(names)}",
                            fix="pass only the model's inputs (not the targets)")
    try:
        with torch.no_grad(), quiet_fx_trace():
            twin(*args, **kwargs)
    except QCompileError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        what = _mismatch(args, kwargs, sig) or (
            f"example_inputs ({describe(args, kwargs, names)}) do not fit the graph, compiled "
            f"for ({', '.join(map(str, sig)) or 'other inputs'})")
        raise QCompileError(
            f"export_onnx: {what} ({type(e).__name__}: {first})",
            fix="pass example inputs shaped like those the graph was compiled with (same "
                "dtypes, same non-batch dimensions; any batch size)") from None


def _save(model: Any, ir: Any, path: Path) -> None:
    """Write the model whole or not at all (``qcompile.files``): the bytes go to a private
    temporary folder beside ``path``, are fsynced, get the user's umask and are moved into
    place, so an interrupted export leaves the previous file as it was. A model too large
    for one protobuf keeps its initializers in ``<name>.data`` beside it: ``ir.save`` writes
    both (and its own temporary for the data) into that folder, then they are moved, data
    first."""
    size = sum(v.const_value.nbytes for v in model.graph.initializers.values()
               if v.const_value is not None)
    if size <= _EXTERNAL_DATA_BYTES:
        write_atomically(path, ir.to_proto(model).SerializeToString())
        return
    data = path.with_name(f"{path.name}.data")
    with atomic_paths(data, path) as (_, tmp):
        ir.save(model, tmp, external_data=data.name)


def export_onnx(
    gm: nn.Module,
    path: str | Path,
    example_inputs: Any = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    dynamic_batch: bool = True,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
) -> Path:
    """Write ``gm`` (a graph from ``qcompile``) as a QDQ ONNX model (opset 21) to ``path``
    and return the path. ``example_inputs`` (a tensor or a tuple of positional inputs) and
    ``example_kwargs`` (keyword inputs) are traced (any batch size); with
    ``dynamic_batch`` dim 0 of every input is the symbolic ``batch``.

    Refused before anything is traced or written: a model qcompile did not compile (or
    ``qc.convert``'s result), a graph whose activation quantizers never saw data (static
    before ``qc.calibrate``, QAT before training), a graph cast to bfloat16 / float16
    after compiling (export a ``.float()`` copy), inputs that do not fit the graph, a path
    that is not a path, a folder that does not exist; after tracing, before writing:
    more ``input_names`` / ``output_names`` than the graph has inputs / outputs.
    The file is written atomically: an interrupted export leaves the previous one.
    Quantizers that still observe (QAT before ``qc.freeze``) are written with their
    current qparams, with a warning. For a graph whose stages ``qc.distributed.pipeline``
    spread over ranks every rank calls it: each stage's trained state reaches the others'
    copies first (``qcompile.deploy.stages.share_stages``), every rank makes the checks,
    and the pipeline's lowest rank traces and writes."""
    graph = _compiled(gm)
    if getattr(graph, "meta", {}).get(TP_SHARDED_KEY):
        raise QCompileError(
            "export_onnx: this graph's layers are sharded across tensor-parallel ranks (each "
            "rank holds rows or columns of their weights)",
            fix="export an unsharded copy: on every rank sd = get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) "
            "(torch.distributed.checkpoint.state_dict); on rank 0 load sd into the graph "
            "qc.qcompile returns for the same spec and export that")
    refuse_adapters(graph, "export_onnx")
    refuse_sharded_stage(graph, "export_onnx")
    path = _check_path(path)
    if spread(graph) is not None:  # every rank: the stages' trained state first
        agree_and_share(graph, graph, "export_onnx", {"path": str(path)},
                        lambda: _check_target(path) if writes_here(graph) else None)
    refuse_pending(graph, "export_onnx")
    onnxscript, ir = _require_onnx()
    args, kwargs = _example(example_inputs, example_kwargs)
    if writes_here(graph):
        _check_target(path)
    _refuse_uncalibrated(graph)
    _refuse_cast(graph)
    twin = _twin(graph)
    _check_fit(twin, graph, args, kwargs)
    if spread(graph) is None:
        return _export(twin, path, args, kwargs, dynamic_batch=dynamic_batch,
                       names=(input_names, output_names), libs=(onnxscript, ir))
    # a pipeline's lowest rank traces and writes; then every rank learns how that went
    refusal = None
    if writes_here(graph):
        try:
            _export(twin, path, args, kwargs, dynamic_batch=dynamic_batch,
                    names=(input_names, output_names), libs=(onnxscript, ir))
        except QCompileError as e:
            refusal = e
    agree_to_gather(graph, "export_onnx", {"written": True}, refusal)
    return path


def _export(twin: nn.Module, path: Path, args: tuple, kwargs: dict[str, Any], *,
            dynamic_batch: bool, names: tuple[Any, Any], libs: tuple[Any, Any]) -> Path:
    """Trace ``twin`` with torch.onnx (dynamo) and write the model to ``path``."""
    onnxscript, ir = libs
    input_names, output_names = names
    args, kwargs, shapes = _batch_inputs(twin, args, kwargs, dynamic_batch)
    table = _translations(onnxscript, ir)
    try:
        with warnings.catch_warnings(), _quiet("torch.onnx"):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                twin, args, kwargs=kwargs or None, dynamo=True, opset_version=OPSET,
                dynamic_shapes=shapes, custom_translation_table=table, verbose=False,
                input_names=input_names, output_names=output_names)
    except Exception as e:
        raise _conversion_error(e, twin) from e
    _check_names(program, input_names, output_names)
    if shapes is not None:
        _check_batch_dynamic(program)
    _fold_weight_casts(program, onnxscript)
    _pin_int8_pairs(program.model, ir)
    _unfuse_per_channel_matmul(program.model, ir)
    _strip_trace_metadata(program.model)
    _save(program.model, ir, path)
    return path
