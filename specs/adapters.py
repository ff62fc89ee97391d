"""The ``adapters`` section: trainable low-rank adapters (LoRA) on matched layers, and the
modules that train in full next to them (peft's ``modules_to_save``).

A ``lora`` entry (the default ``kind``) selects Linear layers with a ``match`` (as
quantization rules do: ``module`` class names, ``name`` globs on the layer's qualified
name) and says what the layer becomes: its weight and bias stop training, and ``y =
base(x) + lora_B(lora_A(dropout(x))) * alpha / rank`` is trained instead (peft's LoRA).
``base`` decides how the frozen weight is held:

- ``frozen``: stored as its rule's weight scheme (int8, int4 per group, nf4, nvfp4, mxfp4,
  ... as integers or block codes) and dequantized layer by layer in the forward and again
  in the backward; a layer whose rule has no weight scheme keeps its float weight, frozen.
- ``qat``: the float weight stays, frozen, behind its fake-quantizer (torchao's QAT +
  LoRA: the adapters learn to compensate the quantization error of the deployed weight).

The first ``lora`` entry that matches a layer wins; ``skip: true`` keeps the layers it
matches free of adapters.

A ``full`` entry selects modules of any kind (a classifier head ``score``, an embedding, the
norms) whose parameters train in full, as peft's ``modules_to_save``; ``qc.save_adapters``
writes them into the adapter. Everything else in the graph stops training, whatever the
model said: the adapters, the ``full`` modules (with their quantizers' learnable scales)
and the learnable (LSQ) scales of activation quantizers and of ``base: qat`` weights train,
nothing more. A module is adapted or trained in full, never both. An entry of either kind
that matches nothing is an error unless ``optional: true``.

Example:
    >>> from qcompile.specs import CompileSpec
    >>> spec = CompileSpec.model_validate({"adapters": [
    ...     {"match": {"name": "head"}, "skip": True},
    ...     {"kind": "lora", "rank": 16, "alpha": 32, "match": {"module": "Linear"}},
    ...     {"kind": "full", "match": {"name": "head"}}]})
    >>> [(a.skip, a.rank, a.scaling) for a in lora_entries(spec.adapters)]
    [(True, 8, 1.0), (False, 16, 2.0)]
    >>> [a.match.name for a in spec.adapters if a.kind == "full"]
    [['head']]
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Discriminator, Field, StrictInt, Tag, model_validator

from qcompile.specs.quant import Frozen, Match


def _by_module_and_name(match: Match) -> None:
    if match.op is not None or match.reads_weight:
        raise ValueError("adapters select layers by module and name: match.op and "
                         "match.reads_weight do not apply (use e.g. {module: Linear, "
                         "name: '*.q_proj'})")


class AdapterSpec(Frozen):
    """One ``adapters`` entry: LoRA on the Linear layers ``match`` selects."""

    kind: Literal["lora"] = Field("lora", description="lora: a low-rank adapter on each "
                                  "selected Linear (the default when kind is left out)")
    match: Match = Field(description="which Linear layers get an adapter (module class "
                         "names, name globs)")
    rank: StrictInt = Field(8, ge=1, description="LoRA rank r: lora_A is [r, in], lora_B [out, r]")
    alpha: float = Field(8.0, gt=0.0, strict=True,
                         description="the update is scaled by alpha / rank (peft's lora_alpha)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, strict=True,
                           description="dropout on the adapter's input (training mode only)")
    base: Literal["frozen", "qat"] = Field(
        "frozen", description="frozen: the base weight stored as its rule's weight scheme "
        "(integers / block codes), no gradient; qat: the float weight kept, frozen, behind its "
        "fake-quantizer")
    skip: bool = Field(False, description="the layers this entry matches get no adapter")
    optional: bool = Field(False, description="allow this entry to match no layer")
    seed: StrictInt = Field(0, ge=0, description="lora_A's initialisation: drawn from a "
                            "generator seeded by this and the layer's name, so every rank and "
                            "every world size starts from the same adapters")

    @model_validator(mode="after")
    def _match_layers(self) -> AdapterSpec:
        _by_module_and_name(self.match)
        return self

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor on the adapter's output."""
        return self.alpha / self.rank


class FullModuleSpec(Frozen):
    """One ``adapters`` entry of ``kind: full``: the modules ``match`` selects train in full
    next to the adapters, and ``qc.save_adapters`` writes them (peft's ``modules_to_save``)."""

    kind: Literal["full"] = Field("full", description="full: every parameter of the "
                                  "selected modules trains (peft's modules_to_save)")
    match: Match = Field(description="which modules train in full (module class names, name "
                         "globs; a module inside a selected one is part of it); none of them "
                         "may hold or be a LoRA-adapted layer")
    optional: bool = Field(False, description="allow this entry to match no module")

    @model_validator(mode="after")
    def _match_modules(self) -> FullModuleSpec:
        _by_module_and_name(self.match)
        return self


def _kind(v: object) -> str:
    """The entry's kind: ``lora`` where it names none (entries before ``full`` existed)."""
    kind = v.get("kind", "lora") if isinstance(v, dict) else getattr(v, "kind", "lora")
    return kind if isinstance(kind, str) else repr(kind)


# One entry: a LoRA entry, or a module trained in full; an unknown kind is an error naming
# both (errors locate a field by its kind: adapters.0.lora.rank)
AdapterEntry = Annotated[Annotated[AdapterSpec, Tag("lora")]
                         | Annotated[FullModuleSpec, Tag("full")], Discriminator(_kind)]


def lora_entries(entries: list[AdapterSpec | FullModuleSpec]) -> list[AdapterSpec]:
    """The ``lora`` entries of an ``adapters`` list, in order."""
    return [a for a in entries if a.kind == "lora"]


def _entries_fit(entries: list[AdapterSpec | FullModuleSpec]
                 ) -> list[AdapterSpec | FullModuleSpec]:
    full = [i for i, a in enumerate(entries) if a.kind == "full"]
    if full and not any(not a.skip for a in lora_entries(entries)):
        raise ValueError(
            f"adapters[{full[0]}] trains modules in full next to LoRA adapters (peft's "
            "modules_to_save), but no entry adds an adapter: add a lora entry (e.g. {match: "
            "{module: Linear, name: '*.q_proj'}, rank: 8}); to train only some modules, "
            "compile without adapters and set requires_grad on the model yourself")
    return entries


# the section: entries of both kinds, checked together
AdapterList = Annotated[list[AdapterEntry], AfterValidator(_entries_fit)]
