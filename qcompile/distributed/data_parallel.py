"""Data parallelism: wrap a compiled graph in DDP or FSDP2, keep observers in sync across
ranks, and one optimizer step with gradient accumulation.

``wrap`` keeps observers in sync: with step updates (``quant.observer_update: step``,
the default) once per optimizer step, else after every forward. A hand-written loop around
``DistributedDataParallel(gm)`` calls ``sync_observers(gm)`` itself after each
``optimizer.step()`` (after each forward with ``observer_update: forward``);
a graph whose observers keep training under a process group of several ranks with nothing
synchronising them warns once (``watch_observer_sync``).

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.distributed.data_parallel import sync_observers
    >>> gm = qc.qcompile(torch.nn.Linear(4, 4), "int8-qat", example_inputs=(torch.randn(2, 4),))
    >>> sync_observers(gm)  # no process group: nothing to reduce
    {'collectives': 0, 'bytes': 0}
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.distributed.agree import (
    MODEL_FIX,
    GroupCheck,
    agree,
    batch_shapes,
    digest,
    model_fingerprint,
    tensors_of,
)
from qcompile.distributed.devices import collective_device, staged
from qcompile.distributed.guards import data_parallel_inner, refuse_wrapped
from qcompile.errors import QCompileError
from qcompile.graph.meta import (
    COLLECTIVES_KEY,
    SHARDED_KEY,
    STEPS_SEEN_KEY,
    SYNC_OBSERVERS_KEY,
)
from qcompile.runtime import weight_cache
from qcompile.runtime.fake_quant import (
    PENDING_IN_STEP,
    PENDING_NONE,
    PENDING_STEP_ENDED,
    FakeQuantize,
)
from qcompile.runtime.frozen import FrozenWeight
from qcompile.runtime.observers import MovingAverageObserver
from qcompile.runtime.sharded import ShardedEmbedding, ShardedLinear
from qcompile.specs import as_spec


def initialised() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def several_ranks(group: Any = None) -> bool:
    """Whether ``group`` (None: the world) is a process group of two or more ranks."""
    return initialised() and torch.distributed.get_world_size(group) > 1


# The attribute a compiled graph's sync watch reads: "watching" until the graph is
# synchronised (``sync_observers``) or wrapped (``wrap``), or has warned; then "off".
_WATCH = "_qc_observer_sync"
UNSYNCED_WARNING = (
    "observers of this graph keep updating under a process group of {world} ranks, but "
    "nothing synchronises them: each rank's scales drift apart. Wrap the graph with "
    "qc.distributed.wrap(gm, spec) (it syncs them), or in a hand-written "
    "DistributedDataParallel loop call qc.distributed.sync_observers(gm) after each "
    "optimizer.step() (after each forward with quant.observer_update: forward; or "
    "qc.freeze(gm) to stop the observers)")


def _check_observer_sync(module: nn.Module, args: Any) -> None:
    """Forward pre-hook on a compiled graph (``watch_observer_sync``): one attribute read
    per forward once decided; before that, a few cheap checks per training forward."""
    state = module.__dict__.get(_WATCH)
    if state != "watching" or not module.training or torch.compiler.is_compiling():
        return
    if not initialised():
        return
    world = torch.distributed.get_world_size()
    if world < 2:
        module.__dict__[_WATCH] = "off"
        return
    # first training forward under the group: observations made so far (compile time,
    # freeze) are not drift; from the second on, an observer that updated in an earlier
    # forward and was not synchronised since is
    if not module.__dict__.get("_qc_observer_sync_armed", False):
        module.__dict__["_qc_observer_sync_armed"] = True
        return
    if any(isinstance(m, FakeQuantize) and m.observe and m.observer is not None
           and (m.observed or m.pending_stats() is not None) for m in module.modules()):
        module.__dict__[_WATCH] = "off"
        warnings.warn(UNSYNCED_WARNING.format(world=world), UserWarning, stacklevel=2)


def watch_observer_sync(gm: nn.Module) -> nn.Module:
    """Install the once-only warning for observers nobody synchronises (``qcompile`` does
    it for every graph whose spec has ``quant.sync_observers``).

    A forward pre-hook on the graph (a module-level function: the graph still pickles): on
    a training forward under an initialised process group of two or more ranks, from the
    second such forward on, a quantizer that still observes and updated since the last
    ``sync_observers`` makes it warn once. ``wrap`` and ``sync_observers`` switch the
    check off for good (one dict lookup per forward remains); ``FakeQuantize.forward`` is
    untouched. Evaluation-mode forwards (``qc.calibrate``, which syncs at its end) are not
    checked."""
    meta = getattr(gm, "meta", None)
    if _apply_after_step not in gm._forward_pre_hooks.values():
        gm.register_forward_pre_hook(_apply_after_step)
    # the step a state dict's pending statistics belong to goes with them (see _StepsSeen)
    if _save_steps_seen not in gm._state_dict_hooks.values():
        gm.register_state_dict_post_hook(_save_steps_seen)
    if _load_steps_seen not in gm._load_state_dict_post_hooks.values():
        gm.register_load_state_dict_post_hook(_load_steps_seen)
    # GraphModule.__deepcopy__ rebuilds the module and keeps no forward hooks (only its
    # state-dict and deepcopy hooks): without this, a deep copy's step-update observers
    # would never apply. torch.fx's own (private) deepcopy hook list re-installs them.
    hooks = getattr(gm, "_deepcopy_hooks", None)
    if isinstance(hooks, list) and watch_observer_sync not in hooks:
        hooks.append(watch_observer_sync)
    if isinstance(meta, dict) and meta.get(SYNC_OBSERVERS_KEY) is False:
        return gm  # the spec turned synchronisation off: local observers are intended
    gm.__dict__.setdefault(_WATCH, "watching")
    if _check_observer_sync not in gm._forward_pre_hooks.values():
        gm.register_forward_pre_hook(_check_observer_sync)
    return gm


def _mark_synced(gm: nn.Module) -> None:
    for m in gm.modules():
        if m.__dict__.get(_WATCH) == "watching":
            m.__dict__[_WATCH] = "off"


def sync_observers(gm: nn.Module, group: Any = None, *, everything: bool = False,
                   weights: bool | None = None) -> dict[str, int]:
    """Reduce observer statistics across the data-parallel group, then recompute qparams.

    With step updates (``quant.observer_update: step``, the default), call it once per
    optimizer step, after ``optimizer.step()``: it reduces the step's pending statistics
    (every micro-batch's, every rank's) and applies them, so the next step quantizes with
    the same qparams on every rank, whatever the world size. ``qc.distributed.wrap`` and
    ``train_step`` do this themselves; so does a graph's next forward after an optimizer
    step, across the group ``wrap`` was given (without ``wrap``: locally, and a warning
    says the ranks drift). A hand-written loop around ``DistributedDataParallel(gm)``
    calls it on every rank::

        ddp = DistributedDataParallel(gm)
        for x, y in loader:
            loss_fn(ddp(x), y).backward()
            opt.step(); opt.zero_grad()
            qc.distributed.sync_observers(gm)   # every rank's qparams identical again

    Quantizers that update in every forward (``observer_update: forward``) are reduced as
    they are: min-max observers take the min of mins and max of maxes, moving averages the
    mean (call it after each forward for those). Histogram-based activation observers of
    a graph ``wrap`` keeps in sync combine each forward's range and histogram across the
    group inside the forward (``RankSync``): they are the same on every rank already and
    are left out here. Step updates
    take the min of mins and max of maxes of the step and fold them in once. All quantizers
    go in one flattened collective per reduction kind (at most three per call), not one
    per quantizer, on the backend's device (``collective_device``: the rank's GPU for NCCL,
    CPU for gloo) whatever device the observers are on. Only quantizers that observed since
    the last call take part (every rank ran the same forwards, so it is the same set),
    unless ``everything``. ``group`` defaults to the world (with pipeline x data parallel:
    the stage's data-parallel group). ``weights``: reduce weight quantizers too (default:
    as ``wrap`` registered, False under DDP, whose replicas see the same weights; True for
    a graph ``wrap`` never saw). Without a process group the pending statistics are
    applied locally. Returns the number of collectives and bytes sent.

    Under a process group every rank of ``group`` must call it, with the same model: the
    ranks first agree on the call and the model (``agree``: a check through the store,
    not a collective), so a call made on some ranks only, or on another model, is the same
    ``QCompileError`` on every rank instead of a hang."""
    if not isinstance(gm, nn.Module):
        raise QCompileError(f"sync_observers takes the graph qc.qcompile returned, got "
                            f"{type(gm).__name__}",
                            fix="pass gm = qc.qcompile(model, spec, ...) (the graph itself, "
                                "or the DistributedDataParallel wrapping it)")
    if initialised():
        agree("qc.distributed.sync_observers",
              {"model": model_fingerprint(gm), "everything": everything, "weights": weights},
              group, fixes={"model": MODEL_FIX})
    return reduce_observers(gm, group, everything=everything, weights=weights)


def reduce_observers(gm: nn.Module, group: Any = None, *, everything: bool = False,
                     weights: bool | None = None,
                     skip: Collection[FakeQuantize] = ()) -> dict[str, int]:
    """``sync_observers`` without its check, for callers whose ranks already agreed (a
    pipeline step, ``qc.calibrate``). ``skip``: quantizers whose statistics are global
    already (the same on every rank)."""
    _mark_synced(gm)
    stats = apply_pending(gm, group)
    if weights is None:
        registered = gm.__dict__.get(_SYNC_GROUP)
        weights = registered[1] if registered is not None else True
    more = _reduce_observed(gm, group, everything=everything, weights=weights, skip=skip)
    return {k: stats[k] + more[k] for k in stats}


def apply_pending(gm: nn.Module, group: Any = None, *, sync: bool = True) -> dict[str, int]:
    """Apply the step updates' pending statistics of ``gm``'s quantizers (see
    ``FakeQuantize.apply_pending``): with ``sync`` and a process group, first reduced across
    ``group`` (the min of the minima, the max of the maxima: one all-reduce of the negated
    minima and the maxima together); each observer then takes them as one update. Returns
    the number of collectives and bytes sent."""
    stats = {"collectives": 0, "bytes": 0}
    if not (sync and initialised()):
        # each on its own: no order to agree on. This runs after every optimizer step: a
        # plain walk of the module tables (named_modules builds every name), not into a
        # quantizer's observer; a module reached twice has nothing pending the second time
        stack = [gm]
        while stack:
            m = stack.pop()
            if isinstance(m, FakeQuantize):
                m.apply_pending()
            else:
                stack.extend(c for c in m._modules.values() if c is not None)
        return stats
    qs = [m for _, m in sorted(gm.named_modules(), key=lambda kv: kv[0])
          if isinstance(m, FakeQuantize) and m.pending_stats() is not None]
    if not qs:
        return stats
    device = collective_device(group)
    pending = [q.pending_stats() for q in qs]
    with torch.no_grad():
        flat = torch.cat([staged(t.reshape(-1), device) for mn, mx in pending
                          for t in (-mn, mx)])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
    stats["collectives"] = 1
    stats["bytes"] = flat.numel() * flat.element_size()
    offset = 0
    for q, (mn, _) in zip(qs, pending):
        n = mn.numel()
        lo = -flat[offset:offset + n].view_as(mn)
        hi = flat[offset + n:offset + 2 * n].view_as(mn)
        offset += 2 * n
        q.apply_pending((lo, hi))
    return stats


def _reduce_observed(gm: nn.Module, group: Any = None, *, everything: bool = False,
                     weights: bool = True, skip: Collection[FakeQuantize] = ()
                     ) -> dict[str, int]:
    """The per-forward reduction of quantizers that update in every forward (those that
    observed since the last call, or ``everything``; weight quantizers only with
    ``weights``): min of mins and max of maxes, mean of moving averages. Observers that
    combine across the ranks as they observe (``across``: histogram-based ones under
    ``keep_observers_in_sync``), and those in ``skip``, are global already: left out."""
    stats = {"collectives": 0, "bytes": 0}
    if not initialised():
        return stats
    skipped = {id(q) for q in skip}
    qs = [m for _, m in sorted(gm.named_modules(), key=lambda kv: kv[0])
          if isinstance(m, FakeQuantize) and m.observer is not None
          and (everything or m.observed) and (weights or not m.weight)
          and m.pending_stats() is None and id(m) not in skipped
          and getattr(m.observer, "across", None) is None]
    if not qs:
        return stats
    world = torch.distributed.get_world_size(group)
    device = collective_device(group)
    mins = [q.observer.min_val for q in qs if not isinstance(q.observer, MovingAverageObserver)]
    maxs = [q.observer.max_val for q in qs if not isinstance(q.observer, MovingAverageObserver)]
    avgs = [t for q in qs if isinstance(q.observer, MovingAverageObserver)
            for t in (q.observer.min_val, q.observer.max_val)]
    ops = torch.distributed.ReduceOp
    with torch.no_grad():
        for tensors, op in ((mins, ops.MIN), (maxs, ops.MAX), (avgs, ops.SUM)):
            if not tensors:
                continue
            flat = torch.cat([staged(t.reshape(-1), device) for t in tensors])
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


@dataclass(frozen=True, eq=False)
class RankSync:
    """Statistics combined across the ranks of ``group`` (None: the world) while they are
    gathered (``qcompile.runtime.observers.RankReduction``): what makes histogram-based
    observers (in every forward) and calibration's moving averages (per batch) hold what
    one process observing the global batch would. Each call is one all-reduce, on the
    backend's device (``collective_device``).

    What it sends, per histogram-based activation quantizer and observed batch: the
    range (4 float64: the negated minimum, the maximum, a NaN flag, the largest element
    count; 32 bytes) and the bin counts (int32 while the global count fits, else int64:
    8 KiB for the default 2048 bins).

    Copies of a graph share it (``qc.convert`` works on one); a pickled graph forgets it,
    as it forgets its ``wrap`` group.

    Example:
        >>> import torch
        >>> RankSync().extremes(torch.tensor([1.0]), torch.tensor([2.0]), 3)  # no group
        (tensor([1.]), tensor([2.]), 3)
    """

    group: Any = None

    def extremes(self, mn: torch.Tensor, mx: torch.Tensor, count: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not initialised():
            return mn, mx, count
        n = mn.numel()
        with torch.no_grad():
            lo = mn.detach().reshape(-1).to(torch.float64)
            hi = mx.detach().reshape(-1).to(torch.float64)
            bad = lo.isnan() | hi.isnan()
            # float32 -> float64 and back is exact; a NaN entry is sent as a flag (MAX
            # over NaN depends on the backend) and comes back NaN on every rank
            flat = torch.cat([(-lo).masked_fill(bad, float("-inf")),
                              hi.masked_fill(bad, float("-inf")), bad.to(torch.float64),
                              torch.full((1,), float(count), dtype=torch.float64,
                                         device=lo.device)])
            flat = staged(flat, collective_device(self.group))
            torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX,
                                         group=self.group)
            flat = flat.to(mn.device)
            nan = flat[2 * n:3 * n] > 0
            lo = (-flat[:n]).masked_fill(nan, float("nan"))
            hi = flat[n:2 * n].masked_fill(nan, float("nan"))
        return (lo.to(mn.dtype).view_as(mn), hi.to(mx.dtype).view_as(mx),
                int(flat[3 * n]))

    def total(self, counts: torch.Tensor, largest: int) -> torch.Tensor:
        if not initialised():
            return counts
        world = torch.distributed.get_world_size(self.group)
        wire = torch.int32 if largest * world < 2**31 else torch.int64
        with torch.no_grad():
            out = staged(counts.to(wire), collective_device(self.group))
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM,
                                         group=self.group)
        return out.to(counts.device, torch.int64)

    def __deepcopy__(self, memo: dict) -> RankSync:
        return self

    def __reduce__(self) -> tuple:
        return (_forgotten, ())


def combine_in_forward(gm: nn.Module, group: Any = None) -> int:
    """Give every histogram-based activation observer of ``gm`` a ``RankSync`` over
    ``group``: each forward then combines its batch's range and histogram across the
    ranks (collectives inside the forward, like SyncBatchNorm's), so the ranks hold the
    global batch's histogram and choose the same range. Weight quantizers are left
    alone (every rank sees the same weights). Returns how many it set."""
    sync = RankSync(group)
    count = 0
    for m in gm.modules():
        if (isinstance(m, FakeQuantize) and getattr(m.observer, "needs_data", False)
                and not (m.weight or not m.per_example)):
            m.observer.across = sync
            count += 1
    return count


def sum_across_ranks(tensors: list[torch.Tensor], group: Any = None) -> None:
    """Sum each tensor in place across ``group`` (the world by default), staged on the
    backend's device (NCCL needs the rank's GPU): how the data-driven PTQ algorithms in
    ``qc.calibrate`` give every rank the same statistics. Without a process group it does
    nothing."""
    if not initialised():
        return
    device = collective_device(group)
    with torch.no_grad():
        for t in tensors:
            staged_t = staged(t, device)
            torch.distributed.all_reduce(staged_t, op=torch.distributed.ReduceOp.SUM,
                                         group=group)
            if staged_t is not t:
                t.copy_(staged_t)


def _sync_after_forward(module: nn.Module, args: Any, out: Any) -> None:
    """Forward hook ``keep_observers_in_sync`` registers: reduce what this forward observed
    across the group it registered. A module-level function (the graph still pickles);
    a loaded graph has forgotten its group (``_Synced``) and does nothing until wrapped
    again."""
    synced = module.__dict__.get(_SYNC_GROUP)
    if synced is None:
        return
    group, weights = synced
    _mark_synced(module)
    _reduce_observed(module, group, weights=weights)


# The attribute of a compiled graph saying how its observers are kept in sync, once
# ``wrap`` (or compile_once) does (a ``_Synced``); absent or None (a loaded graph): step
# updates apply locally.
_SYNC_GROUP = "_qc_sync_group"


class _Synced(tuple):
    """(the data-parallel group (None: the world), whether weight quantizers are reduced
    too). Copies of the graph (``qc.convert`` works on one) share it; a pickled graph
    forgets it (a process group does not pickle): wrap the loaded graph again."""

    def __deepcopy__(self, memo: dict) -> _Synced:
        return self

    def __reduce__(self) -> tuple:
        return (_forgotten, ())


def _forgotten() -> None:
    return None




@dataclass(frozen=True)
class _StepsSeen:
    """The optimizer step count (``weight_cache.optimizer_steps()``) at a graph's last
    forward: the next forward after it changed applies the pending statistics.

    A deep copy shares it (the count is the process's, and the copy has seen what the
    original has). A pickle keeps only whether a step came after that forward (the count
    means nothing in another process): loaded, such a graph applies its pending
    statistics at its next forward, any other counts from the load on."""

    counter: object  # the step counter (None: a step came, count unknown)
    count: int

    def step_since(self) -> bool:
        counter, count = weight_cache.optimizer_steps()
        return self.counter is not counter or self.count != count

    def __deepcopy__(self, memo: dict) -> _StepsSeen:
        return self

    def __reduce__(self) -> tuple:
        return (_loaded_steps_seen, (self.step_since(),))


_STEP_ENDED = _StepsSeen(None, -1)  # never the current count: the next forward applies


def _loaded_steps_seen(step_ended: bool) -> _StepsSeen:
    return _STEP_ENDED if step_ended else _StepsSeen(*weight_cache.optimizer_steps())


def _seen_store(module: nn.Module) -> dict:
    """Where ``module`` keeps its _StepsSeen: ``meta`` (a GraphModule's), else its
    ``__dict__``."""
    meta = module.__dict__.get("meta")
    return meta if type(meta) is dict else module.__dict__


def _apply_after_step(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of every compiled graph (``watch_observer_sync``): the first
    forward after an optimizer step applies the pending statistics of the steps before
    (across the group ``wrap`` registered, else locally). One comparison otherwise."""
    if torch.compiler.is_compiling():
        return
    counter, count = weight_cache.optimizer_steps()
    store = module.__dict__.get("meta")  # _seen_store, inlined: this runs every forward
    if type(store) is not dict:
        store = module.__dict__
    seen = store.get(STEPS_SEEN_KEY)
    if seen is not None and seen.counter is counter and seen.count == count:
        return
    store[STEPS_SEEN_KEY] = _StepsSeen(counter, count)
    if seen is None:
        return
    group = module.__dict__.get(_SYNC_GROUP)
    apply_pending(module, group[0] if group is not None else None, sync=group is not None)


def _save_steps_seen(module: nn.Module, state_dict: dict, prefix: str, _: Any) -> None:
    """State-dict post-hook of a compiled graph: when an optimizer step came after the
    forwards that gathered its pending statistics, their entries say so
    (``PENDING_STEP_ENDED``), so that a graph loading them applies them at its next
    forward, as this one will."""
    seen = _seen_store(module).get(STEPS_SEEN_KEY)
    if seen is None or not seen.step_since():
        return
    # by identity, not by name: a pipeline graph's own hook renames its entries to the
    # model's names (FakeQuantize.get_extra_state returns the quantizer's own tensor)
    entries = {id(v): v for v in state_dict.values() if isinstance(v, torch.Tensor)}
    for q in module.modules():
        if isinstance(q, FakeQuantize) and q.pending_stats() is not None:
            entry = entries.get(id(q.extra_state_entry()))
            if entry is not None and entry.numel() > 2 and entry.device.type != "meta" and (
                    float(entry[1]) == PENDING_IN_STEP):
                entry[1] = PENDING_STEP_ENDED


def _load_steps_seen(module: nn.Module, incompatible_keys: Any) -> None:
    """Load-state-dict post-hook of a compiled graph: pending statistics loaded from a
    state dict are applied when the graph that saved them would have: at the next forward
    if an optimizer step came after them, else at the first forward after the next
    optimizer step."""
    loaded = [q.loaded_pending() for q in module.modules() if isinstance(q, FakeQuantize)]
    if all(code == PENDING_NONE for code in loaded):
        return
    _seen_store(module)[STEPS_SEEN_KEY] = (
        _STEP_ENDED if PENDING_STEP_ENDED in loaded
        else _StepsSeen(*weight_cache.optimizer_steps()))


def apply_registered(gm: nn.Module) -> dict[str, int]:
    """``apply_pending`` as ``gm``'s forwards do it: across the group ``wrap`` registered,
    else locally (``train_step`` after the optimizer step, ``qc.freeze``)."""
    group = gm.__dict__.get(_SYNC_GROUP)
    return apply_pending(gm, group[0] if group is not None else None, sync=group is not None)


def keep_observers_in_sync(gm: nn.Module, spec: Any, group: Any = None) -> nn.Module:
    """With ``quant.sync_observers`` under an initialised process group, keep ``gm``'s
    observers equal across ``group``: step updates are reduced and applied once per
    optimizer step (at the next forward, or by ``train_step``); quantizers that update in
    every forward are reduced after it (weight quantizers too under FSDP2, where each rank
    observed its own initial weights at compile time; under DDP every replica sees the
    same weights, so theirs are never reduced). Either way, no warning about
    unsynchronised observers (they are synced, or local by the spec's choice). Under a
    process group ``group`` is kept as the graph's data-parallel group
    (``meta[COLLECTIVES_KEY]``): ``train_step`` and ``save_adapters`` agree over it first.
    Histogram-based activation observers (histogram, percentile, mse) combine every
    forward's range and histogram across ``group`` inside the forward
    (``combine_in_forward``): every rank holds the global batch's histogram, as one
    process would (two collectives per such quantizer and forward, ~8 KiB with 2048
    bins; see ``RankSync``)."""
    spec = as_spec(spec)
    _mark_synced(gm)
    meta = getattr(gm, "meta", None)
    if initialised() and isinstance(meta, dict):
        # the group the calls that communicate over this graph agree in first
        # (train_step, save_adapters of a sharded graph)
        meta[COLLECTIVES_KEY] = GroupCheck(group)
    # once per graph: a second call (a Lightning setup() run again) adds no second hook
    if spec.quant.sync_observers and initialised() and gm.__dict__.get(_SYNC_GROUP) is None:
        # DDP replicas see the same weights; so do tensor-parallel ranks' quantizers
        # (their ranges are the whole weight's already: qcompile.runtime.sharded)
        weights = spec.data_parallel.kind != "ddp" and spec.tensor_parallel is None
        gm.__dict__[_SYNC_GROUP] = _Synced((group, weights))
        combine_in_forward(gm, group)  # histograms: each forward's, across the group
        if _sync_after_forward not in gm._forward_hooks.values():  # (a loaded graph has it)
            gm.register_forward_hook(_sync_after_forward)
    return gm


def wrap(gm: nn.Module, spec: Any, group: Any = None, **kwargs: Any) -> nn.Module:
    """Replicate a compiled graph as ``spec.data_parallel.kind`` says.

    - ``ddp``: ``DistributedDataParallel(gm, **kwargs)``.
    - ``fsdp2``: ``fully_shard`` on every module the graph calls that owns parameters
      (learnable quantizers get a float32 ``MixedPrecisionPolicy`` of their own, so scales
      stay fp32 under a bf16 policy), then on the root with ``kwargs`` (``mesh``,
      ``mp_policy``, ...). Parameters the graph reads directly (re-expressed Linear/Conv
      weights) belong to the root's group.
    - ``none``: ``gm`` itself.

    With a ``tensor_parallel`` section the planned layers are first sharded across the
    mesh's ``tp`` dim (``qcompile.distributed.tensor_parallel``: torch's
    ``parallelize_module``), and ``fully_shard`` runs on its ``dp`` dim.

    A graph ``compile_once`` already sharded (``fsdp2``) is returned as it is.

    With ``quant.sync_observers`` and an initialised process group, observer statistics
    are reduced across ranks (``keep_observers_in_sync``: step updates once per optimizer
    step, the others after every forward), and the graph's unsynchronised-observer
    warning is switched off.
    """
    spec = as_spec(spec)
    kind = spec.data_parallel.kind
    if kind != "none" and not initialised():
        raise QCompileError(f"data_parallel.kind: {kind} needs an initialised process group",
                            fix="launch with torchrun and call "
                            "torch.distributed.init_process_group() first")
    # before DDP's or fully_shard's first collective: another spec or graph on one rank
    # is the same clear error on every rank, not a hang or a collective-size abort
    agree("qc.distributed.wrap", {
        "spec": spec.model_dump(mode="json", exclude={"cache_dir"}),
        "graph": digest(str(getattr(gm, "code", ""))),
        "tensors": tensors_of(gm)}, group, fixes={"tensors": MODEL_FIX, "graph": MODEL_FIX})
    if kind == "fsdp2" and getattr(gm, "meta", {}).get(SHARDED_KEY):
        return gm  # compile_once sharded it per block and syncs its observers already
    refuse_wrapped(gm)
    if spec.tensor_parallel is not None:
        if spec.pipeline is not None:
            raise QCompileError("qc.distributed.wrap: the spec has pipeline stages and a "
                                "tensor_parallel section",
                                fix="run it with qc.distributed.pipeline(gm, spec, "
                                "loss_fn=...), which shards each stage across tp")
        if group is not None:
            raise QCompileError("qc.distributed.wrap: group= with a tensor_parallel section "
                                "(the ranks form the spec's dp x tp mesh)",
                                fix="leave group out; launch dp x tp processes")
        from qcompile.distributed.hybrid import agreed_mesh
        from qcompile.distributed.tensor_parallel import parallelize

        mesh = agreed_mesh(spec)
        parallelize(gm, mesh["tp"])
        if kind == "fsdp2":
            kwargs.setdefault("mesh", mesh["dp"])
        # statistics of sharded activations combine across tp as well as dp: every rank
        group = None
    keep_observers_in_sync(gm, spec, group)
    if kind == "none":
        return gm
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if group is not None:
            kwargs.setdefault("process_group", group)
        return DistributedDataParallel(gm, **kwargs)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # what each graph calls (the graph, and its child graphs: one per block when the spec
    # says fsdp2, see qc.qcompile), by qualified name
    called, read = set(), set()
    for prefix, g in gm.named_modules():
        if isinstance(g, GraphModule):
            at = f"{prefix}." if prefix else ""
            called |= {at + str(n.target) for n in g.graph.nodes if n.op == "call_module"}
            read |= {at + str(n.target).rpartition(".")[0] for n in g.graph.nodes
                     if n.op == "get_attr"}
    for name in sorted(called, key=lambda s: -s.count(".")):  # innermost first
        module = gm.get_submodule(name)
        if not any(True for _ in module.parameters()) or name in read:
            continue
        if isinstance(module, (ShardedLinear, ShardedEmbedding)):
            # a tensor-parallel layer: its weight is read in the block like the others (one
            # all-gather a block), and its weight statistics are taken before the block's
            # forward (qcompile.runtime.sharded.WeightStatistics)
            continue
        if isinstance(module, FrozenWeight) or name.endswith((".lora_A", ".lora_B")):
            # a frozen base's output needs no gradient, so as its own group FSDP2 would
            # never gather it again for the backward, where it is dequantized again; an
            # adapter is a few rows. Both join the enclosing block's group (gathered for
            # the block's forward and backward): no all-gather of their own
            continue
        if isinstance(module, FakeQuantize):
            # fp32 scales whatever the model's policy; inputs keep their dtype (the
            # quantizer computes in fp32 and returns the input's dtype itself)
            fully_shard(module, mesh=kwargs.get("mesh"),
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                       reduce_dtype=torch.float32,
                                                       cast_forward_inputs=False))
        elif isinstance(module, GraphModule) or not any(
                isinstance(m, FakeQuantize) and m.learnable for m in module.modules()):
            # a block's child graph is one group (its learnable quantizers, sharded
            # above, keep their own)
            fully_shard(module, **kwargs)
    return fully_shard(gm, **kwargs)


_STEP_FIXES = {
    "model": MODEL_FIX,
    "accumulate": "give every rank the same train.accumulate (or accumulate=)",
    "inputs": "give every rank batches of the same shape apart from the batch dimension "
              "(pad sequences to one length on every rank), then launch again",
    "target": "give every rank targets of the same shape apart from the batch dimension, "
              "then launch again",
    "split": "use a batch size that is a multiple of train.accumulate on every rank",
}


def _step_group(model: nn.Module) -> tuple[bool, Any]:
    """Whether an optimizer step of ``model`` communicates, and over which group: DDP's
    process group; a sharded graph's (FSDP2) or one whose observers ``wrap`` keeps in sync,
    as registered (None: the world)."""
    inner = data_parallel_inner(model)
    if inner is not model:
        return True, getattr(model, "process_group", None)
    meta = getattr(inner, "meta", None)
    meta = meta if isinstance(meta, dict) else {}
    synced = inner.__dict__.get(_SYNC_GROUP)
    if synced is not None:
        return True, synced[0]
    from torch.distributed.fsdp import FSDPModule

    check = meta.get(COLLECTIVES_KEY)
    if isinstance(inner, FSDPModule) or meta.get(SHARDED_KEY):
        return True, check.group if check is not None else None
    return False, None


def _check_step_arguments(optimizer: Any, loss_fn: Any, accumulate: Any) -> None:
    """``train_step``'s arguments that are not what it calls or counts, refused by name
    before anything runs (the same on every rank that makes the same mistake)."""
    if not (callable(getattr(optimizer, "step", None))
            and callable(getattr(optimizer, "zero_grad", None))):
        raise QCompileError(f"train_step: optimizer is a {type(optimizer).__name__}, not an "
                            "optimizer (it needs step() and zero_grad())",
                            fix="pass torch.optim.SGD(model.parameters(), lr=...) (or any "
                                "torch.optim optimizer over the graph's parameters)")
    if not callable(loss_fn):
        raise QCompileError(f"train_step: loss_fn is a {type(loss_fn).__name__}, not a "
                            "function", fix="pass loss_fn=torch.nn.functional.mse_loss (any "
                            "function (output, target) -> scalar tensor)")
    if accumulate is not None and (isinstance(accumulate, bool)
                                   or not isinstance(accumulate, int) or accumulate < 1):
        raise QCompileError(f"train_step: accumulate={accumulate!r}: the number of "
                            "micro-batches per step must be an integer of 1 or more",
                            fix="pass accumulate=1 (no accumulation) or more, or leave it out "
                                "(spec.train.accumulate)")


def _first_loss(model: nn.Module, chunk: tuple, target: Any, loss_fn: Any) -> torch.Tensor:
    """The first micro-batch's loss, refused unless it is a scalar tensor (backward of
    anything else is torch's bare error); the forward's pending observations are dropped
    with the refusal, so the graph is as it was."""
    quantizers = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    pending = {id(q): q.get_extra_state().clone() for q in quantizers
               if q.pending_stats() is not None}
    loss = loss_fn(model(*chunk), target)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    for q in quantizers:  # what this forward gathered goes (what was there stays)
        if id(q) in pending:
            q.set_extra_state(pending[id(q)])
        elif q.pending_stats() is not None:
            q.set_extra_state(None)
    got = (f"a {str(loss.dtype).removeprefix('torch.')} tensor of shape {list(loss.shape)}"
           if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
    raise QCompileError(f"train_step: loss_fn returned {got}, not a scalar: backward needs "
                        "one number per step",
                        fix="reduce it in loss_fn, e.g. lambda out, y: "
                            "torch.nn.functional.mse_loss(out, y) or (...).mean()")


def train_step(model: nn.Module, optimizer: Any, inputs: Any, target: Any, loss_fn: Any,
               *, accumulate: int | None = None, spec: Any = None) -> float:
    """One optimizer step over a batch split into ``accumulate`` micro-batches (default
    ``spec.train.accumulate``). Under DDP the gradient all-reduce runs once, on the last
    micro-batch (``no_sync`` on the others); the loss is the mean over micro-batches.

    When the step communicates (DDP, FSDP2, observers kept in sync by ``wrap``), the ranks
    first agree, at every step, on the call, the model (its fingerprint: spec, graph code,
    tensors' shapes, as digests computed once per graph), ``accumulate`` and the batch's
    shapes apart from the batch dimension (``agree``: a few store round trips, no
    collective): a misshaped batch, another model or a step taken on some ranks only is
    the same ``QCompileError`` on every rank, naming the rank and what differs, instead of
    a size error on one rank and a hang or a lost connection on the others.

    Example:
        >>> import torch, qcompile as qc
        >>> gm = qc.qcompile(torch.nn.Linear(4, 1), "int8-qat")
        >>> opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        >>> loss = train_step(gm, opt, torch.randn(8, 4), torch.randn(8, 1),
        ...                   torch.nn.functional.mse_loss, accumulate=4)
        >>> isinstance(loss, float)
        True
    """
    _check_step_arguments(optimizer, loss_fn, accumulate)
    n = accumulate or (as_spec(spec).train.accumulate if spec is not None else 1)
    xs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    rows = [x.shape[0] for x in (*xs, target) if isinstance(x, torch.Tensor) and x.dim()]
    misfit = next((r for r in rows if r % n), None)
    communicates, group = _step_group(model)
    if communicates and initialised():  # every step: before the step's first collective
        agree("qc.distributed.train_step", {
            "model": model_fingerprint(model), "accumulate": n,
            "inputs": batch_shapes(list(xs)), "target": batch_shapes(target),
            "split": "fits" if misfit is None else
                     f"a batch of {misfit} rows does not split into {n} micro-batches"},
            group, fixes=_STEP_FIXES)
    if misfit is not None:
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
            if i == 0:  # its loss checked before anything is applied
                loss = _first_loss(model, chunk, tgt, loss_fn) / n
            else:
                loss = loss_fn(model(*chunk), tgt) / n
            loss.backward()
        total += loss.item()
    optimizer.step()
    # the step's observations (every micro-batch, every rank) take effect now, once
    for m in model.modules():
        if isinstance(m, GraphModule) and _apply_after_step in m._forward_pre_hooks.values():
            apply_registered(m)
            _seen_store(m)[STEPS_SEEN_KEY] = _StepsSeen(*weight_cache.optimizer_steps())
    return total
