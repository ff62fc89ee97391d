"""Adapters onto torch.distributed: the only qcompile package that imports it.

- ``guards``: refuse models already wrapped for data parallelism (compile first, wrap after);
- ``data_parallel``: ``wrap`` (DDP / FSDP2), ``sync_observers``, ``train_step``;
- ``pipelining``: this rank's ``PipelineStage`` and the torch schedule (``pipeline``);
- ``compile_once`` and its ``cache``: quantize once, share with every rank;
- ``state_dict``: ``optimizer_state_dict``, torch.distributed.checkpoint's optimizer state
  under the model's names (a run with block child graphs resumes with ``set_state_dict``).

qcompile never writes its own collectives or schedules. The public names load lazily, so
importing the guards does not import the pipelining runtime.

Example:
    >>> import torch, qcompile as qc
    >>> qc.distributed.wrapper_kind(torch.nn.Linear(2, 2)) is None
    True
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_LAZY = {
    "wrapper_kind": "guards",
    "refuse_wrapped": "guards",
    "wrap": "data_parallel",
    "sync_observers": "data_parallel",
    "keep_observers_in_sync": "data_parallel",
    "train_step": "data_parallel",
    "pipeline": "pipelining",
    "PipelineSchedule": "pipelining",
    "mesh": "hybrid",
    "compile_once": "once",
    "optimizer_state_dict": "state_dict",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"qcompile.distributed.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'qcompile.distributed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
