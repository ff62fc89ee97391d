"""The stages of a graph ``qc.distributed.pipeline`` spread over ranks, brought together for
the calls that read the whole model (``qc.export_gguf``, ``qc.save_pretrained``,
``qc.save_adapters``, ``qc.export_onnx``, ``qc.export_encodings``, ``qc.convert``).

Under ``qc.distributed.pipeline`` every rank holds the whole graph ``qc.qcompile`` returned
(a ``stage_<i>`` child per stage) but trains only its own stage; the other stages are the
copies compiled with it, untrained. ``spread`` tells such a graph (its ``StagePlacement``,
``meta[PIPELINE_KEY]``) and ``share_stages`` gives every rank's copies the trained state,
after the ranks agreed on the call (``StagePlacement`` is the check), so that a writer
reads the trained model. Read through ``sys.modules``: this layer never imports
``torch.distributed`` itself.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> gm = qc.qcompile(m, {"pipeline": {"stages": 2}}, example_inputs=(torch.randn(2, 4),))
    >>> spread(gm) is None  # one process: every stage is here, trained where it runs
    True
    >>> share_stages(gm)  # a no-op
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from qcompile.errors import QCompileError
from qcompile.graph.meta import PIPELINE_KEY

__all__ = ["GATHER_FIX", "refuse_sharded_stage", "share_stages", "spread"]

#: how to get one whole graph from a pipeline whose stages are sharded within (tp, FSDP2)
GATHER_FIX = ("gather it: on every rank sd = get_model_state_dict(stage.submod, "
              "options=StateDictOptions(full_state_dict=True)) "
              "(torch.distributed.checkpoint.state_dict), all_gather_object the stages' sd, "
              "and on rank 0 load them into the graph qc.qcompile returns for the spec "
              "without its pipeline section; or write the trained model with "
              "qc.export_gguf / qc.save_pretrained, which take the sharded stages")


def spread(gm: nn.Module) -> Any:
    """The ``StagePlacement`` of a graph whose stages ``qc.distributed.pipeline`` spread
    over several ranks (under an initialised process group), else None."""
    placement = (getattr(gm, "meta", None) or {}).get(PIPELINE_KEY)
    dist = sys.modules.get("torch.distributed")
    if placement is None or dist is None or not dist.is_initialized():
        return None
    return placement if len({r for ranks in placement.owners for r in ranks}) > 1 else None


def _dtensor(t: Any) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def refuse_sharded_stage(gm: nn.Module, where: str) -> None:
    """A call that reads one whole model on each rank (``qc.convert``,
    ``qc.export_onnx``, ``qc.export_encodings``) on a graph whose stages were spread over
    ranks: refused where this rank's stage is sharded within (tensor parallel, FSDP2), as
    it is on every rank of such a pipeline (no rank holds its own stage whole)."""
    if spread(gm) is None:
        return
    name = next((n for n, p in gm.named_parameters() if _dtensor(p)), None)
    if name is not None:
        raise QCompileError(f"{where}: the graph's pipeline stages were trained on different "
                            f"ranks and this rank's stage is sharded within ({name} is a "
                            "DTensor: tensor parallel or FSDP2), while this call reads one "
                            "whole model", fix=GATHER_FIX)


def share_stages(gm: nn.Module) -> None:
    """For a graph (the one ``qc.qcompile`` returned, with its ``stage_<i>`` children) whose
    stages ``qc.distributed.pipeline`` spread over ranks (a no-op for any other): every
    rank's copy of each stage it did not train takes that stage's trained state, tensor by
    tensor. For each stage in order, its lowest owner broadcasts each state tensor over the
    pipeline's group (a tensor-parallel or FSDP2 shard first gathered whole by the stage's
    owners, ``DTensor.full_tensor()``); the others copy it into their own. Every rank then
    reads the same values, so a refusal is every rank's. A rank's own stages are left as
    they are (a writer gathers their shards as it reads them); the copies it updates are
    ones no rank trains or runs there. Call it on every rank, after the ranks agreed on the
    call: a collective."""
    placement = spread(gm)
    if placement is None:
        return
    dist = sys.modules["torch.distributed"]
    me = int(dist.get_rank())
    # a tensor a stage of this rank holds too (a tied embedding) is this rank's trained one
    trained = {id(t) for s, owners in enumerate(placement.owners) if me in owners
               for t in gm.get_submodule(f"stage_{s}").state_dict(keep_vars=True).values()
               if isinstance(t, torch.Tensor)}
    for s, owners in enumerate(placement.owners):
        stage = gm.get_submodule(f"stage_{s}")
        mine = me in owners
        src = placement.owner_of(s)
        state = stage.state_dict(keep_vars=True)
        # what the owner holds, once per stage: names, dtypes and whole shapes
        listing = [[(k, str(v.dtype).removeprefix("torch."), tuple(v.shape))
                    for k, v in state.items() if isinstance(v, torch.Tensor)]]
        dist.broadcast_object_list(listing, src=src, group=placement.group)
        extra = {}
        for key, dtype, shape in listing[0]:
            value = state.get(key) if mine else None
            if mine and _dtensor(value):
                value = value.detach().full_tensor()  # the stage's owners, together
            if me == src:
                payload = value.detach().contiguous().reshape(-1).view(torch.uint8)
            else:
                count = math.prod(shape) * getattr(torch, dtype).itemsize
                payload = torch.empty(count, dtype=torch.uint8)
            dist.broadcast(payload, src=src, group=placement.group)
            if mine:
                continue
            received = payload.view(getattr(torch, dtype)).reshape(shape)
            target = state.get(key)
            if id(target) in trained:
                continue
            if key.endswith("_extra_state") or not isinstance(target, torch.Tensor) or (
                    target.shape != received.shape or target.dtype != received.dtype):
                extra[key] = received  # loaded by the module (its own checks)
                continue
            with torch.no_grad():
                target.copy_(received)
        if extra:
            stage.load_state_dict(extra, strict=False)
