"""``plan_tensor_parallel`` and ``shard_tensor_parallel`` in one process: the plan ``auto``
finds on Llama (GQA) and Mixtral graphs, what it keeps whole and why, plans that cannot
hold (a clear error naming the layer and the fix), explicit plans, and golden dumps of
the rewrite for one rank's shards (and of a graph where no pair is found). The ranks'
training is in tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.graph.dump import format_graph
from qcompile.passes.plan_tensor_parallel import TP_PLAN_KEY
from qcompile.passes.shard_tensor_parallel import shard_tensor_parallel
from qcompile.runtime.sharded import (
    LocalExperts,
    ShardedFrozenLinear,
    ShardedLinear,
    SumGradients,
    SumPartial,
)

transformers = pytest.importorskip("transformers")


def llama(**over) -> nn.Module:
    conf = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**conf, **over}))


def compiled(model: nn.Module, preset: str = "8da4w-qat", **tp) -> torch.fx.GraphModule:
    spec = qc.load_spec(preset).model_dump()
    spec["tensor_parallel"] = {"size": 2, **tp}
    return qc.qcompile(model, qc.specs.as_spec(spec),
                       example_kwargs={"input_ids": torch.randint(0, 64, (2, 8))})


def styles(gm: torch.fx.GraphModule) -> dict[str, tuple[str, bool]]:
    return {r.layer: (r.style, r.gather) for r in qc.report(gm).tensor_parallel}


def test_llama_attention_mlp_head_and_embedding() -> None:
    gm = compiled(llama())
    s = styles(gm)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert {s[f"{attn}.{p}"] for p in ("q_proj", "k_proj", "v_proj")} == {("colwise", False)}
    assert s[f"{attn}.o_proj"] == ("rowwise", False)
    assert {s[f"{mlp}.{p}"] for p in ("gate_proj", "up_proj")} == {("colwise", False)}
    assert s[f"{mlp}.down_proj"] == ("rowwise", False)
    assert s["lm_head"] == ("colwise", True) and s["model.embed_tokens"] == ("rowwise", False)
    reasons = {r.layer: r.reason for r in qc.report(gm).tensor_parallel}
    assert f"{attn}.o_proj" in reasons[f"{attn}.q_proj"]
    # export records repeat_kv's expand and reshape with whole head counts (2 kv heads
    # repeated to 4): four shape arguments, each halved on a rank
    plan = gm.meta[TP_PLAN_KEY]
    assert sorted(size for _, _, size in plan.shape_args) == [2, 2, 4, 4]


def mixtral(experts: int = 4, layers: int = 1) -> nn.Module:
    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


@pytest.mark.parametrize("preset, region", [
    ("8da4w-qat", ["model.layers.0.mlp.experts.input_fake_quant_1"]),  # down's per-token input
    ("int8-qat", ["model.layers.0.mlp.experts.grouped_mm_fallback_fake_quant"]),  # gate/up out
])
def test_mixtral_experts_sharded_by_expert_router_kept_whole(preset: str,
                                                            region: list[str]) -> None:
    gm = compiled(mixtral(), preset)
    s = styles(gm)
    assert s["model.layers.0.self_attn.q_proj"] == ("colwise", False)
    assert s["model.layers.0.mlp.gate"][0] == "replicate"
    reasons = {r.layer: r.reason for r in qc.report(gm).tensor_parallel}
    assert "softmax" in reasons["model.layers.0.mlp.gate"]
    experts = "model.layers.0.mlp.experts"
    assert s[f"{experts}.gate_up_proj"][0] == s[f"{experts}.down_proj"][0] == "experts"
    assert "2 per rank" in reasons[f"{experts}.gate_up_proj"]
    plan = gm.meta[TP_PLAN_KEY]
    (e,) = plan.experts
    assert e.params == (f"{experts}.gate_up_proj", f"{experts}.down_proj") and e.experts == 4
    assert list(e.region) == region
    # the quantizers between the two matmuls read this rank's rows, as Shard of them
    assert all((q, -2) in plan.sliced_quantizers for q in region)
    assert e.first in [n.name for n in gm.graph.nodes] and e.second != e.first
    # this rank's rows only, from the gate/up output to the down input: no pipeline cut there
    assert e.first in e.rows and set(e.rows) <= plan.region_nodes and e.second not in e.rows


def test_mixtral_experts_not_divisible_are_sliced_within_each_expert() -> None:
    """3 experts do not split 2 ways: each expert's gate/up rows (gate's and up's halves
    alike: the product is cut in two) and down's input features are sliced, as an MLP
    pair; the quantizer on down's input reads a slice of its features."""
    gm = compiled(mixtral(experts=3))
    experts = "model.layers.0.mlp.experts"
    reasons = {r.layer: (r.style, r.reason) for r in qc.report(gm).tensor_parallel}
    assert reasons[f"{experts}.gate_up_proj"] == ("experts", (
        "within each of 3 experts: output rows sliced, each of its 2 pieces (gate, up) "
        "(_StridedShard(1, split_factor=2))"))
    style, reason = reasons[f"{experts}.down_proj"]
    assert style == "experts" and "input features sliced (Shard(2))" in reason
    plan = gm.meta[TP_PLAN_KEY]
    (e,) = plan.experts
    assert e.within and e.split == 2 and e.experts == 3
    assert (f"{experts}.input_fake_quant_1", -1) in plan.sliced_quantizers
    # the reshape back to [experts, out, in] after the gate/up quantizer reads the local
    # rows: its 256 rows a expert counted per rank
    assert [size for _, _, size in e.reshapes] == [256]
    assert set(e.reshapes) <= set(plan.shape_args)


def test_explicit_plan_naming_the_experts_slices_them_within() -> None:
    plan = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
            "*.o_proj": "rowwise", "*.experts.gate_up_proj": "colwise",
            "*.experts.down_proj": "rowwise"}
    (e,) = compiled(mixtral(), plan=plan).meta[TP_PLAN_KEY].experts  # 4 experts: within
    assert e.within and e.split == 2
    with pytest.raises(qc.QCompileError) as err:
        compiled(mixtral(), plan={**plan, "*.experts.down_proj": "colwise"})
    assert "planned colwise and colwise" in err.value.message
    assert "'model.layers.0.mlp.experts.down_proj' rowwise" in err.value.fix


@pytest.mark.parametrize("why, kwargs", [
    ("not sliced within each expert: its 32 intermediate features do not split into "
     "tensor_parallel.size 3", {"model": lambda: MoE(4), "size": 3}),
    ("planned replicate", {"plan": {"*.q_proj": "colwise", "*.k_proj": "colwise",
                                    "*.v_proj": "colwise", "*.o_proj": "rowwise"}}),
])
def test_experts_kept_whole_and_why(why: str, kwargs: dict[str, Any]) -> None:
    model = kwargs.pop("model", mixtral)()
    if isinstance(model, MoE):
        spec = qc.load_spec("8da4w-qat").model_dump()
        spec["tensor_parallel"] = {"size": 3}
        gm = qc.qcompile(model, qc.specs.as_spec(spec), example_inputs=(torch.randn(2, 8, 32),))
        name = "moe.experts.gate_up_proj"
    else:
        gm = compiled(model, **kwargs)
        name = "model.layers.0.mlp.experts.gate_up_proj"
    assert gm.meta[TP_PLAN_KEY].experts == ()
    reasons = {r.layer: (r.style, r.reason) for r in qc.report(gm).tensor_parallel}
    style, reason = reasons[name]
    assert style == "replicate" and why in reason, reason


def test_tied_embeddings_are_replicated() -> None:
    gm = compiled(llama(tie_word_embeddings=True))
    tied = [r for r in qc.report(gm).tensor_parallel if r.layer == "lm_head"]
    assert tied and all(r.style == "replicate" and "tied" in r.reason for r in tied)
    assert styles(gm)["model.layers.0.self_attn.q_proj"][0] == "colwise"


def test_heads_not_divisible_is_an_error_naming_the_layer() -> None:
    # 4 heads of 12: 48 features divide by 3, the heads do not
    with pytest.raises(qc.QCompileError) as e:
        compiled(llama(hidden_size=48, num_key_value_heads=4), "int8-qat", size=3)
    assert "self_attn" in e.value.message and "not divisible by" in e.value.message
    assert "size 3" in e.value.message and "replicate" in e.value.fix


def test_a_group_straddling_two_shards_is_an_error() -> None:
    # 8da4w: int4 groups of 32 along the input features; o_proj's 64 split 4 ways is 16
    with pytest.raises(qc.QCompileError) as e:
        compiled(llama(num_key_value_heads=4), size=4)
    assert "o_proj" in e.value.message and "straddle" in e.value.message
    assert "multiple of 32" in e.value.fix


def test_explicit_plan() -> None:
    plan = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
            "*.o_proj": "rowwise"}
    s = styles(compiled(llama(), plan=plan))
    assert s["model.layers.0.self_attn.q_proj"] == ("colwise", False)
    assert s["model.layers.0.mlp.gate_proj"][0] == "replicate"
    with pytest.raises(qc.QCompileError) as e:  # q colwise, o not rowwise
        compiled(llama(), plan={"*.q_proj": "colwise"})
    assert "q_proj" in e.value.message and "together" in e.value.fix
    with pytest.raises(qc.QCompileError) as e:
        compiled(llama(), plan={"*.qproj": "colwise"})
    assert "'*.qproj' matches no" in e.value.message


def test_without_shapes_is_an_error() -> None:
    spec = {"quant": {"mode": "none"}, "tensor_parallel": {"size": 2}}
    with pytest.raises(qc.QCompileError) as e:
        qc.qcompile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), spec)
    assert "example_inputs" in e.value.fix


def test_a_whole_tensor_observer_on_a_sharded_layer_is_refused() -> None:
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"}, "weight": {
        "dtype": "int8", "observer": "mse"}}]}, "tensor_parallel": {"size": 2}}
    with pytest.raises(qc.QCompileError) as e:
        qc.qcompile(m, spec, example_inputs=(torch.randn(2, 8),))
    assert "MseObserver" in e.value.message and "minmax" in e.value.fix


def test_adapters_follow_their_layers() -> None:
    """QLoRA: each adapted layer's base is planned as without adapters; ``lora_B`` of a
    colwise layer is colwise with it, ``lora_A`` of a rowwise layer rowwise (it reads the
    slice), the others whole; the NF4 block (64) must not straddle a rowwise shard."""
    spec = qc.load_spec("qlora-nf4").model_dump()
    spec["tensor_parallel"] = {"size": 2}
    ids = {"input_ids": torch.zeros(2, 8).long()}
    gm = qc.qcompile(llama(hidden_size=128, intermediate_size=256), spec, example_kwargs=ids)
    plan = {r.layer: r.style for r in qc.report(gm).tensor_parallel}
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "mlp.gate_proj", "mlp.up_proj"):
        layer = f"model.layers.0.{name}"
        assert (plan[layer], plan[f"{layer}.lora_A"], plan[f"{layer}.lora_B"]) == (
            "colwise", "replicate", "colwise"), name
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        layer = f"model.layers.0.{name}"
        assert (plan[layer], plan[f"{layer}.lora_A"], plan[f"{layer}.lora_B"]) == (
            "rowwise", "rowwise", "replicate"), name
    with pytest.raises(qc.QCompileError) as e:  # 64 features: 32 a rank, blocks of 64
        qc.qcompile(llama(), spec, example_kwargs=ids)
    assert "o_proj" in e.value.message and "straddle" in e.value.message, e.value.message
    assert "replicate" in e.value.fix


def test_compile_once_in_one_process_keeps_the_plan() -> None:
    """Without a process group compile_once is one process's compile (the plan recorded
    for a later wrap)."""
    spec = {"quant": {"mode": "qat"}, "tensor_parallel": {"size": 2}}
    gm = qc.distributed.compile_once(lambda: MLP(), spec, (torch.randn(2, 64),))
    assert [r.style for r in qc.report(gm).tensor_parallel] == ["colwise", "rowwise"]


class NormBetween(nn.Module):
    """up -> LayerNorm -> down, residual: the norm reads every feature, so up's slice cannot
    pass it; down's output meets the whole input."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.norm(self.up(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _sharded_dump(model: nn.Module) -> tuple[torch.fx.GraphModule, str]:
    torch.manual_seed(0)
    spec = qc.load_spec("8da4w-qat").model_dump()
    spec["tensor_parallel"] = {"size": 2}
    gm = qc.qcompile(model, qc.specs.as_spec(spec), example_inputs=(torch.randn(2, 64),))
    before = format_graph(gm)
    plan = "\n".join(f"{r.layer}: {r.style} ({r.reason})" for r in qc.report(gm).tensor_parallel)
    shard_tensor_parallel(gm, gm.meta[TP_PLAN_KEY])
    return gm, (f"## before shard_tensor_parallel\n{before}\n## plan\n{plan}\n"
                f"## after shard_tensor_parallel\n{format_graph(gm)}")


def test_golden_mlp_pair(golden) -> None:
    model = MLP()
    x = torch.randn(2, 64)
    gm, text = _sharded_dump(model)
    golden("shard_tensor_parallel_mlp", text)
    assert isinstance(gm.up, ShardedLinear) and isinstance(gm.down, ShardedLinear)
    # in one process (no DTensors) the rewritten graph is the compiled one: the same values
    ref = qc.qcompile(model, qc.specs.as_spec({**qc.load_spec("8da4w-qat").model_dump()}),
                      example_inputs=(torch.randn(2, 64),))
    ref.load_state_dict(gm.state_dict())
    assert torch.equal(gm(x), ref(x))


def test_golden_no_pair_found(golden) -> None:
    gm, text = _sharded_dump(NormBetween())
    golden("shard_tensor_parallel_no_pair", text)
    assert not any(isinstance(m, ShardedLinear) for m in gm.modules())
    assert "LayerNorm" in text or "layer_norm" in text


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(128, 256), nn.Linear(256, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


LORA_QAT = [{"match": {"module": ["Linear"]}, "rank": 4, "alpha": 8, "base": "qat"}]


@pytest.mark.parametrize(("preset", "adapters"), [("qlora-nf4", None),
                                                   ("8da4w-qat", LORA_QAT)],
                         ids=["qlora", "lora_qat"])
def test_golden_adapters(golden, preset: str, adapters: Any) -> None:
    """A LoRA MLP: up colwise with its lora_B, down rowwise with its lora_A. A frozen base
    becomes a ``ShardedFrozenLinear``; a QAT base's per-token input quantizer, read by the
    base and lora_A, gets its slice as a DTensor (``AsShard``) and hands back the local
    values."""
    spec = qc.load_spec(preset).model_dump()
    if adapters is not None:
        spec["adapters"] = adapters
    spec["tensor_parallel"] = {"size": 2}
    torch.manual_seed(0)
    gm = qc.qcompile(WideMLP(), qc.specs.as_spec(spec), example_inputs=(torch.randn(2, 128),))
    before = format_graph(gm)
    plan = "\n".join(f"{r.layer}: {r.style}" for r in qc.report(gm).tensor_parallel)
    shard_tensor_parallel(gm, gm.meta[TP_PLAN_KEY], SumGradients(None))
    golden(f"shard_tensor_parallel_{preset.replace('-', '_')}_lora",
           f"## before shard_tensor_parallel\n{before}\n## plan\n{plan}\n"
           f"## after shard_tensor_parallel\n{format_graph(gm)}")
    layer = ShardedFrozenLinear if adapters is None else ShardedLinear
    assert type(gm.up) is layer and type(gm.down) is layer
    assert isinstance(gm.down.lora_A, nn.Linear)  # the adapters stay the graph's modules
    assert ("to_local" in gm.code) == (adapters is not None)


class FusedHeads(nn.Module):
    """A fused q/k/v Linear whose output holds each head's q, k and v together (GPT-NeoX's
    layout), cut into q, k, v by ``chunk`` along the last dim: whole heads per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 3 * 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 4, 48).chunk(3, dim=-1)
        return x + self.out((q * k + v).reshape(b, s, 64))


class PackedGateUp(nn.Module):
    """gate and up in one Linear, cut in two along the features (Phi-3's gate_up_proj): a
    rank's rows would hold gate's or up's features only, so it stays whole."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(64, 256), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(torch.relu(gate) * up)


@pytest.mark.parametrize(("model", "styles"), [
    (FusedHeads, {"qkv": "colwise", "out": "rowwise"}),
    (PackedGateUp, {"gate_up": "replicate", "down": "replicate"})], ids=["heads", "packed"])
def test_chunk_keeps_the_slice_off_its_dim(model: type, styles: dict[str, str]) -> None:
    torch.manual_seed(0)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["tensor_parallel"] = {"size": 2}
    gm = qc.qcompile(model(), spec, example_inputs=(torch.randn(2, 8, 64),))
    plan = {r.layer: r for r in qc.report(gm).tensor_parallel}
    assert {k: plan[k].style for k in styles} == styles
    if model is PackedGateUp:
        assert "chunk along the sliced dim" in plan["gate_up"].reason, plan["gate_up"].reason


class MoE(nn.Module):
    """transformers' Mixtral mixture alone (router and experts, grouped_mm)."""

    def __init__(self, experts: int, intermediate: int = 32) -> None:
        super().__init__()
        cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=intermediate,
                                         num_local_experts=experts, num_experts_per_tok=2)
        cfg._experts_implementation = "grouped_mm"  # as from_config / from_pretrained set it
        torch.manual_seed(0)
        self.moe = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
        for p in self.moe.parameters():  # (the experts are allocated, not initialised)
            nn.init.normal_(p, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)


def _experts_dump(experts: int, intermediate: int = 32) -> tuple[torch.fx.GraphModule, str]:
    spec = qc.load_spec("8da4w-qat").model_dump()
    spec["tensor_parallel"] = {"size": 2}
    gm = qc.qcompile(MoE(experts, intermediate), qc.specs.as_spec(spec),
                     example_inputs=(torch.randn(2, 8, 32),))
    before = format_graph(gm)
    plan = "\n".join(f"{r.layer}: {r.style} ({r.reason})" for r in qc.report(gm).tensor_parallel)
    shard_tensor_parallel(gm, gm.meta[TP_PLAN_KEY], SumGradients(None))  # no mesh: not run
    return gm, (f"## before shard_tensor_parallel\n{before}\n## plan\n{plan}\n"
                f"## after shard_tensor_parallel\n{format_graph(gm)}")


def test_golden_experts(golden) -> None:
    """The two grouped matmuls become LocalExperts calls on the local weights (to_local,
    after their quantizers), the gate/up input's gradient summed, the down output's parts
    summed; the quantizer between them reads this rank's rows as a Shard."""
    gm, text = _experts_dump(4)
    golden("shard_tensor_parallel_experts", text)
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert sum(isinstance(gm.get_submodule(str(n.target)), LocalExperts) for n in calls) == 2
    assert sum(isinstance(gm.get_submodule(str(n.target)), SumPartial) for n in calls) == 1
    assert not [n for n in gm.graph.nodes
                if n.op == "call_function" and "grouped_mm" in str(n.target)]


def test_golden_experts_within(golden) -> None:
    """3 experts do not split 2 ways: sliced within each expert. The graph's own grouped
    matmuls stay; the fused gate/up weight is seen as [experts, 2, out / 2, in] before
    the graph's reshape for its quantizer, and read as local rows before the reshape
    back (its rows counted per rank); down's weight read local before its matmul; the
    gate/up input's gradient and the down products summed across tp."""
    gm, text = _experts_dump(3, intermediate=64)
    golden("shard_tensor_parallel_experts_within", text)
    calls = [gm.get_submodule(str(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    assert not any(isinstance(m, LocalExperts) for m in calls)
    assert sum(isinstance(m, SumPartial) for m in calls) == 1
    assert len([n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]) == 2
    reshapes = [n.args[1] for n in gm.graph.nodes
                if n.op == "call_function" and n.target is torch.reshape]
    # [experts, 2, out / 2, in] first; the reshape back counts this rank's 64 of 128 rows
    assert reshapes[0] == (3, 2, 64, 32) and (3, 64, 32) in reshapes, reshapes


def test_golden_experts_whole(golden) -> None:
    """3 experts do not split 2 ways, and down's 32 input features split 2 ways would cut
    8da4w's groups of 32: the mixture is left as compiled, with the reason."""
    gm, text = _experts_dump(3)
    golden("shard_tensor_parallel_experts_whole", text)
    assert not any(isinstance(m, (LocalExperts, SumPartial)) for m in gm.modules())
    assert "a group would straddle two shards" in text


# -- sequence parallelism: the norms between the blocks on each rank's tokens ----------------
LLAMA_PLAN = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
              "*.o_proj": "rowwise", "*.gate_proj": "colwise", "*.up_proj": "colwise",
              "*.down_proj": "rowwise", "model.embed_tokens": "rowwise", "lm_head": "colwise"}
NORMS = {"*.input_layernorm": "sequence", "*.post_attention_layernorm": "sequence",
         "model.norm": "sequence"}


def test_sequence_plan_on_llama() -> None:
    """torchtitan's Llama plan with the norms ``sequence``: the rowwise layers and the
    embedding hand over each rank's tokens, the colwise layers gather them, the norms'
    weights get their gradients summed; wrap's rewrite gathers each normed value once for
    all the colwise layers reading it (q, k and v share one gather)."""
    gm = compiled(llama(), "int8-qat", plan={**LLAMA_PLAN, **NORMS})
    s = styles(gm)
    layer = "model.layers.0"
    assert s[f"{layer}.input_layernorm"] == s["model.norm"] == ("sequence", False)
    assert s[f"{layer}.self_attn.q_proj"] == ("colwise", False) and s["lm_head"] == (
        "colwise", True)
    seq = gm.meta[TP_PLAN_KEY].sequence
    assert seq.dim == 1 and seq.norms == (f"{layer}.input_layernorm",
                                          f"{layer}.post_attention_layernorm", "model.norm")
    assert set(seq.enter) == {"model.embed_tokens", f"{layer}.self_attn.o_proj",
                              f"{layer}.mlp.down_proj"}
    assert "lm_head" in seq.leave and f"{layer}.mlp.up_proj" in seq.leave
    reasons = {r.layer: r.reason for r in qc.report(gm).tensor_parallel}
    assert "reduce-scattered" in reasons[f"{layer}.self_attn.o_proj"]
    assert "all-gathered" in reasons[f"{layer}.self_attn.k_proj"]
    plan = gm.meta[TP_PLAN_KEY]
    params = dict(plan.region_params)
    assert {f"{layer}.input_layernorm.weight", "model.norm.weight"} <= set(params)
    # int8-qat's residual-stream quantizers read each rank's tokens: combined once a step
    assert f"{layer}.output_fake_quant" in plan.region_quantizers
    shard_tensor_parallel(gm, plan, SumGradients(None))
    gathers = [n for n in gm.graph.nodes if str(n.target).startswith("tp_gather_tokens_")]
    assert len(gathers) == 3  # attention's input, the MLP's, the LM head's
    q, k = (next(n for n in gm.graph.nodes if n.target == f"{layer}.self_attn.{p}")
            for p in ("q_proj", "k_proj"))
    assert q.args[0] is k.args[0] and q.args[0] in gathers
    sums = {n.args[0].target for n in gm.graph.nodes
            if str(n.target).startswith("tp_sum_gradients_")}
    assert "model.norm.weight" in sums and len(sums) == len(params)


def qwen3() -> nn.Module:
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, use_cache=False,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


@pytest.mark.parametrize("case, words, fix", [
    ("a layer", ("q_proj", "sequence names the norms"), "norms' module names"),
    ("no such norm", ("'*.nonorm' (sequence) matches no module",), "input_layernorm"),
    ("per-head norm", ("q_norm", "whole on every rank"), "between the blocks"),
    ("odd tokens", ("7 tokens", "not divisible"), "multiple of 2"),
    ("mixture", ("view", "each token alone"), "replicate"),
    ("adapters", ("adapters",), "leave sequence out"),
])
def test_sequence_plans_that_cannot_hold(case: str, words: tuple[str, ...], fix: str) -> None:
    """Sequence parallelism only where each rank's tokens pass from rowwise layers through
    per-token ops to colwise layers; anything else is one error naming the node or layer."""
    plan, model, ids, spec = {**LLAMA_PLAN, **NORMS}, llama(), (2, 8), "int8-qat"
    if case == "a layer":
        plan = {"*q_proj": "sequence", **plan}
    elif case == "no such norm":
        plan["*.nonorm"] = "sequence"
    elif case == "per-head norm":  # Qwen3's q/k norms run inside attention, on heads
        model, plan["*.q_norm"] = qwen3(), "sequence"
    elif case == "odd tokens":
        ids = (2, 7)
    elif case == "mixture":  # Mixtral's block merges the tokens for its router and experts
        model = mixtral()
        plan = {k: v for k, v in plan.items() if k not in ("*.gate_proj", "*.up_proj",
                                                           "*.down_proj")}
    elif case == "adapters":
        spec = qc.load_spec("8da4w-qat").model_dump()
        spec["adapters"] = [{"match": {"module": ["Linear"]}, "rank": 4, "alpha": 8,
                             "base": "qat"}]
    d = qc.load_spec(spec).model_dump() if isinstance(spec, str) else spec
    d["tensor_parallel"] = {"size": 2, "plan": plan}
    with pytest.raises(qc.QCompileError) as e:
        qc.qcompile(model, qc.specs.as_spec(d),
                    example_kwargs={"input_ids": torch.randint(0, 64, ids)})
    for word in words:
        assert word in e.value.message, e.value.message
    assert fix in e.value.fix, e.value.fix


def test_sequence_with_pipeline_stages_is_refused() -> None:
    """From the spec alone, on every rank, before any communication."""
    from qcompile.distributed.tensor_parallel import mesh_dims

    spec = {"tensor_parallel": {"size": 2, "plan": {**LLAMA_PLAN, **NORMS}},
            "pipeline": {"stages": 2}}
    with pytest.raises(qc.QCompileError) as e:
        mesh_dims(spec, 4)
    assert "pipeline" in e.value.message and "sequence" in e.value.fix


class TinyLM(nn.Module):
    """Embedding, an RMS norm written as ops, an MLP pair with a residual, a final norm
    and a head: the smallest graph sequence parallelism applies to."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.norm1, self.norm2 = RMS(32), RMS(32)
        self.up, self.down, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(self.norm1(h))))
        return self.head(self.norm2(h))


class RMS(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("norms", [["norm*"], []], ids=["sequence", "norms_whole"])
def test_golden_sequence(golden, norms: list[str]) -> None:
    """The same explicit plan with the norms named ``sequence`` and without: with, each
    norm weight's read gets its gradient summed across tp and the colwise layers' input
    goes through one token gather each; without, the graph is sharded as before."""
    plan = {"up": "colwise", "down": "rowwise", "head": "colwise", "embed": "rowwise",
            **dict.fromkeys(norms, "sequence")}
    spec = qc.load_spec("int8-qat").model_dump()
    spec["tensor_parallel"] = {"size": 2, "plan": plan}
    torch.manual_seed(0)
    gm = qc.qcompile(TinyLM(), qc.specs.as_spec(spec),
                     example_inputs=(torch.randint(0, 64, (2, 8)),))
    before = format_graph(gm)
    lines = "\n".join(f"{r.layer}: {r.style} ({r.reason})"
                      for r in qc.report(gm).tensor_parallel)
    shard_tensor_parallel(gm, gm.meta[TP_PLAN_KEY], SumGradients(None))
    golden(f"shard_tensor_parallel_{'sequence' if norms else 'norms_whole'}",
           f"## before shard_tensor_parallel\n{before}\n## plan\n{lines}\n"
           f"## after shard_tensor_parallel\n{format_graph(gm)}")
    gathers = [n for n in gm.graph.nodes if str(n.target).startswith("tp_gather_tokens_")]
    assert len(gathers) == (2 if norms else 0)


def test_a_plan_naming_only_norms_plans_the_layers_as_auto() -> None:
    only_norms = styles(compiled(llama(), "int8-qat", plan=NORMS))
    auto = styles(compiled(llama(), "int8-qat"))
    assert {k: v for k, v in only_norms.items() if v[0] != "sequence"} == auto
    assert only_norms["model.norm"] == ("sequence", False)


def test_sequence_with_a_tied_embedding_kept_whole() -> None:
    """Gemma2: the embedding is tied to the LM head, so both stay whole. The first norm's
    tokens are cut from the embedding's output (a scatter, no communication), the LM head
    reads them all-gathered, and the norms' ``1 + weight`` (computed from the weight
    before it meets the tokens) gets its gradient summed across tp."""
    from qcompile.tools.architectures import ARCHITECTURES

    arch = ARCHITECTURES["gemma2"]
    spec = qc.load_spec("8da4w-qat").model_dump()
    spec["tensor_parallel"] = {"size": 2, "plan": {"*layernorm": "sequence",
                                                   "model.norm": "sequence"}}
    gm = qc.qcompile(arch.build(seed=0), qc.specs.as_spec(spec),
                     example_kwargs=arch.batch(seed=1, batch=2))
    seq = gm.meta[TP_PLAN_KEY].sequence
    s = styles(gm)
    assert s["lm_head"][0] == "replicate"  # (the embedding reads the same weight)
    assert len(seq.scatter) == 1 and len(seq.whole_readers) == 1
    assert "model.embed_tokens.weight" not in dict(gm.meta[TP_PLAN_KEY].region_params)
    assert len(seq.summed) == len(seq.norms) == 9  # 4 norms a layer and the final one
    shard_tensor_parallel(gm, gm.meta[TP_PLAN_KEY], SumGradients(None))
    head = next(n for n in gm.graph.nodes if n.name in seq.whole_readers)
    assert str(head.args[0].target).startswith("tp_gather_tokens_")
    assert sum(str(n.target).startswith("tp_scatter_tokens_") for n in gm.graph.nodes) == 1
