"""``qc.search`` across data-parallel ranks: each rank scores its own batches, the sums are
reduced before the choice, so every rank chooses from the same scores and returns the
same spec.

Before anything else the ranks agree (``agree_to_search``) on the call, the spec and the
model: its tensors' names, dtypes and shapes and a checksum of their values, so ranks
holding different models (another architecture, other weights) or a search made on some
ranks only raise the same ``QCompileError`` everywhere instead of returning one spec.

Every score ``qc.search`` computes is a sum over batches divided by the number of batches
(output noise and signal energies, loss sums, squared-gradient sums), so one ``all_reduce``
(SUM) of the sums and the batch count gives every rank what one process scoring all the
batches would have. Before it, the ranks agree on what they scored (the groups, their
layers, the candidates, the metric): a rank that compiled another model or spec raises the
same error everywhere instead of reducing mismatched tensors.

Example:
    >>> import torch
    >>> from qcompile.distributed.search_sync import agree_to_search, reduce_scores, world_size
    >>> agree_to_search(torch.nn.Linear(2, 2), {"quant": {"mode": "static"}})  # no group
    >>> reduce_scores(torch.tensor([1.0, 2.0]), {"groups": ["fc1"]})  # no process group
    tensor([1., 2.])
    >>> world_size()
    1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from qcompile.distributed.agree import _active, agree, collective_phase, model_fingerprint

_FIX = ("run qc.search with the same model, spec and candidates on every rank (only the "
        "batches differ), then launch again")


def agree_to_search(model: torch.nn.Module, spec: Any, group: Any = None, *,
                    loss_fn: bool = False) -> None:
    """Before the search's first collective: every rank of ``group`` is in ``qc.search``
    with the same spec, the same model (``model_fingerprint`` with its weights' checksum)
    and a ``loss_fn`` given or not alike, else every rank raises the same error. Does
    nothing without a process group of two or more ranks."""
    if not _active(group):
        return
    dumped = (spec.model_dump(mode="json", exclude={"cache_dir"})
              if hasattr(spec, "model_dump") else spec)
    agree("qc.search", {"spec": dumped,
                        "model": model_fingerprint(model, detailed=True, weights=True),
                        "loss_fn": loss_fn}, group,
          fixes={"spec": _FIX, "loss_fn": _FIX,
                 "model": "give every rank the same model (the same architecture and "
                          "weights: load one checkpoint on every rank), then launch again"})


def world_size(group: Any = None) -> int:
    """Ranks in ``group`` (the world by default) taking part; 1 without a process group."""
    return torch.distributed.get_world_size(group) if _active(group) else 1


@contextlib.contextmanager
def scoring(group: Any = None) -> Iterator[None]:
    """Around one rank's local scoring: if any rank fails in it, every rank raises (the
    failing rank its own error, the others one naming it), none waits in the reduction."""
    with collective_phase("qc.search (scoring the batches)", group):
        yield


def reduce_scores(sums: torch.Tensor, fingerprint: Mapping[str, Any],
                  group: Any = None) -> torch.Tensor:
    """``sums`` (this rank's score sums and its batch count, one flat tensor) summed over
    the ranks of ``group``, after they agree on ``fingerprint`` (what was scored). Returns
    ``sums`` itself without a process group of two or more ranks."""
    if not _active(group):
        return sums
    agree("qc.search", {**fingerprint, "sums": int(sums.numel())}, group,
          fixes={k: _FIX for k in (*fingerprint, "sums")})
    out = sums.clone()
    if torch.distributed.get_backend(group) == "nccl":  # NCCL reduces CUDA tensors only
        out = out.to(torch.device("cuda", torch.cuda.current_device()))
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=group)
    return out.to(sums.device)
