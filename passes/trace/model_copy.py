"""Copies of the user's model: the one the graph is traced from, and a meta one.

Passes never mutate the user's model, so tracing works on ``copy_model(model)``: the same
result as ``copy.deepcopy`` at a fraction of its Python cost on models of many modules.
Shape propagation runs on ``meta_copy(root)``: the same module tree whose tensors are meta
tensors (shape, dtype and strides, no data), so a forward run on it can change nothing of
the model, its graph or the RNG.

Example:
    >>> import torch
    >>> from qcompile.passes.trace.model_copy import copy_model, meta_copy
    >>> m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    >>> c = copy_model(m)
    >>> c[0].weight is m[0].weight, torch.equal(c[0].weight, m[0].weight)
    (False, True)
    >>> root, convert = meta_copy(m)
    >>> root[0].weight.device, root[1].training, m[1].training
    (device(type='meta'), False, True)
    >>> root(convert(torch.randn(4, 3))).shape
    torch.Size([4, 2])
"""

from __future__ import annotations

import collections
import copy
import copyreg
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

# Tensors the meta copy (and shape propagation's call memo) can describe by metadata alone;
# subclasses may carry more than their metadata.
PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
# Values whose type and value are all there is to them: shared by the meta copy, and keyed
# on by value in shape propagation's call memo.
SCALAR_TYPES = frozenset({int, float, bool, str, type(None), type(Ellipsis), torch.dtype,
                          torch.device, torch.memory_format, torch.layout})
_CONTAINERS = frozenset({dict, list, set, collections.OrderedDict})


class _NotMeta(Exception):
    """A tensor the meta copy cannot stand in for (a subclass, sparse, quantized)."""


def meta_copy(root: nn.Module) -> tuple[nn.Module, Callable[[Any], Any]]:
    """A copy of the module tree whose parameters, buffers and tensor attributes are meta
    tensors with the same shapes, dtypes and strides, every module in eval mode (as the
    real run would be), plus the function converting values (the inputs) the same way.

    Modules are new objects with their own attribute dicts, so whatever a forward assigns
    or updates lands on the copy: the model and the traced graph are never touched. Tied
    tensors and shared modules stay tied and shared."""
    tensors: dict[int, torch.Tensor] = {}
    modules: dict[int, nn.Module] = {}

    def tensor(t: torch.Tensor) -> torch.Tensor:
        out = tensors.get(id(t))
        if out is None:
            if type(t) not in PLAIN_TENSORS or t.layout != torch.strided or t.is_quantized:
                raise _NotMeta(f"a {type(t).__name__} ({t.layout}) has no meta stand-in")
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, nn.Parameter):
                out = nn.Parameter(out, requires_grad=t.requires_grad)
            elif t.requires_grad:
                out.requires_grad_()
            tensors[id(t)] = out
        return out

    def value(v: Any) -> Any:
        t = type(v)
        if t in SCALAR_TYPES:
            return v
        if isinstance(v, torch.Tensor):
            return tensor(v)
        if t in (tuple, list) and any(isinstance(x, torch.Tensor) for x in v):
            return t(value(x) for x in v)
        if t in _CONTAINERS:
            return t(v)  # hook tables and the like: a forward may add to them
        if isinstance(v, (dict, list, set)):
            return copy.copy(v)
        return v

    def module(m: nn.Module) -> nn.Module:
        out = modules.get(id(m))
        if out is None:
            out = modules[id(m)] = object.__new__(type(m))
            d = {k: value(v) for k, v in m.__dict__.items()  # (torch.compile's call: eager)
                 if k not in ("_parameters", "_buffers", "_modules", "_compiled_call_impl")}
            d["_parameters"] = {k: None if v is None else tensor(v)
                                for k, v in m._parameters.items()}
            d["_buffers"] = {k: None if v is None else tensor(v) for k, v in m._buffers.items()}
            d["_modules"] = {k: None if v is None else module(v) for k, v in m._modules.items()}
            d["training"] = False
            object.__setattr__(out, "__dict__", d)
        return out

    def convert(v: Any) -> Any:
        return pytree.tree_map(lambda x: tensor(x) if isinstance(x, torch.Tensor) else x, v)

    return module(root), convert



# What copy.deepcopy returns as is (immutable): such attributes are shared, like deepcopy does.
_ATOMIC = frozenset({type(None), int, float, bool, complex, bytes, str, type, range,
                     types.BuiltinFunctionType, types.FunctionType, type(Ellipsis), torch.dtype,
                     torch.memory_format, torch.layout})


def _plain_module_class(cls: type) -> bool:
    """Whether ``copy.deepcopy`` copies instances of ``cls`` by nn.Module's own
    ``__getstate__`` / ``__setstate__`` (no class-specific copy or pickle protocol)."""
    return (getattr(cls, "__deepcopy__", None) is None
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and cls.__getstate__ is nn.Module.__getstate__
            and cls.__setstate__ is nn.Module.__setstate__
            and cls not in copyreg.dispatch_table
            and not any("__slots__" in vars(c) for c in cls.__mro__))


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, the same result at a fraction of the Python cost on models
    of many modules: it follows deepcopy's own recipe for modules (``cls.__new__``, the
    state from ``__getstate__``, ``__setstate__``) without copying what deepcopy would
    return unchanged (numbers, strings, tuples of them, functions) or rebuilding empty hook
    tables item by item. Tensors, parameters, non-empty containers, other objects and
    modules with their own copy protocol go through ``copy.deepcopy`` with the shared memo,
    so ties and shared objects stay tied and shared."""
    memo: dict[int, Any] = {}
    plain: dict[type, bool] = {}

    def module(m: nn.Module) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        cls = type(m)
        if cls not in plain:
            plain[cls] = _plain_module_class(cls)
        if not plain[cls]:
            return copy.deepcopy(m, memo)
        new = memo[id(m)] = cls.__new__(cls)
        state: dict[str, Any] = {}
        for k, v in m.__getstate__().items():
            t = type(v)
            if t in _ATOMIC or (t is tuple and all(type(e) in _ATOMIC for e in v)):
                state[k] = v
            elif k == "_modules" and t is dict:
                state[k] = {n: None if c is None else module(c) for n, c in v.items()}
            elif t in _CONTAINERS and not v:  # shared empty containers stay shared
                if id(v) not in memo:
                    memo[id(v)] = t()
                state[k] = memo[id(v)]
            else:
                state[k] = copy.deepcopy(v, memo)
        new.__setstate__(state)
        return new

    return module(model)
