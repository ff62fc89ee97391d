"""``shard_converted``: a rank's converted rows of a sharded graph become one FSDP2 graph.

``qc.convert`` of a ``fully_shard``-ed graph converts each rank's rows
(``qcompile.passes.convert.sharded``); this module puts them back under FSDP2: every
parameter of the converted graph (integer weights, their per-row scales and zero points,
folded biases, the float parameters left) is re-created on the meta device at its global
shape, the graph is ``fully_shard``-ed as the source graph was (the same modules, then the
root, on the same mesh), allocated, and each rank copies its own rows in. The integer
weights are then sharded like any weight (FSDP2 all-gathers them, mixed dtypes as bytes,
for each group's forward) and no rank ever holds more than its rows plus one group.

Example:
    >>> from qcompile.distributed.convert import global_rows
    >>> global_rows([[3, 2], [2, 2]])  # each rank's local rows of two tensors
    [5, 4]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qcompile.runtime.quantized import IntWeight

__all__ = ["global_rows", "shard_converted"]


def global_rows(per_rank: list[list[int]]) -> list[int]:
    """Global dim-0 sizes from every rank's local sizes (FSDP2's rows add up)."""
    return [sum(sizes) for sizes in zip(*per_rank)]


def _replicated(out: nn.Module) -> set[str]:
    """Parameters every rank holds whole: an ``IntWeight``'s per-tensor / per-column
    qparams (the others are laid out by the weight's rows)."""
    found = set()
    for name, m in out.named_modules():
        if isinstance(m, IntWeight):
            rows = m.row_tensors()
            found |= {f"{name}.{leaf}" if name else leaf
                      for leaf, _ in m.named_parameters(recurse=False) if leaf not in rows}
    return found


def _set(out: nn.Module, path: str, kind: str, value: Any) -> None:
    parent, _, leaf = path.rpartition(".")
    getattr(out.get_submodule(parent) if parent else out, kind)[leaf] = value


def shard_converted(out: nn.Module, mesh: Any, units: list[str], rank: int,
                    world: int, cut: dict[str, torch.Tensor]) -> nn.Module:
    """``out`` (this rank's rows, converted) as one ``fully_shard``-ed graph; ``units``:
    the modules the source graph sharded (root last); ``cut``: buffers that hold this
    rank's rows only, by path, with their whole values."""
    from torch.distributed.fsdp import fully_shard

    from qcompile.passes.convert.sharded import rows_of

    whole = _replicated(out)
    params = [(n, p) for n, p in out.named_parameters()]
    sizes = [p.shape[0] if p.dim() else 1 for n, p in params if n not in whole]
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, sizes, group=mesh.get_group())
    totals = iter(global_rows(gathered))
    local = {}
    for name, p in params:
        shape = tuple(p.shape) if name in whole else (next(totals), *p.shape[1:])
        local[name] = p.detach()
        meta = torch.empty(shape, dtype=p.dtype, device="meta")
        _set(out, name, "_parameters", nn.Parameter(meta, requires_grad=False))
    for m in out.modules():  # an IntWeight reshapes to its weight's global shape
        if isinstance(m, IntWeight) and m.by_rows:
            m.shape = (m.packed.shape[0], *m.shape[1:])
    buffers = dict(out.named_buffers())
    for path, value in cut.items():  # whole again: FSDP2 gathers parameters, not buffers
        if path in buffers:
            buffers[path] = value.clone()
    for name in units:
        module = out.get_submodule(name) if name else out
        if name and not any(True for _ in module.parameters()):
            continue
        fully_shard(module, mesh=mesh)
    out.to_empty(device=next(iter(local.values())).device if local else "cpu")
    for path, value in buffers.items():  # to_empty left them uninitialised
        _set(out, path, "_buffers", value)
    with torch.no_grad():
        for name, p in out.named_parameters():
            dst = p.to_local()
            src = local.pop(name)
            if name in whole:  # every rank holds it whole: this rank's rows of it
                start, stop = rows_of(src.shape[0], rank=rank, world=world)
                src = src[start:stop]
            if dst.shape != src.shape:
                raise RuntimeError(f"{name}: this rank's rows {tuple(src.shape)} do not fit "
                                   f"its shard {tuple(dst.shape)}")
            dst.copy_(src)
    return out
