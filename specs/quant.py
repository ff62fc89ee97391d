"""The ``quant`` section of a spec: how to quantize, and which nodes.

Torch-free on purpose: specs validate (and ``qcompile-inspect validate`` runs) without
importing torch.

Example:
    >>> from qcompile.specs import QuantSpec
    >>> q = QuantSpec.model_validate({"mode": "qat", "rules": [
    ...     {"match": {"module": "Linear"}, "weight": {"dtype": "int4",
    ...      "granularity": "per_group", "group_size": 32}}]})
    >>> q.rules[0].weight.qrange()
    (-8, 7)
    >>> q.target, q.reduce_range  # x86 kernels read 8-bit activations in 7 bits
    ('x86', True)
    >>> Scheme(dtype="uint8").qrange(reduce_range=q.reduce_range)
    (0, 127)
    >>> QuantSpec.model_validate({"mode": "static", "inputs": "auto"}).inputs  # as torch.ao
    'auto'
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    field_validator,
    model_validator,
)

INT_DTYPES = tuple(f"int{b}" for b in range(2, 17))
UINT_DTYPES = tuple(f"uint{b}" for b in range(2, 17))
FLOAT_DTYPES = ("fp8_e4m3", "fp8_e5m2")
# Block-scaled formats: each element block shares a scale computed from the block itself.
# Value: (default block size, whether the format allows another). OCP MX v1.0 fixes 32-element
# blocks with E8M0 scales; NVFP4 16-element blocks with E4M3 scales under one FP32 tensor scale;
# QLoRA's NF4 uses 64 by default and any (even) block size. llama.cpp's GGUF types (q8_0,
# q4_0, q4_1: 32-element blocks with fp16 scales; q4_k, q6_k: 256-element super-blocks of
# 32 / 16 with 6-bit / 8-bit sub-block scales under fp16 ones; q8_k: the 256-element
# activation blocks llama.cpp's CPU matmul makes for K-type weights) are fixed by the format.
BLOCK_SIZES: dict[str, tuple[int, bool]] = {
    "mxfp8_e4m3": (32, False), "mxfp8_e5m2": (32, False), "mxfp6_e3m2": (32, False),
    "mxfp6_e2m3": (32, False), "mxfp4": (32, False), "nvfp4": (16, False), "nf4": (64, True),
    "q8_0": (32, False), "q4_0": (32, False), "q4_1": (32, False), "q4_k": (256, False),
    "q6_k": (256, False), "q8_k": (256, False),
}
BLOCK_DTYPES = tuple(BLOCK_SIZES)
# The largest finite element magnitude of each block format (NF4: levels in [-1, 1];
# llama.cpp's grids: the largest integer code's magnitude).
BLOCK_ELEMENT_MAX = {"mxfp8_e4m3": 448.0, "mxfp8_e5m2": 57344.0, "mxfp6_e3m2": 28.0,
                     "mxfp6_e2m3": 7.5, "mxfp4": 6.0, "nvfp4": 6.0, "nf4": 1.0,
                     "q8_0": 127.0, "q4_0": 8.0, "q4_1": 15.0, "q4_k": 15.0, "q6_k": 32.0,
                     "q8_k": 127.0}
DTYPES = INT_DTYPES + UINT_DTYPES + FLOAT_DTYPES + BLOCK_DTYPES

# The largest finite magnitude of each fp8 format (OCP FP8: e4m3 "fn" variant, e5m2).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}

QDtype = Literal[DTYPES]  # type: ignore[valid-type]
Granularity = Literal["per_tensor", "per_channel", "per_group", "per_token"]
Mode = Literal["none", "dynamic", "static", "qat"]
Target = Literal["x86", "qnnpack", "onednn_vnni", "generic"]

# The 8-bit integer dtypes whose activations a target may read in 7 bits.
REDUCIBLE_DTYPES = ("uint8", "int8")


def reduces_activation_range(target: str) -> bool:
    """Whether ``target``'s integer kernels need 8-bit activations in the reduced 7-bit
    range (uint8 [0, 127], int8 [-64, 63]).

    True for ``x86``: fbgemm and onednn multiply u8 activations by s8 weights and, on CPUs
    without VNNI (AVX2, AVX-512 before Cascade Lake), add adjacent pairs of products into
    int16 with saturation (``vpmaddubsw``); a full-range pair reaches 255 * 128 * 2 = 65280
    and saturates, a 7-bit one at most 127 * 128 * 2 = 32512 never does. torch.ao's x86
    qconfig uses ``reduce_range`` for the same reason. ``qnnpack`` accumulates in int32
    exactly, ``onednn_vnni`` multiplies and adds in int32 (``vpdpbusd``), and ``generic``
    has no kernel to serve: full range.
    """
    return target == "x86"


class Frozen(BaseModel):
    """Base of every spec model: immutable, and unknown keys are errors.

    Every int field is strict (``StrictInt`` or ``strict=True``): lax pydantic reads
    ``true`` as 1 and ``2.0`` as 2, so ``microbatches: true`` would silently run one
    micro-batch. Float fields are strict too (ints are still floats, ``true`` is not), and
    finite: ``.inf`` or ``.nan`` in any float field is an error (``reg_weight: .inf`` would
    otherwise run, with every loss infinite).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class MinMaxObserver(Frozen):
    """Running min and max of everything observed."""

    kind: Literal["minmax"] = "minmax"


class MovingAverageObserver(Frozen):
    """Exponential moving average of each batch's min and max (torch.ao's MovingAverage...)."""

    kind: Literal["moving_average"] = "moving_average"
    momentum: float = Field(0.01, gt=0.0, le=1.0, strict=True,
                            description="weight of the newest batch")


class HistogramObserver(Frozen):
    """Histogram of values; the range minimising L2 quantization error is chosen."""

    kind: Literal["histogram"] = "histogram"
    bins: int = Field(2048, ge=16, le=65536, strict=True,
                      description="histogram bins over the observed range")


class PercentileObserver(Frozen):
    """Range clipped to the given percentile of |x| (or of x at each end, asymmetric)."""

    kind: Literal["percentile"] = "percentile"
    percentile: float = Field(99.99, gt=50.0, le=100.0, strict=True,
                              description="the range covers this percentile of |x|")


class MseObserver(Frozen):
    """Clip search minimising the mean squared quantization error."""

    kind: Literal["mse"] = "mse"
    steps: int = Field(100, ge=2, le=10000, strict=True,
                       description="candidate clip ratios searched")


ObserverSpec = Annotated[
    MinMaxObserver | MovingAverageObserver | HistogramObserver | PercentileObserver | MseObserver,
    Field(discriminator="kind"),
]


class Scheme(Frozen):
    """How one tensor (a weight, or a node's output) is quantized.

    A block-scaled ``dtype`` (``mxfp8_e4m3`` ... ``mxfp4``, ``nvfp4``, ``nf4``, and
    llama.cpp's GGUF grids ``q8_0``, ``q4_0``, ``q4_1``, ``q4_k``, ``q6_k`` and its
    activation blocks ``q8_k``) implies
    ``granularity: per_group`` with its block size as ``group_size`` (NF4 may set another,
    even, size); its scales come from each block of each tensor (weights and activations
    alike), so it takes no observer, no learnable scale and no asymmetric range. Blocks run
    along a weight's rows (its reduction dim) and an activation's last dim.

    >>> Scheme(dtype="nvfp4").group_size, Scheme(dtype="nf4", group_size=16).granularity
    (16, 'per_group')
    """

    dtype: QDtype = Field("int8", description="integer (int2..int16, uint2..uint16), fp8 or "
                          "block-scaled format the values take")
    symmetric: bool = Field(True, description="zero point fixed at the middle of the range "
                            "(0 for signed dtypes); false: affine, a zero point per scale")
    granularity: Granularity = Field(
        "per_tensor", description="how many scales: one per tensor, per channel (along axis), "
        "per group of group_size along the rows, or per token (each row, from each batch)")
    axis: StrictInt | None = Field(
        None,
        description="per_channel only: the channel dimension "
        "(default 0 for weights, 1 for activations)",
    )
    group_size: StrictInt | None = Field(None, ge=1,
                                         description="per_group only: elements per group")
    observer: ObserverSpec = Field(default_factory=MinMaxObserver,
                                   description="how the range is observed: a kind name or "
                                   "{kind: ..., <params>}")
    learnable: bool = Field(False, description="LSQ: the scale is a trained parameter (QAT)")

    @field_validator("observer", mode="before")
    @classmethod
    def _short_observer(cls, v: object) -> object:
        # `observer: minmax` is shorthand for `observer: {kind: minmax}`.
        return {"kind": v} if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _block_defaults(cls, data: object) -> object:
        # a block format's granularity and block size are implied by the dtype
        if not isinstance(data, dict) or data.get("dtype") not in BLOCK_SIZES:
            return data
        dtype = data["dtype"]
        block, free = BLOCK_SIZES[dtype]
        g = data.get("granularity", "per_group")
        if g != "per_group":
            raise ValueError(f"{dtype} is block-scaled (blocks of {block}): granularity is "
                             f"per_group, not {g}; leave granularity out")
        gs = data.get("group_size", block)
        if not free and gs != block:
            raise ValueError(f"{dtype} blocks are {block} elements by the format's "
                             f"definition, not {gs}: leave group_size out")
        if free and isinstance(gs, int) and not isinstance(gs, bool) and (gs < 2 or gs % 2):
            raise ValueError(f"{dtype} blocks pack two 4-bit values per byte: group_size "
                             f"must be even and at least 2, not {gs} (default {block})")
        return {**data, "granularity": "per_group", "group_size": gs}

    @model_validator(mode="after")
    def _granularity_fields(self) -> Scheme:
        if self.dtype in BLOCK_SIZES:
            if not self.symmetric:
                raise ValueError(f"{self.dtype} is a symmetric format: leave symmetric out"
                                 if self.dtype not in ("q4_1", "q4_k") else
                                 f"{self.dtype} stores its own minimum per block: leave "
                                 "symmetric out")
            if self.learnable:
                raise ValueError(f"{self.dtype} scales come from each block: learnable "
                                 "scales are for integer dtypes")
            if self.observer.kind != "minmax":
                raise ValueError(f"{self.dtype} scales come from each block of each tensor: "
                                 f"observer {self.observer.kind} does not apply; leave "
                                 "observer out")
            return self
        g = self.granularity
        if g == "per_group" and self.group_size is None:
            raise ValueError("granularity per_group needs group_size (e.g. group_size: 32)")
        if g != "per_group" and self.group_size is not None:
            raise ValueError(f"group_size is only used with granularity per_group, not {g}")
        if g != "per_channel" and self.axis is not None:
            raise ValueError(f"axis is only used with granularity per_channel, not {g}")
        if self.dtype in FLOAT_DTYPES and not self.symmetric:
            raise ValueError(f"{self.dtype} is a float format: it is symmetric only")
        if self.dtype in FLOAT_DTYPES and self.learnable:
            raise ValueError(f"learnable scales are for integer dtypes, not {self.dtype}")
        return self

    def qrange(self, *, reduce_range: bool = False) -> tuple[int, int]:
        """Integer range ``(quant_min, quant_max)`` of the dtype (fp8: +-largest finite).

        ``reduce_range``: the 7-bit range for 8-bit integer dtypes (uint8 [0, 127], int8
        [-64, 63]), as activation quantizers use on targets that need it (see
        ``reduces_activation_range``); other dtypes keep their full range.
        """
        if self.dtype in FP8_MAX:
            m = int(FP8_MAX[self.dtype])
            return -m, m
        if self.dtype in BLOCK_ELEMENT_MAX:  # the element format's range, rounded up
            m = -int(-BLOCK_ELEMENT_MAX[self.dtype] // 1)
            return -m, m
        bits = int(self.dtype.removeprefix("u").removeprefix("int"))
        if reduce_range and self.dtype in REDUCIBLE_DTYPES:
            bits -= 1
        if self.dtype.startswith("u"):
            return 0, 2**bits - 1
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def is_block(self) -> bool:
        """A block-scaled format (scales from each block; no observer, no state)."""
        return self.dtype in BLOCK_SIZES


def _as_list(v: object) -> object:
    return [v] if isinstance(v, str) else v


class Match(Frozen):
    """Which nodes a rule selects. Every given field must hold; a list means any of them.

    ``module``: class name of an owning module (``Linear``) or its dotted path
    (``torch.nn.modules.linear.Linear``), fnmatch globs allowed. ``name``: fnmatch glob on
    the owning module's whole qualified name (``encoder.*``). A node is owned by the module
    it calls and by every module enclosing it, so ``name: head`` also covers ``head.0``.
    ``op``: functional ops and tensor methods (``add``, ``matmul``, ``cat``, ``linear``).
    ``reads_weight: true``: only nodes that read a parameter or buffer as their weight
    (``F.linear(x, self.w)``, a router, experts of a mixture-of-experts layer behind
    ``grouped_mm`` / ``bmm`` / ``einsum``), not products of two activations.
    """

    module: list[str] | None = Field(None, description="class names or dotted class paths of "
                                     "an owning module (fnmatch globs)")
    name: list[str] | None = Field(None, description="fnmatch globs on an owning module's "
                                   "whole qualified name")
    op: list[str] | None = Field(None, description="functional ops and tensor methods "
                                 "(add, matmul, cat, linear, ...)")
    reads_weight: bool = Field(False, description="only nodes that read a parameter or buffer "
                               "as their weight")

    @field_validator("module", "name", "op", mode="before")
    @classmethod
    def _lists(cls, v: object) -> object:
        return _as_list(v)

    @model_validator(mode="after")
    def _something(self) -> Match:
        if not (self.module or self.name or self.op):
            raise ValueError("match needs at least one of module, name, op")
        return self


class Rule(Frozen):
    """One quantization rule: nodes it matches get its weight/activation schemes."""

    match: Match = Field(description="which nodes the rule selects")
    skip: bool = Field(False, description="matched nodes stay in float, whatever other rules say")
    weight: Scheme | None = Field(None, description="the scheme of the weights the matched "
                                  "nodes read")
    activation: Scheme | None = Field(None, description="the scheme of the matched nodes' "
                                      "outputs (or inputs, with activation_at: input)")
    optional: bool = Field(
        False, description="allow this rule to match nothing (otherwise that is an error)"
    )
    activation_at: Literal["output", "input"] = Field(
        "output", description="where the activation scheme applies: the matched node's "
        "output, or (weighted ops: linear, conv, matmul with a weight) the input it reads, "
        "as torchao's 8da4w and the block formats quantize the matmul's operand; dynamic "
        "mode always quantizes inputs")
    note: str | None = Field(
        None, description="what produced this rule; qc.search writes the measured "
        "sensitivity per candidate (qc.save_spec writes it as comment lines above the "
        "rule too)")

    @model_validator(mode="after")
    def _consistent(self) -> Rule:
        if self.skip and (self.weight or self.activation):
            raise ValueError("a skip rule takes no weight/activation scheme")
        if self.activation_at == "input" and self.activation is None:
            raise ValueError("activation_at: input needs an activation scheme")
        if not self.skip and not (self.weight or self.activation):
            raise ValueError("a rule needs a weight and/or activation scheme, or skip: true")
        if self.weight is not None and self.weight.granularity == "per_token":
            raise ValueError("weight: per_token is for activations; use per_channel or per_group")
        if (self.activation is not None and self.activation.granularity == "per_group"
                and not self.activation.is_block):
            raise ValueError(
                "activation: per_group is for weights; use per_token for activations"
            )
        return self


class CrossLayerEqualization(Frozen):
    """Cross-layer equalization (Nagel et al. 2019, as AIMET does it): for consecutive
    conv/linear layers joined through ReLU (or nothing), scale output channel ``i`` of the
    first by ``1/s_i`` and input channel ``i`` of the second by ``s_i`` so both have the
    same per-channel range. Exact in float (ReLU is positively homogeneous)."""

    kind: Literal["cross_layer_equalization"] = "cross_layer_equalization"


class SmoothQuant(Frozen):
    """SmoothQuant (Xiao et al. 2023): divide a Linear's input channel ``j`` by
    ``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` (folded into the LayerNorm or Linear
    producing it) and multiply the weight's column ``j`` by ``s_j``. Exact in float;
    activation statistics come from the example inputs."""

    kind: Literal["smoothquant"] = "smoothquant"
    alpha: float = Field(0.5, ge=0.0, le=1.0, strict=True,
                         description="migration strength: 0 keeps activations, 1 moves "
                         "all of their range into the weights")


class BiasCorrection(Frozen):
    """Empirical bias correction (Nagel et al. 2019, as AIMET and NNCF do it): for each
    quantized conv/linear layer, in graph order, add to its bias the difference between
    the float model's mean output per channel and the quantized model's (with the layers
    before it already quantized and corrected), both measured on the calibration batches.
    A layer without a bias gets one (zeros plus the correction)."""

    kind: Literal["bias_correction"] = "bias_correction"


class AdaRound(Frozen):
    """AdaRound (Nagel et al. 2020): learn, per weight, whether to round down or up, so
    that the layer's output on the calibration batches (inputs from the model with the
    layers before it already rounded) stays closest to the float layer's. The scales are
    the weight quantizer's; only the integers change."""

    kind: Literal["adaround"] = "adaround"
    iterations: int = Field(1000, ge=1, le=1_000_000, strict=True,
                            description="optimizer steps per layer")
    reg_weight: float = Field(3.0, gt=0.0, strict=True,
                              description="weight of the term pushing each rounding to 0 or 1 "
                              "(its mean per weight, against the output error relative to "
                              "round-to-nearest's)")
    lr: float = Field(0.05, gt=0.0, le=10.0, strict=True, description="Adam learning rate")
    warmup: float = Field(0.2, ge=0.0, lt=1.0, strict=True,
                          description="share of the iterations before the rounding term starts")


class GPTQ(Frozen):
    """GPTQ (Frantar et al. 2023): round each weight column in turn and move its rounding
    error onto the columns not yet rounded, weighted by the inverse Hessian ``X^T X`` of
    the layer's inputs on the calibration batches (from the model with the layers before it
    already rounded). Per-tensor, per-channel and per-group scales are the weight
    quantizer's; only the integers change."""

    kind: Literal["gptq"] = "gptq"
    block_size: int = Field(128, ge=1, le=65536, strict=True,
                            description="columns rounded together before the lazy update")
    damp: float = Field(0.01, gt=0.0, le=1.0, strict=True,
                        description="added to the Hessian's diagonal, as a share of its mean")
    act_order: bool = Field(False, strict=True,
                            description="round columns in order of decreasing Hessian "
                            "diagonal (largest input energy first)")


# Only implemented kinds: an unknown kind is a ValidationError listing these.
Algorithm = Annotated[CrossLayerEqualization | SmoothQuant | BiasCorrection | AdaRound | GPTQ,
                      Field(discriminator="kind")]
ALGORITHM_KINDS = ("cross_layer_equalization", "smoothquant", "bias_correction", "adaround",
                   "gptq")
# The kinds that rewrite the float graph at compile time (exact in float) ...
REWRITE_KINDS = ("cross_layer_equalization", "smoothquant")
# ... and those that choose weights / biases from calibration data, in ``qc.calibrate``.
DATA_KINDS = ("bias_correction", "adaround", "gptq")


def _inputs_kind(v: object) -> str:
    return "auto" if isinstance(v, str) else "scheme"


# ``quant.inputs``: a scheme, or ``auto``; errors name the branch (``inputs.scheme.<key>``).
InputsSpec = Annotated[Annotated[Scheme, Tag("scheme")] | Annotated[Literal["auto"], Tag("auto")],
                       Discriminator(_inputs_kind)]


# -- quant.search: mixed precision under a budget --------------------------------------
# qc.search(model, spec, batches) measures how sensitive each searched layer (each layer
# whose rule gives a weight scheme) is to each candidate weight scheme, picks the assignment
# with the least total predicted error within the budget, and returns the spec with
# ``search`` removed and one explicit rule per chosen group; qc.qcompile refuses a spec that
# still has ``search``.

BUDGET_KINDS = ("avg_weight_bits", "weight_bytes", "max_loss_increase")


class Candidate(Frozen):
    """One weight scheme the search may give a layer."""

    weight: Scheme = Field(description="a weight scheme the search may give a layer")

    @model_validator(mode="before")
    @classmethod
    def _weight_only(cls, data: object) -> object:
        if isinstance(data, dict) and "activation" in data:
            raise ValueError(
                "a candidate gives a weight scheme only: the activation scheme of a searched "
                "layer is the one its rule in quant.rules gives; remove activation here")
        return data

    @model_validator(mode="after")
    def _weight_scheme(self) -> Candidate:
        if self.weight.granularity == "per_token":
            raise ValueError("weight: per_token is for activations; use per_channel or "
                             "per_group")
        return self

    def label(self) -> str:
        """A short name: ``int4/per_group32``, ``int8/per_channel``, ``nvfp4``."""
        w = self.weight
        if w.is_block:
            return w.dtype if w.dtype != "nf4" or w.group_size == 64 else \
                f"nf4/{w.group_size}"
        g = w.granularity + (str(w.group_size) if w.granularity == "per_group" else "")
        return f"{w.dtype}/{g}" + ("" if w.symmetric else "/asym")


class Budget(Frozen):
    """Exactly one of: ``avg_weight_bits`` (bits per weight element of the searched
    layers, weighted by parameter count), ``weight_bytes`` (their weights as stored) or
    ``max_loss_increase`` (the least bits whose total predicted loss increase is at most
    this; needs metric loss or fisher)."""

    avg_weight_bits: float | None = Field(None, gt=0.0, le=64.0, strict=True,
                                          description="element bits per weight, averaged "
                                          "over the searched parameters")
    weight_bytes: StrictInt | None = Field(None, ge=1, description="bytes the searched "
                                           "weights take as qc.convert stores them")
    max_loss_increase: float | None = Field(None, ge=0.0, strict=True,
                                            description="the fewest bits whose predicted "
                                            "loss increase stays within this")

    @model_validator(mode="after")
    def _exactly_one(self) -> Budget:
        given = [k for k in BUDGET_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            shown = ", ".join(given) if given else "none"
            raise ValueError(f"budget takes exactly one of {', '.join(BUDGET_KINDS)}; "
                             f"got {shown}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in BUDGET_KINDS if getattr(self, k) is not None)

    @property
    def value(self) -> float:
        return getattr(self, self.kind)


class SearchSpec(Frozen):
    """``quant.search``: candidates, budget, metric, granularity.

    ``metric``: ``sqnr`` (each layer's output with its weight quantized, from the float
    input it receives, against its float output: noise / signal energy), ``loss`` (the
    loss increase with that one layer quantized, the rest in float) or ``fisher`` (the
    loss increase predicted from squared gradients, one backward per batch:
    ``0.5 * sum(g^2 * (Wq - W)^2)``). ``granularity``: ``layer`` (each searched layer on
    its own) or ``block`` (the layers of each repeated block, e.g. ``layers.0``, share
    one choice).

    Example:
        >>> from qcompile.specs import SearchSpec
        >>> s = SearchSpec.model_validate({
        ...     "candidates": [
        ...         {"weight": {"dtype": "int4", "granularity": "per_group", "group_size": 32}},
        ...         {"weight": {"dtype": "int8", "granularity": "per_channel"}}],
        ...     "budget": {"avg_weight_bits": 4.5}})
        >>> s.metric, s.granularity, s.budget.kind, s.budget.value
        ('sqnr', 'layer', 'avg_weight_bits', 4.5)
    """

    candidates: list[Candidate] = Field(min_length=2, description="the weight schemes to "
                                        "choose from")
    budget: Budget = Field(description="exactly one of avg_weight_bits, weight_bytes, "
                           "max_loss_increase")
    metric: Literal["sqnr", "loss", "fisher"] = Field(
        "sqnr", description="how sensitivity is measured: output SQNR, loss increase, or "
        "the loss increase squared gradients predict")
    granularity: Literal["layer", "block"] = Field(
        "layer", description="one choice per layer, or per repeated block")

    @model_validator(mode="after")
    def _fits(self) -> SearchSpec:
        seen: dict[Scheme, int] = {}
        for i, c in enumerate(self.candidates):
            if c.weight in seen:
                raise ValueError(f"candidates[{i}] repeats candidates[{seen[c.weight]}] "
                                 f"({c.label()}); list each scheme once")
            seen[c.weight] = i
        if self.budget.kind == "max_loss_increase" and self.metric == "sqnr":
            raise ValueError("budget max_loss_increase is in loss units, and metric sqnr "
                             "measures output noise: use metric loss or fisher with it")
        return self



class QuantSpec(Frozen):
    """The ``quant`` section.

    ``target`` names whose integer kernels the quantized numerics simulate (and what
    ``qc.convert`` lowers to): ``x86`` (fbgemm / onednn on any x86 CPU: 8-bit activations
    in the reduced 7-bit range, weights in the full int8 range), ``qnnpack`` (ARM / mobile,
    full range), ``onednn_vnni`` (full range, x86 CPUs with VNNI only) or ``generic`` (no
    integer kernel: full range). The default is ``x86``: its graphs convert correctly on
    every CPU (a 7-bit activation is a valid 8-bit one everywhere, and no x86 CPU saturates
    on it), while a full-range graph is computed differently by x86 CPUs without VNNI; the
    price is one bit of activation resolution, which ``qnnpack`` or ``onednn_vnni`` buy back
    when the deployment CPU is known. Weights, fp8 and other bit widths are never reduced.
    """

    mode: Mode = Field("none", description="none (float), dynamic, static (PTQ with "
                       "calibration) or qat")
    target: Target = Field(
        "x86", description="whose integer kernels: x86 (7-bit activations, correct on every "
        "x86 CPU) | qnnpack | onednn_vnni (needs VNNI) | generic (no kernel constraints)")
    rules: list[Rule] = Field(default_factory=list, description="the first matching rule "
                              "wins (a skip rule always wins for its nodes)")
    inputs: InputsSpec | None = Field(
        None, description="quantize the model's float inputs: a scheme quantizes every float "
        "input with it; auto quantizes only those a quantized Linear / Conv reads (through "
        "shape ops), with that layer's activation scheme, as torch.ao's input observer does "
        "(the int8-static / int8-qat presets; dynamic mode already quantizes them per batch)")
    algorithms: list[Algorithm] = Field(
        default_factory=list,
        description="PTQ algorithms, in this order: cross_layer_equalization and "
        "smoothquant rewrite the graph when compiling; bias_correction, adaround and gptq "
        "run on the calibration batches in qc.calibrate")
    fold_bn: bool = Field(True, description="fold BatchNorm into the conv / linear before "
                          "it (PTQ); QAT keeps BatchNorm training exactly")
    sync_observers: bool = Field(True, description="reduce observer statistics across "
                                 "data-parallel ranks")
    observer_update: Literal["step", "forward"] = Field(
        "step", description="when activation observers change their qparams in training: "
        "step (statistics of a whole optimizer step, reduced across data-parallel ranks and "
        "applied once after it: results do not depend on the world size or on gradient "
        "accumulation) | forward (every forward updates at once, from its own batch)")
    search: SearchSpec | None = Field(
        None, description="mixed precision under a budget: candidate weight schemes, the "
        "budget, the metric; qc.search(model, spec, batches) returns the spec without it "
        "and with one rule per chosen group, which qc.qcompile compiles")

    @model_validator(mode="after")
    def _mode_fits(self) -> QuantSpec:
        schemes = [(f"rules[{i}].{role}", getattr(r, role)) for i, r in enumerate(self.rules)
                   for role in ("weight", "activation")]
        if isinstance(self.inputs, Scheme):
            schemes.append(("inputs", self.inputs))
        for where, s in schemes:
            if s is not None and s.learnable and self.mode != "qat":
                raise ValueError(
                    f"{where}.learnable: learnable scales train only in QAT; "
                    f"set mode: qat or learnable: false (mode is {self.mode})"
                )
        # The rewrites here preserve the float function, so they also give QAT a better
        # start (AIMET applies CLE before QAT); without quantization they prepare nothing.
        if self.algorithms and self.mode == "none":
            kind = self.algorithms[0].kind
            raise ValueError(
                f"quant.algorithms[0] ({kind}): PTQ algorithms prepare weights for "
                "quantization, and mode none quantizes nothing; set quant.mode to static, "
                "dynamic or qat, or remove quant.algorithms")
        self._algorithms_fit()
        self._search_fits()
        # Without a mode nothing is quantized: rules or inputs would be ignored unsaid.
        if self.mode == "none" and (self.rules or self.inputs is not None):
            given = "rules" if self.rules else "inputs"
            raise ValueError(
                f"quant.{given}: quant.mode is none (no quantization, the default), so "
                f"quant.{given} would be ignored; set quant.mode to static, qat or dynamic, "
                f"or remove quant.{given}"
            )
        return self

    def _algorithms_fit(self) -> None:
        """The data-driven algorithms run after the compile-time rewrites (they see the
        rewritten weights), not in QAT (training moves the weights they chose), and at
        most one of them chooses the rounding."""
        kinds = [a.kind for a in self.algorithms]
        for i, kind in enumerate(kinds):
            if kind not in DATA_KINDS:
                continue
            if self.mode == "qat":
                raise ValueError(
                    f"quant.algorithms[{i}] ({kind}): chooses the weights once from "
                    "calibration data, and QAT training moves them again; use quant.mode "
                    "static or dynamic for it, or remove it (cross_layer_equalization and "
                    "smoothquant do work with qat)")
            later = [j for j in range(i + 1, len(kinds)) if kinds[j] in REWRITE_KINDS]
            if later:
                raise ValueError(
                    f"quant.algorithms[{later[0]}] ({kinds[later[0]]}) comes after "
                    f"quant.algorithms[{i}] ({kind}), but it rewrites the graph when "
                    f"compiling, before {kind} sees any data; list it first")
            if kinds.index(kind) != i:
                raise ValueError(f"quant.algorithms[{i}] ({kind}) is listed twice "
                                 f"(also quant.algorithms[{kinds.index(kind)}]); keep one")
        rounding = [i for i, k in enumerate(kinds) if k in ("adaround", "gptq")]
        if len(rounding) > 1:
            a, b = rounding[:2]
            raise ValueError(
                f"quant.algorithms[{b}] ({kinds[b]}): quant.algorithms[{a}] ({kinds[a]}) "
                "already chooses how every weight rounds; keep one of adaround and gptq")

    def _search_fits(self) -> None:
        """A search needs quantization, and each candidate must be a valid weight scheme
        for the mode (the spec it returns holds them as rules)."""
        if self.search is None:
            return
        if self.mode == "none":
            raise ValueError("quant.search: quant.mode is none, so no layer is quantized and "
                             "there is nothing to search; set quant.mode to static, dynamic or "
                             "qat, with rules giving the searched layers a weight scheme")
        for i, c in enumerate(self.search.candidates):
            if c.weight.learnable and self.mode != "qat":
                raise ValueError(
                    f"quant.search.candidates[{i}].weight.learnable: learnable scales train "
                    f"only in QAT; set mode: qat or learnable: false (mode is {self.mode})")

    @property
    def reduce_range(self) -> bool:
        """Whether this spec's 8-bit integer activation quantizers (static, QAT, dynamic
        and input ones) use the reduced 7-bit range: ``reduces_activation_range(target)``."""
        return reduces_activation_range(self.target)
