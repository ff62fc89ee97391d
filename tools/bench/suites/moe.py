"""The ``moe`` suite: mixture-of-experts language models (Mixtral-, Qwen2-MoE- and
DeepSeek-V3-style tiny configs of Hugging Face transformers, experts stored as 3-D
parameters behind grouped GEMMs) under the int8-qat and w4a8-qat presets: the fraction of
expert (and all) parameters behind a weight quantizer, the language-model loss over a
few AdamW steps (next to the float model's), and with ``quant.mode: none`` whether the
graph's logits are bit-identical to the model's and every router picks the same experts.
Prints as
``records``. Needs ``transformers`` (the ``models`` extra); models are built from configs,
never downloaded.

Example:
    >>> from qcompile.tools.bench.suites.moe import bench_moe
    >>> bench_moe.__doc__.splitlines()[0]
    'MoE language models: expert coverage, QAT loss, mode none identity.'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import qcompile as qc

# the presets as shipped, and int8-qat with the language-model head kept in float (the
# advice of docs/concepts/spec.md for a head whose output range keeps growing while training)
PRESETS = ("int8-qat", "int8-qat_float_head", "w4a8-qat")


def _spec(preset: str) -> qc.CompileSpec:
    if not preset.endswith("_float_head"):
        return qc.load_spec(preset)
    s = qc.load_spec(preset.removesuffix("_float_head")).model_dump()
    s["quant"]["rules"].insert(0, {"match": {"name": "lm_head"}, "skip": True})
    return qc.CompileSpec.model_validate(s)


def _configs() -> dict[str, Callable[[], nn.Module]]:
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, use_cache=False)

    def mixtral() -> nn.Module:
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2))

    def qwen2_moe() -> nn.Module:
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=128))

    def deepseek_v3() -> nn.Module:
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **common, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=64, first_k_dense_replace=1, n_group=1, topk_group=1,
            kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16))

    return {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "deepseek_v3": deepseek_v3}


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        return out["logits"]
    return out.logits if hasattr(out, "logits") else out[0]


def _expert_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """The routed experts' weights (3-D parameters, or the Linears of expert lists)."""
    return {n: p for n, p in model.named_parameters()
            if ".experts." in n and p.dim() >= 2}


def _covered(gm: nn.Module, names: dict[str, torch.Tensor]) -> float:
    qs = qc.quantizers(gm)
    total = sum(p.numel() for p in names.values())
    return sum(p.numel() for n, p in names.items() if f"{n}_fake_quant" in qs) / max(total, 1)


def _router_picks(model: nn.Module, gm: nn.Module, ids: torch.Tensor) -> bool:
    """Whether every top-k the graph computes picks what the model's routers pick: the
    graph's ``topk`` results (run by an fx Interpreter) against the model's, in order."""
    picks: list[torch.Tensor] = []

    class Record(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if n.op == "call_function" and "topk" in str(n.target):
                picks.append(out[1])
            return out

    ref: list[torch.Tensor] = []

    class Spy(torch.overrides.TorchFunctionMode):  # torch.topk and Tensor.topk alike
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if getattr(func, "__name__", "") == "topk":
                ref.append(out[1])
            return out

    with torch.no_grad():
        with Spy():
            model(input_ids=ids)
        # the graph's inputs in placeholder order: input_ids, the rest at their defaults
        args = [ids if n.target == "input_ids" else (n.args[0] if n.args else None)
                for n in gm.graph.nodes if n.op == "placeholder"]
        Record(gm).run(*args)
    return len(picks) == len(ref) > 0 and all(torch.equal(a, b) for a, b in zip(picks, ref))


def _train(model: nn.Module, ids: torch.Tensor, steps: int) -> list[float]:
    """Language-model losses of ``steps`` AdamW steps on one batch (next-token targets)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = _logits(model(input_ids=ids))
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def bench_moe(quick: bool) -> dict[str, Any]:
    """MoE language models: expert coverage, QAT loss, mode none identity."""
    try:
        builds = _configs()
    except ImportError:
        return {"skipped": "transformers is not installed (pip install qcompile[models])"}
    steps = 4 if quick else 20
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 32), generator=gen)
    for name, make in builds.items():
        torch.manual_seed(0)
        model = make().eval()
        experts = _expert_names(model)
        none = qc.qcompile(model, {"quant": {"mode": "none"}},
                           example_kwargs={"input_ids": ids})
        with torch.no_grad():
            identical = torch.equal(_logits(none(input_ids=ids)), _logits(model(input_ids=ids)))
        row: dict[str, Any] = {"none_bit_identical": float(identical),
                               "none_same_routing": float(_router_picks(model, none, ids))}
        for preset in ("fp32", *PRESETS):
            if preset == "fp32":
                gm = make()
                gm.load_state_dict(model.state_dict())
            else:
                gm = qc.qcompile(model, _spec(preset), example_kwargs={"input_ids": ids})
                row[f"{preset}_expert_params"] = _covered(gm, experts)
                row[f"{preset}_all_params"] = qc.report(gm).parameters_quantized
            losses = _train(gm, ids, steps)
            row[f"{preset}_loss_first"] = losses[0]
            row[f"{preset}_loss_last"] = losses[-1]
        out[name] = row
    return out
