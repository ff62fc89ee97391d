"""Every fake-quant kind gives the same bits on the GPU as the CPU reference, forward and
backward: integer per-tensor / per-channel / per-group / per-token, fp8, LSQ, and the
block-scaled formats (``fake_quantize_block`` and ``FakeQuantize`` with a block dtype).

Two questions, asked separately: with the same qparams, does the device fake-quantize to
the same bits (the quantizer's arithmetic); and does a quantizer that observes on the
device arrive at the same qparams (the observer's arithmetic)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qcompile.runtime.block_formats import (
    BLOCK_DTYPES,
    GGML_FORMATS,
    default_block,
    dequantize_blocks,
    fake_quant_eager,
    fake_quantize_block,
    quantize_blocks,
)
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.specs import Scheme

pytestmark = pytest.mark.cuda

# name -> (FakeQuantize arguments, input shape)
INT_KINDS = {
    "int8_per_tensor": ({"dtype": "int8"}, (64, 256)),
    "uint8_per_tensor_affine": ({"dtype": "uint8", "symmetric": False}, (64, 256)),
    "uint8_moving_average": ({"dtype": "uint8", "symmetric": False,
                              "observer": {"kind": "moving_average", "momentum": 0.1}},
                             (64, 256)),
    "int8_per_channel_rows": ({"dtype": "int8", "granularity": "per_channel", "axis": 0,
                               "channels": 64}, (64, 256)),
    "uint8_per_channel_dim1": ({"dtype": "uint8", "symmetric": False,
                                "granularity": "per_channel", "axis": 1, "channels": 16},
                               (8, 16, 32)),
    "int4_per_group": ({"dtype": "int4", "granularity": "per_group", "group_size": 32,
                        "channels": 64 * 256 // 32}, (64, 256)),
    "int8_per_token": ({"dtype": "int8", "symmetric": False, "granularity": "per_token"},
                       (8, 16, 64)),
    "fp8_e4m3": ({"dtype": "fp8_e4m3"}, (64, 256)),
    "fp8_e5m2_per_channel": ({"dtype": "fp8_e5m2", "granularity": "per_channel", "axis": 0,
                              "channels": 64}, (64, 256)),
    "lsq_per_tensor": ({"dtype": "int8", "learnable": True}, (64, 256)),
    "lsq_per_channel": ({"dtype": "int4", "learnable": True, "granularity": "per_channel",
                         "axis": 0, "channels": 64}, (64, 256)),
}


def inputs(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Normal values with a few outliers (some elements clamp: the backward has a mask)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x.view(-1)[:: 97] *= 8.0
    return x


def make(kind: str) -> FakeQuantize:
    kw = dict(INT_KINDS[kind][0])
    return FakeQuantize(kw.pop("dtype"), **kw)


def run(fq: FakeQuantize, x: torch.Tensor, grad: torch.Tensor, *, weight: bool
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of ``fq`` on ``x`` (an ``nn.Parameter`` when ``weight``):
    output, input gradient, and the gradients of the quantizer's own parameters."""
    leaf = nn.Parameter(x.clone()) if weight else x.clone().requires_grad_(True)
    out = fq(leaf)
    out.backward(grad)
    return out, leaf.grad, {n: p.grad for n, p in fq.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("weight", [False, True], ids=["activation", "weight"])
@pytest.mark.parametrize("kind", sorted(INT_KINDS))
def test_same_qparams_same_bits(kind: str, weight: bool, device: torch.device,
                                same_bits) -> None:
    shape = INT_KINDS[kind][1]
    x, g = inputs(shape, 1), inputs(shape, 2)
    cpu = make(kind)
    cpu(inputs(shape, 3) * 0.9)  # qparams from other data: some of x clamps
    cpu.observe = False
    dev = copy.deepcopy(cpu).to(device)
    out_c, gx_c, gp_c = run(cpu, x, g, weight=weight)
    out_d, gx_d, gp_d = run(dev, x.to(device), g.to(device), weight=weight)
    assert out_d.device.type == device.type
    same_bits(out_d, out_c, f"{kind} forward")
    same_bits(gx_d, gx_c, f"{kind} input gradient")
    assert set(gp_d) == set(gp_c)
    for name, grad in gp_c.items():  # LSQ's scale gradient: a sum, in another order
        torch.testing.assert_close(gp_d[name].cpu(), grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{kind} {n} gradient: {m}")


@pytest.mark.parametrize("kind", sorted(INT_KINDS))
def test_observing_on_the_device_gives_the_cpu_qparams(kind: str, device: torch.device,
                                                       same_bits) -> None:
    """Observers and qparams computed on the device (min / max, then the scale divides
    by the range's steps): the same bits as on the CPU, so a graph trained on a GPU
    exports the qparams a CPU run would have produced."""
    shape = INT_KINDS[kind][1]
    cpu, dev = make(kind), make(kind).to(device)
    for seed in (4, 5):  # the second batch updates a running min / max or average
        x = inputs(shape, seed) * (1.0 + seed)
        out_c, out_d = cpu(x), dev(x.to(device))
    same_bits(out_d, out_c, f"{kind} forward after observing")
    if cpu.granularity != "per_token":  # per-token keeps no qparams between calls
        same_bits(dev.scale, cpu.scale, f"{kind} scale")
        same_bits(dev.zero_point, cpu.zero_point, f"{kind} zero_point")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "fp8_e4m3"])
def test_ties_round_half_to_even(dtype: str, device: torch.device, same_bits) -> None:
    """x / scale exactly halfway between two grid points (a power-of-two scale makes the
    halves exact): both round to even."""
    fq = FakeQuantize(dtype, symmetric=dtype != "uint8")
    fq.observe = False
    fq.set_qparams(torch.tensor([2.0 ** -4]), torch.tensor([0 if dtype != "uint8" else 128]))
    k = torch.arange(-300, 300, dtype=torch.float32)
    x = (k + 0.5) * 2.0 ** -4 if dtype != "fp8_e4m3" else (k / 8 + 1 / 16) * 2.0 ** -4
    same_bits(copy.deepcopy(fq).to(device)(x.to(device)), fq(x), f"{dtype} ties")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_inputs(dtype: torch.dtype, device: torch.device, same_bits) -> None:
    for kind in ("int8_per_channel_rows", "int4_per_group", "fp8_e4m3", "lsq_per_tensor"):
        cpu = make(kind)
        x = inputs(INT_KINDS[kind][1], 6)
        cpu(x)
        cpu.observe = False
        dev = copy.deepcopy(cpu).to(device)
        same_bits(dev(x.to(dtype).to(device)), cpu(x.to(dtype)), f"{kind} {dtype}")


# -- block-scaled formats ----------------------------------------------------------------
def block_inputs(fmt: str, block: int, seed: int) -> torch.Tensor:
    """Rows of blocks at very different magnitudes, and blocks that test the edges: all
    zeros, fp32 subnormals, dyadic values (many exact ties on the element grids), near the
    fp32 maximum, negative zeros; for MX and NF4 also a block with a NaN and one with an
    inf (NVFP4's tensor scale would make the whole tensor NaN: tested on its own)."""
    g = torch.Generator().manual_seed(seed)
    rows = 24
    x = torch.randn(rows, 8 * block, generator=g)
    x *= torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())
    blocks = x.view(-1, block)
    blocks[0] = 0.0
    blocks[1] = torch.randn(block, generator=g) * 1e-39  # fp32 subnormals
    blocks[2] = torch.randint(-48, 48, (block,), generator=g).float() / 8
    blocks[3] = torch.randint(-48, 48, (block,), generator=g).float() / 16 * 2.0 ** 100
    blocks[4] = torch.randn(block, generator=g) * 3e38
    blocks[5] = -0.0
    blocks[6, ::2] = -0.0
    if fmt != "nvfp4":
        blocks[7, 3] = float("nan")
        blocks[8, 5] = float("inf")
        blocks[9, 0] = float("-inf")
    return x


@pytest.mark.parametrize("fmt", BLOCK_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_formats_same_bits(fmt: str, dtype: torch.dtype, device: torch.device,
                                 same_bits) -> None:
    block = default_block(fmt)
    x = block_inputs(fmt, block, 7).to(dtype)
    want = fake_quant_eager(x, fmt, block)
    leaf = x.to(device).requires_grad_(True)
    got = fake_quantize_block(leaf, fmt, block)
    same_bits(got, want, f"{fmt} {dtype} forward")
    g = torch.randn(x.shape).to(dtype)
    got.backward(g.to(device))
    same_bits(leaf.grad, g, f"{fmt} {dtype} gradient (straight-through)")
    with torch.no_grad():  # the no-autograd path
        same_bits(fake_quantize_block(x.to(device), fmt, block), want, f"{fmt} no_grad")


def test_nf4_other_block_sizes(device: torch.device, same_bits) -> None:
    for block in (16, 128):
        x = block_inputs("nf4", block, 8)
        same_bits(fake_quantize_block(x.to(device), "nf4", block),
                  fake_quant_eager(x, "nf4", block), f"nf4 block {block}")


def test_nvfp4_tensor_scale_edges(device: torch.device, same_bits) -> None:
    """NVFP4's one tensor scale: a NaN anywhere is NaN everywhere, an all-zero tensor is
    zeros, and a tensor of tiny values keeps its block scales at E4M3's smallest."""
    cases = {"nan": torch.randn(4, 64), "zeros": torch.zeros(4, 64),
             "tiny": torch.randn(4, 64) * 1e-30, "one_large": torch.randn(4, 64)}
    cases["nan"][2, 7] = float("nan")
    cases["one_large"][0, 0] = 1e6
    for name, x in cases.items():
        same_bits(fake_quantize_block(x.to(device), "nvfp4", 16),
                  fake_quant_eager(x, "nvfp4", 16), f"nvfp4 {name}")


@pytest.mark.parametrize("fmt", [f for f in BLOCK_DTYPES if f not in GGML_FORMATS])
def test_block_codes_and_scales(fmt: str, device: torch.device, same_bits) -> None:
    """What ``qc.convert`` stores, computed on the device: the same codes and scales, and
    they decode to the fake-quant's values. (llama.cpp's grids are stored as GGUF bytes,
    made on the CPU: ``test_llm_cuda.py`` exports a graph on the device.)"""
    block = default_block(fmt)
    x = block_inputs(fmt, block, 9)
    want, got = quantize_blocks(x, fmt, block), quantize_blocks(x.to(device), fmt, block)
    same_bits(got.codes, want.codes, f"{fmt} codes")
    scales_d, scales_c = got.scales, want.scales
    if scales_c.dtype == torch.float8_e4m3fn:  # compare the bytes
        scales_d, scales_c = scales_d.view(torch.uint8), scales_c.view(torch.uint8)
    same_bits(scales_d, scales_c, f"{fmt} scales")
    if want.tensor_scale is not None:
        same_bits(got.tensor_scale, want.tensor_scale, f"{fmt} tensor scale")
    same_bits(dequantize_blocks(got), fake_quant_eager(x, fmt, block), f"{fmt} decoded")


@pytest.mark.parametrize("fmt", BLOCK_DTYPES)
def test_fake_quantize_module_with_block_dtypes(fmt: str, device: torch.device,
                                                same_bits) -> None:
    """``FakeQuantize`` built from a spec scheme with a block dtype, as a weight (blocks
    along rows) and as an activation (blocks along the last dim)."""
    scheme = Scheme(dtype=fmt)
    block = scheme.group_size
    for role, shape in (("weight", (32, 4 * block)), ("activation", (4, 6, 2 * block))):
        cpu = FakeQuantize.from_scheme(scheme, role=role, shape=shape)
        dev = copy.deepcopy(cpu).to(device)
        x, g = inputs(shape, 10), inputs(shape, 11)
        out_c, gx_c, _ = run(cpu, x, g, weight=role == "weight")
        out_d, gx_d, _ = run(dev, x.to(device), g.to(device), weight=role == "weight")
        same_bits(out_d, out_c, f"{fmt} {role} forward")
        same_bits(out_c, fake_quant_eager(x, fmt, block), f"{fmt} {role} CPU module")
        same_bits(gx_d, g, f"{fmt} {role} gradient (straight-through)")
        assert torch.equal(gx_c, g)
