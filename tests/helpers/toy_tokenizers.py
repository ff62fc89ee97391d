"""Small transformers tokenizers trained here (no download) in the two shapes decoder LLMs
ship: a byte-level BPE (GPT-2, Llama 3, Qwen2) and a SentencePiece-style BPE with byte
fallback (Llama 2, Mistral), for the GGUF exporter's tests and llama.cpp's."""

from __future__ import annotations

import transformers

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world",
          "quantized models run in llama.cpp"] * 8


def bpe_tokenizer() -> object:
    """A byte-level BPE (every byte has a token: any text tokenizes), ``<|endoftext|>``
    its end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok,
                                                eos_token="<|endoftext|>")


def spm_tokenizer(byte_tokens: bool = True) -> object:
    """A SentencePiece-style BPE as Llama's tokenizer.json holds it (``\u2581`` for spaces,
    byte fallback to the 256 tokens ``<0x00>`` .. ``<0xFF>``; ``byte_tokens=False``: a
    vocabulary without them, which llama.cpp cannot tokenize text with)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"]
    if byte_tokens:
        special += [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=len(special) + 40, special_tokens=special, show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
