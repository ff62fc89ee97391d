"""Copies of the user's model: the one the graph is traced from, and a meta one.

Passes never mutate the user's model, so tracing works on ``copy_model(model)``: the same
result as ``copy.deepcopy`` at a fraction of its Python cost on models of many modules.
Shape propagation runs modules on meta copies (``MetaCopy``, ``meta_copy(root)``): the same
module tree whose tensors are meta tensors (shape, dtype and strides, no data), so a
forward run on it can change nothing of the model, its graph or the RNG.

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


class MetaCopy:
    """Meta stand-ins, made on demand: ``module(m)`` is a copy of ``m``'s module tree whose
    parameters, buffers and tensor attributes are meta tensors with the same shapes,
    dtypes and strides, every module in eval mode (as the real run would be); ``value(v)``
    converts one attribute value, ``convert(v)`` the tensors in a pytree (the inputs).

    Modules are new objects with their own attribute dicts, so whatever a forward assigns
    or updates lands on the copy: the model and the traced graph are never touched. One
    instance remembers what it converted, so tied tensors and shared modules stay tied
    and shared however many calls reach them; shape propagation converts only the
    modules it runs (most calls it answers from metadata alone)."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.modules: dict[int, nn.Module] = {}
        self.keep: list[Any] = []  # the originals, so no id above is reused meanwhile

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        out = self.tensors.get(id(t))
        if out is None:
            if type(t) not in PLAIN_TENSORS or t.layout != torch.strided or t.is_quantized:
                raise _NotMeta(f"a {type(t).__name__} ({t.layout}) has no meta stand-in")
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, nn.Parameter):
                out = nn.Parameter(out, requires_grad=t.requires_grad)
            elif t.requires_grad:
                out.requires_grad_()
            self.tensors[id(t)] = out
            self.keep.append(t)
        return out

    def value(self, v: Any) -> Any:
        t = type(v)
        if t in SCALAR_TYPES:
            return v
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if t in (tuple, list) and any(isinstance(x, torch.Tensor) for x in v):
            return t(self.value(x) for x in v)
        if t in _CONTAINERS:
            return t(v)  # hook tables and the like: a forward may add to them
        if isinstance(v, (dict, list, set)):
            return copy.copy(v)
        return v

    def module(self, m: nn.Module) -> nn.Module:
        out = self.modules.get(id(m))
        if out is None:
            out = self.modules[id(m)] = object.__new__(type(m))
            self.keep.append(m)
            value, tensor = self.value, self.tensor
            d = {k: value(v) for k, v in m.__dict__.items()  # (torch.compile's call: eager)
                 if k not in ("_parameters", "_buffers", "_modules", "_compiled_call_impl")}
            d["_parameters"] = {k: None if v is None else tensor(v)
                                for k, v in m._parameters.items()}
            d["_buffers"] = {k: None if v is None else tensor(v) for k, v in m._buffers.items()}
            d["_modules"] = {k: None if v is None else self.module(v)
                             for k, v in m._modules.items()}
            d["training"] = False
            object.__setattr__(out, "__dict__", d)
        return out

    def convert(self, v: Any) -> Any:
        return pytree.tree_map(lambda x: self.tensor(x) if isinstance(x, torch.Tensor) else x,
                               v)


def meta_copy(root: nn.Module) -> tuple[nn.Module, Callable[[Any], Any]]:
    """The meta copy of ``root``'s whole module tree (``MetaCopy.module``) plus the
    function converting values (the inputs) the same way."""
    c = MetaCopy()
    return c.module(root), c.convert


# What copy.deepcopy returns as is (immutable): such attributes are shared, like deepcopy does.
_ATOMIC = frozenset({type(None), int, float, bool, complex, bytes, str, type, range,
                     types.BuiltinFunctionType, types.FunctionType, type(Ellipsis), torch.dtype,
                     torch.memory_format, torch.layout})


def _plain_module_class(cls: type) -> bool:
    """Whether ``copy.deepcopy`` copies instances of ``cls`` by the pickle protocol's
    default recipe, ``cls.__new__(cls)`` then ``__setstate__(deep copy of __getstate__())``
    (no class-specific ``__deepcopy__`` / ``__reduce__`` / ``__getnewargs__``, no
    ``__slots__``). The class's own ``__getstate__`` / ``__setstate__`` (Conv's fills in
    ``padding_mode``) are part of that recipe, so ``copy_model`` calls them as deepcopy
    does."""
    return (getattr(cls, "__deepcopy__", None) is None
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__getnewargs_ex__", None) is None
            and getattr(cls, "__getnewargs__", None) is None
            and cls not in copyreg.dispatch_table
            and not any("__slots__" in vars(c) for c in cls.__mro__))


def _copy_on_write_clone() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch's copy-on-write clone (``torch._lazy_clone``, in torch since 2.3), if this
    build has one whose writes stay on their side, both ways (checked once, on two
    elements: a build whose lazy clone were only simulated, a view, would fail it)."""
    lazy = getattr(torch, "_lazy_clone", None)
    if lazy is None:
        return None
    try:  # on the CPU whatever the default device (an import under torch.device("meta"))
        a = torch.zeros(2, dtype=torch.float32, device="cpu")
        b = lazy(a)
        b.add_(1)
        c = lazy(a)
        a.sub_(1)
        ok = a.tolist() == [-1.0, -1.0] and b.tolist() == [1.0, 1.0] and c.tolist() == [0.0, 0.0]
    except Exception:  # any failure: plain copies
        return None
    return lazy if ok else None


# The clone itself, or None: then clone_data always copies. (A fact of the torch build.)
_LAZY_CLONE = _copy_on_write_clone()


def _lazy_ok(t: torch.Tensor) -> bool:
    """Whether ``clone_data`` may give ``t`` a copy-on-write clone (see there)."""
    if (_LAZY_CLONE is None or type(t) is not torch.Tensor or t.layout != torch.strided
            or t.device.type != "cpu" or t.is_quantized or t.is_inference()
            or t.storage_offset() != 0):
        return False
    storage = t.untyped_storage()
    return storage.nbytes() == t.numel() * t.element_size() and not storage.is_shared()


def clone_data(t: torch.Tensor) -> torch.Tensor:
    """``t.clone(memory_format=torch.preserve_format)`` for a parameter's or buffer's data:
    where it is safe, a copy-on-write clone (``torch._lazy_clone``), which shares ``t``'s
    memory until either tensor is written through torch, and then copies it (once, for the
    side that writes).

    A compiled copy then costs no time and no memory until training writes its weights
    (post-training flows never do), and the user's model is still never changed by what
    the compiled copy does, nor the copy by what the model does. Copied eagerly instead:
    a tensor that is not all of its storage (a view into a flat buffer: the first write
    would copy the whole buffer), storage in shared memory (other processes write it
    behind torch's back) or on a GPU (CUDA graphs and IPC handles do too), subclasses,
    sparse and quantized tensors, and memory torch does not own (``torch.from_numpy``, a
    ``torch.load(mmap=True)`` file), which torch cannot clone lazily. Memory written
    through an alias made before the copy (a NumPy view of the parameter, a raw pointer)
    is not seen by torch either: compile ``copy.deepcopy(model)`` with ``inplace=True``
    in that case.

    Example:
        >>> import torch
        >>> w = torch.ones(3)
        >>> c = clone_data(w)
        >>> _ = c.add_(1)
        >>> w.tolist(), c.tolist()
        ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    """
    if _LAZY_CLONE is not None and _lazy_ok(t):
        try:
            return _LAZY_CLONE(t)
        except RuntimeError:  # memory torch does not own (NumPy, a memory map): copy it
            pass
    return t.clone(memory_format=torch.preserve_format)


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, the same result at a fraction of the Python cost on models
    of many modules: it follows deepcopy's own recipe for modules (``cls.__new__``, the
    state from ``__getstate__``, ``__setstate__``) without copying what deepcopy would
    return unchanged (numbers, strings, tuples of them, functions) or rebuilding empty hook
    tables item by item, and copies a plain ``nn.Parameter`` as its ``__deepcopy__`` does
    (a clone of its data, copy-on-write where safe: ``clone_data``) without going through
    ``copy.deepcopy``'s dispatch; so is a plain buffer that is all of its storage (as
    ``Tensor.__deepcopy__`` copies it, its storage entered in the memo as deepcopy enters
    it, so other tensors on that storage still share the copy's). Other buffers and
    tensors, non-empty containers, other objects and modules with their own copy protocol
    go through ``copy.deepcopy`` with the shared memo, so ties and shared objects stay tied
    and shared."""
    memo: dict[int, Any] = {}
    plain: dict[type, bool] = {}

    def parameters(table: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, p in table.items():
            if id(p) in memo:
                out[name] = memo[id(p)]
            elif type(p) is nn.Parameter:  # exactly: subclasses may copy more
                # nn.Parameter.__deepcopy__, minus copy.deepcopy's dispatch per parameter
                new = memo[id(p)] = nn.Parameter(clone_data(p.data), p.requires_grad)
                memo.setdefault(id(memo), []).append(p)  # deepcopy's keep-alive
                out[name] = new
            else:
                out[name] = copy.deepcopy(p, memo)
        return out

    def buffers(table: dict[str, Any]) -> dict[str, Any]:
        storages = memo.setdefault("torch", {})  # type: ignore[call-overload]
        out = {}
        for name, b in table.items():
            if id(b) in memo:
                out[name] = memo[id(b)]
            elif (type(b) is torch.Tensor and b.is_leaf and not b.requires_grad
                  and not b.__dict__ and _lazy_ok(b)
                  and b.untyped_storage()._cdata not in storages):
                # Tensor.__deepcopy__ of a tensor that is all of its storage: a copy of
                # the storage, entered where UntypedStorage.__deepcopy__ enters it (a
                # later tensor on that storage shares the copy's, as deepcopy would do)
                new = memo[id(b)] = clone_data(b)
                storages[b.untyped_storage()._cdata] = new.untyped_storage()
                memo.setdefault(id(memo), []).append(b)
                out[name] = new
            else:
                out[name] = copy.deepcopy(b, memo)
        return out

    def module(m: nn.Module) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        cls = type(m)
        if cls not in plain:
            plain[cls] = _plain_module_class(cls)
        got = m.__getstate__() if plain[cls] else None
        if type(got) is not dict:
            return copy.deepcopy(m, memo)
        new = memo[id(m)] = cls.__new__(cls)
        state: dict[str, Any] = {}
        for k, v in got.items():
            t = type(v)
            if t in _ATOMIC or (t is tuple and all(type(e) in _ATOMIC for e in v)):
                state[k] = v
            elif k == "_modules" and t is dict:
                state[k] = {n: None if c is None else module(c) for n, c in v.items()}
            elif k == "_parameters" and t is dict:
                state[k] = parameters(v)
            elif k == "_buffers" and t is dict:
                state[k] = buffers(v)
            elif t in _CONTAINERS and not v:  # shared empty containers stay shared
                if id(v) not in memo:
                    memo[id(v)] = t()
                state[k] = memo[id(v)]
            else:
                state[k] = copy.deepcopy(v, memo)
        new.__setstate__(state)
        return new

    return module(model)
