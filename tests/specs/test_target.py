"""``quant.target``: accepted values, the default, which ranges it reduces, the presets."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from qcompile.specs import CompileSpec, QuantSpec, Scheme, load_spec, presets
from qcompile.specs.quant import DTYPES, REDUCIBLE_DTYPES, reduces_activation_range

TARGETS = ["x86", "qnnpack", "onednn_vnni", "generic"]


def test_default_is_x86() -> None:
    assert QuantSpec().target == "x86"
    assert CompileSpec().quant.target == "x86"
    assert QuantSpec().reduce_range is True


@pytest.mark.parametrize("target", TARGETS)
def test_targets_accepted(target: str) -> None:
    q = QuantSpec.model_validate({"mode": "qat", "target": target})
    assert q.target == target
    assert q.reduce_range is (target == "x86")
    assert reduces_activation_range(target) is (target == "x86")


@pytest.mark.parametrize("target", ["X86", "fbgemm", "onednn", "arm", "", None, 86, True])
def test_bad_target_rejected_with_its_path(target: object) -> None:
    with pytest.raises(ValidationError) as excinfo:
        CompileSpec.model_validate({"quant": {"mode": "qat", "target": target}})
    errors = excinfo.value.errors()
    assert [e["loc"] for e in errors] == [("quant", "target")]
    # the message lists what is allowed
    assert "x86" in str(excinfo.value) and "onednn_vnni" in str(excinfo.value)


def test_target_is_frozen_and_round_trips() -> None:
    spec = CompileSpec.model_validate({"quant": {"mode": "static", "target": "qnnpack"}})
    with pytest.raises(ValidationError):
        spec.quant.target = "x86"  # type: ignore[misc]
    again = CompileSpec.model_validate(spec.model_dump(mode="json"))
    assert again == spec and again.quant.target == "qnnpack"
    assert spec != CompileSpec.model_validate({"quant": {"mode": "static", "target": "x86"}})


@pytest.mark.parametrize(("dtype", "full", "reduced"), [
    ("uint8", (0, 255), (0, 127)),
    ("int8", (-128, 127), (-64, 63)),
])
def test_reduced_range_of_8_bit_integers(dtype: str, full: tuple, reduced: tuple) -> None:
    s = Scheme(dtype=dtype, symmetric=False)
    assert s.qrange() == full
    assert s.qrange(reduce_range=False) == full
    assert s.qrange(reduce_range=True) == reduced
    lo, hi = reduced
    assert hi - lo + 1 == 128  # 7 bits
    # the property the x86 kernels need: a pair of u8 x s8 products fits int16
    if dtype == "uint8":
        assert 2 * hi * 128 <= 32767 < 2 * full[1] * 128


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d not in REDUCIBLE_DTYPES])
def test_other_dtypes_never_reduced(dtype: str) -> None:
    s = Scheme(dtype=dtype)
    assert s.qrange(reduce_range=True) == s.qrange()


def test_reduce_range_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        Scheme(dtype="uint8").qrange(True)  # type: ignore[misc]


@pytest.mark.parametrize("name", sorted(presets()))
def test_presets_say_their_target_explicitly(name: str) -> None:
    """Every preset names its target in the file, not through the schema default: x86
    where integer kernels read what it simulates, generic for the formats no CPU kernel
    reads (block formats, 8da4w's full-range per-token activations)."""
    raw = yaml.safe_load(presets()[name].read_text(encoding="utf-8"))
    simulated = name in ("8da4w-qat", "mxfp4-qat", "mxfp8-qat", "nvfp4-qat", "qlora-nf4") \
        or name.startswith("gguf-")
    assert raw["quant"]["target"] == ("generic" if simulated else "x86")
    assert load_spec(name).quant.target == raw["quant"]["target"]


def test_design_example_target() -> None:
    spec = CompileSpec.model_validate({"version": 1, "quant": {"mode": "qat", "target": "x86"}})
    assert spec.quant.reduce_range
