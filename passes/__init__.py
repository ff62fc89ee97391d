"""Graph passes, one per module (a big pass is a package whose ``__init__`` is the pass),
and the fixed order the compiler runs them in.

``qcompile.passes.<name>`` is always the module; the ``Pass`` object inside it has the
module's name (``qcompile.passes.fold_bn.fold_bn``). ``compile_model`` runs the default
pipeline for a spec: ``qc.qcompile`` and ``qc.distributed.compile_once`` both call it.

Example:
    >>> from qcompile.passes import default_passes
    >>> from qcompile.specs import CompileSpec
    >>> [p.name for p in default_passes(CompileSpec.model_validate({"quant": {"mode": "qat"}}))]
    ['trace', 'fold_bn', 'annotate', 'insert_quant', 'overwrite_inputs']
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.errors import QCompileError
from qcompile.graph import finite
from qcompile.graph.algorithms import Applier
from qcompile.graph.context import Context
from qcompile.graph.meta import COMPILED_KEY, REPORT_KEY, SPEC_KEY, SYNC_OBSERVERS_KEY
from qcompile.graph.pipeline import Instrument, Pass, Pipeline
from qcompile.graph.records import Report, TensorParallelRecord
from qcompile.passes import (
    annotate,
    correct_bias,
    equalize,
    fold_bn,
    insert_adapters,
    insert_quant,
    overwrite_inputs,
    partition,
    place,
    plan_tensor_parallel,
    round_adaround,
    round_gptq,
    smooth,
    trace,
)
from qcompile.passes.trace.capture_symbolic import refuse_lost_leaf_hooks
from qcompile.passes.trace.saving import keep_whole
from qcompile.runtime import recompute
from qcompile.runtime.frozen import FrozenWeight
from qcompile.specs import CompileSpec
from qcompile.version import __version__

# The pass serving each ``quant.algorithms`` kind (one run per entry, in the spec's order).
# The rewrites run after fold_bn; the data-driven ones plan after insert_quant (they need
# the weight quantizers) and run in ``qc.calibrate`` (``DATA_ALGORITHMS``).
ALGORITHM_PASSES: dict[str, Pass] = {
    "cross_layer_equalization": equalize.equalize,
    "smoothquant": smooth.smooth,
    "bias_correction": correct_bias.correct_bias,
    "adaround": round_adaround.round_adaround,
    "gptq": round_gptq.round_gptq,
}
# What ``qc.calibrate`` runs for each data-driven kind: (record name, function).
DATA_ALGORITHMS: dict[str, tuple[str, Applier]] = {
    "bias_correction": ("correct_bias", correct_bias.apply),
    "adaround": ("round_adaround", round_adaround.apply),
    "gptq": ("round_gptq", round_gptq.apply),
}


def default_passes(spec: CompileSpec) -> list[Pass]:
    """The fixed pass order for a spec; quantization passes only when quantizing."""
    passes = [trace.trace]
    if spec.quant.mode != "none":
        kinds = [a.kind for a in spec.quant.algorithms]
        passes += [fold_bn.fold_bn]
        passes += [ALGORITHM_PASSES[k] for k in kinds if k not in DATA_ALGORITHMS]
        passes += [annotate.annotate, insert_quant.insert_quant]
        passes += [ALGORITHM_PASSES[k] for k in kinds if k in DATA_ALGORITHMS]
    if spec.adapters:
        passes += [insert_adapters.insert_adapters]
    if spec.tensor_parallel is not None:
        passes += [plan_tensor_parallel.plan_tensor_parallel]
    if spec.pipeline is not None:
        passes += [partition.partition, place.place]
    if spec.quant.mode != "none":
        passes += [overwrite_inputs.overwrite_inputs]  # last: the graphs as they will run
    return passes


def as_inputs(example_inputs: Any) -> tuple[Any, ...] | None:
    """``example_inputs`` as a tuple (a single tensor becomes a 1-tuple), or None."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise QCompileError(f"example_inputs must be a tuple of inputs, got "
                        f"{type(example_inputs).__name__}", fix="pass example_inputs=(x,)")


def parameter_count(gm: nn.Module) -> int:
    """Parameter elements of ``gm``, a frozen base counted as the weight it stores (its
    packed codes and scales are not elements of the model)."""
    total = 0
    for m in gm.modules():
        if isinstance(m, FrozenWeight):
            total += m.rows * m.cols
        else:
            total += sum(p.numel() for p in m.parameters(recurse=False))
    return total


def _balance_ratio(ctx: Context) -> float | None:
    costs = [s.cost for s in ctx.stages]
    if not costs or sum(costs) == 0:
        return None
    return max(costs) / (sum(costs) / len(costs))


def compile_model(model: nn.Module, spec: CompileSpec, example_inputs: Any = None, *,
                  example_kwargs: dict[str, Any] | None = None,
                  instruments: Sequence[Instrument] = (), inplace: bool = False
                  ) -> GraphModule:
    """Run ``default_passes(spec)`` on ``model`` and attach the ``Report`` (``gm.meta``).

    The checks users see first (model type, wrapped models) are the callers' own."""
    ctx = Context(spec=spec, model=model, example_inputs=as_inputs(example_inputs),
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
    if ctx.trace_method == "symbolic" and spec.quant.mode != "none":
        # leaves whose hooks a later pass replaced by operations: refused, never lost
        refuse_lost_leaf_hooks(model, gm, spec.trace.leaf_modules, spec.quant.mode)
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
        parameters_quantized=(None if ctx.parameters_quantized is None else round(
            ctx.parameters_quantized[0] / max(ctx.parameters_quantized[1], 1), 4)),
        weights_quantized=ctx.weights_quantized,
        stages=ctx.stages,
        balance=ctx.balance,
        balance_ratio=_balance_ratio(ctx),
        adapters=ctx.adapters,
        tensor_parallel=[TensorParallelRecord(**vars(p)) for p in ctx.tensor_parallel],
        trainable_parameters=sum(p.numel() for p in gm.parameters() if p.requires_grad),
        parameters=parameter_count(gm),
        trainable=insert_adapters.trainable_records(gm),
        total_seconds=time.perf_counter() - t0,
    )
    gm.meta[SYNC_OBSERVERS_KEY] = spec.quant.sync_observers
    gm.meta[SPEC_KEY] = spec
    # the pipeline's top graph and stages are built after tracing: mark them compiled too
    for m in gm.modules():
        if isinstance(m, GraphModule):
            m.meta.setdefault(COMPILED_KEY, gm.meta.get(COMPILED_KEY))
    if spec.quant.mode != "none" and spec.train.recompute_weights:
        # autograd keeps the weights, not their fake-quantized copies: the graph and each
        # stage (the graph whose code consumes a quantizer's output runs with the hooks)
        for m in gm.modules():
            if isinstance(m, GraphModule):
                recompute.install(m)
    if spec.quant.mode != "none":
        finite.install(gm, spec.train.check_finite)  # NaN / inf in the first steps: an error
    keep_whole(gm)  # torch.save(gm) saves the whole graph (qc.qcompile's and compile_once's)
    for inst in instruments:
        inst.finish(report, gm)
    return gm
