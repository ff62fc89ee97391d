"""On the digits, quantized models stay within the accuracy targets (fixed seeds).

The settings are the accuracy tool's defaults (``qcompile.tools.accuracy.Settings()``), so
the numbers asserted here are the qcompile columns of its table in docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch import nn

from qcompile.tools import accuracy as acc

SETTINGS = acc.Settings()  # seed 0: split, init, batch order, calibration batches
N_TEST = acc.n_test_images(SETTINGS.seed)  # 360: one image is 0.28 points


@pytest.fixture(scope="module", autouse=True)
def _threads() -> Iterator[None]:
    """The tool's thread count (one) for this module, restored afterwards."""
    with acc.threads(SETTINGS.threads):
        yield


@pytest.fixture(scope="module")
def fp32_models() -> dict[str, nn.Module]:
    """Each model trained once in fp32 for the whole module (the slow part)."""
    return {name: acc.train_fp32(name, SETTINGS) for name in acc.MODELS}


@pytest.mark.slow
@pytest.mark.parametrize("name", acc.MODELS)
def test_fp32_baseline_is_decent(fp32_models: dict[str, nn.Module], name: str) -> None:
    # the drops only mean something against a model that has learnt the task
    assert acc.test_accuracy(fp32_models[name], SETTINGS) >= 0.95


@pytest.mark.slow
@pytest.mark.parametrize("method", list(acc.TARGETS))
@pytest.mark.parametrize("name", acc.MODELS)
def test_drop_within_target(fp32_models: dict[str, nn.Module], name: str,
                            method: str) -> None:
    """The drop, in whole test images, is within the target rounded up to whole images
    (one image is 0.28 points: a 0.2-point target cannot ask for less than one image
    without failing on float rounding alone, on another instruction set)."""
    model = fp32_models[name]
    base = acc.test_accuracy(model, SETTINGS)
    # qc.convert, when it exists, runs and any error it raises fails the test
    result = acc.evaluate(name, method, model, SETTINGS)
    allowed = acc.allowed_images(method, N_TEST)
    columns = {"fake-quant": result.fake_quant}
    if acc.has_convert():
        assert isinstance(result.converted, float)
        columns["converted"] = result.converted
    else:
        assert result.converted is None
    for column, accuracy in columns.items():
        assert isinstance(accuracy, float)
        lost = acc.images_lost(base, accuracy, N_TEST)
        assert lost <= allowed, (
            f"{name} {method} {column}: {100 * accuracy:.2f}% vs fp32 {100 * base:.2f}% "
            f"loses {lost} of {N_TEST} test images (target {acc.TARGETS[method]} points: at "
            f"most {allowed})")


def test_targets_in_images_follow_the_resolution() -> None:
    """The rule, from its definition: ceil(points / 100 * images), and a drop counted in
    whole images (one image of 360 over a 0.2-point target passes, two fail)."""
    assert N_TEST == 360
    for method, points in acc.TARGETS.items():
        k = acc.allowed_images(method, N_TEST)
        assert (k - 1) / N_TEST * 100 < points <= k / N_TEST * 100
    base = 356 / 360
    assert acc.images_lost(base, 355 / 360, 360) == 1
    assert acc.within_target("QAT int8", base, 355 / 360, 360)
    assert not acc.within_target("QAT int8", base, 354 / 360, 360)
    assert acc.within_target("QAT w4a8", base, 352 / 360, 360)
    assert not acc.within_target("QAT w4a8", base, 351 / 360, 360)
    assert acc.within_target("static int8", base, 1.0, 360)  # gains pass


@pytest.mark.slow
def test_torch_ao_runs_the_same_recipe(fp32_models: dict[str, nn.Module]) -> None:
    # torch.ao's numbers are compared in docs/benchmarks.md, not asserted against the targets
    fake, converted = acc.torch_ao_method("static int8", fp32_models["MLP"], SETTINGS)
    assert fake is not None
    for m in (fake, converted):
        assert 0.5 < acc.test_accuracy(m, SETTINGS) <= 1.0


def test_table_marks_targets() -> None:
    results = [
        acc.Result("MLP", "fp32", fake_quant=0.97),
        acc.Result("MLP", "static int8", fake_quant=0.97, converted=0.9672),
        acc.Result("MLP", "QAT int8", fake_quant=0.965, converted="error: X: y",
                   torch_ao_fake_quant=0.97, torch_ao_converted=0.96),
    ]
    lines = acc.table(results, 360).splitlines()
    assert lines[0].startswith("| model | method | qcompile fake-quant | qcompile converted")
    assert lines[2] == "| MLP | fp32 | 97.00 | - | - | - | - | - |"
    assert lines[3] == ("| MLP | static int8 | 97.00 | 96.72 | +0.00 / +0.28 | - | - "
                        "| ≤ 0.5 (2 images) ✓ |")
    # a drop over the target, or a conversion that failed, is marked
    assert lines[4] == ("| MLP | QAT int8 | 96.50 | error: X: y | +0.50 | 97.00 | 96.00 "
                        "| ≤ 0.2 (1 image) ✗ |")
