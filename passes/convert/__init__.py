"""``convert``: lower a fake-quant graph to integer kernels for inference (``qc.convert``).

Runs on a copy that ``qc.convert`` made and checked (calibrated or trained, frozen, eval
mode), as a ``Pipeline`` of conversion passes, each its own module with its own
``PassRecord`` in the report (``convert.<step>``) and its own graph dump:

1. ``collect_weights``: every integer weight as integers, once (the fake-quant's grid).
2. ``fold_batchnorm``: in QAT graphs BatchNorm after a conv is folded here: the integer
   weights stay as they are and the per-channel scales absorb ``gamma / sqrt(var + eps)``.
3. ``lower_activations``: 8-bit per-tensor activation quantizers become
   ``quantize_per_tensor`` -> ``dequantize`` (real uint8 values in between), so what is
   not a kernel reads the same numbers as the fake-quant graph; the scale and zero point
   are buffers of an ``ActivationQParams`` in the quantizer's place, read by the code,
   so the state dict carries them. Other activation
   quantizers (per-token, fp8, not 8-bit) stay ``FakeQuantize`` (observers frozen):
   simulated, with a note saying so.
4. ``sink_dequantize``: shape ops and max-pooling run on the quantized tensor directly
   (``dequantize`` commutes with them exactly); dropout is removed.
5. ``use_kernels``: **integer kernels** (``torch.ops.quantized`` through torch's own
   modules, packed with the engine ``quant.target`` asks for: x86 (7-bit activations, exact
   on every x86 CPU), qnnpack, or x86 on a VNNI CPU (``qcompile.runtime.engines``)):
   ``linear`` / ``conv1-3d`` (+ ReLU) between 8-bit per-tensor activation
   quantizers with an int8 symmetric per-tensor or per-channel (axis 0) weight become
   ``nnq.Linear`` / ``nniq.LinearReLU`` / ``nnq.Conv2d`` / ...; ``add`` (+ ReLU) between
   two such tensors becomes ``quantized::add``; in dynamic graphs ``linear`` becomes
   ``quantized::linear_dynamic`` (``DynamicLinear``).
6. ``use_recurrent_kernels``: dynamic LSTM / GRU / RNN and their cells become torch's
   dynamic int8 recurrent modules (``torch.ao.nn.quantized.dynamic``) built from the
   graph's integer weights, or the same recurrence on ``quantized::linear_dynamic``.
7. ``store_weights``: **int-storage weights** for everything else (int4 packed two per
   byte, per-group scales, weights used by embedding/matmul, ops without a quantized
   input): an ``IntWeight`` module returns the dequantized weight to the float op.
   Block-format weights (MX, NVFP4, NF4) become a ``BlockWeight``
   (``qcompile.runtime.block_storage``) in their own bits.
8. ``tidy``: ``quantized::add`` reads its output qparams from those buffers too; the float
   parameters leave the state dict; new modules take their layers' names. A converted
   graph's state dict therefore holds every qparam it computes with:
   ``int8_a.load_state_dict(int8_b.state_dict())`` gives ``int8_b``'s outputs exactly.

The steps share a ``Conversion`` (integer weights, folded biases, conversion records)
on the ``Context`` (``ctx.conversion``); ``convert_graph`` runs them on one graph.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> spec = qc.load_spec("int8-static").model_copy(deep=True)
    >>> gm = qc.qcompile(m, spec, example_inputs=(torch.randn(2, 8),))
    >>> gm = qc.calibrate(gm, [(torch.randn(16, 8),) for _ in range(4)], progress=False)
    >>> int8 = qc.convert(gm)
    >>> sorted({r.path for r in qc.report(int8).conversions})  # the input quantized too
    ['kernel', 'quantize']
    >>> [p.name for p in qc.report(int8).passes][5:]  # doctest: +NORMALIZE_WHITESPACE
    ['convert.collect_weights', 'convert.fold_batchnorm', 'convert.lower_activations',
     'convert.sink_dequantize', 'convert.use_kernels', 'convert.use_recurrent_kernels',
     'convert.store_weights', 'convert.tidy']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch.fx
from torch.fx import GraphModule

from qcompile.graph.context import Context
from qcompile.graph.pipeline import Instrument, Pass, Pipeline
from qcompile.graph.records import ConversionRecord, PassRecord, Report
from qcompile.passes.convert.collect_weights import collect_weights
from qcompile.passes.convert.common import Conversion, state, torch_deprecations_silenced
from qcompile.passes.convert.fold_batchnorm import fold_batchnorm
from qcompile.passes.convert.lower_activations import lower_activations
from qcompile.passes.convert.sink_dequantize import sink_dequantize
from qcompile.passes.convert.store_weights import store_weights
from qcompile.passes.convert.tidy import tidy
from qcompile.passes.convert.use_kernels import use_kernels
from qcompile.passes.convert.use_recurrent_kernels import use_recurrent_kernels
from qcompile.runtime.engines import require_engine, use_engine
from qcompile.specs import CompileSpec

__all__ = ["CONVERSION_PASSES", "GRAPH_FACT", "conversion_pipeline", "convert_graph",
           "torch_deprecations_silenced"]

#: The conversion steps, in the order they run.
CONVERSION_PASSES: tuple[Pass, ...] = (collect_weights, fold_batchnorm, lower_activations,
                                       sink_dequantize, use_kernels, use_recurrent_kernels,
                                       store_weights, tidy)
#: What the pipeline starts from: a checked fake-quant graph, frozen, in eval mode.
GRAPH_FACT = "frozen_graph"


def conversion_pipeline(prefix: str = "convert.",
                        passes: Sequence[Pass] = CONVERSION_PASSES) -> Pipeline:
    """The checked ``Pipeline`` of ``passes``, their records named ``<prefix><step>``."""
    return Pipeline(tuple(replace(p, name=prefix + p.name) for p in passes),
                    initial_facts=frozenset({GRAPH_FACT}))


class _Numbered:
    """An instrument seeing pass numbers that continue from ``offset`` (dumps of the
    conversion steps follow the compile passes' dumps in the same folder)."""

    def __init__(self, inner: Instrument, offset: int) -> None:
        self.inner, self.offset = inner, offset

    def after_pass(self, index: int, record: PassRecord, gm: torch.fx.GraphModule,
                   ctx: Context) -> None:
        self.inner.after_pass(index + self.offset, record, gm, ctx)

    def finish(self, report: Report, gm: torch.fx.GraphModule) -> None:
        self.inner.finish(report, gm)


def convert_graph(gm: GraphModule, spec: CompileSpec | None = None, *,
                  prefix: str = "convert.", instruments: Sequence[Instrument] = (),
                  first_index: int = 1, rows_only: bool = False
                  ) -> tuple[list[ConversionRecord], list[PassRecord]]:
    """Rewrite ``gm`` (a checked copy, frozen, in eval mode) in place through the
    conversion pipeline; returns what became what and one ``PassRecord`` per step.
    Instruments see the steps numbered from ``first_index``. ``rows_only``: ``gm`` holds
    one rank's rows of a sharded graph (``sharded.local_rows_copy``): every weight is
    stored as integers laid out by rows, no kernels."""
    ctx = Context(spec=spec if spec is not None else CompileSpec(), model=gm)
    ctx.conversion = Conversion(rows_only=rows_only)  # collect_weights keeps the option
    # Kernels are packed with the engine that computes what quant.target simulated (packed
    # weights keep their engine); a target this CPU cannot honour is refused here.
    engine = require_engine(ctx.spec.quant.target)
    numbered = [_Numbered(i, first_index - 1) for i in instruments]
    # the steps build torch's quantized modules and tensors (a deprecated torch API)
    with use_engine(engine), torch_deprecations_silenced():
        out, passes = conversion_pipeline(prefix).run(ctx, gm, numbered)
    assert out is gm, "conversion steps rewrite the graph in place"
    return state(ctx).records(), passes
