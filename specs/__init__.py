"""Pydantic spec models (torch-free) and the presets in ``presets/``.

Example:
    >>> import qcompile.specs as s
    >>> s.CompileSpec().quant.mode
    'none'
"""

from qcompile.specs.compile import (
    CompileSpec,
    DataParallelSpec,
    InputSpec,
    PipelineSpec,
    StageSpec,
    TraceSpec,
    TrainSpec,
)
from qcompile.specs.load import as_spec, dump_spec, load_spec, presets
from qcompile.specs.quant import (
    DTYPES,
    FP8_MAX,
    Match,
    QuantSpec,
    Rule,
    Scheme,
)

__all__ = [
    "DTYPES",
    "FP8_MAX",
    "CompileSpec",
    "DataParallelSpec",
    "InputSpec",
    "Match",
    "PipelineSpec",
    "QuantSpec",
    "Rule",
    "Scheme",
    "StageSpec",
    "TraceSpec",
    "TrainSpec",
    "as_spec",
    "dump_spec",
    "load_spec",
    "presets",
]
