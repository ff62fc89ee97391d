"""Pipeline parallelism: this rank's ``PipelineStage`` and the torch schedule the spec names.

Built on ``torch.distributed.pipelining``; qcompile adds inputs by name, a batch-size check
before any communication and summing the gradients of parameters tied across ranks.

Observers see real data only: torch's stage infers the shapes it exchanges by running a
forward of its own on the first step (on ``torch.empty`` tensors). qcompile runs that
bookkeeping forward with every quantizer of the stage paused (``observe = False``) and puts
back every buffer it touched (BatchNorm statistics), so no statistic records it.

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

import contextlib
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qcompile.distributed.agree import agree, collective_phase, digest, tensors_of
from qcompile.errors import QCompileError
from qcompile.graph.meta import PIPELINE_KEY, TIED_KEY
from qcompile.passes.partition import stage_devices
from qcompile.specs import as_spec


class PipelineSchedule:
    """A torch.distributed.pipelining schedule plus what qcompile adds around ``step``:
    inputs by name, a batch-size check, summing the gradients of parameters shared by
    stages on different ranks, ``train.accumulate`` (the batch in that many schedule steps,
    gradients averaged, for one optimizer step) and, with pipeline x data parallel, one
    observer synchronisation over the stage's dp group per step (``last_sync``: its
    collectives and bytes). Every other attribute is the torch schedule's.

    Each ``step`` first has the ranks of ``group`` (the pipeline's ranks; the world with
    pipeline x data parallel) agree on the call, the schedule (``fingerprint``: spec and
    graph digests) and whether this rank's own inputs were refused (a batch size the
    micro-batches do not divide, an unknown input name): a step taken on some ranks only,
    or refused on one, is the same ``QCompileError`` on every rank, never a rank waiting
    in a send or receive."""

    def __init__(self, schedule: Any, input_names: list[str], microbatches: int,
                 tied: list[tuple[list[torch.Tensor], Any]], params: list[torch.Tensor],
                 sync: Any = None, dp_group: Any = None, accumulate: int = 1,
                 group: Any = None, fingerprint: dict[str, Any] | None = None) -> None:
        self.schedule = schedule
        self.group = group  # the ranks that step together
        self.fingerprint = fingerprint or {}
        self.accumulate = accumulate  # train.accumulate: schedule steps per optimizer step
        self.sync = sync  # pipeline x data parallel: observer sync over the dp group
        self.dp_group = dp_group
        self.last_sync: dict[str, int] = {"collectives": 0, "bytes": 0}
        self.input_names = input_names
        self.microbatches = microbatches
        self.tied = tied
        self.params = params

    def __getattr__(self, name: str) -> Any:
        return getattr(self.schedule, name)

    def step(self, *args: Any, target: Any = None, losses: list | None = None,
             **inputs: Any) -> Any:
        try:
            args = self._inputs(args, target, inputs)
            refused = None
        except QCompileError as e:  # agreed on first: every rank raises it, none waits
            refused = e
        agree("PipelineSchedule.step", {
            "schedule": self.fingerprint,
            "refused": None if refused is None else refused.message}, self.group,
            fixes={"schedule": "give every rank the same spec and graph, then launch again",
                   "refused": "fix the inputs that rank refused (its message says why)"})
        if refused is not None:
            raise refused
        return self._step(args, target, losses)

    def _inputs(self, args: tuple, target: Any, inputs: dict[str, Any]) -> tuple:
        """The first stage's positional inputs (``inputs`` by name appended), after the
        batch-size check; a ``QCompileError`` for what this rank was given wrong."""
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
        n, m = self.accumulate, self.microbatches
        for a in (*args, target):
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] % (m * n):
                what = (f"pipeline.microbatches = {m}" if n == 1 else
                        f"pipeline.microbatches x train.accumulate = {m} x {n}")
                raise QCompileError(
                    f"pipeline step: batch size {a.shape[0]} is not divisible by {what}",
                    fix="use a batch size that is a multiple of the micro-batch count")
        return args

    def _step(self, args: tuple, target: Any, losses: list | None) -> Any:
        n, m = self.accumulate, self.microbatches
        backward = getattr(self.schedule, "_has_backward", True)
        # gradients already there (accumulating over several steps) are left as they are:
        # only this step's share is averaged and summed over tied holders
        before = [p.grad.detach().clone() if backward and p.grad is not None else None
                  for p in self.params]

        def part(a: Any, i: int) -> Any:
            return a.chunk(n)[i] if n > 1 and isinstance(a, torch.Tensor) and a.dim() else a

        outs = []
        for i in range(n):  # train.accumulate: n schedule steps, one optimizer step
            mine: list | None = None if losses is None else []
            outs.append(self.schedule.step(*(part(a, i) for a in args),
                                           target=part(target, i), losses=mine))
            if losses is not None:  # torch's step replaces the list's contents: collect
                if i == 0:
                    losses.clear()
                losses.extend(mine or [])
        if backward:
            for p, g0 in zip(self.params, before):  # mean over micro-batches, once each
                if p.grad is not None:
                    if g0 is not None:
                        p.grad.sub_(g0)
                    p.grad.div_(m * n)
        for params, group in self.tied:  # one stage's share of a tied gradient each: sum
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad, group=group)
        for p, g0 in zip(self.params, before):
            if g0 is not None and p.grad is not None:
                p.grad.add_(g0)
        out = outs[0]
        if n > 1 and all(isinstance(o, torch.Tensor) for o in outs):
            out = torch.cat(outs)
        if self.sync is not None:  # one fused collective per reduction kind per step
            self.last_sync = self.sync()
        return out


@dataclass(frozen=True, eq=False)
class StagePlacement:
    """Where ``qc.distributed.pipeline`` put a graph's stages (``meta[PIPELINE_KEY]``):
    ``owners[s]``, the global ranks that train stage ``s`` (its pp index; every dp and tp
    index of it), and ``group``, the ranks that step together (the world with a mesh).
    Every other stage a rank's graph holds is an untrained copy. ``check(what, gm,
    fingerprint)`` has the group agree on a call over the pipeline, by the spec and graph
    every rank had before its stage was sharded (tensor parallelism rewrites a rank's own
    stage only): how an exporter (``qcompile.deploy``, which does not import this package)
    checks before it brings the stages together. Copies of the graph share it; a pickled
    graph forgets it (a process group does not pickle).

    Example:
        >>> placement = StagePlacement(None, ((0, 1), (2, 3)), {"graph": "..."})
        >>> placement.owner_of(1), placement.writer
        (2, 0)
    """

    group: Any
    owners: tuple[tuple[int, ...], ...]
    fingerprint: Mapping[str, Any]

    @property
    def writer(self) -> int:
        """The global rank that writes an export: the lowest of the pipeline's."""
        return min(r for ranks in self.owners for r in ranks)

    def owner_of(self, stage: int) -> int:
        """The global rank that hands stage ``stage``'s state on: its lowest owner."""
        return min(self.owners[stage])

    def __call__(self, what: str, gm: nn.Module,
                 fingerprint: Mapping[str, Any] | None = None) -> None:
        agree(what, {"pipeline": dict(self.fingerprint), **(fingerprint or {})}, self.group,
              fixes={"pipeline": "give every rank the same spec and graph, then launch again"})

    def __deepcopy__(self, memo: dict) -> StagePlacement:
        return self

    def __reduce__(self) -> tuple:
        return (type(None), ())  # unpickled as None


def _owners(k: int, world: int, group: Any, columns: list[list[int]] | None
            ) -> tuple[tuple[int, ...], ...]:
    """The global ranks training each of the ``k`` stages: stage ``s`` on pp rank
    ``s % world``, that is every (dp, tp) index's rank of it (``columns``: the global ranks
    of each pp group) or, without a mesh, that rank of ``group``."""
    dist = torch.distributed
    if columns is not None:
        return tuple(tuple(sorted(col[s % world] for col in columns)) for s in range(k))
    return tuple((dist.get_global_rank(group, s % world) if group is not None
                  else s % world,) for s in range(k))


@contextlib.contextmanager
def paused_observers(module: nn.Module) -> Iterator[None]:
    """Nothing run inside reaches a statistic of ``module``: every quantizer's observer is
    paused (its ``observe`` flag restored after) and every buffer (BatchNorm running
    statistics, observer state) is put back as it was."""
    from qcompile.runtime.calibration import quantizers

    qs = list(quantizers(module).values())
    flags = [(q.observe, q.observed) for q in qs]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    for q in qs:
        q.observe = False
    try:
        yield
    finally:
        for q, (observe, observed) in zip(qs, flags):
            q.observe, q.observed = observe, observed
        with torch.no_grad():
            for b, saved in buffers:
                if not torch.equal(b, saved):
                    b.copy_(saved)


# torch's per-stage shape inference (2.6+: _forward_metadata_inference; before: _shape_inference)
_INFERENCE = ("_forward_metadata_inference", "_shape_inference")


def protect_observers(stage: Any) -> Any:
    """Run ``stage``'s shape-inference forward under ``paused_observers``."""
    for name in _INFERENCE:
        infer = getattr(stage, name, None)
        if infer is None:
            continue

        @functools.wraps(infer)
        def guarded(*args: Any, _infer: Any = infer, **kwargs: Any) -> Any:
            wrapper = stage.submod
            # a DDP-wrapped stage infers through the bare module: DDP's reducer must see
            # only the schedule's real forwards and backwards
            inner = getattr(wrapper, "module", wrapper) if hasattr(wrapper, "no_sync") else (
                wrapper)
            stage.submod = inner
            try:
                with paused_observers(inner):
                    return _infer(*args, **kwargs)
            finally:
                stage.submod = wrapper

        setattr(stage, name, guarded)
    return stage


def _replicate(module: nn.Module, spec: Any, dp_group: Any, dp_mesh: Any) -> nn.Module:
    """This rank's stage replicated over its data-parallel group: DDP (observer buffers
    are not broadcast: ``sync_observers`` reduces them once per step) or ``fully_shard``."""
    if spec.data_parallel.kind == "ddp":
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # buffers are broadcast once at construction (every replica starts equal), never
        # per forward: that would overwrite each replica's observations with rank 0's
        params = inspect.signature(DistributedDataParallel).parameters
        no_forward_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
                           else {"broadcast_buffers": False})
        return DistributedDataParallel(module, process_group=dp_group, **no_forward_sync)
    from torch.distributed.fsdp import fully_shard

    return fully_shard(module, mesh=dp_mesh)


def _tied_groups(gm: nn.Module, stage_rank: dict[int, int], mine: list[int], group: Any,
                 columns: list[list[int]] | None = None
                 ) -> list[tuple[list[torch.Tensor], Any]]:
    """Process groups among the ranks holding each tied parameter (created on every rank
    in the same order, as new_group requires), with this rank's copies. ``columns``
    (pipeline x data parallel): the global ranks of every pp group, one per dp index; each
    gets its own groups, created by every rank in the same order."""

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
        if columns is None:
            candidates = [[r if group is None else torch.distributed.get_global_rank(group, r)
                           for r in ranks]]
        else:
            candidates = [[col[r] for r in ranks] for col in columns]
        for global_ranks in candidates:
            sub_group = torch.distributed.new_group(global_ranks)
            if me not in global_ranks:
                continue
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

    With ``data_parallel.kind`` ``ddp`` or ``fsdp2`` (pipeline x data parallel) the ranks
    form the ``("pp", "dp")`` mesh of ``qc.distributed.mesh``: this rank's stage is wrapped
    in DDP over its dp group (or ``fully_shard`` over the dp sub-mesh) and the PipelineStage
    drives the wrapped module (``stage.submod``); stage ranks count within the pp group;
    observers are synchronised over the dp group once per ``step``; tied parameters are
    summed over the pp ranks holding them.
    """
    from torch.distributed import pipelining as pp

    spec = as_spec(spec)
    no_pipeline = QCompileError("qc.distributed.pipeline: the spec has no pipeline section",
                                fix="add pipeline: {stages: N, ...} and compile with that spec")
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        if spec.pipeline is None:  # the spec's own mistake first: no rank is waiting yet
            raise no_pipeline
        raise QCompileError("qc.distributed.pipeline needs an initialised process group",
                            fix="launch with torchrun and call "
                            "torch.distributed.init_process_group() first")
    # before anything that differs by rank: a schedule, a stage count or a graph of one
    # rank's own would leave the others waiting in the schedule until the timeout
    dumped = spec.model_dump(mode="json", exclude={"cache_dir"})
    code = digest("\n".join([str(getattr(gm, "code", ""))] + [
        str(getattr(c, "code", "")) for n, c in gm.named_children()
        if n.startswith("stage_")]))
    agree("qc.distributed.pipeline", {
        "spec": dumped, "graph": code, "tensors": tensors_of(gm),
        "loss_fn": loss_fn is not None}, group,
        fixes={"loss_fn": "pass loss_fn= on every rank (the last stage computes the loss)"})
    if spec.pipeline is None:  # after agreeing: every rank raises it, none waits
        raise no_pipeline
    k = spec.pipeline.num_stages
    missing = [f"stage_{i}" for i in range(k) if not hasattr(gm, f"stage_{i}")]
    if missing:
        raise QCompileError(f"qc.distributed.pipeline: the graph has no {missing[0]}",
                            fix="pass the GraphModule qc.qcompile returned for this spec")
    hybrid = spec.data_parallel.kind != "none"
    tp_mesh = sync_group = None
    tensor_parallel = spec.tensor_parallel is not None
    # with data or tensor parallel, every rank steps together
    step_group = None if hybrid or tensor_parallel else group
    dp_group = dp_mesh = None
    columns: list[list[int]] | None = None
    if hybrid or tensor_parallel:  # a mesh: validated before any communication
        from qcompile.distributed.hybrid import agreed_mesh

        if group is not None:
            raise QCompileError("qc.distributed.pipeline: pipeline x data (or tensor) "
                                "parallel builds its own mesh over the world; group= is not "
                                "supported", fix="drop group=, or set data_parallel.kind: "
                                "none and remove tensor_parallel")
        device_mesh = agreed_mesh(spec)
        names = device_mesh.mesh_dim_names
        group = device_mesh.get_group("pp")
        if "dp" in names:
            dp_group, dp_mesh = device_mesh.get_group("dp"), device_mesh["dp"]
        sync_group = dp_group
        if tensor_parallel:
            tp_mesh = device_mesh["tp"]
            # a stage's activation statistics combine over its dp x tp ranks (sharded
            # regions hold a slice of each activation on each tp rank)
            sync_group = (device_mesh["dp", "tp"]._flatten().get_group() if "dp" in names
                          else device_mesh.get_group("tp"))
        # the global ranks of every pp group: one per (dp, tp) index
        pp_last = device_mesh.mesh.movedim(0, -1)
        columns = [[int(r) for r in col]
                   for col in pp_last.reshape(-1, pp_last.shape[-1]).tolist()]
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
    modules = {s: gm.get_submodule(f"stage_{s}") for s in mine}
    if tensor_parallel:  # this rank's stage sharded across its tp ranks (torch's styles)
        from qcompile.distributed.tensor_parallel import parallelize, refuse_sliced_cuts

        refuse_sliced_cuts(gm, k)

        for s in mine:
            parallelize(gm, tp_mesh, within=f"stage_{s}")
    wrapped = ({s: _replicate(mod, spec, dp_group, dp_mesh) for s, mod in modules.items()}
               if hybrid else modules)
    m = spec.pipeline.microbatches
    # the local part (this rank's stages on its devices, the schedule): a failure on one
    # rank fails every rank (with pipeline x data parallel, every rank of the world)
    with collective_phase("qc.distributed.pipeline (building this rank's stages)",
                          None if hybrid or tensor_parallel else group):
        stages = [protect_observers(pp.PipelineStage(wrapped[s], s, k, devices[s],
                                                     group=group)) for s in mine]
        # Gradients are averaged over micro-batches here, once per distinct parameter:
        # torch's own scaling divides per stage, twice for a parameter two local stages share.
        if kind == "gpipe":
            schedule = pp.ScheduleGPipe(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        elif kind == "1f1b":
            schedule = pp.Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = pp.ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn,
                                                  scale_grads=False)
    params = list({id(p): p for st in stages for p in st.submod.parameters()}.values())
    inputs = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    gm.meta[PIPELINE_KEY] = StagePlacement(step_group, _owners(k, world, group, columns), {
        "spec": digest(json.dumps(dumped, sort_keys=True)), "graph": code})
    tied = _tied_groups(gm, stage_rank, mine, group, columns)
    from qcompile.distributed.data_parallel import apply_pending, reduce_observers

    synced = (hybrid or tensor_parallel) and spec.quant.sync_observers
    weights = spec.data_parallel.kind != "ddp" and not tensor_parallel

    def sync() -> dict[str, int]:
        """Once per step: over this stage's dp (x tp) ranks only, or this rank's own step
        updates applied (each stage's quantizers live on one rank)."""
        stats = {"collectives": 0, "bytes": 0}
        for mod in modules.values():
            done = (reduce_observers(mod, sync_group, weights=weights)
                    if synced else apply_pending(mod, sync=False))
            for key, value in done.items():
                stats[key] += value
        return stats
    return (stages if kind == "interleaved_1f1b" else stages[0],
            PipelineSchedule(schedule, inputs, m, tied, params, sync=sync, dp_group=dp_group,
                             accumulate=spec.train.accumulate, group=step_group,
                             fingerprint={"spec": digest(json.dumps(dumped, sort_keys=True)),
                                          "graph": code, "loss_fn": loss_fn is not None}))
