"""Tiny mixture-of-experts layers in the ways models store and call their experts, for the
expert tests: one 3-D parameter behind grouped_mm, bmm, einsum or ``W[e]`` + linear (as
[experts, out, in] or [experts, in, out]), and a ``ModuleList`` of Linear experts.

Routing is top-k over a Linear router, computed densely (every expert runs on every token
and the top-k gates weight them), so symbolic tracing and torch.export both capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("grouped_mm", "bmm", "einsum", "index", "module_list")


class Router(nn.Module):
    """Top-k softmax gates over ``experts``: [tokens, experts], zero off the top k."""

    def __init__(self, dim: int, experts: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim) / dim ** 0.5)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        top, idx = logits.topk(self.k, dim=-1)
        return torch.zeros_like(logits).scatter(-1, idx, top.softmax(-1))


class Experts(nn.Module):
    """``experts`` two-layer MLPs stored as 3-D parameters, called the ``kind`` way;
    ``transposed``: stored [experts, in, out] (the Hugging Face ``is_transposed`` layout)."""

    def __init__(self, kind: str, dim: int, hidden: int, experts: int,
                 transposed: bool = False) -> None:
        super().__init__()
        self.kind, self.transposed, self.experts = kind, transposed, experts
        up, down = (experts, hidden, dim), (experts, dim, hidden)
        if transposed:
            up, down = (experts, dim, hidden), (experts, hidden, dim)
        self.up = nn.Parameter(torch.randn(up) / dim ** 0.5)
        self.down = nn.Parameter(torch.randn(down) / hidden ** 0.5)

    def _apply(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [experts, tokens, in] through each expert's w -> [experts, tokens, out]."""
        if self.kind == "grouped_mm":
            e, t, d = x.shape
            offs = torch.arange(1, e + 1, dtype=torch.int32) * t
            wt = w if self.transposed else w.transpose(-2, -1)
            return torch._grouped_mm(x.reshape(e * t, d), wt, offs=offs).reshape(e, t, -1)
        if self.kind == "bmm":
            return torch.bmm(x, w if self.transposed else w.transpose(1, 2))
        if self.kind == "einsum":
            return torch.einsum("eid,ehd->eih" if not self.transposed else "eid,edh->eih", x, w)
        outs = [F.linear(x[e], w[e].t() if self.transposed else w[e])
                for e in range(self.experts)]  # "index": W[e] -> linear
        return torch.stack(outs)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        xs = x.unsqueeze(0).expand(self.experts, -1, -1)
        h = F.silu(self._apply(xs, self.up))
        y = self._apply(h, self.down)  # [experts, tokens, dim]
        return (y * gates.t().unsqueeze(-1)).sum(0)


class LinearExperts(nn.Module):
    """Experts as a ``ModuleList`` of Linear pairs (DeepSeek's and older Mixtral's layout)."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(dim, hidden, bias=False) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(hidden, dim, bias=False) for _ in range(experts))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            out = out + down(F.silu(up(x))) * gates[:, e:e + 1]
        return out


class MoE(nn.Module):
    """A pre-norm residual block: router + experts, with a Linear head."""

    def __init__(self, kind: str = "bmm", dim: int = 16, hidden: int = 32, experts: int = 4,
                 k: int = 2, transposed: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = Router(dim, experts, k)
        self.experts = (LinearExperts(dim, hidden, experts) if kind == "module_list"
                        else Experts(kind, dim, hidden, experts, transposed))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.head(x + self.experts(h, self.router(h)))


def moe(kind: str, seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    return MoE(kind, **kw)


def expert_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The experts' weights by name (3-D parameters, or the ModuleList Linears')."""
    return {n: p for n, p in model.named_parameters() if n.startswith("experts.")}
