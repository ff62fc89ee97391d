"""Quantizers and layers on tensor-parallel shards (DTensors on the ``tp`` mesh dim).

Under tensor parallelism a sharded layer's weight reaches its quantizer as a DTensor
(``Shard(0)`` colwise, ``Shard(1)`` rowwise) and a rowwise layer's input as a
``Shard(-1)`` one. ``fake_quant_dtensor`` fake-quantizes this rank's shard with the
qparams one process would use on the whole tensor:

- statistics a shard holds whole (a colwise weight's rows, a group or block inside the
  shard, a token's values when tokens are sharded) are computed locally;
- statistics across the shard dim (a per-tensor range, a rowwise weight's per-channel
  range, a token's range over sharded features, NVFP4's tensor scale) are reduced across
  ``tp``: one ``all_reduce`` (MIN of ``[min, -max]``) on the tp mesh's process group;
- a colwise weight's per-channel and per-group state (scales, zero points, observed
  ranges) is kept for this rank's rows only (``keep_local_rows``), as its weight is: its
  statistics are the shard's own, and ``state_dict`` shows that state as ``Shard(0)``
  DTensors, so a full state dict reads one process's;
- any other observed qparams are kept whole on every rank (an observer holds the global
  range, as one process does); where a shard needs some of them (a rowwise weight's
  per-group scales), they are sliced at its global offset.

The fake-quant of the local shard is the same kernel and the same bits as one process's on
those rows. The straight-through gradient passes through ``to_local`` / ``from_local``.

``ShardedLinear`` and ``ShardedEmbedding`` are ``nn.Linear`` / ``nn.Embedding`` that run
their quantizers in ``forward``: the modules torch's ``ColwiseParallel`` and
``RowwiseParallel`` shard and hook (``qcompile.distributed.tensor_parallel``).

Example:
    >>> import torch
    >>> from qcompile.runtime.fake_quant import FakeQuantize
    >>> holder = torch.nn.Linear(4, 3)
    >>> holder.weight_fake_quant = FakeQuantize("int8")
    >>> layer = ShardedLinear.adopt(holder, quantize_weight=True, quantize_input=False)
    >>> layer(torch.ones(2, 4)).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qcompile.errors import QCompileError
from qcompile.runtime import recompute
from qcompile.runtime.block_formats import (
    _blocks,
    _kernel_ok,
    block_scales,
    fake_quantize_block,
)

_NVFP4_SCALE = 448.0 * 6.0  # nvfp4_tensor_scale's divisor


class ShardedLinear(nn.Linear):
    """A Linear whose input and weight quantizers run in its own ``forward``."""

    @classmethod
    def adopt(cls, holder: nn.Module, *, quantize_weight: bool,
              quantize_input: bool) -> ShardedLinear:
        """A ``ShardedLinear`` holding ``holder``'s parameters and children (the same
        tensors and quantizers, under the same names); ``forward`` runs its
        ``weight_fake_quant`` / ``input_fake_quant`` children as the flags say."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._parameters.update(holder._parameters)
        layer._buffers.update(holder._buffers)
        layer._modules.update(holder._modules)
        layer._non_persistent_buffers_set |= set(holder._non_persistent_buffers_set)
        if "bias" not in layer._parameters:
            layer.register_parameter("bias", None)
        layer.out_features, layer.in_features = layer.weight.shape
        layer.quantize_weight, layer.quantize_input = quantize_weight, quantize_input
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        style = _local_style(x, self.weight, self.bias)
        if style is not None:
            return self._local_forward(x, style)
        if self.quantize_input:
            x = self.input_fake_quant(x)
        w = self.weight_fake_quant(self.weight) if self.quantize_weight else self.weight
        return F.linear(x, w, self.bias)

    def _local_forward(self, x: Any, style: str) -> Any:
        """The layer on this rank's values, as torch's styles hand them over and take them
        back: a colwise shard reads the whole input (``Replicate``) and gives its output
        features (``Shard(-1)``); a rowwise one reads its input features (``Shard(-1)``)
        and gives its partial sums (``Partial``, which torch's style all-reduces, or
        reduce-scatters to each rank's tokens under sequence parallelism). The matmul runs
        on plain tensors: DTensor's dispatch runs at the layer's edges only, where a float
        layer under torch's styles pays it for every op of its matmul, forward and
        backward."""
        from torch.distributed.tensor import DTensor, Partial, Shard

        if style == "colwise":
            # every rank holds the whole input: its quantizer sees what one process sees;
            # the input's gradient is this rank's output features' part (summed by torch)
            xl = x.to_local(grad_placements=[Partial()])
            if self.quantize_input:
                xl = self.input_fake_quant(xl)
            bias = self.bias.to_local() if self.bias is not None else None
            out = [Shard(x.dim() - 1)]
        else:  # a range over the input features is reduced across tp (fake_quant_dtensor)
            xl = self.input_fake_quant(x, local=True) if self.quantize_input else x.to_local()
            bias, out = None, [Partial()]
        y = F.linear(xl, self._local_weight(), bias)
        shape = torch.Size((*x.shape[:-1], self.out_features))
        return DTensor.from_local(y, x.device_mesh, out, run_check=False, shape=shape,
                                  stride=_contiguous(shape))

    def _local_weight(self) -> torch.Tensor:
        """This rank's shard of the weight the matmul reads (fake-quantized)."""
        w = self.weight
        return self.weight_fake_quant(w, local=True) if self.quantize_weight else w.to_local()


def _local_style(x: Any, w: Any, bias: Any) -> str | None:
    """``colwise`` or ``rowwise`` where ``ShardedLinear`` computes on this rank's values
    (its weight and input DTensors as torch's styles lay them out on one mesh dim; a
    rowwise layer without a bias, which torch adds once, after the reduction), else None."""
    if type(x) is torch.Tensor or not hasattr(x, "placements") or not hasattr(
            w, "placements") or len(w.placements) != 1 or len(x.placements) != 1:
        return None
    pw, px = w.placements[0], x.placements[0]
    if pw.is_shard(0) and px.is_replicate():
        return "colwise"
    if pw.is_shard(1) and px.is_shard(x.dim() - 1) and bias is None:
        return "rowwise"
    return None


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


class ShardedFrozenLinear(ShardedLinear):
    """A Linear whose weight is a frozen base's storage (``weight_frozen``, QLoRA): its
    tensors hold this rank's shard (the weight's rows colwise, ``dim`` 0, or its columns
    rowwise, ``dim`` 1), which each forward dequantizes, as one process dequantizes the
    whole, into the shard torch's style expects."""

    @classmethod
    def adopt(cls, holder: nn.Module, *, dim: int) -> ShardedFrozenLinear:  # type: ignore[override]
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._parameters.update(holder._parameters)
        layer._modules.update(holder._modules)
        if "bias" not in layer._parameters:
            layer.register_parameter("bias", None)
        layer.register_parameter("weight", None)  # the storage is the weight
        fw = layer.weight_frozen
        layer.out_features, layer.in_features = fw.rows, fw.cols
        layer.quantize_weight = layer.quantize_input = False
        layer.shard_dim = dim
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        fw = self.weight_frozen
        if not isinstance(x, DTensor):  # not sharded (yet): the whole weight
            return F.linear(x, fw(), self.bias)
        w = DTensor.from_local(local_frozen(fw, self.shard_dim).dequantize(), x.device_mesh,
                               [Shard(self.shard_dim)], run_check=False,
                               shape=torch.Size((fw.rows, fw.cols)), stride=(fw.cols, 1))
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and recompute.active():
            # autograd keeps the stored integers, not this float shard (as FrozenWeight)
            recompute.tag(w, fw.codes.to_local(), _dequantize_again, fw, self.shard_dim)
        return F.linear(x, w, self.bias)


class ShardedStoredLinear(ShardedFrozenLinear):
    """``qc.convert``'s form of a sharded layer: its weight is this rank's shard as its
    quantizer's grid stores it (``weight_frozen``: integer codes with their scales, or a
    block format's codes and block scales, sharded as the weight was: ``store_shard``),
    dequantized at each forward into the shard the matmul reads: the values its
    fake-quantizer gave, exactly. Its input quantizer, frozen, runs as in training (a
    range over a rowwise shard's input features reduced across tp)."""

    @classmethod
    def store(cls, layer: ShardedLinear, fw: nn.Module) -> ShardedStoredLinear:
        """``layer`` (a ``ShardedLinear`` as torch's style sharded and hooked it) with
        ``fw`` (``store_shard(layer)``) for its weight: the same bias, quantizers and
        hooks; the float weight and its quantizer are left out."""
        holder = nn.Module()
        holder.register_parameter("bias", layer.bias)
        holder._modules.update((k, m) for k, m in layer._modules.items()
                               if k != "weight_fake_quant")  # graph nodes may call them
        holder.weight_frozen = fw
        dim = 0 if layer.weight.placements[0].is_shard(0) else 1
        out = cls.adopt(holder, dim=dim)
        out.quantize_input = layer.quantize_input
        for key, value in layer.__dict__.items():  # torch's style: its input / output hooks
            if key.startswith("_forward") and isinstance(value, dict):
                out.__dict__[key] = type(value)(value)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        style = _local_style(x, self.weight_frozen.codes, self.bias)
        if style is not None:
            return self._local_forward(x, style)
        if self.quantize_input:
            x = self.input_fake_quant(x)
        return super().forward(x)

    def _local_weight(self) -> torch.Tensor:
        return local_frozen(self.weight_frozen, self.shard_dim).dequantize()


def store_shard(layer: ShardedLinear, name: str = "") -> nn.Module:
    """``store_dtensor`` of ``layer``'s weight with its (frozen) weight quantizer."""
    return store_dtensor(layer.weight_fake_quant, layer.weight, name)


@torch.no_grad()
def store_dtensor(fq: nn.Module, w: Any, name: str = "") -> nn.Module:
    """A ``FrozenWeight`` holding the ``[out, in]`` weight ``w`` (a DTensor: this rank's
    rows or columns) as its frozen quantizer ``fq`` stores it, each tensor a DTensor
    sharded as the weight is: by rows (``Shard(0)``: codes and per-row scales), or by
    columns (``Shard(1)``: codes and per-group or per-block scales); one value for many
    rows or columns (a per-tensor scale, per-channel scales of column shards, NVFP4's
    tensor scale) whole on every rank. Each rank encodes its own shard with the qparams
    its fake-quant uses (``_local_rows``); NVFP4's tensor scale is the whole weight's (one
    all-reduce)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from qcompile.runtime.block_formats import nvfp4_tensor_scale
    from qcompile.runtime.frozen import FrozenWeight, frozen_layout, symmetric_offset

    x, d = _placement(w)
    local = x.to_local().detach()
    why = frozen_layout(fq, tuple(x.shape))
    if why is not None or d is None:
        raise QCompileError(f"convert: the sharded weight {name!r} cannot be stored as "
                            f"{why or 'a weight every rank holds whole'}",
                            fix=f"plan it replicate (tensor_parallel.plan: {{{name!r}: "
                            "replicate}), or gather the state and convert one process's "
                            "graph")
    tensor_scale = None
    if fq.block_format == "nvfp4":
        a = local.abs().amax().float().reshape(1)
        tensor_scale = nvfp4_tensor_scale(_extremes(-a, a, x.device_mesh)[1])
    qparams = {} if fq.block_format is not None else {
        "scale": _local_rows(fq, fq.scale, x, d),
        "zero_point": _local_rows(fq, fq.zero_point, x, d)}
    storage, packed = FrozenWeight.encode(fq, local, tensor_scale=tensor_scale, **qparams)
    by_block = fq.block_format is not None or fq.granularity == "per_group"
    sharded = {}
    for leaf, t in storage.items():
        split = leaf == "codes" or (leaf != "tensor_scale" and (
            by_block or (d == 0 and fq.granularity == "per_channel")))
        # (a strided slice of the rows: the rows' codes and scales strided alike)
        place = x.placements[0] if strided(x.placements[0]) else Shard(d)
        sharded[leaf] = DTensor.from_local(t, x.device_mesh, [place if split else Replicate()],
                                           run_check=False)
    return FrozenWeight(sharded, shape=tuple(x.shape), dtype=local.dtype,
                        fmt=fq.block_format, block=fq.group_size, packed=packed,
                        offset=symmetric_offset(fq, packed))


class StoredRows(nn.Module):
    """A weight stored sharded on the tp mesh (``weight_frozen``: ``store_dtensor`` of a
    mixture's experts seen as ``[experts * out, in]``: by expert, ``Shard(0)`` rows;
    within each expert, the gate/up rows' ``_StridedShard(0)`` or down's ``Shard(1)``
    columns), called for the weight: this rank's part dequantized, as the DTensor the
    graph's fake-quantizer returned."""

    def __init__(self, fw: nn.Module) -> None:
        super().__init__()
        self.weight_frozen = fw

    def forward(self) -> Any:
        from torch.distributed.tensor import DTensor

        fw = self.weight_frozen
        place = fw.codes.placements[0]
        return DTensor.from_local(local_frozen(fw, place.dim).dequantize(),
                                  fw.codes.device_mesh, [place], run_check=False,
                                  shape=torch.Size((fw.rows, fw.cols)), stride=(fw.cols, 1))


def sharded_weights(gm: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(weight quantizer, weight) of every ``ShardedLinear`` in ``gm`` that quantizes its
    weight, in module order (every rank's order: ``observe_shard`` communicates)."""
    return [(m.weight_fake_quant, m.weight) for m in gm.modules()
            if isinstance(m, ShardedLinear) and not isinstance(m, ShardedFrozenLinear)
            and m.quantize_weight]


@torch.no_grad()
def observe_shard(fq: nn.Module, w: Any) -> None:
    """``fq`` observes the whole weight ``w`` is a shard of (one reduction or gather across
    tp; a colwise quantizer keeping its rows, its rows' own statistics)."""
    if not hasattr(w, "placements"):
        fq.observe_tensor(w.detach())
        return
    x, d = _placement(w)
    fq.observe_range(*_global_minmax(fq, x, x.to_local(), d))


def on_tp_mesh(gm: nn.Module) -> bool:
    """Whether a parameter of ``gm`` is laid out on a mesh with a ``tp`` dim (torch's
    tensor-parallel styles sharded it: ``qc.distributed.mesh`` names the dims)."""
    return any("tp" in (getattr(p.device_mesh, "mesh_dim_names", None) or ())
               for p in gm.parameters() if hasattr(p, "device_mesh"))


def fsdp_units(gm: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules ``fully_shard`` grouped in ``gm``, innermost first, the root last."""
    return sorted(((n, m) for n, m in gm.named_modules()
                   if any(c.__name__ == "FSDPModule" for c in type(m).__mro__)),
                  key=lambda nm: -nm[0].count(".") if nm[0] else 1)


def on_one_mesh_dim(w: torch.Tensor) -> bool:
    """Whether ``w`` is whole or a shard on one mesh dim (not also FSDP2's over dp: such
    a weight is read once its unit gathers it)."""
    return not (hasattr(w, "placements") and len(w.placements) > 1)


def observe_whole_weights(gm: nn.Module, pairs: Any) -> None:
    """Every weight quantizer ``pairs(module)`` lists ((quantizer, weight) read now)
    observes its whole weight once (``observe_shard``): under FSDP2 each ``fully_shard``
    unit's, innermost first, while that unit is gathered over dp (its weights then hold
    their tensor-parallel shards only). Collective: every rank calls it."""
    units = fsdp_units(gm)
    done: set[int] = set()

    def observe(owner: nn.Module) -> None:
        for fq, w in pairs(owner):
            if id(fq) not in done and on_one_mesh_dim(w):
                observe_shard(fq, w)
                done.add(id(fq))

    if not units:
        observe(gm)
    for _, unit in units:
        unit.unshard()
        try:
            observe(unit)
        finally:
            unit.reshard()


def _dequantize_again(codes: torch.Tensor, fw: nn.Module, dim: int) -> torch.Tensor:
    """The recompute recipe of a frozen shard (``codes``: its version-checked codes)."""
    return local_frozen(fw, dim).dequantize()


def local_frozen(fw: nn.Module, dim: int) -> nn.Module:
    """A ``FrozenWeight`` over this rank's part of ``fw``'s storage (its tensors' local
    shards, no copy): the weight's rows (``dim`` 0) or columns (``dim`` 1) it holds."""
    from qcompile.runtime.frozen import FrozenWeight

    local = {k: t.to_local() if hasattr(t, "to_local") else t
             for k, t in fw.named_parameters()}
    codes = fw.codes
    rows, cols = fw.rows, fw.cols
    if dim == 0:
        rows = local["codes"].shape[0]
    else:  # codes hold a fixed number of bytes per column: the shard's share of them
        cols = fw.cols * local["codes"].shape[1] // codes.shape[1]
    return FrozenWeight(local, shape=(rows, cols), dtype=fw.out_dtype, fmt=fw.fmt,
                        block=fw.block, packed=fw.packed, offset=fw.offset)


class ShardedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` holding a graph's embedding weight (the same Parameter)."""

    @classmethod
    def adopt(cls, holder: nn.Module, padding_idx: int | None) -> ShardedEmbedding:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._parameters.update(holder._parameters)
        layer._buffers.update(holder._buffers)
        layer._modules.update(holder._modules)
        layer.num_embeddings, layer.embedding_dim = layer.weight.shape
        layer.padding_idx = padding_idx
        layer.max_norm, layer.norm_type = None, 2.0
        layer.scale_grad_by_freq, layer.sparse = False, False
        return layer


class SumGradients(nn.Module):
    """The identity forward; backward, the gradient summed across the tp mesh (a DTensor
    ``Replicate`` read as ``Partial``: torch's all-reduce). Put where a replicated
    parameter enters a sharded region, whose ops on each rank see only its heads."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.__dict__["mesh"] = mesh  # not state: rebuilt by wrap

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        return DTensor.from_local(p, self.mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])


class AsShard(nn.Module):
    """This rank's slice of an activation as the DTensor it is (``Shard(dim)`` on the tp
    mesh), for a quantizer whose qparams span the sliced dim (``fake_quant_dtensor``); the
    gradient passes through."""

    def __init__(self, mesh: Any, dim: int) -> None:
        super().__init__()
        self.__dict__["mesh"] = mesh  # not state: rebuilt by wrap
        self.dim = dim

    def forward(self, x: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(x, self.mesh, [Shard(self.dim % x.dim())], run_check=False)


class LocalExperts(nn.Module):
    """One of a mixture's two grouped matmuls on this rank's experts (the weight's
    ``Shard(0)`` on the tp mesh: experts ``r*n .. (r+1)*n - 1`` of rank ``r``), calling
    the graph's own grouped-matmul op (``op``) on the rows routed to them: the rows of
    experts ``e`` lie between ``offs[e-1]`` and ``offs[e]`` (the op's cumulative ends).

    ``rows=None`` (the gate/up matmul): ``x`` holds every routed row; the result is this
    rank's rows only. ``rows`` given (the down matmul): ``x`` holds this rank's rows, and the
    result every row of ``rows`` (the whole routed tensor), the others' zero: summed across
    tp (``SumPartial``) it is the whole output. Row counts differ per rank and per batch."""

    def __init__(self, mesh: Any, op: Any) -> None:
        super().__init__()
        self.__dict__["mesh"] = mesh  # not state: rebuilt by wrap
        self.__dict__["op"] = op

    def forward(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        n = w.shape[0]
        first = self.mesh.get_local_rank() * n
        ends = offs[max(first - 1, 0):first + n].tolist()
        begin = int(ends[0]) if first else 0
        end = int(ends[-1])
        local = offs[first:first + n] - begin
        if rows is None:
            return self.op(x[begin:end], w, local)
        out = self.op(x, w, local)
        return torch.nn.functional.pad(out, (0, 0, begin, rows.shape[0] - end))


class SumPartial(nn.Module):
    """Each rank's part of a value (its experts' rows, the others zero) summed across the
    tp mesh into the whole (a DTensor ``Partial`` made ``Replicate``: torch's all-reduce);
    the gradient, the same on every rank, passes to each part."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.__dict__["mesh"] = mesh  # not state: rebuilt by wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        return DTensor.from_local(x, self.mesh, [Partial()], run_check=False).redistribute(
            self.mesh, [Replicate()]).to_local()


# -- fake-quant of a shard -----------------------------------------------------------------
def _placement(x: Any) -> tuple[Any, int | None]:
    """``x`` with one placement, Replicate or Shard (a Partial value is reduced first),
    and its shard dim (None: replicated)."""
    from torch.distributed.tensor import Replicate

    if len(x.placements) != 1:
        raise QCompileError(
            f"a quantizer got a DTensor on a {len(x.placements)}-D mesh "
            f"({x.placements}); inside a forward it sees the tp dim only",
            fix="wrap the graph with qc.distributed.wrap(gm, spec), which shards it on the "
            "tp dim and replicates it on the dp dim")
    p = x.placements[0]
    if p.is_partial():
        x = x.redistribute(x.device_mesh, [Replicate()])
        p = x.placements[0]
    if p.is_shard() or strided(p):
        return x, p.dim % x.dim()
    return x, None


def strided(p: Any) -> bool:
    """Whether placement ``p`` is torch's ``_StridedShard`` (not a ``Shard`` subclass): the
    dim cut into ``split_factor`` equal pieces, each sliced across the mesh, a rank
    holding its slice of each in order."""
    return type(p).__name__ == "_StridedShard"


def _own_rows(t: torch.Tensor, x: Any) -> torch.Tensor:
    """The rows (dim 0) of ``t``, one or more per row of the whole tensor ``x`` (a DTensor
    strided along its rows), that this rank's slices hold, in their local order."""
    rows = t.unflatten(0, (x.placements[0].split_factor, x.device_mesh.size(), -1))
    return rows[:, x.device_mesh.get_local_rank()].flatten(0, 1)


def _extremes(mn: torch.Tensor, mx: torch.Tensor, mesh: Any
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``mn`` and ``mx`` reduced (min, max) across the mesh: one all-reduce (MIN of
    ``[mn, -mx]``) on the mesh's process group."""
    import torch.distributed as dist

    both = torch.cat([mn.reshape(-1), -mx.reshape(-1)]).contiguous()
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return both[:mn.numel()].view_as(mn), -both[mn.numel():].view_as(mx)


def _joined(mn: torch.Tensor, mx: torch.Tensor, mesh: Any, dim: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``mn`` and ``mx`` joined along ``dim`` (even shards, in mesh order):
    one all-gather on the mesh's process group."""
    import torch.distributed as dist

    pair = torch.stack([mn, mx]).contiguous()
    parts = [torch.empty_like(pair) for _ in range(mesh.size())]
    dist.all_gather(parts, pair, group=mesh.get_group())
    whole = torch.cat(parts, dim=dim + 1)
    return whole[0], whole[1]


def _offset(x: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, start = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return tuple(shape), tuple(start)


def _join_dim(fq: nn.Module, d: int, local: torch.Tensor) -> int | None:
    """The dim of a statistic (``_grid``) along which the shards' statistics are joined
    (they follow the shard dim ``d``), or None: they are reduced (``d`` is reduced over)."""
    rank, g = local.dim(), fq.granularity
    if g == "per_token":
        return d if d != rank - 1 else None
    if g == "per_channel":
        return 0 if d == fq.axis % rank else None
    if g == "per_group":  # groups along the input features: whole rows or whole groups
        if d != 0 and rank != 2:
            raise QCompileError(f"per-group quantizer on a {rank}-D tensor sharded along "
                                f"dim {d}", fix="plan this layer replicate")
        return d
    return None


def _grid(fq: nn.Module, stat: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A statistic shaped so that shards join along ``_join_dim``: per group ``[rows,
    groups]``, else as ``fq._minmax`` gives it."""
    return stat.view(local.shape[0], -1) if fq.granularity == "per_group" else stat


# -- quantizer state of a colwise shard: this rank's rows --------------------------------------
_ROWS_KEY = "_tp_rows"
_LOCAL_KEYS = "_tp_local_buffers"  # on the quantizer and its observer: which buffers


class LocalRows:
    """A colwise weight quantizer's per-row state (scales, zero points, observed ranges:
    one or more values per output row) kept for this rank's rows only, as its weight is
    (``keep_local_rows``). ``state_dict`` shows each such buffer as the DTensor it is
    (``Shard(0)`` on the tp mesh, the whole tensor's shape), so a full state dict or a
    distributed checkpoint reads the whole; ``load_state_dict`` takes a DTensor or the
    whole tensor and keeps this rank's rows."""

    def __init__(self, mesh: Any, rows: int, start: int, stop: int) -> None:
        self.__dict__["mesh"] = mesh  # not state: rebuilt by wrap
        self.rows, self.start, self.stop = rows, start, stop

    def __deepcopy__(self, memo: dict) -> LocalRows:
        return self  # the mesh and the rows are the copy's too

    def part(self, whole: int) -> slice:
        per = whole // self.rows
        return slice(self.start * per, self.stop * per)

    def on_save(self, module: nn.Module, state: dict, prefix: str, _meta: Any) -> None:
        from torch.distributed.tensor import DTensor, Shard

        for key in module.__dict__.get(_LOCAL_KEYS, ()):
            local = module._buffers[key]
            whole = local.numel() * self.rows // max(self.stop - self.start, 1)
            state[prefix + key] = DTensor.from_local(
                local.detach(), self.mesh, [Shard(0)], run_check=False,
                shape=torch.Size((whole,)), stride=(1,))

    def on_load(self, module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
        for key in module.__dict__.get(_LOCAL_KEYS, ()):
            value = state.get(prefix + key)
            if value is None:
                continue
            if hasattr(value, "full_tensor"):  # as on_save wrote it: its local rows
                value = value.to_local() if value.placements[0].is_shard(0) else \
                    value.full_tensor()[self.part(value.numel())]
            elif value.numel() != module._buffers[key].numel():  # the whole tensor
                value = value.reshape(-1)[self.part(value.numel())]
            state[prefix + key] = value


def keep_local_rows(fq: nn.Module, weight: Any) -> None:
    """Keep a colwise shard's per-row quantizer state for this rank's rows only (its
    share, as the weight's; a no-op for anything else): the state's memory is the weight's
    split, and its statistics need no gather."""
    if fq.block_format is not None or fq.granularity not in ("per_channel", "per_group"):
        return
    if not hasattr(weight, "placements") or weight.dim() != 2:
        return
    x, d = _placement(weight)
    if d != 0 or (fq.granularity == "per_channel" and fq.axis % 2 != 0):
        return
    shape, start = _offset(x)
    rows, lo, hi = x.shape[0], start[0], start[0] + shape[0]
    whole = fq.scale.numel()
    owners = [fq] + ([fq.observer] if getattr(fq, "observer", None) is not None else [])
    for m in owners:
        names = tuple(k for k, b in m._buffers.items()
                      if b is not None and b.dim() == 1 and b.numel() == whole)
        for k in names:
            per = whole // rows
            m._buffers[k] = m._buffers[k][lo * per:hi * per].clone()
        m.__dict__[_LOCAL_KEYS] = names
    state = LocalRows(x.device_mesh, rows, lo, hi)
    fq.__dict__[_ROWS_KEY] = state
    for m in owners:  # (torch marks a hook it is given: a partial, not a bound method)
        m.register_state_dict_post_hook(functools.partial(LocalRows.on_save, state))
        m.register_load_state_dict_pre_hook(functools.partial(LocalRows.on_load, state))


def holds_rows(fq: nn.Module) -> bool:
    """Whether ``fq`` keeps its per-row state for this rank's rows (``keep_local_rows``)."""
    return _ROWS_KEY in fq.__dict__


def whole_quantizer(fq: nn.Module) -> nn.Module:
    """A copy of ``fq`` holding its whole state (``keep_local_rows``' rows gathered from
    every tp rank: a collective, every rank calls it), as one process's quantizer: what an
    exporter reads. ``fq`` itself is unchanged; a quantizer holding it whole is copied."""
    import copy

    import torch.distributed as dist

    q = copy.deepcopy(fq)
    state = fq.__dict__.get(_ROWS_KEY)
    if state is None:
        return q
    q.__dict__.pop(_ROWS_KEY, None)
    owners = [(fq, q)] + ([(fq.observer, q.observer)] if getattr(fq, "observer", None)
                          is not None else [])
    group = state.mesh.get_group()
    for src, dst in owners:
        for key in dst.__dict__.pop(_LOCAL_KEYS, ()):  # (its hooks then leave it alone)
            local = src._buffers[key].detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local, group=group)
            dst._buffers[key] = torch.cat(parts)
    return q


def _global_minmax(fq: nn.Module, x: Any, local: torch.Tensor, d: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``fq._minmax`` gives on the whole tensor, from this rank's shard (its own
    rows' statistics only, for a quantizer keeping its rows: ``keep_local_rows``)."""
    mn, mx = fq._minmax(local.detach().float())
    if d is None or holds_rows(fq):
        return mn, mx
    dim = _join_dim(fq, d, local)
    if dim is None:
        return _extremes(mn, mx, x.device_mesh)
    mn, mx = _joined(_grid(fq, mn, local), _grid(fq, mx, local), x.device_mesh, dim)
    if strided(x.placements[0]):  # the ranks' strided rows (dim 0), in the whole's order
        pieces = (x.device_mesh.size(), x.placements[0].split_factor, -1)
        mn = mn.unflatten(0, pieces).transpose(0, 1).flatten(0, 2)
        mx = mx.unflatten(0, pieces).transpose(0, 1).flatten(0, 2)
    return (mn.reshape(-1), mx.reshape(-1)) if fq.granularity == "per_group" else (mn, mx)


def _local_rows(fq: nn.Module, t: torch.Tensor, x: Any, d: int | None) -> torch.Tensor:
    """The qparams (one per scale of the whole tensor) this rank's shard uses."""
    if d is None or t.numel() == 1 or holds_rows(fq):
        return t
    g, rank = fq.granularity, x.dim()
    if strided(x.placements[0]):  # strided rows only (the plan shards experts so)
        if (g == "per_channel" and d == fq.axis % rank) or (g == "per_group" and d == 0):
            return _own_rows(t.view(x.shape[0], -1), x).reshape(-1)
        return t
    shape, start = _offset(x)
    if g == "per_channel":
        return t[start[d]:start[d] + shape[d]] if d == fq.axis % rank else t
    if g == "per_group":
        grid = t.view(x.shape[0], -1)
        if d == 0:
            return grid[start[0]:start[0] + shape[0]].reshape(-1)
        size = fq.group_size
        return grid[:, start[1] // size:(start[1] + shape[1]) // size].reshape(-1)
    return t


def _key(local: torch.Tensor) -> tuple[int, int]:
    """Which values a shard holds: its storage and its version (an optimizer step or
    FSDP2's next unshard changes one)."""
    return local.data_ptr(), local._version


def _weight_kind(fq: nn.Module, d: int | None, local: torch.Tensor) -> str | None:
    """How a weight quantizer's whole-tensor statistics come from the shards: ``join``
    (gathered: the statistics follow the shard dim), ``reduce`` (min / max across ranks),
    ``amax`` (NVFP4's tensor scale), or None (local, or nothing observed)."""
    if d is None or holds_rows(fq):
        return None
    if fq.block_format is not None:
        return "amax" if fq.block_format == "nvfp4" and fq.enabled else None
    if fq.dynamic or fq.granularity == "per_token" or not fq.observe:
        return None
    return "reduce" if _join_dim(fq, d, local) is None else "join"


class WeightStatistics:
    """Before a graph's forward (after FSDP2 has gathered its block), the whole-tensor
    statistics of every sharded weight quantizer it runs, in two collectives in all (one
    all-reduce, one all-gather) instead of one per layer; each quantizer then finds its
    own (``fake_quant_dtensor``) while its weight holds the values they came from.

    ``layers``: (ShardedLinear, its weight quantizer) pairs, in the graph's order."""

    def __init__(self, layers: list[tuple[nn.Module, nn.Module]]) -> None:
        self.layers = layers

    def __call__(self, module: nn.Module, args: Any) -> None:
        reduce, join, mesh = [], [], None
        for layer, fq in self.layers:
            w = layer.weight
            if not hasattr(w, "to_local"):
                continue
            w, d = _placement(w)
            mesh, local = w.device_mesh, w.to_local().detach()
            kind = _weight_kind(fq, d, local)
            if kind is None:
                continue
            if kind == "amax":
                a = local.abs().amax().float().reshape(1)
                reduce.append((fq, local, -a, a))
            elif kind == "reduce":
                reduce.append((fq, local, *fq._minmax(local.float())))
            else:
                join.append((fq, d, local, *fq._minmax(local.float())))
        if reduce:
            mins, maxs = _extremes(torch.cat([r[2].reshape(-1) for r in reduce]),
                                   torch.cat([r[3].reshape(-1) for r in reduce]), mesh)
            at = 0
            for fq, local, mn, mx in reduce:
                n = mn.numel()
                fq.__dict__["_tp_stats"] = (_key(local), (mins[at:at + n].view_as(mn),
                                                          maxs[at:at + n].view_as(mx)))
                at += n
        if join:
            import torch.distributed as dist

            flat = torch.cat([torch.cat([j[3].reshape(-1), j[4].reshape(-1)]) for j in join])
            parts = [torch.empty_like(flat) for _ in range(mesh.size())]
            dist.all_gather(parts, flat, group=mesh.get_group())
            at = 0
            for fq, d, local, mn, _ in join:
                n = mn.numel()
                dim = _join_dim(fq, d, local)
                mins = torch.cat([_grid(fq, p[at:at + n], local) for p in parts], dim=dim)
                maxs = torch.cat([_grid(fq, p[at + n:at + 2 * n], local) for p in parts],
                                 dim=dim)
                fq.__dict__["_tp_stats"] = (_key(local), (mins.reshape(-1), maxs.reshape(-1)))
                at += 2 * n


def _ready_stats(fq: nn.Module, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The statistics ``WeightStatistics`` computed for these values, once."""
    stats = fq.__dict__.pop("_tp_stats", None)
    if stats is None or stats[0] != _key(local):
        return None
    return stats[1]


def _nvfp4(local: torch.Tensor, block: int, amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake-quant of a shard under the whole tensor's scale (``amax``: the largest
    magnitude of every rank's shard), with the straight-through gradient.

    The C++ kernel takes its tensor scale from its input's largest magnitude: given the
    shard with one more row holding ``amax`` (a value of some rank's shard, so exact in the
    shard's dtype), it computes the shard's blocks under the whole tensor's scale, the same
    bits as the formula (``block_scales(..., tensor_scale=)``), at the kernel's speed."""
    with torch.no_grad():
        rows = local.detach().reshape(-1, local.shape[-1])
        if _kernel_ok(rows):
            extra = rows.new_zeros(1, rows.shape[-1])
            extra[0, 0] = amax.to(rows.dtype)
            q = torch.ops.qcompile.block_fake_quant(torch.cat([rows, extra]), "nvfp4", block)
            q = q[:-1].reshape(local.shape)
        else:
            xb = _blocks(rows, block)
            q = block_scales(xb, "nvfp4", tensor_scale=amax / _NVFP4_SCALE).fake_quant(xb)
            q = q.reshape(local.shape).to(local.dtype)
    return _StraightThrough.apply(local, q) if local.requires_grad else q


class _StraightThrough(torch.autograd.Function):
    """``q`` forward, the identity gradient to ``x`` (no ``x + (q - x)``: -0.0 stays)."""

    @staticmethod
    def forward(ctx, x, q):  # type: ignore[override]
        return q

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def fake_quant_dtensor(fq: nn.Module, x: Any, local: bool = False) -> Any:
    """``fq(x)`` for a DTensor ``x``: the whole tensor's qparams, this rank's shard;
    ``local``: this rank's values, as a plain tensor (the gradient flows back to ``x``'s
    shard)."""
    from torch.distributed.tensor import DTensor

    weight = isinstance(x, nn.Parameter)
    x, d = _placement(x)
    values = x.to_local()
    out = _fake_quant_shard(fq, x, values, d, weight)
    if out is None:  # nothing quantized
        return values if local else x
    if local:
        return out
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())


def _fake_quant_shard(fq: nn.Module, x: Any, local: torch.Tensor, d: int | None,
                      weight: bool) -> torch.Tensor | None:
    """``fake_quant_dtensor``'s work: ``local`` (the values of ``x``, a DTensor sharded
    along ``d``) fake-quantized under the whole tensor's qparams, or None where nothing
    is quantized."""
    if not local.is_floating_point():
        return None
    if local.numel() == 0 and d is not None:
        _empty_shard(fq, x, local, d)
        return None
    if x.numel() == 0:
        return None
    again: tuple | None = None  # a weight's recipe: how the backward computes it again
    if fq.block_format is not None:
        if not fq.enabled:
            return None
        if fq.block_format == "nvfp4" and d is not None:
            ready = _ready_stats(fq, local)
            if ready is not None:
                amax = ready[1]
            else:
                a = local.detach().abs().amax().float().reshape(1)
                amax = _extremes(-a, a, x.device_mesh)[1]
            out = _nvfp4(local, fq.group_size, amax.reshape(()))
            again = (_nvfp4, fq.group_size, amax.reshape(()).clone())
        else:  # every block inside the shard (the plan checked): local
            out = fake_quantize_block(local.contiguous(), fq.block_format, fq.group_size)
            again = (_blocks_again, fq.block_format, fq.group_size)
    elif fq.dynamic or fq.granularity == "per_token":
        if not fq.enabled:
            return None
        with torch.no_grad():
            mn, mx = fq._minmax(local.detach().float())
            if d is not None and (fq.granularity != "per_token" or d == local.dim() - 1):
                mn, mx = _extremes(mn, mx, x.device_mesh)
            scale, zp = fq._qparams(mn, mx)
        out = fq._fake_quant(local, scale, zp, shaped=fq.granularity == "per_token")
    else:
        if fq.observe:
            ready = _ready_stats(fq, local) if d is not None else None
            with torch.no_grad():
                mn, mx = ready if ready is not None else _global_minmax(fq, x, local, d)
            if fq.training and torch.is_grad_enabled() and fq.deferred():
                _pend(fq, mn, mx)
                if not fq._ready():
                    return None
            else:
                fq.observe_range(mn, mx)
        if not fq.enabled:
            return None
        scale = _local_rows(fq, fq.scale, x, d)
        zp = _local_rows(fq, fq.zero_point, x, d)
        out = fq._fake_quant(local, scale, zp, shaped=False)
        # the qparams as this forward used them (set_qparams writes the buffers in place)
        again = (fq._fake_quant_again, scale.detach().clone(), zp.clone())
    if weight and again is not None and not torch.compiler.is_compiling() \
            and recompute.active():
        # the shard's fake-quantized copy is computed again in backward, not kept: what
        # the float layer keeps is its weight (qcompile.runtime.recompute)
        recompute.tag(out, local, *again)
    return out


def _empty_shard(fq: nn.Module, x: Any, local: torch.Tensor, d: int) -> Any:
    """A rank holding none of a sharded value (no token routed to its experts): it makes
    the reductions the other ranks make for ``fq``, with statistics that change nothing
    (an empty range, a zero amax), and takes the result as they do; nothing to quantize."""
    mesh = x.device_mesh
    if fq.block_format is not None:
        if fq.block_format == "nvfp4" and fq.enabled:
            zero = torch.zeros(1, device=local.device)
            _extremes(-zero, zero, mesh)
        return x
    with torch.no_grad():
        mn, mx = fq._minmax(torch.zeros((1, *local.shape[1:]), device=local.device))
        mn, mx = torch.full_like(mn, float("inf")), torch.full_like(mx, float("-inf"))
    if fq.dynamic or fq.granularity == "per_token":
        if fq.enabled and (fq.granularity != "per_token" or d == local.dim() - 1):
            _extremes(mn, mx, mesh)
        return x
    if not fq.observe or holds_rows(fq):
        return x
    if _join_dim(fq, d, local) is not None:
        raise QCompileError(f"a {fq.granularity} quantizer's statistics follow the rows of a "
                            "value this rank holds none of",
                            fix="quantize activations between a mixture's matmuls per "
                            "tensor or per token")
    with torch.no_grad():
        mn, mx = _extremes(mn, mx, mesh)
    if fq.training and torch.is_grad_enabled() and fq.deferred():
        _pend(fq, mn, mx)
    else:
        fq.observe_range(mn, mx)
    return x


def _blocks_again(local: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    return fake_quantize_block(local.detach().contiguous(), fmt, block)


def _pend(fq: nn.Module, mn: torch.Tensor, mx: torch.Tensor) -> None:
    """Fold the whole tensor's range into the step's pending statistics."""
    pending = fq.pending_stats()
    if pending is None:
        fq.__dict__["_pending"] = (mn.clone(), mx.clone())
    else:
        torch.minimum(pending[0], mn, out=pending[0])
        torch.maximum(pending[1], mx, out=pending[1])
