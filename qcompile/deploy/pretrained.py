"""A Hugging Face checkpoint in the compressed-tensors format, out of a compiled causal LM.

``save_pretrained(gm, directory, config=hf_config)`` writes two files into ``directory``:
``config.json``, the model's transformers config with a compressed-tensors
``quantization_config`` (``config_groups`` per scheme, ``ignore`` for the linear layers left
float), and ``model.safetensors``, whose quantized weights are compressed by the
``compressed-tensors`` package's own compressors (the ones llm-compressor saves with).
``AutoModelForCausalLM.from_pretrained(directory)`` loads it through transformers'
compressed-tensors integration, on CPU too: it decompresses the weights on the first forward
and applies the activation quantization the config describes.

What each weight quantizer becomes (``quantization_config.config_groups[*].weights``):

- ``int2`` ... ``int8`` / ``uint*`` (symmetric or not, learned scales too), per tensor, per
  channel (output rows) or per group along the input: ``type: int``, ``num_bits`` the
  range's width, strategy ``tensor`` / ``channel`` / ``group``; packed into int32
  (``pack-quantized``), int8 with input activations ``int-quantized``. Codes are stored
  relative to compressed-tensors' signed range (an unsigned or 7-bit range is the same
  grid shifted; the zero points shift with it).
- ``fp8_e4m3`` per tensor / channel / group: ``type: float``, 8 bits (``float-quantized``).
- ``nvfp4``: ``NVFP4A16``'s weights (``nvfp4-pack-quantized``: FP4 codes, E4M3 block scales
  of 16, a float32 ``weight_global_scale`` = 1 / the graph's tensor scale).
- ``mxfp4`` / ``mxfp6_e2m3`` / ``mxfp8_e4m3``: ``MXFP4A16`` / ``MXFP6A16`` / ``MXFP8A16``'s
  weights (blocks of 32, E8M0 scales).

And each activation quantizer (``input_activations`` / ``output_activations`` of the layer
whose input or output it quantizes): per-token or per-tensor dynamic, asymmetric integers
(``dynamic: true``, strategy ``token`` / ``tensor``: ``8da4w-qat``, ``w4a8-qat``,
``int8-dynamic``); static per-tensor integers with their calibrated ``input_scale`` /
``input_zero_point`` (or ``output_*``); fp8 E4M3, static or dynamic per token / tensor.

The stored codes and scales are the graph's: each layer is compressed from its
fake-quantized weight (the values the graph's next forward computes, a quantizer still
observing its weight included) and the graph's own scales, so compressed-tensors' rounding
finds the graph's codes again; the compression is decompressed once more and compared
before anything is written. Integer and fp8 weights with their float32 scales, and MX
weights (power-of-two scales), dequantize bit for bit to the graph's fake-quantized
weights. NVFP4 codes and scales are exact too, but compressed-tensors decompresses NVFP4
in bfloat16 (``block scale / global scale`` in float32, the product rounded to bfloat16):
the loaded weights are the graph's to bfloat16 precision. Scales are stored in float32;
transformers' default path loads them in the model's dtype, so a bfloat16 model's
weights are within a couple of bfloat16 units in the last place of the graph's
(``dequantize=True`` decompresses from the file's float32 scales: bit for bit). Dynamic
activations compute what the graph computes (its zero point may differ only on a
half-way tie), so the loaded model's logits are the graph's, activation quantization
included, for every layer transformers quantizes: it does not quantize the inputs of
fused experts (vLLM does).

Loading with transformers (5.x, compressed-tensors 0.20): the default path needs
``quantization_config=CompressedTensorsConfig(dequantize=True)`` for asymmetric packed
integer weights (compressed-tensors packs their zero points in the file but expects them
unpacked at load) and for NVFP4 / MX weights in a float32 model (they decompress to
bfloat16); ``dequantize=True`` loads the weights alone, without activation quantization,
and decompresses every layer with one scheme (a checkpoint mixing schemes loads by the
default path).

A quantized weight of a module compressed-tensors cannot hold (an embedding, a
mixture-of-experts router that is not an ``nn.Linear``) is written as its fake-quantized
values, in the parameter's dtype: exact, not compressed. Fused experts (transformers'
``experts.gate_up_proj`` / ``down_proj``) are written per expert, as transformers' own
``save_pretrained`` lays them out (``revert_weight_conversion``), each compressed as one
linear layer. A tied head and embedding holding different values are written apart, and
the config says ``tie_word_embeddings: false``.

Refused before anything is written (``QCompileError`` naming the layer or field and the
fix): a scheme compressed-tensors has no format for (llama.cpp's grids: use
``qc.export_gguf``; NF4; ``fp8_e5m2``; other MX element types; integer widths over 8;
per-channel weights along another axis); an activation quantizer compressed-tensors cannot
describe (one on an op that is not a compressed layer's input or output, symmetric
dynamic integers, per-channel activations, MX / NVFP4 activations: their scales come from
each tensor with formulas compressed-tensors does not share); static activations never
calibrated; what transformers' loader would not load right (fused experts float next to
compressed layers, or other than symmetric integers without int8 inputs or fp8;
asymmetric packed weights next to another scheme); unmerged
LoRA adapters (``qc.merge_adapters`` first); pending algorithms; one pipeline stage's
graph on its own; weights sharded other than by ``qc.distributed.wrap`` /
``compile_once`` / ``qc.distributed.pipeline`` or on the meta device; a config that does
not describe the graph; an output path that is a file or a non-empty directory. The
directory is written atomically (a private temporary folder beside it, renamed into
place); the graph is never modified (but for the stage copies of a pipeline, below).

A graph ``qc.distributed.wrap`` (or ``compile_once``) sharded for tensor parallelism, FSDP2
or both is saved by every rank together (FSDP2's blocks, a child graph each, read as one
graph): the ranks first agree on the call (the model, ``directory``, ``config``; a call
made on some ranks only or with other arguments is one ``QCompileError`` on every rank,
before any collective), then each sharded weight is gathered whole (``full_tensor()``)
when its layer's turn comes, one layer at a time, and compressed as one process would;
rank 0 writes the directory (the same files as one process saving the unsharded graph),
the other ranks return its path.

A graph placed in pipeline stages is read as one graph. Under ``qc.distributed.pipeline``
(pp, pp x dp, pp x tp), every rank saves it together: after the agreement each stage's
trained state goes from the rank that trained it to the other ranks' (untrained) copies
of that stage, one tensor at a time (``qcompile.deploy.stages.share_stages``), and the pipeline's
lowest rank writes what one process would write for the trained model.

Example:
    >>> import json, os, tempfile, torch, transformers, qcompile as qc
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
    ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg)
    >>> ids = torch.randint(0, 64, (1, 8))
    >>> gm = qc.qcompile(model, "w8-weight-only", example_kwargs={"input_ids": ids})
    >>> out = qc.save_pretrained(gm, os.path.join(tempfile.mkdtemp(), "ckpt"), config=cfg)
    >>> sorted(os.listdir(out))
    ['config.json', 'model.safetensors']
    >>> qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    >>> qcfg["format"], qcfg["config_groups"]["group_0"]["weights"]["strategy"]
    ('pack-quantized', 'channel')
"""

from __future__ import annotations

import bisect
import copy
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.deploy.adapters import unwrap
from qcompile.deploy.whole_graph import (
    VIEWS,
    agree_and_share,
    call_name,
    config_fingerprint,
    describe_scheme,
    gathered,
    is_sharded,
    sharded_linear,
    view_paths,
    weight_reads,
    weight_sites,
    whole_graph,
    writes_here,
)
from qcompile.errors import QCompileError
from qcompile.files import (
    atomic_paths,
    remove_stale_temporaries,
    sync_folder,
    temp_prefix,
    temporary_folder,
    unmark,
)
from qcompile.graph.meta import ROOT_CLASS_KEY
from qcompile.graph.records import report
from qcompile.runtime.block_formats import FORMATS, block_scales, quantize_blocks
from qcompile.runtime.calibration import (
    apply_view,
    refuse_nonfinite,
    uncalibrated,
)
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.quant_math import FP8_DTYPES
from qcompile.runtime.sharded import whole_quantizer

try:  # the [hf] extra; save_pretrained says how to install it
    import compressed_tensors
    import transformers
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from transformers.core_model_loading import revert_weight_conversion
except ImportError:
    compressed_tensors = None

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "save_pretrained"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WHERE = "save_pretrained"

#: qcompile's block formats -> the compressed-tensors preset whose weights are the same
#: format (its element type, block and scale encoding)
BLOCK_PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16", "mxfp6_e2m3": "MXFP6A16",
                 "mxfp8_e4m3": "MXFP8A16"}


def _require() -> None:
    if compressed_tensors is None:
        raise QCompileError(f"{WHERE} needs the compressed-tensors and transformers packages",
                            fix="pip install 'qcompile[hf]'")


# -- the graph, the target, the config -----------------------------------------------------
def _graph(gm: nn.Module) -> GraphModule:
    """The compiled graph (see ``whole_graph``)."""
    return whole_graph(gm, WHERE, holds="a checkpoint", preset="w8-weight-only", verb="save")


def _checked(graph: GraphModule, directory: str | os.PathLike[str], *, writes: bool) -> Path:
    """The output directory (checked where this rank writes), the graph's parameters
    finite (a tensor-parallel shard: this rank's part; no collective)."""
    refuse_nonfinite(dict(graph.named_parameters()), WHERE)
    return _target(directory) if writes else Path(directory)


def _target(directory: str | os.PathLike[str]) -> Path:
    target = Path(directory)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise QCompileError(f"{WHERE}: {str(directory)!r} exists and is not a directory",
                            fix="give the path of a new (or empty) directory")
    if target.is_dir() and any(target.iterdir()):
        raise QCompileError(f"{WHERE}: directory {str(directory)!r} is not empty; a "
                            "checkpoint never mixes with other files",
                            fix="give a new directory, or empty this one first")
    if not target.parent.is_dir():
        raise QCompileError(f"{WHERE}: directory {str(target.parent)!r} does not exist",
                            fix="create it first or save somewhere else")
    return target


def _config(config: Any) -> Any:
    """A copy of ``config`` as a transformers config, without a quantization config of its
    own (the checkpoint's replaces it)."""
    if config is None:
        raise QCompileError(f"{WHERE}: no config: a compiled graph does not keep the Hugging "
                            "Face config, and config.json is made of it",
                            fix="pass config=model.config (the transformers config of the "
                            "model you compiled)")
    if isinstance(config, transformers.PretrainedConfig):
        cfg = copy.deepcopy(config)
    elif isinstance(config, Mapping):
        fields = dict(config)
        kind = fields.pop("model_type", None)
        if not isinstance(kind, str):
            raise QCompileError(f"{WHERE}: config has no model_type",
                                fix="pass the transformers config (model.config) or its "
                                "to_dict()")
        cfg = transformers.AutoConfig.for_model(kind, **fields)
    else:
        raise QCompileError(f"{WHERE}: config is a {type(config).__name__}",
                            fix="pass the transformers config (model.config) or its dict")
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return cfg


def _model_params(graph: GraphModule, *, remove_duplicate: bool = True
                  ) -> dict[str, nn.Parameter]:
    """The model's parameters in the graph: a quantizer's own (a learned LSQ scale) are
    not the model's."""
    owned = {n for n, m in graph.named_modules() if isinstance(m, FakeQuantize)}
    return {n: p for n, p in graph.named_parameters(remove_duplicate=remove_duplicate)
            if n.rpartition(".")[0] not in owned}


def _skeleton(cfg: Any, graph: GraphModule) -> nn.Module:
    """The transformers model of ``cfg`` on the meta device (names, module types and the
    checkpoint layout, no memory), checked against the graph: the class it was compiled
    from, every parameter's name and shape."""
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError) as e:
        raise QCompileError(f"{WHERE}: transformers has no causal LM for config model_type "
                            f"{cfg.model_type!r} ({e})",
                            fix="pass the config of the causal LM you compiled") from None
    root = graph.meta.get(ROOT_CLASS_KEY)
    if isinstance(root, type) and root.__name__ != type(model).__name__:
        raise QCompileError(f"{WHERE}: the graph was compiled from a {root.__name__}, the "
                            f"config describes a {type(model).__name__}",
                            fix="pass the config of the model you compiled (model.config)")
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    for name, p in _model_params(graph).items():
        if shapes.get(name) != p.shape:
            have = "no such parameter" if name not in shapes else list(shapes[name])
            raise QCompileError(f"{WHERE}: the graph's {name} {list(p.shape)} does not match "
                                f"the config's model ({have})",
                                fix="pass the config of the model you compiled")
    return model


# -- schemes ---------------------------------------------------------------------------------
def _refuse(what: str, fq: FakeQuantize, why: str, fix: str) -> QCompileError:
    return QCompileError(f"{WHERE}: {what} is quantized as {describe_scheme(fq)}; {why}", fix=fix)


def _weight_fix(fq: FakeQuantize) -> str:
    if FORMATS.get(fq.block_format or "") and FORMATS[fq.block_format].kind in ("ggml",
                                                                                "ggml_k"):
        return ("llama.cpp's grids are written by qc.export_gguf; for a compressed-tensors "
                "checkpoint compile with int4 groups (8da4w-qat, w4a8-qat) or int8 "
                "(w8-weight-only)")
    return ("compile with a scheme compressed-tensors stores: int2..int8 per tensor / "
            "channel / group (w8-weight-only, 8da4w-qat, w4a8-qat), fp8_e4m3, nvfp4 "
            "(nvfp4-qat) or mxfp4 (mxfp4-qat)")


@dataclass(frozen=True)
class _Grid:
    """An integer quantizer's range as compressed-tensors' signed ``num_bits`` range:
    stored code = graph code - ``shift``."""

    bits: int
    shift: int


def _int_grid(fq: FakeQuantize, what: str, *, exact_range: bool) -> _Grid:
    """compressed-tensors' range holding ``fq``'s codes: the narrowest signed range at
    least as wide (``exact_range``: exactly as wide, as an activation's clamp needs), and
    for a symmetric quantizer one that puts its fixed zero point at 0."""
    levels = fq.quant_max - fq.quant_min + 1
    bits = max(1, math.ceil(math.log2(levels)))
    if bits > 8 or (exact_range and levels != 2 ** bits):
        raise _refuse(what, fq, f"compressed-tensors stores integer grids of 2^n levels up to "
                      f"8 bits, this one has {levels}", _weight_fix(fq))
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if not fq.symmetric:
        return _Grid(bits, fq.quant_min - low)
    shift = int(fq.zero_point.reshape(-1)[0])
    if fq.quant_min - shift < low or fq.quant_max - shift > high:
        raise _refuse(what, fq, "its symmetric range does not fit compressed-tensors' "
                      f"{bits}-bit one", _weight_fix(fq))
    return _Grid(bits, shift)


def _strategy(fq: FakeQuantize, what: str) -> dict[str, Any]:
    if fq.granularity == "per_tensor":
        return {"strategy": "tensor"}
    if fq.granularity == "per_channel" and fq.axis == 0:
        return {"strategy": "channel"}
    if fq.granularity == "per_group":
        return {"strategy": "group", "group_size": fq.group_size}
    raise _refuse(what, fq, "compressed-tensors quantizes a weight per tensor, per output "
                  "channel (axis 0) or in groups along its input", _weight_fix(fq))


def _weight_args(fq: FakeQuantize, what: str) -> tuple[Any, _Grid | None]:
    """The compressed-tensors ``QuantizationArgs`` of weight quantizer ``fq`` (and, for
    integers, how its codes sit in compressed-tensors' range)."""
    if fq.block_format is not None:
        preset = BLOCK_PRESETS.get(fq.block_format)
        block = FORMATS[fq.block_format].block
        if preset is None or fq.group_size != block:
            raise _refuse(what, fq, "compressed-tensors has no format for it",
                          _weight_fix(fq))
        return preset_name_to_scheme(preset, ["Linear"]).weights, None
    if fq.dynamic or fq.granularity == "per_token":
        raise _refuse(what, fq, "a weight's qparams must be stored", _weight_fix(fq))
    if fq.dtype in FP8_DTYPES:
        if fq.dtype != "fp8_e4m3":
            raise _refuse(what, fq, "compressed-tensors' fp8 is E4M3", "use fp8_e4m3")
        return QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                **_strategy(fq, what)), None
    grid = _int_grid(fq, what, exact_range=False)
    return QuantizationArgs(num_bits=grid.bits, type="int", symmetric=fq.symmetric,
                            **_strategy(fq, what)), grid


def _activation_fix(name: str) -> str:
    return (f"disable it before saving (gm.get_submodule({name!r}).enabled = False: the "
            "graph then computes that tensor in float, as the checkpoint does), or give that "
            "op no activation quantizer in the spec (a rule with skip: true, or one without "
            "activation, before the others)")


def _activation_args(fq: FakeQuantize, name: str) -> tuple[Any, _Grid | None]:
    """The compressed-tensors ``QuantizationArgs`` of activation quantizer ``fq``: the same
    numerics, or a refusal."""
    what = f"activation quantizer {name}"
    dynamic = fq.dynamic or fq.granularity == "per_token"
    if fq.block_format is not None:
        raise _refuse(what, fq, "compressed-tensors computes block scales of activations "
                      "with other formulas (MX: a rounded block maximum; NVFP4: a static "
                      "global scale)", _activation_fix(name))
    if fq.granularity not in ("per_tensor", "per_token"):
        raise _refuse(what, fq, "compressed-tensors quantizes activations per tensor or per "
                      "token", _activation_fix(name))
    strategy = "token" if fq.granularity == "per_token" else "tensor"
    if fq.dtype in FP8_DTYPES:
        if fq.dtype != "fp8_e4m3":
            raise _refuse(what, fq, "compressed-tensors' fp8 is E4M3", _activation_fix(name))
        return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                                dynamic=dynamic), None
    if dynamic and fq.symmetric:
        raise _refuse(what, fq, "compressed-tensors' dynamic symmetric scale is "
                      "max|x| / (2^bits - 1) * 2, not the graph's max|x| / (2^(bits-1) - 1)",
                      _activation_fix(name))
    grid = _int_grid(fq, what, exact_range=True)
    return QuantizationArgs(num_bits=grid.bits, type="int", symmetric=fq.symmetric,
                            strategy=strategy, dynamic=dynamic), grid


# -- weights ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Site:
    """Where a quantized parameter is read: the graph holding it, its path there, its
    quantizer and the views the quantizer reads it through."""

    owner: GraphModule
    path: str
    fq: FakeQuantize
    steps: Any


@dataclass
class _Weight:
    """One quantized parameter: its quantizer (``fq``, by name), where it is read
    (``site``: its values come from there, ``_fake_quantized``), ``dtype`` its own and,
    where compressed-tensors compresses it, its weight args and grid, and the activation
    args and qparams of its layer's input and output."""

    fq: str
    dtype: torch.dtype
    site: _Site
    args: Any = None
    grid: _Grid | None = None
    inputs: tuple[Any, dict[str, torch.Tensor]] | None = None
    outputs: tuple[Any, dict[str, torch.Tensor]] | None = None


def _fake_quantized(w: _Weight) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``w``'s fake-quantized values (float32, the parameter's shape) and, for a compressed
    parameter, its qparams (a qparam of the parameter's rank holds one row per row of the
    parameter, split with it; the others, shape ``(1,)``, are shared by every module it
    becomes). Computed when the parameter's turn comes: a tensor-parallel shard is
    gathered whole first (a collective), one parameter at a time."""
    param = gathered(w.site.owner.get_parameter(w.site.path))
    view = apply_view(param, w.site.steps)
    q, values = _observed(w.site.fq, view)
    qparams = _qparams(q, view, param, w.grid) if w.args is not None else {}
    return values.reshape(param.shape), qparams


def _observed(fq: FakeQuantize, w: torch.Tensor) -> tuple[FakeQuantize, torch.Tensor]:
    """A copy of ``fq`` after the graph's next forward and what that forward computes of
    ``w`` (a quantizer still observing its weight observes it once more): the graph keeps
    its own quantizer untouched."""
    q = whole_quantizer(fq)  # a tensor-parallel shard's rows of state gathered: collective
    q.reuse_weight = False
    with torch.no_grad():
        out = q(w)
    return q, out.float()


def _rows_view(path: str, param: torch.Tensor, steps: Any) -> None:
    """The quantizer must read the parameter's rows as they are (a fused expert weight
    ``[experts, out, in]`` as ``[experts * out, in]``): the checkpoint stores them so."""
    # (shapes only: the views of a sharded weight may exist only once it is gathered)
    view = apply_view(torch.empty(param.shape, device="meta"), steps)
    plain = all(fn is torch.reshape for fn, _ in steps)
    if not plain or view.dim() != 2 or view.shape[-1] != param.shape[-1]:
        raise QCompileError(f"{WHERE}: {path} is quantized through a transposed view; "
                            "compressed-tensors stores weights [out, in] with their groups "
                            "along the input", fix="skip the layer in the spec")


def _qparams(q: FakeQuantize, view: torch.Tensor, param: torch.Tensor, grid: _Grid | None
             ) -> dict[str, torch.Tensor]:
    """``weight_scale`` (and zero point, global scale) as compressed-tensors wants them
    before compression: float32 scales, int8 zero points of its signed range; per-row ones
    shaped ``[*param.shape[:-1], k]``."""
    lead = tuple(param.shape[:-1])
    if q.block_format == "nvfp4":
        codes = quantize_blocks(view.detach(), "nvfp4", q.group_size)
        ts = codes.tensor_scale.float().reshape(1)
        empty = bool(ts == 0) or math.isinf(float(1.0 / ts))  # the graph's zeros
        scales = codes.scales.float()
        return {"weight_scale": torch.where(scales == 0, 1.0, scales).reshape(*lead, -1),
                "weight_global_scale": torch.ones(1) if empty else 1.0 / ts}
    if q.block_format is not None:  # MX: exact powers of two
        grid_ = block_scales(view.detach().reshape(-1, q.group_size), q.block_format)
        return {"weight_scale": grid_.from_grid.reshape(*lead, -1)}
    scale = q.scale.detach().float()
    shape = (1,) if q.granularity == "per_tensor" else (*lead, -1)
    out = {"weight_scale": scale.reshape(shape).clone()}
    if grid is not None and not q.symmetric:
        out["weight_zero_point"] = (q.zero_point.reshape(shape) - grid.shift).to(torch.int8)
    return out


def _weights(graph: GraphModule, linear: set[str]) -> dict[str, _Weight]:
    """Every parameter read through an enabled weight quantizer, by the name it is read
    by (a tied head and embedding: each its own, the quantizer ``<name>_fake_quant``
    telling which): where it is read, and for the parameters of compressed layers
    (``linear``: ``nn.Linear`` weights and fused experts) their args and grid."""
    names = {id(m): n for n, m in graph.named_modules()}
    aliases: dict[int, list[str]] = {}
    for name, p in _model_params(graph, remove_duplicate=False).items():
        aliases.setdefault(id(p), []).append(name)
    out: dict[str, _Weight] = {}
    for owner, path, fq, steps in weight_sites(graph):
        if not fq.enabled:
            continue
        param = owner.get_parameter(path)
        own = names[id(fq)].removesuffix("_fake_quant")
        key = own if own in aliases[id(param)] else path
        if key in out:
            raise QCompileError(f"{WHERE}: {key} is read through two quantizers "
                                f"({out[key].fq}, {names[id(fq)]}); a checkpoint holds one "
                                "tensor per weight", fix="quantize every use of the weight "
                                "with one rule")
        weight = _Weight(names[id(fq)], param.dtype, _Site(owner, path, fq, steps))
        if key in linear:
            _rows_view(key, param, steps)
            weight.args, weight.grid = _weight_args(fq, f"layer weight {key}")
        out[key] = weight
    reads = weight_reads(graph)
    _share_tied(out, aliases, reads)
    _check_reads(out, aliases, reads)
    return out


def _share_tied(weights: dict[str, _Weight], aliases: Mapping[int, list[str]],
                reads: Mapping[int, list[Any]]) -> None:
    """A tied parameter every use of which reads through one quantizer (the head's, say,
    the embedding reading it too): each name holds those values (the others as
    fake-quantized values, not compressed)."""
    enabled = {w.fq for w in weights.values()}
    for pid, names in aliases.items():
        src = next((weights[n] for n in names if n in weights), None)
        kinds = {r.fq if r.fq in enabled else None for r in reads.get(pid, [])}
        if len(names) > 1 and src is not None and kinds == {src.fq}:
            for name in names:
                weights.setdefault(name, _Weight(src.fq, src.dtype, src.site))


def _check_reads(weights: Mapping[str, _Weight], aliases: Mapping[int, list[str]],
                 reads: Mapping[int, list[Any]]) -> None:
    """A weight read both through its quantizer and as it is (not a tied head and
    embedding, which are written apart) has no one value a checkpoint could hold."""
    enabled = {w.fq for w in weights.values()}
    for pid, found in reads.items():
        kinds = {r.fq if r.fq in enabled else None for r in found}
        if len(kinds) > len(aliases.get(pid, [])):
            name = aliases[pid][0]
            raise QCompileError(f"{WHERE}: {name} is read both through a quantizer and as it "
                                "is; a checkpoint holds one tensor per weight",
                                fix="quantize every use of the weight with one rule")


# -- activations ------------------------------------------------------------------------------
def _strip(node: Any) -> Any:
    """The node a value comes from, view ops skipped."""
    while isinstance(node, Node) and call_name(node) in VIEWS and node.args \
            and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _weight_read(op: Node, by_node: Mapping[str, str]) -> str | None:
    """The compressed parameter (by quantizer) op ``op`` multiplies its first input by."""
    layer = sharded_linear(op)
    if layer is not None:  # a tensor-parallel layer quantizing its own weight
        return by_node.get(f"{op.target}.weight_fake_quant") if layer.quantize_weight else None
    for arg in op.args[1:]:
        src = _strip(arg)
        if isinstance(src, Node) and src.op == "call_module" and str(src.target) in by_node:
            return by_node[str(src.target)]
    return None


def _float_input(node: Node) -> bool:
    """Whether the quantizer reads a floating-point value (an integer input, such as token
    ids, passes through it unchanged)."""
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], Node) else None
    return not isinstance(val, torch.Tensor) or val.is_floating_point()


def _slot(node: Node, by_node: Mapping[str, str]) -> tuple[str, set[str]] | None:
    """Where activation quantizer ``node`` sits for compressed-tensors: the ``input`` of the
    compressed layers it alone feeds, or the ``output`` of the one whose only reader it
    is; None anywhere else."""
    ends = [end for _, end in view_paths(node)]
    params = {_weight_read(end, by_node) if end.args and _strip(end.args[0]) is node else None
              for end in ends}
    if ends and None not in params:
        return "input", params  # type: ignore[return-value]
    return _output_slot(node, by_node)


def _output_slot(node: Node, by_node: Mapping[str, str]) -> tuple[str, set[str]] | None:
    """The output of the compressed layer whose only reader ``node`` is, or None."""
    src = _strip(node.args[0]) if node.args else None
    if isinstance(src, Node):
        param = _weight_read(src, by_node)
        if param is not None and all(end is node for _, end in view_paths(src)):
            return "output", {param}
    return None


def _activations(graph: GraphModule, weights: dict[str, _Weight]) -> None:
    """Attach every enabled activation quantizer to the compressed layers whose input or
    output it quantizes (``_Weight.inputs`` / ``outputs``), or refuse it."""
    compressed = {w.fq: key for key, w in weights.items() if w.args is not None}
    by_fq = {w.fq: w for w in weights.values()}
    missing = set(uncalibrated(graph, report(graph).mode))
    for node in graph.graph.nodes:
        if node.op != "call_module" or str(node.target) in by_fq:
            continue
        layer = sharded_linear(node)
        if layer is not None:  # a tensor-parallel layer quantizing its own input
            if layer.quantize_input and _float_input(node):
                _attach(f"{node.target}.input_fake_quant", layer.input_fake_quant,
                        _own_input_slot(node, compressed), weights, missing,
                        lambda node=node: f"linear of {node.target}.weight")
            continue
        fq = graph.get_submodule(str(node.target))
        if isinstance(fq, FakeQuantize) and _float_input(node):
            _attach(str(node.target), fq, _slot(node, compressed), weights, missing,
                    lambda node=node: _feeds(node))


def _own_input_slot(node: Node, by_node: Mapping[str, str]) -> tuple[str, set[str]] | None:
    """``_slot`` of the input quantizer a ``ShardedLinear`` call runs itself: the input of
    its own weight when compressed, else the output of the compressed layer whose only
    reader the call is."""
    param = _weight_read(node, by_node)
    if param is not None:
        return "input", {param}
    return _output_slot(node, by_node)


def _attach(name: str, fq: FakeQuantize, slot: tuple[str, set[str]] | None,
            weights: dict[str, _Weight], missing: set[str], feeds: Any) -> None:
    """Activation quantizer ``name`` onto the compressed layers of its ``slot``, or
    refused (``feeds()``: what it feeds, for the message)."""
    if not fq.enabled:
        return
    if slot is None:
        raise _refuse(f"activation quantizer {name}", fq, "it is not the input or the "
                      "output of a layer compressed-tensors compresses (a linear layer "
                      f"with a quantized weight): it feeds {feeds()}",
                      _activation_fix(name))
    if name in missing:
        raise QCompileError(f"{WHERE}: activation quantizer {name} has no range yet (its "
                            "scale is a placeholder)", fix="run qc.calibrate(gm, batches) "
                            "(static) or train it first, as for qc.export_encodings")
    args, grid = _activation_args(fq, name)
    prefix = slot[0]
    qparams = {} if args.dynamic else _static_qparams(fq, grid, prefix)
    for key in slot[1]:
        if prefix == "input":
            weights[key].inputs = (args, qparams)
        else:
            weights[key].outputs = (args, qparams)


def _feeds(node: Node) -> str:
    """What an activation quantizer's value goes into, for a message: the parameters the
    ops reading it multiply it by, else the ops."""
    out = []
    for _, end in view_paths(node):
        if sharded_linear(end) is not None:
            out.append(f"linear of {end.target}.weight")
            continue
        params = [_strip(a) for a in end.args[1:] if isinstance(a, Node)]
        params = [_strip(p.args[0]) if p.op == "call_module" and p.args else p for p in params]
        named = [str(p.target) for p in params if isinstance(p, Node) and p.op == "get_attr"]
        what = call_name(end) or end.op
        out.append(f"{what} of {named[0]}" if named else what)
    return ", ".join(sorted(set(out))[:3]) or "nothing"


def _static_qparams(fq: FakeQuantize, grid: _Grid | None, prefix: str
                    ) -> dict[str, torch.Tensor]:
    out = {f"{prefix}_scale": fq.scale.detach().float().reshape(1).clone()}
    if grid is not None and not fq.symmetric:
        out[f"{prefix}_zero_point"] = (fq.zero_point.reshape(1) - grid.shift).to(torch.int8)
    return out


# -- the checkpoint's layout -----------------------------------------------------------------
def _linear_params(graph: GraphModule, skeleton: nn.Module) -> set[str]:
    """Graph parameters that are ``nn.Linear`` weights in transformers' model (by any name
    they have in the graph)."""
    linear = {f"{n}.weight" for n, m in skeleton.named_modules() if isinstance(m, nn.Linear)}
    return set(_model_params(graph, remove_duplicate=False)) & linear


class _Layout:
    """Where each row of each parameter goes in transformers' checkpoint layout (its own
    ``revert_weight_conversion``, run once on row indices): fused experts split per expert
    (and gate / up), renamed families (Mixtral's ``block_sparse_moe``) renamed."""

    def __init__(self, skeleton: nn.Module, shapes: Mapping[str, torch.Size]) -> None:
        ids, spans, start = {}, {}, 0
        self.pieces: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, shape in shapes.items():
            rows = math.prod(shape[:-1]) if len(shape) else 1
            if rows == 0:  # nothing to place: kept as it is
                self.pieces[name] = [(name, torch.zeros(*shape[:-1], 1, dtype=torch.long))]
                continue
            spans[name] = (start, start + rows)
            ids[name] = torch.arange(start, start + rows).reshape(*shape[:-1], 1)
            start += rows
        starts = [lo for lo, _ in spans.values()]
        names = list(spans)
        for key, t in revert_weight_conversion(skeleton, ids).items():
            param = None
            if t.numel():
                first, last = int(t.min()), int(t.max())
                param = names[bisect.bisect_right(starts, first) - 1]
                param = param if last < spans[param][1] else None
            # a conversion that moves anything but whole rows of one parameter (a
            # transpose, a merge of two) has no per-row layout
            if param is None or t.dim() == 0 or t.shape[-1] != 1:
                raise QCompileError(f"{WHERE}: transformers' checkpoint layout of "
                                    f"{type(skeleton).__name__} rearranges more than rows "
                                    f"(its tensor {key})", fix="save the model's float "
                                    "weights with transformers instead, or report it")
            self.pieces.setdefault(param, []).append((key, t - spans[param][0]))
        for name, (lo, hi) in spans.items():
            if sum(t.numel() for _, t in self.pieces.get(name, [])) != hi - lo:
                raise QCompileError(f"{WHERE}: transformers' checkpoint layout of "
                                    f"{type(skeleton).__name__} does not hold {name} once",
                                    fix="save the model's float weights with transformers "
                                    "instead, or report it")

    def split(self, param: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``t`` (the parameter's rows, any trailing size) as the checkpoint's tensors."""
        flat = t.reshape(-1, *t.shape[t.dim() - 1:]) if t.dim() else t.reshape(1)
        for key, rows in self.pieces[param]:
            yield key, flat[rows.reshape(-1)].reshape(*rows.shape[:-1], *t.shape[-1:])


# -- compression ----------------------------------------------------------------------------
def _scheme(w: _Weight) -> Any:
    """The compressed-tensors scheme of one compressed parameter, with its format."""
    scheme = QuantizationScheme(targets=["Linear"], weights=w.args,
                                input_activations=w.inputs[0] if w.inputs else None,
                                output_activations=w.outputs[0] if w.outputs else None)
    scheme.format = _format(scheme)
    return scheme


def _format(scheme: Any) -> Any:
    """The compressed-tensors format a layer is written in: integer weights under 8 bits
    packed (``pack-quantized``, whatever the activations), fp8 weights
    ``float-quantized``; otherwise what compressed-tensors infers for the scheme."""
    w = scheme.weights
    if w.type == "int" and w.num_bits < 8:
        return CompressionFormat.pack_quantized
    if w.type == "float" and w.num_bits == 8 and w.scale_dtype is None:
        return CompressionFormat.float_quantized
    return infer_module_format(nn.Linear, scheme)


def _module_state(w: _Weight, own: Mapping[str, torch.Tensor], values: torch.Tensor,
                  pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One compressed layer's state dict before compression (compressed-tensors' local
    names; ``own``: the weight's qparams)."""
    state = {"weight": values}
    for qparams in (own, *(x[1] for x in (w.inputs, w.outputs) if x)):
        for key, t in qparams.items():
            state[key] = pieces.get(key, t).clone()
    return state


def _compress(module: str, state: dict[str, torch.Tensor], scheme: Any, dtype: torch.dtype
              ) -> dict[str, torch.Tensor]:
    """``state`` through compressed-tensors' compressor for the scheme's format, checked by
    decompressing it again: the stored codes and scales must give back the graph's values
    (``dtype``: the parameter's, in which the graph computes them)."""
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    packed = compressor.compress(state, scheme)
    try:
        back = compressor.decompress(dict(packed), scheme)["weight"].to(dtype).float()
    except (RuntimeError, ValueError) as e:  # its loader would fail the same way
        raise QCompileError(f"{WHERE}: compressed-tensors {compressed_tensors.__version__} "
                            f"cannot decompress what it compressed for {module} "
                            f"({scheme.format.value}, {scheme.weights.num_bits}-bit, "
                            f"{scheme.weights.strategy}): {e}",
                            fix="skip the layer in the spec, or quantize it symmetrically"
                            ) from None
    want = state["weight"]
    # NVFP4 decompresses in bfloat16: the graph's values to that precision; the others in
    # the scales' float32, exactly
    tol = 0.0 if scheme.format != CompressionFormat.nvfp4_pack_quantized else \
        torch.finfo(torch.bfloat16).eps
    worst = float((back - want).abs().sub(want.abs() * tol).max()) if want.numel() else 0.0
    if worst > 0:
        raise QCompileError(f"{WHERE}: compressed-tensors {compressed_tensors.__version__} "
                            f"stores {module}'s weight as other values than the graph's",
                            fix="report it to qcompile, with both packages' versions")
    return {f"{module}.{k}": v.contiguous() for k, v in packed.items()}


@dataclass
class _Checkpoint:
    """What the directory will hold: the tensors by checkpoint name, the config groups and
    ignore list, and whether tied weights are written apart."""

    tensors: dict[str, torch.Tensor]
    groups: dict[str, Any]
    ignore: list[str]
    untie: bool


def _group_key(scheme: Any) -> str:
    return json.dumps(scheme.model_dump(exclude={"targets", "format"}), sort_keys=True,
                      default=str)


def _plan(graph: GraphModule, skeleton: nn.Module, *, keep: bool = True) -> _Checkpoint:
    """Every tensor of the checkpoint and its quantization config; every check is done
    before anything is written. Each parameter is taken whole in its turn (a
    tensor-parallel shard gathered: every rank makes the same gathers, in this order, and
    compresses each layer, so that a refusal is every rank's); ``keep`` False (a rank that
    does not write): no tensor is kept."""
    experts = _expert_params(graph)
    weights = _weights(graph, _linear_params(graph, skeleton) | experts)
    _activations(graph, weights)
    _check_experts(weights, experts)
    untie = _untie(graph, weights)
    params = _model_params(graph, remove_duplicate=not untie)
    schemes = {name: _scheme(w) for name, w in weights.items()
               if name in params and w.args is not None}
    keys = {name: _group_key(scheme) for name, scheme in schemes.items()}
    _check_mixed(schemes, keys)
    layout = _Layout(skeleton, {n: p.shape for n, p in params.items()})
    tensors: dict[str, torch.Tensor] = {}
    members: dict[str, list[str]] = {}
    for name, p in params.items():
        if name not in schemes:  # float, or its fake-quantized values
            w = weights.get(name)
            value = gathered(p).detach() if w is None else _fake_quantized(w)[0].to(p.dtype)
            if keep:
                tensors.update((k, v.contiguous()) for k, v in layout.split(name, value))
            continue
        for module, packed in _compressed(layout, name, weights[name], schemes[name]):
            if keep:
                tensors.update(packed)
            members.setdefault(keys[name], []).append(module)
    unique = {keys[name]: scheme for name, scheme in schemes.items()}
    groups, ignore = _groups(unique, members, skeleton, weights)
    return _Checkpoint(tensors, groups, ignore, untie)


def _check_mixed(schemes: Mapping[str, Any], keys: Mapping[str, str]) -> None:
    """Asymmetric packed weights load in transformers only decompressed at load
    (compressed-tensors 0.20 packs their zero points in the file but expects them unpacked
    when it compresses the model it loads into), and that path reads one scheme for every
    layer: next to another scheme they would not load at all."""
    if len(set(keys.values())) < 2:
        return
    for name, scheme in schemes.items():
        if scheme.format == CompressionFormat.pack_quantized and not scheme.weights.symmetric:
            raise QCompileError(
                f"{WHERE}: {name} has asymmetric {scheme.weights.num_bits}-bit weights next "
                "to layers of another scheme; transformers loads asymmetric packed weights "
                "only decompressing them at load, which reads one scheme for every layer",
                fix="quantize those weights symmetrically, or every layer with the one "
                "asymmetric scheme")


def _compressed(layout: _Layout, name: str, w: _Weight, scheme: Any
                ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(checkpoint module, its compressed tensors) for each linear layer parameter
    ``name`` becomes (one, or one per expert)."""
    whole, qparams = _fake_quantized(w)
    rank = whole.dim()
    pieces = {k: dict(layout.split(name, t)) for k, t in qparams.items() if t.dim() == rank}
    for ckpt, values in layout.split(name, whole):
        module = ckpt.removesuffix(".weight")
        state = _module_state(w, qparams, values, {k: v[ckpt] for k, v in pieces.items()})
        yield module, _compress(module, state, scheme, w.dtype)


def _expert_params(graph: GraphModule) -> set[str]:
    """Fused expert weights (transformers' ``experts.gate_up_proj`` / ``down_proj``,
    ``[experts, out, in]``)."""
    return {n for n, p in _model_params(graph).items()
            if p.dim() == 3 and ".experts." in f".{n}"}


def _check_experts(weights: Mapping[str, _Weight], experts: set[str]) -> None:
    """Fused experts in a compressed checkpoint must be in a scheme transformers'
    compressed-tensors loader decompresses right: it decompresses every expert (a float
    one fails to load) from its packed codes and scales alone (zero points, NVFP4's global
    scale and int8 codes stored unpacked are not read)."""
    if not any(w.args is not None for w in weights.values()):
        return
    for name in sorted(experts):
        w = weights.get(name)
        if w is None or w.args is None:
            raise QCompileError(
                f"{WHERE}: the experts {name} are float while other layers are compressed; "
                "transformers' compressed-tensors loader decompresses every expert, and "
                "fails on float ones", fix="quantize the experts too (a rule matching op "
                "grouped_mm with reads_weight: true, as the presets have), or no layer")
        scheme = _scheme(w)
        if not ((scheme.format == CompressionFormat.pack_quantized and w.args.symmetric)
                or scheme.format == CompressionFormat.float_quantized):
            fq = weights[name].fq
            raise QCompileError(
                f"{WHERE}: the experts {name} would be {scheme.format.value} "
                f"({w.args.num_bits}-bit {w.args.type}, "
                f"{'symmetric' if w.args.symmetric else 'asymmetric'}; quantizer {fq}); "
                "transformers' compressed-tensors loader decompresses fused experts from "
                "their packed codes and scales alone, so it would load other values",
                fix="quantize the experts with symmetric integers without int8 activations "
                "(8da4w-qat, w8-weight-only) or with fp8_e4m3")


def _untie(graph: GraphModule, weights: Mapping[str, _Weight]) -> bool:
    """Whether tied parameters must be written apart: a name of theirs holds quantized
    values, so one tensor no longer serves every name."""
    by_id: dict[int, list[str]] = {}
    for name, p in _model_params(graph, remove_duplicate=False).items():
        by_id.setdefault(id(p), []).append(name)
    return any(len(names) > 1 and any(n in weights for n in names) for names in by_id.values())


def _groups(schemes: Mapping[str, Any], members: Mapping[str, list[str]],
            skeleton: nn.Module, weights: Mapping[str, _Weight]
            ) -> tuple[dict[str, Any], list[str]]:
    """``config_groups`` and ``ignore``. One scheme targets ``Linear``, every linear layer
    but the ignored (float) ones, as llm-compressor writes it; several target their layers
    by name (``re:^name$``; experts by their per-expert names, which transformers' loader
    recognises by ``experts``)."""
    if len(schemes) == 1:
        scheme = next(iter(schemes.values()))
        floats = sorted(n for n, m in skeleton.named_modules() if isinstance(m, nn.Linear)
                        and getattr(weights.get(f"{n}.weight"), "args", None) is None)
        return {"group_0": scheme.model_copy(update={"targets": ["Linear"]})}, floats
    groups = {}
    for i, (key, scheme) in enumerate(schemes.items()):
        targets = sorted({f"re:^{re.escape(module)}$" for module in members[key]})
        groups[f"group_{i}"] = scheme.model_copy(update={"targets": targets})
    return groups, []


# -- writing ----------------------------------------------------------------------------------
def save_pretrained(gm: nn.Module, directory: str | os.PathLike[str], *,
                    config: Any = None) -> Path:
    """Write ``gm`` (a graph ``qc.qcompile`` made from a transformers causal LM) as a Hugging
    Face checkpoint with a compressed-tensors ``quantization_config`` into ``directory``
    (new, or an empty directory) and return its path. ``config`` is the model's
    transformers config (or its ``to_dict()``). See the module for what each scheme
    becomes and what is refused; everything is checked before anything is written. A
    graph sharded by tensor parallelism is saved by every rank together (each layer's
    weight gathered in turn), as is one whose stages ``qc.distributed.pipeline`` spread
    over ranks; rank 0 writes the directory, the other ranks return its path."""
    _require()
    graph = _graph(gm)
    writes = writes_here(graph)
    if not is_sharded(graph):
        target = _checked(graph, directory, writes=True)
    else:  # every rank saves a sharded or pipelined graph together; rank 0 writes
        target = agree_and_share(graph, unwrap(gm), WHERE, {
            "directory": os.fspath(directory), "config": config_fingerprint(config)},
            lambda: _checked(graph, directory, writes=writes))
    cfg = _config(config)
    skeleton = _skeleton(cfg, graph)
    plan = _plan(graph, skeleton, keep=writes)
    if not writes:
        return target
    # what transformers' own save_pretrained records: the class (vLLM picks its model by
    # it) and the weights' dtype
    cfg.architectures = [type(skeleton).__name__]
    cfg.dtype = next((p.dtype for p in _model_params(graph).values() if p.is_floating_point()),
                     torch.float32)
    if plan.untie:
        cfg.tie_word_embeddings = False
    # no compressed layer: a plain checkpoint (an empty quantization_config is no config
    # transformers loads)
    qconfig = QuantizationConfig(config_groups=plan.groups, ignore=plan.ignore,
                                 format=_model_format(plan.groups),
                                 quantization_status=QuantizationStatus.COMPRESSED
                                 ) if plan.groups else None
    _write(target, cfg, qconfig, plan.tensors)
    return target


def _model_format(groups: Mapping[str, Any]) -> str:
    """The config's ``format``: the groups' one, or ``mixed-precision`` (each group then
    names its own)."""
    formats = {CompressionFormat(g.format).value for g in groups.values()}
    return formats.pop() if len(formats) == 1 else CompressionFormat.mixed_precision.value


def _write(target: Path, cfg: Any, qconfig: Any | None, tensors: dict[str, torch.Tensor]
           ) -> None:
    """The two files, written into a private folder beside ``target`` (with the mode any
    new file gets, fsynced) that is then renamed onto it: the directory appears whole or
    not at all."""
    from safetensors.torch import save_file

    parent = target.parent
    remove_stale_temporaries(parent, prefix=temp_prefix(target))
    # 0o777 less the umask: once renamed, the folder has the mode any new folder gets
    with temporary_folder(parent, temp_prefix(target), mode=0o777) as folder:
        with atomic_paths(folder / CONFIG_NAME, folder / WEIGHTS_NAME) as (config_tmp, weights):
            # transformers writes config.json into the folder it is given and
            # compressed-tensors adds its quantization_config to that file, as
            # llm-compressor does: the private folder holds the temporary config.json
            cfg.save_pretrained(config_tmp.parent)
            if qconfig is not None:
                ModelCompressor(quantization_config=qconfig).update_config(
                    str(config_tmp.parent))
            save_file(tensors, str(weights), metadata={"format": "pt"})
        unmark(folder)
        os.replace(folder, target)
    sync_folder(parent)
