"""Layer statistics for the data-driven algorithms: the layers found (both front ends,
pipelines), their levels (parallel branches share one, residual chains do not), Gram
matrices equal to ``X^T X`` of the inputs computed by hand (linear, strided / padded /
dilated conv2d, conv1d), output means per channel, early stopping, summing across ranks,
and grids equal to the quantizer's own fake-quant."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.graph.layerwise import (
    Sweep,
    levels,
    quantized_layers,
    round_to_grid,
    weight_grid,
)
from qcompile.graph.running import untouched
from tests.helpers.ptq_cases import ConvNet, conv_data, spec


class Branches(nn.Module):
    """q, k, v read one value (one level); out reads their result; fc reads x + out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.out, self.fc = (nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x)
        return self.fc(x + self.out(a))


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_levels_of_parallel_and_chained_layers(method):
    x = torch.randn(2, 4, 8)
    gm = qc.qcompile(Branches(), spec([], method=method, batch_arg="x"), example_inputs=(x,))
    layers = quantized_layers(gm)
    assert [layer.name for layer in layers] == ["q", "k", "v", "out", "fc"]
    assert {layer.name: lv for layer, lv in levels(gm, layers).items()} == {
        "q": 1, "k": 1, "v": 1, "out": 2, "fc": 3}


def test_levels_cross_pipeline_stages():
    torch.manual_seed(0)
    m = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    gm = qc.qcompile(m, spec([], pipeline={"stages": 2}), example_inputs=(torch.randn(2, 8),))
    layers = quantized_layers(gm)
    assert [layer.owner for layer in layers] == ["stage_0", "stage_0", "stage_1", "stage_1"]
    assert list(levels(gm, layers).values()) == [1, 2, 3, 4]


def test_gram_matrices_are_x_transpose_x_of_the_inputs():
    m = ConvNet()
    gm = qc.qcompile(m, spec([]), example_inputs=(conv_data(2, 0),))
    layers = {layer.name: layer for layer in quantized_layers(gm)}
    batches = [((conv_data(3, s),), {}) for s in range(2)]
    with untouched(gm):
        stats = Sweep(gm, batches, gram=list(layers.values()), mean=[layers["fc"]]).run()
    xs = torch.cat([b[0][0] for b in batches])
    with torch.no_grad():
        w1 = qc.quantizers(gm)["c1.weight_fake_quant"](gm.get_parameter("c1.weight").clone())
        h1 = torch.relu(F.conv2d(xs, w1, m.c1.bias, stride=2, padding=1))
    p1 = F.unfold(xs, 3, padding=1, stride=2).transpose(1, 2).reshape(-1, 27)
    assert torch.allclose(stats.gram[layers["c1"]], p1.T @ p1, rtol=1e-4, atol=1e-3)
    assert stats.rows[layers["c1"]] == 6 * 16
    p2 = F.unfold(h1, 3, dilation=2, padding=2).transpose(1, 2).reshape(-1, 72)
    assert torch.allclose(stats.gram[layers["c2"]], p2.T @ p2, rtol=1e-4, atol=1e-2)
    assert stats.rows[layers["c2"]] == 6 * 16
    assert stats.rows[layers["c3"]] == 6 * 16 and stats.gram[layers["c3"]].shape == (24, 24)
    assert stats.out_count[layers["fc"]] == 6 and stats.out_sum[layers["fc"]].shape == (4,)


def test_a_sweep_stops_each_batch_after_its_layers_and_sums_across_ranks():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    gm = qc.qcompile(m, spec([]), example_inputs=(torch.randn(2, 4),))
    first, _ = quantized_layers(gm)
    ran = []
    second_fq = qc.quantizers(gm)["2.weight_fake_quant"]
    second_fq.register_forward_hook(lambda *a: ran.append(1))
    batches = [((torch.randn(5, 4),), {}) for _ in range(3)]
    calls = []

    def twice(tensors):  # two identical ranks
        calls.append(len(tensors))
        for t in tensors:
            t.mul_(2)
    with untouched(gm):
        stats = Sweep(gm, batches, gram=[first], reduce=twice).run()
    assert ran == []  # the second layer's weight was never even fake-quantized
    xs = torch.cat([b[0][0] for b in batches])
    assert torch.allclose(stats.gram[first], 2 * xs.T @ xs, atol=1e-4)
    assert stats.rows[first] == 30 and calls == [1]


@pytest.mark.parametrize(("granularity", "group"), [
    ("per_tensor", None), ("per_channel", None), ("per_group", 4)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_the_grid_is_the_quantizers_own(granularity, group, symmetric):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(4, 6, 2), nn.Flatten(), nn.Linear(6 * 8, 5))
    s = qc.CompileSpec.model_validate({"quant": {"mode": "static", "rules": [
        {"match": {"module": ["Linear", "Conv2d"]},
         "weight": {"dtype": "int4", "granularity": granularity, "group_size": group,
                    "symmetric": symmetric}}]}})
    gm = qc.qcompile(m, s, example_inputs=(torch.randn(2, 4, 3, 5),))
    for layer in quantized_layers(gm):
        q, w = layer.get_quantizer(gm), layer.get_weight(gm).detach()
        scale, zp = weight_grid(q, w)
        mine = round_to_grid(w.reshape(w.shape[0], -1), scale, zp, q.quant_min, q.quant_max)
        with torch.no_grad():
            assert torch.equal(mine.reshape(w.shape), q(w.clone()))


@pytest.mark.parametrize("model", ["branches", "conv"])
def test_the_walker_gives_what_running_every_level_from_the_inputs_gives(model, monkeypatch):
    """Continuing each batch from where the last level stopped (``Walker``) rounds and
    corrects exactly as re-running the graph from the inputs for every level does."""
    from qcompile.graph.layerwise import Walker

    algorithms = [{"kind": "gptq", "block_size": 4}, {"kind": "bias_correction"}]
    if model == "branches":
        build, batches, arg = Branches, [torch.randn(3, 4, 8) for _ in range(3)], "x"
    else:
        build, batches, arg = ConvNet, [conv_data(4, s) for s in range(3)], "x"
    s = spec(algorithms, batch_arg=arg)

    def run():
        gm = qc.qcompile(build(), s, example_inputs=(batches[0],))
        return qc.calibrate(gm, batches, progress=False).state_dict()
    walked = run()
    monkeypatch.setattr(Walker, "fits", staticmethod(lambda gm: False))
    rerun = run()
    assert walked.keys() == rerun.keys()
    assert all(torch.equal(walked[k], rerun[k]) for k in walked), [
        k for k in walked if not torch.equal(walked[k], rerun[k])]
