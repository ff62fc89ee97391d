"""Tensor parallelism: a compiled graph's planned layers sharded across the ``tp`` mesh dim
with torch's own ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``).

``qc.distributed.wrap(gm, spec)`` calls ``parallelize`` when the spec has a
``tensor_parallel`` section: the graph is rewritten for one rank's shards
(``qcompile.passes.shard_tensor_parallel``), each planned layer gets torch's style for it,
and data parallelism (``fully_shard``) then runs over the ``dp`` dim, as torchtitan
composes them. Quantizers follow their weights' placements
(``qcompile.runtime.sharded``); activation quantizers inside sharded regions combine their
statistics across every rank once per optimizer step, as data parallelism does.

The mesh (``qc.distributed.mesh(spec)``): dims among ``("pp", "dp", "tp")`` in that
order, ``tp`` innermost (ranks ``0..T-1`` of a node share a layer), ``dp`` across nodes.
With pipeline stages, ``qc.distributed.pipeline`` shards each rank's stage across its tp
ranks (``parallelize(gm, tp_mesh, within="stage_<s>")``) and replicates it over dp.

Example:
    >>> import qcompile as qc
    >>> mesh_dims({"tensor_parallel": {"size": 2}, "data_parallel": {"kind": "fsdp2"}}, 4)
    {'dp': 2, 'tp': 2}
    >>> mesh_dims({"tensor_parallel": {"size": 2}}, 2)
    {'tp': 2}
    >>> mesh_dims({"tensor_parallel": {"size": 2}, "pipeline": {"stages": 2}}, 4)
    {'pp': 2, 'tp': 2}
    >>> try:
    ...     mesh_dims({"tensor_parallel": {"size": 2}}, 4)
    ... except qc.QCompileError as e:
    ...     print(e.fix)
    set data_parallel.kind: fsdp2, or launch 2 processes
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.errors import QCompileError
from qcompile.graph.meta import TP_SHARDED_KEY, TP_STAGE_KEY
from qcompile.passes.plan_tensor_parallel import TP_PLAN_KEY, LayerPlan, SequencePlan
from qcompile.passes.shard_tensor_parallel import shard_tensor_parallel
from qcompile.runtime.sharded import (
    ShardedLinear,
    SumGradients,
    WeightStatistics,
    keep_local_rows,
    observe_shard,
    sharded_weights,
)
from qcompile.specs import as_spec


def mesh_dims(spec: Any, world: int) -> dict[str, int]:
    """The mesh's dims and sizes for ``spec`` on ``world`` ranks with a
    ``tensor_parallel`` section, or a ``QCompileError`` saying why not (no communication)."""
    spec = as_spec(spec)
    tp = spec.tensor_parallel.size
    kind = spec.data_parallel.kind
    pp = 1
    if spec.pipeline is not None:
        if spec.pipeline.schedule == "interleaved_1f1b":
            raise QCompileError("tensor parallel with interleaved_1f1b is not supported",
                                fix="use pipeline.schedule: 1f1b or gpipe")
        pp = spec.pipeline.num_stages
        plan = spec.tensor_parallel.plan
        if isinstance(plan, dict) and "sequence" in plan.values():
            raise QCompileError("tensor_parallel.plan: sequence parallelism with pipeline "
                                "stages (a stage would send each rank's tokens as the whole "
                                "batch's)", fix="leave sequence out of the plan, or the "
                                "pipeline section")
    if world % (pp * tp):
        what = f"{pp} stages x tensor_parallel.size {tp}" if pp > 1 else \
            f"groups of tensor_parallel.size {tp}"
        raise QCompileError(f"tensor parallel: {world} ranks do not split into {what}",
                            fix=f"launch a multiple of {pp * tp} processes")
    dp = world // (pp * tp)
    if kind == "ddp":
        raise QCompileError("tensor parallel with data_parallel.kind: ddp: torch's "
                            "DistributedDataParallel does not take sharded (DTensor) "
                            "parameters", fix="set data_parallel.kind: fsdp2 (as torchtitan "
                            "composes tensor and data parallelism)")
    if dp > 1 and kind == "none":
        raise QCompileError(f"tensor parallel: {world} ranks hold {dp} replicas of each "
                            "shard, and data_parallel.kind is none: they would train apart",
                            fix=f"set data_parallel.kind: fsdp2, or launch {pp * tp} "
                            "processes")
    if dp == 1 and kind != "none":
        raise QCompileError(f"tensor parallel: data_parallel.kind: {kind} on {world} ranks "
                            f"of tensor_parallel.size {tp} leaves one replica",
                            fix=f"launch {2 * pp * tp} processes, or set data_parallel.kind: "
                            "none")
    dims = {"pp": pp} if pp > 1 else {}
    if dp > 1:
        dims["dp"] = dp
    dims["tp"] = tp
    return dims


_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_dropout")


def _frozen_placement(t: Any, fw: nn.Module, dim: int) -> Any:
    """Where a frozen base's stored tensor ``t`` (laid out by the weight's rows, blocks
    along its columns) is split: the rows a colwise shard holds, the block columns a
    rowwise one holds; one value for many rows or columns (a per-tensor scale, NVFP4's
    tensor scale, a rowwise shard's per-channel scales) stays whole on every rank."""
    from torch.distributed.tensor import Replicate, Shard

    if t.dim() == 2 and dim == 0 and t.shape[0] == fw.rows and fw.rows > 1:
        return Shard(0)
    if t.dim() == 2 and dim == 1 and t.shape[1] > 1:
        return Shard(1)
    return Replicate()


def _partition(dim: int, name: str, module: nn.Module, mesh: Any) -> None:
    """``_partition_linear_fn`` of a planned layer (``dim`` 0 colwise, 1 rowwise): its own
    weight and bias (torch's colwise or rowwise placements), its frozen base's storage
    (``_frozen_placement``); its quantizers hold no shards, and its adapters (``lora_A``,
    ``lora_B``) have their own plan entries."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if name == "weight_frozen":
        places = {leaf: _frozen_placement(t, module, dim)
                  for leaf, t in module.named_parameters(recurse=False)}
    elif not name:
        places = {"weight": Shard(dim), "bias": Shard(0) if dim == 0 else Replicate()}
    else:
        return
    for leaf, place in places.items():
        t = module._parameters.get(leaf)
        if t is not None:
            module.register_parameter(leaf, nn.Parameter(
                distribute_tensor(t, mesh, [place]), requires_grad=t.requires_grad))


def _style(p: LayerPlan, sequence: SequencePlan | None = None) -> Any:
    """torch's style for a planned layer; under sequence parallelism the layers around the
    norms take or give each rank's tokens (``Shard`` of the sequence), as torchtitan
    plans them around ``SequenceParallel``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    class Colwise(ColwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):  # type: ignore[override]
            _partition(0, name, module, device_mesh)

    class Rowwise(RowwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):  # type: ignore[override]
            _partition(1, name, module, device_mesh)

    if p.style == "gather":  # each rank's tokens, gathered once for the colwise layers
        return PrepareModuleInput(input_layouts=(Shard(sequence.dim),),
                                  desired_input_layouts=(Replicate(),))
    if p.style == "gather_whole":  # ... for a layer kept whole: the gathered tensor itself
        return PrepareModuleInput(input_layouts=(Shard(sequence.dim),),
                                  desired_input_layouts=(Replicate(),),
                                  use_local_output=True)
    if p.style == "scatter":  # each rank's tokens, cut from a value every rank holds
        return PrepareModuleInput(input_layouts=(Replicate(),),
                                  desired_input_layouts=(Shard(sequence.dim),),
                                  use_local_output=True)
    if p.style == "colwise":
        return Colwise(output_layouts=Replicate()) if p.gather else Colwise()
    out = Shard(sequence.dim) if sequence is not None and p.layer in sequence.enter \
        else Replicate()
    if p.kind == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    return Rowwise(output_layouts=out)


def _plain_state(layer: nn.Module) -> None:
    """Quantizer state back to plain tensors: ``distribute_module`` replicates every
    buffer of a layer's children as a DTensor; qcompile keeps qparams as plain tensors,
    whole or a colwise layer's rows (``qcompile.runtime.sharded.keep_local_rows``)."""
    for m in layer.modules():
        if m is layer:
            continue
        for key, buf in m._buffers.items():
            if buf is not None and hasattr(buf, "to_local"):
                m._buffers[key] = buf.to_local()


def refuse_sliced_cuts(gm: nn.Module, stages: int) -> None:
    """A pipeline cut inside a sharded region would send one rank's slice of an activation
    as if it were the whole: refused, naming the value (every rank raises it, before any
    communication)."""
    plan = getattr(gm, "meta", {}).get(TP_PLAN_KEY)
    if plan is None:
        return
    for s in range(stages):
        stage = gm.get_submodule(f"stage_{s}")
        crossing = [n.name for n in stage.graph.nodes
                    if n.op == "placeholder" and n.name in plan.region_nodes]
        if crossing:
            raise QCompileError(
                f"tensor parallel x pipeline: stage_{s} receives {crossing[0]}, which is a "
                "slice on each tp rank (inside an attention or MLP block's sharded region)",
                fix="cut the pipeline between blocks: pipeline.stages as lists of whole "
                "blocks, e.g. [{modules: [model.embed_tokens, model.layers.0, "
                "'model.layers.0.*']}, ...]")


def parallelize(gm: nn.Module, tp_mesh: Any, within: str | None = None) -> nn.Module:
    """Shard ``gm``'s planned layers across ``tp_mesh`` (in place; returns ``gm``);
    ``within``: only the layers of that child graph (this rank's pipeline stage)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if getattr(gm, "meta", {}).get(TP_SHARDED_KEY):
        return gm  # sharded already (wrap called again, e.g. by a second Lightning setup)
    plan = getattr(gm, "meta", {}).get(TP_PLAN_KEY)
    if plan is None:
        raise QCompileError("tensor parallel: this graph was compiled without a "
                            "tensor_parallel section", fix="compile it with the spec you wrap "
                            "it with (qc.qcompile(model, spec, ...))")
    if plan.size != tp_mesh.size():
        raise QCompileError(f"tensor parallel: the graph was planned for "
                            f"tensor_parallel.size {plan.size}, the mesh's tp dim has "
                            f"{tp_mesh.size()} ranks", fix="compile and wrap with one spec")
    sharded = shard_tensor_parallel(gm, plan, SumGradients(tp_mesh), within=within)
    gm.meta[TP_SHARDED_KEY] = plan.size
    if within is not None:
        gm.meta[TP_STAGE_KEY] = within
    experts = sorted(n for n, p in sharded.items() if p.style == "experts")
    sharded = {n: p for n, p in sharded.items() if p.style != "experts"}
    styles = {name: _style(p, plan.sequence) for name, p in sharded.items()}
    # (in the plan's order: every rank makes the same collectives in the same order)
    adapters = [n for n in styles if n.rpartition(".")[2] in _ADAPTER_PARTS]
    if adapters:  # first: their layers' own sharding must not touch them (below)
        parallelize_module(gm, tp_mesh, {n: styles[n] for n in adapters})
    # torch's distribute_module replicates every parameter under a layer it shards as a
    # DTensor: a layer's adapters are set aside meanwhile (the sharded ones are done, the
    # others stay plain tensors, whole on every rank)
    aside = [(m, k, m._modules.pop(k)) for n in styles if n not in adapters
             for m in [gm.get_submodule(n)] for k in _ADAPTER_PARTS if k in m._modules]
    try:
        parallelize_module(gm, tp_mesh, {n: s for n, s in styles.items() if n not in adapters})
    finally:
        for m, k, child in aside:
            m._modules[k] = child
    for name in experts:  # by expert (Shard(0)), or within each expert
        _shard_experts(gm, name, tp_mesh, _expert_placement(plan, name))
    for name, p in sharded.items():
        layer = gm.get_submodule(name)
        _plain_state(layer)
        if isinstance(layer, ShardedLinear) and layer.quantize_weight and p.style == "colwise":
            keep_local_rows(layer.weight_fake_quant, layer.weight)
    # each graph (the root, or each block FSDP2 gathers) computes its sharded weights'
    # statistics together before its forward: two collectives a graph, not two a layer
    for _, g in gm.named_modules():
        if not isinstance(g, GraphModule):
            continue
        layers = [(m, m.weight_fake_quant) for n in g.graph.nodes if n.op == "call_module"
                  and isinstance(m := g.get_submodule(str(n.target)), ShardedLinear)
                  and m.quantize_weight]
        if layers:
            g.register_forward_pre_hook(WeightStatistics(layers))
    return gm


def _expert_placement(plan: Any, name: str) -> tuple[int, int]:
    """``(dim, split)`` of expert parameter ``name`` (qualified within the graph
    ``parallelize`` shards: a pipeline stage's carry its ``stage_<i>.`` prefix): by expert
    ``(0, 1)``; within each expert, the gate/up weight's output rows ``(1, split)`` and the
    down weight's input features ``(2, 1)``."""
    for e in plan.experts:
        for i, param in enumerate(e.params):
            if name == param or name.endswith(f".{param}"):
                if not e.within:
                    return 0, 1
                return (1, e.split) if i == 0 else (2, 1)
    raise QCompileError(f"tensor parallel: {name} is not a planned mixture's weight",
                        fix="wrap the graph qc.qcompile returned, as it returned it")


def _shard_experts(gm: nn.Module, name: str, mesh: Any, place: tuple[int, int] = (0, 1)
                   ) -> None:
    """Make parameter ``name`` (``[experts, ...]``) this rank's part along ``place``'s dim
    (``(dim, split)``: with ``split > 1``, its slice of each of ``split`` pieces, torch's
    ``_StridedShard``), as the DTensor on ``mesh`` it is (no collective: every rank holds
    the whole)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    dim, split = place
    parent, _, leaf = name.rpartition(".")
    owner = gm.get_submodule(parent) if parent else gm
    whole = owner._parameters[leaf]
    size, rank = mesh.size(), mesh.get_local_rank()
    pieces = whole.detach().unflatten(dim, (split, -1))
    part = pieces.chunk(size, dim + 1)[rank].flatten(dim, dim + 1).clone()
    placement = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    owner._parameters[leaf] = nn.Parameter(
        DTensor.from_local(part, mesh, [placement], run_check=False, shape=whole.shape,
                           stride=whole.stride()), requires_grad=whole.requires_grad)


# -- compile_once at 1/(T x D) ----------------------------------------------------------------
def refuse_tensor_parallel_once(spec: Any, group: Any) -> None:
    """What ``compile_once`` does not do with a ``tensor_parallel`` section, refused from
    the spec and arguments alone (every rank raises it, before any communication)."""
    if spec.pipeline is not None:
        raise QCompileError("compile_once with tensor_parallel and pipeline stages",
                            fix="compile with qc.qcompile on every rank, then "
                            "qc.distributed.pipeline(gm, spec, loss_fn=...) shards each "
                            "stage across tp")
    if group is not None:
        raise QCompileError("compile_once: group= with a tensor_parallel section (the ranks "
                            "form the spec's dp x tp mesh)",
                            fix="leave group out; launch dp x tp processes")


def refuse_strided_experts(gm: nn.Module) -> None:
    """``compile_once`` reads each rank's part of a weight as one box of the checkpoint's
    tensor; a mixture sliced within each expert whose gate and up weights are one tensor
    gives each rank two ranges of its rows (``_StridedShard``): refused by name."""
    plan = getattr(gm, "meta", {}).get(TP_PLAN_KEY)
    for e in getattr(plan, "experts", ()):
        if e.split > 1:
            raise QCompileError(
                f"compile_once: {e.params[0]} is sliced within each of its {e.experts} "
                f"experts, its gate and up rows alike (each rank reads {e.split} ranges of "
                "its rows), which compile_once does not read from a checkpoint",
                fix="compile with qc.qcompile and shard with qc.distributed.wrap(gm, spec), "
                "or use a tensor_parallel.size that divides the experts (sharded by expert)")


def refuse_differing_tp_batches(digests: list[Any], size: int) -> None:
    """Ranks sharing a layer (one tp group: ranks ``k*size .. k*size + size-1``) run every
    calibration forward together and must see the same batches: each holds part of a
    layer, and a rowwise layer sums the parts. ``digests``: each rank's digest of its
    batches, in rank order (None: no batches)."""
    for start in range(0, len(digests), size):
        group = digests[start:start + size]
        if len(set(group)) > 1:
            odd = next(start + i for i, d in enumerate(group) if d != group[0])
            raise QCompileError(
                f"compile_once: ranks {start} and {odd} share tensor-parallel layers but "
                "were given different calibration batches",
                fix="give the ranks of one tp group the same batches (the data-parallel "
                "replica's, e.g. by rank // tensor_parallel.size)")


def observe_sharded_weights(gm: nn.Module) -> None:
    """Weight quantizers observe their weights (loaded after compiling on meta) as one
    process observes the whole weight: a sharded layer's range from every rank's shard
    (``qcompile.runtime.sharded``: one reduction or gather across tp per layer), any other
    weight whole. Block by block: each FSDP2 block is unsharded while it is read."""
    from qcompile.runtime.calibration import return_freed_memory, weight_quantizers

    owners = [m for n, m in gm.named_children() if n.startswith("stage_")] or [gm]
    for owner in owners:
        unshard = getattr(owner, "unshard", None)
        if unshard is not None:
            # the previous block's gathered weights, freed: back to the OS before this
            # block's arrive (glibc would keep them, a block per block; see
            # qcompile.distributed.once.one_block_at_a_time)
            return_freed_memory()
            unshard()
        try:  # the weights as the unsharded block holds them (read after the unshard)
            pairs = [*weight_quantizers(owner), *sharded_weights(owner)]
            with torch.no_grad():
                for fq, w in pairs:
                    if fq.observer is None:
                        continue
                    fq.observer.reset()
                    observe_shard(fq, w)
        finally:
            reshard = getattr(owner, "reshard", None)
            if reshard is not None:
                reshard()
    return_freed_memory()
