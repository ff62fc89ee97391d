"""``shard_converted``: a rank's converted rows of a sharded graph become one FSDP2 graph.

``qc.convert`` of a ``fully_shard``-ed graph converts each rank's rows
(``qcompile.passes.convert.sharded``); this module puts them back under FSDP2: every
parameter of the converted graph (integer weights, their per-row scales and zero points,
folded biases, the float parameters left) is re-created on the meta device at its global
shape, the graph is ``fully_shard``-ed as the source graph was (the same modules, then the
root, on the same mesh), allocated, and each rank copies its own rows in. The integer
weights are then sharded like any weight (FSDP2 all-gathers them, mixed dtypes as bytes,
for each group's forward) and no rank ever holds more than its rows plus one group.

Example:
    >>> from qcompile.distributed.convert import global_rows
    >>> global_rows([[3, 2], [2, 2]])  # each rank's local rows of two tensors
    [5, 4]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qcompile.runtime.quantized import IntWeight

__all__ = ["data_parallel_layout", "global_rows", "shard_converted", "shard_over_dp",
           "store_sharded_layers", "tp_refusal"]


def global_rows(per_rank: list[list[int]]) -> list[int]:
    """Global dim-0 sizes from every rank's local sizes (FSDP2's rows add up)."""
    return [sum(sizes) for sizes in zip(*per_rank)]


def _replicated(out: nn.Module) -> set[str]:
    """Parameters every rank holds whole: an ``IntWeight``'s per-tensor / per-column
    qparams (the others are laid out by the weight's rows)."""
    found = set()
    for name, m in out.named_modules():
        if isinstance(m, IntWeight):
            rows = m.row_tensors()
            found |= {f"{name}.{leaf}" if name else leaf
                      for leaf, _ in m.named_parameters(recurse=False) if leaf not in rows}
    return found


def _set(out: nn.Module, path: str, kind: str, value: Any) -> None:
    parent, _, leaf = path.rpartition(".")
    getattr(out.get_submodule(parent) if parent else out, kind)[leaf] = value


def shard_converted(out: nn.Module, mesh: Any, units: list[str], rank: int,
                    world: int, cut: dict[str, torch.Tensor]) -> nn.Module:
    """``out`` (this rank's rows, converted) as one ``fully_shard``-ed graph; ``units``:
    the modules the source graph sharded (root last); ``cut``: buffers that hold this
    rank's rows only, by path, with their whole values."""
    from torch.distributed.fsdp import fully_shard

    from qcompile.passes.convert.sharded import rows_of

    whole = _replicated(out)
    params = [(n, p) for n, p in out.named_parameters()]
    sizes = [p.shape[0] if p.dim() else 1 for n, p in params if n not in whole]
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, sizes, group=mesh.get_group())
    totals = iter(global_rows(gathered))
    local = {}
    for name, p in params:
        shape = tuple(p.shape) if name in whole else (next(totals), *p.shape[1:])
        local[name] = p.detach()
        meta = torch.empty(shape, dtype=p.dtype, device="meta")
        _set(out, name, "_parameters", nn.Parameter(meta, requires_grad=False))
    for m in out.modules():  # an IntWeight reshapes to its weight's global shape
        if isinstance(m, IntWeight) and m.by_rows:
            m.shape = (m.packed.shape[0], *m.shape[1:])
    buffers = dict(out.named_buffers())
    for path, value in cut.items():  # whole again: FSDP2 gathers parameters, not buffers
        if path in buffers:
            buffers[path] = value.clone()
    for name in units:
        module = out.get_submodule(name) if name else out
        if name and not any(True for _ in module.parameters()):
            continue
        fully_shard(module, mesh=mesh)
    out.to_empty(device=next(iter(local.values())).device if local else "cpu")
    for path, value in buffers.items():  # to_empty left them uninitialised
        _set(out, path, "_buffers", value)
    with torch.no_grad():
        for name, p in out.named_parameters():
            dst = p.to_local()
            src = local.pop(name)
            if name in whole:  # every rank holds it whole: this rank's rows of it
                start, stop = rows_of(src.shape[0], rank=rank, world=world)
                src = src[start:stop]
            if dst.shape != src.shape:
                raise RuntimeError(f"{name}: this rank's rows {tuple(src.shape)} do not fit "
                                   f"its shard {tuple(dst.shape)}")
            dst.copy_(src)
    return out


# -- tensor parallelism: each rank stores its shards --------------------------------------
def tp_refusal(gm: nn.Module) -> str | None:
    """Why ``qc.convert`` cannot store a tensor-parallel graph's shards rank by rank, or
    None (a graph ``qc.distributed.wrap`` sharded on the tp mesh, under FSDP2 over dp too,
    not placed in pipeline stages)."""
    from torch.distributed.tensor import Shard

    from qcompile.graph.meta import TP_SHARDED_KEY, TP_STAGE_KEY
    from qcompile.runtime.calibration import apply_view, weight_quantizer_sites

    meta = getattr(gm, "meta", {})
    if not meta.get(TP_SHARDED_KEY):
        return "this graph is one part of it (a pipeline stage's graph)"
    if meta.get(TP_STAGE_KEY):
        return ("it is placed in pipeline stages: each rank trained its own stage's shards "
                f"({meta[TP_STAGE_KEY]}; the other stages' layers it holds are untrained "
                "copies)")
    fsdp = any(c.__name__ == "FSDPModule" for m in gm.modules() for c in type(m).__mro__)
    for name, p in gm.named_parameters():  # (under FSDP2 the dp dim is gathered first)
        if hasattr(p, "placements") and len(p.placements) != 1 and not fsdp:
            return (f"parameter {name!r} is laid out on {len(p.placements)} mesh dims "
                    f"({p.placements})")
    for owner, path, _, steps in weight_quantizer_sites(gm):
        parent, _, leaf = path.rpartition(".")
        p = (owner.get_submodule(parent) if parent else owner)._parameters.get(leaf)
        if p is None or not hasattr(p, "placements") or len(p.placements) != 1 + fsdp:
            continue
        rows = apply_view(torch.empty(p.shape, device="meta"), steps)
        place = p.placements[-1]
        by_expert = place == Shard(0) and rows.dim() == 2 and rows.shape[0] % p.shape[0] == 0
        # within each expert: [experts, out, in] by its rows (strided with gate / up) or
        # its input features, read as [experts * out, in]
        within = p.dim() == 3 and rows.dim() == 2 and rows.shape[1] == p.shape[2] and (
            place == Shard(2) or getattr(place, "dim", None) == 1)
        if not (by_expert or within):
            return (f"{path!r} is quantized in the graph as a weight sharded as "
                    f"{p.placements} (storage by rank holds the rows of a Shard(0) weight, "
                    "or a mixture's experts sliced within each expert)")
    return None


def store_sharded_layers(out: nn.Module) -> list[Any]:
    """Every sharded Linear of ``out`` (a frozen copy of a tensor-parallel graph) becomes a
    ``ShardedStoredLinear``: this rank's shard of its weight in its grid's storage
    (``store_shard``), sharded as the weight was. The graphs' weight-statistics hooks go:
    frozen quantizers need none. Returns one ``ConversionRecord`` per layer."""
    from torch.fx import GraphModule

    from qcompile.graph.records import ConversionRecord
    from qcompile.runtime.sharded import (
        ShardedFrozenLinear,
        ShardedLinear,
        ShardedStoredLinear,
        WeightStatistics,
        store_shard,
    )

    records = []
    for g in [m for m in out.modules() if isinstance(m, GraphModule)]:
        for key, hook in list(g._forward_pre_hooks.items()):
            if isinstance(hook, WeightStatistics):
                del g._forward_pre_hooks[key]
        for node in g.graph.nodes:
            if node.op != "call_module":
                continue
            layer = g.get_submodule(str(node.target))
            if not isinstance(layer, ShardedLinear) or isinstance(layer, ShardedFrozenLinear) \
                    or not layer.quantize_weight:
                continue
            fw = store_shard(layer, str(node.target))
            parent, _, leaf = str(node.target).rpartition(".")
            setattr(g.get_submodule(parent) if parent else g, leaf,
                    ShardedStoredLinear.store(layer, fw))
            style = "colwise" if fw.codes.placements[0].is_shard(0) else "rowwise"
            kind = f"{fw.fmt} blocks" if fw.fmt else f"int{_bits(layer.weight_fake_quant)}"
            records.append(ConversionRecord(
                node=node.name, module=f"{node.target}.weight",
                path="block_storage" if fw.fmt else "int_storage",
                op=f"{kind} weight, {style} shard",
                note="this rank's shard stored, dequantized for the matmul at each forward; "
                     "the input quantizer frozen" if layer.quantize_input else
                     "this rank's shard stored, dequantized for the matmul at each forward"))
        records += _store_weight_nodes(g)
        _unslice_fixed_quantizers(g)
    return records


def _unslice_fixed_quantizers(g: Any) -> None:
    """A quantizer with fixed per-tensor qparams (frozen, static) reads a rank's slice as
    it reads any tensor: the ``AsShard`` before it (there for statistics across the
    slices) and the ``to_local`` after it go, so the conversion lowers it as it lowers
    any such quantizer."""
    from qcompile.runtime.fake_quant import FakeQuantize
    from qcompile.runtime.sharded import AsShard

    for node in list(g.graph.nodes):
        if node.op != "call_module" or not isinstance(g.get_submodule(str(node.target)),
                                                      AsShard):
            continue
        users = list(node.users)
        fixed = [u for u in users if u.op == "call_module" and _fixed(
            g.get_submodule(str(u.target)), FakeQuantize)]
        if len(fixed) != len(users):
            continue
        for q in fixed:
            q.replace_input_with(node, node.args[0])
            for u in list(q.users):
                if u.op == "call_method" and u.target == "to_local":
                    u.replace_all_uses_with(q)
                    g.graph.erase_node(u)
        g.graph.erase_node(node)
    g.recompile()


def _fixed(q: nn.Module, kind: type) -> bool:
    return (isinstance(q, kind) and not q.observe and not q.dynamic and q.block_format is None
            and q.granularity == "per_tensor")


def _store_weight_nodes(g: Any) -> list[Any]:
    """Each weight quantizer of ``g``'s graph reading a tensor-parallel weight through
    views (a mixture's experts, sharded by expert, as rows) becomes a ``StoredRows`` call
    returning what it returned (``<weight>_stored``, next to the weight); the weight
    leaves the graph when nothing else reads it."""
    from qcompile.graph.records import ConversionRecord
    from qcompile.runtime.calibration import apply_view, weight_view
    from qcompile.runtime.fake_quant import FakeQuantize
    from qcompile.runtime.sharded import StoredRows, store_dtensor

    records = []
    for node in list(g.graph.nodes):
        if node.op != "call_module" or not node.args:
            continue
        fq = g.get_submodule(str(node.target))
        view = weight_view(node.args[0]) if isinstance(fq, FakeQuantize) else None
        if view is None:
            continue
        attr, steps = view
        path = str(attr.target)
        parent, _, leaf = path.rpartition(".")
        owner = g.get_submodule(parent) if parent else g
        param = owner._parameters.get(leaf)
        if param is None or not hasattr(param, "placements"):
            continue
        fw = store_dtensor(fq, apply_view(param, steps), path)
        name = f"{leaf}_stored"
        owner.add_module(name, StoredRows(fw))
        with g.graph.inserting_before(node):
            call = g.graph.call_module(f"{parent}.{name}" if parent else name)
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        chain = [node, *reversed(_views(node.args[0], attr))]
        for n in chain:
            if not n.users:
                g.graph.erase_node(n)
        if not any(n.op == "get_attr" and n.target == path for n in g.graph.nodes):
            del owner._parameters[leaf]
        kind = f"{fw.fmt} blocks" if fw.fmt else f"int{_bits(fq)}"
        cols = fw.codes.placements[0].dim == 1
        records.append(ConversionRecord(
            node=call.name, module=path, path="block_storage" if fw.fmt else "int_storage",
            op=f"{kind} weight, {'columns' if cols else 'rows'} shard",
            note="this rank's columns (every expert's share of its input features) stored, "
            "dequantized at each forward" if cols else "this rank's rows (its experts, or "
            "every expert's share of them) stored, dequantized at each forward"))
    g.recompile()
    return records


def _views(node: Any, attr: Any) -> list[Any]:
    """The nodes from ``attr`` (a ``get_attr``) to ``node`` (the view a quantizer read)."""
    chain = [node]
    while chain[-1] is not attr:
        chain.append(chain[-1].args[0])
    return list(reversed(chain))


def _bits(fq: nn.Module) -> int:
    return int(fq.quant_max - fq.quant_min).bit_length()


def data_parallel_layout(gm: nn.Module) -> tuple[Any, list[str]]:
    """(the ``dp`` mesh, the modules ``fully_shard`` grouped, innermost first, root last) of
    a dp x tp graph under FSDP2."""
    from qcompile.runtime.sharded import fsdp_units

    mesh = next(p.device_mesh for p in gm.parameters()
                if hasattr(p, "device_mesh") and p.device_mesh.ndim == 2)
    return mesh["dp"], [name for name, _ in fsdp_units(gm)]


def shard_over_dp(out: nn.Module, mesh: Any, units: list[str]) -> nn.Module:
    """``out`` (a dp rank's converted tensor-parallel graph: its stored shards whole over
    dp) ``fully_shard``-ed over ``mesh`` (dp) as its source graph was, the same modules,
    root last: each rank keeps 1/D of its tp shards' storage, FSDP2 gathers a block's for
    its forward (integer codes and float scales, as bytes)."""
    from torch.distributed.fsdp import fully_shard

    for name in units:
        module = out.get_submodule(name) if name else out
        if name and not any(True for _ in module.parameters()):
            continue
        fully_shard(module, mesh=mesh, shard_placement_fn=_dp_placement)
    return out


def _dp_placement(p: nn.Parameter) -> Any:
    """FSDP2's dim over dp for a stored tensor: its columns where tp holds strided rows
    (a mixture's gate/up rows sliced within each expert), whose rows split again over dp
    would make a layout torch cannot gather whole; else FSDP2's own (rows)."""
    from torch.distributed.tensor import Shard

    from qcompile.runtime.sharded import strided

    places = getattr(p, "placements", ())
    if p.dim() >= 2 and any(strided(q) and q.dim == 0 for q in places):
        return Shard(1)
    return None
