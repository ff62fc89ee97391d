"""Fake-quantized weights recomputed in backward instead of kept by autograd.

In a QAT graph a weight reaches its layer as ``linear(x, weight_fake_quant(weight))``: the
layer's autograd node saves its weight input for the backward (``grad_x = grad @ W``),
and that input is the fake-quantized copy, a new weight-sized tensor per layer, alive
from the forward until the layer's backward. A float step saves the weight parameter
itself (no copy); under FSDP2 that parameter's unsharded storage is freed after the
layer's forward and gathered again before its backward, so at most a block or two are
whole at any time. Kept copies break both: a QAT step holds one more model per rank,
unsharded, whatever the world size.

So while a compiled graph runs its forward (``install(gm)``: a forward pre-hook and an
always-called forward hook push and pop ``torch.autograd.graph.saved_tensors_hooks``),
a tensor autograd saves that is (a view of) a weight quantizer's output is packed as a
``Recipe``: the weight itself (the parameter, what the float layer saves; under FSDP2 the
unsharded parameter, refilled before the backward like the float layer's), the qparams
as they were in that forward (a few floats, copied), and how to quantize. The backward
unpacks it by fake-quantizing the weight again: bit-identical (the same kernels on the
same values), so gradients equal those of a graph that kept the copy. Costs one more
fake-quant of each weight per step (memory-bound, next to the layer's matmuls).

The quantizer's own backward needs no copy either: the CPU kernels keep a 1-bit mask
(nothing when every element is inside the range, as for a min-max weight scale), LSQ
keeps the weight and scale it was given.

Other saved tensors go to the hooks that were active when the forward started (a user's
``save_on_cpu``, for instance), or are saved as autograd saves them. Nothing is packed
while tracing (torch.compile, export, fx) or where saved-tensor hooks are disabled; a
weight changed in place between the forward and the backward is an error, as autograd
reports for the float layer. ``FakeQuantize`` tags its output only while these hooks are
active, for a weight (an ``nn.Parameter`` or a view of one) that its cache
(``qcompile.runtime.weight_cache``) does not hold already: a cached copy costs nothing
more to save.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.runtime import recompute
    >>> gm = qc.qcompile(torch.nn.Sequential(torch.nn.Linear(8, 8)), "int8-qat",
    ...                  example_inputs=(torch.randn(2, 8),))
    >>> recompute.installed(gm)
    True
    >>> gm(torch.randn(2, 8, requires_grad=True)).sum().backward()
    >>> gm.get_submodule("0").weight.grad.shape
    torch.Size([8, 8])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Recipe", "active", "install", "installed", "tag", "uninstall", "user_hooks_active"]

# the attribute of a fake-quantized weight (a tensor) holding its Recipe
ATTR = "_qc_recipe"
# the attribute of the pack function marking it as ours
_MARK = "_qc_recompute"
# ... and saying whether it passes other tensors on to hooks it found
_OUTER = "_qc_recompute_outer"
# the attribute of a graph holding what its forward pre-hook pushed (one bool per call)
_PUSHED = "_qc_recompute_pushed"


class Recipe:
    """How to compute a fake-quantized weight again: ``fn(weight, *args)`` under no_grad,
    with the weight's version when it was quantized (checked on unpack)."""

    __slots__ = ("args", "fn", "version", "weight")

    def __init__(self, fn: Callable[..., torch.Tensor], weight: torch.Tensor,
                 args: tuple[Any, ...]) -> None:
        self.fn, self.weight, self.args = fn, weight, args
        self.version = weight._version

    def value(self) -> torch.Tensor:
        if self.weight._version != self.version:
            raise RuntimeError(
                "qcompile: a weight of this graph was modified in place between the forward "
                "and the backward (its fake-quantized value is recomputed from it in "
                "backward); call optimizer.step() and in-place weight updates after "
                "backward, or set train.recompute_weights: false in the spec")
        with torch.no_grad():
            return self.fn(self.weight, *self.args)


class _View:
    """A saved fake-quantized weight (or a view of one): its recipe, and the size, strides
    and offset of what was saved in the recipe's storage."""

    __slots__ = ("offset", "recipe", "size", "stride")

    def __init__(self, recipe: Recipe, t: torch.Tensor) -> None:
        self.recipe = recipe
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def value(self) -> torch.Tensor:
        return self.recipe.value().as_strided(self.size, self.stride, self.offset)


def user_hooks_active() -> bool:
    """Whether saved-tensor hooks other than ours are active (ours pass everything but
    weights on to the hooks they found: those count)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is None:
        return False
    return not getattr(top[0], _MARK, False) or getattr(top[0], _OUTER, False)


def active() -> bool:
    """Whether a compiled graph's forward is running with these hooks (innermost hooks
    ours): only then does tagging a weight's output save memory."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is not None and getattr(top[0], _MARK, False)


def tag(out: torch.Tensor, weight: torch.Tensor, fn: Callable[..., torch.Tensor],
        *args: Any) -> torch.Tensor:
    """Mark ``out`` (= ``fn(weight, *args)``, a new tensor or a view of one) as
    recomputable; returns ``out``. A saved tensor is recomputed as the same view of the
    same storage: ``fn`` must return a tensor laid out as ``out`` is."""
    owner = out if out._base is None else out._base
    owner.__dict__[ATTR] = Recipe(fn, weight, args)
    return out


def _hooks(outer: tuple[Callable, Callable] | None) -> tuple[Callable, Callable]:
    """Pack / unpack functions: recipes for tagged weights, ``outer``'s (the hooks active
    before ours) or autograd's own saving for everything else."""
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor) -> Any:
        recipe = _recipe(t)
        if recipe is not None:
            return _View(recipe, t)
        # a tensor-parallel shard: a tagged DTensor (or a view of one), recomputed as its
        # local values (the same storage, laid out as this view's)
        local = getattr(t, "_local_tensor", None) if type(t) is not torch.Tensor else None
        if local is not None:
            recipe = t.__dict__.get(ATTR)
            if recipe is None and t._base is not None:
                recipe = t._base.__dict__.get(ATTR)
            if recipe is None:  # the shard itself tagged (DTensor.from_local of it)
                recipe = _recipe(local)
            if recipe is not None:
                return _Shard(_View(recipe, local), t)
        return (_Outer, outer_pack(t)) if outer_pack is not None else t

    def unpack(packed: Any) -> torch.Tensor:
        if type(packed) in (_View, _Shard):
            return packed.value()
        if type(packed) is tuple and len(packed) == 2 and packed[0] is _Outer:
            return outer_unpack(packed[1])
        return packed

    setattr(pack, _MARK, True)
    setattr(pack, _OUTER, outer is not None)
    return pack, unpack


def _recipe(t: torch.Tensor) -> Recipe | None:
    """The recipe tagged on ``t`` or on the tensor it is a view of: the tag sits on the
    quantizer's output (a per-group output is reshaped back), ``t`` may be a view of it."""
    recipe = t.__dict__.get(ATTR) if type(t) is torch.Tensor else None
    if recipe is None:
        base = t._base
        if base is not None and type(base) is torch.Tensor:
            recipe = base.__dict__.get(ATTR)
    return recipe


class _Shard:
    """A saved DTensor whose local values are a tagged weight shard: the shard's recipe
    and the DTensor's layout (mesh, placements, whole shape and strides)."""

    __slots__ = ("kind", "mesh", "placements", "shape", "stride", "view")

    def __init__(self, view: _View, t: Any) -> None:
        self.view, self.mesh, self.placements = view, t.device_mesh, t.placements
        self.shape, self.stride = t.shape, t.stride()
        self.kind = type(t)  # DTensor: this layer never imports torch.distributed itself

    def value(self) -> torch.Tensor:
        return self.kind.from_local(self.view.value(), self.mesh, self.placements,
                                    run_check=False, shape=self.shape, stride=self.stride)


class _Outer:
    """Marks a value packed by the hooks that were active before ours."""


def _enabled() -> bool:
    return (torch._C._autograd._saved_tensors_hooks_is_enabled()
            and not torch.fx._symbolic_trace.is_fx_symbolic_tracing())


def _push(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: push the hooks (when grad is on and hooks may be used)."""
    if torch.compiler.is_compiling():  # first: nothing below is traced (see _pop)
        return
    pushed = module.__dict__.setdefault(_PUSHED, [])
    do = torch.is_grad_enabled() and _enabled() and not active()
    if do:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        torch._C._autograd._push_saved_tensors_default_hooks(*_hooks(outer))
    pushed.append(do)


def _pop(module: nn.Module, args: Any, out: Any) -> None:
    """Forward hook (always called, also when the forward raised): pop what ``_push``
    pushed for this call."""
    if torch.compiler.is_compiling():
        return
    pushed = module.__dict__.get(_PUSHED)
    if pushed and pushed.pop():
        torch._C._autograd._pop_saved_tensors_default_hooks()


def install(gm: nn.Module) -> nn.Module:
    """Run ``gm``'s forwards with the weight-recomputing hooks (idempotent); returns ``gm``.
    The hooks are module-level functions: the graph still pickles."""
    if not installed(gm):
        gm.register_forward_pre_hook(_push)
        gm.register_forward_hook(_pop, always_call=True)
    # a GraphModule's deep copy keeps no forward hooks: torch.fx's (private) deepcopy
    # hook list installs them on the copy
    hooks = getattr(gm, "_deepcopy_hooks", None)
    if isinstance(hooks, list) and install not in hooks:
        hooks.append(install)
    return gm


def installed(gm: nn.Module) -> bool:
    return _push in gm._forward_pre_hooks.values()


def uninstall(gm: nn.Module) -> nn.Module:
    """Remove the hooks ``install`` added (fake-quantized weights are then kept)."""
    hooks = getattr(gm, "_deepcopy_hooks", None)
    if isinstance(hooks, list) and install in hooks:
        hooks.remove(install)
    for table in (gm._forward_pre_hooks, gm._forward_hooks):
        for key in [k for k, fn in table.items() if fn in (_push, _pop)]:
            del table[key]
            gm._forward_hooks_always_called.pop(key, None)
    return gm
