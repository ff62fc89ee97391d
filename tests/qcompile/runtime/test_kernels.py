"""The fused fake-quant kernels (``qcompile.runtime.kernels``) against the eager formulation.

Forward outputs and ``x`` gradients must be bit-identical to
``quant_math.fake_quantize_eager`` (torch.equal); LSQ's scale gradient is a sum whose
order differs from torch's, so it is compared exactly where every partial sum is exact
and to float32 rounding elsewhere (and must not depend on the thread count).
"""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import qcompile as qc
from qcompile.runtime import kernels, quant_math
from qcompile.runtime.fake_quant import FakeQuantize

OPS = kernels.load()
needs_ext = pytest.mark.skipif(OPS is None,
                               reason="no C++ kernels (QCOMPILE_NO_EXT=1 or no compiler)")

# (quant_min, quant_max, symmetric)
QDTYPES = {"int8": (-128, 127, True), "int8_asym": (-128, 127, False),
           "uint8": (0, 255, True), "uint8_asym": (0, 255, False),
           "int4": (-8, 7, True), "int4_asym": (-8, 7, False)}

# granularity cases: (name, x shape, how scale is shaped against the working view)
GRANULARITIES = [
    ("per_tensor", (6, 37), None),
    ("per_channel_0", (5, 40), 0),
    ("per_channel_1", (3, 4, 5, 6), 1),        # conv activation: [N, C, H, W], inner 30
    ("per_channel_1_short", (3, 6, 2, 2), 1),  # inner 4: per-element parameters
    ("per_channel_-1", (4, 3, 24), -1),        # [B, T, C]: one scale per column
    ("per_group", (6, 64), "group16"),
    ("per_group_short", (4, 24), "group4"),
    ("per_token", (2, 5, 33), "token"),
]


def _work_and_params(name: str, x: torch.Tensor, axis: object, qdtype: str,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The working view of x and its scale / zero point, shaped as FakeQuantize does."""
    qmin, qmax, symmetric = QDTYPES[qdtype]
    if axis is None:
        shape: list[int] = [1]
        work = x
    elif isinstance(axis, int):
        shape = [1] * x.dim()
        shape[axis] = x.shape[axis]
        work = x
    elif axis == "token":
        shape = [*x.shape[:-1], 1]
        work = x
    else:  # per-group: [rows, groups, group_size]
        gs = int(axis.removeprefix("group"))
        work = x.reshape(x.shape[0], -1, gs)
        shape = [work.shape[0], work.shape[1], 1]
    n = 1
    for d in shape:
        n *= d
    # a mix of powers of two (exact .5 ties) and arbitrary scales
    pow2 = 2.0 ** torch.randint(-6, 2, (n,), generator=gen).float()
    arb = torch.rand(n, generator=gen) * 0.2 + 0.01
    scale = torch.where(torch.rand(n, generator=gen) < 0.5, pow2, arb).reshape(shape)
    if symmetric:
        zp = torch.full((n,), quant_math.symmetric_zero_point(qmin, qmax), dtype=torch.int32)
    else:
        zp = torch.randint(qmin, qmax + 1, (n,), generator=gen, dtype=torch.int32)
    return work, scale, zp.reshape(shape)


def _planted(shape: tuple[int, ...], name: str, axis: object, qdtype: str,
             gen: torch.Generator) -> torch.Tensor:
    """Values on the grid, at .5 ties and around the clamp edges, plus random ones."""
    x = torch.randn(shape, generator=gen) * 3
    work, scale, zp = _work_and_params(name, x, axis, qdtype, gen)
    qmin, qmax, _ = QDTYPES[qdtype]
    k = torch.randint(qmin - 3, qmax + 4, work.shape, generator=gen).float() - zp.float()
    frac = torch.tensor([0.0, 0.5, -0.5, 0.25, 0.4999, 1.5])[
        torch.randint(0, 6, work.shape, generator=gen)]
    planted = (k + frac) * scale
    pick = torch.rand(work.shape, generator=gen) < 0.7
    return torch.where(pick, planted, work).reshape(shape)


def _run(fn, leaf: torch.Tensor, view, scale: torch.Tensor, grad: torch.Tensor):
    """fn(view(leaf), scale) forward + backward: (out, d leaf, d scale)."""
    leaf = leaf.detach().clone().requires_grad_(True)
    s = scale.detach().clone().requires_grad_(scale.requires_grad)
    out = fn(view(leaf), s)
    out.backward(grad)
    return out.detach(), leaf.grad, s.grad


def _both(work_fn, leaf, view, scale, zp, qmin, qmax, learnable, factor=0.125, grad=None):
    """(fused, eager) results of fake-quantizing view(leaf), upstream gradient ``grad``
    (default: random normal): each (out, d leaf, d scale, reference); the fused one's
    reference is LSQ's scale gradient summed in float64 (and the sum of |terms|)."""
    def fused(x, s):
        return (OPS.fake_quant_lsq(work_fn(x), s, zp, qmin, qmax, factor) if learnable
                else OPS.fake_quant(work_fn(x), s, zp, qmin, qmax))

    def eager(x, s):
        return quant_math.fake_quantize_eager(work_fn(x), s, zp, qmin, qmax,
                                              learnable=learnable, grad_factor=factor)

    s = scale.requires_grad_(learnable)
    probe = eager(view(leaf.detach()), s.detach())
    if grad is None:
        grad = torch.randn(probe.shape, generator=torch.Generator().manual_seed(1))
    grad = grad.to(probe.dtype)
    ref = None
    if learnable:  # the eager backward's terms, in float32, summed in float64
        xs = work_fn(view(leaf.detach())).float() / s.detach()
        z = zp.float()
        q = torch.round(xs) + z
        inside = (q >= qmin) & (q <= qmax)
        qc = torch.clamp(q, qmin, qmax)
        terms = grad.float() * torch.where(inside, qc - z - xs, qc - z)
        ref = (terms.double().sum_to_size(s.shape) * factor,
               terms.double().abs().sum_to_size(s.shape) * factor)
    return (*_run(fused, leaf, view, s, grad), ref), (*_run(eager, leaf, view, s, grad), None)


def _assert_same(fused, eager, learnable: bool, exact_scale_grad: bool = False) -> None:
    (y1, gx1, gs1, ref), (y2, gx2, gs2, _) = fused, eager
    assert y1.dtype == y2.dtype and y1.shape == y2.shape
    assert torch.equal(y1, y2), (y1 - y2).abs().max()
    assert torch.equal(gx1, gx2)
    if learnable:
        assert gs1.shape == gs2.shape and gs1.dtype == gs2.dtype
        if exact_scale_grad:
            assert torch.equal(gs1, gs2), (gs1 - gs2).abs().max()
        # fused: float64 sums, rounded once (then the factor): within ~2 ulp of the exact sum
        total, size = ref
        err = (gs1.double() - total).abs()
        assert bool((err <= 2.5e-7 * total.abs() + 1e-12 * size).all()), (gs1, total)
        # eager: float32 sums, off by rounding errors that grow with the terms' magnitude
        assert bool(((gs2.double() - total).abs() <= 1e-5 * size + 1e-30).all()), (gs2, total)


LAYOUTS = {
    "contiguous": (lambda shape: shape, lambda t: t),
    "transposed": (lambda shape: shape[::-1], lambda t: t.permute(*range(t.dim() - 1, -1, -1))),
    "sliced": (lambda shape: (shape[0] + 2, *shape[1:-1], shape[-1] * 2),
               lambda t: t[1:-1, ..., ::2]),
}


@needs_ext
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("learnable", [False, True], ids=["ste", "lsq"])
@pytest.mark.parametrize(("name", "shape", "axis"), GRANULARITIES,
                         ids=[g[0] for g in GRANULARITIES])
def test_matches_eager_exactly(name: str, shape: tuple[int, ...], axis: object,
                               learnable: bool, layout: str) -> None:
    base_shape, view = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{layout}-{learnable}".encode()))
    for qdtype, (qmin, qmax, _) in QDTYPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            x = _planted(shape, name, axis, qdtype, gen)
            # the leaf in base layout whose view has x's values
            leaf = torch.empty(base_shape(shape))
            view(leaf).copy_(x)
            leaf = leaf.to(dtype)
            assert view(leaf).shape == x.shape
            if layout != "contiguous":
                assert not view(leaf).is_contiguous()
            _, scale, zp = _work_and_params(name, x, axis, qdtype, gen)

            def work(t: torch.Tensor, axis: object = axis) -> torch.Tensor:
                if isinstance(axis, str) and axis.startswith("group"):
                    return t.reshape(t.shape[0], -1, int(axis.removeprefix("group")))
                return t

            fused, eager = _both(work, leaf, view, scale, zp, qmin, qmax, learnable)
            assert fused[0].dtype == dtype
            _assert_same(fused, eager, learnable)


@needs_ext
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=4).map(tuple),
    axis_pick=st.integers(-1, 4),
    values=st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False),
    log2_scale=st.integers(-12, 8),
    odd_scale=st.floats(0.5, 1.0, width=32),
    qdtype=st.sampled_from(sorted(QDTYPES)),
    learnable=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_values(shape, axis_pick, values, log2_scale, odd_scale, qdtype,
                                  learnable, seed) -> None:
    qmin, qmax, symmetric = QDTYPES[qdtype]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * abs(values) / 3
    x.view(-1)[0] = values
    per_channel = axis_pick < len(shape)
    pshape = [1] * len(shape)
    if per_channel:
        pshape[axis_pick] = shape[axis_pick]
    n = 1
    for d in pshape:
        n *= d
    scale = (torch.rand(n, generator=gen) * odd_scale + 2.0**log2_scale).reshape(pshape)
    zp = (torch.zeros(n, dtype=torch.int32) if symmetric
          else torch.randint(qmin, qmax + 1, (n,), generator=gen, dtype=torch.int32))
    fused, eager = _both(lambda t: t, x, lambda t: t, scale, zp.reshape(pshape), qmin, qmax,
                         learnable)
    _assert_same(fused, eager, learnable)


@needs_ext
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_lsq_scale_gradient_exact_when_sums_are_exact(axis: int | None) -> None:
    """Power-of-two scale, x on a quarter-step grid, integer upstream gradients: every
    term and partial sum is exact in float32, so both reductions give the same bits."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-300, 300, (64, 96), generator=gen).float() * 0.125
    x[::7, ::5] *= 4  # some beyond the clamp
    pshape = [1, 1] if axis is None else [-1 if d == axis else 1 for d in range(2)]
    c = 1 if axis is None else x.shape[axis]
    scale = torch.full((c,), 0.5).reshape(pshape)
    zp = torch.randint(-20, 20, (c,), generator=gen, dtype=torch.int32).reshape(pshape)
    grad = torch.randint(-4, 5, x.shape, generator=gen).float()
    fused, eager = _both(lambda t: t, x, lambda t: t, scale, zp, -128, 127, True, factor=0.25,
                         grad=grad)
    _assert_same(fused, eager, True, exact_scale_grad=True)


@needs_ext
@pytest.mark.parametrize(("shape", "dims"), [((600, 1024), ()), ((64, 40, 256), (1,)),
                                             ((3000, 200), (1,)), ((2048, 8, 32), (0, 1))],
                         ids=["per_tensor", "per_channel", "per_column", "per_group32"])
def test_parallel_and_deterministic(shape: tuple[int, ...], dims: tuple[int, ...]) -> None:
    """Tensors large enough for several threads and many partial sums: exact against
    eager, and LSQ's scale gradient has the same bits with 1 or 2 threads."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen)
    pshape = [d if i in dims else 1 for i, d in enumerate(shape)]
    scale = torch.rand(pshape, generator=gen) * 0.05 + 0.01
    zp = torch.zeros(pshape, dtype=torch.int32)
    fused, eager = _both(lambda t: t, x, lambda t: t, scale, zp, -128, 127, True)
    _assert_same(fused, eager, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _both(lambda t: t, x, lambda t: t, scale, zp, -128, 127, True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[2], fused[2])
    ste, ste_eager = _both(lambda t: t, x, lambda t: t, scale, zp, -8, 7, False)
    _assert_same(ste, ste_eager, False)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_empty_and_other_dtypes(dtype: torch.dtype) -> None:
    s, z = torch.tensor([0.1]), torch.tensor([0], dtype=torch.int32)
    for shape in ((0,), (0, 5), (3, 0, 2)):
        x = torch.empty(shape, dtype=dtype, requires_grad=True)
        sp = s.clone().requires_grad_(True)
        y = OPS.fake_quant_lsq(x, sp, z, -128, 127, 0.5)
        assert y.shape == x.shape and y.dtype == dtype
        y.sum().backward()
        assert x.grad.shape == x.shape and torch.equal(sp.grad, torch.zeros(1))
    x = torch.randn(7, 9).to(dtype)  # float16 runs the float32 kernel on a converted copy
    fused, eager = _both(lambda t: t, x, lambda t: t, torch.tensor([0.05]),
                         torch.tensor([3], dtype=torch.int32), -128, 127, True)
    _assert_same(fused, eager, True)


def _node_types(t: torch.Tensor) -> set[str]:
    """Types of the autograd nodes within two steps of t."""
    found, frontier = set(), [t.grad_fn]
    for _ in range(2):
        frontier = [f for f in frontier if f is not None]
        found |= {type(f).__name__ for f in frontier}
        frontier = [n for f in frontier for n, _ in f.next_functions]
    return found


@needs_ext
@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel", "per_group", "per_token"])
def test_fake_quantize_module_takes_the_kernel(monkeypatch: pytest.MonkeyPatch, granularity: str,
                                               learnable: bool) -> None:
    """The FakeQuantize module routes CPU tensors to the kernels (seen in the autograd
    graph) and gives what the eager path gives."""
    if granularity == "per_token" and learnable:
        pytest.skip("per-token scales are computed per input, never learned")
    kw = {"per_channel": {"axis": 1, "channels": 8}, "per_group": {"group_size": 16,
                                                                   "channels": 4 * 2}}
    fq = FakeQuantize("int8", granularity=granularity, learnable=learnable,
                      **kw.get(granularity, {}))
    x = torch.randn(4, 8, 4) if granularity != "per_group" else torch.randn(4, 32)
    fq(x)
    fq.observe = False
    xa = x.clone().requires_grad_(True)
    ya = fq(xa)
    assert "CppFunction" in _node_types(ya)  # the C++ autograd function
    ya.backward(torch.ones_like(ya))
    # the learnt scale's parameter(s), whatever the parameterisation of the scale
    params = list(fq.parameters())
    assert bool(params) == learnable
    grads = [p.grad.clone() for p in params]
    fq.zero_grad(set_to_none=True)
    monkeypatch.setattr(quant_math, "_fused", lambda *a: False)
    monkeypatch.setattr(kernels, "available", lambda: False)  # FakeQuantize's fast path too
    xb = x.clone().requires_grad_(True)
    yb = fq(xb)
    assert "CppFunction" not in _node_types(yb)
    yb.backward(torch.ones_like(yb))
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    for p, grad in zip(params, grads):  # a sum in another order: float32 rounding
        torch.testing.assert_close(grad, p.grad, rtol=2e-5, atol=1e-6)


@needs_ext
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 70001])
def test_masks(n: int) -> None:
    """The forward saves 1 bit per element; ``fake_quant_bwd`` takes a bool mask of the
    gradient's shape (as ``qcompile.runtime.weight_cache`` keeps one)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 200
    s, z = torch.tensor([1.0]), torch.tensor([0], dtype=torch.int32)
    out, bits = OPS.fake_quant_ste_fwd(x, s, z, -128, 127)
    assert torch.equal(out, quant_math.fake_quantize_eager(x, s, z, -128, 127))
    assert bits.dtype == torch.uint8 and bits.shape == ((n + 7) // 8,)
    inside = (torch.round(x) >= -128) & (torch.round(x) <= 127)
    unpacked = (bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    assert torch.equal(unpacked.reshape(-1)[:n].bool(), inside)
    assert int(unpacked.reshape(-1)[n:].sum()) == 0
    g = torch.randn(n, generator=gen)
    assert torch.equal(OPS.fake_quant_ste_bwd(g, bits, [1]), g * inside)
    assert torch.equal(OPS.fake_quant_bwd(g, inside), g * inside)
    assert torch.equal(OPS.fake_quant_bwd(g.bfloat16(), inside), g.bfloat16() * inside)


@needs_ext
def test_operator_registration() -> None:
    """Schema, autograd, fake-tensor and AOT-dispatch checks of torch.library."""
    x = torch.randn(3, 5, 7, requires_grad=True)
    s = torch.rand(1, 5, 1) * 0.1 + 0.01
    z = torch.randint(-3, 3, (1, 5, 1), dtype=torch.int32)
    xt = x.detach().transpose(0, 2).requires_grad_(True)
    for op, args in ((OPS.fake_quant.default, (x, s, z, -128, 127)),
                     (OPS.fake_quant.default, (xt, s.transpose(0, 2), z.transpose(0, 2), -8, 7)),
                     (OPS.fake_quant_lsq.default, (x, s.clone().requires_grad_(True), z, 0, 255,
                                                   0.1))):
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), result


def _small_qat_graph() -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    gm = qc.qcompile(model, "int8-qat", example_inputs=(x,))
    gm(x)
    qc.freeze(gm)
    return gm, x


@needs_ext
@pytest.mark.filterwarnings("ignore:.*script_method.*:DeprecationWarning")  # torch's inductor
def test_torch_compile_of_a_qcompiled_graph() -> None:
    gm, x = _small_qat_graph()
    y_eager = gm(x)
    y_eager.sum().backward()
    grads = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad()
    explained = torch._dynamo.explain(gm)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def inductor(graph: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(graph)
        return compile_fx(graph, inputs)

    compiled = torch.compile(gm, fullgraph=True, backend=inductor)  # the default, recorded
    y = compiled(x)
    # The fake-quant reaches Inductor as the eager formula (elementwise ops it fuses into
    # its neighbours' kernels, the GPU path), not as the opaque C++ operator.
    targets = {str(n.target) for g in graphs for n in g.graph.nodes}
    assert graphs and not any("qcompile" in t for t in targets), targets
    torch.testing.assert_close(y, y_eager, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    for n, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)


@needs_ext
def test_torch_compile_with_dynamic_shapes() -> None:
    """Meta kernels and the saved output stride work with symbolic sizes."""
    fq = FakeQuantize("int8", granularity="per_channel", axis=1, channels=8)
    lsq = FakeQuantize("int8", learnable=True)
    fq(torch.randn(4, 8, 5))
    lsq(torch.randn(3, 8))
    fq.observe = False
    compiled = torch.compile(fq, dynamic=True, backend="aot_eager")
    compiled_lsq = torch.compile(lsq, dynamic=True, backend="aot_eager")
    for n in (4, 6, 9):
        for module, cmod, x in ((fq, compiled, torch.randn(n, 8, 5)),
                                (lsq, compiled_lsq, torch.randn(n, 8))):
            xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            ya, yb = cmod(xa), module(xb)
            assert torch.equal(ya, yb)
            ya.backward(torch.ones_like(ya))
            yb.backward(torch.ones_like(yb))
            assert torch.equal(xa.grad, xb.grad)


@needs_ext
def test_export_shows_the_operator() -> None:
    gm, x = _small_qat_graph()
    ep = torch.export.export(gm, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    # 2 weights, 2 outputs, and the model input (inputs: auto)
    assert targets.count(torch.ops.qcompile.fake_quant.default) == 5
    assert torch.equal(ep.module()(x), gm(x))
    fq = FakeQuantize("int8", learnable=True)
    fq(x)
    ep = torch.export.export(fq, (x,))
    assert torch.ops.qcompile.fake_quant_lsq.default in [n.target for n in ep.graph.nodes]


def test_other_devices_take_the_eager_path() -> None:
    """Meta tensors (as CUDA ones) never reach the CPU kernels."""
    x = torch.empty(4, 8, device="meta")
    s, z = torch.ones(1, device="meta"), torch.zeros(1, dtype=torch.int32, device="meta")
    assert not quant_math._fused(x, s, z)
    y = quant_math.fake_quantize(x, s, z, -128, 127, learnable=True)
    assert y.device.type == "meta" and y.shape == x.shape


@needs_ext
def test_isa_variants_and_fallback_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX-512, AVX2 and baseline kernels, and the eager fallback, give the same bits
    (LSQ's scale gradient too, but the eager one: torch sums in another order)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 257, generator=g)
    s = torch.rand(300, 1, generator=g) * 0.05 + 0.01
    z = torch.randint(-9, 9, (300, 1), generator=g, dtype=torch.int32)
    xt = torch.randn(64, 48, generator=g).t().to(torch.bfloat16)
    st_ = torch.rand(1, 64, generator=g) * 0.05 + 0.01
    zt = torch.zeros(1, 64, dtype=torch.int32)
    # short rows (groups of 16, one scale each), straight-through, some clamped
    xg = torch.randn(30, 4, 16, generator=g) * 3
    sg = torch.rand(30, 4, 1, generator=g) * 0.05 + 0.01
    zg = torch.zeros(30, 4, 1, dtype=torch.int32)

    def run() -> list[torch.Tensor]:
        xl, sl = x.clone().requires_grad_(True), s.clone().requires_grad_(True)
        xtl = xt.clone().requires_grad_(True)
        y = quant_math.fake_quantize(xl, sl, z, -128, 127, learnable=True)
        y2 = quant_math.fake_quantize(xtl, st_, zt, -8, 7)
        out = []
        for dtype in (torch.float32, torch.bfloat16):
            xgl = xg.to(dtype).clone().requires_grad_(True)
            y3 = quant_math.fake_quantize(xgl, sg, zg, -8, 7)
            (y3.float() ** 2).sum().backward()
            out += [y3, xgl.grad]
        (y.sum() + (y2.float() ** 2).sum()).backward()
        return [y, xl.grad, y2, xtl.grad, *out, sl.grad]

    results = {}
    for isa in ("", "avx512", "avx2", "base"):
        monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
        results[OPS.fake_quant_isa() if isa else "default"] = run()
    assert {"default", "base"} <= set(results)
    monkeypatch.setattr(kernels, "available", lambda: False)
    eager = run()
    for name, r in results.items():
        assert all(torch.equal(a, b) for a, b in zip(r, results["default"])), name
        assert all(torch.equal(a, b) for a, b in zip(r[:-1], eager[:-1])), name
        torch.testing.assert_close(r[-1], eager[-1], rtol=2e-5, atol=1e-6)


def test_build_failure_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path) -> None:
    # every source a tiny broken file: the compiler fails at once on each (the real
    # sources take seconds to compile, torch's headers included)
    for attr in ("SOURCE", "BLOCK_SOURCE", "DEQUANT_SOURCE"):
        broken = tmp_path / f"{attr.lower()}.cpp"
        broken.write_text("#error this source does not compile\n")
        monkeypatch.setattr(kernels, attr, broken)
    monkeypatch.setenv("QCOMPILE_EXT_DIR", str(tmp_path / "build"))
    monkeypatch.delenv("QCOMPILE_NO_EXT", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.load.__wrapped__() is None
    assert any("could not be built" in str(w.message) for w in caught), caught
    monkeypatch.setenv("QCOMPILE_NO_EXT", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.load.__wrapped__() is None


# -- forced to AVX2: the path of every CPU without AVX-512 ----------------------------------
_AVX2_CHECKS = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("kernel_tests", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
# the x86 target's 7-bit activation ranges too
m.QDTYPES.update({"uint8_x86": (0, 127, False), "int8_x86": (-64, 63, True)})
for name, shape, axis in m.GRANULARITIES:
    for learnable in (False, True):
        m.test_matches_eager_exactly(name, shape, axis, learnable, "contiguous")
m.test_matches_eager_exactly("per_channel_1", (3, 4, 5, 6), 1, True, "transposed")
for axis in (None, 0, 1):
    m.test_lsq_scale_gradient_exact_when_sums_are_exact(axis)
for n in (7, 1000, 70001):
    m.test_masks(n)
print(m.OPS.fake_quant_isa(), torch.backends.cpu.get_cpu_capability())
"""


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


@needs_ext
def test_kernels_forced_to_avx2_match_eager() -> None:
    """The key equality checks in a fresh process with our kernels forced to their AVX2
    variant (``QCOMPILE_FQ_ISA=avx2``) and torch's eager reference to its AVX2 code
    (``ATEN_CPU_CAPABILITY=avx2``): what a CPU without AVX-512 runs, tested on any CPU."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "QCOMPILE_FQ_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}
    proc = subprocess.run([sys.executable, "-c", _AVX2_CHECKS, __file__], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    isa, aten = proc.stdout.split()[-2:]
    flags = _cpu_flags()
    if flags is not None and {"avx2", "fma", "f16c", "bmi2"} <= flags:
        assert isa == "avx2", proc.stdout
        assert aten == "AVX2", proc.stdout
    else:
        assert isa in ("avx2", "base"), proc.stdout


# -- odd lengths and bfloat16 on every instruction-set variant, against a formula written here --
# Rows of 17, 24 and 40 elements (the 8- and 16-wide loops, then their tails), per tensor,
# per row, per column (the last dim), per group and per token, float32 and bfloat16, for
# each variant QCOMPILE_FQ_ISA picks: the output and the straight-through mask against
# round-half-even(x / s) + z, clamped, written out here in float32 (not quant_math's).
ODD_SHAPES = [
    ("per_tensor", (5, 17), None), ("per_tensor", (3, 40), None),
    ("per_row", (5, 24), 0), ("per_row", (7, 17), 0), ("per_row", (2, 40), 0),
    ("per_column", (5, 24), -1), ("per_column", (3, 17), -1),
    ("per_group", (3, 48), 24), ("per_group", (2, 80), 40),
    ("per_token", (2, 3, 40), "token"), ("per_token", (5, 17), "token"),
]


def _odd_params(shape: tuple[int, ...], axis: object, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(shape, generator=gen) * 4
    if axis is None:
        pshape = [1]
    elif axis == "token":
        pshape = [*shape[:-1], 1]
    elif isinstance(axis, int) and axis in (0, -1):
        pshape = [1] * len(shape)
        pshape[axis] = shape[axis]
    else:  # per group of `axis` elements: [rows, groups, group]
        x = x.reshape(shape[0], -1, axis)
        pshape = [shape[0], x.shape[1], 1]
    scale = (torch.rand(pshape, generator=gen) * 0.05 + 0.01)
    zp = torch.randint(-5, 6, pshape, generator=gen, dtype=torch.int32)
    return x, scale, zp


@needs_ext
@pytest.mark.parametrize("isa", ["", "avx512", "avx2", "base"], ids=lambda s: s or "best")
@pytest.mark.parametrize(("name", "shape", "axis"), ODD_SHAPES,
                         ids=[f"{n}-{'x'.join(map(str, s))}" for n, s, _ in ODD_SHAPES])
def test_odd_lengths_every_isa_against_the_formula(name: str, shape: tuple[int, ...],
                                                   axis: object, isa: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}{shape}".encode()))
    x, scale, zp = _odd_params(shape, axis, gen)
    qmin, qmax = -8, 7  # int4: a good share of the values clamp
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).clone().requires_grad_(True)
        q = torch.round(xd.detach().float() / scale) + zp.float()
        inside = (q >= qmin) & (q <= qmax)
        want = ((q.clamp(qmin, qmax) - zp.float()) * scale).to(dtype)
        assert 0 < int(inside.sum()) < x.numel()  # some clamped, some not
        got = OPS.fake_quant(xd, scale, zp, qmin, qmax)
        assert got.dtype == dtype
        wrong = int((got.detach() != want).sum())
        assert wrong == 0, f"{name} {shape} {dtype} isa {isa or 'best'}: {wrong} values wrong"
        g = torch.randn(x.shape, generator=gen).to(dtype)
        got.backward(g)
        assert torch.equal(xd.grad, g * inside.to(dtype)), f"{name} {dtype}: gradient mask"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits, NaN for NaN (whatever its payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(ints), b[~nan].view(ints))


# (shape, channel axis or None for one scale): odd lengths, row mode (a channel's elements
# in runs of 16 or more), column mode (shorter runs), several threads' tasks
MINMAX_CASES = [((1,), None), ((7,), None), ((3, 21), None), ((65, 1009), None),
                ((5, 37), 0), ((3, 6, 5, 7), 1), ((3, 6, 2, 3), 1), ((4, 9, 33), -1),
                ((40, 24, 70), 1)]


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("shape", "axis"), MINMAX_CASES, ids=[str(c) for c in MINMAX_CASES])
def test_fake_quant_minmax_is_fake_quant_and_a_running_min_max(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, shape: tuple[int, ...],
        axis: int | None) -> None:
    """``qcompile::fake_quant_minmax`` (a training forward with step observer updates, in
    one pass): the eager fake-quant's output and gradient, bit for bit, and the running
    minimum / maximum that ``torch.minimum`` / ``torch.amin`` give, per scale; NaN and
    infinities included; every ISA variant."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}-{axis}-{dtype}".encode()))
    x = torch.randn(shape, generator=gen) * 3
    flat = x.view(-1)
    if x.numel() >= 8:  # one channel meets a NaN, others +-inf
        idx = torch.randperm(x.numel(), generator=gen)[:3]
        flat[idx] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    x = x.to(dtype)
    c = 1 if axis is None else shape[axis]
    view = [1] * len(shape)
    if axis is not None:
        view[axis] = c
    pow2 = 2.0 ** torch.randint(-5, 0, (c,), generator=gen).float()  # exact .5 ties
    scale = torch.where(torch.rand(c, generator=gen) < 0.5, pow2,
                        torch.rand(c, generator=gen) * 0.2 + 0.01)
    zp = torch.randint(0, 128, (c,), generator=gen, dtype=torch.int32)
    s, z = scale.view(view), zp.view(view)
    mn0 = torch.randn(c, generator=gen)  # statistics gathered before: some channels keep them
    mx0 = mn0 + torch.rand(c, generator=gen) * 4
    grad = torch.randn(shape, generator=gen).to(dtype)
    # the references: the eager formula (tensor ops) and torch's reductions
    xr = x.clone().requires_grad_(True)
    ref = quant_math.fake_quantize_eager(xr, s, z, 0, 127)
    ref.backward(grad)
    rows = x.float().movedim(axis, 0).reshape(c, -1) if axis is not None else x.float().view(1, -1)
    ref_mn, ref_mx = torch.minimum(mn0, rows.amin(1)), torch.maximum(mx0, rows.amax(1))
    for isa in ("", "avx512", "avx2", "base"):
        monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
        for grads in (True, False):
            mn, mx = mn0.clone(), mx0.clone()
            xa = x.clone().requires_grad_(grads)
            out = OPS.fake_quant_minmax(xa, s, z, 0, 127, mn, mx)
            assert _same_bits(out, ref.detach()), (isa, grads)
            torch.testing.assert_close(mn, ref_mn, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(mx, ref_mx, rtol=0, atol=0, equal_nan=True)
            if grads:
                out.backward(grad)
                assert _same_bits(xa.grad, xr.grad), isa
    with pytest.raises(RuntimeError, match="one value per scale"):
        OPS.fake_quant_minmax(x, s, z, 0, 127, torch.zeros(c + 1), torch.zeros(c + 1))
