"""Step updates (``quant.observer_update: step``): a training step's activation
statistics are gathered over its forwards and applied once, after ``optimizer.step()``."""

from __future__ import annotations

import copy
import io

import pydantic
import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.runtime.fake_quant import FakeQuantize


def step_fq(observer: str = "minmax") -> FakeQuantize:
    return FakeQuantize("uint8", symmetric=False, observer=observer, per_example=True,
                        update="step")


def test_a_training_forward_defers_and_apply_pending_folds_the_step_once():
    fq = step_fq("moving_average")  # momentum 0.01: one update per step is visible
    a, b = torch.randn(4, 8) - 1, torch.randn(4, 8) + 1
    for x in (a, b):
        out = fq(x.requires_grad_(True))
        assert torch.equal(out, x)  # no statistics yet: passed through
    assert torch.isinf(fq.observer.min_val).all()  # nothing applied yet
    assert fq.apply_pending()
    both = torch.cat([a, b]).detach()
    # the first update of a moving average takes the step's min / max as they are
    assert float(fq.observer.min_val) == float(both.min())
    assert float(fq.observer.max_val) == float(both.max())
    assert not fq.apply_pending()  # applied once
    c = torch.randn(4, 8) * 3
    scale = fq.scale.clone()
    out = fq(c.requires_grad_(True))
    assert torch.equal(fq.scale, scale)  # this step quantizes with the last step's qparams
    steps = (out / scale).detach()
    assert torch.allclose(steps, steps.round(), atol=1e-3)
    fq.apply_pending()
    m = fq.observer.momentum
    expect = float(both.min()) + m * (float(c.min()) - float(both.min()))
    assert float(fq.observer.min_val) == pytest.approx(expect, rel=1e-6)


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_evaluation_and_no_grad_forwards_observe_at_once(how):
    fq = step_fq()
    x = torch.randn(16)
    if how == "eval":
        fq.eval()
        fq(x)
    else:
        with torch.no_grad():
            fq(x)
    assert fq.pending_stats() is None
    assert float(fq.observer.min_val) == float(x.min())


def test_weights_and_histograms_are_never_deferred():
    w = FakeQuantize("int8", granularity="per_channel", axis=0, channels=4, weight=True,
                     update="step")
    assert not w.deferred()
    assert not step_fq("histogram").deferred()
    assert step_fq("minmax").deferred() and step_fq("moving_average").deferred()


def test_pending_statistics_travel_with_the_module_and_its_state_dict():
    """A step's pending statistics: copied and pickled with the quantizer (a whole graph
    saved mid-step resumes the step), and in the state dict as its extra state, not as
    buffers (tests/qcompile/test_state_survives.py checks graphs); a device move drops
    them."""
    fq = step_fq()
    x = torch.randn(8, requires_grad=True)
    fq(x)
    assert fq.pending_stats() is not None
    assert set(fq.state_dict()) == set(step_fq().state_dict())
    assert "_extra_state" not in dict(fq.named_buffers())
    loaded = step_fq()
    loaded.load_state_dict(fq.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(loaded.pending_stats(), fq.pending_stats()))
    f = io.BytesIO()
    torch.save(fq, f)
    f.seek(0)
    for other in (copy.deepcopy(fq), torch.load(f, weights_only=False)):
        assert all(torch.equal(a, b) for a, b in zip(other.pending_stats(),
                                                      fq.pending_stats()))
    fq.to(torch.float64)
    assert fq.pending_stats() is None


def test_an_unknown_update_is_refused():
    with pytest.raises(qc.QCompileError, match="update"):
        FakeQuantize("int8", update="sometimes")
    with pytest.raises(pydantic.ValidationError, match="observer_update"):
        qc.CompileSpec.model_validate({"quant": {"mode": "qat", "observer_update": "x"}})


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


# drawn from their own generator: the global one's state at import depends on which test
# modules were imported before (and the comparisons below on the data)
_G = torch.Generator().manual_seed(1234)
X, Y = torch.randn(16, 6, generator=_G), torch.randn(16, 3, generator=_G)


def trained(update: str, accumulate: int, steps: int = 4) -> torch.fx.GraphModule:
    spec = qc.load_spec("int8-qat").model_dump()
    spec["quant"]["observer_update"] = update
    gm = qc.qcompile(mlp(), spec, (X,))
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    for _ in range(steps):
        qc.distributed.train_step(gm, opt, X, Y, nn.functional.mse_loss,
                                  accumulate=accumulate)
    return gm


def test_accumulated_micro_batches_equal_one_batch_with_step_updates():
    one, four = trained("step", 1), trained("step", 4)
    for (n, p), q in zip(one.named_parameters(), four.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)
    for n, q in qc.quantizers(one).items():
        assert torch.equal(q.zero_point, qc.quantizers(four)[n].zero_point), n
        torch.testing.assert_close(q.scale, qc.quantizers(four)[n].scale, rtol=1e-6, atol=0)


def test_with_forward_updates_they_differ():
    """The reference semantics: each micro-batch moves the observers on its own."""
    one, four = trained("forward", 1), trained("forward", 4)
    diff = max((p - q).abs().max().item() for p, q in zip(one.parameters(), four.parameters()))
    assert diff > 1e-5


def test_the_next_forward_after_an_optimizer_step_applies_and_freeze_does_too():
    gm = qc.qcompile(mlp(), "int8-qat", (X,))
    act = qc.quantizers(gm)["0.output_fake_quant"]
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    gm(X).sum().backward()
    gm(X).sum().backward()  # no step between: still the same step
    assert act.pending_stats() is not None and torch.isinf(act.observer.min_val).all()
    opt.step()
    gm(X).sum()  # the first forward after the step applies the last one's statistics
    assert torch.isfinite(act.observer.min_val).all()
    assert act.pending_stats() is not None  # ... and gathers its own
    qc.freeze(gm)
    assert act.pending_stats() is None and not act.observe
