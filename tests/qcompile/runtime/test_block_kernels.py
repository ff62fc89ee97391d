"""The block-scaled fake-quant kernel (``torch.ops.qcompile.block_fake_quant``) against the
eager reference ``qcompile.runtime.block_formats.fake_quant_eager``: the same bits for every
format, float32 and bfloat16, on random values and on the values where formulas part ways
(ties on the element grid, saturation, zeros, all-zero blocks, float32 subnormals, huge
values, NaN and inf), for each instruction-set variant of the kernel.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from qcompile.runtime import kernels
from qcompile.runtime.block_formats import (
    BLOCK_DTYPES,
    FORMATS,
    NF4_LEVELS,
    fake_quant_eager,
    fake_quantize_block,
)

OPS = kernels.load()
pytestmark = [
    pytest.mark.skipif(OPS is None or not hasattr(OPS, "block_fake_quant"),
                       reason="no C++ kernels (QCOMPILE_NO_EXT=1 or no compiler)"),
    pytest.mark.usefixtures("one_thread"),
]

# the variants QCOMPILE_FQ_ISA picks ("" the best; one the CPU lacks falls back)
ISAS = ("", "avx512", "avx2", "base")


def _assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal shape and dtype, NaN at the same places, the same bits elsewhere."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), int((torch.isnan(out) != nan).sum())
    view = torch.int16 if ref.dtype == torch.bfloat16 else torch.int32
    a, b = out[~nan].view(view), ref[~nan].view(view)
    assert torch.equal(a, b), (out[~nan][a != b][:8], ref[~nan][a != b][:8])


def _grid_ties(f, n: int, gen: torch.Generator) -> torch.Tensor:
    """n values of f's element grid (up to just past its max): grid points, the midpoints
    between neighbours (exact ties), and values beyond max."""
    e = torch.randint(f.emin, f.emax + 1, (n,), generator=gen)
    m = torch.randint(0, 2 ** f.mbits, (n,), generator=gen).float()
    normal = e > f.emin
    sig = torch.where(normal, m + 2 ** f.mbits, m * 2 + 1)  # subnormals: 0.m, as odd halves
    half = torch.randint(0, 3, (n,), generator=gen).float() * 0.5  # on, half past, a step past
    step = 2.0 ** (e - f.mbits).float()
    v = torch.where(normal, (sig + half) * step, (sig * 0.5 + half) * step)
    v = torch.where(torch.rand(n, generator=gen) < 0.1, f.max + (v % 1.0) * f.max, v)
    return torch.where(torch.rand(n, generator=gen) < 0.5, -v, v)


def _values(fmt: str, rows: int, block: int, seed: str) -> torch.Tensor:
    """[rows, block] float32: random blocks at magnitudes from 2^-140 to 2^120, blocks of
    grid ties at a known scale, and blocks with zeros, subnormals, huge values, NaN, inf."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    f = FORMATS[fmt]
    x = torch.randn(rows, block, generator=gen)
    mag = torch.randint(-130, 121, (rows, 1), generator=gen).float()
    x = x * torch.exp2(mag)
    for r in range(0, rows, 3):  # ties and saturation at a scale 2^k set by the block's max
        k = int(torch.randint(-20, 20, (), generator=gen))
        if f.kind == "mx":
            t = _grid_ties(f, block, gen)
            t[0] = float(2 ** f.emax)  # amax in [2^emax, 2^(emax+1)): e = k
            x[r] = t.clamp(-(2 ** (f.emax + 1)) * 0.99, 2 ** (f.emax + 1) * 0.99) * 2.0 ** k
        elif f.kind == "nvfp4":  # pts = 1 (a block holds 2688), block scale s8 = 2^k
            k = max(min(k, 6), -6)
            x[r] = _grid_ties(FORMATS["mxfp4"], block, gen).clamp(-6, 6) * 2.0 ** k
            x[r, 0] = 6.0 * 2.0 ** k
            x[0, 1] = 2688.0
        elif f.kind == "ggml":  # Q8_0 / Q4_0 / Q4_1 at d = 2^k: x / d on and between grid ties
            m = torch.randint(-120, 121, (block,), generator=gen).float()
            half = torch.rand(block, generator=gen) < 0.5
            if fmt == "q8_0":  # amax 127 d: x / d = m + 1/2, C's roundf goes away from 0
                x[r] = torch.where(half, m + 0.5, m).clamp(-126.5, 126.5)
                x[r, 0] = 127.0
            elif fmt == "q4_0":  # lead -8 d: x / d + 8.5 an integer (trunc exact) or a half
                x[r] = torch.where(half, m / 16 - 0.5, m / 16).clamp(-7.5, 7.5)
                x[r, 0] = -8.0
            else:  # q4_1: min 0, max 15 d: (x - min) / d + 0.5 an integer or a half
                x[r] = torch.where(half, m.abs() / 8 + 0.5, m.abs() / 8).clamp(0.0, 15.0)
                x[r, 0], x[r, 1] = 0.0, 15.0
            x[r] = x[r] * 2.0 ** k
        else:  # level midpoints (as float32) times a power of two absmax
            lv = torch.tensor(NF4_LEVELS)
            mids = (lv[:-1] + lv[1:]) / 2
            idx = torch.randint(0, 15, (block,), generator=gen)
            x[r] = torch.where(torch.rand(block, generator=gen) < 0.5, mids[idx], lv[idx])
            x[r, 0] = -1.0
            x[r] = x[r] * 2.0 ** k
    if rows > 4:
        x[1] = 0.0                                         # an all-zero block
        x[2, ::2] = 0.0
        x[2, 1::2] = torch.randn(block // 2, generator=gen) * 1e-39  # subnormals (e = -127)
        x[4, 0] = 3.0e38                                   # huge
    return x


def _special(x: torch.Tensor) -> torch.Tensor:
    """x with NaN in one block and +-inf in others (NVFP4: the whole tensor is NaN then)."""
    x = x.clone()
    x[-1, 1] = float("nan")
    x[-2, 0] = float("inf")
    x[-3, -1] = float("-inf")
    return x


CASES = [(fmt, FORMATS[fmt].block) for fmt in BLOCK_DTYPES] + [
    ("nf4", 16), ("nf4", 32), ("nf4", 128),
    # blocks that are not a multiple of 8 take the scalar code in every variant
    ("mxfp8_e4m3", 12), ("nvfp4", 12), ("nf4", 6),
]


@pytest.mark.parametrize("isa", ISAS, ids=lambda s: s or "best")
@pytest.mark.parametrize(("fmt", "block"), CASES, ids=[f"{f}-{b}" for f, b in CASES])
def test_matches_eager_bit_for_bit(fmt: str, block: int, isa: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    x = _values(fmt, 12, block, f"{fmt}-{block}")
    for case in (x, _special(x), x.reshape(3, -1, block)[:, :2]):
        for dtype in (torch.float32, torch.bfloat16):
            xd = case.to(dtype)
            _assert_same_bits(OPS.block_fake_quant(xd, fmt, block),
                              fake_quant_eager(xd, fmt, block))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "nf4"])
def test_edge_tensors(fmt: str) -> None:
    """Whole tensors that are zero, tiny (NVFP4's tensor scale 0, subnormal with an infinite
    inverse, or just normal), NaN or inf, a non-contiguous and a float16 input, an empty
    one, and several threads."""
    block = FORMATS[fmt].block
    tiny = [torch.randn(2, block) * scale for scale in (2e-45, 1e-42, 1e-35, 1e-33)]
    for x in (torch.zeros(2, block), -torch.zeros(2, block), *tiny,
              torch.full((2, block), float("nan")), torch.full((1, block), float("inf")),
              torch.randn(block, 6).t(), torch.randn(3, block).half()):
        _assert_same_bits(OPS.block_fake_quant(x, fmt, block), fake_quant_eager(x, fmt, block))
    assert OPS.block_fake_quant(torch.empty(0, block), fmt, block).shape == (0, block)
    x = torch.randn(96, 4096) * torch.rand(96, 1) * 10  # several parallel tasks
    torch.set_num_threads(2)
    _assert_same_bits(OPS.block_fake_quant(x, fmt, block), fake_quant_eager(x, fmt, block))


def test_wrong_inputs_are_refused() -> None:
    with pytest.raises(RuntimeError, match="unknown format 'mxfp3'"):
        OPS.block_fake_quant(torch.randn(32), "mxfp3", 32)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        OPS.block_fake_quant(torch.randn(3, 20), "mxfp4", 32)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        OPS.block_fake_quant(torch.ones(32, dtype=torch.int32), "nf4", 32)
    with pytest.raises(RuntimeError, match="block must be positive"):
        OPS.block_fake_quant(torch.randn(32), "nf4", 0)


def test_operator_registration_and_straight_through_gradient() -> None:
    """One C++ node that hands the gradient on; shapes under fake tensors (torch.library's
    checks) and a graph torch.compile traces with the operator in it."""
    x = torch.randn(4, 64, requires_grad=True)
    y = OPS.block_fake_quant(x, "nvfp4", 16)
    assert type(y.grad_fn).__name__ == "CppFunction"
    g = torch.randn(4, 64)
    y.backward(g)
    assert torch.equal(x.grad, g)
    xb = x.detach().bfloat16().requires_grad_(True)
    fake_quantize_block(xb, "mxfp8_e4m3", 32).sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and bool((xb.grad == 1).all())
    result = torch.library.opcheck(OPS.block_fake_quant.default, (x, "mxfp4", 32))
    assert all(v == "SUCCESS" for v in result.values()), result

    def fn(t: torch.Tensor) -> torch.Tensor:
        return OPS.block_fake_quant(t * 2, "nf4", 64) + 1

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    xa = x.detach().clone().requires_grad_(True)
    ya = compiled(xa)
    assert torch.equal(ya, fn(x.detach()))
    ya.backward(g)
    assert torch.equal(xa.grad, 2 * g)


@pytest.mark.filterwarnings("ignore:.*script_method.*:DeprecationWarning")  # torch's inductor
def test_torch_compile_of_the_eager_formula_gives_the_same_bits() -> None:
    """What ``fake_quantize_block`` runs under torch.compile: Inductor's fused kernel of the
    eager formula gives the kernel's bits (float32, one format per kind, two of
    llama.cpp's)."""
    xs = {fmt: _values(fmt, 6, FORMATS[fmt].block, f"inductor-{fmt}")
          for fmt in ("mxfp6_e3m2", "nvfp4", "nf4", "q4_1", "q4_k")}

    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
           e: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # (llama.cpp's grids round their scales to fp16 from the float bits: Inductor
        # drops a float32 -> float16 -> float32 round trip)
        return (fake_quant_eager(a, "mxfp6_e3m2", 32), fake_quant_eager(b, "nvfp4", 16),
                fake_quant_eager(c, "nf4", 64), fake_quant_eager(d, "q4_1", 32),
                fake_quant_eager(e, "q4_k", 256))

    compiled = torch.compile(fn, dynamic=False)
    for out, (fmt, x) in zip(compiled(*xs.values()), xs.items()):
        _assert_same_bits(out, OPS.block_fake_quant(x, fmt, FORMATS[fmt].block))


# -- odd block lengths against the independent numpy reference ---------------------------------
# Blocks of 24 and 40 elements (16 + 8, 32 + 8: the vector loop and then its 8-element tail,
# where bfloat16's absmax reads 16 at a time) and of 17 (no vector code at all), tensors
# whose total length leaves a tail for NVFP4's tensor-wide absmax. The block's largest
# element is put in its last 8 (or last 1) positions in half of the rows: a kernel that
# skips the tail then picks another scale. Graded by tests/helpers/block_reference.py, which
# shares no code with qcompile.
ODD_CASES = [(fmt, block) for fmt in ("mxfp4", "mxfp8_e4m3", "mxfp6_e2m3", "nvfp4", "nf4")
             for block in (24, 40, 17)]


def _odd_values(block: int, rows: int, seed: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    x = torch.randn(rows, block, generator=gen) * torch.exp2(
        torch.randint(-6, 7, (rows, 1), generator=gen).float())
    tail = min(8, block)
    for r in range(0, rows, 2):  # the absmax in the tail: 4x anything else in the block
        at = block - 1 - int(torch.randint(0, tail, (), generator=gen))
        x[r, at] = 4 * float(x[r].abs().max()) * (-1 if r % 4 else 1)
    x[1] = 0.0  # an all-zero block
    return x


@pytest.mark.parametrize("isa", ISAS, ids=lambda s: s or "best")
@pytest.mark.parametrize(("fmt", "block"), ODD_CASES, ids=[f"{f}-{b}" for f, b in ODD_CASES])
def test_odd_blocks_match_the_independent_reference(fmt: str, block: int, isa: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import block_reference as R

    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    for rows in (6, 5):  # 5 rows of 24 / 40: a total that is not a multiple of 16 either
        x = _odd_values(block, rows, f"odd-{fmt}-{block}-{rows}")
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            want = torch.from_numpy(R.reference(xd.float().numpy(), fmt, block)).to(dtype)
            got = OPS.block_fake_quant(xd, fmt, block)
            wrong = int((got.float() != want.float()).sum())
            assert wrong == 0, (f"{fmt}, block {block}, {dtype}, isa {isa or 'best'}: "
                                f"{wrong} of {x.numel()} values differ from the reference")
            _assert_same_bits(got, want)


def _k_quant_blocks(fmt: str, seed: int) -> torch.Tensor:
    """[8, 256] super-blocks whose sub-blocks part the ways a kernel can go wrong: a lead
    of either sign tied with its opposite (the first one is the lead), all-zero and
    single-value sub-blocks next to large ones, sub-blocks so small next to the largest
    that their scale code is 0 (1 / scale infinite: 0), ranges whose scale code is a tie
    (x.5), all-negative and all-positive sub-blocks."""
    gen = torch.Generator().manual_seed(seed)
    sub = 32 if fmt == "q4_k" else 16
    x = torch.randn(8, 256, generator=gen) * torch.exp2(torch.randint(-8, 8, (8, 256 // sub),
                                                                    generator=gen)
                                                       ).repeat_interleave(sub, 1)
    for r in range(8):
        s = int(torch.randint(0, 256 // sub, (), generator=gen)) * sub
        a = float(x[r].abs().max()) * 2
        x[r, s + 3], x[r, s + 9] = (a, -a) if r % 2 else (-a, a)  # tied lead, either sign
        x[r, (s + sub) % 256:(s + sub) % 256 + sub] = 0.0  # an all-zero sub-block
        t = (s + 2 * sub) % 256
        x[r, t:t + sub] = 0.0
        x[r, t + 5] = -1e-3 * a  # one value, scale code 0 next to the lead
        u = (s + 3 * sub) % 256
        x[r, u:u + sub] = x[r, u:u + sub].abs() * (1 if r % 3 else -1)  # one sign throughout
        v = (s + 4 * sub) % 256  # a range of 10.5 / 63 of the largest: code 10.5 (a tie)
        x[r, v:v + sub] = torch.linspace(0, 10.5 / 63 * a, sub)
    return x


@pytest.mark.parametrize("isa", ISAS, ids=lambda s: s or "best")
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_k_quant_sub_blocks_match_eager_bit_for_bit(fmt: str, isa: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The two-level grids' vector kernels compute every sub-block's scale together: the
    same bits as the eager formula on the sub-blocks where that can part ways."""
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    for seed in range(4):
        x = _k_quant_blocks(fmt, seed)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            _assert_same_bits(OPS.block_fake_quant(xd, fmt, 256), fake_quant_eager(xd, fmt, 256))


@pytest.mark.parametrize("isa", ISAS, ids=lambda s: s or "best")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_32_element_grids_in_groups_of_eight_blocks(fmt: str, isa: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The 32-element grids' kernels take eight blocks at a time: a group holding a NaN or
    an infinite block, groups followed by a tail of fewer than eight blocks, a lead tied
    with its opposite and blocks of one sign give the eager formula's bits."""
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    x = _values(fmt, 43, 32, f"groups-{fmt}")  # five groups of eight, then three blocks
    x[5, 7], x[5, 20] = 3.0, -3.0   # tied lead, positive first
    x[6, 7], x[6, 20] = -3.0, 3.0   # negative first
    x[7] = x[7].abs()
    x[8] = -x[8].abs()
    x[13, 4] = float("nan")         # in the second group
    x[26, 31] = float("inf")        # in the fourth
    x[33, 0] = float("-inf")        # in the fifth
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        _assert_same_bits(OPS.block_fake_quant(xd, fmt, 32), fake_quant_eager(xd, fmt, 32))
