"""Refuse models that are already wrapped for data parallelism (quantize first, then wrap),
and unwrap ``torch.compile``'d models (quantize the original module).

Example:
    >>> import torch
    >>> from qcompile.distributed.guards import refuse_wrapped, unwrap_compiled, wrapper_kind
    >>> wrapper_kind(torch.nn.Linear(2, 2)) is None
    True
    >>> wrapper_kind(torch.nn.DataParallel(torch.nn.Linear(2, 2)))
    'DataParallel'
    >>> refuse_wrapped(torch.nn.DataParallel(torch.nn.Linear(2, 2)))
    Traceback (most recent call last):
    ...
    qcompile.errors.QCompileError: the model is wrapped in nn.DataParallel, ...
    >>> model, note = unwrap_compiled(torch.compile(torch.nn.Linear(2, 2)))
    >>> type(model).__name__, note.startswith("torch.compile")
    ('Linear', True)
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from qcompile.errors import QCompileError

DDP_RECIPE = (
    "launch one process per device with DistributedDataParallel instead:\n"
    "    gm = qc.qcompile(model, spec, example_inputs)  # the bare model (dp_model.module)\n"
    "    model = qc.distributed.wrap(gm, spec)  # data_parallel.kind: ddp (syncs observers)\n"
    "    torchrun --standalone --nproc_per_node=<devices> train.py  # after "
    "init_process_group()")


def _is_compiled(m: nn.Module) -> bool:
    """A ``torch.compile`` wrapper (``OptimizedModule``), also by duck typing."""
    # only when dynamo is loaded (nothing else makes an OptimizedModule): no import here
    cls = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return (cls is not None and isinstance(m, cls)) or isinstance(
        m.__dict__.get("_modules", {}).get("_orig_mod"), nn.Module)


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, str | None]:
    """``(model._orig_mod, note)`` for a ``torch.compile``'d model, else ``(model, None)``.

    qcompile rewrites the module itself, not dynamo's compiled code, so it quantizes the
    original module; graph names carry no ``_orig_mod.``. A compiled module *inside* the
    model is refused: its names would carry ``_orig_mod.`` and dynamo would keep running the
    unquantized original."""
    note = None
    while _is_compiled(model):
        model = model._orig_mod
        note = ("torch.compile'd model: compiled its original module (model._orig_mod); "
                "call torch.compile on the returned graph to compile it again")
    inner = [name for name, m in model.named_modules() if name and _is_compiled(m)]
    if inner:
        raise QCompileError(f"submodule {inner[0]!r} is torch.compile'd: qcompile would see "
                            "its _orig_mod wrapper, not the module",
                            fix=f"pass the model with the original module in place of "
                            f"{inner[0]!r} ({inner[0]}._orig_mod), then torch.compile the "
                            "graph qcompile returns")
    return model, note


def wrapper_kind(model: nn.Module) -> str | None:
    """'DataParallel', 'DistributedDataParallel', 'FullyShardedDataParallel' or
    'fully_shard' when ``model`` (or any submodule) is wrapped by a data-parallel wrapper,
    else None."""
    for m in model.modules():
        if isinstance(m, nn.DataParallel):
            return "DataParallel"
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
    """Raise if ``model`` is already wrapped: quantize first, then wrap (with
    ``qc.distributed.wrap``, which also keeps observers in sync across ranks)."""
    kind = wrapper_kind(model)
    if kind is not None:
        raise refusal(kind)


def refusal(kind: str) -> QCompileError:
    """The error for a model wrapped in ``kind`` (a ``wrapper_kind`` value)."""
    if kind == "DataParallel":
        return QCompileError(
            "the model is wrapped in nn.DataParallel, which qcompile does not support: its "
            "replicas are copies made for every forward and discarded after it, so observer "
            "and BatchNorm statistics updated on them are lost (and graph names would carry "
            "'module.')", fix=DDP_RECIPE)
    if kind == "DistributedDataParallel":
        fix = ("compile the bare module: gm = qc.qcompile(ddp_model.module, spec, ...), then "
               "wrap the result with qc.distributed.wrap(gm, spec), which also synchronises "
               "observers across ranks (a hand-written DistributedDataParallel(gm) must call "
               "qc.distributed.sync_observers(gm) after each optimizer.step())")
    elif kind == "FullyShardedDataParallel":
        fix = ("compile the unwrapped model, then shard the result with FSDP2: "
               "qc.distributed.wrap(gm, spec) with data_parallel.kind: fsdp2; FSDP1 cannot "
               "hold the re-assigned parameters quantization needs")
    else:
        fix = ("compile the model before calling fully_shard on it, then shard the result: "
               "qc.distributed.wrap(gm, spec) with data_parallel.kind: fsdp2")
    return QCompileError(f"the model is wrapped in {kind}: qcompile must run before "
                         "data-parallel wrapping", fix=fix)


def wrapper_under_construction(e: BaseException) -> str | None:
    """The data-parallel wrapper whose constructor raised ``e`` (a ``wrapper_kind``
    value), or None: a model factory that wraps its model fails inside the wrapper when
    it runs on the meta device (DDP verifies its parameters with ``.item()``), so the
    wrapper is known only from the traceback (the instance being built)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    kinds = ((DistributedDataParallel, "DistributedDataParallel"),
             (FullyShardedDataParallel, "FullyShardedDataParallel"),
             (nn.DataParallel, "DataParallel"))
    tb = e.__traceback__
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        for cls, kind in kinds:
            if isinstance(me, cls):
                return kind
        tb = tb.tb_next
    return None


def data_parallel_inner(model: nn.Module) -> nn.Module:
    """The graph inside a data-parallel wrapper ``qc.distributed.wrap`` made: DDP's
    ``.module``; ``fully_shard`` keeps the graph itself (its class becomes an FSDP
    subclass), so it comes back as it is, as does a bare graph."""
    if torch.distributed.is_available():
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            return model.module
    return model
