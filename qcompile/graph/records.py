"""The compile ``Report``: what every pass did, which rule quantized which node.

Example:
    >>> from qcompile.graph.records import Report, PassRecord
    >>> r = Report(mode="qat", passes=[PassRecord(name="trace", seconds=0.01,
    ...            nodes_before=0, nodes_after=3)])
    >>> "trace" in r.text()
    True
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from qcompile.errors import QCompileError
from qcompile.graph.meta import REPORT_KEY


class PassRecord(BaseModel):
    """One pass's run: time, graph size before/after, nodes added/removed, notes."""

    model_config = ConfigDict(extra="forbid")

    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class QuantizerRecord(BaseModel):
    """One inserted ``FakeQuantize``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="qualified name of the FakeQuantize module")
    role: str = Field(description="weight | activation | input")
    node: str = Field(description="graph node (or parameter) it quantizes")
    rule: int | None = Field(description="index into quant.rules (for quant.inputs: auto, the "
                             "rule of the layer reading the input); None for a quant.inputs scheme")
    dtype: str
    granularity: str
    symmetric: bool
    scales: int
    learnable: bool = False
    dynamic: bool = False


class StageRecord(BaseModel):
    """One pipeline stage: what it holds, what it costs, what crosses its edges."""

    model_config = ConfigDict(extra="forbid")

    stage: int
    device: str
    nodes: int
    parameters: int = Field(description="parameter elements held by the stage")
    parameter_bytes: int
    cost: float = Field(description="estimated forward+backward cost (unit of the balance)")
    bytes_in: int = Field(description="activation bytes received per forward")
    bytes_out: int = Field(description="activation bytes sent per forward")
    memory_bytes: int = Field(0, description="estimate: parameters x4 (weights, gradients, "
                              "two Adam moments) + activations x micro-batches in flight")
    modules: list[str] = Field(default_factory=list, description="top-level modules it holds")


class TensorParallelRecord(BaseModel):
    """One layer's tensor-parallel placement (``tensor_parallel``) and why."""

    model_config = ConfigDict(extra="forbid")

    layer: str
    kind: str = Field(description="linear | embedding")
    style: str = Field(description="colwise | rowwise | replicate")
    reason: str
    gather: bool = Field(False, description="a colwise layer whose output is gathered")


def tensor_parallel_lines(records: list[TensorParallelRecord]) -> list[str]:
    """The plan, one line per layer: its style across the tp dim and why."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.style] = counts.get(r.style, 0) + 1
    lines = ["tensor parallel: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))]
    for r in records:
        style = f"{r.style}{' (gathered)' if r.gather else ''}"
        lines.append(f"    {r.layer:<40} {style:<20} {r.reason}")
    return lines


class AdapterRecord(BaseModel):
    """One adapted layer (``adapters``): its adapter and what its frozen base costs."""

    model_config = ConfigDict(extra="forbid")

    layer: str
    entry: int = Field(description="index of the adapters entry that chose it")
    rank: int
    alpha: float
    base: str = Field(description="frozen | qat")
    stored: str | None = Field(None, description="the dtype a frozen base is stored as; None "
                               "for a float base")
    base_bytes_before: int = Field(description="bytes of the layer's weight as the model held it")
    base_bytes_after: int = Field(description="bytes the graph holds for it (codes + scales "
                                  "for a frozen base)")
    adapter_parameters: int


class WeightCoverage(BaseModel):
    """Which weights of linear layers and matrix products a quantizer reads (embeddings,
    normalisations and biases aside): parameter elements, and the layers left float."""

    model_config = ConfigDict(extra="forbid")

    read: int = Field(description="elements of the tensors linear ops and products read as "
                      "weights (2-D and up)")
    quantized: int = Field(description="of those, elements read through a weight quantizer")
    skipped: int = Field(0, description="elements a skip rule keeps float on purpose")
    float: list[str] = Field(default_factory=list, description="weights read by a product "
                             "that no rule quantizes and no skip rule names")

    @property
    def share(self) -> float:
        """Quantized elements over those not skipped on purpose (1.0 when none)."""
        meant = self.read - self.skipped
        return self.quantized / meant if meant > 0 else 1.0


class TrainableRecord(BaseModel):
    """A module holding parameters that train, in a graph compiled with ``adapters``."""

    model_config = ConfigDict(extra="forbid")

    module: str = Field(description="the module's qualified name (the model's: a pipeline "
                        "stage's prefix left out); for lora, the adapted layer")
    kind: str = Field(description="lora: the layer's lora_A and lora_B; full: a module an "
                      "adapters entry of kind full trains (its quantizers' learnable scales "
                      "included); quantizer: a learnable (LSQ) scale of an activation or "
                      "base: qat weight quantizer; other: anything else")
    parameters: int = Field(description="parameter elements with requires_grad")


class ConversionRecord(BaseModel):
    """What ``qc.convert`` made of one node or weight."""

    model_config = ConfigDict(extra="forbid")

    node: str = Field(description="graph node in the converted graph")
    module: str = Field(description="the layer (module qualified name) it belongs to")
    path: str = Field(description="kernel | dynamic_kernel | quantize | int_storage | "
                      "block_storage | fake_quant | fold")
    op: str = Field(description="the kernel or storage used, e.g. quantized::linear_relu")
    note: str = ""


class Report(BaseModel):
    """What ``qcompile`` did; ``qc.report(gm)`` returns it, ``.model_dump_json()`` saves it."""

    model_config = ConfigDict(extra="forbid")

    qcompile_version: str = ""
    torch_version: str = ""
    mode: str
    trace_method: str | None = None
    shapes: str | None = Field(
        None, description="how node shapes were recorded: 'meta tensors' (no kernel runs), "
        "'torch.export' (its fake values), or 'example inputs (...)' (the model ran on them, "
        "and why meta tensors could not); None without example inputs")
    passes: list[PassRecord] = Field(default_factory=list)
    quantizers: list[QuantizerRecord] = Field(default_factory=list)
    rule_matches: dict[int, list[str]] = Field(
        default_factory=dict, description="rule index -> nodes it selected"
    )
    parameters_quantized: float | None = Field(
        None, description="fraction of the model's parameter elements read through a weight "
        "quantizer (None in mode none)")
    weights_quantized: WeightCoverage | None = Field(
        None, description="weights of linear layers and matrix products behind a weight "
        "quantizer (None in mode none)")
    stages: list[StageRecord] = Field(default_factory=list)
    balance: str | None = Field(None, description="cost model used for the stages")
    balance_ratio: float | None = Field(None, description="max stage cost / mean stage cost")
    adapters: list[AdapterRecord] = Field(default_factory=list)
    tensor_parallel: list[TensorParallelRecord] = Field(
        default_factory=list, description="with a tensor_parallel section: each Linear's and "
        "embedding's placement across the tp mesh dim, and why")
    trainable_parameters: int | None = Field(
        None, description="parameter elements with requires_grad in the graph")
    parameters: int | None = Field(None, description="parameter elements in the graph")
    trainable: list[TrainableRecord] = Field(
        default_factory=list, description="with an adapters section: every module whose "
        "parameters train, by kind (everything else is frozen); empty without one (the "
        "model's own requires_grad flags hold)")
    total_seconds: float = 0.0
    conversions: list[ConversionRecord] = Field(
        default_factory=list, description="qc.convert: what each quantized node became")
    max_deviation: dict[str, float] = Field(
        default_factory=dict, description="qc.convert with example_inputs: per output, max "
        "|converted - fake-quant|, and in steps of the output quantizer when it has one")

    def text(self) -> str:
        """A human-readable summary."""
        lines = [f"qcompile {self.qcompile_version} (torch {self.torch_version}), "
                 f"mode {self.mode}, traced by {self.trace_method}, "
                 f"{self.total_seconds * 1e3:.1f} ms"]
        if self.shapes is not None and self.shapes.startswith("example inputs"):
            lines.append(f"shapes from {self.shapes}")
        width = max([14] + [len(p.name) + 1 for p in self.passes])
        lines.append(f"{'pass':<{width}}{'ms':>9}{'nodes':>8}{'+':>6}{'-':>6}")
        for p in self.passes:
            lines.append(f"{p.name:<{width}}{p.seconds * 1e3:>9.2f}{p.nodes_after:>8}"
                         f"{len(p.added):>6}{len(p.removed):>6}")
            lines += [f"    note: {n}" for n in p.notes]
        for i, nodes in sorted(self.rule_matches.items()):
            shown = ", ".join(nodes[:6]) + (f", ... (+{len(nodes) - 6})" if len(nodes) > 6 else "")
            lines.append(f"rule {i}: {len(nodes)} node(s): {shown}")
        by_kind: dict[str, int] = {}
        for q in self.quantizers:
            key = f"{q.role} {q.dtype} {q.granularity}"
            by_kind[key] = by_kind.get(key, 0) + 1
        lines.append(f"quantizers: {len(self.quantizers)}")
        lines += [f"    {n:>4} x {k}" for k, n in sorted(by_kind.items())]
        if self.parameters_quantized is not None:
            lines.append(f"parameters behind a weight quantizer: "
                         f"{100 * self.parameters_quantized:.1f}%")
        w = self.weights_quantized
        if w is not None and w.read:
            kept = f", {w.skipped} kept float by skip rules" if w.skipped else ""
            lines.append(f"linear / product weights behind a quantizer: {100 * w.share:.1f}% "
                         f"of {w.read - w.skipped} elements{kept} (embeddings, norms aside)")
            if w.float:
                lines.append(f"    float, no rule: {', '.join(w.float[:6])}"
                             + (f" (+{len(w.float) - 6})" if len(w.float) > 6 else ""))
        if self.adapters:
            before = sum(a.base_bytes_before for a in self.adapters)
            after = sum(a.base_bytes_after for a in self.adapters)
            kinds = sorted({f"r={a.rank} {a.base}" + (f" {a.stored}" if a.stored else "")
                            for a in self.adapters})
            lines.append(f"adapters: {len(self.adapters)} lora ({', '.join(kinds)}), "
                         f"{sum(a.adapter_parameters for a in self.adapters)} parameters")
            lines.append(f"    adapted base weights: {before / 2**20:.2f} MiB -> "
                         f"{after / 2**20:.2f} MiB ({100 * after / max(before, 1):.1f}%)")
        if self.trainable_parameters is not None and self.parameters:
            lines.append(f"trainable parameters: {self.trainable_parameters} of "
                         f"{self.parameters} "
                         f"({100 * self.trainable_parameters / self.parameters:.2f}%)")
        if self.trainable:
            lines.append(f"trains: {_trains(self.trainable)}")
        if self.tensor_parallel:
            lines += tensor_parallel_lines(self.tensor_parallel)
        if self.stages:
            lines.append(f"stages: {len(self.stages)} (balance {self.balance}, max/mean cost "
                         f"{self.balance_ratio:.2f})")
            lines.append(f"{'stage':<7}{'device':<9}{'nodes':>6}{'params':>11}{'cost':>12}"
                         f"{'bytes in':>11}{'bytes out':>11}{'memory':>12}")
            for s in self.stages:
                lines.append(f"{s.stage:<7}{s.device:<9}{s.nodes:>6}{s.parameters:>11}"
                             f"{s.cost:>12.4g}{s.bytes_in:>11}{s.bytes_out:>11}"
                             f"{s.memory_bytes:>12}")
        if self.conversions:
            by_path: dict[str, int] = {}
            for c in self.conversions:
                key = f"{c.path} {c.op}"
                by_path[key] = by_path.get(key, 0) + 1
            lines.append(f"converted: {len(self.conversions)}")
            lines += [f"    {n:>4} x {k}" for k, n in sorted(by_path.items())]
            lines += [f"    note: {c.module}: {c.note}" for c in self.conversions
                      if c.path == "fake_quant"]
        for k, v in self.max_deviation.items():
            lines.append(f"max deviation {k}: {v:.4g}")
        return "\n".join(lines)


def _trains(records: list[TrainableRecord]) -> str:
    """What trains, in one line: per kind, the modules (a few named) and their elements."""
    parts = []
    for kind in ("lora", "full", "quantizer", "other"):
        mine = [r for r in records if r.kind == kind]
        if not mine:
            continue
        total = sum(r.parameters for r in mine)
        names = ", ".join(r.module for r in mine[:3]) + (
            f", ... (+{len(mine) - 3})" if len(mine) > 3 else "")
        parts.append({"lora": f"lora on {len(mine)} layer(s)",
                      "full": f"in full {names}",
                      "quantizer": f"{len(mine)} learnable quantizer scale(s)",
                      "other": f"other {names}"}[kind] + f" ({total})")
    return "; ".join(parts)


def report(gm: Any) -> Report:
    """The ``Report`` of a graph returned by ``qcompile``."""

    meta = getattr(gm, "meta", None)
    if not isinstance(meta, dict) or REPORT_KEY not in meta:
        raise QCompileError(f"{type(gm).__name__} has no qcompile report",
                            fix="pass the GraphModule returned by qc.qcompile")
    return meta[REPORT_KEY]
