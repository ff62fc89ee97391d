"""Training compiled graphs: QAT with BatchNorm, learnable (LSQ) scales, w4a8, bf16
models, and dynamic quantization's per-batch activation qparams."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        return self.fc(torch.flatten(self.pool(y), 1))


def classification_task(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random images labelled by a fixed random teacher (learnable, not trivial)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=gen)
    teacher = torch.randn(3, 4, generator=gen)
    y = (x.mean(dim=(2, 3)) @ teacher).argmax(dim=1)
    return x, y


def new_cnn(seed: int = 0) -> CNN:
    torch.manual_seed(seed)
    return CNN()


def train(gm: nn.Module, x: torch.Tensor, loss_fn, steps: int, opt: torch.optim.Optimizer
          ) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(gm(x))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def on_grid(out: torch.Tensor, q: qc.FakeQuantize) -> bool:
    """``out`` lies on ``q``'s per-tensor quantization grid."""
    levels = out.detach().float() / q.scale + q.zero_point
    return bool(((levels - levels.round()).abs() < 1e-3).all())


# -- int8 QAT ---------------------------------------------------------------------------------
def test_int8_qat_cnn_with_batchnorm_trains() -> None:
    x, y = classification_task()
    gm = qc.qcompile(new_cnn(), "int8-qat", (x[:2],))
    gm.train()
    qs = qc.quantizers(gm)
    assert {"conv1.weight_fake_quant", "conv1.output_fake_quant", "conv2.weight_fake_quant",
            "fc.weight_fake_quant", "fc.output_fake_quant"} <= set(qs)
    assert any(n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)),
                                                    nn.BatchNorm2d) for n in gm.graph.nodes)
    bn_mean = gm.get_submodule("bn1").running_mean.clone()
    act_scale = qs["conv1.output_fake_quant"].scale.clone()

    opt = torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad()
    F.cross_entropy(gm(x), y).backward()
    for name, p in gm.named_parameters():  # gradients reach every weight through the STE
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name

    losses = train(gm, x, lambda out: F.cross_entropy(out, y), 20, opt)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    # BatchNorm kept training, the activation observers kept tracking, fake-quant stayed on.
    assert not torch.equal(gm.get_submodule("bn1").running_mean, bn_mean)
    assert not torch.equal(qs["conv1.output_fake_quant"].scale, act_scale)
    assert on_grid(gm(x), qs["fc.output_fake_quant"])


# -- learnable scales ---------------------------------------------------------------------------
LSQ = {"quant": {"mode": "qat", "rules": [{
    "match": {"module": ["Conv2d", "Linear"]},
    "weight": {"dtype": "int8", "granularity": "per_channel", "learnable": True},
    "activation": {"dtype": "uint8", "symmetric": False, "learnable": True},
}]}}


def test_learnable_scales_get_gradients_and_train() -> None:
    x, y = classification_task()
    gm = qc.qcompile(new_cnn(), LSQ, (x[:2],))
    qs = qc.quantizers(gm)
    assert len(qs) == 6 and all(q.learnable for q in qs.values())
    params = {id(p) for p in gm.parameters()}
    for name, q in qs.items():
        assert isinstance(q.scale_offset, nn.Parameter) and q.scale_offset.requires_grad, name
        assert id(q.scale_offset) in params, f"{name}.scale_offset is not in gm.parameters()"
        assert q.scale.dtype == torch.float32 and bool((q.scale > 0).all()), name

    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    with torch.no_grad():  # a batch initialises the activation scales (observed at once;
        gm(x)              # a training step's observations would apply after the step)
    opt.zero_grad()
    F.cross_entropy(gm(x), y).backward()
    before = {}
    for name, q in qs.items():
        assert q.scale_offset.grad is not None, name
        assert q.scale_offset.grad.abs().sum() > 0, name
        assert q.observe is False, f"{name}: the observer must stop once the scale is learned"
        before[name] = q.scale.detach().clone()
    opt.step()
    for name, q in qs.items():
        assert not torch.equal(q.scale.detach(), before[name]), f"{name}.scale did not move"

    stepped = {name: q.scale.detach().clone() for name, q in qs.items()}
    with torch.no_grad():
        gm(x * 10)  # a wider batch: learned scales are not overwritten by observers
    for name, q in qs.items():
        assert torch.equal(q.scale.detach(), stepped[name]), name


# -- w4a8 ------------------------------------------------------------------------------------
def test_w4a8_qat_trains_an_mlp() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 32, generator=gen)
    target = x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:6].prod(dim=1, keepdim=True)
    gm = qc.qcompile(model, "w4a8-qat", (x[:2],))
    qs = qc.quantizers(gm)
    wq = qs["0.weight_fake_quant"]
    assert (wq.granularity, wq.group_size, wq.quant_min, wq.quant_max) == ("per_group", 32,
                                                                            -8, 7)
    assert wq.scale.numel() == 64 * 32 // 32
    assert qs["0.output_fake_quant"].granularity == "per_token"
    # int4 groups: at most 16 distinct values in every group of 32 weights
    wfq = wq(gm.get_submodule("0").weight).detach().reshape(-1, 32)
    assert max(len(row.unique()) for row in wfq) <= 16

    opt = torch.optim.Adam(gm.parameters(), lr=1e-2)
    losses = train(gm, x, lambda out: F.mse_loss(out, target), 25, opt)
    assert losses[-1] < 0.5 * losses[0], losses


# -- bf16 models ---------------------------------------------------------------------------
def test_bf16_model_trains_with_float32_scales() -> None:
    x, y = classification_task(16)
    model = new_cnn().to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    gm = qc.qcompile(model, "int8-qat", (xb[:2],))
    qs = qc.quantizers(gm)
    assert qs

    def check_qparam_dtypes() -> None:
        for name, q in qs.items():
            assert q.scale.dtype == torch.float32, name
            assert q.zero_point.dtype == torch.int32, name

    check_qparam_dtypes()
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    out = gm(xb)
    assert out.dtype == torch.bfloat16 and out.shape == (16, 4)
    F.cross_entropy(out.float(), y).backward()
    for name, p in gm.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    opt.step()
    check_qparam_dtypes()
    assert torch.isfinite(gm(xb).float()).all()
    check_qparam_dtypes()


# -- dynamic quantization -------------------------------------------------------------------
def _fake_quant_reference(x: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Asymmetric per-tensor fake-quant with qparams from this tensor alone."""
    lo, hi = torch.clamp(x.min(), max=0), torch.clamp(x.max(), min=0)
    scale = torch.clamp((hi - lo) / (qmax - qmin), min=torch.finfo(torch.float32).eps)
    zp = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    return (torch.clamp(torch.round(x / scale) + zp, qmin, qmax) - zp) * scale


def test_dynamic_activation_qparams_follow_each_batch() -> None:
    torch.manual_seed(0)
    # Without biases the float model is exactly scale-equivariant under powers of two.
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 4, bias=False))
    gen = torch.Generator().manual_seed(3)
    small = torch.randn(8, 16, generator=gen) * 1e-2
    large = torch.randn(8, 16, generator=gen) * 1e2
    gm = qc.qcompile(model, "int8-dynamic", (small,))
    qs = qc.quantizers(gm)
    act = qs["0.input_fake_quant"]  # dynamic mode quantizes what Linear reads
    assert act.dynamic and act.enabled and (act.quant_min, act.quant_max) == (0, 127)  # x86: 7-bit
    assert all(r.dynamic for r in qc.report(gm).quantizers if r.role == "activation")

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = act.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    try:
        outs = {}
        for name, batch in (("large", large), ("small", small), ("large2", large)):
            outs[name] = gm(batch).detach()
    finally:
        handle.remove()

    # Each batch is fake-quantized with the qparams of its own range.
    steps = []
    for inp, out in seen:
        torch.testing.assert_close(out, _fake_quant_reference(inp, 0, 127))
        steps.append((inp.max() - torch.clamp(inp.min(), max=0)).item() / 127)
    assert steps[0] / steps[1] > 1e3  # the small batch's grid is ~10^4 times finer

    # Hence a small batch after a large one keeps its resolution (a fixed scale would
    # round it to zero), and a batch gives the same result whatever came before.
    for name, batch in (("small", small), ("large", large)):
        ref = model(batch).detach()
        rel = (outs[name] - ref).abs().max() / ref.abs().max()
        assert rel < 0.05, (name, rel)
    assert torch.equal(outs["large"], outs["large2"])

    # Per-batch qparams scale with the batch: a power-of-two scaling is exact.
    k = 2.0**12
    assert torch.equal(gm(small * k), outs["small"] * k)
    assert torch.equal(gm(large / k), outs["large"] / k)


def test_dynamic_output_depends_on_batch_range() -> None:
    # The same sample quantizes differently when batched with a wide-range sample.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    gen = torch.Generator().manual_seed(4)
    sample = torch.randn(1, 16, generator=gen)
    gm = qc.qcompile(copy.deepcopy(model), "int8-dynamic", (sample,))
    alone = gm(sample).detach()
    with_outlier = gm(torch.cat([sample, sample * 50]))[:1].detach()
    assert not torch.equal(alone, with_outlier)
    float_out = model(sample).detach()
    assert (alone - float_out).abs().max() < (with_outlier - float_out).abs().max()


@pytest.mark.parametrize("preset", ["int8-qat", "w4a8-qat"])
def test_qat_gradients_match_float_when_fake_quant_is_off(preset: str) -> None:
    # Straight-through: with every quantizer disabled, the graph trains exactly like the
    # float model (same gradients), so differences come from fake-quant alone.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 32)
    ref = copy.deepcopy(model)
    gm = qc.qcompile(model, preset, (x,))
    for q in qc.quantizers(gm).values():
        q.enabled = False
    gm(x).square().sum().backward()
    ref(x).square().sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in gm.named_parameters():
        assert torch.equal(p.grad, ref_grads[name].grad), name
