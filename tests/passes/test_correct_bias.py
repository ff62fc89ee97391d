"""The ``correct_bias`` pass (``quant.algorithms: bias_correction``): it removes the mean
output shift that coarse weights leave (MLP, convolutions, both front ends), gives a layer
without a bias one (a new parameter and get_attr node, the state dict keeping the model's
names), composes after gptq, and a failure leaves every parameter as it was."""

from __future__ import annotations

import pytest
import torch

import qcompile as qc
from qcompile.errors import QCompileError
from tests.helpers.ptq_cases import (
    ConvNet,
    calibrated,
    conv_data,
    mean_shift,
    mlp,
    mlp_data,
    output_mse,
    spec,
)

BC = {"kind": "bias_correction"}
CALIB = [mlp_data(64, seed) for seed in range(4)]
TEST = mlp_data(1024, 100)
COARSE = {"dtype": "int3", "granularity": "per_tensor"}


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_removes_the_mean_shift(method):
    m = mlp()
    rtn = calibrated(m, spec([], method=method, **COARSE), CALIB)
    gm = calibrated(m, spec([BC], method=method, **COARSE), CALIB)
    assert mean_shift(gm, m, TEST) < 0.5 * mean_shift(rtn, m, TEST)
    assert output_mse(gm, m, TEST) < output_mse(rtn, m, TEST)
    rec = qc.report(gm).passes[-1]
    assert rec.name == "correct_bias.calibrate" and len(rec.notes) == 3
    # weights untouched: only the biases moved
    for k in ("0.weight", "2.weight", "4.weight"):
        assert torch.equal(gm.get_parameter(k), m.get_parameter(k))
    assert not torch.equal(gm.get_parameter("4.bias"), m.get_parameter("4.bias"))


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_a_layer_without_bias_gets_one(method):
    m = mlp(bias=False)
    rtn = calibrated(m, spec([], method=method, **COARSE), CALIB)
    gm = calibrated(m, spec([BC], method=method, **COARSE), CALIB)
    assert mean_shift(gm, m, TEST) < 0.5 * mean_shift(rtn, m, TEST)
    assert {"0.bias", "2.bias", "4.bias"} <= set(gm.state_dict())
    assert "0.bias" not in m.state_dict() and m[0].bias is None  # the user's model as it was
    assert all("bias added" in n for n in qc.report(gm).passes[-1].notes)
    code = gm.code
    assert code.count("bias") >= 3
    # the graph still saves and converts
    q = qc.convert(gm, example_inputs=(TEST[:4],))
    with torch.no_grad():
        assert (q(TEST[:4]) - gm(TEST[:4])).abs().max() < 0.1


def test_convolutions_correct_per_channel():
    m = ConvNet()
    calib = [conv_data(16, s) for s in range(4)]
    test = conv_data(256, 50)
    rtn = calibrated(m, spec([], **COARSE), calib)
    gm = calibrated(m, spec([BC], **COARSE), calib)
    assert mean_shift(gm, m, test) < 0.5 * mean_shift(rtn, m, test)
    assert "c2.bias" in gm.state_dict()  # c2 had none


def test_after_gptq_it_corrects_what_is_left():
    m = mlp()
    g = calibrated(m, spec([{"kind": "gptq"}], **COARSE), CALIB)
    both = calibrated(m, spec([{"kind": "gptq"}, BC], **COARSE), CALIB)
    assert [p.name for p in qc.report(both).passes[-2:]] == ["round_gptq.calibrate",
                                                             "correct_bias.calibrate"]
    assert mean_shift(both, m, TEST) < mean_shift(g, m, TEST)


def test_a_failure_restores_every_parameter():
    m = mlp(bias=False)
    gm = qc.qcompile(m, spec([{"kind": "gptq"}, BC], **COARSE), example_inputs=(CALIB[0],))
    params = dict(gm.named_parameters())
    values = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(QCompileError, match="calibration batch 2"):
        qc.calibrate(gm, [*CALIB[:2], torch.randn(3, 7)], progress=False)
    assert all(p is params[n] and torch.equal(p, values[n])
               for n, p in gm.named_parameters() if n in params)
    assert qc.report(gm).passes[-1].name == "overwrite_inputs"  # calibrate recorded nothing
