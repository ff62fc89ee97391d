"""Quantize once and share the result with every rank (``qc.distributed.compile_once``).

Every rank first builds the model with its parameters on the meta device and its buffers
computed by the model's own code (``_parameters_on_meta``: rotary tables, masks, position
ids are real; weights cost nothing), and compiles it on meta. Three ways, by the spec and
the arguments:

- **Sharded** (``data_parallel.kind: fsdp2`` under a process group, no pipeline): no rank
  ever holds the whole model. The graph is split into one child per repeated block
  (``blocks``: the layers of a transformer, the stages of a ResNet; what comes before the
  first block joins it, what comes after joins the last) and each child is
  ``fully_shard``-ed, so a block's weights, including those the graph reads directly, are
  one FSDP2 group (the blocks sharing a parameter, tied embeddings, are one); then the
  graph is allocated (``to_empty``; a tensor several blocks read stays one tensor) and
  each rank loads only its rows of every parameter: from the ``checkpoint``
  (safetensors, read slice by slice into the rank's own memory), or streamed from rank 0,
  which builds the real model and broadcasts it one tensor at a time (freeing each tensor
  once sent). Gathers on CPU ranks go straight into FSDP2's buffer (``GatherInPlace``).
- **Replicated from a checkpoint** (``ddp``/``none`` with ``checkpoint``): every rank
  allocates one replica and reads the whole checkpoint into it.
- **Replicated from rank 0** (``ddp``/``none``, no checkpoint): every rank allocates one
  replica; rank 0 builds the real model and streams it as above. With ``quant.algorithms``
  (they rewrite the real weights while compiling) rank 0 compiles the real model in place
  instead and the others receive every tensor.

Non-persistent buffers (no checkpoint holds them) take rank 0's values: its real model
when it streams, else its build; a tensor nothing can fill (a buffer computed from a
parameter, a constant ``torch.export`` captured on meta) is an error naming it, before
anything is read. A graph exported on meta keeps no ``meta`` device literal
(``capture_export.follow_graph_device``).

Then every rank calibrates on its own ``calibration`` batches; with
``quant.sync_observers`` the observer statistics are reduced across ranks, so the qparams
equal one process calibrating on all ranks' batches. Sharded, the calibration unshards one
block at a time and hands the memory each block freed back to the OS before the next
(``one_block_at_a_time``): a rank peaks at its shards + 2 blocks with glibc's default
malloc settings, which are left unchanged. With a ``cache_dir``, what compiling
and calibrating produced (quantizer state, buffers such as BatchNorm statistics; never the
weights) is stored under a key over the checkpoint's content (or the model's weights), the
spec, the graph's code, every rank's calibration data and the versions.

Without a process group it is compile (+ load, + calibrate, + cache) in one process.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.distributed.once import compile_once
    >>> gm = compile_once(lambda: torch.nn.Linear(4, 4), "int8-static", (torch.randn(2, 4),),
    ...                   calibration=[torch.randn(2, 4) for _ in range(2)])
    >>> all(q.enabled and not q.observe for q in qc.quantizers(gm).values())
    True
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.distributed.agree import agree, collective_phase, digest, shapes_of
from qcompile.distributed.cache import CompileCache, cache_key, misfit
from qcompile.distributed.checkpoint import Checkpoint
from qcompile.distributed.data_parallel import (
    initialised,
    keep_observers_in_sync,
    sync_observers,
    watch_observer_sync,
    wrap,
)
from qcompile.distributed.devices import collective_device, staged
from qcompile.distributed.guards import (
    refusal,
    refuse_wrapped,
    unwrap_compiled,
    wrapper_under_construction,
)
from qcompile.distributed.tensor_parallel import (
    observe_sharded_weights,
    refuse_differing_tp_batches,
    refuse_strided_experts,
    refuse_tensor_parallel_once,
)
from qcompile.errors import QCompileError
from qcompile.graph.meta import (
    ADAPTERS_KEY,
    ALGORITHMS_SKIPPED_KEY,
    BLOCKS_KEY,
    FOLDS_KEY,
    SHARDED_KEY,
)
from qcompile.graph.records import report
from qcompile.graph.signature import graph_inputs
from qcompile.passes import as_inputs, compile_model
from qcompile.passes.insert_adapters import init_adapter
from qcompile.runtime.block_formats import nvfp4_tensor_scale
from qcompile.runtime.calibration import (
    check_calibratable,
    collect_statistics,
    model_weights,
    quantizers,
    refuse_nonfinite,
    return_freed_memory,
    weight_quantizers,
)
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.frozen import FrozenWeight
from qcompile.specs import CompileSpec, PipelineSpec, as_spec
from qcompile.specs.quant import DATA_KINDS

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_ENCODE_CHUNK = 1 << 16  # elements of a frozen base encoded at once (NF4: 8 MB of temporaries)
_FIXES = {
    "cache_dir": "pass the same cache_dir on every rank (or on none): rank 0 reads and "
                 "writes the cache for every rank and tells the others what it found",
    "checkpoint": "pass checkpoint= on every rank (each reads its own part) or on none",
    "example_inputs": "pass the same example_inputs (shapes and dtypes) on every rank",
    "example_kwargs": "pass the same example_kwargs (shapes and dtypes) on every rank",
}


def blocks(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s repeated blocks: the children of the first
    container (breadth first) in which two or more children of one class own parameters;
    else the top-level children that own parameters."""
    def owns(m: nn.Module) -> bool:
        return any(True for _ in m.parameters())

    queue: list[tuple[str, nn.Module]] = [("", model)]
    while queue:
        name, m = queue.pop(0)
        kids = [(f"{name}.{k}" if name else k, c) for k, c in m.named_children()]
        if isinstance(m, _CONTAINERS):
            counts = Counter(type(c) for _, c in kids if owns(c))
            if counts and max(counts.values()) >= 2:
                return [n for n, c in kids if owns(c)]
        queue += kids
    return [n for n, c in model.named_children() if owns(c)]


def block_spec(spec: CompileSpec, names: list[str]) -> CompileSpec:
    """``spec`` with one pipeline stage per block (in one process): the graph gets one
    child per block, which ``fully_shard`` makes an FSDP2 group."""
    stages = [{"modules": [n, f"{n}.*"]} for n in names]
    return spec.model_copy(update={"pipeline": PipelineSpec.model_validate({"stages": stages})})


def mark_blocks(gm: GraphModule) -> None:
    """Record that ``gm``'s ``stage_<i>`` children are its blocks (``block_spec``), not
    pipeline stages (``BLOCKS_KEY``)."""
    gm.meta[BLOCKS_KEY] = [n for n, c in gm.named_children()
                           if n.startswith("stage_") and isinstance(c, GraphModule)]


def _to_meta(v: Any) -> Any:
    return v.to("meta") if isinstance(v, torch.Tensor) else v


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[set[int]]:
    """Inside, every parameter a module registers is replaced by a meta tensor as it is
    registered, while everything else the model's ``__init__`` computes (its buffers:
    rotary tables, causal masks, position ids) is computed for real: the model's own code
    gives its buffers their values, and its weights cost nothing. This is accelerate's
    ``init_empty_weights(include_buffers=False)``, done with torch's public registration
    hooks (``register_module_parameter_registration_hook``; process-wide while inside,
    removed on leaving) instead of replacing ``nn.Module.register_parameter``. A
    parameter's value is made before it is registered (uninitialised memory for
    ``torch.empty``, never written: one tensor at a time); its initialisation then runs on
    meta. Yields the ids of the parameters and buffers registered inside (a model that
    existed before has other tensors)."""
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    made: set[int] = set()

    def on_parameter(module: nn.Module, name: str, param: Any) -> Any:
        if param is None:
            return None
        if not param.is_meta:  # already meta (a tied weight registered twice): kept as is
            empty = param.detach().to("meta")
            try:
                meta = type(param)(empty, requires_grad=param.requires_grad)
            except TypeError:  # a subclass with its own constructor: a plain Parameter
                meta = nn.Parameter(empty, requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # attributes set on it (HF's init flags)
            param = meta
        made.add(id(param))
        return param

    def on_buffer(module: nn.Module, name: str, buffer: Any) -> None:
        if buffer is not None:
            made.add(id(buffer))

    handles = [register_module_parameter_registration_hook(on_parameter),
               register_module_buffer_registration_hook(on_buffer)]
    try:
        yield made
    finally:
        for handle in handles:
            handle.remove()


def _build_meta(build_model: Any) -> tuple[nn.Module, str | None, bool, dict[str, Any]]:
    """``build_model()`` with its parameters on the meta device (no memory) and its
    buffers computed, as every rank runs it first: ``(meta model, torch.compile note,
    shared, buffers)``; ``buffers`` are the model's buffer values by name (what its own
    code computed), and the returned model holds meta tensors only. A model already
    wrapped for data parallelism is refused here, on every rank alike (a wrapper built on
    meta fails inside its own constructor: that is recognised too). ``shared``: the
    factory returned a model that already existed (``lambda: model``: tensors not
    registered during the call); then the meta model is a structural copy, so nothing
    compile_once does reaches the user's, and the buffers are read from the user's."""
    try:
        with _parameters_on_meta() as made:
            built = build_model()
    except Exception as e:
        kind = wrapper_under_construction(e)
        if kind is not None:
            raise refusal(kind) from None
        raise
    model, note = unwrap_compiled(built)
    refuse_wrapped(model)
    tensors = (*model.parameters(), *model.buffers())
    shared = any(id(t) not in made or (isinstance(t, nn.Parameter) and not t.is_meta)
                 for t in tensors)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    if shared:
        return _meta_copy(model), note, shared, buffers
    moved: dict[int, torch.Tensor] = {}  # a buffer two modules share stays one tensor
    for m in model.modules():
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = moved.setdefault(id(b), b.to("meta"))
    return model, note, shared, buffers


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (no data is
    copied: each tensor's copy is pre-seeded into deepcopy's memo)."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = (nn.Parameter(empty, requires_grad=t.requires_grad)
                           if isinstance(t, nn.Parameter) else empty)
    return copy.deepcopy(model, memo)


def _digest(batches: list[Any] | None) -> str:
    """SHA-256 of a rank's calibration batches (their tensors' bytes)."""
    h = hashlib.sha256()
    for batch in batches or ():
        for t in torch.utils._pytree.tree_leaves(batch):
            if isinstance(t, torch.Tensor):
                c = t.detach().cpu().contiguous()
                h.update(f"{c.dtype}{tuple(c.shape)}".encode())
                h.update(c.view(-1).view(torch.uint8).numpy().tobytes() if c.dtype != torch.bool
                         else c.numpy().tobytes())
    return h.hexdigest()


def _state_hash(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names and bytes: what the model brought (a cache key's weights part;
    the graph's tensors before calibration, constants included)."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(_digest([t]).encode())
    return h.hexdigest()


def _count(batches: list[Any] | None) -> int | None:
    return None if batches is None else len(batches)


def _refuse_uneven(gathered: list[Any], shard: bool) -> None:
    """Every rank, before any forward: calibration given on some ranks only, or (sharded:
    every forward is a collective) a different number of batches per rank, would leave
    ranks waiting for each other until the process group times out."""
    counts = [c for _, c, _ in gathered]
    given = [c is not None for c in counts]
    if any(given) and not all(given):
        raise QCompileError(f"compile_once: calibration batches per rank {counts}: some ranks "
                            "pass none", fix="pass calibration=<this rank's batches> on every "
                            "rank (or on none)")
    if shard and len(set(counts)) > 1:
        raise QCompileError(f"compile_once: a sharded (fsdp2) calibration needs the same "
                            f"number of batches on every rank, got {counts} per rank",
                            fix="split the calibration data evenly across the ranks (every "
                                "forward through a sharded graph is a collective)")
    shapes = [s for _, _, s in gathered]
    if shard and shapes[0] is not None:
        for i, per_rank in enumerate(zip(*shapes)):
            if len(set(per_rank)) > 1:
                shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(per_rank))
                raise QCompileError(
                    f"compile_once: calibration batch {i} differs in shape between the "
                    f"ranks ({shown}); a sharded (fsdp2) calibration runs every batch on "
                    "every rank together", fix="give every rank batches of the same shapes "
                    "(the same batch size), or fix the misshaped batch")


def _rows(t: torch.Tensor, rank: int, world: int) -> slice | None:
    """The rows of dim 0 this rank holds of ``t`` (an FSDP2 ``Shard(0)`` DTensor: torch
    chunks dim 0 into pieces of ``ceil(n / world)``), or None for a whole tensor."""
    if not (hasattr(t, "to_local") and hasattr(t, "placements")):
        return None
    if not (len(t.placements) == 1 and t.placements[0].is_shard(0)):
        return None  # a view across the rows (a [in, out] weight read transposed)
    n = t.shape[0]
    size = -(-n // world)
    start = min(rank * size, n)
    local = t.to_local().shape[0]
    return slice(start, start + local)


def _box(t: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's part of a sharded DTensor ``t`` in the whole tensor's coordinates, one
    slice per dim (FSDP2's rows, a tensor-parallel shard's rows or columns, or both on a
    ``(dp, tp)`` mesh), or None for a whole tensor. The offsets are torch's own
    (``compute_local_shape_and_global_offset``), so FSDP2's ``_StridedShard`` over a
    tensor-parallel shard lands where torch puts it."""
    if not (hasattr(t, "to_local") and hasattr(t, "placements")):
        return None
    if all(p.is_replicate() for p in t.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, start = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(s, s + n) for s, n in zip(start, shape))


def _across(box: tuple[slice, ...] | None, shape: torch.Size) -> tuple[slice, ...] | None:
    """The slices of ``box`` past dim 0 when one of them is not the whole dim (a rowwise
    tensor-parallel shard's columns), else None."""
    if box is None or all(s.start == 0 and s.stop == n for s, n in zip(box[1:], shape[1:])):
        return None
    return (slice(None), *box[1:])


class _Loader:
    """Puts values into the allocated graph, one tensor at a time: ``read(name, rows)``
    gives them (a checkpoint, on every rank) or rank 0 broadcasts each whole tensor
    (``stream``) and every rank keeps its rows."""

    def __init__(self, read: Callable[[str, slice | None], torch.Tensor] | None, *,
                 stream: bool, group: Any, rank: int, world: int, src: int,
                 sent: Callable[[str], None] | None = None) -> None:
        self.read, self.stream, self.group, self.sent = read, stream, group, sent
        self.rank, self.world, self.src = rank, world, src
        self.device = collective_device(group)
        self._buffer: torch.Tensor | None = None

    def _full(self, name: str, like: torch.Tensor,
              value: Callable[[], torch.Tensor] | None) -> torch.Tensor:
        """The whole tensor ``name`` on every rank: rank 0 computes it, then broadcast
        into one reused byte buffer (a fresh buffer per tensor is memory the allocator
        may keep: up to a model's worth over a load)."""
        nbytes = like.numel() * like.element_size()
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # the old one goes before the larger one comes
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer = self._buffer[:nbytes].view(like.dtype).view(like.shape)
        if self.rank == 0:
            assert value is not None
            buffer.copy_(value())
        torch.distributed.broadcast(buffer, src=self.src, group=self.group)
        return buffer

    @torch.no_grad()
    def put(self, target: torch.Tensor, name: str,
            compute: Callable[[slice | None], torch.Tensor]) -> None:
        """Write ``compute(rows)`` (this rank's rows, or all) into ``target``; of a
        tensor-parallel shard, this rank's columns of those rows."""
        box = _box(target)
        rows = box[0] if box is not None else None
        # (a replicated DTensor, a rowwise layer's bias under tensor parallelism: whole)
        local = target.to_local() if hasattr(target, "to_local") else target
        if self.stream:
            whole = self._full(name, target, (lambda: compute(None)) if self.rank == 0
                               else None)
            value = whole[box] if box is not None else whole
            if self.rank == 0 and self.sent is not None:
                self.sent(name)  # every rank has it now: rank 0 may let it go
        else:
            value = compute(rows)
            columns = _across(box, target.shape)
            if columns is not None:
                value = value[columns]
        local.copy_(value.to(local.dtype))


@torch.no_grad()
def _read_into(ckpt: Checkpoint, name: str, target: torch.Tensor) -> bool:
    """This rank's part of ``name`` read from the checkpoint into ``target``'s local
    shard: its rows straight in (one byte range, no temporary), or, for a rowwise
    tensor-parallel shard's columns or another dtype than the file's, a few rows at a time
    through a small buffer; False when the shard cannot take either (``_Loader.put``)."""
    box = _box(target)
    local = target.to_local() if hasattr(target, "to_local") else target
    if _across(box, target.shape) is None and ckpt.read_into(
            name, box[0] if box is not None else None, local):
        return True
    whole = tuple(slice(0, n) for n in target.shape)
    return ckpt.read_box_into(name, box if box is not None else whole, local)


def _sharded(gm: nn.Module, group: Any, device: torch.device) -> None:
    """``fully_shard`` each block child, then the root (the torchtitan recipe)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if group is None:
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    else:
        mesh = DeviceMesh.from_group(group, device.type)
    gather = GatherInPlace() if device.type == "cpu" else None
    children = [c for n, c in gm.named_children()
                if n.startswith("stage_") and any(True for _ in c.parameters())]
    for members in _fsdp_groups(children):
        # children sharing a parameter (tied input and output embeddings: the first and the
        # last) are one group: FSDP2 manages a parameter in one group only, and keeps every
        # module of that group holding it up to date
        fully_shard(members if len(members) > 1 else members[0], mesh=mesh)
        if gather is not None:
            members[0].set_custom_all_gather(gather)
    fully_shard(gm, mesh=mesh)


def _fsdp_groups(children: list[nn.Module]) -> list[list[nn.Module]]:
    """The block children in FSDP2 groups: one each, children sharing a parameter in one
    (a union-find over the parameters they hold), in order."""
    parent = list(range(len(children)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    holder: dict[int, int] = {}
    for i, child in enumerate(children):
        for p in child.parameters():
            parent[find(i)] = find(holder.setdefault(id(p), i))
    groups: dict[int, list[nn.Module]] = {}
    for i, child in enumerate(children):
        groups.setdefault(find(i), []).append(child)
    return list(groups.values())


class GatherInPlace:
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``) on CPU ranks, straight
    into the buffer FSDP2 allocates for it: the chunk of each rank is broadcast from that
    rank, in place. Same bytes, same values as ``all_gather_into_tensor``, but no
    temporary: gloo's ``all_gather_into_tensor`` gathers into a new tensor of the
    gathered size and copies it out, and it allocates that tensor on its worker thread,
    from the thread's own malloc arena; glibc keeps the freed top of such an arena
    (``malloc_trim`` returns only the main heap's top) and, below its mmap threshold (up
    to 32 MiB), serves that size from there: every gloo worker thread kept a block
    resident. A broadcast works in the tensor it is given. (NCCL gathers in place.)

    Example:
        >>> from qcompile.distributed.once import GatherInPlace
        >>> GatherInPlace().allocate((3,), dtype=torch.float32, device=torch.device("cpu")).shape
        torch.Size([3])
    """

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        n = input_tensor.numel()
        ranks = torch.distributed.get_process_group_ranks(group)
        mine = output_tensor.narrow(0, ranks.index(torch.distributed.get_rank()) * n, n)
        if mine.data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its input there
            mine.copy_(input_tensor)
        for i, src in enumerate(ranks):  # synchronous: FSDP2 then waits for nothing
            torch.distributed.broadcast(output_tensor.narrow(0, i * n, n), src=src, group=group)


def _produced(gm: nn.Module, weights: set[str]) -> list[str]:
    """State-dict entries compiling and calibrating made (quantizer state, buffers such
    as BatchNorm statistics): everything but the weights, which the checkpoint or the
    model provide."""
    return [n for n in gm.state_dict() if n not in weights]


def _observe_weights(gm: nn.Module, group: Any, rank: int, world: int) -> None:
    """Weight quantizers take their weight's range again (compile time saw meta tensors or
    a model whose values were replaced). A row-wise range (per tensor, per output channel,
    per group) of a weight FSDP2 shards by rows is reduced from each rank's own rows, a few
    bytes per channel across ranks; any other block is unsharded while it is read."""
    owners = [m for n, m in gm.named_children() if n.startswith("stage_")] or [gm]
    for owner in owners:
        pending = []
        for fq, weight in weight_quantizers(owner):
            if fq.observer is None:
                continue
            fq.observer.reset()
            if not _observe_rows(fq, weight, group, rank, world):
                pending.append(fq)
        if not pending:
            continue
        unshard = getattr(owner, "unshard", None)
        if unshard is not None:
            unshard()
        try:
            for fq, weight in weight_quantizers(owner):
                if fq in pending:
                    fq.observe_tensor(weight.detach())
        finally:
            reshard = getattr(owner, "reshard", None)
            if reshard is not None:
                reshard()


@torch.no_grad()
def _observe_rows(fq: FakeQuantize, weight: torch.Tensor, group: Any, rank: int,
                  world: int) -> bool:
    """``fq.observe_range`` from every rank's rows of a ``Shard(0)`` weight; False when the
    weight is whole, or the range is not row-wise, or the observer needs the data itself."""
    rows = _rows(weight, rank, world)
    if (rows is None or getattr(fq.observer, "needs_data", False) or fq.granularity not in (
            "per_tensor", "per_channel", "per_group")
            or (fq.granularity == "per_channel" and fq.axis != 0)):
        return False
    device = collective_device(group)
    local = weight.to_local().detach().float()
    n = weight.shape[0]
    if fq.granularity == "per_tensor":
        mn, mx = (torch.aminmax(local) if local.numel() else
                  (torch.tensor(float("inf")), torch.tensor(float("-inf"))))
        both = torch.stack([-mn, mx]).to(device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
        fq.observe_range((-both[0]).reshape(1).cpu(), both[1].reshape(1).cpu())
        return True
    per_row = fq.scale.numel() // n  # 1 per channel; the groups of a row per group
    chunk = -(-n // world) * per_row
    mn = torch.full((chunk,), float("inf"), device=device)
    mx = torch.full((chunk,), float("-inf"), device=device)
    if local.numel():
        a, b = fq._minmax(local)
        mn[:a.numel()] = a.reshape(-1).to(device)
        mx[:b.numel()] = b.reshape(-1).to(device)
    both = torch.cat([mn, mx])
    parts = [torch.empty_like(both) for _ in range(world)]
    torch.distributed.all_gather(parts, both, group=group)
    mins = torch.cat([p[:chunk] for p in parts])[:n * per_row]
    maxs = torch.cat([p[chunk:] for p in parts])[:n * per_row]
    fq.observe_range(mins.cpu().to(fq.observer.min_val.device),
                     maxs.cpu().to(fq.observer.max_val.device))
    return True


@contextlib.contextmanager
def one_block_at_a_time(gm: nn.Module) -> Iterator[None]:
    """Forwards through a sharded graph (one FSDP2 group per block child, as
    ``compile_once`` shards it) in the body hold at most one block unsharded, and no
    memory a finished block freed stays resident: calibration at model/N + 2 blocks.

    Right before each block child's forward, the memory freed so far goes back to the OS
    (``return_freed_memory``: the fake-quant kernels' pooled outputs and, under glibc, the
    free heap pages; glibc otherwise keeps each gathered block's freed tensors, and the
    default allocator grew a rank by about a block per forward), then the child is
    unsharded by its own ``unshard()``. FSDP2's pre-forward then finds it unsharded; left
    to itself it would keep the previous block's all-gather buffer (a block) alive until
    this block's all-gather is copied out, to overlap the two on a GPU stream, which a
    CPU rank pays for in memory and nothing else. FSDP2 reshards each child after its
    forward as usual. The memory peak per block is then its all-gather buffer and its
    unsharded weights during the copy-out (2 blocks), over the shards. Hooks are removed,
    and freed memory returned once more, on leaving. Nothing here changes an allocator
    setting; ``return_freed_memory`` only hands back pages that are free.

    The gathers themselves leave nothing behind: on CPU ranks ``compile_once`` has FSDP2
    gather into its own buffer (``GatherInPlace``); gloo's own all-gather would gather
    into a temporary on its worker thread, from a malloc arena whose free top
    ``malloc_trim`` does not release, keeping a block per worker thread for blocks under
    32 MiB (glibc's largest mmap threshold). NCCL gathers in place.

    Example:
        >>> import torch
        >>> from qcompile.distributed.once import one_block_at_a_time
        >>> gm = torch.nn.Sequential(torch.nn.Linear(2, 2))   # no block children: as is
        >>> with one_block_at_a_time(gm):
        ...     gm(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    def before(child: nn.Module, args: Any) -> None:
        return_freed_memory()  # what the previous block freed (its weights, outputs)
        child.unshard()
        # the all-gather buffer, freed by now, may have come from free heap chunks
        return_freed_memory()

    handles = [child.register_forward_pre_hook(before, prepend=True)
               for name, child in gm.named_children()
               if name.startswith("stage_") and callable(getattr(child, "unshard", None))]
    return_freed_memory()  # what loading the weights left behind
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        return_freed_memory()


def compile_once(build_model: Any, spec: Any, example_inputs: Any = None, *,
                 example_kwargs: dict[str, Any] | None = None,
                 calibration: Any = None, checkpoint: Any = None,
                 cache_dir: str | None = None, group: Any = None) -> nn.Module:
    """Quantize once, share with every rank (see the module docstring).

    ``build_model()`` builds the float model; with a checkpoint, or on every rank but 0,
    it runs under ``torch.device("meta")`` (no memory); without a checkpoint in the
    sharded way, rank 0 also builds the real model. ``checkpoint``: a ``.safetensors``
    file, or a folder of shards with ``model.safetensors.index.json``; it must hold
    exactly the model's state dict (a missing, extra, misshaped or retyped tensor is a
    ``QCompileError`` naming it, on every rank, before any collective). ``calibration``:
    this rank's batches (every rank passes its own). Tensors live on the backend's device
    (``collective_device``: the rank's GPU for NCCL, so call ``torch.cuda.set_device``
    first; CPU for gloo). The sharded result is already ``fully_shard``-ed and keeps
    observers in sync (``keep_observers_in_sync``; ``qc.distributed.wrap`` returns it as
    it is); a
    replicated result is wrapped as usual (``qc.distributed.wrap``).

    Every rank first builds the model on the meta device (free): a model already wrapped
    for data parallelism is refused there on every rank, and a factory that returns a model
    that already exists (``lambda: model``: its tensors are not on meta) is compiled from a
    copy, so the user's model is never changed (that copy costs one model's memory on rank
    0, or nothing but the structure with a checkpoint or when sharded). Before the first
    collective the ranks agree on the spec, ``cache_dir``, ``checkpoint`` given or not, the
    example inputs' shapes and then the graph's code; a build, compile or calibration batch
    that fails on one rank fails every rank with that rank's message, never a hang."""
    if isinstance(build_model, nn.Module) or not callable(build_model):
        what = (f"a {type(build_model).__name__} instance (the model itself)"
                if isinstance(build_model, nn.Module) else f"a {type(build_model).__name__}")
        raise QCompileError(
            f"compile_once: build_model is {what}, not a function that builds the model",
            fix="pass the class or a factory, e.g. compile_once(MyModel, ...) or "
                "compile_once(lambda: MyModel(config), ...): every rank builds it, on the "
                "meta device where it needs no memory")
    spec = as_spec(spec)
    tp = spec.tensor_parallel is not None and initialised()
    if tp:
        refuse_tensor_parallel_once(spec, group)
    if spec.quant.search is not None:
        raise QCompileError("quant.search: this spec describes a search, not one "
                            "quantization; compile_once compiles the spec the search returns",
                            fix="run qc.search(model, spec, batches) first and compile the "
                            "spec it returns")
    if cache_dir is not None and not str(cache_dir).strip():
        raise QCompileError("compile_once: cache_dir is an empty string",
                            fix="pass cache_dir=None for no cache, or a folder path")
    directory = cache_dir or spec.cache_dir
    on = initialised()
    rank = torch.distributed.get_rank(group) if on else 0
    world = torch.distributed.get_world_size(group) if on else 1
    src = (torch.distributed.get_global_rank(group, 0) if group is not None else 0) if on else 0
    inputs = as_inputs(example_inputs)
    batches = list(calibration) if calibration is not None else None
    ckpt = Checkpoint(checkpoint) if checkpoint is not None else None
    shard = on and spec.data_parallel.kind == "fsdp2" and spec.pipeline is None
    if batches is not None:
        check_calibratable(spec.quant.mode)
    data_driven = [i for i, a in enumerate(spec.quant.algorithms) if a.kind in DATA_KINDS]
    if data_driven:  # checked from the spec alone: every rank refuses, none hangs
        i = data_driven[0]
        raise QCompileError(
            f"quant.algorithms[{i}] ({spec.quant.algorithms[i].kind}): compile_once does not "
            "run the data-driven algorithms (bias_correction, adaround, gptq)",
            fix="compile with qc.qcompile on every rank and call qc.calibrate(gm, batches) "
            "there (statistics are summed across ranks with quant.sync_observers), or "
            "remove it from quant.algorithms")
    if on:  # before the first collective: a mismatch is the same clear error on every rank
        agree("compile_once", {
            "spec": spec.model_dump(mode="json", exclude={"cache_dir"}),
            "cache_dir": None if directory is None else str(directory),
            "checkpoint": "given" if ckpt is not None else None,
            "example_inputs": shapes_of(inputs),
            "example_kwargs": {k: shapes_of(v) for k, v in sorted((example_kwargs or {}).items())},
        }, group, fixes=_FIXES)
    if ckpt is None and not shard and not tp and (not on or spec.quant.algorithms):
        gm, source = _replicated_from_rank0(build_model, spec, inputs, example_kwargs,
                                            rank, group, src, hashing=directory is not None)
    else:
        gm, source = _from_meta(build_model, spec, inputs, example_kwargs, ckpt, shard, tp,
                                rank, world, group, src, hashing=directory is not None)
    # -- the cache: what compile + calibrate produced, keyed by where the weights came from
    key, why = None, "no cache_dir"
    produced = _produced(gm, source["weights"])
    # each rank's calibration data goes into the cache key; the counts are checked anyway
    # (and under tensor parallelism the ranks sharing a layer must calibrate on one batch)
    together = shard or tp  # every forward is a collective
    mine = (_digest(batches) if directory is not None or tp else None, _count(batches),
            [" ".join(shapes_of(b)) for b in batches] if together and batches is not None
            else None)
    digests: list[Any] = [mine]
    if on:
        digests = [None] * world
        torch.distributed.all_gather_object(digests, mine, group=group)
        _refuse_uneven(digests, together)
        if tp:
            refuse_differing_tp_batches([d[0] for d in digests], spec.tensor_parallel.size)
    hit = False
    state: dict[str, torch.Tensor] | None = None
    if directory is not None:
        if rank == 0:
            weights = ckpt.content_hash() if ckpt is not None else source["weights_hash"]
            key = cache_key(gm_code(gm), spec.model_dump_json(exclude={"cache_dir"}),
                            extra=[str(weights), *map(str, digests)])
            state, why = CompileCache(directory).load(key)
            if state is not None and (bad := misfit(state, gm, produced)) is not None:
                state, why = None, f"entry {bad}; rebuilt"
            hit = state is not None
        if on:
            box = [hit, why]
            torch.distributed.broadcast_object_list(box, src=src, group=group)
            hit, why = box
    loader = _Loader(lambda n, r: state[n] if r is None else state[n][r], stream=on,
                     group=group, rank=rank, world=world, src=src)
    if hit:
        full = gm.state_dict()
        for name in produced:  # rank 0 read the entry; every rank gets its part
            loader.put(full[name], name, lambda r, n=name: state[n] if r is None else state[n][r])
        for q in quantizers(gm).values():
            q.enabled, q.observe = bool(q.mode_flags[0]), bool(q.mode_flags[1])
    elif batches is not None:
        sync = spec.quant.sync_observers and on
        if together:  # every forward is a collective: counts and shapes were agreed above
            with one_block_at_a_time(gm):
                collect_statistics(gm, batches, signature=graph_inputs(gm),
                                   sync=(lambda m: sync_observers(m, group, everything=True))
                                   if sync else None)
        else:  # a batch refused on one rank is refused on every rank, before the sync
            with collective_phase("compile_once (calibrating)", group):
                collect_statistics(gm, batches, signature=graph_inputs(gm))
            if sync:
                sync_observers(gm, group, everything=True)
    if directory is not None and not hit:
        full = gm.state_dict()
        entry = {n: _whole(full[n]) for n in produced}  # collectives for sharded tensors
        with collective_phase("compile_once (writing the cache entry)", group):
            if rank == 0:  # a folder rank 0 cannot write is an error on every rank
                CompileCache(directory).store(key, entry, report(gm).model_dump_json())
    report(gm).passes[-1].notes.append(f"compile cache: {why}")
    if together:  # step updates applied after each optimizer step, across the group
        keep_observers_in_sync(watch_observer_sync(gm), spec, group)
        if shard:
            gm.meta[SHARDED_KEY] = True
        return gm
    return watch_observer_sync(gm)


def gm_code(gm: nn.Module) -> str:
    """The generated code of the graph and of each block child."""
    parts = [getattr(gm, "code", "")]
    parts += [getattr(c, "code", "") for n, c in gm.named_children() if n.startswith("stage_")]
    return "\n".join(parts)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU (a sharded DTensor is gathered: every rank calls this)."""
    if hasattr(t, "full_tensor") and hasattr(t, "placements"):
        t = t.full_tensor()
    return t.detach().cpu()


def _replicated_from_rank0(build_model: Any, spec: CompileSpec, inputs: Any,
                           example_kwargs: Any, rank: int, group: Any, src: int, *,
                           hashing: bool) -> tuple[nn.Module, dict[str, Any]]:
    """Rank 0 builds and compiles the real model in place; the others compile it on meta,
    allocate the graph once and receive every tensor from rank 0."""
    on = initialised()
    with collective_phase("compile_once (building and compiling the model)", group):
        # every rank builds on meta first (cheap): a wrapped model is refused on every rank
        model, note, shared, _ = _build_meta(build_model)
        if rank == 0:
            model, note = unwrap_compiled(build_model())
            refuse_wrapped(model)
            weights = {n for n, _ in model.named_parameters()}
            # a model built here for this graph alone needs no copy; the user's own model
            # (a factory returning an existing one) is compiled from a copy, never touched
            gm = compile_model(model, spec, inputs, example_kwargs=example_kwargs,
                               inplace=not shared)
            h = _state_hash(gm.state_dict()) if hashing else None
            del model
        else:
            weights = {n for n, _ in model.named_parameters()}
            meta_inputs = tuple(_to_meta(v) for v in inputs) if inputs is not None else None
            meta_kwargs = {k: _to_meta(v) for k, v in (example_kwargs or {}).items()} or None
            gm = compile_model(model, spec, meta_inputs, example_kwargs=meta_kwargs,
                               inplace=True)
            gm = gm.to_empty(device="cpu")
            h = None
    if on:  # every rank receives rank 0's tensors into a graph of the same code
        agree("compile_once", {"graph": digest(gm_code(gm))}, group)
    if note is not None:
        report(gm).passes[0].notes.append(note)
    if on:
        tensors = [t for _, t in sorted([*gm.named_parameters(remove_duplicate=True),
                                         *gm.named_buffers(remove_duplicate=True)],
                                        key=lambda kv: kv[0])]
        device = collective_device(group)
        with torch.no_grad():
            for t in tensors:
                buffer = staged(t.data, device)  # NCCL sends CUDA tensors only
                torch.distributed.broadcast(buffer, src=src, group=group)
                if buffer is not t.data and rank != 0:
                    t.data.copy_(buffer)
        gm.load_state_dict(gm.state_dict())  # quantizer on/off flags follow their buffers
    folded = {n for f in gm.meta.get(FOLDS_KEY, {}).values() for n in (f.weight, f.out_bias)}
    return gm, {"weights": weights | folded,
                "weights_hash": h}


def _from_meta(build_model: Any, spec: CompileSpec, inputs: Any, example_kwargs: Any,
               ckpt: Checkpoint | None, shard: bool, tp: bool, rank: int, world: int,
               group: Any, src: int, *, hashing: bool) -> tuple[nn.Module, dict[str, Any]]:
    """Every rank compiles the meta model (sharded: one FSDP2 group per block; ``tp``: its
    planned layers sharded across the mesh's tp dim first, as ``qc.distributed.wrap``
    does), allocates it, and loads the weights: its part of each from the checkpoint, or
    from rank 0's stream."""
    on = initialised()
    with collective_phase("compile_once (building and compiling the model)", group):
        # a factory returning the user's own model gets a meta copy: nothing touches it
        meta_model, note, _, built = _build_meta(build_model)
        if ckpt is not None:
            ckpt.check(meta_model)  # every rank reads the same headers: all refuse together
        names = set(meta_model.state_dict())
        weights = {n for n, _ in meta_model.named_parameters()}
        compile_spec = spec
        found = blocks(meta_model) if shard else []
        if shard and len(found) >= 2:
            compile_spec = block_spec(spec, found)
        meta_inputs = tuple(_to_meta(v) for v in inputs) if inputs is not None else None
        meta_kwargs = {k: _to_meta(v) for k, v in (example_kwargs or {}).items()} or None
        gm = compile_model(meta_model, compile_spec, meta_inputs, example_kwargs=meta_kwargs,
                           inplace=True)
        if compile_spec is not spec:
            mark_blocks(gm)
        del meta_model
    # compiling freed a lot of small objects: give their pages back before the weights
    # arrive, or the weights' allocations settle around them and keep them resident
    return_freed_memory()
    if on:
        agree("compile_once", {"graph": digest(gm_code(gm))}, group)
    skipped = gm.meta.get(ALGORITHMS_SKIPPED_KEY)
    if skipped:  # every rank compiled on meta: all refuse together, none hangs
        raise QCompileError(
            f"{skipped[0]}: compile_once here builds the graph on the meta device and loads "
            "the model's weights afterwards, so the algorithm never sees (or rewrites) them",
            fix=("compile with qc.qcompile on every rank (real weights), then "
                 "qc.distributed.wrap(gm, spec) shards it" if tp else
                 "compile with real weights (data_parallel ddp without a checkpoint)")
            + ", or remove quant.algorithms")
    rep = report(gm)
    if note is not None:
        rep.passes[0].notes.append(note)
    if compile_spec is not spec:
        rep.passes[-1].notes.append(f"compile_once: {len(found)} blocks as FSDP2 groups "
                                    f"({found[0]} .. {found[-1]})")
    device = collective_device(group) if on else torch.device("cpu")
    if tp:  # on meta (no memory), as wrap shards it: parallelize_module on tp, then
        refuse_strided_experts(gm)  # (every rank: the plan is the same graph's)
        wrap(gm, spec)  # fully_shard over dp; to_empty then allocates this rank's part
        if shard and device.type == "cpu":
            gather = GatherInPlace()
            for n, child in gm.named_children():
                if n.startswith("stage_") and hasattr(child, "set_custom_all_gather"):
                    child.set_custom_all_gather(gather)
    elif shard:
        _sharded(gm, group, device)
    ties = _ties(gm)
    gm.to_empty(device=device)
    _retie(ties)
    for q in quantizers(gm).values():
        q.reset_parameters()
    folds = {}
    for f in gm.meta.get(FOLDS_KEY, {}).values():
        folds[f.weight] = (f, 0)
        folds[f.out_bias] = (f, 1)
    fold_sources = {n for f, _ in folds.values() for n in f.sources()}
    state = gm.state_dict()
    constants = _fill_export_constants(gm, names | set(built), build_model, inputs,
                                       example_kwargs, device)
    # every rank knows now, from names alone, whether every tensor will get values: all
    # refuse together, before reading anything
    _refuse_valueless(gm, {n for n in state if n in names or n in folds} | _adapter_names(gm)
                      | constants, built, stream=ckpt is None)
    # -- where the weights come from ------------------------------------------------------
    real: dict[str, torch.Tensor] = {}
    h = None
    if ckpt is not None:
        def read(name: str, rows: slice | None) -> torch.Tensor:
            return ckpt.read(name, rows)
    else:  # rank 0 streams its real model, freeing each tensor once sent
        with collective_phase("compile_once (rank 0 building the model)", group):
            if rank == 0:
                model, _ = unwrap_compiled(build_model())
                real = dict(model.state_dict(keep_vars=False))
                real.update({n: b for n, b in model.named_buffers()})  # non-persistent too
                del model
                h = _state_hash(real) if hashing and ckpt is None else None

        def read(name: str, rows: slice | None) -> torch.Tensor:
            t = real[name]
            return t if rows is None else t[rows]
    def sent(name: str) -> None:
        """Rank 0 streaming: free a tensor every rank has received (a fold's sources are
        read again) and hand a large one's pages back, so that rank 0 holds at most its
        model, shrinking, next to its growing shard."""
        if name in real and name not in fold_sources:
            nbytes = real[name].numel() * real[name].element_size()
            del real[name]
            if nbytes >= 1 << 20:
                return_freed_memory()
    loader = _Loader(read, stream=ckpt is None and on, group=group, rank=rank, world=world,
                     src=src, sent=sent)
    for name in sorted(state):
        target = state[name]
        if name in folds:
            fold, which = folds[name]
            loader.put(target, name, lambda r, f=fold, i=which: f.apply(read, r)[i])
        elif name in names:
            if ckpt is not None and _read_into(ckpt, name, target):
                continue
            loader.put(target, name, lambda r, n=name: read(n, r))
    # buffers outside the state dict (non-persistent: rotary tables, masks, position ids):
    # what the model's own code computed on rank 0 (its real model when it streams, else
    # its build with parameters on meta), sent to every rank, so that they hold the same
    # values even where that code draws random numbers
    built_loader = _Loader(lambda n, r: built[n] if r is None else built[n][r], stream=on,
                           group=group, rank=rank, world=world, src=src)
    for name, b in gm.named_buffers():  # a buffer the blocks share: once (one tensor)
        short = _model_name(name)
        if short in state or short not in built:  # loaded above; the graph's own
            continue
        if ckpt is None:
            loader.put(b, short, lambda r, n=short: read(n, r))
        else:
            built_loader.put(b, short, lambda r, n=short: built[n] if r is None else
                             built[n][r])
    adapted = _fill_adapters(gm, spec, read, loader, group, rank, world, tp)
    real.clear()
    # a NaN in one rank's rows is an error on every rank (the ranges below are collectives)
    with collective_phase("compile_once (loading the weights)", group):
        refuse_nonfinite(model_weights(gm), "compile_once")
    if tp:
        observe_sharded_weights(gm)
    else:
        _observe_weights(gm, group, rank, world)
    if ckpt is not None:
        ckpt.close()  # the memory maps of the headers (data was read with readinto)
    return gm, {"weights": weights | set(folds) | adapted,
                "weights_hash": h}


def _model_name(name: str) -> str:
    """A graph's tensor name as the model's (a block child's ``stage_<i>.`` dropped)."""
    head, _, rest = name.partition(".")
    return rest if head.startswith("stage_") and rest else name


def _ties(gm: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Every tensor several module slots of ``gm`` hold, as its slots ``(module, kind,
    name)`` (``kind``: ``_parameters`` or ``_buffers``), the first first. Each block child
    reads what it needs of the model (the blocks each recompute their rotary positions
    from ``rotary_emb.inv_freq``; tied input and output embeddings), and when placed those
    are the very same tensor; ``to_empty`` allocates each slot anew (and FSDP2 refreshes
    only the first holder of a shared parameter until its next unshard), which would leave
    every other slot without values."""
    slots: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for m in gm.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(m, kind).items():
                if t is not None:
                    slots.setdefault(id(t), []).append((m, kind, name))
    return [held for held in slots.values() if len(held) > 1]


def _retie(ties: list[list[tuple[nn.Module, str, str]]]) -> None:
    """Every slot of a tie holds its first slot's tensor again (see ``_ties``)."""
    for (first, kind, name), *others in ties:
        t = getattr(first, kind)[name]
        for m, k, n in others:
            getattr(m, k)[n] = t


def _export_constants(gm: nn.Module, model: set[str]) -> dict[str, list[tuple[Any, str]]]:
    """The tensors torch.export captured as constants while tracing the meta model
    (``x[..., [-2]]``'s index tensor) that no checkpoint or model holds: buffers of the
    graph whose names are none of ``model``'s (its state dict and buffers) nor a
    quantizer's, and plain tensor attributes a graph reads on the meta device. By model
    name, each with every (owner, attribute) holding it."""
    owned = {id(t) for q in quantizers(gm).values() for t in (*q.parameters(), *q.buffers())}
    found: dict[str, list[tuple[Any, str]]] = {}
    for name, b in gm.named_buffers(remove_duplicate=False):
        short = _model_name(name)
        if id(b) not in owned and b.numel() and short not in model:
            *path, leaf = name.split(".")
            found.setdefault(short, []).append((gm.get_submodule(".".join(path)), leaf))
    known = {id(t) for t in (*gm.parameters(), *gm.buffers())}
    for g in [gm, *(c for n, c in gm.named_children() if n.startswith("stage_"))]:
        for node in getattr(getattr(g, "graph", None), "nodes", ()):
            if node.op != "get_attr":  # a target is the model's name in every graph
                continue
            *path, leaf = str(node.target).split(".")
            owner: Any = g
            for part in path:
                owner = getattr(owner, part, None)
            value = getattr(owner, leaf, None)
            if isinstance(value, torch.Tensor) and id(value) not in known and value.is_meta:
                found.setdefault(str(node.target), []).append((owner, leaf))
    return found


def _fill_export_constants(gm: nn.Module, model: set[str], build_model: Any, inputs: Any,
                           example_kwargs: Any, device: torch.device) -> set[str]:
    """Give the constants torch.export captured on meta (``_export_constants``) values.
    They are made by ``forward()`` from Python values, so they do not depend on the
    weights: the model is exported once more with its tensors as fake CPU tensors
    (``FakeTensorMode``: no memory), where the same constants are real tensors, taken by
    name. Only when the graph holds such constants (Falcon's list indexing); what this
    does not give stays without values, for ``_refuse_valueless`` to name. Returns the
    names it filled."""
    wanted = _export_constants(gm, model)
    if not wanted:
        return set()
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from qcompile.passes.trace.capture_export import quiet_export

    model, _, _, buffers = _build_meta(build_model)
    for config in [getattr(model, "config", None)]:
        if getattr(config, "use_cache", None) is True:  # as the trace pass captures it
            config.use_cache = False
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        if id(t) not in fakes:
            fakes[id(t)] = (mode.from_tensor(real) if real is not None
                            else FakeTensor(mode, t.to("meta"), torch.device("cpu")))
        return fakes[id(t)]

    named = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = nn.Parameter(fake(p), requires_grad=p.requires_grad)
        for k, b in m._buffers.items():
            if b is not None:
                real = buffers.get(named.get(id(b), ""))
                m._buffers[k] = fake(b, real if real is not None and not real.is_meta
                                     else None)

    def as_fake(v: Any) -> Any:
        return fake(v, v if not v.is_meta else None) if isinstance(v, torch.Tensor) else v

    args = tuple(as_fake(v) for v in inputs) if inputs is not None else ()
    kwargs = {k: as_fake(v) for k, v in (example_kwargs or {}).items()}
    try:
        ep = quiet_export(model, args, kwargs)
    except Exception:  # left to _refuse_valueless, which names what has no values
        return set()
    filled = set()
    for name, holders in wanted.items():
        value = ep.constants.get(name)
        if type(value) is not torch.Tensor:  # a fake or missing one has no values either
            continue
        filled.add(name)
        for owner, leaf in holders:
            held = owner._buffers.get(leaf) if isinstance(owner, nn.Module) else None
            if held is not None and not held.is_meta and held.shape == value.shape:
                with torch.no_grad():
                    held.copy_(value)  # a registered buffer, allocated by to_empty
            else:
                setattr(owner, leaf, value.to(device))
    return filled


def _refuse_valueless(gm: nn.Module, provided: set[str], built: dict[str, torch.Tensor],
                      stream: bool) -> None:
    """Refuse a graph holding a tensor nothing will give values: every parameter and
    buffer comes from the checkpoint or rank 0 (``provided``: the model's state dict,
    folds, adapters), from the model's own build (``built``: non-persistent buffers; on
    meta there, only rank 0's real model has them), is a quantizer's own state (reset) or
    is empty (the device anchor); a tensor the graph reads that is neither (a constant
    torch.export captured: a registered buffer, or a plain attribute ``to_empty`` does not
    allocate) must not be on meta. Named, with the fix."""
    owned = {id(t) for q in quantizers(gm).values() for t in (*q.parameters(), *q.buffers())}
    held = [(n, t, "parameter") for n, t in gm.named_parameters()]
    held += [(n, t, "buffer") for n, t in gm.named_buffers()]
    known = {id(t) for _, t, _ in held}
    graphs = [("", gm), *((n, c) for n, c in gm.named_children() if n.startswith("stage_"))]
    for prefix, g in graphs:  # plain tensor attributes the graphs read
        for node in getattr(getattr(g, "graph", None), "nodes", ()):
            if node.op == "get_attr":
                value: Any = g
                for part in str(node.target).split("."):
                    value = getattr(value, part, None)
                if isinstance(value, torch.Tensor) and id(value) not in known and value.is_meta:
                    held.append((f"{prefix}.{node.target}" if prefix else str(node.target),
                                 value, "tensor"))
    for name, t, kind in held:
        short = _model_name(name)
        if id(t) in owned or t.numel() == 0 or short in provided:
            continue
        value = built.get(short)
        if value is not None and (not value.is_meta or stream):
            continue
        if value is not None:
            raise QCompileError(
                f"compile_once: buffer {short!r} is not persistent, so the checkpoint does "
                "not hold it, and building the model left it on the meta device (no values)",
                fix="compute it in the model's __init__ from its config (compile_once builds "
                "the model with its parameters on meta and its buffers for real), register "
                "it with persistent=True and save it in the checkpoint, or call compile_once "
                "without checkpoint= (rank 0 streams its real model)")
        raise QCompileError(
            f"compile_once: {kind} {short!r} of the compiled graph has no values: it is a "
            "constant torch.export captured while tracing on the meta device (a tensor "
            "forward() makes from Python values, e.g. indexing with a list), and no "
            "checkpoint or model holds it",
            fix="make it a buffer of the model computed in __init__ (or index with a slice "
            "or an int), or compile with real weights (data_parallel ddp without a "
            "checkpoint: rank 0 compiles the real model)")


def _adapter_names(gm: nn.Module) -> set[str]:
    """The state-dict names ``_fill_adapters`` gives values (LoRA factors, frozen bases)."""
    records = gm.meta.get(ADAPTERS_KEY) or {}
    modules = _by_model_name(gm) if records else {}
    names: set[str] = set()
    for layer, rec in records.items():
        names |= {f"{layer}.lora_A.weight", f"{layer}.lora_B.weight"}
        if rec.storage is not None:
            names |= {f"{rec.storage}.{n}" for n, _ in modules[rec.storage].named_parameters()}
    return names


def _by_model_name(gm: nn.Module) -> dict[str, nn.Module]:
    """The graph's modules by the model's names (a block child's ``stage_<i>.`` dropped)."""
    found = {}
    for name, m in gm.named_modules():
        head, _, rest = name.partition(".")
        found[rest if head.startswith("stage_") and rest else name] = m
    return found


@torch.no_grad()
def _fill_adapters(gm: nn.Module, spec: CompileSpec, read: Callable[[str, slice | None],
                   torch.Tensor], loader: _Loader, group: Any, rank: int, world: int,
                   tp: bool = False) -> set[str]:
    """Give the adapted layers their values on every rank: each frozen base stores this
    rank's rows of its weight, quantized (a scale that spans the rows, per tensor or
    NVFP4's tensor scale, from the range reduced across ranks); ``lora_A`` / ``lora_B``
    start as ``qc.qcompile`` starts them (the same values on every rank, no collective).
    Returns the state-dict names it filled (derived from the weights: never cached)."""
    records = gm.meta.get(ADAPTERS_KEY) or {}
    if not records:
        return set()
    modules = _by_model_name(gm)
    on = initialised()
    filled: set[str] = set()
    for layer, rec in sorted(records.items()):
        lora_a = modules[f"{layer}.lora_A"].weight
        lora_b = modules[f"{layer}.lora_B"].weight
        a = torch.empty(tuple(lora_a.shape), dtype=lora_a.dtype)
        b = torch.empty(tuple(lora_b.shape), dtype=lora_b.dtype)
        init_adapter(a, b, layer, rec.seed)
        for param, value in ((lora_a, a), (lora_b, b)):
            box = _box(param)  # FSDP2's rows, a tensor-parallel shard, or both
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(value[box] if box is not None else value)
        filled |= {f"{layer}.lora_A.weight", f"{layer}.lora_B.weight"}
        if rec.storage is None:
            continue
        fw = modules[rec.storage]
        assert isinstance(fw, FrozenWeight)
        filled |= {f"{rec.storage}.{n}" for n, _ in fw.named_parameters()}
        rows_of = read
        if getattr(rec, "fan_in_fan_out", False):
            # a weight stored [in, out] (Conv1D): the storage's rows are its columns, read
            # from the whole weight, one layer at a time
            def rows_of(name: str, rows: slice | None, read=read) -> torch.Tensor:
                w = read(name, None).t()
                return w if rows is None else w[rows]
        if tp:
            _store_box(fw, rec, f"{layer}.weight", spec, rows_of, loader)
        else:
            _store_rows(fw, rec, f"{layer}.weight", spec, rows_of, loader, group, rank, world,
                        on)
    return filled


@torch.no_grad()
def _store_box(fw: FrozenWeight, rec: Any, name: str, spec: CompileSpec,
               read: Callable[[str, slice | None], torch.Tensor], loader: _Loader) -> None:
    """Under tensor parallelism: this rank's part of weight ``name`` (its rows of a
    colwise layer or its block columns of a rowwise one, FSDP2's rows of those), quantized
    into ``fw``'s storage shards. What spans the parts is reduced across every rank first,
    one small all-reduce: any non-finite value, the whole weight's range (per tensor,
    NVFP4's tensor scale) and each row's range (per channel, when the columns are split);
    blocks and groups never straddle a shard (the plan checked)."""
    dist = torch.distributed
    box = _box(fw.codes)
    width = fw.codes.shape[1]  # stored columns: a fixed number per weight column
    rows = box[0] if box is not None else slice(0, fw.rows)
    part = box[1] if box is not None else slice(0, width)
    cols = slice(part.start * fw.cols // width, part.stop * fw.cols // width)
    split = cols.stop - cols.start < fw.cols
    if loader.stream:  # rank 0 sends the whole float weight; this rank keeps its part
        whole = torch.empty((fw.rows, fw.cols), dtype=fw.out_dtype, device=loader.device)
        loader.put(whole, name, lambda r: read(name, r))
        w = whole[rows, cols]
    else:
        w = read(name, rows)[:, cols]
    w = w.to(loader.device).float()
    fq = FakeQuantize.from_scheme(rec.scheme, role="weight",
                                  shape=(max(w.shape[0], 1), max(w.shape[1], 1)),
                                  target=spec.quant.target).to(w.device)
    # [non-finite, -min, max] of the whole weight, then -min and max of each row
    per_row = split and fq.block_format is None and fq.granularity == "per_channel"
    stats = torch.full((3 + (2 * fw.rows if per_row else 0),), float("-inf"), device=w.device)
    if w.numel():
        stats[0] = float(not bool(torch.isfinite(w).all()))
        finite = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        stats[1], stats[2] = -finite.min(), finite.max()
        if per_row:
            at = slice(3 + rows.start, 3 + rows.stop)
            stats[at] = -finite.amin(1)
            stats[3 + fw.rows:][rows] = finite.amax(1)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # every rank holds a part of every weight
    if stats[0] > 0:
        raise QCompileError(f"compile_once: the checkpoint's {name} holds NaN or inf: its "
                            "frozen base would store NaN scales",
                            fix="repair the checkpoint (or the model that wrote it)")
    if not w.numel():  # an FSDP2 chunk with no rows: nothing to store here
        return
    tensor_scale = None
    if fq.block_format == "nvfp4":
        tensor_scale = nvfp4_tensor_scale(torch.maximum(stats[1], stats[2]).reshape(1))
    elif fq.block_format is None and fq.granularity == "per_tensor":
        fq.observe_range((-stats[1]).reshape(1), stats[2].reshape(1))
    elif per_row:
        fq.observe_range(-stats[3:3 + fw.rows][rows], stats[3 + fw.rows:][rows])
    elif fq.observer is not None:
        fq.observe_tensor(w)
    n = w.shape[0]
    step = max(1, _ENCODE_CHUNK // max(w.shape[1], 1))
    by_row = fq.block_format is None and fq.granularity in ("per_channel", "per_group")
    for start in range(0, n, step):  # a few rows at a time: NF4's temporaries (see below)
        chunk = slice(start, min(start + step, n))
        qparams = {}
        if by_row:
            qparams = {k: getattr(fq, k).detach().reshape(n, -1)[chunk].reshape(-1)
                       for k in ("scale", "zero_point")}
        values, _ = FrozenWeight.encode(fq, w[chunk], tensor_scale=tensor_scale, **qparams)
        for leaf, param in fw.named_parameters():
            value = values[leaf]
            pbox = _box(param)  # None: whole on this rank (maybe a replicated DTensor)
            local = param.to_local() if hasattr(param, "to_local") else param
            if param.shape[0] == fw.rows and fw.rows > 1:
                local[chunk].copy_(value)  # laid out by rows: these rows, this part
            elif start == 0:  # one value for the whole weight, the same on every rank
                local.copy_(value[pbox] if pbox is not None else value)


def _store_rows(fw: FrozenWeight, rec: Any, name: str, spec: CompileSpec,
                read: Callable[[str, slice | None], torch.Tensor], loader: _Loader,
                group: Any, rank: int, world: int, on: bool) -> None:
    """This rank's rows of weight ``name``, quantized into ``fw``'s (sharded) storage."""
    rows = _rows(fw.codes, rank, world)
    shape = (fw.rows, fw.cols)
    if loader.stream:  # rank 0 sends the whole float weight; this rank keeps its rows
        whole = torch.empty(shape, dtype=fw.out_dtype, device=loader.device)
        loader.put(whole, name, lambda r: read(name, r))
        w = whole[rows] if rows is not None else whole
    else:
        w = read(name, rows)
    w = w.to(loader.device).float()
    local_rows = w.shape[0]
    if not local_rows:  # a rank holding none of the rows still shares the global tensors
        w = torch.zeros(1, fw.cols, device=w.device)
    fq = FakeQuantize.from_scheme(rec.scheme, role="weight", shape=tuple(w.shape),
                                  target=spec.quant.target).to(w.device)
    # one small reduction per weight: any rank's non-finite value, and the range a scale
    # spanning the rows needs, are known to every rank before any of them quantizes
    spans = rows is not None and (fq.granularity == "per_tensor"
                                  or fq.block_format == "nvfp4")
    stats = torch.full((3,), float("-inf"), device=w.device)
    if local_rows:
        stats[0] = float(not bool(torch.isfinite(w).all()))
        finite = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        stats[1], stats[2] = -finite.min(), finite.max()
    if on and rows is not None:
        torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX, group=group)
    if stats[0] > 0:
        raise QCompileError(f"compile_once: the checkpoint's {name} holds NaN or inf: its "
                            "frozen base would store NaN scales",
                            fix="repair the checkpoint (or the model that wrote it)")
    tensor_scale = None
    if spans and fq.block_format == "nvfp4":
        tensor_scale = nvfp4_tensor_scale(torch.maximum(stats[1], stats[2]).reshape(1))
    elif spans:
        if getattr(fq.observer, "needs_data", False):
            raise QCompileError(
                f"compile_once: {name}'s frozen base is per_tensor with a "
                f"{type(fq.observer).__name__}, which needs the whole weight on one rank",
                fix="use granularity per_channel or per_group for frozen bases, or the "
                "minmax observer")
        fq.observe_range((-stats[1]).reshape(1), stats[2].reshape(1))
    elif fq.observer is not None:
        fq.observe_tensor(w)
    if fq.block_format == "nvfp4" and tensor_scale is None:  # the chunks share the weight's
        tensor_scale = nvfp4_tensor_scale(w)
    # encoded a few rows at a time: NF4 picks each element's level among 16 in float32
    # (128 bytes of temporaries per element), which for a shard of a wide weight would
    # be more memory than the shard; a row's codes never depend on another row's
    n = w.shape[0]
    step = max(1, _ENCODE_CHUNK // max(fw.cols, 1))
    by_row = fq.block_format is None and fq.granularity in ("per_channel", "per_group")
    for start in range(0, n, step):
        part = slice(start, min(start + step, n))
        qparams = {}
        if by_row:  # these rows' scales and zero points (per tensor: the one for all)
            qparams = {k: getattr(fq, k).detach().reshape(n, -1)[part].reshape(-1)
                       for k in ("scale", "zero_point")}
        values, _ = FrozenWeight.encode(fq, w[part], tensor_scale=tensor_scale, **qparams)
        for leaf, param in fw.named_parameters():
            value = values[leaf]
            prow = _rows(param, rank, world)
            local = param.to_local() if prow is not None else param
            if param.shape[0] == fw.rows and fw.rows > 1:  # laid out by rows: these rows
                if local_rows:
                    local[part].copy_(value)
            elif start == 0:  # one value for the whole weight, the same on every rank
                local.copy_(value[prow] if prow is not None else value)
