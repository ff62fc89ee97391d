"""llama.cpp's GGUF file out of a graph compiled from a Hugging Face decoder LLM.

``export_gguf(gm, path, config=hf_config, tokenizer=None)`` writes one ``.gguf`` file with
gguf-py's ``GGUFWriter`` (llama.cpp's own Python package), laid out as llama.cpp's
``convert_hf_to_gguf.py`` lays out the same model: its tensor names (``blk.0.attn_q.weight``
...), its metadata keys (context and embedding length, block count, head counts, RoPE,
RMS epsilon, expert counts, file type) and, for the ``llama`` architecture, its reordering
of the query and key rows (llama.cpp rotates adjacent pairs, Hugging Face the two halves
of each head).

The file computes what the graph computes. Each weight is written as the layer reads it:

- through a llama.cpp grid (scheme dtypes ``q8_0``, ``q4_0``, ``q4_1``, ``q4_k``,
  ``q6_k``; presets ``gguf-q8_0-qat``, ``gguf-q4_0-qat``, ``gguf-q4_k-qat``): as that GGML
  type, routers included, whose dequantization is the graph's fake-quantized weight bit
  for bit (llama.cpp then quantizes the layer's input on the fly, as the preset's
  activation quantizer does);
- with no quantizer (or a disabled one): F32, or F16 / BF16 when the parameter is stored
  so; norms, biases, 1-D tensors and float routers are F32, as the converter writes them.

A mixture of experts' fused ``gate_up_proj`` (transformers 5) becomes llama.cpp's
``ffn_gate_exps`` and ``ffn_up_exps``; Qwen2-MoE's shared-expert gate is the vector
``{n_embd}`` llama.cpp declares.

Tied embeddings (``tie_word_embeddings``) give no ``output.weight`` (llama.cpp reads the
head from ``token_embd``), unless the head reads the shared tensor through a quantizer the
embedding does not: then ``output.weight`` holds the head's version, so both stay exact.

Refused before anything is written (``QCompileError``, naming the layer and the fix): a
weight scheme no GGUF type holds (int8 per channel, int4 groups, nvfp4, mxfp4, nf4 ...:
the fix names the ``gguf-*`` preset of the same width); an activation quantizer other
than the blocks llama.cpp's CPU matmul makes of a layer's input on the fly (``q8_0`` for
``q4_0`` / ``q4_1`` / ``q8_0`` weights, ``q8_k`` for the K types); an architecture other
than ``llama``, ``mistral``, ``mixtral``, ``qwen2`` and ``qwen2_moe``; one pipeline
stage's graph on its own, weights sharded other than by ``qc.distributed.wrap`` /
``compile_once`` / ``qc.distributed.pipeline`` or on the meta device; unmerged LoRA
adapters; a path that exists. The file is written atomically
(``qcompile.files.atomic_path``); the graph is never modified (but for the stage copies
of a pipeline, below).

A graph ``qc.distributed.wrap`` (or ``compile_once``) sharded for tensor parallelism, FSDP2
or both is exported by every rank together (FSDP2's blocks, a child graph each, read as
one graph): the ranks first agree on the call (the model, ``path``, ``config``, the
tokenizer's kind; a call made on some ranks only or with other arguments is one
``QCompileError`` on every rank, before any collective), then each sharded weight is
gathered whole (``full_tensor()``) when its turn comes, one at a time, and goes through
what one process's export does with it; rank 0 writes the file (the same bytes as one
process exporting the unsharded graph), the other ranks return its path.

A graph placed in pipeline stages is read as one graph. Under ``qc.distributed.pipeline``
(pp, pp x dp, pp x tp), where each rank trained its own stage and holds untrained copies
of the others, every rank calls the export: after the agreement each stage's trained
state goes from the rank that trained it to the others' copies, one tensor at a time
(``qcompile.deploy.stages.share_stages``), and the pipeline's lowest rank writes what one process
would write for the trained model.

The vocabulary comes from ``tokenizer`` (a transformers tokenizer) as the converter
reads it: a byte-level BPE as model ``gpt2`` with its merges, a SentencePiece-style BPE
(byte fallback) as model ``llama`` with scores, plus the special token ids. Without one, a
plain vocabulary of the config's ``vocab_size`` (``<t0>``, ``<t1>`` ... with the config's
bos / eos / pad ids as control tokens), which llama.cpp loads and evaluates token ids with.

Example:
    >>> import os, tempfile, torch, transformers, gguf, qcompile as qc
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
    ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg)
    >>> gm = qc.qcompile(model, "gguf-q4_0-qat", example_kwargs={"input_ids":
    ...                  torch.randint(0, 64, (1, 8))})
    >>> path = os.path.join(tempfile.mkdtemp(), "model.gguf")
    >>> _ = qc.export_gguf(gm, path, config=cfg)
    >>> reader = gguf.GGUFReader(path)
    >>> {t.name: t.tensor_type.name for t in reader.tensors}["blk.0.attn_q.weight"]
    'Q4_0'
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.deploy.adapters import unwrap
from qcompile.deploy.encodings import quantizer_bits
from qcompile.deploy.whole_graph import (
    VIEWS,
    WeightRead,
    agree_and_share,
    call_name,
    config_fingerprint,
    describe_scheme,
    gathered,
    is_sharded,
    sharded_linear,
    view_paths,
    weight_reads,
    whole_graph,
    writes_here,
)
from qcompile.errors import QCompileError
from qcompile.files import atomic_path
from qcompile.graph.records import report
from qcompile.runtime.block_formats import FORMATS, GGUF_WEIGHT_FORMATS, ggml_bytes
from qcompile.runtime.fake_quant import FakeQuantize

try:
    import gguf
except ImportError:  # the [gguf] extra; export_gguf says how to install it
    gguf = None

__all__ = ["export_gguf"]

#: how a GGUF tensor's rows come from a parameter
_Rows = Callable[[torch.Tensor], torch.Tensor]

WHERE = "export_gguf"


@dataclass(frozen=True)
class _Family:
    """How one Hugging Face ``model_type`` becomes a GGUF architecture: llama.cpp's
    architecture, whether the converter reorders the q / k rows (``LlamaModel.permute``),
    and where it looks for the vocabulary (``spm``: SentencePiece-style first, as
    ``LlamaModel`` does; else a byte-level BPE) and which BPE pre-tokenizer it names."""

    arch: str  # general.architecture
    permute_qk: bool
    spm: bool
    bpe_pre: str


_LLAMA = _Family("llama", permute_qk=True, spm=True, bpe_pre="llama-bpe")
_QWEN2 = _Family("qwen2", permute_qk=False, spm=False, bpe_pre="qwen2")
#: Hugging Face model_type -> how llama.cpp's converter writes it (LlamaModel serves
#: Mistral and Mixtral too; Qwen2MoeModel has its own architecture)
FAMILIES: Mapping[str, _Family] = MappingProxyType({
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "mixtral": _LLAMA,
    "qwen2": _QWEN2,
    "qwen2_moe": _Family("qwen2moe", permute_qk=False, spm=False, bpe_pre="qwen2"),
})

#: the activation blocks llama.cpp's CPU matmul makes of a layer's input for each weight
#: type (its ``vec_dot_type``; Q4_1's Q8_1 holds the values Q8_0 does)
ON_THE_FLY: Mapping[str, str] = MappingProxyType({
    "q8_0": "q8_0", "q4_0": "q8_0", "q4_1": "q8_0", "q4_k": "q8_k", "q6_k": "q8_k"})

# float tensors the converter always writes as F32 whatever the file type: the routers
_F32_ALWAYS = frozenset({"ffn_gate_inp", "ffn_gate_inp_shexp"})
# ops that read a weight as an embedding table (a tied head reads it otherwise)
_EMBEDDING_OPS = frozenset({"embedding"})
# general.file_type (gguf.LlamaFileType) by the type holding most weights
_FILE_TYPES: Mapping[str, str] = MappingProxyType({
    "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q6_k": "MOSTLY_Q6_K",
    "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "f32": "ALL_F32"})


def _require_gguf() -> None:
    if gguf is None:
        raise QCompileError(f"{WHERE} needs llama.cpp's gguf package (gguf-py)",
                            fix="pip install 'qcompile[gguf]'")


def _is_embedding(node: Node | None, gm: GraphModule) -> bool:
    if node is None:
        return False
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), nn.Embedding)
    return call_name(node) in _EMBEDDING_OPS


# -- what each GGUF tensor holds -------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    """One GGUF tensor: its name, the graph parameter it comes from, how the rows are
    taken from it (``rows``: the q / k reordering, an expert half), and the quantizer the
    layer reads it through (None: the float value)."""

    name: str
    param: str
    rows: _Rows
    fq: str | None


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _permute_heads(heads: int) -> _Rows:
    """llama.cpp's order of a q or k projection's rows (and bias): within each head, the
    first and second halves interleaved (HF rotates halves, llama.cpp adjacent pairs)."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        shape = t.shape
        return (t.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
                .transpose(1, 2).reshape(shape))
    return rows


def _half(which: int) -> _Rows:
    """The gate (0) or up (1) half of fused experts ``[experts, 2 * ff, hidden]``."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-2] // 2
        return t[..., which * half:(which + 1) * half, :]
    return rows


def _hf_names(name: str) -> list[tuple[str, _Rows]]:
    """The checkpoint tensors a graph parameter stands for, as the converter names them:
    transformers' fused experts ``gate_up_proj`` split into ``gate_proj`` and ``up_proj``
    (the first and second halves), ``down_proj`` given its ``.weight``."""
    if name.endswith(".experts.gate_up_proj"):
        stem = name.removesuffix("gate_up_proj")
        return [(f"{stem}gate_proj.weight", _half(0)), (f"{stem}up_proj.weight", _half(1))]
    if name.endswith(".experts.down_proj"):
        return [(f"{name}.weight", _identity)]
    return [(name, _identity)]


def _qk_rows(hf: str, hp: Mapping[str, Any], family: _Family) -> _Rows:
    """LlamaModel's q / k reordering where the family has it (q by its heads, k by the
    key-value heads), else the rows as they are."""
    if not family.permute_qk:
        return _identity
    heads = int(hp["num_attention_heads"])
    kv = int(hp.get("num_key_value_heads") or heads)
    if hf.endswith(("q_proj.weight", "q_proj.bias")):
        return _permute_heads(heads)
    if hf.endswith(("k_proj.weight", "k_proj.bias")):
        return _permute_heads(kv)
    return _identity


def _one_read(gm: GraphModule, reads: list[WeightRead], name: str) -> str | None:
    """The one quantizer (or None) every read of ``name`` goes through."""
    kinds = {r.fq for r in reads}
    if len(kinds) > 1:
        shown = ", ".join(sorted(k or "the float value" for k in kinds))
        raise QCompileError(f"{WHERE}: {name} is read through different quantizers "
                            f"({shown}); a GGUF file holds one tensor per weight",
                            fix="quantize every use of the weight with one rule")
    return next(iter(kinds)) if kinds else None


def _plan(gm: GraphModule, hp: Mapping[str, Any], family: _Family,
          reads: Mapping[int, list[WeightRead]]) -> list[_Tensor]:
    """Every tensor of the file, in the graph's parameter order (``reads``: the graph's
    ``weight_reads``)."""
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.arch)
    tensor_map = gguf.get_tensor_name_map(arch, int(hp["num_hidden_layers"]))
    by_id: dict[int, list[str]] = {}
    params: dict[str, torch.Tensor] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        params[name] = p
    plan: list[_Tensor] = []
    for names in by_id.values():
        mapped = [(name, hf, gguf_name, _compose(rows, _shape_of(gguf_name)))
                  for name in names for hf, rows in _hf_names(name)
                  for gguf_name in [_gguf_name(tensor_map, hf, name)]]
        plan.extend(_tensors_of(gm, mapped, reads.get(id(params[names[0]]), []), hp, family))
    return plan


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _shape_of(gguf_name: str) -> _Rows:
    """The shared expert's gate ``[1, n_embd]`` as the vector llama.cpp declares it
    (``{n_embd}``) and transformers' GGUF loader expects."""
    return _flat if gguf_name.endswith("ffn_gate_inp_shexp.weight") else _identity


def _gguf_name(tensor_map: gguf.TensorNameMap, hf: str, param: str) -> str:
    found = tensor_map.get_name(hf, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise QCompileError(f"{WHERE}: parameter {param} has no tensor in llama.cpp's "
                            f"layout of this architecture (as {hf})",
                            fix="export a graph of the unmodified Hugging Face model (its "
                            "parameter names as transformers gives them)")
    return found


def _tensors_of(gm: GraphModule, mapped: list[tuple[str, str, str, Any]], reads: list[WeightRead],
                hp: Mapping[str, Any], family: _Family) -> list[_Tensor]:
    """The GGUF tensors of one parameter (several names when tied)."""
    out_names = {"output.weight"}
    tied = len({m[0] for m in mapped}) > 1 and any(m[2] in out_names for m in mapped) \
        and any(m[2] == "token_embd.weight" for m in mapped)
    if not tied:
        fq = _one_read(gm, reads, mapped[0][0])
        return [_Tensor(g, name, _compose(_qk_rows(hf, hp, family), rows), fq)
                for name, hf, g, rows in mapped]
    embed = next(m for m in mapped if m[2] == "token_embd.weight")
    head = next(m for m in mapped if m[2] in out_names)
    embed_fq = _one_read(gm, [r for r in reads if _is_embedding(r.consumer, gm)], embed[0])
    head_fq = _one_read(gm, [r for r in reads if not _is_embedding(r.consumer, gm)], head[0])
    tensors = [_Tensor(embed[2], embed[0], _identity, embed_fq)]
    if head_fq != embed_fq:  # the head reads its own version: llama.cpp then reads output
        tensors.append(_Tensor(head[2], head[0], _identity, head_fq))
    return tensors


def _compose(first: _Rows, then: _Rows) -> _Rows:
    """``then`` after ``first``."""
    if first is _identity:
        return then
    if then is _identity:
        return first
    return lambda t: then(first(t))


# -- quantizers ------------------------------------------------------------------------------
def _preset_for(fq: FakeQuantize) -> str:
    return "gguf-q4_0-qat" if quantizer_bits(fq) <= 4 else "gguf-q8_0-qat"


def _weight_format(gm: GraphModule, t: _Tensor, param: torch.Tensor,
                   views: tuple[Node, ...]) -> str | None:
    """The llama.cpp grid ``t`` is read through (None: read as float), or the refusal of
    a quantizer no GGUF type holds."""
    if t.fq is None:
        return None
    fq = gm.get_submodule(t.fq)
    if not fq.enabled:
        return None
    fmt = fq.block_format
    if fmt not in GGUF_WEIGHT_FORMATS:
        raise QCompileError(
            f"{WHERE}: layer weight {t.param} is quantized as {describe_scheme(fq, brief=True)} "
            f"(quantizer {t.fq}); no GGUF tensor type holds that grid exactly",
            fix=f"compile with the {_preset_for(fq)} preset (llama.cpp's "
            f"{'Q4_0' if quantizer_bits(fq) <= 4 else 'Q8_0'} blocks of 32), or a rule whose "
            "weight dtype is one of " + ", ".join(GGUF_WEIGHT_FORMATS))
    if fq.group_size != FORMATS[fmt].block:
        raise QCompileError(f"{WHERE}: layer weight {t.param}: {fmt} in blocks of "
                            f"{fq.group_size}; llama.cpp's {fmt.upper()} has blocks of "
                            f"{FORMATS[fmt].block}",
                            fix=f"drop group_size from the rule (the {fmt} default is "
                            f"{FORMATS[fmt].block})")
    _check_rows(t, param, views, fmt)
    return fmt


def _check_rows(t: _Tensor, param: torch.Tensor, views: tuple[Node, ...], fmt: str) -> None:
    """The quantizer's blocks must run along the parameter's last dim (its input
    dimension), as GGUF stores them: the views before it may only merge leading dims."""
    # (shapes only: the views of a sharded weight may exist only once it is gathered)
    x: torch.Tensor | None = torch.empty(param.shape, device="meta")
    for v in views:
        if x is None or call_name(v) in ("to", "contiguous", "alias"):  # same rows
            continue
        if call_name(v) not in ("reshape", "view", "_unsafe_view") or any(
                isinstance(a, Node) for a in v.args[1:]):
            x = None
            continue
        x = x.reshape(v.args[1] if len(v.args) == 2 else v.args[1:])
    if x is None or x.shape[-1:] != param.shape[-1:]:
        raise QCompileError(f"{WHERE}: layer weight {t.param}: its {fmt} blocks do not run "
                            "along the weight's input dimension (its last), as GGUF stores "
                            "them", fix="store the weight [out, in] (a Linear's layout), "
                            "or skip the layer in the spec")


def _weight_views(reads: list[WeightRead], fq: str | None) -> tuple[Node, ...]:
    return next((r.views for r in reads if r.fq == fq), ())


def _check_activations(gm: GraphModule, formats: Mapping[str, str]) -> None:
    """Every enabled activation quantizer must be the blocks llama.cpp makes of a
    weighted op's input on the fly for that op's weight type: anything else the file
    would not compute."""
    weights = {q.name for q in report(gm).quantizers if q.role == "weight"}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in weights:
            continue
        layer = sharded_linear(node)
        if layer is not None:  # a tensor-parallel layer quantizing its own input
            if layer.quantize_input:
                name = f"{node.target}.input_fake_quant"
                _check_activation(name, layer.input_fake_quant, _own_format(node, formats))
            continue
        fq = gm.get_submodule(str(node.target))
        if isinstance(fq, FakeQuantize):
            _check_activation(str(node.target), fq, _fed_weight_format(gm, node, formats))


def _check_activation(name: str, fq: FakeQuantize, wfmt: str | None) -> None:
    if not fq.enabled:
        return
    want = ON_THE_FLY.get(wfmt) if wfmt else None
    if fq.block_format is None or fq.block_format != want:
        _refuse_activation(name, fq, wfmt, want)


def _own_format(node: Node, formats: Mapping[str, str]) -> str | None:
    """The grid of a ``ShardedLinear`` call's weight (None when read as float)."""
    layer = sharded_linear(node)
    if layer is None or not layer.quantize_weight:
        return None
    return formats.get(f"{node.target}.weight_fake_quant")


def _fed_weight_format(gm: GraphModule, node: Node, formats: Mapping[str, str]) -> str | None:
    """The grid of the weight read by the op this activation quantizer feeds (None when
    it feeds no op with a quantized weight)."""
    for _, user in view_paths(node):  # through views and tp's gradient sums
        if (own := _own_format(user, formats)) is not None:
            return own
        for arg in user.all_input_nodes:
            while call_name(arg) in VIEWS and arg.args and isinstance(arg.args[0], Node):
                arg = arg.args[0]
            if arg.op == "call_module" and str(arg.target) in formats:
                return formats[str(arg.target)]
    return None


def _refuse_activation(name: str, fq: FakeQuantize, wfmt: str | None, want: str | None) -> None:
    if want is None:
        fix = ("compile with a gguf-* preset (gguf-q4_0-qat, gguf-q8_0-qat): they quantize "
               "only the inputs of llama.cpp-quantized weights, as llama.cpp does; or disable "
               f"it before exporting (gm.get_submodule({name!r}).enabled = False) if the "
               "float model is what you want")
        what = ("it is not the input of a layer whose weight is on a llama.cpp grid "
                f"({wfmt} has no known on-the-fly blocks)" if wfmt else
                "it is not the input of a layer whose weight is on a llama.cpp grid")
    else:
        fix = (f"quantize this input as {want} (llama.cpp's {want.upper()} blocks for "
               f"{wfmt.upper() if wfmt else ''} weights), as the gguf-* presets do")
        what = f"llama.cpp quantizes this input on the fly as {want.upper()}"
    scheme = describe_scheme(fq, brief=True)
    raise QCompileError(f"{WHERE}: activation quantizer {name} ({scheme}): {what}; the GGUF "
                        "file would compute something else", fix=fix)


# -- tensor data -----------------------------------------------------------------------------
def _data(t: _Tensor, p: torch.Tensor, fmt: str | None, keep_f32: bool
          ) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """(array, raw type) of one tensor from its rows ``p``: a grid's block bytes, or the
    float parameter (F32 where llama.cpp wants float32)."""
    if fmt is not None:
        if not bool(torch.isfinite(p).all()):
            raise QCompileError(f"{WHERE}: layer weight {t.param} holds NaN or inf, which no "
                                f"{fmt.upper()} block stores",
                                fix="train with a smaller learning rate or load finite weights")
        raw = ggml_bytes(p, fmt)
        return (raw.reshape(*p.shape[:-1], raw.shape[-1]),
                gguf.GGMLQuantizationType[fmt.upper()])
    if p.dtype not in (torch.float16, torch.bfloat16) or keep_f32:
        return p.float().numpy(), None
    if p.dtype == torch.float16:
        return p.numpy(), None
    # numpy has no bfloat16: the same bits through gguf-py's BF16 (exact: it rounds
    # float32 to the nearest bfloat16, and these values are bfloat16 already)
    bf16 = gguf.GGMLQuantizationType.BF16
    return gguf.quants.quantize(p.float().numpy(), bf16), bf16


def _keeps_f32(name: str, p: torch.Tensor) -> bool:
    """llama.cpp's rule (the converter's) for float tensors: 1-D tensors, norms, biases
    and the routers are float32. A router on a llama.cpp grid keeps its grid: llama.cpp's
    matmul reads any type, and quantizes the router's input on the fly as the graph did."""
    return (p.dim() <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or name.split(".")[-2] in _F32_ALWAYS)


def _file_type(kinds: Counter[str]) -> gguf.LlamaFileType:
    """llama.cpp's ``general.file_type``: the quantized type holding most weights (Q4_K
    with Q6_K beside it is Q4_K_M), else the float type of most 2-D weights."""
    quantized = Counter({k: n for k, n in kinds.items() if k in GGUF_WEIGHT_FORMATS})
    top = (quantized or kinds or Counter(["f32"])).most_common(1)[0][0]
    if top == "q4_k":
        top = "MOSTLY_Q4_K_M" if "q6_k" in quantized else "MOSTLY_Q4_K_S"
    return gguf.LlamaFileType[_FILE_TYPES.get(top, top)]


# -- config and metadata ----------------------------------------------------------------------
def _hparams(config: Any) -> dict[str, Any]:
    """The config as the converter reads it (``config.json``'s dict)."""
    if config is None:
        raise QCompileError(f"{WHERE}: no config: a compiled graph does not keep the Hugging "
                            "Face config, and the file needs its hyperparameters",
                            fix="pass config=model.config (the transformers config of the "
                            "model you compiled)")
    if isinstance(config, Mapping):
        hp = dict(config)
    elif hasattr(config, "to_dict"):
        hp = config.to_dict()
    else:
        raise QCompileError(f"{WHERE}: config is a {type(config).__name__}",
                            fix="pass the transformers config (model.config) or its dict")
    family = hp.get("model_type")
    if family not in FAMILIES:
        raise QCompileError(f"{WHERE}: architecture {family!r} is not supported (supported: "
                            f"{', '.join(FAMILIES)})",
                            fix="export one of the supported families, or use "
                            "qc.export_onnx for other models")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if not isinstance(hp.get(key), int):
            raise QCompileError(f"{WHERE}: config field {key} is {hp.get(key)!r}",
                                fix="pass the model's own transformers config")
    return hp


def _first(hp: Mapping[str, Any], *keys: str) -> Any:
    return next((hp[k] for k in keys if hp.get(k) is not None), None)


def _rope(hp: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE parameters as the converter gathers them (transformers 5's ``rope_parameters``
    or the older ``rope_scaling`` with a top-level ``rope_theta``)."""
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    rope = dict(rope.get("full_attention", rope))
    if "rope_theta" not in rope and hp.get("rope_theta") is not None:
        rope["rope_theta"] = hp["rope_theta"]
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    kind = rope.get("rope_type") or "default"
    if kind not in ("default", "linear", "yarn", "llama3"):
        raise QCompileError(f"{WHERE}: config rope_parameters rope_type {kind!r}: llama.cpp's "
                            "converter writes default, linear, yarn and llama3 RoPE for these "
                            "architectures", fix="export a model with one of those RoPE types")
    return rope


def _check_family(hp: Mapping[str, Any]) -> None:
    """Settings of a supported family that llama.cpp's graph for it does not compute."""
    if hp["model_type"] == "qwen2_moe" and hp.get("norm_topk_prob"):
        raise QCompileError(f"{WHERE}: config norm_topk_prob is true; llama.cpp's qwen2moe "
                            "graph does not renormalise the top-k router weights",
                            fix="export a model with norm_topk_prob false (as Qwen's "
                            "Qwen2-MoE checkpoints)")


def _write_hparams(w: gguf.GGUFWriter, hp: Mapping[str, Any], family: _Family,
                   ftype: gguf.LlamaFileType) -> None:
    """The architecture's keys, as ``TextModel.set_gguf_parameters`` and the family's class
    write them."""
    w.add_block_count(hp["num_hidden_layers"])
    if (n := _first(hp, "max_position_embeddings", "n_ctx", "n_positions")) is not None:
        w.add_context_length(n)
    w.add_embedding_length(hp["hidden_size"])
    if (n := hp.get("intermediate_size")) is not None:
        w.add_feed_forward_length(n)
    w.add_head_count(hp["num_attention_heads"])
    if (n := hp.get("num_key_value_heads")) is not None:
        w.add_head_count_kv(n)
    rope = _rope(hp)
    if rope.get("rope_type") == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn" and rope.get("factor") is not None:
        _write_yarn(w, rope)
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    if (eps := _first(hp, "rms_norm_eps", "norm_eps")) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (n := _first(hp, "num_local_experts", "num_experts")) is not None:
        w.add_expert_count(n)
    if (n := hp.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(n)
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(ftype)
    if family.arch == "llama":  # LlamaModel's own keys
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(head_dim or hp["hidden_size"] // hp["num_attention_heads"])
    if family.arch == "qwen2moe":  # Qwen2MoeModel's
        if (n := hp.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(n)
        if (n := hp.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(n)


def _write_yarn(w: gguf.GGUFWriter, rope: Mapping[str, Any]) -> None:
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                     ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
            add(rope[key])
    if (f := _first(rope, "attention_factor", "attn_factor")) is not None:
        w.add_rope_scaling_yarn_attn_factor(f)


def _llama3_rope_factors(hp: Mapping[str, Any], rope: Mapping[str, Any]) -> np.ndarray:
    """``rope_freqs.weight`` of Llama 3's RoPE: per frequency, 1 above the high-frequency
    wavelength, ``factor`` below the low one, a smooth blend between (the scaling
    transformers' ``llama3`` RoPE applies, which llama.cpp reads from this tensor)."""
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings",
                   hp.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# -- vocabulary ------------------------------------------------------------------------------
def _special_ids(hp: Mapping[str, Any]) -> dict[str, int]:
    """bos / eos / pad ids from the config (the first of a list), within the vocabulary."""
    out = {}
    for kind in ("bos", "eos", "pad"):
        v = hp.get(f"{kind}_token_id")
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(v, int) and 0 <= v < hp["vocab_size"]:
            out[kind] = v
    return out


def _plain_vocab(w: gguf.GGUFWriter, hp: Mapping[str, Any]) -> None:
    """A SentencePiece-model vocabulary of ``vocab_size`` placeholder tokens: llama.cpp
    needs token, score and type arrays of the embedding's size to load the file; the
    config's special ids become control tokens."""
    n = hp["vocab_size"]
    special = _special_ids(hp)
    names = {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}
    tokens = [f"<t{i}>" for i in range(n)]
    types = [gguf.TokenType.NORMAL] * n
    for kind, i in special.items():
        if types[i] == gguf.TokenType.NORMAL:  # bos == eos: one name
            tokens[i] = names[kind]
            types[i] = gguf.TokenType.CONTROL
    if 0 not in special.values():  # llama.cpp's SPM default unknown token is id 0
        tokens[0], types[0] = "<unk>", gguf.TokenType.UNKNOWN
        w.add_unk_token_id(0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    for kind, i in special.items():
        getattr(w, f"add_{kind}_token_id")(i)
    w.add_add_bos_token("bos" in special)
    w.add_add_eos_token(False)


def _tokenizer_vocab(w: gguf.GGUFWriter, tokenizer: Any, hp: Mapping[str, Any],
                     family: _Family) -> None:
    """The tokenizer's vocabulary as the converter writes it. The converter reads a model
    folder (tokenizer files next to ``config.json``) with gguf-py's vocabulary classes;
    so does this, from a scratch folder the tokenizer and config are saved to."""
    if not hasattr(tokenizer, "save_pretrained"):
        raise QCompileError(f"{WHERE}: tokenizer is a {type(tokenizer).__name__}",
                            fix="pass a transformers tokenizer (AutoTokenizer.from_pretrained"
                            "(...)), or none for a plain vocabulary")
    with tempfile.TemporaryDirectory(prefix="qcompile-gguf-vocab-") as folder:
        tokenizer.save_pretrained(folder)
        Path(folder, "config.json").write_text(json.dumps(dict(hp), default=str),
                                               encoding="utf-8")
        if family.spm and _llama_hf_vocab(w, Path(folder), hp["vocab_size"]):
            return
        _bpe_vocab(w, tokenizer, Path(folder), hp["vocab_size"], family.bpe_pre)


def _llama_hf_vocab(w: gguf.GGUFWriter, folder: Path, vocab_size: int) -> bool:
    """A SentencePiece-style BPE (byte fallback) as model ``llama`` (the converter's
    ``_set_vocab_llama_hf``); False when the tokenizer is not one (then it is a BPE)."""
    try:
        vocab = gguf.LlamaHfVocab(folder)
    except (FileNotFoundError, TypeError):
        return False
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    _check_vocab_size(len(tokens), vocab_size)
    _check_byte_tokens(tokens)
    for i in range(len(tokens), vocab_size):  # embedding rows beyond the tokenizer
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    return True


def _check_byte_tokens(tokens: list[bytes]) -> None:
    """llama.cpp's SentencePiece tokenizer spells a piece it has no token for in its byte
    tokens ``<0x00>`` .. ``<0xFF>``, looked up unchecked: a vocabulary without all 256
    aborts the llama.cpp process on the first such text. Refused here instead."""
    have = set(tokens)
    missing = [i for i in range(256) if f"<0x{i:02X}>".encode() not in have]
    if missing:
        raise QCompileError(
            f"{WHERE}: the tokenizer is SentencePiece-style (model 'llama') but has "
            f"{256 - len(missing)} of the 256 byte tokens <0x00>..<0xFF> (<0x{missing[0]:02X}> "
            "is missing): llama.cpp's tokenizer aborts on any text it must spell in bytes",
            fix="pass the model's own tokenizer (Llama's and Mistral's carry all 256 byte "
            "tokens), or export without tokenizer= (a plain vocabulary: llama.cpp evaluates "
            "token ids)")


def _check_vocab_size(n: int, vocab_size: int) -> None:
    if n > vocab_size:
        raise QCompileError(f"{WHERE}: the tokenizer has {n} tokens, the model's embedding "
                            f"{vocab_size} rows", fix="pass the tokenizer of this model")


def _bpe_vocab(w: gguf.GGUFWriter, tokenizer: Any, folder: Path, vocab_size: int,
               pre: str) -> None:
    """A byte-level BPE as model ``gpt2`` (the converter's ``_set_vocab_gpt2``): tokens by
    id, added tokens as control (special) or user-defined, unused ids padded."""
    vocab = tokenizer.get_vocab()
    _check_vocab_size(max(vocab.values()) + 1, vocab_size)
    by_id = {i: tok for tok, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoders = getattr(tokenizer, "added_tokens_decoder", {})
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = by_id[i]
        kind = gguf.TokenType.NORMAL
        if token in added:
            entry = decoders.get(i)
            if entry is not None and not entry.normalized:
                # llama.cpp takes added tokens as pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if (entry is not None and entry.special) or _looks_special(token):
                kind = gguf.TokenType.CONTROL
            else:
                token = token.replace("\u2581", " ")
                kind = gguf.TokenType.USER_DEFINED
        tokens.append(token)
        types.append(kind)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w, quiet=True)


def _looks_special(token: str) -> bool:
    """The converter's test for added tokens that act as control tokens though not marked
    special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


# -- the export ------------------------------------------------------------------------------
def _target(path: str | Path) -> Path:
    target = Path(path)
    if target.is_dir():
        raise QCompileError(f"{WHERE}: {str(path)!r} is a directory",
                            fix="give a file path, e.g. model.gguf")
    if target.exists() or target.is_symlink():
        raise QCompileError(f"{WHERE}: {str(path)!r} exists; a GGUF export never replaces a "
                            "file", fix="remove it first, or write to another path")
    if not target.parent.is_dir():
        raise QCompileError(f"{WHERE}: directory {str(target.parent)!r} does not exist",
                            fix="create it first or write somewhere else")
    return target


def _check_shapes(gm: GraphModule, plan: list[_Tensor], hp: Mapping[str, Any]) -> None:
    """The config must describe this graph: a wrong one gives a file llama.cpp refuses."""
    embed = next((t for t in plan if t.name == "token_embd.weight"), None)
    if embed is None:
        raise QCompileError(f"{WHERE}: the graph has no token embedding (model.embed_tokens)",
                            fix="compile the whole causal-LM model (AutoModelForCausalLM)")
    rows, width = gm.get_parameter(embed.param).shape
    if (rows, width) != (hp["vocab_size"], hp["hidden_size"]):
        raise QCompileError(f"{WHERE}: config vocab_size {hp['vocab_size']} / hidden_size "
                            f"{hp['hidden_size']} do not match the graph's embedding "
                            f"{embed.param} [{rows}, {width}]",
                            fix="pass the config of the model you compiled")
    layers = {int(t.name.split(".")[1]) for t in plan if t.name.startswith("blk.")}
    if layers != set(range(hp["num_hidden_layers"])):
        raise QCompileError(f"{WHERE}: config num_hidden_layers {hp['num_hidden_layers']}, "
                            f"the graph has {len(layers)} layers",
                            fix="pass the config of the model you compiled")


def export_gguf(gm: nn.Module, path: str | Path, *, config: Any = None,
                tokenizer: Any = None) -> Path:
    """Write ``gm`` (a graph ``qc.qcompile`` made from a Hugging Face ``llama``,
    ``mistral``, ``mixtral``, ``qwen2`` or ``qwen2_moe`` causal LM) as llama.cpp's GGUF to
    ``path`` (which must not exist) and return the path. ``config`` is the model's
    transformers config (or its dict); ``tokenizer`` an optional transformers tokenizer
    (without one: a plain vocabulary of ``vocab_size`` tokens). See the module for what is
    written and what is refused; everything is checked before the file is created. A graph
    sharded by tensor parallelism is exported by every rank together (each weight
    gathered in turn), as is one whose stages ``qc.distributed.pipeline`` spread over
    ranks; rank 0 writes the file, the other ranks return its path."""
    _require_gguf()
    graph = whole_graph(gm, WHERE, holds="a GGUF file", preset="gguf-q4_0-qat",
                        verb="export")
    writes = writes_here(graph)
    if not is_sharded(graph):
        target = _target(path)
    else:  # every rank exports a sharded or pipelined graph together; rank 0 writes
        target = agree_and_share(graph, unwrap(gm), WHERE, {
            "path": str(path), "config": config_fingerprint(config),
            "tokenizer": None if tokenizer is None else type(tokenizer).__name__},
            lambda: _target(path) if writes else Path(path))
    hp = _hparams(config)
    _check_family(hp)
    family = FAMILIES[hp["model_type"]]
    writer = _writer(graph, hp, family, _prepared(graph, hp, family), tokenizer, keep=writes)
    if writer is None:
        return target
    try:
        with atomic_path(target) as tmp:
            writer.write_header_to_file(path=tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
    finally:
        writer.close()
    return target


def _prepared(graph: GraphModule, hp: Mapping[str, Any], family: _Family
              ) -> list[tuple[_Tensor, str | None, bool]]:
    """Every tensor of the file with its grid (None: float) and whether llama.cpp wants it
    in F32, after every check: nothing is written for a graph the file cannot hold."""
    reads = weight_reads(graph)
    plan = _plan(graph, hp, family, reads)
    _check_shapes(graph, plan, hp)
    formats: dict[str, str] = {}
    prepared = []
    for t in plan:
        p = graph.get_parameter(t.param)
        fmt = _weight_format(graph, t, p, _weight_views(reads.get(id(p), []), t.fq))
        if fmt is not None and t.fq is not None:
            formats[t.fq] = fmt
        prepared.append((t, fmt, _keeps_f32(t.name, p)))
    _check_activations(graph, formats)
    return prepared


def _writer(graph: GraphModule, hp: Mapping[str, Any], family: _Family,
            prepared: list[tuple[_Tensor, str | None, bool]], tokenizer: Any, *,
            keep: bool = True) -> gguf.GGUFWriter | None:
    """A ``GGUFWriter`` holding the tensors, the metadata and the vocabulary, in memory.
    Each tensor is taken whole in turn (a tensor-parallel shard gathered: every rank makes
    the same gathers, in this order, and converts each tensor, so that a refusal is every
    rank's); ``keep`` False (a rank that does not write): none is kept, no writer."""
    rope = _rope(hp)
    writer = gguf.GGUFWriter(path=None, arch=family.arch) if keep else None
    kinds: Counter[str] = Counter()
    if writer is not None and family.arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                          _llama3_rope_factors(hp, rope))
    for t, fmt, keep_f32 in prepared:
        p = t.rows(gathered(graph.get_parameter(t.param)).detach().cpu()).contiguous()
        data, raw = _data(t, p, fmt, keep_f32)
        if writer is None:
            continue
        writer.add_tensor(t.name, data, raw_dtype=raw)
        if fmt is not None or not keep_f32:  # the weights a file type describes
            kinds[_kind(fmt, raw, data)] += p.numel()
    if writer is None:
        return None
    _write_metadata(writer, hp, family, _file_type(kinds))
    if tokenizer is None:
        _plain_vocab(writer, hp)
    else:
        _tokenizer_vocab(writer, tokenizer, hp, family)
    return writer


def _kind(fmt: str | None, raw: gguf.GGMLQuantizationType | None, data: np.ndarray) -> str:
    """A written tensor's type as ``_file_type`` counts it: the grid, or f32 / f16 / bf16."""
    if fmt is not None:
        return fmt
    if raw is gguf.GGMLQuantizationType.BF16:
        return "bf16"
    return "f16" if data.dtype == np.float16 else "f32"


def _write_metadata(w: gguf.GGUFWriter, hp: Mapping[str, Any], family: _Family,
                    ftype: gguf.LlamaFileType) -> None:
    """``general.*`` (type, name, size label, quantization version) and the architecture's
    hyperparameters, as the converter's ``prepare_metadata`` writes them."""
    w.add_type(gguf.GGUFType.MODEL)
    # the converter names a model by its folder: the last part of the config's source
    w.add_name(Path(str(hp.get("_name_or_path") or "")).name or hp["model_type"])
    total, shared, experts, count = w.get_total_parameter_count()
    if total > 0:
        w.add_size_label(gguf.size_label(total, shared, experts, count))
    _write_hparams(w, hp, family, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
