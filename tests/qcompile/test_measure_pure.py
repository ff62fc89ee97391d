"""Measuring never changes what it measures: ``qc.sqnr`` leaves the graph's state_dict
(observer buffers, BatchNorm running statistics) bit-identical, its training flags and
quantizer flags as they were, and the float model untouched; an uncalibrated static
graph is not calibrated by the batches it is measured on, a live QAT graph's qparams do
not move.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.graph.running import untouched as unchanged


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.relu(self.bn(self.conv(x))), 1))


def batches(n: int = 3, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 6, 6, generator=gen) * 3 + 1 for _ in range(n)]


def snapshot(m: nn.Module) -> tuple:
    state = {k: v.clone() for k, v in m.state_dict(keep_vars=False).items()}
    flags = {n: (q.enabled, q.observe) for n, q in qc.quantizers(m).items()} if hasattr(
        m, "meta") else {}
    return state, [(n, s.training) for n, s in m.named_modules()], flags


def assert_same(before: tuple, after: tuple) -> None:
    sb, tb, fb = before
    sa, ta, fa = after
    assert list(sa) == list(sb)
    for k in sb:  # bit-identical (NaN-safe: compare the bytes)
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k].view(-1).view(torch.uint8) if sa[k].is_floating_point()
                           else sa[k], sb[k].view(-1).view(torch.uint8)
                           if sb[k].is_floating_point() else sb[k]), k
    assert ta == tb
    assert fa == fb


def compiled(mode: str, model: nn.Module, method: str = "symbolic") -> torch.fx.GraphModule:
    spec = qc.load_spec({"qat": "int8-qat", "static": "int8-static"}[mode]).model_dump()
    spec["trace"]["method"] = method
    return qc.qcompile(model, spec, example_inputs=(batches(1, 0)[0],))


def model() -> nn.Module:
    torch.manual_seed(0)
    return ConvBN()


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_uncalibrated_static_graph_is_not_calibrated(method: str) -> None:
    float_model = model().eval()
    gm = compiled("static", float_model, method)
    before, float_before = snapshot(gm), snapshot(float_model)
    qc.sqnr(gm, float_model, batches())
    assert_same(before, snapshot(gm))
    assert_same(float_before, snapshot(float_model))
    # still uncalibrated: calibrate refuses nothing, convert still asks for calibration
    with pytest.raises(qc.QCompileError, match="calibrate"):
        qc.convert(gm)


def test_live_qat_graph_keeps_its_qparams() -> None:
    float_model = model().train()
    gm = compiled("qat", float_model)
    gm.train()
    gm(batches(1, 9)[0]).sum().backward()  # observers have seen something already
    assert any(q.observe for q in qc.quantizers(gm).values())
    before, float_before = snapshot(gm), snapshot(float_model)
    first = qc.sqnr(gm, float_model, batches())
    assert_same(before, snapshot(gm))
    assert_same(float_before, snapshot(float_model))
    assert gm.training and float_model.training
    assert qc.sqnr(gm, float_model, batches()) == first  # nothing moved in between


def test_batchnorm_running_stats_in_train_mode() -> None:
    float_model = model().train()
    gm = compiled("qat", float_model)
    gm.train()
    bn_keys = [k for k in gm.state_dict() if "running_" in k or "num_batches" in k]
    assert bn_keys
    before = snapshot(gm)
    qc.sqnr(gm, float_model, batches())
    assert_same(before, snapshot(gm))
    assert float_model.bn.num_batches_tracked.item() == 0  # the float model never ran


def test_calibrated_static_graph_unchanged() -> None:
    float_model = model().eval()
    gm = qc.calibrate(compiled("static", float_model), batches(2, 1), progress=False)
    before = snapshot(gm)
    rows = qc.sqnr(gm, float_model, batches())
    assert rows and all(r["sqnr_db"] > 10 for r in rows)
    assert_same(before, snapshot(gm))


def test_failed_measurement_restores_too() -> None:
    float_model = model().train()
    gm = compiled("qat", float_model)
    gm.train()
    before = snapshot(gm)
    with pytest.raises(Exception):  # noqa: B017 - whatever the wrong batch raises
        qc.sqnr(gm, float_model, [torch.randn(2, 3, 6, 6), torch.randn(2, 5, 6, 6)])
    assert_same(before, snapshot(gm))


def test_unchanged_puts_back_swapped_buffers() -> None:
    bn = nn.BatchNorm1d(3).train()
    bn.register_buffer("extra", torch.zeros(2))
    saved = copy.deepcopy(bn.state_dict())
    extra = bn.extra
    with unchanged(bn):
        assert not bn.training
        bn.extra = torch.ones(2)  # a module that replaces its buffer
        bn.running_mean.add_(1)
    assert bn.training and bn.extra is extra
    assert all(torch.equal(bn.state_dict()[k], v) for k, v in saved.items())
