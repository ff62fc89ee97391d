"""Which device a collective's tensors must live on, chosen by the group's backend.

NCCL only reduces CUDA tensors (on the rank's own GPU), gloo and MPI CPU tensors. qcompile's
collectives (``compile_once``'s broadcast, ``sync_observers``' all-reduces) stage their
tensors on ``collective_device(group)`` and copy the result back, wherever the model lives.

Example:
    >>> from qcompile.distributed.devices import collective_device, device_for_backend
    >>> device_for_backend("gloo")
    device(type='cpu')
    >>> device_for_backend("nccl", current=1)   # the rank's CUDA device
    device(type='cuda', index=1)
    >>> collective_device()   # no process group: CPU
    device(type='cpu')
"""

from __future__ import annotations

import os
from typing import Any

import torch

# backends that reduce tensors of one accelerator type only
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}


def _current(kind: str, current: int | None) -> int:
    """The rank's accelerator index: ``current`` when given, else the current device —
    except that a current device 0 with ``LOCAL_RANK`` > 0 (torchrun, but no
    ``set_device`` yet) means the device of the local rank, as torch's own barrier does."""
    if current is not None:
        return current
    module = getattr(torch, kind)
    index = module.current_device()
    local = os.environ.get("LOCAL_RANK", "")
    count = module.device_count()
    if index == 0 and local.isdigit() and int(local) > 0 and count > 1:
        index = int(local) % count
    return index


def device_for_backend(backend: str, *, current: int | None = None) -> torch.device:
    """The device for tensors of a collective on ``backend`` (a name as
    ``torch.distributed.get_backend`` returns it, e.g. ``"nccl"``, ``"gloo"`` or
    ``"cpu:gloo,cuda:nccl"``). A CPU-capable backend in the list wins (no copy)."""
    names = [part.rpartition(":")[2].strip().lower() for part in str(backend).split(",")]
    accelerators = [_ACCELERATOR_BACKENDS[n] for n in names if n in _ACCELERATOR_BACKENDS]
    if not names or len(accelerators) < len(names):
        return torch.device("cpu")
    return torch.device(accelerators[0], _current(accelerators[0], current))


def collective_device(group: Any = None) -> torch.device:
    """The device for tensors of a collective over ``group`` (default: the world): the
    group's bound device (``init_process_group(device_id=...)``) when it has one, else by
    backend name; CPU without a process group."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    if not backend_uses_accelerator(backend):
        return torch.device("cpu")
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    kind = device_for_backend(backend, current=0).type
    if isinstance(bound, torch.device) and bound.type == kind and bound.index is not None:
        return bound
    return device_for_backend(backend)


def backend_uses_accelerator(backend: str) -> bool:
    return device_for_backend(backend, current=0).type != "cpu"


def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` itself when it is on ``device``, else a copy there (write it back with
    ``t.copy_(result)``)."""
    return t if t.device == device else t.to(device)
