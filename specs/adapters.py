"""The ``adapters`` section: trainable low-rank adapters (LoRA) on matched layers.

Each entry selects Linear layers with a ``match`` (as quantization rules do: ``module``
class names, ``name`` globs on the layer's qualified name) and says what the layer becomes:
its weight and bias stop training, and ``y = base(x) + lora_B(lora_A(dropout(x))) * alpha
/ rank`` is trained instead (peft's LoRA). ``base`` decides how the frozen weight is held:

- ``frozen``: stored as its rule's weight scheme (int8, int4 per group, nf4, nvfp4, mxfp4,
  ... as integers or block codes) and dequantized layer by layer in the forward and again
  in the backward; a layer whose rule has no weight scheme keeps its float weight, frozen.
- ``qat``: the float weight stays, frozen, behind its fake-quantizer (torchao's QAT +
  LoRA: the adapters learn to compensate the quantization error of the deployed weight).

The first entry that matches a layer wins; ``skip: true`` keeps the layers it matches free
of adapters. An entry that matches no layer is an error unless ``optional: true``.

Example:
    >>> from qcompile.specs import CompileSpec
    >>> spec = CompileSpec.model_validate({"adapters": [
    ...     {"match": {"name": "head"}, "skip": True},
    ...     {"kind": "lora", "rank": 16, "alpha": 32, "match": {"module": "Linear"}}]})
    >>> [(a.skip, a.rank, a.scaling) for a in spec.adapters]
    [(True, 8, 1.0), (False, 16, 2.0)]
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, model_validator

from qcompile.specs.quant import Frozen, Match


class AdapterSpec(Frozen):
    """One ``adapters`` entry: LoRA on the Linear layers ``match`` selects."""

    kind: Literal["lora"] = "lora"
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
        if self.match.op is not None or self.match.reads_weight:
            raise ValueError("adapters select layers by module and name: match.op and "
                             "match.reads_weight do not apply (use e.g. {module: Linear, "
                             "name: '*.q_proj'})")
        return self

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor on the adapter's output."""
        return self.alpha / self.rank
