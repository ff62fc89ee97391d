"""llama.cpp itself (llama-cpp-python, built from source: the ``llama`` extra) loads what
``qc.export_gguf`` writes and computes what the QAT graph computes.

A tiny Llama trained with ``gguf-q4_0-qat`` (so its weights sit on llama.cpp's Q4_0 grid
and its distributions are far from uniform) is exported and evaluated on held-out token
sequences inside llama.cpp; its next-token probabilities are compared with the graph's
(activation blocks on, as llama.cpp's CPU matmul quantizes its inputs to Q8_0) with the
metrics llama.cpp's perplexity tool reports: RMS delta-p of the true next token and the
share of positions whose top token agrees. A file written with a tokenizer (byte-level BPE,
SentencePiece-style) tokenizes text in llama.cpp as transformers does. Run by ``.ci/run``
(``QCOMPILE_E2E=1``) after the default suite, where the extra is installed.
"""

from __future__ import annotations

import math

import pytest
import torch

import qcompile as qc

pytestmark = pytest.mark.e2e

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 32


def _data(n: int, seed: int) -> torch.Tensor:
    """Token sequences of a small, learnable language: each next token is a fixed
    function of the current one (a random permutation of the vocabulary), 5% of them
    random, so a trained model predicts most next tokens with a high probability."""
    nxt = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, SEQ, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, SEQ):
        noise = torch.rand(n, generator=g) < 0.05
        out[:, t] = torch.where(noise, torch.randint(0, VOCAB, (n,), generator=g),
                                nxt[out[:, t - 1]])
    return out


def _trained_graph(preset: str) -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    width = 256 if preset == "gguf-q4_k-qat" else 64  # Q4_K: super-blocks of 256
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, use_cache=False, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    train = _data(64, 1)
    gm = qc.qcompile(model, preset, example_kwargs={"input_ids": train[:8]})
    opt = torch.optim.AdamW(gm.parameters(), lr=3e-3)
    for step in range(60):
        ids = train[(step * 8) % 64:(step * 8) % 64 + 8]
        logits = gm(input_ids=ids)["logits"]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    gm.eval()
    return gm, cfg


def _compare(ours: torch.Tensor, theirs: torch.Tensor, ids: torch.Tensor
             ) -> tuple[float, float, float]:
    """(RMS delta-p of the true next token, same-top-token rate, our mean p) of two
    [batch, seq, vocab] probability tensors."""
    nxt = ids[:, 1:].unsqueeze(-1)
    p_ours = ours[:, :-1].gather(-1, nxt).squeeze(-1)
    p_theirs = theirs[:, :-1].gather(-1, nxt).squeeze(-1)
    rms_dp = math.sqrt(float(((p_theirs - p_ours) ** 2).mean()))
    same_top = float((theirs.argmax(-1) == ours.argmax(-1)).float().mean())
    return rms_dp, same_top, float(p_ours.mean())


@pytest.mark.parametrize("preset", ["gguf-q4_0-qat", "gguf-q8_0-qat", "gguf-q4_k-qat"])
def test_llama_cpp_computes_what_the_qat_graph_computes(preset: str, tmp_path) -> None:
    gm, cfg = _trained_graph(preset)
    path = qc.export_gguf(gm, tmp_path / "model.gguf", config=cfg)
    held_out = _data(8, 2)  # (the batch size the graph was traced with)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=SEQ, n_batch=SEQ, logits_all=True,
                          n_threads=2, verbose=False)
    theirs = []
    for ids in held_out.tolist():
        llm.reset()
        llm.eval(ids)
        theirs.append(torch.tensor(llm.scores[:SEQ]).float())
    theirs = torch.softmax(torch.stack(theirs), dim=-1)
    with torch.no_grad():
        ours = torch.softmax(gm(input_ids=held_out)["logits"].float(), dim=-1)
        # the same weights with float activations: what a graph without llama.cpp's
        # activation blocks would have trained against
        acts = [q for q in qc.quantizers(gm).values() if not q.weight]
        for q in acts:
            q.enabled = False
        weights_only = torch.softmax(gm(input_ids=held_out)["logits"].float(), dim=-1)
        for q in acts:
            q.enabled = True
    assert theirs.shape == ours.shape
    rms_dp, same_top, p_next = _compare(ours, theirs, held_out)
    rms_w, same_w, _ = _compare(weights_only, theirs, held_out)
    print(f"{preset}: llama.cpp vs the QAT graph: RMS delta-p {rms_dp:.4%}, same top "
          f"{same_top:.2%} (weights only: {rms_w:.4%}, {same_w:.2%}); mean p(next) "
          f"{p_next:.3f}")
    assert p_next > 0.5  # the graph learned the language: peaked distributions compared
    assert rms_dp <= 0.002
    assert same_top >= 0.99


# -- the tokenizer, through llama.cpp's text path ---------------------------------------------
TEXTS = ["Hello world", "the quick brown fox jumps over the lazy dog",
         "  two  spaces,\ttabs\nand new lines", "ünïcödé, 漢字 and 🙂",
         "def f(x):\n    return x + 1"]


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_style"])
def test_llama_cpp_tokenizes_text_as_the_tokenizer_does(kind: str, tmp_path) -> None:
    """The vocabulary ``export_gguf(tokenizer=...)`` writes, inside llama.cpp: text becomes
    the ids transformers' tokenizer gives and those ids the same text again, with words
    the tokenizer never saw, whitespace runs, non-Latin scripts and characters only bytes
    spell (SentencePiece-style: byte fallback)."""
    from toy_tokenizers import bpe_tokenizer, spm_tokenizer

    tok = bpe_tokenizer() if kind == "byte_level_bpe" else spm_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 320, (1, 8), generator=torch.Generator().manual_seed(0))
    gm = qc.qcompile(model, {"quant": {"mode": "none"}}, example_kwargs={"input_ids": ids})
    path = qc.export_gguf(gm, tmp_path / "model.gguf", config=cfg, tokenizer=tok)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        want = tok.encode(text, add_special_tokens=False)
        got = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert got == want, (text, got, want)
        assert tok.decode(want) == text, text
        # llama.cpp's pieces keep the space SentencePiece puts before the text
        lead = " " if kind == "sentencepiece_style" else ""
        assert llm.detokenize(got).decode() == lead + text, text
