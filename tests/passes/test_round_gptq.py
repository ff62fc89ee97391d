"""The ``round_gptq`` pass (``quant.algorithms: gptq``): it plans at compile time and runs
in ``qc.calibrate``; on correlated inputs it beats round-to-nearest at 3 and 4 bits (per
channel, per group, act_order, convolutions, both front ends, a pipeline's stages), its
weights lie on the quantizer's grid, it is deterministic, it runs before the observers, and
what it cannot do is refused or left alone with a note."""

from __future__ import annotations

import pytest
import torch

import qcompile as qc
from qcompile.errors import QCompileError
from qcompile.graph.layerwise import output_error, round_to_grid
from qcompile.passes.round_gptq import gptq
from tests.helpers.ptq_cases import (
    ConvNet,
    calibrated,
    conv_data,
    mlp,
    mlp_data,
    output_mse,
    spec,
    weights_on_grid,
)

GPTQ = {"kind": "gptq", "block_size": 8}
CALIB = [mlp_data(64, seed) for seed in range(4)]
TEST = mlp_data(512, 100)


def test_the_solver_beats_rounding_on_its_own_objective():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 24, generator=g) @ torch.randn(24, 24, generator=g)
    w = torch.randn(12, 24, generator=g)
    s, z = w.abs().amax(1, keepdim=True).expand_as(w) / 3, torch.zeros_like(w)
    h = x.T @ x
    rtn = output_error(round_to_grid(w, s, z, -4, 3) - w, h, 512)
    for act_order in (False, True):
        for block in (1, 5, 128):
            q, damp = gptq(w, h, s, z, -4, 3, block_size=block, act_order=act_order)
            assert damp == 0.01
            assert output_error(q - w, h, 512) < 0.7 * rtn
            assert torch.equal(round_to_grid(q, s, z, -4, 3), q)


def test_dead_inputs_and_a_singular_hessian():
    """An input that is always zero, and H of rank 1: still a rounding on the grid."""
    x = torch.zeros(64, 6)
    x[:, 0] = torch.arange(64.0)
    w = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    s, z = torch.full_like(w, 0.1), torch.zeros_like(w)
    q, _ = gptq(w, x.T @ x, s, z, -8, 7)
    assert torch.isfinite(q).all() and torch.equal(round_to_grid(q, s, z, -8, 7), q)
    assert torch.equal(q[:, 1:], torch.zeros(3, 5))  # columns nothing reads: zero


@pytest.mark.parametrize(("granularity", "dtype", "group"), [
    ("per_channel", "int3", None), ("per_group", "int4", 8), ("per_tensor", "int4", None)])
@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_beats_round_to_nearest_on_an_mlp(granularity, dtype, group, method):
    m = mlp()
    kw = {"dtype": dtype, "granularity": granularity, "group_size": group, "method": method}
    rtn = output_mse(calibrated(m, spec([], **kw), CALIB), m, TEST)
    gm = calibrated(m, spec([GPTQ], **kw), CALIB)
    assert output_mse(gm, m, TEST) < 0.8 * rtn
    assert weights_on_grid(gm)
    notes = qc.report(gm).passes[-1].notes
    assert qc.report(gm).passes[-1].name == "round_gptq.calibrate" and len(notes) == 3
    assert all("% of round-to-nearest" in n for n in notes)


def test_act_order_and_big_blocks_too():
    m = mlp()
    rtn = output_mse(calibrated(m, spec([]), CALIB), m, TEST)
    gm = calibrated(m, spec([{"kind": "gptq", "act_order": True, "block_size": 128}]), CALIB)
    assert output_mse(gm, m, TEST) < 0.8 * rtn


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_convolutions_strided_dilated_and_1d(method):
    m = ConvNet()
    calib = [conv_data(16, s) for s in range(4)]
    test = conv_data(128, 50)
    rtn = output_mse(calibrated(m, spec([], method=method, batch_arg="x"), calib), m, test)
    gm = calibrated(m, spec([GPTQ], method=method, batch_arg="x"), calib)
    assert output_mse(gm, m, test) < 0.8 * rtn
    assert weights_on_grid(gm)
    assert len(qc.report(gm).passes[-1].notes) == 4  # c1, c2, c3 (1-d), fc


def test_deterministic():
    a = calibrated(mlp(), spec([GPTQ]), CALIB).state_dict()
    b = calibrated(mlp(), spec([GPTQ]), CALIB).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_model_is_not_touched_and_the_grid_stays():
    m = mlp()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    gm = qc.qcompile(m, spec([GPTQ], activation=True), example_inputs=(CALIB[0],))
    scales = {n: q.scale.clone() for n, q in qc.quantizers(gm).items() if "weight" in n}
    qc.calibrate(gm, CALIB, progress=False)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    # the weights were rounded onto these scales: calibration must not observe them again
    assert all(torch.equal(qc.quantizers(gm)[n].scale, s) for n, s in scales.items())
    assert not torch.equal(gm.get_parameter("0.weight"), m[0].weight)
    # the activations were calibrated on the final weights (the first layer's output range
    # is that of linear-relu with the rounded weight, which fake-quantizes to itself)
    w, b = gm.get_parameter("0.weight"), gm.get_parameter("0.bias")
    outs = torch.cat([torch.relu(torch.nn.functional.linear(x, w, b)) for x in CALIB]).detach()
    obs = qc.quantizers(gm)["0.output_fake_quant"].observer
    assert torch.allclose(obs.min_val, outs.min()) and torch.allclose(obs.max_val, outs.max())


def test_convert_and_encodings_wait_for_calibration(tmp_path):
    gm = qc.qcompile(mlp(), spec([GPTQ], activation=True), example_inputs=(CALIB[0],))
    for call in (lambda: qc.convert(gm), lambda: qc.export_encodings(gm, tmp_path / "e.json")):
        with pytest.raises(QCompileError) as info:
            call()
        assert "quant.algorithms[0] (gptq) has not run yet" in str(info.value)
        assert "qc.calibrate(gm, batches)" in str(info.value)
    qc.calibrate(gm, CALIB, progress=False)
    q = qc.convert(gm, example_inputs=(TEST[:8],))
    with torch.no_grad():
        assert (q(TEST[:8]) - gm(TEST[:8])).abs().max() < 0.05


def test_dynamic_mode_runs_only_the_algorithm():
    m = mlp()
    gm = qc.qcompile(m, spec([GPTQ], mode="dynamic", activation=True),
                     example_inputs=(CALIB[0],))
    rtn = output_mse(gm, m, TEST)
    qc.calibrate(gm, CALIB, progress=False)
    assert output_mse(gm, m, TEST) < 0.8 * rtn
    plain = qc.qcompile(m, spec([], mode="dynamic", activation=True), example_inputs=(CALIB[0],))
    with pytest.raises(QCompileError, match=r"calibration is for quant.mode 'static'"):
        qc.calibrate(plain, CALIB)


def test_pipeline_stages_are_rounded_in_order():
    m = mlp()
    pipe = {"stages": 2}
    rtn = output_mse(calibrated(m, spec([], pipeline=pipe), CALIB), m, TEST)
    gm = calibrated(m, spec([GPTQ], pipeline=pipe), CALIB)
    assert output_mse(gm, m, TEST) < 0.8 * rtn
    assert len(qc.report(gm).passes[-1].notes) == 3 and weights_on_grid(gm)
    assert len([n for n, _ in gm.named_children() if n.startswith("stage_")]) == 2


def test_a_misfit_batch_is_named_and_changes_nothing():
    gm = qc.qcompile(mlp(), spec([GPTQ], activation=True), example_inputs=(CALIB[0],))
    params = dict(gm.named_parameters())
    state = {k: v.clone() for k, v in gm.state_dict().items()}
    with pytest.raises(QCompileError) as info:
        qc.calibrate(gm, [CALIB[0], torch.randn(4, 5)], progress=False)
    assert "calibration batch 1 (input: float32[4, 5]) does not fit" in str(info.value)
    assert all(p is params[n] for n, p in gm.named_parameters())
    assert all(torch.equal(v, state[k]) for k, v in gm.state_dict().items())
    assert qc.report(gm).passes[-1].name == "overwrite_inputs"  # nothing recorded
    qc.calibrate(gm, CALIB, progress=False)  # still pending: runs now
    assert qc.report(gm).passes[-1].name == "round_gptq.calibrate"


def test_no_layer_to_round_is_refused_at_compile():
    s = qc.CompileSpec.model_validate({"quant": {"mode": "static", "algorithms": [GPTQ], "rules": [
        {"match": {"module": "Linear"}, "activation": {"dtype": "uint8"}}]}})
    with pytest.raises(QCompileError) as info:
        qc.qcompile(mlp(), s, example_inputs=(CALIB[0],))
    assert "quant.algorithms[0] (gptq): no layer to round" in str(info.value)
    assert "no rule quantizes a weight" in str(info.value)


def test_fp8_and_grouped_convolutions_are_left_with_a_note():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = torch.nn.Conv2d(4, 4, 3, groups=4)
            self.fc = torch.nn.Linear(4 * 6 * 6, 3)

        def forward(self, x):
            return self.fc(self.dw(x).flatten(1))
    s = qc.CompileSpec.model_validate({"quant": {"mode": "static", "algorithms": [GPTQ], "rules": [
        {"match": {"module": "Conv2d"}, "weight": {"dtype": "int4"}},
        {"match": {"module": "Linear"}, "weight": {"dtype": "fp8_e4m3"}}]}})
    with pytest.raises(QCompileError, match="dw: a grouped convolution"):
        qc.qcompile(Net(), s, example_inputs=(torch.randn(2, 4, 8, 8),))
    s2 = s.model_copy(deep=True)
    s2.quant.rules[1].weight.__dict__["dtype"] = "int4"
    gm = qc.qcompile(Net(), qc.CompileSpec.model_validate(s2.model_dump()),
                     example_inputs=(torch.randn(2, 4, 8, 8),))
    notes = next(p for p in qc.report(gm).passes if p.name == "round_gptq").notes
    assert any("dw left to round-to-nearest: a grouped convolution (groups=4)" in n for n in notes)


def test_no_batches_or_empty_batches_are_refused():
    gm = qc.qcompile(mlp(), spec([GPTQ]), example_inputs=(CALIB[0],))
    with pytest.raises(QCompileError, match="calibrate: no batches were given"):
        qc.calibrate(gm, [], progress=False)
    with pytest.raises(QCompileError) as info:
        qc.calibrate(gm, [torch.randn(0, 16)], progress=False)
    assert "calibration batch 0" in str(info.value) and "0 rows" in str(info.value)
    assert qc.report(gm).passes[-1].name == "overwrite_inputs"  # still pending
