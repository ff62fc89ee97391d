"""Pydantic spec models (torch-free) and the presets in ``presets/``.

Example:
    >>> import qcompile.specs as s
    >>> s.CompileSpec().quant.mode
    'none'
"""

from qcompile.specs.adapters import AdapterSpec
from qcompile.specs.compile import (
    CompileSpec,
    DataParallelSpec,
    InputSpec,
    PipelineSpec,
    StageSpec,
    TraceSpec,
    TrainSpec,
)
from qcompile.specs.load import as_spec, dump_spec, load_spec, presets, save_spec
from qcompile.specs.quant import (
    ALGORITHM_KINDS,
    DATA_KINDS,
    DTYPES,
    FP8_MAX,
    GPTQ,
    AdaRound,
    Algorithm,
    BiasCorrection,
    Budget,
    Candidate,
    CrossLayerEqualization,
    Match,
    QuantSpec,
    Rule,
    Scheme,
    SearchSpec,
    SmoothQuant,
)

__all__ = [
    "ALGORITHM_KINDS",
    "DATA_KINDS",
    "DTYPES",
    "FP8_MAX",
    "GPTQ",
    "AdaRound",
    "AdapterSpec",
    "Algorithm",
    "BiasCorrection",
    "Budget",
    "Candidate",
    "CompileSpec",
    "CrossLayerEqualization",
    "DataParallelSpec",
    "InputSpec",
    "Match",
    "PipelineSpec",
    "QuantSpec",
    "Rule",
    "Scheme",
    "SearchSpec",
    "SmoothQuant",
    "StageSpec",
    "TraceSpec",
    "TrainSpec",
    "as_spec",
    "dump_spec",
    "load_spec",
    "presets",
    "save_spec",
]
