"""``FrozenWeight``: a frozen base gives exactly its fake-quantizer's values (table kernel
and torch formula alike), a rank's rows encode as the whole weight's rows, casts keep the
stored bits, and autograd keeps the integers, not the float weight."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qcompile.errors import QCompileError
from qcompile.runtime import kernels
from qcompile.runtime.block_formats import nvfp4_tensor_scale
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.frozen import FrozenWeight, frozen_layout
from qcompile.specs import Scheme

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMES = [
    {"dtype": "int8", "granularity": "per_channel"},
    {"dtype": "int8", "symmetric": False},
    {"dtype": "uint8", "granularity": "per_channel", "symmetric": False},
    {"dtype": "int4", "granularity": "per_group", "group_size": 16},
    {"dtype": "int4", "granularity": "per_group", "group_size": 16, "symmetric": False},
    {"dtype": "int4", "granularity": "per_channel"},
    {"dtype": "int2", "granularity": "per_group", "group_size": 8},
    {"dtype": "int12", "granularity": "per_channel"},
    {"dtype": "nf4"},
    {"dtype": "nf4", "group_size": 32},
    {"dtype": "nvfp4"},
    {"dtype": "mxfp4"},
    {"dtype": "mxfp6_e3m2"},
    {"dtype": "mxfp6_e2m3"},
    {"dtype": "mxfp8_e4m3"},
    {"dtype": "mxfp8_e5m2"},
]


def quantizer(scheme: dict, w: torch.Tensor) -> FakeQuantize:
    fq = FakeQuantize.from_scheme(Scheme(**scheme), role="weight", shape=tuple(w.shape))
    fq.observe_tensor(w)
    return fq


def weight(rows: int = 24, cols: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 3, rows).unsqueeze(1)
    w[0, :64] = 0.0  # all-zero blocks and groups
    w[1, 3] = -0.0
    return w


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: "-".join(map(str, s.values())))
def test_frozen_values_are_the_fake_quantizers(scheme):
    w = weight()
    fq = quantizer(scheme, w)
    fw = FrozenWeight.from_quantizer(fq, w)
    expected = fq(w).detach()
    assert torch.equal(fw.dequantize_eager(), expected)
    assert torch.equal(fw(), expected)  # the table kernel where it applies
    assert not any(p.requires_grad for p in fw.parameters())


@pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[3], SCHEMES[8], SCHEMES[10],
                                    SCHEMES[11], SCHEMES[14]],
                         ids=["int8", "int4g16", "nf4", "nvfp4", "mxfp4", "mxfp8"])
def test_the_table_kernel_serves_the_common_formats(scheme):
    w = weight(seed=1)
    fw = FrozenWeight.from_quantizer(quantizer(scheme, w), w)
    fast = fw._table_lookup()
    assert fast is not None and torch.equal(fast, fw.dequantize_eager())


def test_storage_size_is_the_formats():
    w = weight(64, 256)
    bits = {}
    for s in (SCHEMES[0], SCHEMES[3], SCHEMES[8], SCHEMES[10], SCHEMES[11], SCHEMES[14]):
        fw = FrozenWeight.from_quantizer(quantizer(s, w), w)
        bits[s["dtype"] + str(s.get("group_size", ""))] = 8 * fw.nbytes() / w.numel()
    # int8 + one float32 scale per row; int4 + a float32 scale per 16 (symmetric: no zero
    # point stored); blocks
    assert bits["int8"] == pytest.approx(8 + 32 / 256)
    assert bits["int416"] == pytest.approx(4 + 32 / 16)
    assert bits["nf4"] == pytest.approx(4.5)
    assert bits["nvfp4"] == pytest.approx(4.5 + 32 / w.numel())
    assert bits["mxfp4"] == pytest.approx(4.25)
    assert bits["mxfp8_e4m3"] == pytest.approx(8.25)


@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[4], SCHEMES[8], SCHEMES[10]],
                         ids=["int8", "int4-asym", "nf4", "nvfp4"])
def test_rows_encoded_apart_are_the_whole_weights_rows(scheme):
    w = weight(seed=2)
    fq = quantizer(scheme, w)
    whole, _ = FrozenWeight.encode(fq, w)
    ts = nvfp4_tensor_scale(w) if scheme["dtype"] == "nvfp4" else None
    parts = []
    for rows in (slice(0, 10), slice(10, 24)):
        part_fq = quantizer(scheme, w[rows])
        parts.append(FrozenWeight.encode(part_fq, w[rows], tensor_scale=ts)[0])
    for name, value in whole.items():
        if value.shape[0] == w.shape[0]:
            assert torch.equal(torch.cat([p[name] for p in parts]), value), name
        else:
            assert torch.equal(parts[0][name], value), name


def test_a_cast_changes_the_output_dtype_never_the_stored_values():
    w = weight()
    fw = FrozenWeight.from_quantizer(quantizer(SCHEMES[3], w), w)
    stored = {n: p.clone() for n, p in fw.named_parameters()}
    fw = fw.to(torch.bfloat16)
    assert all(torch.equal(p, stored[n]) and p.dtype == stored[n].dtype
               for n, p in fw.named_parameters())
    out = fw()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fw.dequantize_eager())
    back = FrozenWeight.from_quantizer(quantizer(SCHEMES[3], w), w)
    back.load_state_dict(fw.state_dict())
    assert torch.equal(back().to(torch.bfloat16), fw())  # the same values, rounded


def test_empty_storage_has_the_shapes_and_dtypes_of_real_storage():
    w = weight()
    for s in SCHEMES:
        fq = quantizer(s, w)
        real = FrozenWeight.from_quantizer(fq, w)
        meta = FrozenWeight.empty(fq, tuple(w.shape))
        assert {n: (p.shape, p.dtype) for n, p in real.named_parameters()} == {
            n: (p.shape, p.dtype) for n, p in meta.named_parameters()}, s


def test_autograd_keeps_the_integers_not_the_float_weight():
    import qcompile as qc

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256))
    spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
                                                "weight": {"dtype": "nf4"}}]},
            "adapters": [{"match": {"module": "Linear"}, "rank": 2}]}
    x = torch.randn(4, 256)
    gm = qc.qcompile(model, spec, example_inputs=(x,))
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    # ours pass every tensor that is not a weight on to the hooks they find
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gm(x).square().sum()
    assert (256, 256) not in saved, saved
    loss.backward()
    grads = {n for n, p in gm.named_parameters() if p.grad is not None}
    assert grads == {"0.lora_A.weight", "0.lora_B.weight", "2.lora_A.weight",
                     "2.lora_B.weight"}
    # the same gradients as a float layer holding the dequantized weights
    ref = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 256))
    with torch.no_grad():
        for i in (0, 2):
            ref[i].weight.copy_(gm.get_submodule(f"{i}.weight_frozen")())
            ref[i].bias.copy_(gm.get_submodule(str(i)).bias)
    xr = x.clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    ref(xr).square().sum().backward()
    gm(xg).square().sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-5)


@given(rows=st.integers(1, 9), groups=st.integers(1, 4),
       scheme=st.sampled_from(SCHEMES), seed=st.integers(0, 2**16))
def test_property_frozen_equals_fake_quant(rows, groups, scheme, seed):
    block = scheme.get("group_size") or {"nvfp4": 16, "nf4": 64}.get(scheme["dtype"], 32)
    w = weight(rows, block * groups, seed) if rows > 1 else torch.randn(1, block * groups)
    fq = quantizer(scheme, w)
    fw = FrozenWeight.from_quantizer(fq, w)
    assert torch.equal(fw(), fq(w).detach())


@pytest.mark.parametrize("scheme", [SCHEMES[8], SCHEMES[10], SCHEMES[12]],
                         ids=["nf4", "nvfp4", "mxfp6"])
def test_block_formats_encode_large_weights_in_row_chunks_with_the_same_bits(
        scheme, monkeypatch):
    from qcompile.runtime import frozen

    w = weight(seed=4)
    fq = quantizer(scheme, w)
    whole = FrozenWeight.from_quantizer(fq, w)
    monkeypatch.setattr(frozen, "_ENCODE_ELEMENTS", 300)  # a few rows at a time
    chunked = FrozenWeight.from_quantizer(fq, w)
    assert all(torch.equal(p, dict(whole.named_parameters())[n])
               for n, p in chunked.named_parameters())
    assert torch.equal(chunked(), fq(w).detach())


@pytest.mark.parametrize("scheme", [{"dtype": "int8", "granularity": "per_channel"},
                                    {"dtype": "uint4", "granularity": "per_channel",
                                     "symmetric": False},
                                    {"dtype": "int8"}], ids=["int8", "uint4-asym", "tensor"])
def test_a_weight_stored_in_out_is_held_by_its_output_rows(scheme):
    """GPT-2's Conv1D: the quantizer reads the ``[in, out]`` weight as stored (per channel
    along axis 1, or per tensor); the storage holds its transpose, with the same values."""
    w = weight(rows=24, cols=128).t().contiguous()  # [in=128, out=24]
    fq = FakeQuantize.from_scheme(Scheme(**scheme), role="weight", shape=tuple(w.shape),
                                  channel_axis=1)
    fq.observe_tensor(w)
    assert frozen_layout(fq, (24, 128), transposed=True) is None
    if scheme.get("granularity") == "per_channel":
        assert "axis 1" in frozen_layout(fq, (24, 128))  # as rows, its scales run across
    fw = FrozenWeight.from_quantizer(fq, w.t(), transposed=True)
    assert (fw.rows, fw.cols) == (24, 128)
    assert torch.equal(fw.dequantize_eager(), fq(w).detach().t())
    assert torch.equal(fw.dequantize(), fq(w).detach().t())


def test_groups_across_the_outputs_are_refused():
    w = weight(rows=32, cols=64)  # read as stored [in, out], groups would run along outputs
    fq = quantizer({"dtype": "int4", "granularity": "per_group", "group_size": 16}, w)
    assert "output dimension" in frozen_layout(fq, (64, 32), transposed=True)
    with pytest.raises(QCompileError, match="output dimension"):
        FrozenWeight.from_quantizer(fq, w.t(), transposed=True)



# -- odd block lengths and bfloat16 against references written outside qcompile --------------
# (MX and NVFP4 blocks are fixed by their formats: NF4 and integer groups take any size)
@pytest.mark.parametrize(("scheme", "cols"), [
    ({"dtype": "nf4", "group_size": 24}, 120), ({"dtype": "nf4", "group_size": 40}, 120),
    ({"dtype": "int4", "granularity": "per_group", "group_size": 24}, 72),
    ({"dtype": "int8", "granularity": "per_channel"}, 17),
], ids=["nf4-24", "nf4-40", "int4-g24", "int8-17"])
def test_odd_groups_match_the_independent_reference(scheme: dict, cols: int) -> None:
    import block_reference as R

    w = weight(rows=6, cols=cols, seed=3)
    w[2, -1] = 50 * float(w[2].abs().max())  # a row's absmax in its last element
    fw = FrozenWeight.from_quantizer(quantizer(scheme, w), w)
    if scheme["dtype"] in ("int4", "int8"):
        g = scheme.get("group_size", cols)
        qmax = 7 if scheme["dtype"] == "int4" else 127
        blocks = w.reshape(w.shape[0], -1, g)
        s = (blocks.abs().amax(-1, keepdim=True) / qmax).clamp_min(torch.finfo().eps)
        want = (torch.round(blocks / s).clamp(-qmax - 1, qmax) * s).reshape(w.shape)
    else:
        want = torch.from_numpy(R.reference(w.numpy(), scheme["dtype"], scheme["group_size"]))
    got = fw()
    assert torch.equal(got, want), int((got != want).sum())
    assert torch.equal(fw.to(torch.bfloat16)(), want.to(torch.bfloat16))


@pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
@pytest.mark.parametrize("block", [1, 6, 17, 24, 40])
def test_table_kernels_on_odd_blocks(block: int) -> None:
    """``dequant_lut8`` / ``dequant_lut4``: ``lut[code] * scale[block]`` for every element
    (the packed one takes even blocks only)."""
    ops = kernels.load()
    g = torch.Generator().manual_seed(block)
    rows, cols = 3, block * 5
    lut8, lut4 = torch.randn(256, generator=g), torch.randn(16, generator=g)
    scale = torch.rand(rows, cols // block, generator=g) + 0.5
    codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    per = scale.repeat_interleave(block, dim=1)
    assert torch.equal(ops.dequant_lut8(codes, lut8, scale, block), lut8[codes.long()] * per)
    if block % 2 == 0:
        nib = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
        packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
        assert torch.equal(ops.dequant_lut4(packed, lut4, scale, block), lut4[nib.long()] * per)
