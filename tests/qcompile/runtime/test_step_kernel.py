"""Step observer updates in one pass: a training forward of an activation quantizer with
``update="step"`` runs ``qcompile::fake_quant_minmax`` (its input read once: the fake-quant,
its straight-through mask and the min / max folded into the step's pending statistics).
It must give what the two passes give (the min / max into the pending statistics, then
the fake-quant; ``_one_pass_step = False``) and what the eager fallback gives, bit for bit:
outputs, gradients, pending statistics and the qparams they lead to."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.runtime import kernels, quant_math
from qcompile.runtime.fake_quant import FakeQuantize

needs_ext = pytest.mark.skipif(kernels.load() is None,
                               reason="no C++ kernels (QCOMPILE_NO_EXT=1 or no compiler)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape, strides and bits, NaN for NaN (whatever its payload)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(ints), b[~nan].view(ints))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Statistics: equal values (NaN for NaN; min / max may keep either zero's sign)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        ((a == b) | (a.isnan() & b.isnan())).all())


def _ops(fn) -> list[str]:
    """The qcompile operators ``fn()`` calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("qcompile::")]


# (granularity kwargs, input shape): odd lengths, row and column layouts, a transposed input
CASES = {
    "per_tensor": ({}, (5, 67)),
    "per_tensor_big": ({}, (65, 1009)),  # several threads' tasks
    "per_channel_1": ({"granularity": "per_channel", "axis": 1, "channels": 6}, (3, 6, 5, 7)),
    "per_channel_1_short": ({"granularity": "per_channel", "axis": 1, "channels": 6},
                            (3, 6, 2, 3)),
    "per_channel_last": ({"granularity": "per_channel", "axis": -1, "channels": 33},
                         (4, 9, 33)),
    "per_channel_transposed": ({"granularity": "per_channel", "axis": 0, "channels": 19},
                               "t(40, 19)"),
}


def _input(shape: object, gen: torch.Generator, dtype: torch.dtype,
           special: tuple[float, ...] = ()) -> torch.Tensor:
    """A batch, with ``special`` values at random places."""
    x = torch.randn((40, 19) if shape == "t(40, 19)" else shape, generator=gen) * 2
    idx = torch.randperm(x.numel(), generator=gen)[:len(special)]
    x.view(-1)[idx] = torch.tensor(special, dtype=x.dtype)
    x = x.to(dtype)
    return x.t() if shape == "t(40, 19)" else x  # transposed: not contiguous


def _quantizers(kind: str, observer: str, gen: torch.Generator, dtype: torch.dtype):
    """One quantizer taking the one pass, a copy taking the two passes, both calibrated on
    a narrower batch (so that training batches are clamped)."""
    kw, shape = CASES[kind]
    one = FakeQuantize("uint8", symmetric=False, observer=observer, per_example=True,
                       update="step", **kw)
    one.eval()
    one(_input(shape, gen, dtype) * 0.5)  # evaluation forwards observe at once
    one.train()
    two = copy.deepcopy(one)
    two.__dict__["_one_pass_step"] = False
    return one, two, shape


def _step(one: FakeQuantize, two: FakeQuantize, x: torch.Tensor, gen: torch.Generator):
    """A training forward and backward of both; the outputs and gradients must agree."""
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = one(xa), two(xb)
    grad = torch.randn(x.shape, generator=gen).to(x.dtype)
    ya.backward(grad)
    yb.backward(grad)
    assert _same_bits(ya, yb) and _same_bits(xa.grad, xb.grad)
    pa, pb = one.pending_stats(), two.pending_stats()
    assert _same_values(pa[0], pb[0]) and _same_values(pa[1], pb[1])
    return ya


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", sorted(CASES))
def test_one_pass_gives_what_two_passes_give(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(len(kind) * 7 + DTYPES.index(dtype))
    observer = "moving_average" if len(kind) % 2 else "minmax"
    one, two, shape = _quantizers(kind, observer, gen, dtype)
    x = _input(shape, gen, dtype)
    x.requires_grad_(True)
    ops = _ops(lambda: one(x))
    assert ops == ["qcompile::fake_quant_minmax"], ops  # one operator, one pass
    one.__dict__["_pending"] = None
    # micro-batch 1: finite; 2: with infinities, then the step's statistics applied
    inf = float("inf")
    for special in ((), (inf, -inf)):
        _step(one, two, _input(shape, gen, dtype, special), gen)
    assert one.apply_pending() and two.apply_pending()
    for a, b in ((one.observer.min_val, two.observer.min_val),
                 (one.observer.max_val, two.observer.max_val),
                 (one.scale, two.scale)):
        assert _same_values(a, b)
    assert torch.equal(one.zero_point, two.zero_point)
    # the next step quantizes with the new qparams; a NaN reaches its channel's statistics
    _step(one, two, _input(shape, gen, dtype, (float("nan"),)), gen)
    nan = one.pending_stats()[0].isnan()
    assert int(nan.sum()) == 1 and bool(one.pending_stats()[1].isnan()[nan].all())


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_without_kernels_the_eager_path_gives_the_same(monkeypatch: pytest.MonkeyPatch,
                                                      dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    one, eager, shape = _quantizers("per_channel_1", "minmax", gen, dtype)
    xs = [_input(shape, gen, dtype) for _ in range(2)]
    grads = [torch.randn(shape, generator=gen).to(dtype) for _ in xs]
    results = []
    for q, kernels_on in ((one, True), (eager, False)):
        if not kernels_on:  # FakeQuantize's checks and quant_math's
            monkeypatch.setattr(kernels, "available", lambda: False)
            monkeypatch.setattr(quant_math, "_fused", lambda *a: False)
        outs = []
        for x, g in zip(xs, grads):
            xl = x.clone().requires_grad_(True)
            y = q(xl)
            y.backward(g)
            outs += [y.detach(), xl.grad]
        results.append((outs, q.pending_stats()))
    (outs_a, pend_a), (outs_b, pend_b) = results
    assert all(_same_bits(a, b) for a, b in zip(outs_a, outs_b))
    assert all(_same_values(a, b) for a, b in zip(pend_a, pend_b))


@needs_ext
def test_first_step_and_disabled_quantizers_pass_inputs_through() -> None:
    """Until the observer has statistics, and while ``enabled`` is off, a training forward
    returns its input as it is and still gathers the step's statistics."""
    fq = FakeQuantize("uint8", symmetric=False, per_example=True, update="step")
    x = torch.randn(4, 9, requires_grad=True)
    assert fq(x) is x
    assert float(fq.pending_stats()[0]) == float(x.detach().min())
    fq.apply_pending()
    fq.enabled = False
    y = torch.randn(4, 9, requires_grad=True) * 5
    assert fq(y) is y
    assert float(fq.pending_stats()[1]) == float(y.detach().max())
    fq.enabled = True
    assert _ops(lambda: fq(y)) == ["qcompile::fake_quant_minmax"]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


@needs_ext
def test_a_compiled_graph_trains_the_same_and_saves_its_pending_statistics() -> None:
    """int8-qat (step updates, the default; the first steps check inputs for NaN): three
    steps of two micro-batches in one pass and in two give the same weights and qparams,
    and a state dict saved mid-step carries the same pending statistics."""
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    graphs, states = [], []
    for one_pass in (True, False):
        gm = qc.qcompile(_mlp(), "int8-qat", (x,))
        for q in qc.quantizers(gm).values():
            q.__dict__["_one_pass_step"] = one_pass
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        for _ in range(3):
            qc.distributed.train_step(gm, opt, x, y, nn.functional.mse_loss, accumulate=2)
        gm(x).sum().backward()  # mid-step: pending statistics
        f = io.BytesIO()
        torch.save(gm.state_dict(), f)  # before the other graph's optimizer steps
        f.seek(0)
        graphs.append(gm)
        states.append(torch.load(f, weights_only=True))
    one, two = graphs
    for (name, p), q in zip(one.named_parameters(), two.parameters()):
        assert torch.equal(p, q), name
    assert states[0].keys() == states[1].keys()
    for key, a in states[0].items():
        assert _same_values(a.float(), states[1][key].float()), key
    assert any(k.endswith("_extra_state") and v.numel() > 2 and v[1] == 1.0
               for k, v in states[0].items())  # pending statistics among them
