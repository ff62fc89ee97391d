"""``trace``: capture the model as a ``torch.fx.GraphModule`` and record tensor shapes.

Two front ends, chosen by ``trace.method``: ``symbolic`` (torch.fx symbolic tracing, with
leaf modules and concrete arguments from ``spec.trace``), ``export`` (torch.export, see
``qcompile.passes.trace.capture_export``; needs example inputs), and ``auto`` (symbolic
first, export
when symbolic tracing fails; the Report notes why). Both work on a copy: the user's
model is never touched. On symbolic graphs with example inputs (the argument, or
``spec.trace.inputs``), ``node.meta[TENSOR_META]`` (torch.fx ``TensorMetadata``) comes
from running the graph on meta tensors: shapes and dtypes without running a kernel,
on a meta copy of the modules (so BatchNorm statistics, the RNG and every module's state
are left as they were). A graph meta tensors cannot run (data-dependent ops such as
``.item()`` or ``nonzero``, Python branching on values in a leaf module) runs on the
example inputs instead, in eval mode under ``no_grad``, and ``Report.shapes`` says why.
Export graphs take their shapes from export's own fake values.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.graph.context import Context
    >>> from qcompile.passes.trace import trace
    >>> ctx = Context(spec=qc.CompileSpec(), model=torch.nn.Sequential(torch.nn.Linear(3, 2)),
    ...               example_inputs=(torch.randn(1, 3),))
    >>> gm = trace(None, ctx)
    >>> [n.meta["tensor_meta"].shape for n in gm.graph.nodes if n.op == "call_module"]
    [torch.Size([1, 2])]
"""

from __future__ import annotations

import collections
import copy
import copyreg
import fnmatch
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx import GraphModule, Interpreter, Node, Tracer
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import TensorMetadata, _extract_tensor_metadata

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.meta import ROOT_CLASS_KEY, TENSOR_META, TYPE
from qcompile.graph.pipeline import graph_pass, mark_compiled
from qcompile.graph.state_layout import keep_state_layout
from qcompile.passes.trace.capture_export import export_graph


class _Tracer(Tracer):
    """symbolic tracing with spec-given leaf modules; remembers which module it was in
    when tracing fails, so the error can name it."""

    def __init__(self, leaf_patterns: list[str]) -> None:
        super().__init__()
        self.leaf_patterns = leaf_patterns
        self.used_patterns: set[str] = set()
        self.path: list[tuple[str, str]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if not self.leaf_patterns:
            return super().is_leaf_module(m, module_qualified_name)
        cls = type(m)
        names = (cls.__name__, f"{cls.__module__}.{cls.__qualname__}", module_qualified_name)
        hits = [p for p in self.leaf_patterns if any(fnmatch.fnmatchcase(v, p) for v in names)]
        if hits:
            self.used_patterns.update(hits)
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):  # type: ignore[override]
        self.path.append((self.path_of_module(m), type(m).__name__))
        out = super().call_module(m, forward, args, kwargs)
        self.path.pop()  # left in place when tracing raises: the innermost module failed
        return out


class _TraceFailure(QCompileError):
    """Symbolic tracing could not capture the model (``auto`` then tries torch.export)."""


# -- shape propagation ----------------------------------------------------------------------
# Shapes come from running the graph on *meta* tensors (shape, dtype and strides, no data):
# no kernel runs, so it costs the same for a batch of 1 or 1,000, leaves the RNG, BatchNorm
# statistics and every module's state alone, and needs no device memory. (torch's
# FakeTensorMode does the same through a dispatch mode: 2.5-6x slower on the bench models.)
# A graph that cannot run on meta tensors (data-dependent ops: ``.item()``, ``nonzero``,
# Python branching on a value in a leaf module; ops without a meta kernel; tensors the copy
# could not convert), or a call mixing floating-point dtypes (meta kernels accept what real
# ones reject), is run on the example inputs instead, and ``Report.shapes`` says why.
# Shapes and dtypes are the real ones; strides follow the meta kernels, which can lay
# some outputs out differently (a conv on a channels_last input): nothing here reads them.
_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
_PLAIN = (torch.Tensor, nn.Parameter)
# nn.Module's own bookkeeping (hooks, parameter and buffer dicts), not a module's config
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_INPLACE_OPERATORS = frozenset({
    "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "ior",
    "ipow", "irshift", "isub", "itruediv", "ixor", "setitem", "delitem", "__setitem__",
    "__delitem__"})
_CONTAINERS = frozenset({dict, list, set, collections.OrderedDict})
_SCALARS = frozenset({int, float, bool, str, type(None), type(Ellipsis), torch.dtype,
                      torch.device, torch.memory_format, torch.layout})


def _tensor_metadata(t: torch.Tensor) -> TensorMetadata:
    """torch.fx's ``_extract_tensor_metadata``, with the memory-format queries answered by
    the tensor itself (in C++) for plain strided tensors: the same fields, without torch's
    per-query Python, which costs more than running most nodes on meta tensors."""
    if type(t) not in _PLAIN or t.layout != torch.strided or t.is_quantized:
        return _extract_tensor_metadata(t)
    fmt = next((f for f in _FORMATS if t.is_contiguous(memory_format=f)), None)
    return TensorMetadata(t.shape, t.dtype, t.requires_grad, t.stride(), fmt, False, {})


def _record(n: Node, result: Any) -> None:
    """``node.meta["tensor_meta"]`` (when the value holds tensors) and ``["type"]``."""
    if isinstance(result, torch.Tensor):
        n.meta[TENSOR_META] = _tensor_metadata(result)
    elif isinstance(result, (tuple, list, dict)):
        found = []

        def extract(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                found.append(True)
                return _tensor_metadata(obj)
            return obj

        meta = map_aggregate(result, extract)
        if found:
            n.meta[TENSOR_META] = meta
    n.meta[TYPE] = type(result)


class _ShapeProp(Interpreter):
    """Runs the graph node by node recording shapes; remembers the node running, so errors
    can name it (torch's ShapeProp prints a traceback to stderr before raising)."""

    current: Node | None = None

    def run_node(self, n: Node) -> Any:
        self.current = n
        result = super().run_node(n)
        _record(n, result)
        return result


class _Unkeyable(Exception):
    """A value the call memo cannot key on (the call simply runs)."""


def _key(a: Any) -> Any:
    """A hashable description of a call argument: tensors by metadata, other values by type
    and value (``1``, ``1.0`` and ``True`` promote differently)."""
    t = type(a)
    if t in _PLAIN:
        return ("T", tuple(a.shape), a.stride(), a.dtype, a.requires_grad)
    if t in _SCALARS:
        return (t, a)
    if isinstance(a, (tuple, list)):  # fx passes lists as immutable_list, torch.Size...
        return (t, tuple(_key(x) for x in a))
    if isinstance(a, dict):  # ... and kwargs as immutable_dict
        return (t, tuple((k, _key(v)) for k, v in a.items()))
    if t is slice:
        return (t, _key(a.start), _key(a.stop), _key(a.step))
    raise _Unkeyable


def _module_key(m: nn.Module) -> Any:
    """What a stock ``torch.nn`` module's output metadata can depend on: its class, its
    config attributes, its parameters' and buffers' metadata. None (never reused) for
    modules whose forward may depend on anything else: user classes, containers, hooks."""
    if (not type(m).__module__.startswith("torch.nn.") or m._modules or "forward" in m.__dict__
            or m._forward_hooks or m._forward_pre_hooks):
        return None
    items = []
    try:
        for k, v in m.__dict__.items():
            if k in ("_parameters", "_buffers"):
                items.append((k, tuple((name, _key(t)) for name, t in v.items())))
            elif k not in _MODULE_INTERNALS:
                items.append((k, _key(v)))
    except _Unkeyable:
        return None
    return ("module", type(m), tuple(items))


def _function_key(target: Any) -> Any:
    """torch functions and operators that do not write their inputs; None otherwise (user
    functions kept as calls may do anything)."""
    name = getattr(target, "__name__", "") or ""
    module = getattr(target, "__module__", None) or ""
    if (name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
            or not (module == "_operator" or module == "torch" or module.startswith("torch."))
            or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))):
        return None
    return ("function", target)


def _template(result: Any) -> Any:
    """The metadata of a call's output when it is a tensor or a plain tuple/list of them."""
    if type(result) is torch.Tensor:
        if result.layout != torch.strided:
            return None
        return ("T", tuple(result.shape), result.stride(), result.dtype, result.requires_grad)
    if type(result) in (tuple, list):
        parts = [_template(x) for x in result]
        return None if any(p is None for p in parts) else (type(result), parts)
    return None


def _rebuild(template: Any) -> Any:
    if template[0] == "T":
        _, shape, stride, dtype, requires_grad = template
        out = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return out.requires_grad_() if requires_grad else out
    cls, parts = template
    return cls(_rebuild(p) for p in parts)


_ELEMENTWISE = frozenset({nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh,
                          nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.Mish})
_BN_DIMS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}


def _same_dtype(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == x.dtype for t in tensors)


def _stock_output(m: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The meta output of the commonest stock modules (exact class, eval mode) on a
    contiguous floating-point input, without torch's meta kernels, which for these are
    Python decompositions costing up to ~2 ms a call (BatchNorm, LayerNorm, GELU, Linear):
    shape and dtype by the module's definition, contiguous as the CPU kernels make them.
    None (run the module) for anything else, including inputs these modules would reject."""
    if kwargs or len(args) != 1 or getattr(m, "inplace", False):
        return None
    x = args[0]
    if type(x) is not torch.Tensor or not x.is_floating_point() or not x.is_contiguous():
        return None
    cls = type(m)
    if cls in _ELEMENTWISE:
        same = True
    elif cls in _BN_DIMS:
        same = (x.dim() in _BN_DIMS[cls] and x.shape[1] == m.num_features
                and _same_dtype(x, m.weight, m.bias, m.running_mean, m.running_var))
    elif cls is nn.LayerNorm:
        ns = tuple(m.normalized_shape)
        same = (x.dim() >= len(ns) and tuple(x.shape[x.dim() - len(ns):]) == ns
                and _same_dtype(x, m.weight, m.bias))
    elif (cls is nn.Linear and x.dim() >= 1 and x.shape[-1] == m.in_features
          and _same_dtype(x, m.weight, m.bias)):
        return x.new_empty((*x.shape[:-1], m.out_features))
    else:
        same = False
    return torch.empty_like(x) if same else None


class _MixedDtypes(Exception):
    """Floating-point inputs of different dtypes: CPU and CUDA kernels reject many such
    calls (``linear`` on float64 input and float32 weight) that meta kernels accept."""


def _check_dtypes(args: tuple, kwargs: dict, module: nn.Module | None) -> None:
    """Raise ``_MixedDtypes`` when a call mixes floating-point dtypes among its tensor
    inputs (and, for a module, its parameters); 0-dim tensors promote like scalars."""
    dtypes = set()
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):  # torch.cat([...]) and the like
            if isinstance(t, torch.Tensor) and t.dim() and t.is_floating_point():
                dtypes.add(t.dtype)
    if module is not None:
        dtypes.update(p.dtype for p in module.parameters() if p.is_floating_point())
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise _MixedDtypes(f"mixes floating-point dtypes ({names}): real kernels may reject "
                           "that where meta kernels do not")


class _UserLeaf(Exception):
    """A user's leaf module: its forward runs for real (``_real_shapes``)."""


def _mutates(n: Node) -> bool:
    """An in-place call: ``x.add_(...)``, ``x += y``, ``x[i] = v``."""
    if n.op == "call_method":
        name = str(n.target)
    elif n.op == "call_function":
        name = getattr(n.target, "__name__", "")
    else:
        return False
    return name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))


class _MetaShapeProp(_ShapeProp):
    """Runs the graph on meta tensors against a meta copy of the modules (``_meta_copy``).

    Real models repeat themselves (the blocks of a transformer, the layers of a ResNet
    stage) and torch's meta kernels are Python: a call whose op (a torch function or
    operator, a tensor method, a stock ``torch.nn`` module with the same config) and input
    metadata were seen before gets fresh meta outputs with the metadata recorded then.
    In-place calls and anything the key cannot describe always run."""

    def __init__(self, gm: GraphModule, root: nn.Module) -> None:
        super().__init__(root, graph=gm.graph)
        self.memo: dict[Any, Any] = {}
        self.module_keys: dict[str, Any] = {}
        # A memo hit returns a fresh tensor where the op may return its input (contiguous,
        # .to(same dtype)): an in-place shape change through that alias would be lost, so
        # a graph with any in-place call runs every call.
        self.memo_on = not any(_mutates(n) for n in gm.graph.nodes)
        hooks = torch.nn.modules.module
        self.memo_modules = not (hooks._global_forward_hooks
                                 or hooks._global_forward_pre_hooks)

    def _op_key(self, n: Node) -> Any:
        if n.op == "call_module":
            target = str(n.target)
            if target not in self.module_keys:
                self.module_keys[target] = (_module_key(self.fetch_attr(target))
                                            if self.memo_modules else None)
            return self.module_keys[target]
        if n.op == "call_method":
            name = str(n.target)
            mutates = name in _INPLACE_OPERATORS or (name.endswith("_")
                                                     and not name.endswith("__"))
            return None if mutates else ("method", name)
        return _function_key(n.target)

    def run_node(self, n: Node) -> Any:
        if n.op not in ("call_module", "call_function", "call_method"):
            return super().run_node(n)
        self.current = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        # out=: writes a tensor
        key = self._op_key(n) if self.memo_on and "out" not in kwargs else None
        if key is not None:
            try:
                key = (key, _key(args), _key(kwargs))
            except _Unkeyable:
                key = None
        seen = self.memo.get(key) if key is not None else None
        if seen is not None:  # (a call with mixed dtypes never got into the memo)
            _record(n, result := _rebuild(seen))
            return result
        module = self.fetch_attr(str(n.target)) if n.op == "call_module" else None
        if module is not None and not type(module).__module__.startswith("torch."):
            # a leaf module of the user's: its body is not in the graph, so nothing here
            # can check what it does with dtypes that meta kernels would accept
            raise _UserLeaf(f"is a leaf module with its own forward ({type(module).__name__})")
        _check_dtypes(args, kwargs, module)
        stock = _stock_output(module, args, kwargs) if module is not None and key else None
        if stock is not None:
            result = stock
            self.memo[key] = _template(result)
        else:
            # factory calls without a device (torch.zeros(n)) make meta tensors too; only
            # around the call: the mode taxes every tensor method (the keys, the records)
            with torch.device("meta"):
                result = getattr(self, n.op)(n.target, args, kwargs)
            if key is not None and (template := _template(result)) is not None:
                self.memo[key] = template
        _record(n, result)
        return result


class _NotMeta(Exception):
    """A tensor the meta copy cannot stand in for (a subclass, sparse, quantized)."""


def _meta_copy(root: nn.Module) -> tuple[nn.Module, Callable[[Any], Any]]:
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
            if type(t) not in _PLAIN or t.layout != torch.strided or t.is_quantized:
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
        if t in _SCALARS:
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


def _target_name(node: Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", None) or str(t)


def _first_line(e: BaseException) -> str:
    cause = e.__cause__ or e
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__


def _meta_shapes(gm: GraphModule, args: list[Any]) -> str | None:
    """Record shapes by running ``gm`` on meta tensors; None when done, else why not."""
    prop: _MetaShapeProp | None = None
    try:
        root, convert = _meta_copy(gm)
        meta_args = convert(list(args))
        prop = _MetaShapeProp(gm, root)
        with torch.no_grad():
            prop.run(*meta_args)
    except Exception as e:
        node = prop.current if prop is not None else None
        where = (f"node {node.name!r} ({node.op} {_target_name(node)})" if node is not None
                 else "the model")
        why = str(e) if isinstance(e, (_MixedDtypes, _UserLeaf)) else (
            f"cannot run on meta tensors: {_first_line(e)}")
        return f"{where} {why}"
    return None


def example_args(gm: GraphModule, ctx: Context) -> list[Any] | None:
    """Positional arguments for the graph's placeholders from the example inputs (or the
    spec's ``trace.inputs``), with keyword inputs placed by name; None without inputs."""
    inputs = _inputs(ctx)
    if inputs is None:
        return None
    kwargs = dict(ctx.example_kwargs or {})
    concrete = ctx.spec.trace.concrete_args
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # fx may rename a placeholder (``double`` -> ``double_1``); the forward() signature
    # gives the real parameter names, one per placeholder, in order.
    names = _forward_params(ctx.model)
    if len(names) != len(placeholders):
        names = [str(p.target) for p in placeholders]
    args = list(inputs)
    for p, name in list(zip(placeholders, names))[len(args):]:
        if name in concrete:
            args.append(concrete[name])
        elif name in kwargs:
            args.append(kwargs.pop(name))
        elif p.args:
            args.append(p.args[0])  # the parameter's default
        else:
            raise QCompileError(
                f"input {name!r} of the model has no example value",
                fix=f"pass it in example_inputs or example_kwargs={{'{name}': ...}}")
    if len(args) > len(placeholders):
        raise QCompileError(
            f"{len(args)} example inputs given, the traced model takes {len(placeholders)} "
            f"({', '.join(str(p.target) for p in placeholders)})",
            fix="pass one example value per model input")
    if kwargs:
        raise QCompileError(f"example_kwargs names {sorted(kwargs)}, which the model does not "
                            "take", fix="remove them or check the forward() signature")
    return args


def _forward_params(model: nn.Module) -> list[str]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _propagate_shapes(gm: GraphModule, args: list[Any], ctx: Context) -> None:
    """``node.meta["tensor_meta"]`` for every node: from meta tensors, or when the graph
    cannot run on them, from running it on the example inputs (``ctx.shapes`` says which)."""
    why = _meta_shapes(gm, args)
    if why is None:
        ctx.shapes = "meta tensors"
        return
    for n in gm.graph.nodes:  # what the meta run recorded before it stopped
        n.meta.pop(TENSOR_META, None)
    _real_shapes(gm, args)
    ctx.shapes = f"example inputs (ran the model on them: {why})"


def _real_shapes(gm: GraphModule, args: list[Any]) -> None:
    """Run ``gm`` on the example inputs in eval mode under ``no_grad`` (BatchNorm statistics
    and the RNG are left as they were), recording shapes."""
    modes = {name: m.training for name, m in gm.named_modules()}
    gm.eval()
    prop = _ShapeProp(gm)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # random ops draw nothing
            prop.run(*args)
    except Exception as e:
        node = prop.current
        where = f"node {node.name!r} ({node.format_node()})" if node is not None else "the model"
        raise QCompileError(
            f"running {where} on the example inputs failed: {_first_line(e)}",
            fix="check the shapes and dtypes of example_inputs / trace.inputs",
        ) from e
    finally:
        for name, m in gm.named_modules():
            m.training = modes.get(name, m.training)


def _inputs(ctx: Context) -> tuple[Any, ...] | None:
    if ctx.example_inputs is not None:
        return ctx.example_inputs
    if ctx.spec.trace.inputs is not None:
        return tuple(torch.zeros(i.shape, dtype=getattr(torch, i.dtype))
                     for i in ctx.spec.trace.inputs)
    return () if ctx.example_kwargs else None


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


def _symbolic(ctx: Context) -> GraphModule:
    """torch.fx symbolic tracing; raises ``_TraceFailure`` when the model cannot be traced."""
    model = ctx.model
    root = model if ctx.inplace else copy_model(model)
    tracer = _Tracer(list(ctx.spec.trace.leaf_modules))
    concrete = dict(ctx.spec.trace.concrete_args) or None
    try:
        graph = tracer.trace(root, concrete_args=concrete)
    except Exception as e:
        if tracer.path:
            name, cls = tracer.path[-1]
            where = f"module {name!r} ({cls})"
            fix = (f"add it to trace.leaf_modules (e.g. leaf_modules: [{cls}]) so it stays one "
                   "node, or pass concrete_args for arguments used in Python control flow")
        else:
            where = f"the forward of {type(model).__name__}"
            fix = ("pass concrete_args for arguments used in Python control flow, or move the "
                   "control flow into a submodule listed in trace.leaf_modules")
        raise _TraceFailure(f"symbolic tracing failed in {where}: {type(e).__name__}: {e}",
                            fix=fix) from e
    for p in sorted(set(ctx.spec.trace.leaf_modules) - tracer.used_patterns):
        ctx.note(f"trace.leaf_modules entry {p!r} matched no module")
    gm = GraphModule(tracer.root, graph, type(model).__name__)
    keep_state_layout(gm, tracer.root)
    return gm


def _export(ctx: Context, symbolic_error: _TraceFailure | None) -> GraphModule:
    inputs = _inputs(ctx)
    earlier = f"{symbolic_error.message}\n  " if symbolic_error is not None else ""
    if inputs is None:
        raise QCompileError(
            f"{earlier}the torch.export front end needs example inputs",
            fix="pass example_inputs (and example_kwargs) to qcompile, or set trace.inputs"
            + (f"; or for symbolic tracing: {symbolic_error.fix}" if symbolic_error else ""))
    try:
        gm, notes = export_graph(ctx.model, inputs, dict(ctx.example_kwargs or {}),
                                 ctx.spec.trace.dynamic_dims, inplace=ctx.inplace)
    except QCompileError:
        raise
    except Exception as e:
        text = str(e).strip()
        first = text.splitlines()[0] if text else ""
        if ctx.spec.trace.dynamic_dims and ("Constraints violated" in text
                                            or "Suggested fixes" in text):
            hints = text.split("Suggested fixes:", 1)[1].strip() if (
                "Suggested fixes:" in text) else ""
            hints = " ".join(line.strip() for line in hints.splitlines()[:6] if line.strip())
            raise QCompileError(
                f"trace.dynamic_dims: torch.export cannot keep these dims dynamic: {first} "
                f"{hints}".rstrip(),
                fix="bound the dims in the spec, e.g. {1: {name: seq, max: 64}} for export's "
                "Dim('seq', max=64), or leave them static") from e
        fix = ("make the failing code exportable (torch.export guidance: "
               "https://pytorch.org/docs/stable/export.html, e.g. torch.cond for data-dependent "
               "branches, no .item() in forward), or keep the module out of the graph with "
               "trace.leaf_modules and trace.method: symbolic")
        if symbolic_error is not None:
            fix = f"{symbolic_error.fix}; or {fix}"
        raise QCompileError(f"{earlier}torch.export failed: {type(e).__name__}: {first}",
                            fix=fix) from e
    for note in notes:
        ctx.note(note)
    return gm


@graph_pass(requires=("model",), provides=("graph",))
def trace(gm: GraphModule | None, ctx: Context) -> GraphModule:
    """Capture ``ctx.model`` (a copy of it) as a GraphModule: symbolic tracing, torch.export,
    or symbolic first and export when it fails (``trace.method: auto``)."""
    model = ctx.model
    params = _forward_params(model)
    unknown = sorted(set(ctx.spec.trace.concrete_args) - set(params)) if params else []
    if unknown:
        raise QCompileError(f"trace.concrete_args names {unknown}, which forward() does not "
                            f"take (it takes {', '.join(params)})",
                            fix="use the names of forward()'s parameters")
    method = ctx.spec.trace.method
    failure: _TraceFailure | None = None
    if method in ("auto", "symbolic"):
        try:
            gm = _symbolic(ctx)
        except _TraceFailure as e:
            if method == "symbolic":
                raise QCompileError(e.message, fix=e.fix) from e.__cause__
            failure = e
        else:
            gm.meta[ROOT_CLASS_KEY] = type(model)
            ctx.trace_method = "symbolic"
            args = example_args(gm, ctx)
            if args is not None:
                _propagate_shapes(gm, args, ctx)
                ctx.has_shapes = True
            else:
                ctx.note("no example inputs: shapes unknown (pass example_inputs or "
                         "trace.inputs)")
            mark_compiled(gm, ctx)  # GraphModule() generated the code of this very graph
            return gm
    gm = _export(ctx, failure)
    gm.meta[ROOT_CLASS_KEY] = type(model)
    ctx.trace_method = "export"
    ctx.has_shapes = True
    ctx.shapes = "torch.export"
    if failure is not None:
        ctx.note(f"captured with torch.export: {failure.message.splitlines()[0]}")
    mark_compiled(gm, ctx)
    return gm
