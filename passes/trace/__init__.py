"""``trace``: capture the model as a ``torch.fx.GraphModule`` and record tensor shapes.

Two front ends, chosen by ``trace.method``: ``symbolic`` (torch.fx symbolic tracing, with
leaf modules and concrete arguments from ``spec.trace``; ``capture_symbolic``), ``export``
(torch.export; ``capture_export``; needs example inputs), and ``auto`` (symbolic first,
export when symbolic tracing fails; the Report notes why, in words: what the forward does
that symbolic tracing cannot follow, and where, ``explain``). Both work on a copy
(``model_copy``): the user's model is never touched. On symbolic graphs with example inputs
(the argument, or ``spec.trace.inputs``), ``node.meta[TENSOR_META]`` (torch.fx
``TensorMetadata``) comes from running the graph on meta tensors, or on the example inputs
when meta tensors cannot run it (``shape_prop``; ``Report.shapes`` says which). Export
graphs take their shapes from export's own fake values. The traced graph is marked as
qcompile's (``gm.meta[COMPILED_KEY]``); ``compile_model`` makes the finished graph save
whole with ``torch.save`` (``saving.keep_whole``).

Before either front end runs, names fx cannot write into code (a ``ModuleDict`` key with a
quote, backslash or line break) and old-style ``torch.nn.utils.weight_norm`` are refused,
naming the module (``forward_effects``).

Inside the package imports run one way: this pass -> ``capture_symbolic``, ``shape_prop``,
``capture_export``; each of those three -> ``model_copy``; the pass and ``capture_symbolic``
-> ``forward_effects``; ``capture_symbolic`` -> ``explain``.

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

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.meta import COMPILED_KEY, REPORT_KEY, ROOT_CLASS_KEY
from qcompile.graph.pipeline import graph_pass, mark_compiled
from qcompile.passes.trace import capture_export, capture_symbolic, forward_effects
from qcompile.passes.trace.linearize import linearize
from qcompile.passes.trace.model_copy import copy_model
from qcompile.passes.trace.shape_prop import propagate_shapes
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.version import __version__

# copy_model is re-exported: it lived here before the package was split by concern
__all__ = ["copy_model", "example_args", "refuse_compiled", "trace"]


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


def _inputs(ctx: Context) -> tuple[Any, ...] | None:
    if ctx.example_inputs is not None:
        return ctx.example_inputs
    if ctx.spec.trace.inputs is not None:
        return tuple(torch.zeros(i.shape, dtype=getattr(torch, i.dtype))
                     for i in ctx.spec.trace.inputs)
    return () if ctx.example_kwargs else None


def _refuse_meta_weights(model: nn.Module, ctx: Context) -> None:
    """A model on the meta device has no values: with real example inputs it would compile
    and fail on its first call, so say it now. (Meta inputs, or none, compile the structure
    only, which is what a sharded ``compile_once`` wants.)"""
    devices = {t.device.type for t in torch.utils._pytree.tree_leaves(
        (ctx.example_inputs, ctx.example_kwargs)) if isinstance(t, torch.Tensor)}
    if not devices - {"meta"}:
        return
    for kind, items in (("parameter", model.named_parameters()),
                        ("buffer", model.named_buffers())):
        for name, t in items:
            if t.device.type == "meta":
                raise QCompileError(
                    f"{kind} {name!r} of the model is on the meta device (it has no values), "
                    f"but example_inputs are on {sorted(devices - {'meta'})[0]}",
                    fix="materialize the model first (model.to_empty(device=...) and load "
                        "its weights), or compile a sharded model with "
                        "qc.distributed.compile_once(build, spec, inputs, checkpoint=...)")


def _refuse_uncapturable(model: nn.Module) -> None:
    """What neither front end can capture, refused before the model is copied: a name fx
    cannot write into the graph's code, and old-style weight norm (no copy can hold its
    computed weight)."""
    bad = forward_effects.unwritable_name(model)
    if bad is not None:
        kind, name = bad
        raise QCompileError(
            f"{kind} {name!r} of the model has a name (a ModuleDict / ParameterDict key) "
            "with a quote, backslash or line break, which torch.fx cannot write into the "
            "compiled graph's code",
            fix="rename the key to letters, digits and underscores (e.g. "
                f"{name.rpartition('.')[2]!r} -> {_identifier(name.rpartition('.')[2])!r})")
    name = forward_effects.old_weight_norm(model)
    if name is not None:
        raise QCompileError(
            f"module {name!r} of the model uses torch.nn.utils.weight_norm (the old-style "
            "hook), whose computed weight no copy of the model can hold",
            fix=f"use torch.nn.utils.parametrizations.weight_norm(model.{name}) instead "
                "(qcompile keeps it: training updates g and v), or for inference call "
                f"torch.nn.utils.remove_weight_norm(model.{name}) before compiling")


def _identifier(atom: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in atom)
    return out if out.isidentifier() else f"_{out}"


_RECOMPILE_FIX = ("compile the original float model instead; to change the scheme, compile the "
                  "float model with the new spec and load the trained state "
                  "(model.load_state_dict(gm.state_dict(), strict=False) before compiling)")


def refuse_compiled(model: nn.Module) -> None:
    """Refuse a graph ``qcompile`` returned (or a model holding one, or holding quantizers
    because an ``inplace=True`` compile took it over): compiling it again would insert
    quantizers around quantizers, and its rules would match nothing. ``qc.qcompile`` calls
    it first (before the wrapped-model checks); the trace pass again, for every other
    caller of the pass pipeline."""
    for name, m in model.named_modules():
        meta = getattr(m, "meta", None) if isinstance(m, GraphModule) else None
        if isinstance(meta, dict) and (COMPILED_KEY in meta or REPORT_KEY in meta):
            rep = meta.get(REPORT_KEY)
            mode = f" (quant.mode {rep.mode!r})" if rep is not None else ""
            what = "the model is" if not name else f"module {name!r} of the model is"
            raise QCompileError(f"qcompile: {what} already a graph returned by qcompile{mode}; "
                                "compiling it again would quantize its quantizers",
                                fix=_RECOMPILE_FIX)
        if isinstance(m, FakeQuantize):
            raise QCompileError(
                f"qcompile: module {name!r} of the model is a qcompile quantizer "
                "(FakeQuantize): the model was already compiled (an inplace=True compile "
                "hands the model's modules to the graph)",
                fix="compile a fresh instance of the float model; " + _RECOMPILE_FIX)


def _mark(gm: GraphModule, model: nn.Module) -> None:
    gm.meta[ROOT_CLASS_KEY] = type(model)
    gm.meta[COMPILED_KEY] = __version__  # qc.qcompile refuses to compile it again


@graph_pass(requires=("model",), provides=("graph",))
def trace(gm: GraphModule | None, ctx: Context) -> GraphModule:
    """Capture ``ctx.model`` (a copy of it) as a GraphModule: symbolic tracing, torch.export,
    or symbolic first and export when it fails (``trace.method: auto``)."""
    model = ctx.model
    refuse_compiled(model)
    params = _forward_params(model)
    unknown = sorted(set(ctx.spec.trace.concrete_args) - set(params)) if params else []
    if unknown:
        raise QCompileError(f"trace.concrete_args names {unknown}, which forward() does not "
                            f"take (it takes {', '.join(params)})",
                            fix="use the names of forward()'s parameters")
    _refuse_meta_weights(model, ctx)
    _refuse_uncapturable(model)
    with _cache_off(model, ctx):
        return _capture(model, ctx)


def _configs(model: nn.Module) -> list[Any]:
    """The model's Hugging Face config and the configs nested in it (a text config)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return []
    nested = [v for v in vars(config).values() if hasattr(v, "to_dict") and v is not config]
    return [config, *nested]


@contextlib.contextmanager
def _cache_off(model: nn.Module, ctx: Context) -> Iterator[None]:
    """A Hugging Face model whose config has ``use_cache`` on (transformers' default) is
    captured with it off, and the report says so: a training graph keeps no key/value
    cache, and a cache object is not a tensor output either front end can capture. The
    flag is set back when the capture ends, so the model is left as it was (the graph's own
    copy keeps ``use_cache=False``). Asking for the cache in ``example_kwargs`` is refused."""
    if (ctx.example_kwargs or {}).get("use_cache") is True:
        raise QCompileError(
            "example_kwargs asks for use_cache=True: a compiled graph is a training graph and "
            "keeps no key/value cache (a cache object is not a tensor output torch.export or "
            "torch.fx can capture)",
            fix="pass use_cache=False in example_kwargs, or leave it out (qcompile then "
                "compiles with the cache off); generate with the float model, or export the "
                "trained model (qc.export_onnx) for inference")
    on = [c for c in _configs(model) if getattr(c, "use_cache", None) is True]
    for c in on:
        c.use_cache = False
    try:
        yield
    finally:
        for c in on:
            c.use_cache = True
    if on:
        ctx.note("config.use_cache is on in the model: compiled with use_cache=False (a "
                 "training graph keeps no key/value cache; the model's config is unchanged)")


def _capture(model: nn.Module, ctx: Context) -> GraphModule:
    """The front end(s) ``trace.method`` names, on ``model`` (see ``trace``)."""
    method = ctx.spec.trace.method
    failure: capture_symbolic.TraceFailure | None = None
    if method in ("auto", "symbolic"):
        try:
            gm = capture_symbolic.capture(ctx)
        except capture_symbolic.TraceFailure as e:
            if method == "symbolic":
                raise QCompileError(e.message, fix=e.fix) from e.__cause__
            failure = e
        else:
            _mark(gm, model)
            ctx.trace_method = "symbolic"
            args = example_args(gm, ctx)
            if args is not None:
                propagate_shapes(gm, args, ctx)
                ctx.has_shapes = True
            else:
                ctx.note("no example inputs: shapes unknown (pass example_inputs or "
                         "trace.inputs)")
            if _linearized(gm, ctx):
                gm.recompile()
            if not ctx.code_may_wait:
                mark_compiled(gm, ctx)  # GraphModule() generated the code of this very graph
            return gm
    gm = capture_export.capture(ctx, _inputs(ctx), failure)
    _mark(gm, model)
    ctx.trace_method = "export"
    ctx.has_shapes = True
    ctx.shapes = "torch.export"
    if failure is not None:
        ctx.note(f"captured with torch.export: {failure.reason}")
    if _linearized(gm, ctx):
        gm.recompile()
    mark_compiled(gm, ctx)
    return gm


def _linearized(gm: GraphModule, ctx: Context) -> bool:
    """When quantizing or adapting: ``x @ W.T`` products become ``linear`` (``linearize``),
    with a note; whether any did."""
    if ctx.spec.quant.mode == "none" and not ctx.spec.adapters:
        return False
    done = linearize(gm)
    if done:
        shown = ", ".join(done[:4]) + (f" and {len(done) - 4} more" if len(done) > 4 else "")
        ctx.note(f"{len(done)} product(s) of an input and a transposed [out, in] parameter "
                 f"(x @ W.T) read as linear layers: {shown}")
    return bool(done)
