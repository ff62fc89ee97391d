"""Learnable (LSQ) scales: positive by construction (``scale_offset`` / ``scale_ref``,
``quant_math.learned_scale``), the chain-rule gradient, old state dicts, quality."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.quant_math import fake_quantize, learned_scale

pytestmark = pytest.mark.usefixtures("one_thread")


def _fq(granularity: str, channels: int = 1) -> FakeQuantize:
    kw = {"axis": 0, "channels": channels} if granularity == "per_channel" else {}
    return FakeQuantize("int8", granularity=granularity, learnable=True, **kw)


def _shaped(s: torch.Tensor, granularity: str) -> torch.Tensor:
    return s.view(-1, 1) if granularity == "per_channel" else s


# -- positivity -------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_scales_stay_positive_under_aggressive_training(granularity: str) -> None:
    """Adam lr 1e-2, 100 steps, a loss that pulls every scale down: every scale stays finite
    and positive, and the same run on a plain scale parameter does not (so the setting
    really drives scales through zero)."""
    torch.manual_seed(0)
    w0 = torch.randn(16, 32) * 0.05
    loss_of = lambda y, s: (y - 0.5 * w0).square().sum() + 10.0 * s.sum()  # noqa: E731

    fq = _fq(granularity, 16)
    w = nn.Parameter(w0.clone())
    fq(w.detach())  # the observer initialises the scale, then it is learned
    opt = torch.optim.Adam([w, fq.scale_offset], lr=1e-2)
    for _ in range(100):
        opt.zero_grad()
        loss_of(fq(w), fq.scale).backward()
        opt.step()
    s = fq.scale.detach()
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all()), s
    assert bool(torch.isfinite(fq(w)).all())

    # the plain parameterisation (the scale itself is the parameter) on the same run
    plain = nn.Parameter(fq.scale_ref.clone())
    w = nn.Parameter(w0.clone())
    opt = torch.optim.Adam([w, plain], lr=1e-2)
    zp = torch.zeros(plain.shape, dtype=torch.int32)
    for _ in range(100):
        opt.zero_grad()
        y = fake_quantize(w, _shaped(plain, granularity), _shaped(zp, granularity), -128, 127,
                          learnable=True)
        loss_of(y, plain).backward()
        opt.step()
    assert bool((plain.detach() <= 0).any()), "the run never pushed a plain scale below 0"


def test_issue_scenario_no_scale_goes_non_positive() -> None:
    """A QAT model with learnable per-channel weight and activation scales, Adam lr 1e-3,
    30 steps (where plain scale parameters went <= 0 by the dozen): none does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=gen)
    y = x[:, :4].argmax(1)
    spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
            "weight": {"dtype": "int8", "granularity": "per_channel", "learnable": True},
            "activation": {"dtype": "uint8", "symmetric": False, "learnable": True}}]}}
    gm = qc.qcompile(model, spec, (x[:2],))
    opt = torch.optim.Adam(gm.parameters(), lr=1e-3)
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(gm(x), y).backward()
        opt.step()
    scales = torch.cat([q.scale.detach() for q in qc.quantizers(gm).values()])
    assert scales.numel() == 32 + 32 + 4 + 3
    assert bool(torch.isfinite(scales).all()) and int((scales <= 0).sum()) == 0


# -- gradient ---------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_offset_gradient_is_the_chain_rule_of_the_lsq_scale_gradient(granularity: str) -> None:
    """d L / d scale_offset = (d scale / d offset) * (LSQ's scale gradient), both computed
    here in float64 from their definitions: LSQ (Esser et al. 2020) d out / d s =
    round(x/s) - x/s inside the range, q_clip - zp at the clip, times 1 / sqrt(N * Q_P);
    d s / d u = 1 above the reference, exp(u / ref) below it."""
    gen = torch.Generator().manual_seed(3)
    channels = 4 if granularity == "per_channel" else 1
    fq = _fq(granularity, channels)
    x = torch.randn(channels, 64, generator=gen)
    fq(x)  # initialise
    ref = fq.scale_ref.clone()
    offsets = torch.tensor([0.3, -0.5, -2.0, 0.0])[:channels] * ref
    with torch.no_grad():
        fq.scale_offset.copy_(offsets)
    g = torch.randn(channels, 64, generator=gen)
    fq(x).backward(g)

    u, c = offsets.double(), ref.double()
    s64 = torch.where(u > 0, c + u, c * torch.exp(u / c))
    s = fq.scale.detach()
    assert torch.allclose(s.double(), s64, rtol=1e-6, atol=0)
    s_e = _shaped(s, granularity).expand_as(x)
    xs = (x / s_e).double()  # float32 division, as the forward computes it
    q = torch.round(xs)
    inside = (q >= -128) & (q <= 127)
    dyds = torch.where(inside, q - xs, q.clamp(-128, 127))
    n = x.numel() // channels
    dims = 1 if granularity == "per_channel" else (0, 1)
    terms = g.double() * dyds
    dlds = terms.sum(dim=dims).reshape(-1) / math.sqrt(n * 127)
    mag = terms.abs().sum(dim=dims).reshape(-1) / math.sqrt(n * 127)
    dsdu = torch.where(u > 0, torch.ones_like(u), torch.exp(u / c))
    want = dsdu * dlds
    got = fq.scale_offset.grad.double()
    assert got.shape == fq.scale_offset.shape
    assert bool(((got - want).abs() <= 1e-5 * dsdu * mag + 1e-30).all()), (got, want)


def test_learned_scale_value_and_slope() -> None:
    """``learned_scale``: exactly the reference at offset 0 (where initialisation puts it),
    ``ref + u`` above, ``ref * exp(u / ref)`` below (float64 reference), slope 1 at 0 from
    both sides, and positive for offsets far below any underflow."""
    ref = torch.tensor([0.01, 0.5, 3.0, 1e-6])
    for u in ([0.0] * 4, [0.02, 0.1, 1.0, 1e-6], [-0.01, -1.0, -2.0, -5e-6]):
        ut = torch.tensor(u)
        want = np.where(np.array(u) > 0, ref.double().numpy() + np.array(u),
                        ref.double().numpy() * np.exp(np.array(u) / ref.double().numpy()))
        np.testing.assert_allclose(learned_scale(ut, ref).double().numpy(), want, rtol=1e-6)
    assert torch.equal(learned_scale(torch.zeros(4), ref), ref)
    huge = learned_scale(torch.full((4,), -1e6), ref)
    assert bool((huge > 0).all()) and bool(torch.isfinite(huge).all())
    for side in (1e-4, -1e-4):
        u = torch.full((4,), side) * ref
        u.requires_grad_(True)
        learned_scale(u, ref).sum().backward()
        np.testing.assert_allclose(u.grad.numpy(), 1.0, rtol=2e-4)


# -- setting and loading ------------------------------------------------------------------------
def test_every_setter_sets_the_reference() -> None:
    """The observer's first batch, set_qparams and reset_parameters put the offset at 0
    and the reference at the new scale (read back exactly)."""
    fq = _fq("per_channel", 3)
    x = torch.tensor([[1.0, -2.0], [0.5, 0.25], [-4.0, 3.0]])
    fq(x)
    assert torch.equal(fq.scale.detach(), torch.tensor([2.0, 0.5, 4.0]) / 127)
    assert torch.equal(fq.scale_offset.detach(), torch.zeros(3))
    with torch.no_grad():
        fq.scale_offset.fill_(-0.001)
    fq.set_qparams(torch.tensor([0.1, 0.2, 0.3]))
    assert torch.equal(fq.scale.detach(), torch.tensor([0.1, 0.2, 0.3]))
    assert torch.equal(fq.scale_offset.detach(), torch.zeros(3))
    with pytest.raises(qc.QCompileError, match="finite and positive"):
        fq.set_qparams(torch.tensor([0.1, 0.0, 0.3]))
    assert torch.equal(fq.scale.detach(), torch.tensor([0.1, 0.2, 0.3]))
    fq.reset_parameters()
    assert torch.equal(fq.scale.detach(), torch.ones(3))


def _old_format(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as saved when the learnable scale was itself the parameter."""
    out = {}
    for k, v in sd.items():
        if k.endswith("scale_offset"):
            continue
        if k.endswith("scale_ref"):
            k = k[: -len("scale_ref")] + "scale"
        out[k] = v
    return out


def test_old_state_dict_with_scale_loads() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
            "weight": {"dtype": "int8", "learnable": True}}]}}
    x = torch.randn(4, 8)
    gm = qc.qcompile(model, spec, (x,))
    old = _old_format(gm.state_dict())
    name = next(k for k in old if k.endswith("weight_fake_quant.scale"))
    old[name] = torch.tensor([0.0123])
    twin = qc.qcompile(model, spec, (x,))
    result = twin.load_state_dict(old)  # strict: every key maps
    assert not result.missing_keys and not result.unexpected_keys
    fq = twin.get_submodule(name.rpartition(".")[0])
    assert torch.equal(fq.scale.detach(), torch.tensor([0.0123]))
    assert torch.equal(fq.scale_offset.detach(), torch.zeros(1))
    # and the new format round-trips exactly, offsets included
    with torch.no_grad():
        fq.scale_offset.fill_(-0.004)
    again = qc.qcompile(model, spec, (x,))
    again.load_state_dict(twin.state_dict())
    assert torch.equal(again.get_submodule(fq_name := name.rpartition(".")[0]).scale,
                       twin.get_submodule(fq_name).scale)


@pytest.mark.parametrize("bad", [-0.5, 0.0, float("nan"), float("inf")])
def test_non_positive_loaded_scale_is_refused(bad: float) -> None:
    fq = _fq("per_channel", 2)
    fq(torch.randn(2, 8))
    before = {k: v.clone() for k, v in fq.state_dict().items()}
    old = _old_format({f"layer.q.{k}": v for k, v in fq.state_dict().items()})
    old["layer.q.scale"] = torch.tensor([0.1, bad])
    host = nn.Module()
    host.layer = nn.Module()
    host.layer.q = fq
    with pytest.raises(qc.QCompileError) as info:
        host.load_state_dict(old)
    msg = str(info.value)
    assert "layer.q.scale" in msg and "positive" in msg and "fix:" in msg
    assert all(torch.equal(v, before[k]) for k, v in fq.state_dict().items())


def test_learnable_state_dict_loads_into_a_fixed_scale_quantizer() -> None:
    """A trained LSQ checkpoint loads into a fixed-scale quantizer as the learned values."""
    lsq = _fq("per_channel", 2)
    lsq(torch.randn(2, 8))
    with torch.no_grad():
        lsq.scale_offset.copy_(torch.tensor([0.01, -0.02]))
    fixed = FakeQuantize("int8", granularity="per_channel", axis=0, channels=2)
    fixed.load_state_dict(lsq.state_dict())
    assert torch.equal(fixed.scale, lsq.scale.detach())


# -- quality --------------------------------------------------------------------------------------
def _train(parameterised: bool, opt_name: str, lr: float, steps: int) -> tuple[float, int]:
    """A 2-layer MLP with LSQ per-channel weight scales, the scale a plain parameter
    (``parameterised=False``, as before) or ``learned_scale(offset, ref)``; final loss and
    the number of non-positive scales."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=gen)
    y = (x[:, :4] + 0.3 * x[:, 4:8]).argmax(1)
    ws = [nn.Parameter(torch.randn(32, 16, generator=gen) * 0.25),
          nn.Parameter(torch.randn(4, 32, generator=gen) * 0.18)]
    refs = [w.detach().abs().amax(dim=1) / 127 for w in ws]
    raw = [nn.Parameter(torch.zeros_like(r) if parameterised else r.clone()) for r in refs]
    zps = [torch.zeros(r.shape, dtype=torch.int32).view(-1, 1) for r in refs]

    def scales() -> list[torch.Tensor]:
        return [learned_scale(p, r) if parameterised else p for p, r in zip(raw, refs)]

    def forward() -> torch.Tensor:
        h = x
        for i, (w, s, z) in enumerate(zip(ws, scales(), zps)):
            h = h @ fake_quantize(w, s.view(-1, 1), z, -128, 127, learnable=True).t()
            h = torch.relu(h) if i == 0 else h
        return F.cross_entropy(h, y)

    kind = torch.optim.Adam if opt_name == "adam" else torch.optim.SGD
    opt = kind([*ws, *raw], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        forward().backward()
        opt.step()
    with torch.no_grad():
        return forward().item(), int(sum(int((s <= 0).sum()) for s in scales()))


@pytest.mark.parametrize(("opt_name", "lr"), [("adam", 1e-3), ("sgd", 0.05)])
def test_training_quality_matches_a_plain_scale(opt_name: str, lr: float) -> None:
    """The issue's optimizer and lr (and SGD as in the LSQ paper): the final loss is within
    2% of a plain scale parameter's on the same run (measured: equal to 0.3%), with no
    scale <= 0 (the plain run has some)."""
    plain_loss, plain_bad = _train(False, opt_name, lr, 40)
    loss, bad = _train(True, opt_name, lr, 40)
    assert bad == 0 and plain_bad > 0
    assert loss <= plain_loss * 1.02 + 1e-4, (loss, plain_loss)


def test_aggressive_training_stays_positive_and_learns() -> None:
    """Adam lr 1e-2 (a plain scale goes <= 0 within steps): no scale does, and the loss
    falls well below its start. (Plain runs end lower here only because a negative scale
    still quantizes a symmetric grid, mirrored; an asymmetric one it would break.)"""
    start, _ = _train(True, "adam", 1e-2, 0)
    _, plain_bad = _train(False, "adam", 1e-2, 40)
    loss, bad = _train(True, "adam", 1e-2, 40)
    assert plain_bad > 0 and bad == 0
    assert math.isfinite(loss) and loss < 0.5 * start, (loss, start)


def test_pickled_learnable_quantizer_from_before_loads() -> None:
    """A quantizer pickled when the learnable scale was itself the parameter unpickles
    with that scale as its reference (offset 0)."""
    fq = _fq("per_channel", 2)
    state = fq.__getstate__()
    state["_parameters"] = {"scale": nn.Parameter(torch.tensor([0.25, 0.5]))}
    state["_buffers"] = {k: v for k, v in state["_buffers"].items() if k != "scale_ref"}
    old = FakeQuantize.__new__(FakeQuantize)
    old.__setstate__(state)
    assert torch.equal(old.scale.detach(), torch.tensor([0.25, 0.5]))
    assert [n for n, _ in old.named_parameters()] == ["scale_offset"]
