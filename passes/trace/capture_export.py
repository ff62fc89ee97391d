"""The torch.export front end: capture a model as an aten-level fx graph that trains.

``torch.export.export(strict=False)`` captures models symbolic tracing cannot (Hugging
Face transformers, Python control flow on shapes, ...). Its graph needs three repairs to
be a ready-to-train qcompile graph:

- The training flag is baked into ops (pytorch/pytorch#151726). The model is exported in
  train mode and mode-dependent ops are re-expressed as module calls that read
  ``self.training``: BatchNorm calls the model's own ``nn.BatchNorm*`` (which also keeps
  ``num_batches_tracked``), dropout calls ``nn.Dropout``, attention dropout a
  ``ModeAwareSDPA``. Then every module gets the train/eval flag it had in the model.
- ``ep.module()`` is a ``_StatefulGraphModule`` whose ``train()``/``eval()`` raise; the
  graph is re-rooted on (a copy of) the model itself, a plain ``GraphModule`` whose
  parameters keep their qualified names and whose submodules keep their classes.
- Shapes: ``node.meta[TENSOR_META]`` is filled from export's fake values, so passes read
  shapes the same way on both front ends.
- Saving: export's input-guard module (``_guards_fn``) runs a function generated at export
  time, which pickle cannot save; its forward becomes a ``GuardCode`` that saves that
  function's code, so the graph still checks its inputs after ``torch.save`` / ``torch.load``.

What export itself does with a forward's other effects: hooks (the root's included) are
traced into the graph; in-place buffer updates are kept (the graph updates the buffer on
every call); attribute assignments (``self.calls += 1``) are undone by torch.export after
its run and are not in the graph (symbolic tracing refuses them); an ``if self.training:``
branch is exported in train mode (mode-aware dropout and BatchNorm aside, see above), and
the report notes every module whose class reads ``self.training`` (``mode_branch_note``).
A parametrized tensor (``torch.nn.utils.parametrizations.weight_norm`` and the like),
which export traces into ops, is read back as the module's attribute, as symbolic tracing
reads it, so its layer is quantized (``_parametrized_weights``).

Module ownership comes from ``node.meta[NN_MODULE_STACK]`` (recorded by export).
``capture`` is the front end the ``trace`` pass calls: ``export_graph`` with every failure
turned into a ``QCompileError`` that says how to get past it.

Example:
    >>> import torch
    >>> from qcompile.passes.trace.capture_export import export_graph
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    >>> gm, notes = export_graph(m, (torch.randn(2, 4),), {}, {})
    >>> [n.target for n in gm.graph.nodes if n.op == "call_module"]
    ['_guards_fn', '1']
    >>> torch.equal(gm.eval()(torch.ones(2, 4)), m.eval()(torch.ones(2, 4)))
    True
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import marshal
import math
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.meta import NN_MODULE_STACK, TENSOR_META, VAL
from qcompile.graph.state_layout import keep_root_persistence, keep_state_layout
from qcompile.passes.trace.model_copy import copy_model
from qcompile.runtime.modes import ModeAwareBatchNorm, ModeAwareSDPA

aten = torch.ops.aten
_DROPOUTS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
             aten.feature_alpha_dropout.default}


class GuardCode:
    """The function torch.export generates to check a graph's inputs (the ``forward`` of
    its ``_guards_fn`` module), as a callable pickle can save.

    Export builds the function from source it does not keep, so its code object is saved
    (``marshal``): a saved graph loads on the Python version it was saved with (the
    state_dict recipe loads anywhere). The module stays torch's own ``GuardsFn``."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.fn = fn
        self._call = _traceable(fn)

    def __call__(self, *args: Any) -> None:
        return self._call(*args)

    def __getstate__(self) -> dict[str, Any]:
        return {"fn": (tuple(sys.version_info[:2]), marshal.dumps(self.fn.__code__))}

    def __setstate__(self, state: dict[str, Any]) -> None:
        version, code = state["fn"]
        if tuple(version) != tuple(sys.version_info[:2]):
            raise QCompileError(
                f"this graph was saved with Python {version[0]}.{version[1]}; its torch.export "
                "input guards load only on that version",
                fix="load it with the same Python, or rebuild it: compile the model again and "
                "load_state_dict(torch.load(f, weights_only=True)) of a saved state_dict")
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        # the namespace export runs the generated guards in (torch/export/_unlift.py)
        namespace = {**SYMPY_INTERP, "math": math, "inf": float("inf"), "torch": torch}
        self.__init__(types.FunctionType(marshal.loads(code), namespace, "_"))


def _traceable(fn: Any) -> Any:
    # as export wraps it: dynamo traces into the guards (re-exporting keeps them)
    dont_skip = getattr(getattr(torch, "_dynamo", None), "dont_skip_tracing", None)
    return dont_skip(fn) if dont_skip is not None else fn


def _picklable_guards(module: Any) -> Any:
    """Give export's ``_guards_fn`` module a ``GuardCode`` forward (its generated function,
    found in the wrapper torch puts around it); anything else stays as it is."""
    forward = module.__dict__.get("forward") if isinstance(module, nn.Module) else None
    if forward is None or isinstance(forward, GuardCode):
        return module
    cells = [c.cell_contents for c in getattr(forward, "__closure__", None) or ()]
    fns = [f for f in [forward, *cells] if isinstance(f, types.FunctionType)
           and f.__code__.co_name == "_" and "<locals>" not in f.__qualname__]
    if fns:
        module.forward = GuardCode(fns[0])
    return module


def _innermost(node: Node) -> str:
    stack = node.meta.get(NN_MODULE_STACK) or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _lookup(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


def _assign(root: nn.Module, target: str, value: Any) -> None:
    *path, leaf = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    setattr(mod, leaf, value)


def _add_child(root: nn.Module, owner: str, base: str, module: nn.Module) -> str:
    parent = root.get_submodule(owner) if owner else root
    name, k = base, 0
    while hasattr(parent, name):
        k += 1
        name = f"{base}_{k}"
    parent.add_module(name, module)
    return f"{owner}.{name}" if owner else name


def _replace(graph: Graph, node: Node, target: str, args: tuple, kwargs: dict | None = None
             ) -> Node:
    with graph.inserting_before(node):
        new = graph.call_module(target, args, kwargs or {})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _restore_modes(graph: Graph, root: nn.Module, notes: list[str]) -> None:
    """Re-express ops whose behaviour export fixed to training mode as module calls."""
    attrs = {str(n.target): n for n in graph.nodes if n.op == "get_attr"}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        owner = _innermost(node)
        mod = root.get_submodule(owner) if owner and _lookup(root, owner) is not None else None
        if node.target is aten.batch_norm.default:
            x, w, b, rm, rv, _training, momentum, eps = node.args[:8]
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and rm is not None:
                counter = attrs.get(f"{owner}.num_batches_tracked")
                for other in list(counter.users) if counter is not None else []:
                    if other.target is aten.add_.Tensor and not other.users:
                        graph.erase_node(other)  # the module counts batches itself
                _replace(graph, node, owner, (x,))
            else:
                bn_mode = ModeAwareBatchNorm(momentum, eps)
                name = _add_child(root, owner, f"{node.name}_mode", bn_mode)
                _replace(graph, node, name, (x, w, b, rm, rv))
        elif node.target in _DROPOUTS:
            if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p == node.args[1]:
                _replace(graph, node, owner, (node.args[0],))
            elif node.target is aten.dropout.default:
                name = _add_child(root, owner, f"{node.name}_mode", nn.Dropout(node.args[1]))
                _replace(graph, node, name, (node.args[0],))
            else:
                notes.append(f"{node.name}: {node.target} keeps the training behaviour it was "
                             "exported with")
        elif node.target is aten.scaled_dot_product_attention.default:
            sig = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                   "enable_gqa")
            bound = dict(zip(sig, node.args))
            bound.update(node.kwargs)
            p = bound.pop("dropout_p", 0.0)
            if p:
                name = _add_child(root, owner, f"{node.name}_mode", ModeAwareSDPA(p))
                _replace(graph, node, name, (), bound)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)


def _parametrized_weights(graph: Graph, root: nn.Module) -> list[str]:
    """Read each parametrized tensor (``torch.nn.utils.parametrizations``: weight_norm,
    spectral_norm, orthogonal, ...) as the module's attribute, as symbolic tracing does.

    Export traces the parametrization into ops (``_weight_norm(original1, original0)``), so
    a layer would read a computed tensor, not a weight: its weight and output would stay
    float. The ops computing ``<owner>.<name>`` (those inside ``<owner>.parametrizations.
    <name>``, by ``nn_module_stack``) become one ``get_attr`` of ``<owner>.<name>``: the
    module's own property, which computes the same tensor from the originals on every
    call, so ``g`` and ``v`` (or ``original``) still train. Returns the owners (the
    GraphModule must hold them whole: a property lives on its class)."""
    from torch.nn.utils import parametrize

    groups: dict[tuple[str, str], list[Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for name, _ in (node.meta.get(NN_MODULE_STACK) or {}).values():
            owner, sep, tensor = f".{name}".rpartition(".parametrizations.")
            if sep and tensor and "." not in tensor:
                groups.setdefault((owner.lstrip("."), tensor), []).append(node)
                break
    owners = []
    for (owner, tensor), nodes in groups.items():
        module = _lookup(root, owner) if owner else root
        if not (isinstance(module, nn.Module) and parametrize.is_parametrized(module, tensor)):
            continue
        inside = set(nodes)
        target = f"{owner}.{tensor}" if owner else tensor
        for out in [n for n in nodes if any(u not in inside for u in n.users)]:
            with graph.inserting_after(out):
                read = graph.get_attr(target)
            read.meta = {k: v for k, v in out.meta.items() if k in (VAL, TENSOR_META)}
            out.replace_all_uses_with(read, delete_user_cb=lambda u, s=inside: u not in s)
        for node in reversed(nodes):  # what computed it (asserts included) goes
            if not node.users:
                graph.erase_node(node)
        owners.append(owner)
    if owners:
        for node in list(graph.nodes):
            if node.op == "get_attr" and not node.users:
                graph.erase_node(node)
    return owners


def mode_branch_note(graph: Graph, root: nn.Module) -> str | None:
    """The note for modules export went through whose class reads ``self.training``
    (``forward_effects.reads_training``, as symbolic tracing checks): export runs the
    model in train mode, so an ``if self.training:`` branch of theirs computes the
    train-mode path in either mode of the graph (dropout, BatchNorm and attention dropout
    are re-expressed to follow the mode; symbolic tracing compares both modes and refuses
    a difference). None when no such module was traced."""
    from qcompile.passes.trace.forward_effects import reads_training

    names = {""}
    for node in graph.nodes:
        names.update(name for name, _ in (node.meta.get(NN_MODULE_STACK) or {}).values())
    found: dict[str, list[str]] = {}
    for name in sorted(names):
        module = _lookup(root, name) if name else root
        if isinstance(module, nn.Module) and reads_training(type(module)):
            found.setdefault(type(module).__name__, []).append(repr(name) if name else
                                                               "the model")
    if not found:
        return None
    shown = "; ".join(f"{', '.join(where[:3])}{f' (+{len(where) - 3})' if len(where) > 3 else ''}"
                      f" ({cls})" for cls, where in found.items())
    return (f"torch.export traced in train mode: module(s) {shown} read self.training in "
            "forward(); dropout, BatchNorm and attention dropout follow gm.train() / "
            "gm.eval(), any other `if self.training:` branch keeps its train-mode path in "
            "both modes (trace.method: symbolic compares both modes and refuses a "
            "difference; trace.leaf_modules keeps such a module's own forward)")


def dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict,
                   dims: dict[str, dict[int, Any]]) -> dict[str, Any] | None:
    """``torch.export`` dynamic_shapes from the spec's ``trace.dynamic_dims``."""
    if not dims:
        return None
    params = list(inspect.signature(model.forward).parameters)
    given = params[:len(args)] + [k for k in kwargs]
    unknown = sorted(set(dims) - set(given))
    if unknown:
        raise QCompileError(f"trace.dynamic_dims names {unknown}, which are not among the "
                            f"example inputs ({', '.join(given)})",
                            fix="use the names of forward()'s parameters that you pass inputs for")
    values = dict(zip(params, args)) | dict(kwargs)
    named: dict[str, tuple[Any, tuple[int | None, int | None]]] = {}

    def dim(spec: Any) -> Any:
        name = spec if isinstance(spec, str) else spec.name
        bounds = (None, None) if isinstance(spec, str) else (spec.min, spec.max)
        if name in named:
            if isinstance(spec, str) or named[name][1] == bounds:
                return named[name][0]
            raise QCompileError(f"trace.dynamic_dims: dim {name!r} is given two different "
                                "bounds", fix="give its min/max once, or the same everywhere")
        kw = {k: v for k, v in zip(("min", "max"), bounds) if v is not None}
        named[name] = (torch.export.Dim(name, **kw), bounds)
        return named[name][0]

    shapes: dict[str, Any] = {}
    for arg in given:
        spec = dims.get(arg)
        if spec is None:
            shapes[arg] = None
            continue
        value = values[arg]
        for d in spec:
            if not isinstance(value, torch.Tensor) or not -value.dim() <= d < value.dim():
                raise QCompileError(f"trace.dynamic_dims.{arg}: dim {d} does not exist on the "
                                    "example input", fix="use a dimension index of that tensor")
            if value.shape[d] < 2:
                raise QCompileError(
                    f"trace.dynamic_dims.{arg}: dim {d} has size {value.shape[d]} in the "
                    "example input; torch.export specialises sizes 0 and 1",
                    fix="use an example input with size >= 2 in every dynamic dimension")
        shapes[arg] = {d % value.dim(): dim(n) for d, n in spec.items()}
    return shapes


# torch's loggers that narrate a failing export (graph dumps, "Unable to find user code")
# at WARNING before the exception that says it all; the QCompileError carries the cause
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export",
                  "torch._export", "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch's export loggers at ERROR for the duration of one export, as they were after
    (TORCH_LOGS still works: a logger a user configured below WARNING is left alone).
    A failing export also prints its partial graph to stderr (``print(e.partial_fx_graph,
    file=sys.stderr)`` in torch.export): stderr is held during the call and given back
    without that dump; the QCompileError says what failed."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    held = io.StringIO()
    real = sys.stderr
    dump = ""
    try:
        for lg in loggers:
            if lg.getEffectiveLevel() >= logging.WARNING:
                lg.setLevel(logging.ERROR)
        with contextlib.redirect_stderr(held):
            yield
    except Exception as e:
        dump = str(getattr(e, "partial_fx_graph", "") or "")
        raise
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        text = held.getvalue()
        if dump:
            text = text.replace(dump, "")
        if text.strip():
            real.write(text)


@contextlib.contextmanager
def _stack_traces(record: bool) -> Iterator[None]:
    """Without ``record``, torch.fx's ``do_not_emit_stack_traces`` on for one export, as
    it was after. Export records the Python stack of every node it creates, walking the
    whole stack each time (~12% of an export, more the deeper the caller); nothing in
    qcompile reads it, and the symbolic front end records none. With ``record``, or with
    a torch without the switch, the export runs as torch configures it."""
    config = getattr(torch.fx, "config", None)
    if record or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


#: the zero-element buffer whose device an exported graph computes on
DEVICE_ANCHOR = "_qcompile_device"


def _traced_device(gm: GraphModule) -> torch.device | None:
    """The device ``gm`` was exported on: its tensor inputs', else its state's."""
    for node in gm.graph.nodes:
        val = node.meta.get(VAL)
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            return val.device
    return next((t.device for t in (*gm.parameters(), *gm.buffers())), None)


def follow_graph_device(gm: GraphModule) -> int:
    """Make an exported graph run wherever its tensors are put.

    Export bakes the device it traced on into the graph: ``arange(n, device=cpu)`` for
    positions and causal masks, ``to(inv_freq, cpu)`` for a rotary table moved to its
    input's device, and ``_assert_tensor_metadata(x, dtype=..., device=cpu)`` guards of
    what each ``.to()`` saw. A graph compiled on the CPU and moved with ``.to("cuda")``
    (or exported on the meta device and materialised by ``compile_once``) would then mix
    devices, and under ``torch.autocast`` the guards' dtypes no longer hold. So:

    - each literal of the traced device becomes the device of a zero-element,
      non-persistent buffer, ``_qcompile_device``: ``to_empty``, ``to``, ``cuda()`` and
      ``fully_shard`` move it with the rest of the graph (a pipeline stage gets its own, on
      the stage's device), so the literal always names the device the graph's tensors are
      on. Literals of another device (a model that moves a tensor to the CPU on purpose)
      stay;
    - the guards go: they check what held when traced, and the graph is meant to be moved
      and autocast (the ``.to()`` ops they guard still convert);
    - traced on meta, ``histc`` of integers counts floats (see below).

    Returns the number of rewritten or removed nodes; the caller recompiles.

    Example:
        >>> import torch
        >>> class M(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x + torch.arange(x.shape[-1], device=x.device)
        >>> x = torch.ones(2, 3, device="meta")
        >>> gm, _ = export_graph(M(), (x,), {}, {})
        >>> gm.to_empty(device="cpu")(torch.ones(2, 3)).tolist()
        [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    """
    traced = _traced_device(gm)
    if traced is None:
        return 0

    def is_traced(v: Any) -> bool:
        return v == traced if isinstance(v, torch.device) else v == str(traced)

    changed = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)  # no users: a guard, not a value
            changed += 1
    # Code that branches on the device took the non-CPU branch on meta; the one such
    # branch export keeps as an op: ``histc`` of integers (transformers' MoE routing counts
    # tokens per expert in int, CPU kernels count floats only). Floats count the same
    # integer values (exact below 2**24) on every device.
    for node in list(gm.graph.nodes) if traced.type == "meta" else ():
        val = node.args[0].meta.get(VAL) if (node.op == "call_function" and node.target is
                                             aten.histc.default) else None
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            with gm.graph.inserting_before(node):
                cast = gm.graph.call_function(aten._to_copy.default, (node.args[0],),
                                              {"dtype": torch.float32})
            cast.meta[VAL] = val.float()
            cast.meta[TENSOR_META] = _extract_tensor_metadata(cast.meta[VAL])
            node.args = (cast, *node.args[1:])
            changed += 1
    users = [n for n in gm.graph.nodes if n.op == "call_function" and any(
        is_traced(v) for v in (*n.args, *n.kwargs.values()))]
    if not users:
        return changed
    if DEVICE_ANCHOR not in gm._buffers:
        gm.register_buffer(DEVICE_ANCHOR, torch.empty(0, device=traced), persistent=False)
    anchor = gm.get_buffer(DEVICE_ANCHOR)
    for node in users:
        # one device value per use, made right before it: the value floats with its user
        # (computed from a buffer alone), so a pipeline never passes it between stages
        with gm.graph.inserting_before(node):
            held = gm.graph.get_attr(DEVICE_ANCHOR)
            held.meta[VAL] = anchor
            held.meta[TENSOR_META] = _extract_tensor_metadata(anchor)
            device = gm.graph.call_function(getattr, (held, "device"))
        node.args = tuple(device if is_traced(v) else v for v in node.args)
        node.kwargs = {k: (device if is_traced(v) else v) for k, v in node.kwargs.items()}
    return changed + len(users)


def quiet_export(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``torch.export.export(model, args, kwargs, strict=False)`` with torch's export
    loggers quiet (``_quiet_torch_logs``) and no per-node stack traces: the
    ``ExportedProgram``, for callers that want export's own result (its constants)."""
    with _quiet_torch_logs(), _stack_traces(False):
        return torch.export.export(model, tuple(args), dict(kwargs), strict=False)


def export_graph(model: nn.Module, args: tuple, kwargs: dict,
                 dims: dict[str, dict[int, Any]], *, inplace: bool = False,
                 stack_traces: bool = False) -> tuple[GraphModule, list[str]]:
    """Export a copy of ``model`` (the model itself with ``inplace``) and return a
    trainable GraphModule plus notes; ``stack_traces`` keeps export's per-node source
    stacks (``trace.stack_traces``).

    Raises whatever ``torch.export`` raises when it cannot capture the model."""
    notes: list[str] = []
    flags = {name: m.training for name, m in model.named_modules()}
    root = (model if inplace else copy_model(model)).train()
    shapes = dynamic_shapes(model, args, kwargs, dims)
    with _quiet_torch_logs(), _stack_traces(stack_traces):
        ep = torch.export.export(root, tuple(args), dict(kwargs), dynamic_shapes=shapes,
                                 strict=False)
    exported = ep.module()
    # The graph is taken over (nodes will call modules that exist only on ``root``): the
    # stateful module it came from is only read for the constants and the input guard, and
    # then dropped. (A deep copy would cost more than the rest of this front end, and
    # deep-copying export's pytree codegen warns.)
    graph = exported.graph
    graph.owning_module = None  # unowned until re-rooted: fx checks call targets on owners
    for node in graph.nodes:  # constants and the input guard live on the exported module
        if node.op in ("get_attr", "call_module") and _lookup(root, str(node.target)) is None:
            value = _lookup(exported, str(node.target))
            if node.op == "call_module":
                value = _picklable_guards(value)
            _assign(root, str(node.target), value)
    _restore_modes(graph, root, notes)
    parametrized = _parametrized_weights(graph, root)
    branch = mode_branch_note(graph, root)
    if branch is not None:
        notes.append(branch)
    # export's tracer class (kept on the graph, then on the GraphModule) takes arguments,
    # and torch.load re-traces a saved graph with it built without any: use fx's Tracer
    graph._tracer_cls = None
    gm = GraphModule(root, graph, type(model).__name__)
    for owner in parametrized:  # whole (fx copied attributes only): its property computes
        if owner:
            _assign(gm, owner, root.get_submodule(owner))
    keep_state_layout(gm, root)
    for name, m in gm.named_modules():
        owner = name
        while owner not in flags and owner:
            owner = owner.rpartition(".")[0]
        m.training = flags.get(owner, model.training)
    for node in gm.graph.nodes:
        val = node.meta.get(VAL)
        if isinstance(val, torch.Tensor):
            node.meta[TENSOR_META] = _extract_tensor_metadata(val)
    if follow_graph_device(gm):
        gm.recompile()
    keep_root_persistence(gm)
    return gm, notes


def capture(ctx: Context, inputs: tuple[Any, ...] | None,
            symbolic_error: QCompileError | None = None) -> GraphModule:
    """``export_graph`` for the pass: ``inputs`` are the example inputs (None without any),
    ``symbolic_error`` why symbolic tracing failed first (``trace.method: auto``). Every
    failure becomes a ``QCompileError`` that says how to get past it with either front end;
    the notes of the capture land in ``ctx``."""
    earlier = f"{symbolic_error.message}\n  " if symbolic_error is not None else ""
    if inputs is None:
        raise QCompileError(
            f"{earlier}the torch.export front end needs example inputs",
            fix="pass example_inputs (and example_kwargs) to qcompile, or set trace.inputs"
            + (f"; or for symbolic tracing: {symbolic_error.fix}" if symbolic_error else ""))
    try:
        gm, notes = export_graph(ctx.model, inputs, dict(ctx.example_kwargs or {}),
                                 ctx.spec.trace.dynamic_dims, inplace=ctx.inplace,
                                 stack_traces=ctx.spec.trace.stack_traces)
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
