"""llama.cpp's grids (GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; Q8_K activation blocks) as
fake-quant: what gguf-py (llama.cpp's own Python package) dequantizes the written bytes to
is the fake-quant, bit for bit; Q8_0 / Q4_0 / Q4_1 bytes are llama.cpp's reference
quantizer's; the K types' sub-block scales are checked against a reading of the bytes
written here, and Q8_K against llama.cpp's reference formula written out below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qcompile.errors import QCompileError
from qcompile.runtime.block_formats import (
    FORMATS,
    GGUF_WEIGHT_FORMATS,
    bits_per_element,
    fake_quant_eager,
    fake_quantize_block,
    ggml_bytes,
)
from qcompile.specs.quant import Scheme

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402


def _weights(block: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows across magnitudes, and the rows that pick a grid's edge cases: all zero, zero
    blocks among others, one sign only, the largest magnitude twice with both signs (the
    first one sets Q4_0's signed scale), fp16-subnormal scales, exact halves, and float32
    subnormals (they come back as zeros)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(12, 2 * block, generator=g) * torch.logspace(-3, 3, 12).unsqueeze(1)
    w[0] = 0
    w[1, : block // 2 + 3] = 0
    w[2] = -w[2].abs()
    w[3] = w[3].abs()
    w[4, 3], w[4, 5] = 7.0, -7.0
    w[5, 3], w[5, 5] = -7.0, 7.0
    w[6] *= 1e-6  # block scales below fp16's smallest normal
    w[7] = torch.randint(-16, 17, (2 * block,), generator=g).float() / 2  # ties
    w[8] = torch.randn(2 * block, generator=g) * 1e-40  # float32 subnormals: 1 / d overflows
    w[8, : block // 2] = 0
    return w.to(dtype)


def _dequantized(raw: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[fmt.upper()]).copy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", GGUF_WEIGHT_FORMATS)
def test_gguf_dequantizes_the_bytes_to_the_fake_quant_bit_for_bit(fmt: str,
                                                                  dtype: torch.dtype) -> None:
    block = FORMATS[fmt].block
    for seed in range(3):
        w = _weights(block, seed, dtype)
        raw = ggml_bytes(w, fmt)
        assert raw.dtype == np.uint8
        assert raw.shape == (w.shape[0], w.shape[1] * bits_per_element(fmt) / 8)
        back = _dequantized(raw, fmt)
        want = fake_quant_eager(w.float(), fmt, block)
        assert torch.equal(back.view(torch.int32), want.view(torch.int32)), fmt
        # a bf16 tensor's fake-quant is the float32 one rounded to bf16
        assert torch.equal(fake_quant_eager(w, fmt, block), want.to(dtype))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_bytes_are_llama_cpps_own_quantizers(fmt: str) -> None:
    """gguf-py's quantize is llama.cpp's ``quantize_row_q*_ref`` in numpy: the same codes
    and scales, byte for byte, so an RTN model exports as llama-quantize would write it."""
    for seed in range(3):
        w = _weights(32, seed)
        w = torch.cat([w[:8], w[9:]])  # (subnormals: llama.cpp's 1 / d overflows, below)
        ref = quants.quantize(w.numpy(), GGMLQuantizationType[fmt.upper()])
        assert np.array_equal(ref.reshape(w.shape[0], -1), ggml_bytes(w, fmt))


@pytest.mark.parametrize("fmt", GGUF_WEIGHT_FORMATS)
def test_float32_subnormal_blocks_store_zeros(fmt: str) -> None:
    """A block of float32 subnormals has an fp16 scale of 0, so it dequantizes to zeros
    whatever its codes; llama.cpp's ``1 / d`` overflows there (its codes come from inf and
    NaN), qcompile's codes are those of a zero block."""
    block = FORMATS[fmt].block
    w = torch.randn(2, block) * 1e-40
    w[1, : block // 2] = 0
    assert torch.equal(_dequantized(ggml_bytes(w, fmt), fmt), torch.zeros_like(w))
    assert torch.equal(fake_quant_eager(w, fmt, block).abs(), torch.zeros_like(w))


def _q4_k_fields(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d, dmin as float32, 6-bit scales [n, 8]) of Q4_K super-blocks, read as ggml's
    ``get_scale_min_k4`` reads them."""
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    q = b[:, 4:16].astype(np.int32)
    sc = np.empty((b.shape[0], 8), np.int32)
    for j in range(8):
        sc[:, j] = q[:, j] & 63 if j < 4 else (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4)
    return d, dmin, sc


def test_q4_k_sub_block_scales_follow_each_sub_blocks_range() -> None:
    """Each 32-element sub-block's step is its own (max - min) / 15 on the 6-bit grid of
    the super-block's largest: an element is within half a step (plus the scale's
    rounding) of its value, so sub-blocks of different ranges keep their precision."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 256, generator=g) * torch.linspace(0.1, 4.0, 8).repeat_interleave(32)
    raw = ggml_bytes(w, "q4_k")
    d, _, sc = _q4_k_fields(raw)
    step = torch.from_numpy(d[:, None] * sc).float()  # [4, 8]
    x = w.reshape(4, 8, 32)
    span = (x.amax(-1) - x.amin(-1).clamp(max=0)) / 15
    assert torch.all((step - span).abs() <= span.amax(-1, keepdim=True) / 63 + 1e-6)
    err = (fake_quant_eager(w, "q4_k", 256) - w).reshape(4, 8, 32).abs().amax(-1)
    assert torch.all(err <= 0.5 * step * 1.02 + 1e-6 + span.amax(-1, keepdim=True) / 63 * 8)


def test_q6_k_largest_magnitude_keeps_its_value() -> None:
    """Q6_K maps each 16-element sub-block's largest magnitude to code -32 under the
    super-block's int8 scales: the largest element of the whole super-block comes back to
    fp16 precision."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 256, generator=g)
    y = fake_quant_eager(w, "q6_k", 256)
    i = w.abs().argmax(dim=1, keepdim=True)
    assert torch.allclose(y.gather(1, i), w.gather(1, i), rtol=2e-3, atol=0)
    assert ((y - w).norm() / w.norm()) < 0.03


def _q8_k_reference(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``quantize_row_q8_K_ref`` and ``dequantize_row_q8_K``, one 256-element
    block per row (float32, numpy)."""
    out = np.zeros_like(x)
    with np.errstate(over="ignore"):
        for r, row in enumerate(x):
            lead = row[np.argmax(np.abs(row))]
            iscale = np.float32(-127.0) / lead if lead != 0 else np.float32(0)
            if not np.isfinite(iscale) or iscale == 0:
                continue  # (a subnormal lead: the division overflows; zeros, as above)
            # nearest_int rounds half to even; the code is an int8
            q = np.minimum(127, np.rint(iscale * row)).astype(np.int8).astype(np.float32)
            out[r] = np.float32(1.0) / iscale * q
    return out


def test_q8_k_is_llama_cpps_activation_block() -> None:
    w = _weights(256, 5)
    want = _q8_k_reference(w.reshape(-1, 256).numpy()).reshape(w.shape)
    got = fake_quant_eager(w, "q8_k", 256)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))


def test_q8_k_has_no_gguf_weight_bytes() -> None:
    with pytest.raises(ValueError, match="q8_k is not a GGUF weight type"):
        ggml_bytes(torch.randn(2, 256), "q8_k")


def test_nan_weights_are_refused_not_written() -> None:
    w = torch.randn(2, 64)
    w[1, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        ggml_bytes(w, "q4_0")
    y = fake_quant_eager(w, "q4_0", 32)
    assert torch.isnan(y[1, :32]).all() and torch.isfinite(y[0]).all() and \
        torch.isfinite(y[1, 32:]).all()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "q8_k"])
def test_straight_through_gradient_and_module_path(fmt: str) -> None:
    block = FORMATS[fmt].block
    x = torch.randn(3, 2 * block, requires_grad=True)
    y = fake_quantize_block(x, fmt, block)
    y.backward(torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape))
    assert torch.equal(y, fake_quant_eager(x.detach(), fmt, block))
    assert torch.equal(x.grad, torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape))


def test_scheme_fixes_the_block_and_explains() -> None:
    assert Scheme(dtype="q4_0").group_size == 32
    assert Scheme(dtype="q4_k").group_size == 256
    assert Scheme(dtype="q4_0").granularity == "per_group"
    with pytest.raises(ValueError, match="q4_0 blocks are 32 elements"):
        Scheme(dtype="q4_0", group_size=64)
    with pytest.raises(ValueError, match="q4_1 stores its own minimum per block"):
        Scheme(dtype="q4_1", symmetric=False)


def test_convert_refuses_llama_cpp_grids_with_the_way_out() -> None:
    import qcompile as qc

    m = torch.nn.Sequential(torch.nn.Linear(64, 32))
    x = torch.randn(2, 64)
    gm = qc.qcompile(m, "gguf-q4_0-qat", (x,))
    gm(x)
    with pytest.raises(QCompileError, match=r"llama\.cpp's q8_0 grid") as e:
        qc.convert(gm)
    assert "qc.export_gguf" in (e.value.fix or "")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gptq_result_is_on_the_grid_and_beats_rounding(fmt: str) -> None:
    """GPTQ keeps each block's grid (its ends pinned), so the forward finds the rounded
    weight again, with less output error than round-to-nearest."""
    from qcompile.graph.layerwise import output_error
    from qcompile.passes.round_gptq import gptq_blocks

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)
    w = torch.randn(16, 64, generator=g)
    for act_order in (False, True):
        q, _ = gptq_blocks(w, x.T @ x, fmt, 32, act_order=act_order)
        assert torch.equal(fake_quant_eager(q, fmt, 32), q)
        rtn = fake_quant_eager(w, fmt, 32)
        assert output_error(q - w, x.T @ x, 512) < 0.8 * output_error(rtn - w, x.T @ x, 512)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_gptq_keeps_every_sub_block_range_of_a_super_block(fmt: str) -> None:
    """GPTQ on the K types: each super-block's grid from its columns as GPTQ reaches them,
    every sub-block's ends kept, so the forward finds the same fp16 super-block scales and
    sub-block codes again (the rounded weight is its own fake-quant, bit for bit), with
    far less output error than round-to-nearest. Rows span the cases the ends decide: mixed
    signs, no negative element (Q4_K's minimum is then 0), all negative, constant sub-blocks,
    an all-zero row, and sub-blocks of graded ranges, whose small scale codes make
    round-to-nearest itself drift when applied twice (an end rounds a step inside)."""
    from qcompile.graph.layerwise import output_error
    from qcompile.passes.round_gptq import gptq_blocks

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 512, generator=g) @ torch.randn(512, 512, generator=g) / 20
    x = x + 2 * torch.randn(512, generator=g)
    w = 0.05 * torch.randn(16, 512, generator=g)
    w[1] = w[1].abs()
    w[2] = -w[2].abs()
    w[3, :32] = 0.02
    w[3, 256:288] = -0.03
    w[4] = 0.0
    w[5, 40] = 1.5  # an outlier sets its super-block's fp16 scale
    w[6:] *= torch.linspace(0.05, 1.0, 16).repeat_interleave(16).repeat(2)
    h = x.T @ x
    rtn = fake_quant_eager(w, fmt, 256)
    assert not torch.equal(fake_quant_eager(rtn, fmt, 256), rtn)
    for act_order in (False, True):
        q, _ = gptq_blocks(w, h, fmt, 256, block_size=64, act_order=act_order)
        assert torch.equal(fake_quant_eager(q, fmt, 256), q)
        assert torch.equal(q[4], w[4])
        assert output_error(q - w, h, 1024) < 0.5 * output_error(rtn - w, h, 1024)


def test_q4_k_preset_trains_a_256_wide_model_and_names_the_width_it_needs() -> None:
    import qcompile as qc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(),
                                torch.nn.Linear(512, 256))
    x = torch.randn(4, 256)
    gm = qc.qcompile(model, "gguf-q4_k-qat", (x,))
    gm(x).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in gm.parameters())
    w = gm.get_parameter("0.weight").detach()
    fq = gm.get_submodule("0.weight_fake_quant")
    assert torch.equal(fq(w), fake_quant_eager(w, "q4_k", 256))
    narrow = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(QCompileError, match="blocks of 256 do not divide 64"):
        qc.qcompile(narrow, "gguf-q4_k-qat", (torch.randn(2, 64),))
