"""``qc.export_gguf``: llama.cpp's GGUF from graphs compiled from tiny Hugging Face decoders
(``qcompile.tools.architectures``: llama, mistral, mixtral, qwen2, qwen2_moe).

The references are built here, not read from the code under test:

- tensor names from a hand-written table of llama.cpp's names for these checkpoints;
- each tensor's values: the graph's own weight quantizer applied to the parameter (the
  weight the layer computes with), the parameter itself where no quantizer reads it; the
  file's tensor is dequantized by gguf-py (``gguf.quants.dequantize``, llama.cpp's formula)
  and must equal it bit for bit. llama's q / k rows are put back in Hugging Face's order
  with transformers' own GGUF loader code (``LlamaTensorProcessor``);
- logits: transformers loads the file (``from_pretrained(gguf_file=...)``) and must give
  the graph's logits with its activation quantizers off (llama.cpp's on-the-fly activation
  blocks are not transformers');
- metadata against the model's config;
- with ``QCOMPILE_E2E=1`` and llama-cpp-python installed, llama.cpp's own logits for every
  family's file (float32 key / value cache) against the QAT graph's, activation blocks on.

Every refusal is checked for its error, the names and fix in its message, and an empty
folder afterwards (no file, no temporary).
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import qcompile as qc
from qcompile.errors import QCompileError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from toy_tokenizers import bpe_tokenizer, spm_tokenizer  # noqa: E402
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor  # noqa: E402

from qcompile.tools.architectures import ARCHITECTURES  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                         "ignore::FutureWarning", "ignore::UserWarning")]

# each family with the preset it is exported with (Q4_0, and Q8_0 for mistral)
PRESETS = {"llama": "gguf-q4_0-qat", "mistral": "gguf-q8_0-qat", "mixtral": "gguf-q4_0-qat",
           "qwen2": "gguf-q4_0-qat", "qwen2_moe": "gguf-q4_0-qat"}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
             "qwen2_moe": "qwen2moe"}
# transformers reads these files back: not Mixtral (experts under arch "llama"), nor a file
# named "mistral" (transformers 5.24 asks gguf-py 0.19 for an architecture "mistral")
LOADABLE = ("llama", "qwen2", "qwen2_moe")

# llama.cpp's tensor names for these checkpoints (convert_hf_to_gguf.py's output)
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
        "output_norm.weight", "lm_head.weight": "output.weight"}


def expected_tensors(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """GGUF name -> values of one checkpoint tensor (fused experts: the gate half first)."""
    if name in _TOP:
        return {_TOP[name]: value}
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    assert m, name
    block, rest = m.groups()
    if rest == "mlp.experts.gate_up_proj":
        half = value.shape[1] // 2
        return {f"blk.{block}.ffn_gate_exps.weight": value[:, :half],
                f"blk.{block}.ffn_up_exps.weight": value[:, half:]}
    if rest == "mlp.shared_expert_gate.weight":  # llama.cpp's shape for it: {n_embd}
        value = value.reshape(-1)
    return {f"blk.{block}.{_LAYER[rest]}": value}


def as_used(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the weight the graph computes with: its quantizer's output, or
    the parameter."""
    fq = {q.node: q.name for q in qc.report(gm).quantizers if q.role == "weight"}
    out = {}
    with torch.no_grad():
        for name, p in gm.named_parameters():
            w = p.detach().clone()
            out[name] = gm.get_submodule(fq[name])(w) if name in fq else w
    return out


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, object]]:
    """The file's tensors (dequantized by gguf-py), their types and its metadata."""
    reader = gguf.GGUFReader(path)
    values, types = {}, {}
    for t in reader.tensors:
        values[t.name] = torch.from_numpy(
            np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        types[t.name] = t.tensor_type.name
    fields = {k: f.contents() for k, f in reader.fields.items()}
    return values, types, fields


def logits_of(out: object) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out.logits


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module", params=list(PRESETS))
def exported(request: pytest.FixtureRequest, folder: Path) -> SimpleNamespace:
    name = request.param
    arch = ARCHITECTURES[name]
    model, batch = arch.build(), arch.batch()
    gm = qc.qcompile(model, PRESETS[name], example_kwargs=batch)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    path = qc.export_gguf(gm, folder / f"{name}.gguf", config=model.config)
    values, types, fields = read(path)
    return SimpleNamespace(name=name, model=model, batch=batch, gm=gm.eval(), path=path,
                           values=values, types=types, fields=fields, before=before)


def test_every_tensor_is_the_graphs_weight_bit_for_bit(exported) -> None:
    e = exported
    config = e.model.config
    heads = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": config.num_key_value_heads}
    to_hf = LlamaTensorProcessor(config=heads)
    expected, quantized = {}, set()
    weights = {q.node for q in qc.report(e.gm).quantizers if q.role == "weight"}
    for name, value in as_used(e.gm).items():
        tensors = expected_tensors(name, value)
        expected.update(tensors)
        quantized |= set(tensors) if name in weights else set()
    assert set(e.values) == set(expected)
    grid = PRESETS[e.name].split("-")[1].upper()  # gguf-q4_0-qat -> Q4_0
    for gname, want in expected.items():
        got = e.values[gname]
        if GGUF_ARCH[e.name] == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            got = torch.from_numpy(to_hf.process(got.numpy(), gname).weights.copy())
        assert got.shape == want.shape, gname
        assert torch.equal(bits(got), bits(want)), gname
        assert e.types[gname] == (grid if gname in quantized else "F32"), gname
    # the graph is untouched
    after = e.gm.state_dict()
    assert all(torch.equal(after[k], v) for k, v in e.before.items())


def test_metadata_is_the_configs(exported) -> None:
    e = exported
    c, f = e.model.config, e.fields
    arch = GGUF_ARCH[e.name]
    assert f["general.architecture"] == arch
    assert f["general.type"] == "model"
    assert f["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    file_type = {"gguf-q4_0-qat": gguf.LlamaFileType.MOSTLY_Q4_0,
                 "gguf-q8_0-qat": gguf.LlamaFileType.MOSTLY_Q8_0}[PRESETS[e.name]]
    assert f["general.file_type"] == file_type
    assert f[f"{arch}.block_count"] == c.num_hidden_layers
    assert f[f"{arch}.context_length"] == c.max_position_embeddings
    assert f[f"{arch}.embedding_length"] == c.hidden_size
    assert f[f"{arch}.feed_forward_length"] == c.intermediate_size
    assert f[f"{arch}.attention.head_count"] == c.num_attention_heads
    assert f[f"{arch}.attention.head_count_kv"] == c.num_key_value_heads
    assert f[f"{arch}.rope.freq_base"] == c.rope_parameters["rope_theta"]
    assert f[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(c.rms_norm_eps)
    if arch == "llama":
        assert f["llama.vocab_size"] == c.vocab_size
        assert f["llama.rope.dimension_count"] == c.hidden_size // c.num_attention_heads
    if ARCHITECTURES[e.name].moe:
        experts = getattr(c, "num_local_experts", None) or c.num_experts
        assert f[f"{arch}.expert_count"] == experts
        assert f[f"{arch}.expert_used_count"] == c.num_experts_per_tok
    if e.name == "qwen2_moe":
        assert f["qwen2moe.expert_feed_forward_length"] == c.moe_intermediate_size
        assert f["qwen2moe.expert_shared_feed_forward_length"] == \
            c.shared_expert_intermediate_size
    # no tokenizer: a plain vocabulary of vocab_size tokens, the config's special ids
    assert f["tokenizer.ggml.model"] == "llama"
    for key in ("tokens", "scores", "token_type"):
        assert len(f[f"tokenizer.ggml.{key}"]) == c.vocab_size
    assert len(set(f["tokenizer.ggml.tokens"])) == c.vocab_size
    assert f["tokenizer.ggml.padding_token_id"] == c.pad_token_id
    if c.eos_token_id is not None:
        assert f["tokenizer.ggml.eos_token_id"] == c.eos_token_id
        assert f["tokenizer.ggml.bos_token_id"] == c.bos_token_id


def test_transformers_loads_the_file_and_computes_the_graph(exported) -> None:
    e = exported
    if e.name not in LOADABLE:
        pytest.skip(f"transformers does not load {e.name} GGUF files")
    # transformers' GGUF config mapping has no key for Qwen2-MoE's expert widths
    extra = {"config": e.model.config} if e.name == "qwen2_moe" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            e.path.parent, gguf_file=e.path.name, dtype=torch.float32, **extra).eval()
    weight_only = copy.deepcopy(e.gm)
    for q in qc.report(weight_only).quantizers:
        if q.role == "activation":
            weight_only.get_submodule(q.name).enabled = False
    with torch.no_grad():
        want = logits_of(weight_only(**e.batch))
        got = logits_of(loaded(**e.batch))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.e2e
def test_llama_cpp_computes_the_qat_graph(exported) -> None:
    """llama.cpp itself (llama-cpp-python) loads every family's file and gives the graph's
    logits, activation blocks on (its CPU matmul makes the same Q8_0 input blocks), with a
    float32 key / value cache (its default F16 cache rounds keys and values)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    e = exported
    ids = e.batch["input_ids"][1]  # the unpadded sequence
    seq = len(ids)
    with torch.no_grad():
        want = logits_of(e.gm(**e.batch))[1].float()
    f32 = 0  # ggml's type id of F32
    llm = llama_cpp.Llama(model_path=str(e.path), n_ctx=seq, n_batch=seq, logits_all=True,
                          n_threads=1, verbose=False, type_k=f32, type_v=f32)
    llm.eval(ids.tolist())
    got = torch.tensor(np.array(llm.scores[:seq]), dtype=torch.float32)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_bf16_float_graph_with_tied_embeddings(folder: Path) -> None:
    """No quantizer: 2-D weights keep the parameter's BF16, norms go F32; tied embeddings
    give no output.weight; the file type is MOSTLY_BF16."""
    arch = ARCHITECTURES["qwen2"]
    model = arch.build(tie_word_embeddings=True).to(torch.bfloat16)
    gm = qc.qcompile(model, {"quant": {"mode": "none"}}, example_kwargs=arch.batch())
    values, types, fields = read(qc.export_gguf(gm, folder / "bf16.gguf", config=model.config))
    assert "output.weight" not in values
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    for name, p in gm.named_parameters():
        for gname, want in expected_tensors(name, p.detach()).items():
            assert types[gname] == ("BF16" if p.dim() == 2 else "F32"), gname
            assert torch.equal(bits(values[gname]), bits(want)), gname


def test_tied_head_read_through_its_own_quantizer(folder: Path) -> None:
    """The embedding reads the shared tensor as float, the head through Q4_0: both are
    written (token_embd F32, output Q4_0) so that each stays exact."""
    arch = ARCHITECTURES["qwen2"]
    model = arch.build(tie_word_embeddings=True, num_hidden_layers=1)
    gm = qc.qcompile(model, "gguf-q4_0-qat", example_kwargs=arch.batch())
    values, types, _ = read(qc.export_gguf(gm, folder / "tied.gguf", config=model.config))
    embed = model.model.embed_tokens.weight.detach()
    assert types["token_embd.weight"] == "F32" and torch.equal(values["token_embd.weight"], embed)
    fq = {q.node: q.name for q in qc.report(gm).quantizers if q.role == "weight"}
    with torch.no_grad():
        head = gm.get_submodule(fq["lm_head.weight"])(embed.clone())
    assert types["output.weight"] == "Q4_0"
    assert torch.equal(bits(values["output.weight"]), bits(head))


def test_q4_k_file(folder: Path) -> None:
    """Super-blocks of 256: Q4_K weights, file type Q4_K_S."""
    arch = ARCHITECTURES["llama"]
    model = arch.build(hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    gm = qc.qcompile(model, "gguf-q4_k-qat", example_kwargs=arch.batch())
    values, types, fields = read(qc.export_gguf(gm, folder / "q4k.gguf", config=model.config))
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_S
    used = as_used(gm)
    for hf, gname in (("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                      ("lm_head.weight", "output.weight")):
        assert types[gname] == "Q4_K"
        assert torch.equal(bits(values[gname]), bits(used[hf]))


# -- the vocabulary --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def float_llama() -> SimpleNamespace:
    arch = ARCHITECTURES["llama"]
    model = arch.build(vocab_size=320, num_hidden_layers=1)
    gm = qc.qcompile(model, {"quant": {"mode": "none"}}, example_kwargs=arch.batch())
    return SimpleNamespace(model=model, gm=gm)


def test_byte_level_bpe_tokenizer(folder: Path, float_llama) -> None:
    tok = bpe_tokenizer()
    path = qc.export_gguf(float_llama.gm, folder / "bpe.gguf", config=float_llama.model.config,
                          tokenizer=tok)
    f = read(path)[2]
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == "llama-bpe"
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == 320 and len(f["tokenizer.ggml.token_type"]) == 320
    vocab = tok.get_vocab()
    assert all(tokens[i] == t for t, i in vocab.items())
    assert tokens[len(vocab):] == [f"[PAD{i}]" for i in range(len(vocab), 320)]
    assert f["tokenizer.ggml.token_type"][vocab["<|endoftext|>"]] == gguf.TokenType.CONTROL
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    want = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    assert f["tokenizer.ggml.merges"] == want
    assert f["tokenizer.ggml.eos_token_id"] == vocab["<|endoftext|>"]


def test_sentencepiece_style_tokenizer(folder: Path, float_llama) -> None:
    tok = spm_tokenizer()
    path = qc.export_gguf(float_llama.gm, folder / "spm.gguf", config=float_llama.model.config,
                          tokenizer=tok)
    f = read(path)[2]
    assert f["tokenizer.ggml.model"] == "llama"
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == len(f["tokenizer.ggml.scores"]) == 320
    assert all(tokens[i] == t for t, i in tok.get_vocab().items())
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"],
            f["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)
    byte = tok.get_vocab()["<0x41>"]
    assert f["tokenizer.ggml.token_type"][byte] == gguf.TokenType.BYTE


def test_a_sentencepiece_vocabulary_without_byte_tokens_is_refused(tmp_path: Path,
                                                                   float_llama) -> None:
    """llama.cpp spells text its SentencePiece vocabulary has no piece for in byte tokens,
    and aborts (std::out_of_range) where they are missing: refused before writing."""
    refused(tmp_path / "out", float_llama.gm, "SentencePiece-style", "byte tokens",
            "<0x00>", fix="the model's own tokenizer", config=float_llama.model.config,
            tokenizer=spm_tokenizer(byte_tokens=False))


# -- refusals --------------------------------------------------------------------------------
def refused(folder: Path, gm: torch.nn.Module, *words: str, fix: str, **kwargs: object
            ) -> QCompileError:
    """Export into an empty folder: a QCompileError naming ``words`` and ``fix``, and the
    folder still empty."""
    folder.mkdir(exist_ok=True)
    assert not os.listdir(folder)
    with pytest.raises(QCompileError) as info:
        qc.export_gguf(gm, folder / "model.gguf", **kwargs)
    for word in words:
        assert word in info.value.message, (word, info.value.message)
    assert info.value.fix is not None and fix in info.value.fix, info.value.fix
    assert os.listdir(folder) == []
    return info.value


@pytest.fixture(scope="module")
def small() -> SimpleNamespace:
    arch = ARCHITECTURES["llama"]
    model, batch = arch.build(num_hidden_layers=1), arch.batch()
    compile = lambda spec: qc.qcompile(model, spec, example_kwargs=batch)  # noqa: E731
    return SimpleNamespace(model=model, batch=batch, config=model.config, compile=compile,
                           float=compile({"quant": {"mode": "none"}}))


@pytest.mark.parametrize("preset, layer, scheme, fix", [
    ("w8-weight-only", "model.embed_tokens.weight", "int8 per_channel", "gguf-q8_0-qat"),
    ("mxfp4-qat", "model.layers.0.self_attn.q_proj.weight", "mxfp4 in blocks of 32",
     "gguf-q4_0-qat"),
])
def test_refuses_a_weight_scheme_gguf_does_not_hold(tmp_path, small, preset, layer, scheme,
                                                    fix) -> None:
    refused(tmp_path, small.compile(preset), layer, scheme, fix=fix, config=small.config)


def test_refuses_activation_quantizers_llama_cpp_does_not_apply(tmp_path, small) -> None:
    spec = {"quant": {"mode": "qat", "target": "generic", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "q4_0"},
         "activation": {"dtype": "int8", "symmetric": False, "granularity": "per_token"},
         "activation_at": "input"}]}}
    refused(tmp_path, small.compile(spec), "model.layers.0.self_attn.q_proj.input_fake_quant",
            "int8 per_token", "Q8_0", fix="q8_0", config=small.config)
    # the preset's Q8_0 input blocks, but before a weight read as float: llama.cpp's F32
    # matmul does not quantize its input
    gm = small.compile("gguf-q4_0-qat")
    gm.get_submodule("model.layers.0.mlp.up_proj.weight_fake_quant").enabled = False
    refused(tmp_path, gm, "model.layers.0.mlp.up_proj.input_fake_quant", "q8_0",
            fix="gguf-q4_0-qat", config=small.config)


def test_refuses_an_unsupported_architecture(tmp_path, small) -> None:
    config = {**small.config.to_dict(), "model_type": "phi3"}
    error = refused(tmp_path, small.float, "'phi3'", "llama", "qwen2_moe", "mixtral",
                    fix="export_onnx", config=config)
    assert "mistral" in error.message and "qwen2," in error.message


def test_refuses_without_config(tmp_path, small) -> None:
    refused(tmp_path, small.float, "config", fix="config=model.config")


def test_pipeline_stages_export_as_one_graph(tmp_path) -> None:
    """A graph placed in pipeline stages (one process, a child graph per stage) is read as
    one graph: after a training step its file is, byte for byte, that of the same model
    compiled without the pipeline section holding the same state."""
    arch = ARCHITECTURES["llama"]
    model, batch = arch.build(num_hidden_layers=2), arch.batch()
    spec = {**qc.load_spec("gguf-q4_0-qat").model_dump(),
            "pipeline": {"stages": 2, "devices": ["cpu", "cpu"]}}
    staged = qc.qcompile(model, spec, example_kwargs=batch)
    assert [n for n, _ in staged.named_children() if n.startswith("stage_")] == [
        "stage_0", "stage_1"]
    arch.loss(staged(**batch), batch).backward()
    torch.optim.SGD(staged.parameters(), lr=0.1).step()
    whole = qc.qcompile(model, "gguf-q4_0-qat", example_kwargs=batch)
    whole.load_state_dict(staged.state_dict())
    a = qc.export_gguf(staged, tmp_path / "staged.gguf", config=model.config)
    b = qc.export_gguf(whole, tmp_path / "whole.gguf", config=model.config)
    assert a.read_bytes() == b.read_bytes()
    fresh = qc.qcompile(model, "gguf-q4_0-qat", example_kwargs=batch)
    c = qc.export_gguf(fresh, tmp_path / "fresh.gguf", config=model.config)
    assert c.read_bytes() != a.read_bytes()  # the step changed what is written


def test_refuses_one_pipeline_stage(tmp_path, small) -> None:
    gm = small.compile({"quant": {"mode": "none"},
                        "pipeline": {"stages": 2, "devices": ["cpu", "cpu"]}})
    refused(tmp_path, gm.stage_0, "not compiled by qcompile", fix="qc.qcompile",
            config=small.config)


def test_refuses_sharded_weights(tmp_path, small) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of another test")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    gm = small.compile({"quant": {"mode": "none"}})
    name = "model.layers.0.self_attn.q_proj.weight"
    holder = gm.get_submodule(name.rpartition(".")[0])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        holder.weight = torch.nn.Parameter(
            distribute_tensor(holder.weight.detach(), mesh, [Shard(0)]))
        refused(tmp_path, gm, name, "DTensor", fix="full_tensor()", config=small.config)
    finally:
        dist.destroy_process_group()


def test_refuses_unmerged_adapters(tmp_path, small) -> None:
    gm = small.compile({"adapters": [{"match": {"module": "Linear", "name": "*q_proj"},
                                      "rank": 2}]})
    refused(tmp_path, gm, "adapters", "model.layers.0.self_attn.q_proj",
            fix="qc.merge_adapters", config=small.config)


def test_refuses_an_existing_path(tmp_path, small) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not replaced")
    with pytest.raises(QCompileError) as info:
        qc.export_gguf(small.float, path, config=small.config)
    assert "exists" in info.value.message and "remove it" in info.value.fix
    assert path.read_bytes() == b"not replaced" and os.listdir(tmp_path) == ["model.gguf"]


def test_fsdp2_blocks_export_as_one_graph(tmp_path) -> None:
    """A spec with ``data_parallel: fsdp2`` compiles each block as a child graph; the
    export reads them as one graph and writes, byte for byte, the file of the same model
    compiled without that section."""
    arch = ARCHITECTURES["llama"]
    model, batch = arch.build(num_hidden_layers=2), arch.batch()
    spec = {**qc.load_spec("gguf-q4_0-qat").model_dump(), "data_parallel": {"kind": "fsdp2"}}
    blocks = qc.qcompile(model, spec, example_kwargs=batch)
    assert [n for n, _ in blocks.named_children() if n.startswith("stage_")] == [
        "stage_0", "stage_1"]
    whole = qc.qcompile(model, "gguf-q4_0-qat", example_kwargs=batch)
    a = qc.export_gguf(blocks, tmp_path / "blocks.gguf", config=model.config)
    b = qc.export_gguf(whole, tmp_path / "whole.gguf", config=model.config)
    assert a.read_bytes() == b.read_bytes()
