"""``qc.convert`` shows none of torch's deprecation warnings that converting cannot avoid
(quantized tensor creation, an exported graph's pytree ``LeafSpec``): a program run with
``-W error`` converts. The silencing is scoped to our own calls, never a global filter.

torch warns about quantized tensors once per process (``TORCH_WARN_ONCE``): with
``torch.set_warn_always(True)`` it warns every time, so each test sees it whatever ran
before. The controls check that the warnings exist at all (if torch drops one, its
silencing in ``qcompile.passes.convert.common`` can go).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import qcompile as qc

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def warn_always() -> Iterator[None]:
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(before)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def converted_under_error(gm: nn.Module, example_inputs: tuple | None) -> nn.Module:
    """``qc.convert`` with every warning an error; it leaves the filters as they were."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        filters = list(warnings.filters)
        out = qc.convert(gm, example_inputs=example_inputs)
        assert list(warnings.filters) == filters, "convert left a warnings filter behind"
    return out


def test_the_quantized_tensor_warning_exists() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="quantized tensor creation functions"):
            torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)


@pytest.mark.parametrize("preset", ["int8-static", "int8-dynamic", "w4a8-qat"])
def test_convert_raises_no_torch_deprecation(preset: str) -> None:
    x = torch.randn(16, 32)
    gm = qc.qcompile(mlp(), preset, example_inputs=(x,))
    if qc.report(gm).mode == "static":
        qc.calibrate(gm, [x], progress=False)
    else:
        gm(x)
        qc.freeze(gm)
    out = converted_under_error(gm, (x,))  # example inputs: the result runs in convert too
    paths = {c.path for c in qc.report(out).conversions}
    if preset != "w4a8-qat":  # torch's int8 kernels: quantized tensors made and run
        assert paths & {"kernel", "dynamic_kernel"}, paths
    assert "output0" in qc.report(out).max_deviation


def test_an_exported_llm_converts_under_error() -> None:
    from qcompile.tools.architectures import ARCHITECTURES

    arch = ARCHITECTURES["llama"]
    batch = arch.batch()
    gm = qc.qcompile(arch.build(), "int8-static", example_kwargs=batch)
    assert qc.report(gm).trace_method == "export"
    qc.calibrate(gm, [batch], progress=False)
    with warnings.catch_warnings():  # the control: copying an exported graph warns
        warnings.simplefilter("error")
        with pytest.raises(FutureWarning, match="LeafSpec"):
            copy.deepcopy(gm)
    out = converted_under_error(gm, None)
    assert {"quantize", "int_storage"} <= {c.path for c in qc.report(out).conversions}
