"""Tiny Hugging Face models of every architecture family qcompile is checked on, built from
configs (random weights, never downloaded), with batches that hold a pad token.

Each ``Architecture`` builds its model with ``transformers``' own classes, from a config of
the real family shrunk to two layers and 64-wide hidden states: every Linear reads a
multiple of 64 features (so NF4's blocks of 64, NVFP4's 16 and int4 groups of 32 divide
it), attention has 4 heads (2 key/value heads where the family has grouped queries), and
mixture-of-experts families have 4 experts with 2 per token. ``pad_token_id`` is 0, as most
tokenizers' configs set one: transformers initialises that embedding row to zero, and
``batch`` pads the first sequence with it (its ``attention_mask`` zero there), the case that
turns an unsafe quantizer inside a normalisation into a NaN.

The caches are off (``use_cache=False``): a training graph keeps no key/value cache.

Example:
    >>> from qcompile.tools.architectures import ARCHITECTURES
    >>> arch = ARCHITECTURES["llama"]
    >>> model = arch.build()
    >>> batch = arch.batch()
    >>> sorted(batch), int((batch["input_ids"] == 0).sum()) > 0
    (['attention_mask', 'input_ids'], True)
    >>> loss = arch.loss(model(**batch), batch)
    >>> bool(loss.isfinite())
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB = 128
HIDDEN = 64
SEQ = 16
BATCH = 2
PAD = 0

# what every decoder config shares (the family's own names where they differ)
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, use_cache=False, pad_token_id=PAD)


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


@dataclass(frozen=True)
class Architecture:
    """One family: ``model`` and ``config`` are transformers class names, ``config_kwargs``
    what the tiny config sets; ``kind`` is ``decoder`` (causal LM: ``input_ids`` and
    ``attention_mask``, loss on the next token), ``encoder`` (``input_ids`` or
    ``pixel_values``, loss on the last hidden state) or ``seq2seq`` (T5: decoder ids too);
    ``moe``: a mixture of experts."""

    name: str
    model: str
    config: str
    config_kwargs: tuple[tuple[str, Any], ...]
    kind: str = "decoder"
    moe: bool = False
    common: bool = True  # start from _COMMON (families with their own names do not)

    def build(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """The tiny model, in training mode, with weights drawn under ``seed``;
        ``overrides`` change config fields (e.g. ``num_hidden_layers``)."""
        tf = _transformers()
        kwargs = dict(_COMMON) if self.common else {}
        kwargs.update(dict(self.config_kwargs))
        kwargs.update(overrides)
        config = getattr(tf, self.config)(**kwargs)
        torch.manual_seed(seed)
        return getattr(tf, self.model)(config).train()

    def batch(self, seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
        """Keyword inputs of one batch: token ids in [1, vocab) and, for token models, the
        last quarter of the first sequence padded (id 0, masked)."""
        g = torch.Generator().manual_seed(seed)
        if self.name == "vit":
            return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        ids[0, -(seq // 4):] = PAD
        mask[0, -(seq // 4):] = 0
        out = {"input_ids": ids, "attention_mask": mask}
        if self.kind == "seq2seq":
            out["decoder_input_ids"] = torch.randint(1, VOCAB, (batch, seq // 2), generator=g)
        return out

    def loss(self, out: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A training loss from the model's output: next-token cross entropy over the
        unpadded positions (decoders), the decoder ids' cross entropy (seq2seq), the mean
        square of half of the last hidden state's features summed (encoders: a normalised
        state's own mean square is constant, its gradient nothing)."""
        if self.kind == "encoder":
            hidden = _field(out, "last_hidden_state").float()
            return hidden[..., :hidden.shape[-1] // 2].sum(-1).square().mean() / hidden.shape[-1]
        logits = _field(out, "logits").float()
        if self.kind == "seq2seq":
            target = batch["decoder_input_ids"]
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               target.reshape(-1))
        ids = batch["input_ids"].clone()
        ids[batch["attention_mask"] == 0] = -100
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           ids[:, 1:].reshape(-1), ignore_index=-100)


def _field(out: Any, key: str) -> torch.Tensor:
    if isinstance(out, dict):
        return out[key]
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, key)


def _arch(name: str, model: str, config: str, kind: str = "decoder", moe: bool = False,
          common: bool = True, **config_kwargs: Any) -> Architecture:
    return Architecture(name, model, config, tuple(sorted(config_kwargs.items())), kind, moe,
                        common)


_MOE = dict(num_experts_per_tok=2)
# every family, in the order the docs' table lists them
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    _arch("llama", "LlamaForCausalLM", "LlamaConfig"),
    _arch("mistral", "MistralForCausalLM", "MistralConfig"),
    _arch("qwen2", "Qwen2ForCausalLM", "Qwen2Config"),
    _arch("qwen3", "Qwen3ForCausalLM", "Qwen3Config", head_dim=16),
    _arch("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", moe=True, num_experts=4,
          moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN, **_MOE),
    _arch("mixtral", "MixtralForCausalLM", "MixtralConfig", moe=True, num_local_experts=4,
          **_MOE),
    _arch("olmoe", "OlmoeForCausalLM", "OlmoeConfig", moe=True, num_experts=4, **_MOE),
    _arch("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", moe=True,
          n_routed_experts=4, moe_intermediate_size=HIDDEN, first_k_dense_replace=1,
          kv_lora_rank=HIDDEN, q_lora_rank=HIDDEN, qk_rope_head_dim=8, qk_nope_head_dim=8,
          v_head_dim=16, n_group=2, topk_group=1, num_key_value_heads=4, **_MOE),
    _arch("gemma2", "Gemma2ForCausalLM", "Gemma2Config", head_dim=16),
    _arch("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=16),
    _arch("phi3", "Phi3ForCausalLM", "Phi3Config"),
    _arch("falcon", "FalconForCausalLM", "FalconConfig", common=False, vocab_size=VOCAB,
          hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, use_cache=False,
          pad_token_id=PAD),
    _arch("gpt2", "GPT2LMHeadModel", "GPT2Config", common=False, vocab_size=VOCAB,
          n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, use_cache=False,
          pad_token_id=PAD),
    _arch("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig"),
    _arch("bloom", "BloomForCausalLM", "BloomConfig", common=False, vocab_size=VOCAB,
          hidden_size=HIDDEN, n_layer=2, n_head=4, use_cache=False, pad_token_id=PAD),
    _arch("bert", "BertModel", "BertConfig", kind="encoder", common=False, vocab_size=VOCAB,
          hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
          num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD),
    _arch("vit", "ViTModel", "ViTConfig", kind="encoder", common=False, hidden_size=HIDDEN,
          intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=4,
          image_size=16, patch_size=4),
    _arch("t5", "T5ForConditionalGeneration", "T5Config", kind="seq2seq", common=False,
          vocab_size=VOCAB, d_model=HIDDEN, d_ff=2 * HIDDEN, d_kv=16, num_layers=2,
          num_heads=4, use_cache=False, pad_token_id=PAD, decoder_start_token_id=PAD),
)}

DECODERS = [n for n, a in ARCHITECTURES.items() if a.kind == "decoder"]


def linear_weight_parameters(model: nn.Module) -> dict[str, int]:
    """The parameters of ``model`` that a linear layer reads as its weight, by name, with
    their element counts: ``nn.Linear`` and its subclasses, GPT-2's ``Conv1D``, and the 2-D
    and 3-D weights of mixture-of-experts experts and routers stored as bare parameters
    (anything named ``*.weight`` or held by an experts module that is not an embedding or a
    normalisation). The reference for the share of linear parameters a preset quantizes,
    computed from the model, not from the compiled graph."""
    found: dict[str, int] = {}
    for mname, m in model.named_modules():
        cls = type(m).__name__
        if isinstance(m, nn.Embedding) or "Norm" in cls or "Embedding" in cls:
            continue
        for pname, p in m.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if isinstance(m, nn.Linear) or cls == "Conv1D":
                if pname == "weight":
                    found[full] = p.numel()
            elif p.dim() in (2, 3) and not pname.endswith("bias"):
                found[full] = p.numel()  # experts / routers held as bare parameters
    return found


BuildFn = Callable[[], nn.Module]
