"""``local_rows_copy``: one rank's rows of an FSDP2-sharded graph, as a plain graph.

``fully_shard`` (FSDP2) shards every parameter along dim 0: each rank holds rows
``r*c .. (r+1)*c`` (``c = ceil(rows / N)``) of every weight, as a ``DTensor``. Weight
quantization is row by row (per-tensor, per-channel on axis 0, per-group along a row), and
so is folding a BatchNorm into a conv's output channels: a rank converts its own rows
without seeing the others'. ``local_rows_copy`` builds the graph that conversion runs on:
a copy of the sharded graph without FSDP (its classes, hooks and state left out) whose
parameters are this rank's local rows (shared, not copied) and whose per-row buffers (a
weight quantizer's scales and zero points, a BatchNorm's statistics) are cut to the same
rows. ``qc.convert`` then shards the converted graph the same way
(``qcompile.distributed.convert``), so no rank ever holds a whole weight.

What a rank cannot convert alone is refused (``refusal``): weights sharded on another
dim or over a 2-D mesh, learnable scales, weight quantizers still observing (their next
observation would need every row), weights quantized through a view (transposed
per-group weights, 3-D expert weights), block-format weights (NVFP4's tensor scale is the
whole weight's maximum, and a ``BlockWeight`` keeps its codes whole on every rank).

Duck-typed on purpose: this layer does not import ``torch.distributed``.

Example:
    >>> import torch
    >>> from qcompile.passes.convert.sharded import rows_of
    >>> rows_of(10, rank=3, world=4)  # torch.chunk's split, as FSDP2 shards
    (9, 10)
"""

from __future__ import annotations

import copy
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qcompile.passes.convert.common import torch_deprecations_silenced
from qcompile.runtime.calibration import weight_quantizer_sites
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.sharded import fsdp_units

__all__ = ["LocalRows", "data_parallel_whole_copy", "local_rows_copy", "refusal", "rows_of"]

_FSDP_KEYS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
          "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


def rows_of(total: int, *, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a ``total``-row tensor on ``rank`` under FSDP2."""
    chunk = math.ceil(total / world) if total else 0
    start = min(rank * chunk, total)
    return start, min(start + chunk, total)


def _is_fsdp(module: nn.Module) -> bool:
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


def _is_dtensor(p: Any) -> bool:
    return any(c.__name__ == "DTensor" for c in type(p).__mro__)


def _from_fsdp(hook: Any) -> bool:
    """A hook ``fully_shard`` registered (torch's tensor-parallel styles' hooks stay)."""
    owner = getattr(hook, "__self__", None)
    where = type(owner).__module__ if owner is not None else getattr(hook, "__module__", "")
    return str(where).startswith(("torch.distributed.fsdp", "torch.distributed._composable"))


@dataclass
class LocalRows:
    """A rank's plain copy of a sharded graph and what rebuilding the sharded result needs."""

    graph: nn.Module
    mesh: Any  # the DeviceMesh the weights are sharded over
    rank: int
    world: int
    units: list[str]  # the modules fully_shard grouped (root last)
    sharded: dict[str, tuple[int, ...]] = field(default_factory=dict)  # param -> global shape
    cut: dict[str, torch.Tensor] = field(default_factory=dict)  # buffer -> its whole value


def refusal(gm: nn.Module) -> str | None:
    """Why this rank cannot convert its rows of ``gm`` alone, or None."""
    mesh = None
    for name, p in gm.named_parameters():
        if not _is_dtensor(p):
            return f"parameter {name!r} is not sharded (a plain tensor in a sharded graph)"
        placements = tuple(p.placements)
        if (len(placements) != 1 or type(placements[0]).__name__ != "Shard"
                or placements[0].dim != 0):
            return (f"parameter {name!r} is laid out as {placements}, not FSDP2's rows "
                    "(Shard(0) on a 1-D mesh)")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            return "the parameters are sharded over more than one device mesh"
    for owner, path, fq, view in weight_quantizer_sites(gm):
        p = owner.get_parameter(path) if _has_param(owner, path) else None
        if p is None:
            continue
        if fq.block_format is not None:
            return (f"the quantizer of {path!r} is block-scaled ({fq.block_format}): "
                    "block-format weights are converted from the whole weight, not rank by "
                    "rank")
        if fq.learnable:
            return f"the quantizer of {path!r} has a learnable scale"
        if fq.observe:
            return (f"the quantizer of {path!r} still observes its weight (a QAT graph "
                    "not frozen): its last observation needs every row")
        if view and p.device_mesh.size() > 1:
            return (f"{path!r} is quantized through a view of it (a transposed [in, out] "
                    "weight, or the rows of a 3-D expert weight): its rows are not the "
                    "quantizer's rows")
    return None


def _has_param(owner: nn.Module, path: str) -> bool:
    parent, _, leaf = path.rpartition(".")
    try:
        module = owner.get_submodule(parent) if parent else owner
    except AttributeError:
        return False
    return leaf in module._parameters


def _plain(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A deep copy of one ``fully_shard``-ed module as its own class, without FSDP's state
    and hooks (FSDP refuses deepcopy); its children and parameters come from ``memo``."""
    base = next(c for c in type(module).__mro__ if c.__name__ != "FSDPModule"
                and not any(b.__name__ == "FSDPModule" for b in c.__mro__))
    clone = base.__new__(base)
    state = {k: v for k, v in module.__dict__.items()
             if k not in _FSDP_KEYS and not k.startswith("__composable_api_state_key")}
    for key in _HOOKS:
        if key in state:
            state[key] = OrderedDict((k, h) for k, h in state[key].items()
                                     if not _from_fsdp(h))
    clone.__dict__.update(state)
    # what refers back to the module (its graph's owner) finds the plain one
    memo[id(module)] = clone
    with torch_deprecations_silenced():  # an exported graph's pytree LeafSpec (see there)
        out = copy.deepcopy(clone, memo)
    # a hook registered with its module (a state-dict hook) holds a weak reference to it:
    # to the copy, not to ``clone``, which is gone once the copy is made
    for hooks in (getattr(out, key, {}) for key in _HOOKS):
        for hook in hooks.values():
            if getattr(hook, "with_module", False) and hook.module() is clone:
                hook.module = weakref.ref(out)
    return out


def data_parallel_whole_copy(gm: nn.Module) -> nn.Module:
    """A plain copy of ``gm`` sharded by FSDP2 over ``dp`` and by torch's tensor-parallel
    styles over ``tp`` (parameters on the 2-D mesh): FSDP2's classes, state and hooks left
    out, the styles' hooks kept, and each parameter its value gathered over ``dp`` (the
    tensor-parallel DTensor FSDP2's unshard gives, copied), one ``fully_shard`` unit at a
    time (collectives over dp: every rank calls it)."""
    memo: dict[int, Any] = {}
    units = fsdp_units(gm)
    for _, unit in units:  # innermost first
        before = dict(unit.named_parameters())
        unit.unshard()
        try:
            for pname, p in unit.named_parameters():
                held = before[pname]
                if p is not held and id(held) not in memo:  # this unit's: gathered now
                    memo[id(held)] = nn.Parameter(p.detach().clone(),
                                                  requires_grad=held.requires_grad)
        finally:
            unit.reshard()
    for _, module in units:
        memo[id(module)] = _plain(module, memo)
    if id(gm) not in memo:  # the root not sharded itself
        with torch_deprecations_silenced():
            return copy.deepcopy(gm, memo)
    return memo[id(gm)]


def local_rows_copy(gm: nn.Module) -> LocalRows:
    """This rank's rows of ``gm`` (``refusal(gm)`` is None) as a plain graph; see above."""
    memo: dict[int, Any] = {}
    sharded = {}
    mesh = None
    for name, p in gm.named_parameters():
        mesh = p.device_mesh
        sharded[name] = tuple(p.shape)
        memo[id(p)] = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
    assert mesh is not None, "a sharded graph has parameters"
    units = [n for n, m in gm.named_modules() if _is_fsdp(m)]
    for _, module in fsdp_units(gm):  # innermost first
        memo[id(module)] = _plain(module, memo)
    local = memo[id(gm)]
    world, rank = mesh.size(), mesh.get_local_rank()
    out = LocalRows(local, mesh, rank, world, [n for n in units if n] + [""], sharded)
    # per-row buffers: a weight quantizer's qparams, the statistics beside a sharded param
    for owner, path, fq, _ in weight_quantizer_sites(local):
        prefix = _prefix(local, owner)
        total = sharded.get(prefix + path, (0,))[0]
        if prefix + path not in sharded or (fq.axis != 0 and fq.group_size is None):
            continue
        fq_path = next(n for n, m in local.named_modules() if m is fq)
        for leaf in ("scale", "zero_point"):
            _cut(out, local, f"{fq_path}.{leaf}", total)
    for mod_name, module in local.named_modules():
        if isinstance(module, FakeQuantize):
            continue
        rows = {sharded[f"{mod_name}.{n}" if mod_name else n][0]
                for n, _ in module.named_parameters(recurse=False)
                if (f"{mod_name}.{n}" if mod_name else n) in sharded}
        for leaf, b in list(module._buffers.items()):
            if b is not None and b.dim() and b.shape[0] in rows:
                _cut(out, local, f"{mod_name}.{leaf}" if mod_name else leaf, b.shape[0])
    return out


def _prefix(root: nn.Module, owner: nn.Module) -> str:
    name = next(n for n, m in root.named_modules() if m is owner)
    return f"{name}." if name else ""


def _cut(out: LocalRows, local: nn.Module, path: str, total: int) -> None:
    """Replace the buffer at ``path`` by this rank's rows of it (remembering the whole)."""
    parent, _, leaf = path.rpartition(".")
    module = local.get_submodule(parent) if parent else local
    whole = module._buffers[leaf]
    if whole is None or path in out.cut or not whole.dim():
        return
    start, stop = rows_of(total, rank=out.rank, world=out.world)
    if whole.shape[0] == total:
        part = whole[start:stop]
    elif whole.numel() % total == 0:  # per-group qparams stored flat: rows x groups
        per = whole.numel() // total
        part = whole.reshape(-1)[start * per:stop * per]
    else:
        return
    out.cut[path] = whole
    module._buffers[leaf] = part.clone()
