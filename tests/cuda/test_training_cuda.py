"""QAT on the GPU: a training step on the device matches the CPU's, in float32 and under
bf16 autocast, and ``torch.compile(fullgraph=True)`` of a compiled graph computes what
the eager graph computes (Inductor fuses the fake-quant formula into its own kernels)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.runtime.block_formats import fake_quantize_block
from qcompile.runtime.fake_quant import FakeQuantize

pytestmark = pytest.mark.cuda

# the presets a GPU user trains with, and block-scaled weights
BLOCKS = {"version": 1, "quant": {"mode": "qat", "rules": [
    {"match": {"module": "Linear", "name": "0"}, "weight": {"dtype": "nvfp4"}},
    {"match": {"module": "Linear", "name": "2"}, "weight": {"dtype": "mxfp4"}},
    {"match": {"module": "Linear"}, "weight": {"dtype": "nf4"}}]}}
SPECS = {"int8-qat": "int8-qat", "w4a8-qat": "w4a8-qat", "blocks": BLOCKS}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 16))


def task(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 64, generator=g)
    return x, (x[:, :16] - x[:, 16:32]).argmax(1)


def steps(gm: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int,
          autocast: torch.dtype | None = None) -> list[float]:
    opt = torch.optim.Adam(gm.parameters(), lr=1e-2)
    losses = []
    for _ in range(n):
        with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16,
                            enabled=autocast is not None):
            out = gm(x)
            if autocast is not None:
                assert out.dtype == autocast, "autocast computes the linears in bf16"
            loss = F.cross_entropy(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_qparams_float32(gm: nn.Module) -> None:
    for name, q in qc.quantizers(gm).items():
        assert q.scale.dtype == torch.float32 and q.zero_point.dtype == torch.int32, name
        if q.observer is not None:
            assert q.observer.min_val.dtype == torch.float32, name


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_first_qat_step_matches_the_cpu(spec: str, device: torch.device) -> None:
    """One float32 QAT step from the same state: the loss, every gradient and the qparams
    the step observed agree with the CPU's (matmuls differ in the last bits, which can
    move an activation by one quantization step in a few elements: a small tolerance)."""
    x, y = task()
    gm_cpu = qc.qcompile(mlp(), SPECS[spec], example_inputs=(x[:2],))
    gm_dev = copy.deepcopy(gm_cpu).to(device)
    losses = []
    for gm, xs, ys in ((gm_cpu, x, y), (gm_dev, x.to(device), y.to(device))):
        loss = F.cross_entropy(gm(xs), ys)
        loss.backward()
        losses.append(loss.item())
    assert math.isclose(losses[0], losses[1], rel_tol=1e-4), losses
    dev_params = dict(gm_dev.named_parameters())
    for name, p in gm_cpu.named_parameters():
        assert dev_params[name].device.type == device.type, name
        torch.testing.assert_close(dev_params[name].grad.cpu(), p.grad, rtol=2e-3, atol=2e-5,
                                   msg=lambda m, n=name: f"{spec} gradient of {n}: {m}")
    dev_q = qc.quantizers(gm_dev)
    for name, q in qc.quantizers(gm_cpu).items():
        torch.testing.assert_close(dev_q[name].scale.cpu(), q.scale, rtol=1e-5, atol=0,
                                   msg=lambda m, n=name: f"{spec} scale of {n}: {m}")


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_qat_trains_in_float32_and_bf16_autocast(spec: str, device: torch.device) -> None:
    x, y = task()
    x, y = x.to(device), y.to(device)
    ref = steps(qc.qcompile(mlp(), SPECS[spec], example_inputs=(x[:2],)).to(device), x, y, 30)
    gm = qc.qcompile(mlp(), SPECS[spec], example_inputs=(x[:2],)).to(device)
    losses = steps(gm, x, y, 30, autocast=torch.bfloat16)
    assert all(math.isfinite(v) for v in ref + losses)
    assert ref[-1] < 0.7 * ref[0], ref
    assert losses[-1] < 0.7 * losses[0], losses
    # bf16 rounds the linears' operands (~3 significant digits): the first ten steps'
    # losses within 5% of the float32 run's (measured on the CPU: within 1%)
    for i, (a, b) in enumerate(zip(losses[:10], ref[:10])):
        assert abs(a - b) < 0.05 * b + 0.01, (i, losses[:10], ref[:10])
    for name, p in gm.named_parameters():
        assert p.dtype == torch.float32 and p.device.type == device.type, name
    check_qparams_float32(gm)


def one_step_outcome(call: nn.Module, gm: nn.Module, x: torch.Tensor, y: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``call(x)`` (``gm`` or its compiled form) forward and backward: the output and the
    gradients of ``gm``'s parameters."""
    out = call(x)
    F.cross_entropy(out, y).backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in gm.named_parameters()
                          if p.grad is not None}


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_torch_compile_fullgraph_equals_eager(spec: str, device: torch.device) -> None:
    """A training-mode QAT step (observers updating) through ``torch.compile(gm,
    fullgraph=True)``: no graph break, outputs and gradients as the eager graph's, and
    the qparams observed the same ranges."""
    x, y = task(64)
    x, y = x.to(device), y.to(device)
    eager = qc.qcompile(mlp(), SPECS[spec], example_inputs=(x[:2],)).to(device)
    gm = qc.qcompile(mlp(), SPECS[spec], example_inputs=(x[:2],)).to(device)
    torch._dynamo.reset()
    with _division_rounding():  # x / scale rounded as eager rounds it (docs: GPU)
        compiled = torch.compile(gm, fullgraph=True)
        out_c, grads_c = one_step_outcome(compiled, gm, x, y)
    out_e, grads_e = one_step_outcome(eager, eager, x, y)
    # the matmuls may still differ in their last bits (Inductor's own kernels): an
    # activation may move by one quantization step in rare elements; the output is then
    # off by about a step times a weight
    diff = (out_c - out_e).abs()
    assert float(diff.max()) < 0.05 * float(out_e.abs().max()), float(diff.max())
    assert float((diff > 1e-5).float().mean()) < 0.05
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=2e-2, atol=2e-3,
                                   msg=lambda m, n=name: f"{spec} gradient of {n}: {m}")
    q_c = qc.quantizers(gm)
    for name, q in qc.quantizers(eager).items():
        torch.testing.assert_close(q_c[name].scale, q.scale, rtol=1e-5, atol=0,
                                   msg=lambda m, n=name: f"{spec} scale of {n}: {m}")


def _division_rounding():
    """Inductor's switch for IEEE-rounded fp32 division in its GPU kernels (the eager
    ops' rounding; Triton's ``/`` is ``div.full.f32``, within 2 ulp), by the name this
    torch gives it."""
    import torch._inductor.config as config

    if hasattr(config, "eager_numerics"):
        return config.patch({"eager_numerics.division_rounding": True})
    if hasattr(config, "emulate_division_rounding"):
        return config.patch(emulate_division_rounding=True)
    pytest.skip("this torch's Inductor has no switch for IEEE-rounded division")


def test_compiled_quantizers_are_bit_exact_with_ieee_division(device: torch.device,
                                                              same_bits) -> None:
    """With IEEE-rounded division, every kind of quantizer compiled by Inductor gives the
    eager bits, forward and backward (one compiled function for all of them)."""
    quantizers = [FakeQuantize("int8"), FakeQuantize("uint8", symmetric=False),
                  FakeQuantize("int8", granularity="per_channel", axis=0, channels=64),
                  FakeQuantize("int4", granularity="per_group", group_size=32,
                               channels=64 * 256 // 32),
                  FakeQuantize("int8", symmetric=False, granularity="per_token"),
                  FakeQuantize("fp8_e4m3"), FakeQuantize("int8", learnable=True)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g)
    for q in quantizers:
        q(x * 0.9)
        q.observe = False
    quantizers = [q.to(device) for q in quantizers]
    blocks = [("mxfp8_e4m3", 32), ("mxfp6_e2m3", 32), ("mxfp4", 32), ("nvfp4", 16),
              ("nf4", 64)]

    def all_kinds(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        kinds = [*quantizers, *[lambda t, f=f, b=b: fake_quantize_block(t, f, b)
                                for f, b in blocks]]
        return [fn(t) for fn, t in zip(kinds, ts)]

    n = len(quantizers) + len(blocks)
    xd = x.to(device)
    grad = torch.randn(64, 256, generator=g).to(device)
    torch._dynamo.reset()
    with _division_rounding():
        compiled = torch.compile(all_kinds, fullgraph=True)
        # one leaf per kind: each gradient comes from one quantizer (no sum across kinds,
        # whose order Inductor may choose differently)
        leaves_c = [xd.clone().requires_grad_(True) for _ in range(n)]
        leaves_e = [xd.clone().requires_grad_(True) for _ in range(n)]
        outs_c, outs_e = compiled(leaves_c), all_kinds(leaves_e)
        torch.autograd.backward(outs_c, [grad] * n)
        torch.autograd.backward(outs_e, [grad] * n)
    names = [repr(q) for q in quantizers] + [f for f, _ in blocks]
    for name, oc, oe, lc, le in zip(names, outs_c, outs_e, leaves_c, leaves_e):
        same_bits(oc, oe, f"compiled {name}")
        same_bits(lc.grad, le.grad, f"compiled {name}: input gradient")
