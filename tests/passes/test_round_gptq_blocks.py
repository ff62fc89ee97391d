"""GPTQ on block-scaled weights (``gptq_blocks``, and ``quant.algorithms: gptq`` with a
block-format weight scheme): on correlated inputs it beats round-to-nearest on the layer's
output error, and the weight it writes is its own fake-quant, so the forward (which computes
every block's scale from the weight) reproduces it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.graph.layerwise import output_error
from qcompile.passes.round_gptq import gptq_blocks
from qcompile.runtime.block_formats import fake_quant_eager

CASES = [(fmt, block, False) for fmt, block in (
    ("mxfp4", 32), ("nvfp4", 16), ("nf4", 64), ("nf4", 16), ("mxfp8_e4m3", 32),
    ("mxfp6_e2m3", 32))] + [("mxfp4", 32, True), ("nvfp4", 16, True), ("nf4", 64, True)]


def _layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight with one outlier (NVFP4's tensor scale) and the Gram matrix of correlated,
    off-centre inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)
    x = x + 2 * torch.randn(64, generator=g)
    w = 0.05 * torch.randn(24, 64, generator=g)
    w[3, 37] = 0.8
    return w, x.T @ x


@pytest.mark.parametrize(("fmt", "block", "act_order"), CASES)
def test_beats_round_to_nearest_and_is_its_own_fake_quant(fmt, block, act_order):
    w, h = _layer()
    q, damp = gptq_blocks(w, h, fmt, block, block_size=48, act_order=act_order)
    assert damp == 0.01
    again = fake_quant_eager(q, fmt, block)
    if fmt == "nvfp4":  # the tensor scale amax / 2688 is found again to a float32 rounding
        assert torch.allclose(again, q, rtol=1e-6, atol=0)
    else:
        assert torch.equal(again, q)
    rtn = output_error(fake_quant_eager(w, fmt, block) - w, h, 512)
    assert output_error(q - w, h, 512) < 0.75 * rtn


def test_nvfp4_keeps_the_tensor_scale_when_the_largest_weight_moves():
    """The largest element's column is updated before it is rounded (it is not its block's
    first column) and its block's grid is taken from the updated values: the block still
    gets the largest scale, so the tensor scale the forward computes is the original's."""
    w, h = _layer(1)
    w[5, 17] = -1.0  # column 17: the second block's second column
    q, _ = gptq_blocks(w, h, "nvfp4", 16)
    assert q.abs().max() == pytest.approx(1.0, rel=1e-6)
    assert torch.allclose(fake_quant_eager(q, "nvfp4", 16), q, rtol=1e-6, atol=0)


def test_dead_inputs_and_rows_that_do_not_split_into_blocks():
    x = torch.zeros(64, 32)
    x[:, :16] = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    q, _ = gptq_blocks(w, x.T @ x, "mxfp4", 32)
    assert torch.isfinite(q).all() and torch.equal(fake_quant_eager(q, "mxfp4", 32), q)
    with pytest.raises(ValueError, match="blocks of 16"):
        gptq_blocks(torch.randn(4, 24), torch.eye(24), "nvfp4", 16)


def _data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(32, 32, generator=torch.Generator().manual_seed(9)) / 3 + torch.eye(32)
    return torch.randn(n, 32, generator=g) @ mix + 0.5


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_calibrate_runs_it_on_block_format_layers(fmt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    calib, test = [_data(128, s) for s in range(4)], _data(512, 10)

    def compiled(algorithms):
        spec = qc.CompileSpec.model_validate({"quant": {
            "mode": "static", "algorithms": algorithms,
            "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": fmt,
                                                                 "group_size": 16}}]}})
        gm = qc.qcompile(model, spec, example_inputs=(calib[0],))
        return qc.calibrate(gm, calib, progress=False)

    def mse(gm):
        with torch.no_grad():
            return float(((gm(test) - model(test)) ** 2).mean())

    rtn, gm = compiled([]), compiled([{"kind": "gptq", "block_size": 32}])
    assert mse(gm) < 0.8 * mse(rtn)
    record = qc.report(gm).passes[-1]
    assert record.name == "round_gptq.calibrate" and len(record.notes) == 2
    assert all("% of round-to-nearest" in n for n in record.notes)
    for name in ("0", "2"):  # the forward reproduces the weights GPTQ wrote
        w = gm.get_submodule(name).weight.detach()
        assert torch.allclose(fake_quant_eager(w, fmt, 16), w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_calibrate_runs_it_on_llama_cpp_super_blocks(fmt):
    """Weight-only PTQ on llama.cpp's K grids through the spec: GPTQ lowers the model's
    output error against round-to-nearest, and the forward finds GPTQ's weights again bit
    for bit (their fp16 super-block scales and sub-block codes included)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))
    mix = torch.randn(256, 256, generator=torch.Generator().manual_seed(9)) / 16 + torch.eye(256)
    calib, test = [torch.randn(128, 256, generator=torch.Generator().manual_seed(s)) @ mix
                   for s in range(4)], torch.randn(512, 256) @ mix

    def compiled(algorithms):
        spec = qc.CompileSpec.model_validate({"quant": {
            "mode": "static", "target": "generic", "algorithms": algorithms,
            "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": fmt}}]}})
        gm = qc.qcompile(model, spec, example_inputs=(calib[0],))
        return qc.calibrate(gm, calib, progress=False)

    def mse(gm):
        with torch.no_grad():
            return float(((gm(test) - model(test)) ** 2).mean())

    rtn, gm = compiled([]), compiled([{"kind": "gptq", "block_size": 64}])
    assert mse(gm) < 0.8 * mse(rtn)
    for name in ("0", "2"):
        w = gm.get_submodule(name).weight.detach()
        assert torch.equal(fake_quant_eager(w, fmt, 256), w)
        assert not torch.equal(w, fake_quant_eager(model.get_submodule(name).weight, fmt, 256))


def test_adaround_leaves_block_format_layers_to_round_to_nearest():
    """AdaRound learns a rounding on a fixed grid; a block-scaled weight has none: it is
    skipped with the reason, and an integer layer beside it is still rounded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    calib = [_data(64, s) for s in range(2)]
    spec = qc.CompileSpec.model_validate({"quant": {
        "mode": "static", "algorithms": [{"kind": "adaround", "iterations": 5}],
        "rules": [{"match": {"name": "0"}, "weight": {"dtype": "nvfp4"}},
                  {"match": {"name": "2"}, "weight": {"dtype": "int4"}}]}})
    gm = qc.calibrate(qc.qcompile(model, spec, example_inputs=(calib[0],)), calib,
                      progress=False)
    notes = qc.report(gm).passes[-1].notes
    assert any("block-scaled" in n and n.startswith("0") for n in notes), notes
    assert any("round-to-nearest)" in n and n.startswith("2") for n in notes), notes


def test_weights_read_by_other_ops_are_named_as_left_to_round_to_nearest():
    """A fused-experts-style ``[experts, out, in]`` parameter read by ``bmm`` (quantized
    by an op rule) is not a conv/linear layer: GPTQ rounds the Linear beside it and names
    the parameter it leaves to round-to-nearest, at compile time and after calibration."""

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.experts = nn.Parameter(torch.randn(2, 32, 32) / 6)

        def forward(self, x):
            h = self.proj(x)
            return torch.bmm(h.unsqueeze(0).expand(2, -1, -1), self.experts.transpose(1, 2))

    torch.manual_seed(0)
    calib = [_data(64, s) for s in range(2)]
    scheme = {"weight": {"dtype": "int4", "granularity": "per_channel"}, "optional": True}
    spec = qc.CompileSpec.model_validate({"quant": {
        "mode": "static", "algorithms": [{"kind": "gptq", "block_size": 16}],
        "rules": [{"match": {"module": "Linear"}, **scheme},
                  {"match": {"op": ["bmm"], "reads_weight": True}, **scheme}]}})
    gm = qc.qcompile(Experts(), spec, example_inputs=(calib[0],))
    compiled = [n for r in qc.report(gm).passes for n in r.notes]
    gm = qc.calibrate(gm, calib, progress=False)
    notes = qc.report(gm).passes[-1].notes
    assert notes[0].startswith("proj (32x32): output error")
    for where in (compiled, notes):
        assert any(n.endswith("experts left to round-to-nearest: read by an op other than "
                              "conv/linear (a fused expert weight, bmm, einsum ...)")
                   for n in where), where
