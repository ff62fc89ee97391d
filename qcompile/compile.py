"""``qcompile(model, spec, example_inputs)``: trace, rewrite, return a GraphModule.

Example:
    >>> import torch, qcompile as qc
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> gm = qc.qcompile(model, "int8-qat", example_inputs=(torch.randn(4, 8),))
    >>> loss = gm(torch.randn(4, 8)).square().mean(); loss.backward()
    >>> gm.get_submodule("0").weight.grad is not None
    True
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile import __version__
from qcompile.context import Context
from qcompile.errors import QCompileError
from qcompile.passes import annotate, fold_bn, insert_quant, partition, place, trace
from qcompile.pipeline import Instrument, Pass, Pipeline
from qcompile.records import Report
from qcompile.specs import CompileSpec, load_spec

REPORT_KEY = "qcompile.report"


def default_passes(spec: CompileSpec) -> list[Pass]:
    """The fixed pass order for a spec; quantization passes only when quantizing."""
    passes = [trace]
    if spec.quant.mode != "none":
        passes += [fold_bn, annotate, insert_quant]
    if spec.pipeline is not None:
        passes += [partition, place]
    return passes


def _as_spec(spec: CompileSpec | dict | str | Path) -> CompileSpec:
    if isinstance(spec, CompileSpec):
        return spec
    if isinstance(spec, dict):
        return CompileSpec.model_validate(spec)
    if isinstance(spec, (str, Path)):
        return load_spec(spec)
    raise QCompileError(f"spec must be a CompileSpec, a dict or a path, got {type(spec).__name__}",
                        fix="pass qc.load_spec('file.yaml') or a preset name like 'int8-qat'")


def _as_inputs(example_inputs: Any) -> tuple[Any, ...] | None:
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise QCompileError(f"example_inputs must be a tuple of inputs, got "
                        f"{type(example_inputs).__name__}", fix="pass example_inputs=(x,)")


def _balance_ratio(ctx: Context) -> float | None:
    costs = [s.cost for s in ctx.stages]
    if not costs or sum(costs) == 0:
        return None
    return max(costs) / (sum(costs) / len(costs))


def qcompile(
    model: nn.Module,
    spec: CompileSpec | dict | str | Path,
    example_inputs: Any = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    instruments: Sequence[Instrument] = (),
    inplace: bool = False,
) -> GraphModule:
    """Compile ``model`` as ``spec`` says and return a ready-to-train ``GraphModule``.

    ``spec`` is a ``CompileSpec``, a dict, a spec file path or a preset name.
    ``example_inputs`` (optional) enables shape-dependent features. The model itself is
    never modified: passes work on a deep copy — unless ``inplace=True`` (as in torch.ao's
    ``prepare_fx``), which saves the copy's memory and lets the graph take over the model's
    modules and parameters: use it only for a model nothing else will use.
    """
    if not isinstance(model, nn.Module):
        raise QCompileError(f"qcompile takes an nn.Module, got {type(model).__name__}",
                            fix="pass the model instance (not its class or a function)")
    spec = _as_spec(spec)
    ctx = Context(spec=spec, model=model, example_inputs=_as_inputs(example_inputs),
                  example_kwargs=example_kwargs, inplace=inplace)
    t0 = time.perf_counter()
    # Compiling allocates many small objects (fx nodes, modules); Python's cyclic GC would
    # rescan the whole growing heap again and again and make compile time superlinear in
    # graph size. Pause it for the pipeline (reference counting still frees memory).
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        gm, records = Pipeline(default_passes(spec)).run(ctx, instruments=instruments)
    finally:
        if gc_was_on:
            gc.enable()
    if spec.cache_dir is not None:
        records[-1].notes.append("cache_dir is used by qc.distributed.compile_once: "
                                 "qcompile itself compiles afresh")
    report = gm.meta[REPORT_KEY] = Report(
        qcompile_version=__version__,
        torch_version=torch.__version__,
        mode=spec.quant.mode,
        trace_method=ctx.trace_method,
        shapes=ctx.shapes,
        passes=records,
        quantizers=ctx.quantizers,
        rule_matches=ctx.rule_matches,
        stages=ctx.stages,
        balance=ctx.balance,
        balance_ratio=_balance_ratio(ctx),
        total_seconds=time.perf_counter() - t0,
    )
    gm.meta["qcompile.sync_observers"] = spec.quant.sync_observers
    gm.meta["qcompile.spec"] = spec
    for inst in instruments:
        inst.finish(report, gm)
    return gm
