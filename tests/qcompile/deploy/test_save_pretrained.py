"""``qc.save_pretrained``: Hugging Face checkpoints in the compressed-tensors format, from
graphs compiled from tiny transformers decoders (``qcompile.tools.architectures``).

The references are built here, not read from the code under test:

- the weight a layer computes with: the graph's own weight quantizer applied to the
  parameter (through the view the graph reads it by, for fused experts);
- logits: ``AutoModelForCausalLM.from_pretrained(folder)`` (transformers' compressed-tensors
  integration; it applies the activation quantization the config describes) against the
  graph's logits; loaded with ``CompressedTensorsConfig(dequantize=True)`` (weights
  decompressed at load, no activation quantization) against the graph's logits with its
  activation quantizers disabled;
- stored codes and scales: read from ``model.safetensors`` and unpacked with
  compressed-tensors' own helpers;
- ``config.json``: the model's config, and a ``quantization_config`` that
  compressed-tensors' ``QuantizationConfig`` parses.

Every refusal is checked for its error, the names and fix in its message, and nothing
written (no directory, no temporary).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import qcompile as qc
from qcompile.errors import QCompileError

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import (  # noqa: E402
    unpack_from_int32,
)
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from qcompile.tools.architectures import ARCHITECTURES  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                         "ignore::FutureWarning", "ignore::UserWarning")]

Q = "model.layers.0.self_attn.q_proj"


# -- helpers ---------------------------------------------------------------------------------
def build(name: str, **overrides: object) -> SimpleNamespace:
    arch = ARCHITECTURES[name]
    model = arch.build(**overrides)
    return SimpleNamespace(model=model, batch=arch.batch(), config=model.config)


def compiled(m: SimpleNamespace, spec: object) -> torch.nn.Module:
    return qc.qcompile(m.model, spec, example_kwargs=m.batch).eval()


def activations(gm: torch.nn.Module, on: bool) -> None:
    for q in qc.quantizers(gm).values():
        if not q.weight:
            q.enabled = on


def logits(model: torch.nn.Module, batch: dict, *, weight_only: bool = False) -> torch.Tensor:
    """The graph's (or a loaded model's) logits; ``weight_only``: the graph's activation
    quantizers off for the call."""
    was = {n: q.enabled for n, q in qc.quantizers(model).items()} if weight_only else {}
    if weight_only:
        activations(model, False)
    try:
        with torch.no_grad():
            out = model(**batch)
    finally:
        for n, on in was.items():
            model.get_submodule(n).enabled = on
    return out["logits"] if isinstance(out, dict) else out.logits


def load(folder: Path, *, dequantize: bool = False, **kwargs: object) -> torch.nn.Module:
    config = transformers.CompressedTensorsConfig(dequantize=True) if dequantize else None
    extra = {"quantization_config": config} if config is not None else {}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **extra, **kwargs).eval()


def used(gm: torch.nn.Module, param: str) -> torch.Tensor:
    """The weight the graph computes with: its quantizer applied to the parameter (a fused
    expert weight through the rows view the graph reads it by)."""
    p = gm.get_parameter(param).detach()
    fq = gm.get_submodule(f"{param}_fake_quant")
    with torch.no_grad():
        view = p.reshape(-1, p.shape[-1]) if p.dim() == 3 else p
        return fq(view).reshape(p.shape)


def saved(folder: Path, gm: torch.nn.Module, config: object) -> Path:
    """Save into ``folder``: its two files, no temporary beside it, and the modes any new
    folder and file get (safetensors alone would give 0600)."""
    out = qc.save_pretrained(gm, folder, config=config)
    assert out == folder and sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert not [n for n in os.listdir(folder.parent) if n.startswith(".")]  # no temporary
    probe = folder.parent / "probe"
    probe.mkdir()
    (probe / "file").write_text("")
    assert folder.stat().st_mode == probe.stat().st_mode
    for name in ("config.json", "model.safetensors"):
        assert (folder / name).stat().st_mode == (probe / "file").stat().st_mode, name
    (probe / "file").unlink()
    probe.rmdir()
    return folder


def quantization_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def refused(tmp_path: Path, gm: torch.nn.Module, *words: str, fix: str, config: object = None
            ) -> QCompileError:
    """Save into a new folder: a QCompileError naming ``words`` and ``fix``, and nothing
    written."""
    parent = tmp_path / "refused"
    parent.mkdir(exist_ok=True)
    before = sorted(os.listdir(parent))
    with pytest.raises(QCompileError) as info:
        qc.save_pretrained(gm, parent / "ckpt", config=config)
    for word in words:
        assert word in info.value.message, (word, info.value.message)
    assert info.value.fix is not None and fix in info.value.fix, info.value.fix
    assert sorted(os.listdir(parent)) == before
    return info.value


@pytest.fixture(scope="module")
def llama() -> SimpleNamespace:
    return build("llama")


# -- int4 groups with dynamic per-token int8 inputs (8da4w) ----------------------------------
@pytest.fixture(scope="module")
def da8w4(llama, tmp_path_factory) -> SimpleNamespace:
    """An 8da4w QAT graph still observing its weights (no freeze) after a training step:
    the weights moved since they were last observed."""
    gm = qc.qcompile(llama.model, "8da4w-qat", example_kwargs=llama.batch)
    opt = torch.optim.SGD(gm.parameters(), lr=1e-2)
    ARCHITECTURES["llama"].loss(gm(**llama.batch), llama.batch).backward()
    opt.step()
    gm.eval()
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    folder = saved(tmp_path_factory.mktemp("da8w4") / "ckpt", gm, llama.config)
    after = gm.state_dict()  # the graph is not modified (its observers neither)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return SimpleNamespace(gm=gm, folder=folder, **vars(llama))


def test_config_is_the_models_with_a_compressed_tensors_quantization_config(da8w4) -> None:
    written = json.loads((da8w4.folder / "config.json").read_text())
    loaded = transformers.AutoConfig.from_pretrained(da8w4.folder).to_dict()
    for key, value in da8w4.config.to_dict().items():
        if key not in ("transformers_version", "architectures", "dtype", "_name_or_path"):
            assert loaded[key] == value, key
    assert written["architectures"] == ["LlamaForCausalLM"] and written["dtype"] == "float32"
    qcfg = QuantizationConfig.model_validate(written["quantization_config"])
    assert qcfg.quant_method == "compressed-tensors" and qcfg.format == "pack-quantized"
    assert qcfg.quantization_status == "compressed" and qcfg.ignore == []
    (group,) = qcfg.config_groups.values()
    assert group.targets == ["Linear"]
    w, a = group.weights, group.input_activations
    assert (w.num_bits, w.type, w.symmetric, w.strategy, w.group_size) == (
        4, "int", True, "group", 32)
    assert (a.num_bits, a.type, a.symmetric, a.strategy, a.dynamic) == (
        8, "int", False, "token", True)


def test_stored_codes_and_scales_are_the_graphs(da8w4) -> None:
    tensors = load_file(da8w4.folder / "model.safetensors")
    for layer in (Q, "model.layers.1.mlp.down_proj", "lm_head"):
        fq = da8w4.gm.get_submodule(f"{layer}.weight_fake_quant")
        weight = used(da8w4.gm, f"{layer}.weight")
        scale = tensors[f"{layer}.weight_scale"]
        assert scale.dtype == torch.float32
        assert torch.equal(scale.reshape(-1), fq.scale.detach())  # after the graph's forward
        codes = unpack_from_int32(tensors[f"{layer}.weight_packed"], 4,
                                  torch.Size(weight.shape)).float()
        assert codes.min() >= -8 and codes.max() <= 7
        assert torch.equal(codes.reshape(len(weight), -1, 32) * scale.unsqueeze(-1),
                           weight.reshape(len(weight), -1, 32))


def test_transformers_computes_the_graph(da8w4) -> None:
    # compressed on load, decompressed on the first forward, inputs quantized per token
    # as the config says: the graph's logits, activation quantization included
    hf = load(da8w4.folder)
    torch.testing.assert_close(logits(hf, da8w4.batch), logits(da8w4.gm, da8w4.batch),
                               rtol=0, atol=1e-5)
    # dequantized at load (no activation quantization): the graph's weights, bit for bit
    hf = load(da8w4.folder, dequantize=True)
    state = hf.state_dict()
    for name, fq in ((q.node, q.name) for q in qc.report(da8w4.gm).quantizers
                     if q.role == "weight"):
        assert fq == f"{name}_fake_quant"
        assert torch.equal(state[name], used(da8w4.gm, name)), name
    torch.testing.assert_close(logits(hf, da8w4.batch),
                               logits(da8w4.gm, da8w4.batch, weight_only=True), rtol=0, atol=1e-5)


# -- int8 per channel, weight only: embeddings, tied heads, mixtures of experts ---------------
def test_tied_head_and_embedding_are_written_apart(tmp_path) -> None:
    m = build("qwen2", tie_word_embeddings=True)
    gm = compiled(m, "w8-weight-only")  # the embedding and head read one quantizer
    folder = saved(tmp_path / "ckpt", gm, m.config)
    written = json.loads((folder / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight_packed" in tensors  # compressed
    # an embedding is no layer compressed-tensors compresses: its fake-quantized values
    assert torch.equal(tensors["model.embed_tokens.weight"], used(gm, "lm_head.weight"))
    assert written["quantization_config"]["ignore"] == []
    hf = load(folder)
    torch.testing.assert_close(logits(hf, m.batch), logits(gm, m.batch), rtol=0, atol=1e-5)


def test_mixture_of_experts_per_expert(tmp_path) -> None:
    m = build("qwen2_moe")
    gm = compiled(m, "w8-weight-only")
    folder = saved(tmp_path / "ckpt", gm, m.config)
    tensors = load_file(folder / "model.safetensors")
    # transformers' own checkpoint layout: one linear layer per expert, gate and up apart
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for e in range(4):
            assert f"model.layers.0.mlp.experts.{e}.{proj}.weight_packed" in tensors
    assert "model.layers.0.mlp.experts.gate_up_proj" not in tensors
    # the router (not an nn.Linear) holds its fake-quantized values
    assert torch.equal(tensors["model.layers.0.mlp.gate.weight"],
                       used(gm, "model.layers.0.mlp.gate.weight"))
    hf = load(folder)
    torch.testing.assert_close(logits(hf, m.batch), logits(gm, m.batch), rtol=0, atol=1e-5)
    state = load(folder, dequantize=True).state_dict()  # experts merged back by transformers
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                 "model.layers.1.mlp.shared_expert.up_proj.weight"):
        assert torch.equal(state[name], used(gm, name)), name


def test_bf16_model_weights_bit_for_bit(tmp_path, llama) -> None:
    model = copy.deepcopy(llama.model).to(torch.bfloat16)
    gm = qc.qcompile(model, "w8-weight-only", example_kwargs=llama.batch).eval()
    folder = saved(tmp_path / "ckpt", gm, model.config)
    assert load_file(folder / "model.safetensors")[f"{Q}.weight_scale"].dtype == torch.float32
    # the float32 scales decompress to the graph's bfloat16 weights exactly
    state = load(folder, dequantize=True, dtype=torch.bfloat16).state_dict()
    for name in (f"{Q}.weight", "lm_head.weight", "model.layers.1.mlp.up_proj.weight"):
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], used(gm, name))


def test_mixed_schemes_target_their_layers_by_name(tmp_path, llama) -> None:
    def spec(attention: dict) -> dict:
        return {"quant": {"mode": "qat", "target": "generic", "rules": [
            {"match": {"name": "lm_head"}, "skip": True},
            {"match": {"module": "Linear", "name": "*self_attn*"}, "weight": attention},
            {"match": {"module": "Linear"}, "weight": {"dtype": "fp8_e4m3",
                                                      "granularity": "per_channel"}}]}}

    uint4 = {"dtype": "uint4", "granularity": "per_group", "group_size": 32}
    gm = compiled(llama, spec(uint4))  # symmetric uint4: zero point 8, signed int4 codes
    folder = saved(tmp_path / "ckpt", gm, llama.config)
    qcfg = QuantizationConfig.model_validate(quantization_config(folder))
    assert qcfg.format == "mixed-precision" and qcfg.ignore == []
    groups = {g.format: g for g in qcfg.config_groups.values()}
    assert sorted(groups) == ["float-quantized", "pack-quantized"]
    packed = groups["pack-quantized"]
    assert "re:^model\\.layers\\.0\\.self_attn\\.q_proj$" in packed.targets
    assert len(packed.targets) == 8 and len(groups["float-quantized"].targets) == 6
    assert (packed.weights.num_bits, packed.weights.symmetric) == (4, True)
    tensors = load_file(folder / "model.safetensors")
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    hf = load(folder)  # one scheme per layer, by name
    torch.testing.assert_close(logits(hf, llama.batch), logits(gm, llama.batch),
                               rtol=0, atol=1e-5)
    state = hf.state_dict()  # decompressed by the forward
    for name in (f"{Q}.weight", "model.layers.1.mlp.up_proj.weight"):
        assert torch.equal(state[name], used(gm, name)), name
    # asymmetric packed weights next to another scheme would not load in transformers
    refused(tmp_path, compiled(llama, spec({**uint4, "symmetric": False})),
            "asymmetric 4-bit", fix="symmetrically", config=llama.config)


def test_asymmetric_weights(tmp_path, llama) -> None:
    gm = compiled(llama, {"quant": {"mode": "qat", "target": "generic", "rules": [
        {"match": {"module": "Linear"}, "weight": {
            "dtype": "uint4", "symmetric": False, "granularity": "per_group",
            "group_size": 32}}]}})
    folder = saved(tmp_path / "ckpt", gm, llama.config)
    tensors = load_file(folder / "model.safetensors")
    fq = gm.get_submodule(f"{Q}.weight_fake_quant")
    # uint4 [0, 15] is compressed-tensors' int4 [-8, 7] shifted: zero points - 8, packed
    zp = unpack_from_int32(tensors[f"{Q}.weight_zero_point"], 4, torch.Size([64, 2]),
                           packed_dim=0)
    assert torch.equal(zp.reshape(-1).int(), fq.zero_point.int() - 8)
    # transformers' default path expects these zero points unpacked (compressed-tensors
    # 0.20); decompressed at load they give the graph's weights
    hf = load(folder, dequantize=True)
    state = hf.state_dict()
    for name in (f"{Q}.weight", "lm_head.weight"):
        assert torch.equal(state[name], used(gm, name)), name
    torch.testing.assert_close(logits(hf, llama.batch), logits(gm, llama.batch),
                               rtol=0, atol=1e-5)


# -- block formats ----------------------------------------------------------------------------
@pytest.mark.parametrize("preset, fmt", [("nvfp4-qat", "nvfp4-pack-quantized"),
                                         ("mxfp4-qat", "mxfp4-pack-quantized")])
def test_block_formats(tmp_path, llama, preset, fmt) -> None:
    gm = compiled(llama, preset)
    # activation blocks are computed with other formulas by compressed-tensors
    refused(tmp_path, gm, f"{Q}.input_fake_quant", preset.split("-")[0], "in blocks of",
            fix="enabled = False", config=llama.config)
    activations(gm, False)  # weight only: NVFP4A16 / MXFP4A16
    folder = saved(tmp_path / "ckpt", gm, llama.config)
    assert quantization_config(folder)["format"] == fmt
    tensors = load_file(folder / "model.safetensors")
    weight = used(gm, f"{Q}.weight")
    codes = unpack_fp4_from_uint8(tensors[f"{Q}.weight_packed"], 64, 64, torch.float32)
    scale = tensors[f"{Q}.weight_scale"]
    if fmt.startswith("nvfp4"):  # E4M3 block scales of 16 under a float32 global scale
        assert scale.dtype == torch.float8_e4m3fn
        step = scale.float() / tensors[f"{Q}.weight_global_scale"]
        decoded = (codes.reshape(64, -1, 16) * step.unsqueeze(-1)).reshape(64, 64)
        torch.testing.assert_close(decoded, weight, rtol=2**-22, atol=0)
    else:  # E8M0 exponents of blocks of 32
        assert scale.dtype == torch.uint8
        step = torch.exp2(scale.float() - 127)
        decoded = (codes.reshape(64, -1, 32) * step.unsqueeze(-1)).reshape(64, 64)
        assert torch.equal(decoded, weight)
    # float32 model: transformers' default path leaves compressed-tensors' bfloat16 FP4
    # decompression in a float32 model; dequantize=True casts it to the model's dtype
    hf = load(folder, dequantize=True)
    state = hf.state_dict()
    for name in (f"{Q}.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        want = used(gm, name)
        if fmt.startswith("nvfp4"):  # decompressed in bfloat16: within its rounding
            bound = want.abs() * torch.finfo(torch.bfloat16).eps
            assert bool(((state[name] - want).abs() <= bound).all()), name
        else:  # MX: powers of two, exact
            assert torch.equal(state[name], want), name
    ref = logits(gm, llama.batch)
    tol = 1e-5 if fmt.startswith("mx") else 2e-2 * float(ref.abs().max())
    torch.testing.assert_close(logits(hf, llama.batch), ref, rtol=0, atol=tol)


# -- static activations -------------------------------------------------------------------
def test_static_output_activations(tmp_path, llama) -> None:
    gm = qc.qcompile(llama.model, "int8-qat", example_kwargs=llama.batch)
    refused(tmp_path, gm, "model.rotary_emb.cat_fake_quant", "uint8", "not the input or the "
            "output", fix="enabled = False", config=llama.config)
    for name, q in qc.quantizers(gm).items():  # keep the linear layers' outputs only
        if not q.weight and not name.endswith(("proj.output_fake_quant",
                                                "lm_head.output_fake_quant")):
            q.enabled = False
    refused(tmp_path, gm, "no range yet", fix="qc.calibrate", config=llama.config)
    gm.train()
    with torch.no_grad():
        gm(**llama.batch)  # observers learn ranges
    qc.freeze(gm).eval()
    folder = saved(tmp_path / "ckpt", gm, llama.config)
    (group,) = QuantizationConfig.model_validate(quantization_config(folder)).config_groups.values()
    out = group.output_activations  # x86's 7-bit unsigned range: a 7-bit signed grid shifted
    assert (out.num_bits, out.symmetric, out.strategy, out.dynamic) == (7, False, "tensor", False)
    tensors = load_file(folder / "model.safetensors")
    fq = gm.get_submodule(f"{Q}.output_fake_quant")
    assert torch.equal(tensors[f"{Q}.output_scale"].reshape(-1), fq.scale.detach())
    assert int(tensors[f"{Q}.output_zero_point"]) == int(fq.zero_point) - 64
    torch.testing.assert_close(logits(load(folder), llama.batch), logits(gm, llama.batch),
                               rtol=0, atol=1e-5)


# -- adapters -----------------------------------------------------------------------------
def test_merged_adapters_save_like_any_graph(tmp_path, llama) -> None:
    spec = {"quant": {"mode": "qat", "target": "generic", "rules": [
        {"match": {"name": "lm_head"}, "skip": True},
        {"match": {"module": "Linear"},
         "weight": {"dtype": "int4", "granularity": "per_group", "group_size": 32}}]},
        "adapters": [{"match": {"module": "Linear", "name": "model.*"}, "rank": 4,
                      "alpha": 8, "base": "frozen"}]}
    gm = qc.qcompile(llama.model, spec, example_kwargs=llama.batch)
    with torch.no_grad():
        for name, p in gm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # trained adapters
    refused(tmp_path, gm, "LoRA adapters", Q, fix="qc.merge_adapters", config=llama.config)
    merged = qc.merge_adapters(gm).eval()
    folder = saved(tmp_path / "ckpt", merged, llama.config)
    assert quantization_config(folder)["ignore"] == ["lm_head"]
    torch.testing.assert_close(logits(load(folder), llama.batch),
                               logits(merged, llama.batch), rtol=0, atol=1e-5)


# -- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("spec, layer, scheme, fix", [
    ("gguf-q4_0-qat", f"{Q}.weight", "q4_0 in blocks of 32", "qc.export_gguf"),
    ({"quant": {"mode": "qat", "target": "generic", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "nf4"}}]}},
     f"{Q}.weight", "nf4 in blocks of 64", "8da4w-qat"),
    ({"quant": {"mode": "qat", "target": "generic", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "fp8_e5m2",
                                                  "granularity": "per_channel"}}]}},
     f"{Q}.weight", "fp8_e5m2", "fp8_e4m3"),
    ({"quant": {"mode": "qat", "target": "generic", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int4", "granularity": "per_group",
                                                  "group_size": 32},
         "activation": {"dtype": "int8", "granularity": "per_token"}, "activation_at": "input"}]}},
     f"{Q}.input_fake_quant", "int8 symmetric per_token", "enabled = False"),
])
def test_refuses_a_scheme_compressed_tensors_has_no_format_for(tmp_path, llama, spec, layer,
                                                                 scheme, fix) -> None:
    refused(tmp_path, compiled(llama, spec), layer, scheme, fix=fix, config=llama.config)


def test_refuses_experts_transformers_cannot_load(tmp_path) -> None:
    m = build("qwen2_moe", num_hidden_layers=1)
    float_experts = {"quant": {"mode": "qat", "target": "generic", "rules": [
        {"match": {"name": "*.experts"}, "skip": True},
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8",
                                                  "granularity": "per_channel"}}]}}
    refused(tmp_path, compiled(m, float_experts), "model.layers.0.mlp.experts",
            "are float", fix="quantize the experts", config=m.config)
    # the 8da4w preset quantizes the router's input: a router is no compressed layer
    refused(tmp_path, compiled(m, "8da4w-qat"), "model.layers.0.mlp.gate.input_fake_quant",
            fix="enabled = False", config=m.config)


def test_refuses_a_graph_it_cannot_save(tmp_path, llama) -> None:
    plain = compiled(llama, "w8-weight-only")
    refused(tmp_path, llama.model, "not compiled by qcompile", fix="qc.qcompile",
            config=llama.config)
    refused(tmp_path, plain, "no config", fix="config=model.config")
    other = build("qwen2").config
    refused(tmp_path, plain, "LlamaForCausalLM", "Qwen2ForCausalLM", fix="config of the "
            "model you compiled", config=other)
    smaller = transformers.LlamaConfig(**{**llama.config.to_dict(), "hidden_size": 32})
    refused(tmp_path, plain, "model.embed_tokens.weight", fix="config of the model you "
            "compiled", config=smaller)
    staged = compiled(build("llama", num_hidden_layers=2),
                      {"quant": {"mode": "none"}, "pipeline": {"stages": 2,
                                                               "devices": ["cpu", "cpu"]}})
    refused(tmp_path, staged.stage_1, "not compiled by qcompile", fix="qc.qcompile",
            config=llama.config)


def test_refuses_sharded_weights(tmp_path, llama) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of another test")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    gm = compiled(llama, {"quant": {"mode": "none"}})
    holder = gm.get_submodule(Q)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        holder.weight = torch.nn.Parameter(
            distribute_tensor(holder.weight.detach(), mesh, [Shard(0)]))
        refused(tmp_path, gm, f"{Q}.weight", "DTensor", fix="full_tensor()",
                config=llama.config)
    finally:
        dist.destroy_process_group()


def test_refuses_an_existing_file_or_non_empty_directory(tmp_path, llama) -> None:
    gm = compiled(llama, {"quant": {"mode": "none"}})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("kept")
    (tmp_path / "file").write_text("kept")
    for path, word in ((tmp_path / "full", "not empty"), (tmp_path / "file", "not a directory")):
        with pytest.raises(QCompileError) as info:
            qc.save_pretrained(gm, path, config=llama.config)
        assert word in info.value.message and info.value.fix
    assert sorted(os.listdir(tmp_path)) == ["file", "full"]
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    (tmp_path / "empty").mkdir()  # an empty directory is filled
    folder = qc.save_pretrained(gm, tmp_path / "empty", config=llama.config)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    # nothing quantized: a plain checkpoint, no quantization_config
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    torch.testing.assert_close(logits(load(folder), llama.batch), logits(gm, llama.batch),
                               rtol=0, atol=1e-5)


def test_pipeline_stages_save_as_one_graph(tmp_path) -> None:
    """A graph placed in pipeline stages (one process) is read as one graph: after a
    training step its checkpoint is, byte for byte, that of the same model compiled
    without the pipeline section holding the same state."""
    m = build("llama", num_hidden_layers=2)
    spec = {**qc.load_spec("8da4w-qat").model_dump(),
            "pipeline": {"stages": 2, "devices": ["cpu", "cpu"]}}
    staged = compiled(m, spec)
    ARCHITECTURES["llama"].loss(staged(**m.batch), m.batch).backward()
    torch.optim.SGD(staged.parameters(), lr=0.1).step()
    whole = compiled(m, "8da4w-qat")
    whole.load_state_dict(staged.state_dict())
    a = saved(tmp_path / "staged", staged, m.config)
    b = saved(tmp_path / "whole", whole, m.config)
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_fsdp2_blocks_save_as_one_graph(tmp_path) -> None:
    """A spec with ``data_parallel: fsdp2`` compiles each block as a child graph; the
    checkpoint reads them as one graph and is, byte for byte, that of the same model
    compiled without that section."""
    m = build("llama", num_hidden_layers=2)
    spec = {**qc.load_spec("8da4w-qat").model_dump(), "data_parallel": {"kind": "fsdp2"}}
    blocks = compiled(m, spec)
    assert [n for n, _ in blocks.named_children() if n.startswith("stage_")] == [
        "stage_0", "stage_1"]
    a = saved(tmp_path / "blocks", blocks, m.config)
    b = saved(tmp_path / "whole", compiled(m, "8da4w-qat"), m.config)
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
