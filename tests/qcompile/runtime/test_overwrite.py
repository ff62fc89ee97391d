"""Activation quantizers writing their output over their input (``overwrite=True`` calls,
``passes.overwrite_inputs``; ``qcompile::fake_quant_minmax_overwrite``), and the
straight-through backward masking a gradient nothing else holds where it lies.

Both must give the bits the new-output paths give (outputs, gradients, statistics, a
trained model), write over the input exactly when nothing else can read it, and leave
it alone whenever something can: a hook, a view, a tensor autograd saved, a leaf."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.runtime import kernels
from qcompile.runtime.fake_quant import FakeQuantize

needs_ext = pytest.mark.skipif(kernels.load() is None,
                               reason="no C++ kernels (QCOMPILE_NO_EXT=1 or no compiler)")
ISAS = ["avx512", "avx2", "base"]  # unsupported ones fall back to the next
EVERY_ISA = pytest.mark.parametrize("isa", ISAS)
BOTH_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                                      ids=lambda d: str(d).removeprefix("torch."))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _quantizer(dtype: torch.dtype) -> FakeQuantize:
    """A calibrated per-tensor activation quantizer with step updates, in training mode,
    calibrated on a narrower range than the batches below (some values clamp)."""
    fq = FakeQuantize("uint8", symmetric=False, per_example=True, update="step")
    fq.eval()
    fq(torch.linspace(-1.5, 2.0, 64).to(dtype))
    return fq.train()


def _layer(dtype: torch.dtype, seed: int, width: int = 37):
    """A Linear's weight and a 3-D input: the output is a view of the 2-D product."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(width, 29, generator=g) * 0.4).to(dtype).requires_grad_(True)
    x = torch.randn(3, 11, 29, generator=g).to(dtype).requires_grad_(True)
    return w, x


def _same_as_new_and_formula(new: tuple, over: tuple, q: FakeQuantize, w, x,
                             dtype: torch.dtype) -> None:
    """Both runs wrote where they should and agree bit for bit, and the output is the
    formula's with ``q``'s qparams: x / s rounded to even, clamped to [0, 255]."""
    assert not new[3] and over[3]
    for u, v in zip(new[:3], over[:3]):
        assert _same_bits(u, v)
    s, z = float(q.scale), float(q.zero_point)
    ref = (torch.clamp(torch.round(F.linear(x, w).detach().float() / s) + z, 0, 255) - z) * s
    assert _same_bits(over[0], ref.to(dtype))


def _run(fq: FakeQuantize, w, x, overwrite: bool, grad: torch.Tensor):
    """Forward ``fq(linear(x, w))``, backward ``grad``; (output, dx, dw, wrote over the
    linear's output)."""
    w.grad = x.grad = None
    h = F.linear(x, w)
    where = h.data_ptr()
    y = fq(h, overwrite=overwrite)
    over = y.data_ptr() == where
    (y * grad).sum().backward()
    return y.detach().clone(), x.grad.clone(), w.grad.clone(), over


@needs_ext
@EVERY_ISA
@BOTH_DTYPES
def test_writing_over_the_input_gives_the_same_bits(monkeypatch, isa: str,
                                                    dtype: torch.dtype) -> None:
    """Output, both gradients and the pending statistics match the new-output path bit
    for bit, on every kernel variant, float32 and bfloat16, odd widths (vector tails)."""
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    for seed, width in ((0, 37), (1, 64), (2, 5)):
        w, x = _layer(dtype, seed, width)
        g = torch.Generator().manual_seed(seed + 10)
        grad = (torch.randn(3, 11, width, generator=g) * 3).to(dtype)
        a, b = _quantizer(dtype), _quantizer(dtype)
        # the step's qparams, fixed until apply_pending
        _same_as_new_and_formula(_run(a, w, x, False, grad), _run(b, w, x, True, grad), a, w,
                                 x, dtype)
        for u, v in zip(a.pending_stats(), b.pending_stats()):
            assert torch.equal(u, v)


@needs_ext
@EVERY_ISA
@BOTH_DTYPES
def test_a_frozen_quantizer_writes_over_its_input_with_the_same_bits(monkeypatch, isa: str,
                                                                     dtype: torch.dtype) -> None:
    """Fixed qparams (observers off: frozen, calibrated): the training forward writes over
    the input, the evaluation forward never does; both give the new-output path's bits."""
    monkeypatch.setenv("QCOMPILE_FQ_ISA", isa)
    w, x = _layer(dtype, 6, 40)
    grad = (torch.randn(3, 11, 40, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
    a, b = _quantizer(dtype), _quantizer(dtype)
    for q in (a, b):
        q.observe = False
    _same_as_new_and_formula(_run(a, w, x, False, grad), _run(b, w, x, True, grad), a, w, x,
                             dtype)
    b.eval()
    with torch.no_grad():
        h = F.linear(x, w)
        before = h.clone()
        assert b(h, overwrite=True).data_ptr() != h.data_ptr() and torch.equal(h, before)


def _hooked(fq: FakeQuantize) -> None:
    fq.register_forward_pre_hook(lambda m, args: None)


@needs_ext
@pytest.mark.parametrize("case", ["module_hook", "global_hook", "view_kept", "storage_kept",
                                  "saved_by_relu", "leaf_input", "not_marked", "eval",
                                  "no_grad"])
def test_the_input_is_left_alone_when_something_can_read_it(case: str) -> None:
    """Each thing that could read the input after the call keeps the quantizer writing a
    new output, and the input keeps its values."""
    w, x = _layer(torch.float32, 3)
    fq = _quantizer(torch.float32)
    handle = None
    if case == "module_hook":
        _hooked(fq)
    elif case == "global_hook":
        handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    if case == "eval":
        fq.eval()
    try:
        with torch.set_grad_enabled(case != "no_grad"):
            h = F.linear(x, w)
            keep = None
            if case == "view_kept":
                keep = h.view(-1)
            elif case == "storage_kept":
                keep = h.untyped_storage()
            elif case == "saved_by_relu":
                h = torch.relu(h)  # relu's backward reads its output
            elif case == "leaf_input":
                h = h.detach().requires_grad_(True)
            before = h.detach().clone()
            y = fq(h, overwrite=case != "not_marked")
    finally:
        if handle is not None:
            handle.remove()
    assert y.data_ptr() != h.data_ptr()
    assert torch.equal(h.detach(), before)
    del keep


@needs_ext
def test_an_input_autograd_kept_fails_loudly_not_silently() -> None:
    """An input some other operation saved for its backward (a graph edited after
    qcompile, so a marked call's input has another reader): the version check refuses
    the backward instead of computing with the new values."""
    w, x = _layer(torch.float32, 4)
    fq = _quantizer(torch.float32)
    h = F.linear(x, w)
    other = h * h  # saves h itself
    y = fq(h, overwrite=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (other.sum() + y.sum()).backward()


@needs_ext
@BOTH_DTYPES
def test_a_residual_sums_gradient_is_not_masked_for_both_inputs(dtype: torch.dtype) -> None:
    """``y = fq(2 h) + h``: the sum's backward hands one gradient tensor to both inputs.
    The quantizer masks its own copy; h's other path gets the gradient unmasked. Checked
    against the same graph with the quantizer's mask applied by hand."""
    w, x = _layer(dtype, 5)
    fq = _quantizer(dtype)
    h = F.linear(x, w)
    y = fq(h * 2, overwrite=True) + h
    y.pow(2).sum().backward()
    dx, dw = x.grad.clone(), w.grad.clone()
    # reference: the straight-through mask from the step's qparams, by formula
    x.grad = w.grad = None
    s, z = float(fq.scale), float(fq.zero_point)
    h = F.linear(x, w)
    q = torch.round((h * 2).detach().float() / s) + z
    inside = ((q >= 0) & (q <= 255)).to(dtype)
    fq_out = ((torch.clamp(q, 0, 255) - z) * s).to(dtype)
    y = (fq_out + (h * 2 - (h * 2).detach()) * inside) + h
    y.pow(2).sum().backward()
    assert _same_bits(dx, x.grad) and _same_bits(dw, w.grad)


class _Attention(nn.Module):
    """A pre-norm attention + MLP block written out (fx traces it): Linear outputs on 3-D
    inputs (views), batched matmuls, residual sums."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).chunk(3, -1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(x)))


class _ReluBlock(nn.Module):
    """Pre-norm residual Linear + ReLU: the group's quantizer reads the ReLU's output,
    which the ReLU's backward reads (never written over)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.ln(x)))


def _unmarked(gm):
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            for n in m.graph.nodes:
                if n.kwargs.get("overwrite"):
                    n.kwargs = {}
            m.recompile()
    return gm


@needs_ext
def test_a_compiled_block_trains_the_same_with_and_without_overwriting() -> None:
    """int8-qat on attention blocks and a Linear + ReLU block: three steps of two
    micro-batches give the same losses, weights and qparams whether the marked calls
    write over their inputs or not; and they do write over them (their operator
    allocates only masks)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Attention(), _ReluBlock(), _Attention())
    x, target = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["train"]["check_finite"] = 0  # the checks take the general path: not from step 1
    over = qc.qcompile(copy.deepcopy(model), spec, (x,))
    marked = [n.name for n in over.graph.nodes if n.kwargs.get("overwrite")]
    assert len(marked) >= 10, marked
    runs = []
    for gm in (over, _unmarked(copy.deepcopy(over))):
        opt = torch.optim.SGD(gm.parameters(), lr=0.05)
        losses = [qc.distributed.train_step(gm, opt, x, target, F.mse_loss, accumulate=2)
                  for _ in range(3)]
        runs.append((losses, gm.state_dict()))
    (la, sa), (lb, sb) = runs
    assert [float(v) for v in la] == [float(v) for v in lb]
    for key, a in sa.items():
        assert torch.equal(a, sb[key]), key
    # frozen observers (the last steps of a QAT run): the same, through fake_quant, and
    # the marked calls take the writing-over operator
    runs = []
    for gm in (over, _unmarked(copy.deepcopy(over))):
        gm = qc.freeze(copy.deepcopy(gm))
        opt = torch.optim.SGD(gm.parameters(), lr=0.05)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            losses = [qc.distributed.train_step(gm, opt, x, target, F.mse_loss)
                      for _ in range(2)]
        names = {e.key for e in prof.key_averages()}
        assert ("qcompile::fake_quant_overwrite" in names) == (len(runs) == 0), names
        runs.append(losses + list(gm.state_dict().values()))
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(*runs))
    allocated = {}
    for gm in (over, _unmarked(copy.deepcopy(over))):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            gm(x).sum().backward()
        allocated[gm is over] = sum(e.self_cpu_memory_usage for e in prof.key_averages()
                                    if e.key.startswith("qcompile::fake_quant_minmax"))
    # what is left: the marked calls' masks (a bit per element) and the unmarked calls
    assert allocated[True] < allocated[False] / 4, allocated


@needs_ext
def test_the_value_recorder_of_qc_sqnr_keeps_every_input() -> None:
    """``qc.sqnr``'s recorder keeps every node's value: in a training forward too, the
    marked quantizers write new outputs there."""
    from qcompile.measure import _Record

    torch.manual_seed(0)
    x = torch.randn(2, 4, 16)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["train"]["check_finite"] = 0
    gm = qc.qcompile(_Attention(), spec, (x,))
    gm(x).sum().backward()
    for q in qc.quantizers(gm).values():
        q.apply_pending()
    record = _Record(gm)
    record.run(x)
    marked = [n for n in gm.graph.nodes if n.kwargs.get("overwrite")]
    assert marked
    for n in marked:
        source, out = record.values[n.args[0].name], record.values[n.name]
        assert source.data_ptr() != out.data_ptr(), n.name
        assert not torch.equal(source, out), n.name  # the float input, kept as it was
