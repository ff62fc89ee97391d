"""Shape propagation: ``node.meta[TENSOR_META]`` for every node of a symbolic graph.

Shapes come from running the graph on *meta* tensors (shape, dtype and strides, no data)
against meta copies of the modules (``model_copy.MetaCopy``, made only for the modules and
attributes the run reaches, as most calls are answered from metadata): no kernel runs, so it costs
the same for a batch of 1 or 1,000, leaves the RNG, BatchNorm statistics and every module's
state alone, and needs no device memory. (torch's FakeTensorMode does the same through a
dispatch mode: 2.5-6x slower on the bench models.) A graph that cannot run on meta tensors
(data-dependent ops: ``.item()``, ``nonzero``, Python branching on a value in a leaf module;
ops without a meta kernel; tensors the copy could not convert), or a call mixing
floating-point dtypes (meta kernels accept what real ones reject), is run on the example
inputs instead, in eval mode under ``no_grad``, and ``Report.shapes`` says why. Shapes and
dtypes are the real ones; strides follow the meta kernels, which can lay some outputs out
differently (a conv on a channels_last input): nothing here reads them.

Example:
    >>> import torch
    >>> from torch.fx import symbolic_trace
    >>> from qcompile.graph.context import Context
    >>> from qcompile.passes.trace.shape_prop import propagate_shapes
    >>> from qcompile.specs import CompileSpec
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    >>> gm, ctx = symbolic_trace(model), Context(spec=CompileSpec(), model=model)
    >>> propagate_shapes(gm, [torch.randn(4, 3)], ctx)
    >>> ctx.shapes
    'meta tensors'
    >>> [tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes if n.op == "call_module"]
    [(4, 2), (4, 2)]
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import TensorMetadata, _extract_tensor_metadata

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.meta import TENSOR_META, TYPE
from qcompile.passes.trace.model_copy import PLAIN_TENSORS, SCALAR_TYPES, MetaCopy
from qcompile.runtime.calibration import describe

# the formats torch's _extract_tensor_metadata asks about, in its order (the first wins)
_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
# nn.Module's own bookkeeping (hooks, parameter and buffer dicts), not a module's config
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_INPLACE_OPERATORS = frozenset({
    "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "ior",
    "ipow", "irshift", "isub", "itruediv", "ixor", "setitem", "delitem", "__setitem__",
    "__delitem__"})


def _tensor_metadata(t: torch.Tensor) -> TensorMetadata:
    """torch.fx's ``_extract_tensor_metadata``, with the memory-format queries answered by
    the tensor itself (in C++) for plain strided tensors: the same fields, without torch's
    per-query Python, which costs more than running most nodes on meta tensors."""
    if type(t) not in PLAIN_TENSORS or t.layout != torch.strided or t.is_quantized:
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
    if t in PLAIN_TENSORS:
        return ("T", tuple(a.shape), a.stride(), a.dtype, a.requires_grad)
    if t in SCALAR_TYPES:
        return (t, a)
    # (list comprehensions: cheaper than generators for the few items calls have)
    if isinstance(a, (tuple, list)):  # fx passes lists as immutable_list, torch.Size...
        return (t, tuple([_key(x) for x in a]))
    if isinstance(a, dict):  # ... and kwargs as immutable_dict
        return (t, tuple([(k, _key(v)) for k, v in a.items()]))
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
                items.append((k, tuple([(name, _key(t)) for name, t in v.items()])))
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


_CONV_DIMS = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def _conv_shape(m: nn.Module, x: torch.Tensor) -> tuple[int, ...] | None:
    """The output shape of a stock Conv1d/2d/3d on a batched input, by the convolution
    formula (as torch's meta kernel computes it); None for anything the kernel would
    reject or treat specially (let it run and say why)."""
    d, w = _CONV_DIMS[type(m)], m.weight
    if (m.padding_mode != "zeros" or x.dim() != d + 2 or w.dim() != d + 2 or x.shape[0] == 0
            or x.shape[1] == 0
            or x.shape[1] != w.shape[1] * m.groups or not _same_dtype(x, w, m.bias)):
        return None
    if m.padding == "same":  # stride 1 (the module insists): the length is kept
        return (x.shape[0], w.shape[0], *x.shape[2:])
    padding = (0,) * d if m.padding == "valid" else m.padding
    out = []
    for n, k, stride, pad, dilation in zip(x.shape[2:], w.shape[2:], m.stride, padding,
                                          m.dilation):
        length = (n + 2 * pad - dilation * (k - 1) - 1) // stride + 1
        if length <= 0:
            return None
        out.append(length)
    return (x.shape[0], w.shape[0], *out)


_ADAPTIVE_AVG_DIMS = {nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3}


def _adaptive_avg_shape(m: nn.Module, x: torch.Tensor) -> tuple[int, ...] | None:
    """The output shape of a stock AdaptiveAvgPool1d/2d/3d: the leading dims, then the
    output size (None entries keep the input's)."""
    d = _ADAPTIVE_AVG_DIMS[type(m)]
    size = m.output_size
    if size is None:  # (torch refuses a bare None: only tuples may hold None)
        return None
    sizes = (size,) * d if isinstance(size, int) else tuple(size)
    if x.dim() not in (d + 1, d + 2) or x.numel() == 0 or len(sizes) != d:
        return None
    out = [n if s is None else s for s, n in zip(sizes, x.shape[x.dim() - d:])]
    if any(type(s) is not int or s <= 0 for s in out):
        return None
    return (*x.shape[:x.dim() - d], *out)


_ELEMENTWISE = frozenset({nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh,
                          nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.Mish})
_BN_DIMS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}


def _same_dtype(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == x.dtype for t in tensors)


def _stock_output(m: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The meta output of the commonest stock modules (exact class, eval mode) on a
    contiguous floating-point input, without torch's meta kernels, which for these are
    Python decompositions costing up to ~2 ms a call (BatchNorm, LayerNorm, GELU, Linear;
    a convolution's ~0.1 ms plus converting the module to meta tensors):
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
    elif cls in _CONV_DIMS or cls in _ADAPTIVE_AVG_DIMS:
        shape = _conv_shape(m, x) if cls in _CONV_DIMS else _adaptive_avg_shape(m, x)
        # contiguous, as torch's meta kernels and the CPU kernels make them for this input
        return None if shape is None else x.new_empty(shape)
    else:
        same = False
    # (x is contiguous: new_empty makes the same tensor as empty_like, without the
    # Python reference implementation empty_like runs on meta tensors)
    return x.new_empty(x.shape) if same else None


class _MixedDtypes(Exception):
    """Floating-point inputs of different dtypes: CPU and CUDA kernels reject many such
    calls (``linear`` on float64 input and float32 weight) that meta kernels accept."""


# Calls whose real kernels want every tensor input floating when the weights are (meta
# kernels accept ``linear(int64 input, float weight)``); an embedding's integer indices are
# fine and are not listed.
_FLOAT_ONLY_MODULES = (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase,
                       nn.LayerNorm, nn.GroupNorm)
_FLOAT_ONLY_FUNCTIONS = frozenset({
    torch.nn.functional.linear, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
    torch.nn.functional.conv3d, torch.nn.functional.layer_norm,
    torch.nn.functional.batch_norm, torch.matmul, torch.mm, torch.bmm, operator.matmul})


def _check_dtypes(args: tuple, kwargs: dict, module: nn.Module | None,
                  target: Any = None) -> None:
    """Raise ``_MixedDtypes`` when a call mixes floating-point dtypes among its tensor
    inputs (and, for a module, its parameters), or gives an integer tensor to a call that
    computes in floating point; 0-dim tensors promote like scalars."""
    dtypes = set()
    integral = set()
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):  # torch.cat([...]) and the like
            if isinstance(t, torch.Tensor) and t.dim():
                if t.is_floating_point():
                    dtypes.add(t.dtype)
                elif not t.is_complex() and t.dtype != torch.bool:
                    integral.add(t.dtype)
    if module is not None:
        dtypes.update(p.dtype for p in module.parameters() if p.is_floating_point())
    float_only = (isinstance(module, _FLOAT_ONLY_MODULES) if module is not None
                  else target in _FLOAT_ONLY_FUNCTIONS)
    if float_only and dtypes and integral:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes | integral))
        raise _MixedDtypes(f"computes in floating point but gets an integer tensor ({names}): "
                           "real kernels reject that where meta kernels do not")
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
    """Runs the graph on meta tensors against meta copies of the modules and attributes
    (``MetaCopy``), made when a node first reads one: the graph's own module is only read
    (metadata, module configs), never run.

    Real models repeat themselves (the blocks of a transformer, the layers of a ResNet
    stage) and torch's meta kernels are Python: a call whose op (a torch function or
    operator, a tensor method, a stock ``torch.nn`` module with the same config) and input
    metadata were seen before gets fresh meta outputs with the metadata recorded then.
    In-place calls and anything the key cannot describe always run."""

    def __init__(self, gm: GraphModule, metas: MetaCopy) -> None:
        super().__init__(gm, graph=gm.graph)
        self.metas = metas
        self.memo: dict[Any, Any] = {}
        self.module_keys: dict[str, Any] = {}
        # A memo hit returns a fresh tensor where the op may return its input (contiguous,
        # .to(same dtype)): an in-place shape change through that alias would be lost, so
        # a graph with any in-place call runs every call.
        self.memo_on = not any(_mutates(n) for n in gm.graph.nodes)
        hooks = torch.nn.modules.module
        self.memo_modules = not (hooks._global_forward_hooks
                                 or hooks._global_forward_pre_hooks)

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = self.fetch_attr(target)
        if isinstance(value, nn.Module):
            return self.metas.module(value)
        # a plain attribute of a module the meta copy would hold: converted the same way
        return self.metas.value(value)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self.metas.module(self.fetch_attr(target))(*args, **kwargs)

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
        _check_dtypes(args, kwargs, module, n.target)
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
        metas = MetaCopy()
        meta_args = metas.convert(list(args))
        prop = _MetaShapeProp(gm, metas)
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


def propagate_shapes(gm: GraphModule, args: list[Any], ctx: Context) -> None:
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
    names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
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
            fix="check the shapes and dtypes of example_inputs / trace.inputs (given: "
                f"{describe(tuple(args), {}, names)})",
        ) from e
    finally:
        for name, m in gm.named_modules():
            m.training = modes.get(name, m.training)
