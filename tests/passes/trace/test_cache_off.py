"""A model whose Hugging Face config has ``use_cache`` on (transformers' default) compiles
with the cache off, the report says so and the model's config is left as it was; asking
for the cache in ``example_kwargs`` is refused with ``use_cache=False`` as the fix. Both
front ends."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qcompile as qc

transformers = pytest.importorskip("transformers")


class Cached(nn.Module):
    """A symbolic-traceable model with a transformers config: with the cache on it also
    returns the "cache" (its hidden state)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.GPT2Config(use_cache=True)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        h = self.fc(x)
        if self.config.use_cache:
            return h, h.detach()
        return h


def cache_note(gm: torch.fx.GraphModule) -> bool:
    return any("compiled with use_cache=False" in n
               for p in qc.report(gm).passes for n in p.notes)


def test_symbolic_model_compiles_with_the_cache_off() -> None:
    model = Cached()
    x = torch.randn(2, 8)
    gm = qc.qcompile(model, "int8-qat", example_inputs=(x,))
    assert qc.report(gm).trace_method == "symbolic"
    assert isinstance(gm(x), torch.Tensor)  # no cache output
    assert cache_note(gm)
    assert model.config.use_cache is True and isinstance(model(x), tuple)


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=32)
    assert cfg.use_cache is True  # transformers' default
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_hugging_face_model_compiles_with_the_cache_off(llama) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    gm = qc.qcompile(llama, "int8-qat", example_kwargs={"input_ids": ids})
    assert qc.report(gm).trace_method == "export"
    assert cache_note(gm)
    out = gm(input_ids=ids)
    assert list(out.keys()) == ["logits"]
    assert llama.config.use_cache is True
    ref = qc.qcompile(llama, {"quant": {"mode": "none"}}, example_kwargs={"input_ids": ids})
    torch.testing.assert_close(ref(input_ids=ids)["logits"],
                               llama(input_ids=ids, use_cache=False).logits)


def test_asking_for_the_cache_is_refused(llama) -> None:
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(qc.QCompileError, match="use_cache=True") as e:
        qc.qcompile(llama, "int8-qat", example_kwargs={"input_ids": ids, "use_cache": True})
    assert "use_cache=False" in e.value.fix
    assert llama.config.use_cache is True
