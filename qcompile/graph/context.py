"""``Context``: the per-compile state passes read (spec, model, inputs) and write (notes,
facts, quantizer records). One is made per ``qcompile`` call; nothing is module-level.

Example:
    >>> import torch
    >>> from qcompile.graph.context import Context
    >>> from qcompile.specs import CompileSpec
    >>> ctx = Context(spec=CompileSpec(), model=torch.nn.Linear(2, 2))
    >>> ctx.note("hello"); ctx.notes
    ['hello']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qcompile.graph.records import AdapterRecord, QuantizerRecord, StageRecord
from qcompile.specs import CompileSpec


@dataclass
class Context:
    """State shared by the passes of one compilation."""

    spec: CompileSpec
    model: torch.nn.Module
    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: dict[str, Any] | None = None
    inplace: bool = False  # the graph may take the model's modules instead of copies
    notes: list[str] = field(default_factory=list)
    quantizers: list[QuantizerRecord] = field(default_factory=list)
    rule_matches: dict[int, list[str]] = field(default_factory=dict)
    # (parameter elements behind a weight quantizer, all parameter elements): insert_quant
    parameters_quantized: tuple[int, int] | None = None
    weights_quantized: Any = None  # insert_quant: a WeightCoverage
    trace_method: str | None = None
    has_shapes: bool = False
    shapes: str | None = None  # how node shapes were recorded (Report.shapes)
    code_state: Any = None  # what the graph's code was last generated from (pipeline.py)
    # the pass running may leave the graph's code ungenerated: the next pass does not
    # need it and the pipeline generates it later (pipeline.py)
    code_may_wait: bool = False
    stages: list[StageRecord] = field(default_factory=list)
    adapters: list[AdapterRecord] = field(default_factory=list)  # insert_adapters
    balance: str | None = None
    tensor_parallel: list[Any] = field(default_factory=list)  # plan_tensor_parallel's layers
    conversion: Any = None  # qc.convert: the state its steps share (passes/convert)
    algorithms_run: int = 0  # quant.algorithms entries whose passes have run, in order

    def note(self, message: str) -> None:
        """Record a note for the running pass (it lands in the Report)."""
        self.notes.append(message)
