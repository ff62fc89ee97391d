"""Adapters onto torch.distributed (the only qcompile module importing it).

The wrong-order guard (compile first, wrap after) and the pipeline adapter: this rank's
``PipelineStage`` and the torch schedule the spec names. qcompile never writes its own
collectives or schedules.

Example:
    >>> import torch
    >>> from qcompile.distributed import wrapper_kind
    >>> wrapper_kind(torch.nn.Linear(2, 2)) is None
    True
"""

from __future__ import annotations

from typing import Any

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


# -- pipeline parallelism ------------------------------------------------------------------
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
    from qcompile.passes.place import TIED_KEY

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

    from qcompile.compile import _as_spec
    from qcompile.passes.partition import stage_devices

    spec = _as_spec(spec)
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



# -- data parallel ---------------------------------------------------------------------------
def _initialised() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def sync_observers(gm: nn.Module, group: Any = None, *, everything: bool = False
                   ) -> dict[str, int]:
    """Reduce observer statistics across the data-parallel group, then recompute qparams.

    Min-max observers take the min of mins and max of maxes; moving averages the mean.
    All quantizers go in one flattened collective per reduction kind (at most three per
    call), not one per quantizer. Only quantizers that observed since the last call take
    part (every rank ran the same forward, so it is the same set), unless ``everything``.
    Returns the number of collectives and bytes sent."""
    from qcompile.fake_quant import FakeQuantize
    from qcompile.observers import MovingAverageObserver

    stats = {"collectives": 0, "bytes": 0}
    if not _initialised():
        return stats
    qs = [m for _, m in sorted(gm.named_modules(), key=lambda kv: kv[0])
          if isinstance(m, FakeQuantize) and m.observer is not None
          and (everything or m.observed)]
    if not qs:
        return stats
    world = torch.distributed.get_world_size(group)
    mins = [q.observer.min_val for q in qs if not isinstance(q.observer, MovingAverageObserver)]
    maxs = [q.observer.max_val for q in qs if not isinstance(q.observer, MovingAverageObserver)]
    avgs = [t for q in qs if isinstance(q.observer, MovingAverageObserver)
            for t in (q.observer.min_val, q.observer.max_val)]
    ops = torch.distributed.ReduceOp
    with torch.no_grad():
        for tensors, op in ((mins, ops.MIN), (maxs, ops.MAX), (avgs, ops.SUM)):
            if not tensors:
                continue
            flat = torch.cat([t.reshape(-1) for t in tensors])
            torch.distributed.all_reduce(flat, op=op, group=group)
            if op == ops.SUM:
                flat /= world
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            stats["collectives"] += 1
            stats["bytes"] += flat.numel() * flat.element_size()
        for q in qs:
            was_learning = q.learnable and not q.observe
            if not q.learnable or was_learning:
                q.refresh_qparams()  # a learnable scale is (re)initialised from synced stats
            q.observed = False
    return stats


def wrap(gm: nn.Module, spec: Any, group: Any = None, **kwargs: Any) -> nn.Module:
    """Replicate a compiled graph as ``spec.data_parallel.kind`` says.

    - ``ddp``: ``DistributedDataParallel(gm, **kwargs)``.
    - ``fsdp2``: ``fully_shard`` on every module the graph calls that owns parameters
      (learnable quantizers get a float32 ``MixedPrecisionPolicy`` of their own, so scales
      stay fp32 under a bf16 policy), then on the root with ``kwargs`` (``mesh``,
      ``mp_policy``, ...). Parameters the graph reads directly (re-expressed Linear/Conv
      weights) belong to the root's group.
    - ``none``: ``gm`` itself.

    With ``quant.sync_observers`` and an initialised process group, observer statistics
    are reduced across ranks after every forward (``sync_observers``).
    """
    from qcompile.compile import _as_spec
    from qcompile.fake_quant import FakeQuantize

    spec = _as_spec(spec)
    kind = spec.data_parallel.kind
    if kind != "none" and not _initialised():
        raise QCompileError(f"data_parallel.kind: {kind} needs an initialised process group",
                            fix="launch with torchrun and call "
                            "torch.distributed.init_process_group() first")
    refuse_wrapped(gm)
    if spec.quant.sync_observers and _initialised():
        gm.register_forward_hook(lambda module, args, out: (sync_observers(module, group),
                                                             None)[1])
    if kind == "none":
        return gm
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if group is not None:
            kwargs.setdefault("process_group", group)
        return DistributedDataParallel(gm, **kwargs)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    read = {str(n.target).rpartition(".")[0] for n in gm.graph.nodes if n.op == "get_attr"}
    for name in sorted(called, key=lambda s: -s.count(".")):  # innermost first
        module = gm.get_submodule(name)
        if not any(True for _ in module.parameters()) or name in read:
            continue
        if isinstance(module, FakeQuantize):
            # fp32 scales whatever the model's policy; inputs keep their dtype (the
            # quantizer computes in fp32 and returns the input's dtype itself)
            fully_shard(module, mesh=kwargs.get("mesh"),
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                       reduce_dtype=torch.float32,
                                                       cast_forward_inputs=False))
        elif not any(isinstance(m, FakeQuantize) and m.learnable for m in module.modules()):
            fully_shard(module, **kwargs)
    return fully_shard(gm, **kwargs)


def compile_once(build_model: Any, spec: Any, example_inputs: Any = None, *,
                 example_kwargs: dict[str, Any] | None = None,
                 calibration: Any = None, cache_dir: str | None = None,
                 group: Any = None) -> nn.Module:
    """Quantize once, share with every rank.

    Rank 0 builds the model, compiles it and (with ``calibration`` batches) calibrates it
    — or loads the result from the compile cache (``cache_dir``, or ``spec.cache_dir``).
    The other ranks build the model on the meta device (no memory), compile that, allocate
    the compiled graph once and receive every parameter and buffer from rank 0. All ranks
    end with bit-identical graphs; no rank but 0 ever holds the float model.
    Without a process group this is compile (+ calibrate, + cache) in one process.
    """
    from qcompile.api import calibrate, report
    from qcompile.cache import CompileCache, cache_key
    from qcompile.compile import _as_inputs, _as_spec, qcompile

    spec = _as_spec(spec)
    directory = cache_dir or spec.cache_dir
    rank = torch.distributed.get_rank(group) if _initialised() else 0
    inputs = _as_inputs(example_inputs)
    if rank == 0:
        model = build_model()
        key = None
        batches = list(calibration) if calibration is not None else None
        # The model was built here for this graph alone: no copy needed.
        gm = qcompile(model, spec, inputs, example_kwargs=example_kwargs, inplace=True)
        state, why = None, "no cache_dir"
        if directory is not None:
            # The compiled graph's own tensors (tensor constants included), before
            # calibration; where the cache lives is not part of what is cached.
            key = cache_key(gm.code, spec.model_dump_json(exclude={"cache_dir"}), gm, batches)
            state, why = CompileCache(directory).load(key)
        if state is not None:
            gm.load_state_dict(state)
        else:
            if batches is not None:  # rank 0 alone: no cross-rank sync to wait for
                calibrate(gm, batches, sync=False)
            if directory is not None:
                CompileCache(directory).store(key, gm, report(gm).model_dump_json())
        report(gm).passes[-1].notes.append(f"compile cache: {why}")
        del model
    else:
        meta = torch.device("meta")
        with meta:
            model = build_model()

        def to_meta(v: Any) -> Any:
            return v.to(meta) if isinstance(v, torch.Tensor) else v

        meta_inputs = tuple(to_meta(v) for v in inputs) if inputs is not None else None
        meta_kwargs = {k: to_meta(v) for k, v in (example_kwargs or {}).items()} or None
        gm = qcompile(model, spec, meta_inputs, example_kwargs=meta_kwargs, inplace=True)
        gm = gm.to_empty(device="cpu")
    if _initialised():
        tensors = [t for _, t in sorted([*gm.named_parameters(remove_duplicate=True),
                                         *gm.named_buffers(remove_duplicate=True)],
                                        key=lambda kv: kv[0])]
        src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for t in tensors:
                torch.distributed.broadcast(t.data, src=src, group=group)
        gm.load_state_dict(gm.state_dict())  # quantizer on/off flags follow their buffers
    return gm


def train_step(model: nn.Module, optimizer: Any, inputs: Any, target: Any, loss_fn: Any,
               *, accumulate: int | None = None, spec: Any = None) -> float:
    """One optimizer step over a batch split into ``accumulate`` micro-batches (default
    ``spec.train.accumulate``). Under DDP the gradient all-reduce runs once, on the last
    micro-batch (``no_sync`` on the others); the loss is the mean over micro-batches.

    Example:
        >>> import torch, qcompile as qc
        >>> gm = qc.qcompile(torch.nn.Linear(4, 1), "int8-qat")
        >>> opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        >>> loss = train_step(gm, opt, torch.randn(8, 4), torch.randn(8, 1),
        ...                   torch.nn.functional.mse_loss, accumulate=4)
        >>> isinstance(loss, float)
        True
    """
    import contextlib

    from qcompile.compile import _as_spec

    n = accumulate or (_as_spec(spec).train.accumulate if spec is not None else 1)
    xs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    if any(isinstance(x, torch.Tensor) and x.shape[0] % n for x in (*xs, target)):
        raise QCompileError(f"train.accumulate = {n} does not divide the batch",
                            fix="use a batch size that is a multiple of train.accumulate")
    chunks = list(zip(*(x.chunk(n) for x in xs)))
    targets = target.chunk(n)
    optimizer.zero_grad()
    total = 0.0
    for i, (chunk, tgt) in enumerate(zip(chunks, targets)):
        last = i == n - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else (
            model.no_sync())
        with sync:
            loss = loss_fn(model(*chunk), tgt) / n
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total
