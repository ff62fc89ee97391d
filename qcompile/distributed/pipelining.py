"""Pipeline parallelism: this rank's ``PipelineStage`` and the torch schedule the spec names.

Built on ``torch.distributed.pipelining``; qcompile adds inputs by name, a batch-size check
before any communication and summing the gradients of parameters tied across ranks.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.distributed.pipelining import pipeline
    >>> spec = {"pipeline": {"stages": 2}}
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> gm = qc.qcompile(m, spec, example_inputs=(torch.randn(2, 4),))
    >>> pipeline(gm, spec)  # launched without torchrun
    Traceback (most recent call last):
    ...
    qcompile.errors.QCompileError: qc.distributed.pipeline needs an initialised process group
      fix: launch with torchrun and call torch.distributed.init_process_group() first
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qcompile.errors import QCompileError
from qcompile.graph.meta import TIED_KEY
from qcompile.passes.partition import stage_devices
from qcompile.specs import as_spec


class PipelineSchedule:
    """A torch.distributed.pipelining schedule plus what qcompile adds around ``step``:
    inputs by name, a batch-size check, and summing the gradients of parameters shared by
    stages on different ranks. Every other attribute is the torch schedule's."""

    def __init__(self, schedule: Any, input_names: list[str], microbatches: int,
                 tied: list[tuple[list[torch.Tensor], Any]], params: list[torch.Tensor]
                 ) -> None:
        self.schedule = schedule
        self.input_names = input_names
        self.microbatches = microbatches
        self.tied = tied
        self.params = params

    def __getattr__(self, name: str) -> Any:
        return getattr(self.schedule, name)

    def step(self, *args: Any, target: Any = None, losses: list | None = None,
             **inputs: Any) -> Any:
        if inputs:  # model inputs by name -> the first stage's positional inputs
            unknown = sorted(set(inputs) - set(self.input_names))
            if unknown:
                raise QCompileError(f"pipeline step: inputs {unknown} are not model inputs "
                                    f"({', '.join(self.input_names)})",
                                    fix="pass the model's inputs, by position or by name")
            named = [inputs.get(n) for n in self.input_names[len(args):]]
            if any(v is None for v in named):
                missing = [n for n, v in zip(self.input_names[len(args):], named) if v is None]
                raise QCompileError(f"pipeline step: inputs {missing} are missing: the "
                                    "schedule feeds every stage-0 input as a tensor",
                                    fix="pass a tensor for every model input")
            args = (*args, *named)
        for a in (*args, target):
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] % self.microbatches:
                raise QCompileError(
                    f"pipeline step: batch size {a.shape[0]} is not divisible by "
                    f"pipeline.microbatches = {self.microbatches}",
                    fix="use a batch size that is a multiple of the micro-batch count")
        kwargs: dict[str, Any] = {"target": target, "losses": losses}
        out = self.schedule.step(*args, **kwargs)
        if getattr(self.schedule, "_has_backward", True):
            for p in self.params:  # mean over micro-batches, once per parameter
                if p.grad is not None:
                    p.grad.div_(self.microbatches)
        for params, group in self.tied:  # one stage's share of a tied gradient each: sum
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad, group=group)
        return out


def _tied_groups(gm: nn.Module, stage_rank: dict[int, int], mine: list[int], group: Any
                 ) -> list[tuple[list[torch.Tensor], Any]]:
    """Process groups among the ranks holding each tied parameter (created on every rank
    in the same order, as new_group requires), with this rank's copies."""

    def stage_of(key: str) -> int:
        return int(key.split(".", 1)[0].removeprefix("stage_"))

    groups: dict[tuple[int, ...], list[list[str]]] = {}
    for keys in gm.meta.get(TIED_KEY, []):
        holders = sorted({stage_rank[stage_of(key)] for key in keys})
        if len(holders) > 1:
            groups.setdefault(tuple(holders), []).append(keys)
    out = []
    me = torch.distributed.get_rank()
    for ranks, tied_keys in sorted(groups.items()):
        # stage ranks count within `group`; new_group takes global ranks
        global_ranks = [r if group is None else torch.distributed.get_global_rank(group, r)
                        for r in ranks]
        sub_group = torch.distributed.new_group(global_ranks)
        if me in global_ranks:
            tensors = []
            for keys in tied_keys:
                for key in keys:
                    if stage_of(key) in mine:
                        tensors.append(gm.get_parameter(key))
                        break  # one copy per rank: stages on one rank share the Parameter
            out.append((tensors, sub_group))
    return out


def pipeline(gm: nn.Module, spec: Any, loss_fn: Any = None, *, group: Any = None
             ) -> tuple[Any, PipelineSchedule]:
    """This rank's ``PipelineStage`` (a list of them for interleaved schedules) and the
    schedule ``spec.pipeline.schedule`` names, driven by torch.distributed.pipelining.

    ``gpipe`` and ``1f1b`` put stage ``r`` on rank ``r`` (stages == world size);
    ``interleaved_1f1b`` puts stages ``r, r + W, r + 2W, ...`` on rank ``r``.
    """
    from torch.distributed import pipelining as pp

    spec = as_spec(spec)
    if spec.pipeline is None:
        raise QCompileError("qc.distributed.pipeline: the spec has no pipeline section",
                            fix="add pipeline: {stages: N, ...} and compile with that spec")
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise QCompileError("qc.distributed.pipeline needs an initialised process group",
                            fix="launch with torchrun and call "
                            "torch.distributed.init_process_group() first")
    k = spec.pipeline.num_stages
    missing = [f"stage_{i}" for i in range(k) if not hasattr(gm, f"stage_{i}")]
    if missing:
        raise QCompileError(f"qc.distributed.pipeline: the graph has no {missing[0]}",
                            fix="pass the GraphModule qc.qcompile returned for this spec")
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    kind = spec.pipeline.schedule
    if kind == "interleaved_1f1b":
        if k % world or k // world < 2:
            raise QCompileError(f"pipeline.schedule: interleaved_1f1b needs at least 2 stages "
                                f"per rank and stages divisible by the world size ({k} stages, "
                                f"{world} ranks)", fix=f"use stages: {2 * world} (or a "
                                "multiple of the world size), or schedule: 1f1b")
        mine = list(range(rank, k, world))
    else:
        if k != world:
            raise QCompileError(f"pipeline.schedule: {kind} runs one stage per rank, but there "
                                f"are {k} stages and {world} ranks",
                                fix=f"launch {k} processes (torchrun --nproc_per_node={k}) "
                                f"or set pipeline.stages: {world}")
        mine = [rank]
    devices = [torch.device(d) for d in stage_devices(spec.pipeline)]
    stage_rank = {s: s % world for s in range(k)}
    stages = [pp.PipelineStage(gm.get_submodule(f"stage_{s}"), s, k, devices[s], group=group)
              for s in mine]
    m = spec.pipeline.microbatches
    # Gradients are averaged over micro-batches here, once per distinct parameter: torch's
    # own scaling divides per stage, twice for a parameter two local stages share.
    if kind == "gpipe":
        schedule = pp.ScheduleGPipe(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    elif kind == "1f1b":
        schedule = pp.Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = pp.ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
    params = list({id(p): p for st in stages for p in st.submod.parameters()}.values())
    inputs = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    tied = _tied_groups(gm, stage_rank, mine, group)
    return (stages if kind == "interleaved_1f1b" else stages[0],
            PipelineSchedule(schedule, inputs, m, tied, params))
