"""The whole spec: ``CompileSpec`` and its parallel-placement and tracing sections.

Example:
    >>> from qcompile.specs import CompileSpec
    >>> spec = CompileSpec.model_validate({"quant": {"mode": "none"},
    ...                                    "pipeline": {"stages": 2, "devices": ["cpu", "cpu"]}})
    >>> spec.pipeline.num_stages
    2
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from qcompile.specs.adapters import AdapterList
from qcompile.specs.quant import Frozen, QuantSpec

# Device strings are checked for form here (torch-free); whether the device exists on this
# machine is checked when compiling. Only devices that execute: ``meta`` holds no data, so
# a stage placed there would compute nothing.
_DEVICE = re.compile(r"(cpu|cuda|xpu|mps|hpu|npu)(:\d+)?")
TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16",
                "int8", "uint8", "bool")


def _check_device(d: str) -> str:
    if d.partition(":")[0] == "meta":
        raise ValueError(f"device {d!r} holds no data and runs nothing: a stage must run on an "
                         "execution device such as 'cpu', 'cuda' or 'cuda:1'")
    if not _DEVICE.fullmatch(d):
        raise ValueError(f"device {d!r} is not a device string like 'cpu', 'cuda' or 'cuda:1'")
    return d


# A device checked on its own: an error's location names its index (pipeline.devices.1).
Device = Annotated[str, AfterValidator(_check_device)]


class DataParallelSpec(Frozen):
    """How the compiled model is replicated across ranks (``qcompile.distributed.wrap``)."""

    kind: Literal["none", "ddp", "fsdp2"] = "none"


TP_STYLES = ("colwise", "rowwise", "sequence", "replicate")


class TensorParallelSpec(Frozen):
    """Layers sharded across the ``tp`` mesh dim (``torch.distributed.tensor.parallel``).

    ``plan: auto`` finds attention and MLP pairs in the graph (a Linear whose sharded output
    reaches another Linear only through per-head or elementwise ops is ``colwise``, that one
    ``rowwise``), the LM head (``colwise``, logits gathered) and the embedding (``rowwise``,
    by vocabulary); or name them: ``{<name glob>: colwise | rowwise | sequence |
    replicate}``, first match wins, unmatched layers replicated. ``sequence`` names norm
    modules (``'*.input_layernorm'``): the norms and the residual stream between the blocks
    then run on each rank's tokens (sequence parallelism, as torchtitan plans it); a plan
    naming only norms plans the layers as ``auto`` does. A mixture of experts (one
    ``[experts, ...]`` weight per grouped matmul) is sharded by expert under ``auto`` where
    ``size`` divides the experts, else within each expert; an explicit plan slices it within
    each expert where it names its gate/up weight ``colwise`` and its down weight
    ``rowwise`` (``'*.experts.gate_up_proj': colwise``).

    Example:
        >>> TensorParallelSpec(size=2, plan={"*.q_proj": "colwise", "*.o_proj": "rowwise"}).size
        2
    """

    size: StrictInt = Field(ge=1, description="ranks each layer is sharded across (the tp "
                            "mesh dim, innermost: inside a node)")
    plan: Literal["auto"] | dict[str, Literal[TP_STYLES]] = Field(  # type: ignore[valid-type]
        "auto", description="auto, or {<layer name glob>: colwise | rowwise | sequence | "
        "replicate}")

    @field_validator("plan")
    @classmethod
    def _plan(cls, v: object) -> object:
        if isinstance(v, dict) and not v:
            raise ValueError("plan is empty: give auto, or at least one "
                             "{<layer name glob>: colwise | rowwise | sequence | replicate}")
        return v


class StageSpec(Frozen):
    """One explicit pipeline stage: the modules (qualified-name globs) it holds."""

    modules: list[str] = Field(min_length=1, description="qualified-name globs of the "
                               "modules the stage holds")
    device: Device | None = Field(None, description="where the stage runs")


class PipelineSpec(Frozen):
    """Pipeline placement: ``stages`` is a count (cost-balanced) or an explicit list."""

    stages: StrictInt | list[StageSpec] = Field(
        1, description="a count (cost-balanced stages) or a list of explicit stages")
    devices: list[Device] | None = Field(None, description="one device per stage")
    balance: Literal["params", "flops", "time"] = Field(
        "params", description="the cost model that balances a count of stages")
    microbatches: StrictInt = Field(1, ge=1, description="micro-batches per step")
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "gpipe", description="the torch.distributed.pipelining schedule")
    transfer: Literal["fp32", "int8"] = Field(
        "fp32", description="what crosses a cut: float values, or int8 (forward only)")
    allow_tied: bool = Field(True, description="parameters shared between stages are allowed")

    @field_validator("stages")
    @classmethod
    def _positive(cls, v: int | list[StageSpec]) -> int | list[StageSpec]:
        if isinstance(v, int) and v < 1:
            raise ValueError("stages must be at least 1")
        if isinstance(v, list) and not v:
            raise ValueError("stages must list at least one stage")
        return v

    @model_validator(mode="after")
    def _devices_fit(self) -> PipelineSpec:
        if self.devices is not None and len(self.devices) != self.num_stages:
            raise ValueError(
                f"devices lists {len(self.devices)} devices for {self.num_stages} stages: "
                "give one device per stage"
            )
        return self

    @property
    def num_stages(self) -> int:
        return self.stages if isinstance(self.stages, int) else len(self.stages)


class InputSpec(Frozen):
    """An example input described by shape and dtype (zeros are fed when tracing)."""

    shape: list[StrictInt] = Field(min_length=0, description="the input's shape")
    dtype: Literal[TORCH_DTYPES] = Field(  # type: ignore[valid-type]
        "float32", description="the input's dtype")

    @field_validator("shape")
    @classmethod
    def _nonneg(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError(f"shape {v} has a negative dimension")
        return v


class DynamicDim(Frozen):
    """A named dynamic dimension with optional bounds (``{name: seq, max: 512}``)."""

    name: str = Field(description="dims with the same name are equal")
    min: StrictInt | None = Field(None, ge=0, description="the smallest size allowed")
    max: StrictInt | None = Field(None, ge=1, description="the largest size allowed")

    @model_validator(mode="after")
    def _ordered(self) -> DynamicDim:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"dynamic dim {self.name}: min {self.min} > max {self.max}")
        return self


class TraceSpec(Frozen):
    """How the model is captured as a graph."""

    method: Literal["auto", "symbolic", "export"] = Field(
        "auto", description="symbolic: torch.fx symbolic tracing; export: torch.export; "
        "auto: symbolic, then export if it fails")
    leaf_modules: list[str] = Field(
        default_factory=list,
        description="modules kept as single nodes: class names, dotted class paths or "
        "qualified-name globs",
    )
    concrete_args: dict[str, bool | int | float | str | None] = Field(
        default_factory=dict, description="forward() arguments fixed to constants while "
        "tracing, e.g. {use_cache: false}")
    inputs: list[InputSpec] | None = Field(None, description="example inputs by shape and "
                                           "dtype (zeros) when none are passed")
    dynamic_dims: dict[str, dict[int, str | DynamicDim]] = Field(
        default_factory=dict,
        description="export: forward() argument -> {dim index: name or {name, min, max}}; "
        "dims with the same name are equal, e.g. {input_ids: {0: batch, 1: seq}}",
    )
    stack_traces: StrictBool = Field(
        False,
        description="export: record the source stack of each node (node.meta['stack_trace'], "
        "for debugging the graph); off, the export costs ~12% less. Symbolic tracing "
        "records none",
    )

    @field_validator("dynamic_dims", mode="before")
    @classmethod
    def _dim_indices(cls, v: object) -> object:
        # Lax pydantic would read a `true:` key as dim 1 and `1.0:` as dim 1; JSON keys are
        # strings ("0"), which stay allowed.
        for arg, dims in (v.items() if isinstance(v, dict) else ()):
            for d in dims if isinstance(dims, dict) else ():
                if isinstance(d, (bool, float)):
                    raise ValueError(f"dynamic_dims.{arg}: dim index {d!r} is not an integer; "
                                     "give dims by index, e.g. {0: batch, 1: seq}")
        return v

    @field_validator("dynamic_dims")
    @classmethod
    def _dim_names(cls, v: dict[str, dict[int, str | DynamicDim]]
                   ) -> dict[str, dict[int, str | DynamicDim]]:
        for arg, dims in v.items():
            for d, dim in dims.items():
                name = dim if isinstance(dim, str) else dim.name
                if not name.isidentifier():
                    raise ValueError(f"dynamic_dims.{arg}.{d}: {name!r} is not a valid name "
                                     "(letters, digits, _)")
        return v


class TrainSpec(Frozen):
    """How ``qcompile.distributed.train_step`` runs an optimizer step."""

    accumulate: StrictInt = Field(1, ge=1, description="micro-batches per optimizer step; "
                                  "with DDP, gradients are all-reduced on the last one only")
    recompute_weights: StrictBool = Field(
        True, description="autograd keeps the float weight, not its fake-quantized copy, and "
        "recomputes the copy in backward: a QAT step holds what a float step holds (under "
        "FSDP2, no unsharded weight outlives its layer); false keeps the copies (one weight "
        "per layer more, no recomputation)")
    check_finite: StrictInt = Field(
        10, ge=0, description="optimizer steps, from the first training forward, in which "
        "every quantizer's input is checked for NaN and infinity: the first one is an error "
        "naming the quantizer, its node and the op upstream that made it (a division, root, "
        "exp or log), not a NaN loss later; costs one pass over each quantized tensor in "
        "those steps; 0 turns the check off")


class CompileSpec(Frozen):
    """Everything ``qcompile`` needs to know besides the model."""

    version: Literal[1] = Field(1, description="the spec format's version")
    quant: QuantSpec = Field(default_factory=QuantSpec, description="how to quantize")
    data_parallel: DataParallelSpec = Field(default_factory=DataParallelSpec,
                                            description="how ranks replicate the graph")
    pipeline: PipelineSpec | None = Field(None, description="pipeline stages and their "
                                          "devices; null for none")
    tensor_parallel: TensorParallelSpec | None = Field(
        None, description="layers sharded across ranks (tensor parallelism); null for none")
    cache_dir: str | None = Field(None, description="folder for compile_once's cache; null "
                                  "for no cache")
    trace: TraceSpec = Field(default_factory=TraceSpec, description="how the model is "
                             "captured as a graph")
    train: TrainSpec = Field(default_factory=TrainSpec, description="how training steps run")
    adapters: AdapterList = Field(
        default_factory=list, description="trainable adapters (LoRA) on matched Linear "
        "layers, their base weights frozen, and modules trained in full next to them (kind: "
        "full); everything else stops training (qcompile.specs.adapters)")

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: object) -> object:
        # Literal[1] alone accepts `version: true` (True == 1) and 1.0.
        if type(v) is not int:
            raise ValueError(f"version must be the integer 1, got {v!r}")
        return v

    @model_validator(mode="after")
    def _adapters_fit(self) -> CompileSpec:
        data = [a.kind for a in self.quant.algorithms if a.kind in ("adaround", "gptq")]
        frozen = [i for i, a in enumerate(self.adapters)
                  if a.kind == "lora" and a.base == "frozen" and not a.skip]
        if data and frozen:
            raise ValueError(
                f"adapters[{frozen[0]}] stores its base frozen when compiling, and "
                f"quant.algorithms {data[0]} rounds weights later, in qc.calibrate: round the "
                "model first (qc.qcompile + qc.calibrate without adapters), or use base: qat")
        return self

    @field_validator("cache_dir")
    @classmethod
    def _cache_dir(cls, v: str | None) -> str | None:
        # "" would be the current folder (Path("") is "."): cache entries among the user's
        # files, never what an empty value means
        if v is not None and not v.strip():
            raise ValueError(f"cache_dir {v!r} is empty: give null (no cache) or a folder "
                             "path such as .qcompile-cache")
        return v
