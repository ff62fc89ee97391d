"""Refuse models that are already wrapped for data parallelism: quantize first, then wrap.

Example:
    >>> import torch
    >>> from qcompile.distributed.guards import wrapper_kind
    >>> wrapper_kind(torch.nn.Linear(2, 2)) is None
    True
"""

from __future__ import annotations

import torch
from torch import nn

from qcompile.errors import QCompileError


def wrapper_kind(model: nn.Module) -> str | None:
    """'DistributedDataParallel', 'FullyShardedDataParallel' or 'fully_shard' when
    ``model`` (or any submodule) is wrapped by a data-parallel wrapper, else None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for m in model.modules():
        if isinstance(m, DistributedDataParallel):
            return "DistributedDataParallel"
        if isinstance(m, FullyShardedDataParallel):
            return "FullyShardedDataParallel"
        if isinstance(m, FSDPModule):
            return "fully_shard"
    return None


def refuse_wrapped(model: nn.Module) -> None:
    """Raise if ``model`` is already wrapped: quantize first, then wrap."""
    kind = wrapper_kind(model)
    if kind is None:
        return
    if kind == "DistributedDataParallel":
        fix = ("compile the bare module: gm = qc.qcompile(ddp_model.module, spec, ...), then "
               "wrap the result: qc.distributed.wrap(gm, spec) or DistributedDataParallel(gm)")
    elif kind == "FullyShardedDataParallel":
        fix = ("compile the unwrapped model, then shard the result with FSDP2 "
               "(qc.distributed.wrap(gm, spec) with data_parallel.kind: fsdp2); FSDP1 cannot "
               "hold the re-assigned parameters quantization needs")
    else:
        fix = ("compile the model before calling fully_shard on it, then shard the result: "
               "qc.distributed.wrap(gm, spec) with data_parallel.kind: fsdp2")
    raise QCompileError(f"the model is wrapped in {kind}: qcompile must run before "
                        "data-parallel wrapping", fix=fix)
