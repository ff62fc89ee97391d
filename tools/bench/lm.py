"""A small Llama-style character language model trained on text that ships with Python,
for ``qcompile-bench algorithms`` and ``qcompile-bench llm``: real text every machine has,
no download.

Data (``LMConfig.text``): ``"stdlib"``, the ``*.py`` files under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and ``dist-packages`` left out: they
differ from machine to machine), sorted by relative path; every ``val_every``-th file is
held out for validation, the others are training text. ``"english"``: the English reference
pages of ``pydoc_data.topics`` (the language reference as ``help()`` shows it), every
``val_every``-th topic (sorted by name) held out for validation; the training text is the
other topics followed by the stdlib's training files. Each split is the concatenation of
its parts cut at a character budget. The vocabulary is the training text's characters seen
at least ``min_count`` times, plus ``<unk>`` (id 0).

Model: token embedding, ``layers`` pre-norm blocks (``nn.RMSNorm``, causal self-attention
with rotary positions through ``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU
MLP), a final RMSNorm and an untied Linear head; no biases. With ``experts`` > 0 each
block's MLP is a mixture of experts (``MoE``: a Linear router, softmax, the top ``top_k``
experts per token, each a SwiGLU of width ``hidden``, run on the tokens routed to it only).
It traces with ``torch.fx.symbolic_trace`` (no data-dependent control flow), so qcompile
compiles it.

Trained float weights are cached under ``~/.cache/qcompile-bench/`` (``QCOMPILE_BENCH_CACHE``
overrides the directory), keyed by a hash of the config, the training text and the torch
version, so repeated runs skip training.

Example (a tiny model on a tiny slice of the text, no training):
    >>> import dataclasses, torch
    >>> from qcompile.tools.bench.lm import LMConfig, TinyLlama, load_text
    >>> cfg = LMConfig(layers=1, dim=32, heads=2, hidden=64, context=16,
    ...                train_chars=20_000, val_chars=2_000)
    >>> data = load_text(cfg)
    >>> data.vocab[0], len(data.val) == 2_000
    ('<unk>', True)
    >>> model = TinyLlama(cfg, len(data.vocab))
    >>> x = data.train[:32].view(2, 16)
    >>> model(x).shape == (2, 16, len(data.vocab))
    True
    >>> gm = torch.fx.symbolic_trace(model)
    >>> bool(torch.allclose(gm(x), model(x)))
    True
    >>> moe = TinyLlama(dataclasses.replace(cfg, experts=4), len(data.vocab))
    >>> bool(torch.allclose(torch.fx.symbolic_trace(moe)(x), moe(x)))
    True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Everything that fixes the model and its trained weights."""

    layers: int = 4
    dim: int = 128
    heads: int = 4
    hidden: int = 384           # SwiGLU width
    context: int = 128
    train_chars: int = 3_000_000
    val_chars: int = 65_536     # 512 windows of 128: the perplexity's text
    val_every: int = 10         # every 10th file (sorted) is validation
    min_count: int = 5          # rarer characters read as <unk>
    steps: int = 400
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 50
    seed: int = 0
    text: str = "stdlib"        # "stdlib" | "english" (see the module docstring)
    experts: int = 0            # > 0: mixture-of-experts MLPs of this many experts
    top_k: int = 2              # experts per token

    def key(self, text_digest: str) -> str:
        """Cache key: the config, the training text and the torch version (numerics).
        ``text``, ``experts`` and ``top_k`` enter it only when not at their defaults, so
        the keys of configs without them stay what they were."""
        fields = dataclasses.asdict(self)
        for name in ("text", "experts", "top_k"):
            if fields[name] == LMConfig.__dataclass_fields__[name].default:
                del fields[name]
        blob = json.dumps([fields, text_digest, torch.__version__], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class TextData:
    vocab: list[str]            # id -> character; 0 is <unk>
    train: torch.Tensor         # int64 ids
    val: torch.Tensor
    digest: str                 # sha256 of the training text
    files: tuple[int, int]      # (training, validation) files (and topic pages) read


def stdlib_sources() -> list[Path]:
    """The stdlib's ``*.py`` files, sorted by path relative to the stdlib directory."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not skip & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _take(files: list[Path], budget: int) -> tuple[str, int]:
    parts, total, used = [], 0, 0
    for p in files:
        if total >= budget:
            break
        # a few stdlib files are latin-1 or deliberately broken: replace, don't skip,
        # so the text depends on the file list only
        t = p.read_text(encoding="utf-8", errors="replace") + "\n"
        parts.append(t)
        total += len(t)
        used += 1
    return "".join(parts)[:budget], used


def english_topics() -> list[str]:
    """The pages of ``pydoc_data.topics`` (English reference text), sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[name] + "\n" for name in sorted(topics)]


def load_text(cfg: LMConfig) -> TextData:
    """The training and validation splits as ids (deterministic for a given stdlib)."""
    if cfg.text not in ("stdlib", "english"):
        raise ValueError(f"LMConfig.text is 'stdlib' or 'english', not {cfg.text!r}")
    files = stdlib_sources()
    val_files = files[::cfg.val_every]
    train_files = [p for i, p in enumerate(files) if i % cfg.val_every]
    if cfg.text == "english":
        pages = english_topics()
        held = pages[::cfg.val_every]
        kept = [t for i, t in enumerate(pages) if i % cfg.val_every]
        english = "".join(kept)
        rest, used = _take(train_files, max(0, cfg.train_chars - len(english)))
        train = (english + rest)[:cfg.train_chars]
        val = "".join(held)[:cfg.val_chars]
        n_train, n_val = len(kept) + used, len(held)
    else:
        train, n_train = _take(train_files, cfg.train_chars)
        val, n_val = _take(val_files, cfg.val_chars)
    counts = Counter(train)
    vocab = ["<unk>", *sorted(c for c, n in counts.items() if n >= cfg.min_count)]
    index = {c: i for i, c in enumerate(vocab)}

    def ids(text: str) -> torch.Tensor:
        return torch.tensor([index.get(c, 0) for c in text], dtype=torch.long)

    return TextData(vocab, ids(train), ids(val), hashlib.sha256(train.encode()).hexdigest(),
                    (n_train, n_val))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, -1).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v,
                                           is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Mixture of experts: ``router`` scores each token, the ``top_k`` best experts (by
    softmax probability, renormalised over the chosen ones) each run on the tokens routed
    to them only, and their outputs are added back at those tokens' rows."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2)
        probs, index = torch.topk(self.router(flat).softmax(dim=-1), self.top_k, dim=-1)
        gates = probs / probs.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = index == e  # [tokens, top_k]: at most one True per row
            rows = hit.any(dim=-1).nonzero().squeeze(-1)
            gate = (gates * hit).sum(dim=-1)[rows].unsqueeze(-1)
            out = out.index_add(0, rows, expert(flat[rows]) * gate)
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp: nn.Module = (MoE(cfg.dim, cfg.hidden, cfg.experts, cfg.top_k) if cfg.experts
                               else SwiGLU(cfg.dim, cfg.hidden))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """ids [batch, tokens] (tokens <= context) -> logits [batch, tokens, vocab]."""

    def __init__(self, cfg: LMConfig, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab, bias=False)
        half = cfg.dim // cfg.heads // 2
        freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
        angle = torch.arange(cfg.context, dtype=torch.float32)[:, None] * freq
        # rotary tables as buffers, sliced to the input's length: a traceable getitem
        self.register_buffer("cos", torch.cat((angle.cos(), angle.cos()), -1), persistent=False)
        self.register_buffer("sin", torch.cat((angle.sin(), angle.sin()), -1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # the rotary rows of positions 0..t-1: an arange index traces (a slice by a traced
        # length does not)
        pos = torch.arange(ids.shape[1], device=ids.device)
        cos, sin = self.cos[pos], self.sin[pos]
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def windows(ids: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping (input, target) windows of ``context`` tokens."""
    n = (len(ids) - 1) // context
    x = ids[:n * context].view(n, context)
    y = ids[1:n * context + 1].view(n, context)
    return x, y


@torch.no_grad()
def perplexity(model: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
               context: int, batch: int = 64) -> float:
    """exp(mean next-character cross-entropy) over non-overlapping windows of ``ids``."""
    if isinstance(model, nn.Module):
        model.eval()
    x, y = windows(ids, context)
    total = 0.0
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch])
        total += F.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(),
                                 reduction="sum").item()
    return math.exp(total / y.numel())


def batches(ids: torch.Tensor, context: int, batch: int, count: int,
            seed: int) -> list[torch.Tensor]:
    """``count`` seeded batches of random windows (calibration data)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - context, (count, batch), generator=gen)
    return [torch.stack([ids[s:s + context] for s in row.tolist()]) for row in starts]


def train(cfg: LMConfig, data: TextData) -> tuple[TinyLlama, dict[str, Any]]:
    """AdamW with linear warm-up and cosine decay on random training windows (seeded)."""
    torch.manual_seed(cfg.seed)
    model = TinyLlama(cfg, len(data.vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1,
                            betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    model.train()
    t0 = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(cfg.steps):
        starts = torch.randint(0, len(data.train) - cfg.context - 1, (cfg.batch,), generator=gen)
        x = torch.stack([data.train[s:s + cfg.context] for s in starts.tolist()])
        y = torch.stack([data.train[s + 1:s + cfg.context + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return model.eval(), {"train_s": time.perf_counter() - t0, "final_loss": loss.item()}


def cache_dir() -> Path:
    return Path(os.environ.get("QCOMPILE_BENCH_CACHE", Path.home() / ".cache" / "qcompile-bench"))


def trained(cfg: LMConfig, data: TextData) -> tuple[TinyLlama, dict[str, Any]]:
    """The trained model, from the cache when this exact config was trained before
    (``info["cached"]`` says which, ``info["path"]`` where)."""
    path = cache_dir() / f"tinyllama-{cfg.key(data.digest)}.pt"
    if path.exists():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            model = TinyLlama(cfg, len(data.vocab))
            model.load_state_dict(saved["state"])
            return model.eval(), {**saved["info"], "cached": True, "path": str(path)}
        except Exception:  # a truncated or stale file: train again and overwrite it
            pass
    model, info = train(cfg, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    # temp file + os.replace: a concurrent or interrupted run never sees half a file
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        torch.save({"state": model.state_dict(), "info": info}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return model, {**info, "cached": False, "path": str(path)}
