"""Small modules that restore train/eval behaviour to exported graphs.

``torch.export`` bakes the training flag into the graph: dropout keeps dropping and
BatchNorm keeps using batch statistics after ``.eval()`` (pytorch/pytorch#151726). The
export front end replaces those ops by calls to modules that read ``self.training``
(the model's own ``nn.BatchNorm*`` where it exists, else these), so the compiled graph
switches with ``train()`` / ``eval()`` like the model did.

Example:
    >>> import torch
    >>> sdpa = ModeAwareSDPA(dropout_p=0.5).eval()
    >>> q = torch.randn(1, 1, 4, 8)
    >>> torch.equal(sdpa(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q))
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ModeAwareSDPA(nn.Module):
    """``scaled_dot_product_attention`` whose dropout applies in training only."""

    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.dropout_p = dropout_p

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, self.dropout_p if self.training else 0.0,
            is_causal, scale=scale, enable_gqa=enable_gqa)

    def extra_repr(self) -> str:
        return f"dropout_p={self.dropout_p}"


class ModeAwareBatchNorm(nn.Module):
    """Functional ``batch_norm`` (not an ``nn.BatchNorm*``) that uses batch statistics in
    training and running statistics in eval, like the module would."""

    def __init__(self, momentum: float | None, eps: float) -> None:
        super().__init__()
        self.momentum = momentum
        self.eps = eps

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None
                ) -> torch.Tensor:
        return F.batch_norm(x, running_mean, running_var, weight, bias, self.training,
                            self.momentum if self.momentum is not None else 0.0, self.eps)

    def extra_repr(self) -> str:
        return f"momentum={self.momentum}, eps={self.eps}"
