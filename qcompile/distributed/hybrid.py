"""Pipeline x data parallel: the 2-D ``DeviceMesh`` with dims ``("pp", "dp")``.

A spec with a ``pipeline`` of ``S`` stages and ``data_parallel.kind`` ``ddp`` or ``fsdp2``
on ``W`` ranks runs each stage on ``dp = W / S`` ranks: rank ``r`` holds stage
``r // dp`` (its pp index) as replica ``r % dp`` (its dp index), rank = pp_index * dp +
dp_index, as torchtitan lays it out. ``qc.distributed.pipeline`` builds the mesh with
``mesh(spec)``, wraps this rank's stage over the ``dp`` sub-mesh, and drives the wrapped
stage with the torch schedule over the ``pp`` sub-mesh.

Every check runs before any communication: no process group, ``data_parallel.kind:
none``, a world size the stage count does not divide, or a data-parallel group of one rank
(``ddp``/``fsdp2`` over a single replica is refused, not silently a no-op: launch
``stages x replicas`` processes or set ``data_parallel.kind: none``).

Example:
    >>> import qcompile as qc
    >>> spec = {"pipeline": {"stages": 2}, "data_parallel": {"kind": "ddp"}}
    >>> mesh_shape(spec, world=4)
    (2, 2)
    >>> mesh_shape(spec, world=3)
    Traceback (most recent call last):
    ...
    qcompile.errors.QCompileError: pipeline x data parallel: 3 ranks do not split into 2 stages
      fix: launch a multiple of 2 processes (torchrun --nproc_per_node=4 for 2 replicas)
"""

from __future__ import annotations

from typing import Any

import torch

from qcompile.distributed.agree import agree
from qcompile.errors import QCompileError
from qcompile.specs import as_spec

DIMS = ("pp", "dp")


def mesh_shape(spec: Any, world: int) -> tuple[int, int]:
    """``(pp, dp)`` for ``spec`` on ``world`` ranks, or a ``QCompileError`` saying why
    not (no communication)."""
    spec = as_spec(spec)
    if spec.pipeline is None:
        raise QCompileError("pipeline x data parallel: the spec has no pipeline section",
                            fix="add pipeline: {stages: N, ...}, or use "
                            "qc.distributed.wrap for data parallelism alone")
    kind = spec.data_parallel.kind
    if kind == "none":
        raise QCompileError("pipeline x data parallel: data_parallel.kind is none",
                            fix="set data_parallel.kind: ddp or fsdp2")
    if spec.pipeline.schedule == "interleaved_1f1b":
        raise QCompileError("pipeline x data parallel: interleaved_1f1b is not supported "
                            "with data_parallel", fix="use schedule: 1f1b or gpipe")
    pp = spec.pipeline.num_stages
    if world % pp:
        raise QCompileError(f"pipeline x data parallel: {world} ranks do not split into "
                            f"{pp} stages",
                            fix=f"launch a multiple of {pp} processes (torchrun "
                            f"--nproc_per_node={2 * pp} for 2 replicas)")
    dp = world // pp
    if dp < 2:
        raise QCompileError(f"pipeline x data parallel: data_parallel.kind: {kind} with "
                            f"{pp} stages on {world} ranks leaves each stage one replica "
                            "(a data-parallel group of 1)",
                            fix=f"launch {2 * pp} processes (2 replicas per stage) or set "
                            "data_parallel.kind: none")
    return pp, dp


def mesh(spec: Any, device_type: str | None = None) -> Any:
    """The ``("pp", "dp")`` ``DeviceMesh`` for ``spec`` on the initialised process group
    (``init_device_mesh``; every rank calls it); with a ``tensor_parallel`` section, dims
    among ``("dp", "tp")`` (``qcompile.distributed.tensor_parallel.mesh_dims``).
    ``device_type`` defaults to the pipeline devices' type (``cuda`` when they name GPUs,
    else ``cpu``; with tensor parallelism ``cuda`` under NCCL). The ranks first agree on
    the spec's ``pipeline`` and ``data_parallel`` sections and the device type: a rank
    launched with another spec is the same ``QCompileError`` on every rank, not a hang."""
    spec = as_spec(spec)
    _initialised()
    agree("qc.distributed.mesh", {
        "pipeline": spec.pipeline.model_dump(mode="json") if spec.pipeline else None,
        "data_parallel": spec.data_parallel.model_dump(mode="json"),
        "tensor_parallel": (spec.tensor_parallel.model_dump(mode="json")
                            if spec.tensor_parallel else None),
        "device_type": device_type})
    return agreed_mesh(spec, device_type)


def _initialised() -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise QCompileError("pipeline x data parallel needs an initialised process group",
                            fix="launch with torchrun and call "
                            "torch.distributed.init_process_group() first")


def agreed_mesh(spec: Any, device_type: str | None = None) -> Any:
    """``mesh`` for callers whose ranks already agreed on the spec
    (``qc.distributed.pipeline``)."""
    spec = as_spec(spec)
    _initialised()
    from torch.distributed.device_mesh import init_device_mesh

    if spec.tensor_parallel is not None:
        from qcompile.distributed.tensor_parallel import mesh_dims

        dims = mesh_dims(spec, torch.distributed.get_world_size())
        if device_type is None:
            device_type = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device_type, tuple(dims.values()),
                                mesh_dim_names=tuple(dims))
    pp, dp = mesh_shape(spec, torch.distributed.get_world_size())
    if device_type is None:
        devices = spec.pipeline.devices or ["cpu"]
        device_type = torch.device(devices[0]).type
    return init_device_mesh(device_type, (pp, dp), mesh_dim_names=DIMS)
