"""The fast paths of the fused fake-quant (issue 18): one autograd node per call, output
buffers recycled from a small pool, the vectorised LSQ backward, amin/amax statistics,
and the eager formula under ``torch.compile`` (tested in ``test_kernels``).

Numerics are compared bit for bit with the eager formulation
(``quant_math.fake_quantize_eager``), as ``test_kernels`` does for the other paths.
"""

from __future__ import annotations

import pytest
import torch

from qcompile.runtime import kernels, quant_math
from qcompile.runtime.fake_quant import FakeQuantize

OPS = kernels.load()
needs_ext = pytest.mark.skipif(OPS is None,
                               reason="no C++ kernels (QCOMPILE_NO_EXT=1 or no compiler)")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical values, NaN where the other has NaN (``torch.equal`` says NaN != NaN):
    same dtype and shape, same NaN positions, ``torch.equal`` everywhere else."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


@needs_ext
@pytest.mark.parametrize("learnable", [False, True])
def test_one_autograd_node_per_call(learnable: bool) -> None:
    """The output's grad_fn is the operator's own node, wired straight to the leaves."""
    x = (torch.randn(8, 16) * 10).requires_grad_(True)  # some clamped: the node saves a mask
    s = torch.tensor([0.05], requires_grad=learnable)
    z = torch.zeros(1, dtype=torch.int32)
    y = quant_math.fake_quantize(x, s, z, -128, 127, learnable=learnable)
    name = "FakeQuantLSQBackward" if learnable else "FakeQuantSTEBackward"
    assert y.grad_fn.name() == name
    nexts = [type(f).__name__ if f is not None else None for f, _ in y.grad_fn.next_functions]
    assert nexts == ["AccumulateGrad", "AccumulateGrad" if learnable else None]
    g = torch.randn_like(y)
    y.backward(g, retain_graph=True)
    first = x.grad.clone()
    y.backward(g)  # saved tensors still there with retain_graph
    assert torch.equal(x.grad, 2 * first)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(g)  # ... and released after the last backward


@needs_ext
@pytest.mark.parametrize("isa", ["", "avx2", "base"])
def test_nothing_clamped_passes_the_gradient_on(monkeypatch: pytest.MonkeyPatch,
                                                isa: str) -> None:
    """When no element is clamped (a weight under its own min-max range) the straight-
    through backward hands the incoming gradient on as is: the same tensor, so the same
    bits as ``grad * 1``; one element clamped and it is the masked copy again."""
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    for n in (1, 7, 64, 1000, 4099):  # partial mask bytes and words
        w = torch.randn(n)
        s = (w.abs().amax() / 127).reshape(1)
        z = torch.zeros(1, dtype=torch.int32)
        x = w.clone().requires_grad_(True)
        y = quant_math.fake_quantize(x, s, z, -128, 127)
        g = torch.randn(n)
        y.backward(g)
        assert x.grad is not None and torch.equal(x.grad, g), n
        ref = x.detach().clone().requires_grad_(True)
        quant_math.fake_quantize_eager(ref, s, z, -128, 127).backward(g)
        assert torch.equal(x.grad, ref.grad)
        # the last element beyond the range: that one gradient is 0, the rest pass
        x2 = w.clone()
        x2[-1] = 200 * s[0]
        x2.requires_grad_(True)
        quant_math.fake_quantize(x2, s, z, -128, 127).backward(g)
        want = g.clone()
        want[-1] = 0.0
        assert torch.equal(x2.grad, want), n


@needs_ext
@pytest.mark.parametrize("learnable", [False, True])
def test_node_gradients_match_eager(learnable: bool) -> None:
    """Gradients of x (and the scale) from the node equal the eager autograd Functions'."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 70, generator=gen) * 3
    s = torch.rand(33, 1, generator=gen) * 0.05 + 0.01
    z = torch.randint(-5, 5, (33, 1), generator=gen, dtype=torch.int32)
    g = torch.randn(33, 70, generator=gen)

    def run(fused: bool) -> list[torch.Tensor]:
        xl, sl = x.clone().requires_grad_(True), s.clone().requires_grad_(learnable)
        if fused:
            y = quant_math.fake_quantize(xl, sl, z, -128, 127, learnable=learnable, batch=1)
        else:
            factor = quant_math.lsq_grad_factor(x, s, 127, 1) if learnable else 0.0
            y = quant_math.fake_quantize_eager(xl, sl, z, -128, 127, learnable=learnable,
                                               grad_factor=factor)
        y.backward(g)
        return [y.detach(), xl.grad] + ([sl.grad] if learnable else [])

    fused, eager = run(True), run(False)
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])
    if learnable:  # a sum in another order than torch's
        torch.testing.assert_close(fused[2], eager[2], rtol=2e-5, atol=1e-6)


@needs_ext
def test_unused_output_and_no_grad() -> None:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    s, z = torch.tensor([0.1]), torch.zeros(1, dtype=torch.int32)
    y = quant_math.fake_quantize(x, s, z, -8, 7)
    (gx,) = torch.autograd.grad([y.sum(), x.sum()], [x], allow_unused=True)
    r = (x.detach() / s).round()
    assert torch.equal(gx, ((r >= -8) & (r <= 7)).float() + 1)  # the STE's range is [-8, 7]
    with torch.no_grad():
        assert quant_math.fake_quantize(x, s, z, -8, 7).grad_fn is None


@needs_ext
def test_checkpointing_saves_through_hooks() -> None:
    """Saved-tensor hooks (non-reentrant checkpointing) see the node's saved mask."""
    x = torch.randn(16, 32, requires_grad=True)
    s, z = torch.tensor([0.02]), torch.zeros(1, dtype=torch.int32)
    packed = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = quant_math.fake_quantize(x, s, z, -128, 127)
    assert packed == [torch.Size([16 * 32 // 8])]  # the 1-bit mask
    y.sum().backward()
    ref = torch.utils.checkpoint.checkpoint(
        lambda t: quant_math.fake_quantize(t, s, z, -128, 127), x.detach().requires_grad_(True),
        use_reentrant=False)
    assert torch.equal(ref, y)


@needs_ext
def test_large_outputs_reuse_freed_buffers() -> None:
    """Outputs of 1 MB and more come back from the pool (no fresh pages to fault in),
    stay ordinary tensors, and the pool can be emptied."""
    x = torch.randn(512, 1024)  # 2 MB
    s, z = torch.tensor([0.02]), torch.zeros(1, dtype=torch.int32)
    first = OPS.fake_quant(x, s, z, -128, 127)
    ptr = first.data_ptr()
    del first
    again = OPS.fake_quant(x, s, z, -128, 127)
    assert again.data_ptr() == ptr  # the freed block, reused
    assert torch.equal(again, quant_math.fake_quantize_eager(x, s, z, -128, 127))
    again.resize_(1024, 1024).fill_(1.0)  # resizable, as torch's own
    assert again.sum().item() == 1024 * 1024
    del again
    assert OPS.fake_quant_release_cache() >= 512 * 1024 * 4
    assert OPS.fake_quant_release_cache() == 0


def test_minmax_statistics_match_aminmax() -> None:
    """amin/amax (the fast reductions the quantizer uses) give torch.aminmax's values,
    NaN included, for every granularity."""
    x = torch.randn(6, 8, 32)
    x[1, 2, 3] = float("nan")
    cases = [({"granularity": "per_channel", "axis": 1, "channels": 8},
              lambda t: torch.aminmax(t.movedim(1, 0).reshape(8, -1), dim=1)),
             ({"granularity": "per_group", "group_size": 16, "channels": 6 * 16},
              lambda t: [v.reshape(-1) for v in torch.aminmax(t.reshape(6, -1, 16), dim=-1)]),
             ({"granularity": "per_token", "dynamic": True},
              lambda t: torch.aminmax(t, dim=-1, keepdim=True))]
    for kw, ref in cases:
        fq = FakeQuantize("int8", **kw)
        for got, want in zip(fq._minmax(x), ref(x)):
            assert same_bits(got, want)


@needs_ext
@pytest.mark.parametrize("isa", ["", "avx2", "base"])
@pytest.mark.parametrize("observer", ["minmax", "moving_average", "moving_average_0.7",
                                      "moving_average_1.0"])
@pytest.mark.parametrize(("dtype", "symmetric", "granularity"), [
    ("int8", True, "per_channel"), ("uint8", False, "per_channel"),
    ("int4", False, "per_tensor"), ("uint8", True, "per_tensor")])
def test_fused_observation_matches_python(monkeypatch: pytest.MonkeyPatch, isa: str,
                                          observer: str, dtype: str, symmetric: bool,
                                          granularity: str) -> None:
    """``observe_minmax`` (one pass, in C++) leaves the observer's statistics and the
    qparams bit-identical to MinMaxObserver.update / MovingAverageObserver.update +
    qparams_from_minmax, over a sequence of observations (running min / max, or averages
    from a fresh start), odd row lengths, all-zero and NaN rows."""
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    gen = torch.Generator().manual_seed(7)
    kw: dict = {"granularity": granularity, "axis": 0, "channels": 12} \
        if granularity == "per_channel" else {}
    if observer.startswith("moving_average"):
        momentum = float(observer.rsplit("_", 1)[1]) if observer.count("_") == 2 else 0.01
        kw["observer"] = {"kind": "moving_average", "momentum": momentum}
    fused = FakeQuantize(dtype, symmetric=symmetric, **kw)
    python = FakeQuantize(dtype, symmetric=symmetric, **kw)
    assert type(fused.observer).__name__ == ("MinMaxObserver" if observer == "minmax"
                                             else "MovingAverageObserver")
    monkeypatch.setattr(python, "_observe_fused", lambda x: False)
    for step in range(4):
        x = torch.randn(12, 37, generator=gen) * (10.0 ** (step - 2)) + step * 0.3
        x[3] = 0.0  # a constant row: scale eps
        if step == 2:
            x[5, 7] = float("nan")
        assert fused._observe_fused(x.clone()) is True
        fused.observed = True
        python.observe_tensor(x)
        for a, b in ((fused.observer.min_val, python.observer.min_val),
                     (fused.observer.max_val, python.observer.max_val),
                     (fused.scale, python.scale), (fused.zero_point, python.zero_point)):
            assert same_bits(a, b), (step, a, b)
    # and the forward the quantizer runs with them (the NaN row's scale stays NaN)
    x = torch.randn(12, 37, generator=gen)
    torch.testing.assert_close(fused(x), python(x), rtol=0, atol=0, equal_nan=True)


@needs_ext
def test_fused_observation_keeps_weight_cache_rules() -> None:
    """A weight quantizer observing through the fused call still caches and invalidates as
    before (versions bumped, entry dropped on observation)."""
    w = torch.nn.Parameter(torch.randn(8, 16))
    fq = FakeQuantize("int8", granularity="per_channel", axis=0, channels=8)
    v = fq.scale._version
    a = fq(w)
    assert fq.scale._version > v and fq.observed
    assert fq(w).data_ptr() == a.data_ptr()  # a hit
    with torch.no_grad():
        w.mul_(3.0)
    b = fq(w)
    assert b.data_ptr() != a.data_ptr()
    assert torch.equal(fq.observer.max_val, torch.maximum(w.detach().amax(1) / 3,
                                                          w.detach().amax(1)))


@needs_ext
@pytest.mark.parametrize("isa", ["", "avx2", "base"])
@pytest.mark.parametrize(("shape", "kw"), [
    ((12, 64), {"granularity": "per_channel", "axis": 0, "channels": 12}),  # one pass
    ((6, 1064), {"granularity": "per_channel", "axis": 0, "channels": 6}),  # long rows
    ((12, 4, 3, 3), {"granularity": "per_channel", "axis": 0, "channels": 12}),  # rows of 36
    ((12, 37), {"granularity": "per_channel", "axis": 0, "channels": 12}),  # two passes
    # 2.5 MB: the output written with streaming stores
    ((640, 1032), {"granularity": "per_channel", "axis": 0, "channels": 640}),
    ((3, 5, 40000), {}),  # per-tensor: min / max over chunks of the row
    ((7, 9), {"observer": {"kind": "moving_average", "momentum": 0.3}}),
    ((16, 24), {"granularity": "per_channel", "axis": 0, "channels": 16,
                "observer": "moving_average", "symmetric": False, "dtype": "uint8"}),
])
def test_observe_and_fake_quant_in_one_call(monkeypatch: pytest.MonkeyPatch, isa: str,
                                            shape: tuple[int, ...], kw: dict) -> None:
    """``qcompile::fake_quant_observe`` (the forward of an observing quantizer in one
    call) leaves the same observer state and qparams, and gives the same output and
    gradient bits, as observing first and fake-quantizing after, over several steps
    (running statistics), with a NaN row and a clamped element."""
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    gen = torch.Generator().manual_seed(11)
    fused = FakeQuantize(**{"dtype": "int8", **kw})
    split = FakeQuantize(**{"dtype": "int8", **kw})
    monkeypatch.setattr(split, "_observe_fake_quant", lambda x: None)
    for step in range(3):
        x = torch.randn(shape, generator=gen) * (step + 1)
        if step == 1 and shape[0] > 3:
            x[2] = float("nan")
        g = torch.randn(shape, generator=gen)
        got = []
        for fq in (fused, split):
            xl = x.clone().requires_grad_(True)
            y = fq(xl)
            y.backward(g)
            got.append((y.detach(), xl.grad, fq.scale.clone(), fq.zero_point.clone(),
                        fq.observer.min_val.clone(), fq.observer.max_val.clone()))
        assert fused.observed and split.observed
        for a, b in zip(*got):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    # an average moves only part of the way to an outlier: it is clamped, gradient 0
    if fused.observer.__class__.__name__ == "MovingAverageObserver":
        fused.observer.min_val.fill_(-1.0)
        fused.observer.max_val.fill_(1.0)
        x = torch.full(shape, 0.5)
        x.view(-1)[0] = 1e6
        x.requires_grad_(True)
        fused(x).sum().backward()
        assert x.grad.view(-1)[0] == 0 and (x.grad.view(-1)[1:] == 1).all()


def test_a_zero_dim_value_is_quantized_per_tensor_on_both_paths():
    """``y.sum()`` after a quantized layer: a 0-d tensor through a per-tensor quantizer, on
    the fixed-qparams fast path and the observing path alike."""
    fq = FakeQuantize("uint8", symmetric=False)
    x = torch.tensor(2.71828)
    observed = fq(x)  # observes, then quantizes
    assert observed.shape == () and float(observed) == pytest.approx(2.71828, abs=0.02)
    fq.observe = False
    fixed = fq(torch.tensor(1.3))
    scale = float(fq.scale)
    q = max(0, min(255, round(1.3 / scale) + int(fq.zero_point)))
    assert fixed.shape == () and float(fixed) == pytest.approx(
        (q - int(fq.zero_point)) * scale, rel=1e-6)
