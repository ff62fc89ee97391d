"""The weight fake-quant cache (``FakeQuantize.reuse_weight``, ``qcompile.runtime.weight_cache``):
computed once per optimizer step, reused by further forwards, invalidated by every change
it depends on, gradients bit-identical to the uncached path."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.optim.optimizer as optim_mod
from torch import nn

import qcompile as qc
import qcompile.runtime.fake_quant as fq_mod
from qcompile.distributed.data_parallel import train_step
from qcompile.runtime import weight_cache
from qcompile.runtime.fake_quant import FakeQuantize

SCHEMES = {
    "per_tensor": {},
    "per_channel": {"granularity": "per_channel", "axis": 0, "channels": 32},
    "int4_per_group": {"dtype": "int4", "granularity": "per_group", "group_size": 16,
                       "channels": 32 * 64 // 16},
}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts fake-quant computations (quant_math's entry points, as FakeQuantize calls
    them, and the fused observe-and-fake-quant call)."""
    n = [0]
    for name in ("fake_quantize", "fake_quantize_fp8"):
        real = getattr(fq_mod, name)

        def counted(*args, _real=real, **kwargs):
            n[0] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fq_mod, name, counted)
    fused = fq_mod.FakeQuantize._observe_fake_quant

    def counted_fused(self, x):
        out = fused(self, x)
        n[0] += out is not None
        return out

    monkeypatch.setattr(fq_mod.FakeQuantize, "_observe_fake_quant", counted_fused)
    return n


def make_fq(scheme: str = "per_channel", *, learnable: bool = False, reuse: bool = True,
            observe: bool = False) -> FakeQuantize:
    kw = dict(SCHEMES[scheme])
    fq = FakeQuantize(kw.pop("dtype", "int8"), learnable=learnable, **kw)
    fq.reuse_weight = reuse
    if not observe and not learnable:
        fq(torch.randn(32, 64))  # initialise the scales from a plain tensor (not cached)
        fq.observe = False
    return fq


def uncached(fq: FakeQuantize, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        ref = copy.deepcopy(fq)
        ref.reuse_weight = False
        ref.observe = False
        return ref(w.detach().clone())


# -- reuse ----------------------------------------------------------------------------------
def test_forwards_between_steps_compute_once(calls: list[int]) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    fq = make_fq()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    calls[0] = 0
    for step in range(3):
        opt.zero_grad()
        outs = [fq(lin.weight) for _ in range(4)]
        for out in outs:
            assert torch.equal(out, outs[0])
        assert len({o.grad_fn for o in outs}) == 4  # an autograd node per forward
        for i, out in enumerate(outs):  # each backpropagates alone, no retain_graph
            (out * (i + 1)).sum().backward()
        opt.step()
        # step 0: the forward, then the mask on first reuse; later steps: one computation
        assert calls[0] == (2 if step == 0 else 1), step
        calls[0] = 0


def test_reuse_weight_false_and_activations_never_cache(calls: list[int]) -> None:
    w = nn.Parameter(torch.randn(32, 64))
    off = make_fq(reuse=False)
    calls[0] = 0
    for _ in range(3):
        off(w)
    assert calls[0] == 3
    fq = make_fq()
    x = torch.randn(32, 64, requires_grad=True)
    calls[0] = 0
    for _ in range(3):
        fq(x)          # a leaf activation, not a parameter
        fq(x * 1.0)    # a computed activation
        fq(w.detach())  # a tensor sharing a parameter's storage
    assert calls[0] == 9
    assert fq.__dict__.get(weight_cache.ATTR) is None


def test_observers_that_are_not_idempotent_do_not_cache(calls: list[int]) -> None:
    w = nn.Parameter(torch.randn(32, 64))
    fq = FakeQuantize("int8", observer="moving_average")
    calls[0] = 0
    for _ in range(3):
        fq(w)
    assert calls[0] == 3
    fq.observe = False  # frozen: now cached
    calls[0] = 0
    for _ in range(3):
        fq(w)
    assert calls[0] == 2  # the forward, then the mask on first reuse


def test_minmax_observer_skips_reobserving_the_same_weight(calls: list[int]) -> None:
    w = nn.Parameter(torch.randn(32, 64))
    fq = FakeQuantize("int8", granularity="per_channel", axis=0, channels=32)
    assert fq.observe
    calls[0] = 0
    with torch.no_grad():
        a = fq(w)
        b = fq(w)
    assert calls[0] == 1 and torch.equal(a, b)
    mn = fq.observer.min_val.clone()
    fq.observer.reset()  # the statistics changed: observe again
    with torch.no_grad():
        c = fq(w)
    assert calls[0] == 2 and torch.equal(c, a) and torch.equal(fq.observer.min_val, mn)


# -- invalidation -----------------------------------------------------------------------------
@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    lambda p: torch.optim.SGD(p, lr=0.1, foreach=True),
    lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
], ids=["sgd", "sgd_foreach", "adam_foreach", "adamw_fused", "sgd_fused"])
def test_optimizer_step_invalidates(make_opt) -> None:
    """Fused optimizers do not bump the parameters' versions: the step count does it."""
    lin = nn.Linear(64, 32)
    fq = make_fq()
    opt = make_opt(lin.parameters())
    for _ in range(3):
        out = fq(lin.weight)
        assert torch.equal(out, uncached(fq, lin.weight))
        out.sum().backward()
        opt.step()
        assert torch.equal(fq(lin.weight), uncached(fq, lin.weight))


def test_writes_and_switches_invalidate(calls: list[int]) -> None:
    w = nn.Parameter(torch.randn(32, 64))
    fq = make_fq()

    def check(expect_compute: bool) -> None:
        before = calls[0]
        with torch.no_grad():
            out = fq(w)
        assert (calls[0] > before) == expect_compute
        assert torch.equal(out, uncached(fq, w))

    check(True)
    check(False)
    with torch.no_grad():
        w.mul_(1.5)          # in-place write to the weight
    check(True)
    with torch.no_grad():
        fq.scale.mul_(2)     # in-place write to the scale
    check(True)
    with torch.no_grad():
        fq.zero_point.add_(0)
    check(True)
    fq.refresh_qparams()     # qparams rewritten through .data (no version bump)
    check(True)
    fq.enabled = False
    with torch.no_grad():
        assert fq(w) is w
    fq.enabled = True
    check(True)
    fq.observe = True        # observe on (minmax): re-observed once
    check(True)
    check(False)
    qc.freeze(nn.ModuleList([fq]))  # observe off
    check(True)
    fq.load_state_dict(fq.state_dict())
    check(True)
    with torch.no_grad():
        out = fq(w)
        out.add_(1)          # an in-place write to a returned tensor
    check(True)
    w.data.mul_(0.5)         # invisible to autograd's version counter: clear by hand
    fq.clear_weight_cache()
    check(True)
    with torch.no_grad():
        w.data = torch.randn(32, 64)  # new storage
    check(True)
    w2 = nn.Parameter(w.detach().clone())  # another parameter, same values
    before = calls[0]
    with torch.no_grad():
        fq(w2)
    assert calls[0] == before + 1


def test_dtype_and_device_changes_invalidate(calls: list[int]) -> None:
    lin = nn.Linear(64, 32)
    fq = make_fq()
    with torch.no_grad():
        fq(lin.weight)
    fq.double()  # drops the entry (buffers converted)
    assert fq.__dict__.get(weight_cache.ATTR) is None
    lin.to(torch.bfloat16)
    fq.float()
    with torch.no_grad():
        out = fq(lin.weight)
    assert out.dtype == torch.bfloat16 and torch.equal(out, uncached(fq, lin.weight))


def test_learnable_scale_step_invalidates(calls: list[int]) -> None:
    lin = nn.Linear(64, 32)
    fq = make_fq("per_channel", learnable=True)
    opt = torch.optim.SGD([*lin.parameters(), *fq.parameters()], lr=0.1)
    fq(lin.weight)  # observes once, then the scale is learned
    assert not fq.observe
    opt.zero_grad()
    with torch.no_grad():
        a = fq(lin.weight)
    fq(lin.weight).sum().backward()
    opt.step()  # moves the weight and the scale
    with torch.no_grad():
        b = fq(lin.weight)
    assert not torch.equal(a, b) and torch.equal(b, uncached(fq, lin.weight))


# -- exact gradients ----------------------------------------------------------------------------
def _accumulate(reuse: bool, scheme: str, learnable: bool, dtype: torch.dtype = torch.float32,
                steps: int = 3, micro: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(dtype)
    kw = dict(SCHEMES[scheme])
    fq = FakeQuantize(kw.pop("dtype", "int8"), learnable=learnable, **kw)
    fq.reuse_weight = reuse
    params = [*lin.parameters(), *fq.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    xs = torch.randn(steps, micro, 8, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    seen = []
    for s in range(steps):
        opt.zero_grad()
        for i in range(micro):
            y = F.linear(xs[s, i], fq(lin.weight), lin.bias)
            (y.float().square().mean() / micro).backward()
        seen += [p.grad.clone() for p in params]
        opt.step()
    return seen + [p.detach().clone() for p in params] + [fq.scale.detach().clone()]


@pytest.mark.parametrize("learnable", [False, True], ids=["fixed", "lsq"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_accumulated_gradients_equal_uncached(scheme: str, learnable: bool) -> None:
    ref = _accumulate(False, scheme, learnable)
    got = _accumulate(True, scheme, learnable)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_bfloat16_weights_gradients_equal_uncached() -> None:
    for a, b in zip(_accumulate(False, "per_channel", False, torch.bfloat16),
                    _accumulate(True, "per_channel", False, torch.bfloat16)):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_non_contiguous_and_other_dtypes_gradients_equal_uncached(dtype: torch.dtype) -> None:
    def run(reuse: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        w = nn.Parameter((torch.randn(64, 32) * 2).to(dtype).t())  # [32, 64], transposed
        fq = make_fq("per_channel")
        with torch.no_grad():
            fq.scale.mul_(0.25)  # some values clipped
        fq.reuse_weight = reuse
        upstream = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
        for i in range(3):
            fq(w).backward(upstream[:, :] * (i + 1))
        return [w.grad, fq(w).detach()]

    for a, b in zip(run(False), run(True)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_fp8_gradients_equal_uncached() -> None:
    def run(reuse: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(32, 64))
        fq = FakeQuantize("fp8_e4m3")
        fq.reuse_weight = reuse
        for i in range(3):
            (fq(w) * (i + 1)).sum().backward()
        return [w.grad, fq(w).detach()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_backward_order_and_partial_backward() -> None:
    w = nn.Parameter(torch.randn(32, 64) * 3)
    fq = make_fq("per_tensor")
    with torch.no_grad():
        fq.scale.fill_(0.01)  # many values clipped: a non-trivial mask
    outs = [fq(w) for _ in range(3)]
    outs[2].sum().backward()
    outs[0].sum().backward()  # out of order; outs[1] never backpropagated
    ref = w.detach().clone().requires_grad_(True)
    off = make_fq("per_tensor", reuse=False)
    off.load_state_dict(fq.state_dict())
    (off(ref).sum() * 2).backward()
    assert torch.equal(w.grad, ref.grad)
    assert 0 < int((w.grad == 0).sum()) < w.numel()


def _checkpointed(reuse: bool, learnable: bool, mode: str) -> list[torch.Tensor]:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    fq = FakeQuantize("int8", granularity="per_channel", axis=0, channels=32,
                      learnable=learnable)
    fq.reuse_weight = reuse
    params = [*lin.parameters(), *fq.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)

    def block(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fq(lin.weight), lin.bias).relu()

    xs = torch.randn(3, 3, 8, 64, generator=torch.Generator().manual_seed(1))
    seen = []
    for s in range(3):
        opt.zero_grad()
        for i in range(3):
            x = xs[s, i].clone().requires_grad_(True)
            if mode == "plain":
                y = block(x)
            elif mode == "offload":
                with torch.autograd.graph.save_on_cpu():
                    y = block(x)
            else:
                y = checkpoint(block, x, use_reentrant=mode == "reentrant")
            y.square().mean().backward()
            seen.append(x.grad)
        seen += [p.grad.clone() for p in params]
        opt.step()
    return seen


@pytest.mark.parametrize("learnable", [False, True], ids=["fixed", "lsq"])
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant", "offload"])
def test_activation_checkpointing_and_saved_tensor_hooks(mode: str, learnable: bool) -> None:
    """Non-reentrant checkpointing matches the tensors saved by the forward with those of
    its recomputation (which hits the cache): both must save alike."""
    ref = _checkpointed(False, learnable, "plain")
    for a, b in zip(ref, _checkpointed(True, learnable, mode), strict=True):
        assert torch.equal(a, b)


# -- eval, no_grad, frozen weights -----------------------------------------------------------
def test_no_grad_and_inference_mode_reuse(calls: list[int]) -> None:
    w = nn.Parameter(torch.randn(32, 64))
    fq = make_fq()
    calls[0] = 0
    with torch.no_grad():
        a = fq(w)
    with torch.inference_mode():
        b = fq(w)
    assert calls[0] == 1 and not a.requires_grad and not b.is_inference()
    assert torch.equal(a, b)
    out = fq(w)  # with gradients: same values, mask computed now, exact gradient
    out.sum().backward()
    ref = w.detach().clone().requires_grad_(True)
    off = copy.deepcopy(fq)
    off.reuse_weight = False
    off(ref).sum().backward()
    assert torch.equal(w.grad, ref.grad) and torch.equal(out, a)
    with torch.inference_mode():  # an entry made in inference mode is a normal tensor
        fq.clear_weight_cache()
        fq(w)
    fq(w).sum().backward()


def test_frozen_weight_is_cached_without_autograd(calls: list[int]) -> None:
    w = nn.Parameter(torch.randn(32, 64), requires_grad=False)
    fq = make_fq()
    calls[0] = 0
    outs = [fq(w) for _ in range(3)]
    assert calls[0] == 1 and all(o.grad_fn is None and not o.requires_grad for o in outs)
    assert fq.__dict__[weight_cache.ATTR].mask is None


# -- module hygiene --------------------------------------------------------------------------------
def test_state_dict_copy_pickle_and_no_graphs_kept() -> None:
    lin = nn.Linear(64, 32)
    fq = make_fq()
    keys = list(fq.state_dict())
    before = {k: v.clone() for k, v in fq.state_dict().items()}
    fq(lin.weight).sum().backward()
    fq(lin.weight).sum().backward()
    entry = fq.__dict__[weight_cache.ATTR]
    assert entry is not None and entry.mask is not None and entry.mask.dtype == torch.bool
    assert entry.out.grad_fn is None and not entry.out.requires_grad  # detached only
    assert list(fq.state_dict()) == keys
    assert all(torch.equal(v, before[k]) for k, v in fq.state_dict().items())
    dup = copy.deepcopy(fq)
    assert dup.__dict__.get(weight_cache.ATTR) is None and dup.reuse_weight
    assert torch.equal(dup(lin.weight), fq(lin.weight))
    buf = io.BytesIO()
    torch.save(fq, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.__dict__.get(weight_cache.ATTR) is None
    assert pickle.loads(pickle.dumps(fq)).__dict__.get(weight_cache.ATTR) is None
    fq.reuse_weight = False
    assert copy.deepcopy(fq).reuse_weight is False


def test_cache_does_not_keep_the_weight_alive() -> None:
    fq = make_fq()
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        fq(lin.weight)
    ref = weakref.ref(lin.weight)
    del lin
    gc.collect()
    assert ref() is None
    with torch.no_grad():  # a new parameter (perhaps at a reused address) is recomputed
        lin = nn.Linear(64, 32)
        assert torch.equal(fq(lin.weight), uncached(fq, lin.weight))


# -- compiled graphs ----------------------------------------------------------------------------
def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def test_qcompiled_graph_train_step_accumulate(calls: list[int]) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    runs = {}
    spec = qc.load_spec("int8-qat").model_dump()
    spec["quant"]["observer_update"] = "forward"  # activations fake-quantize from the start
    for reuse in (False, True):
        gm = qc.qcompile(mlp(), spec, (x[:4],))
        for q in qc.quantizers(gm).values():
            q.reuse_weight = reuse
        opt = torch.optim.SGD(gm.parameters(), lr=0.05)
        calls[0] = 0
        losses = [train_step(gm, opt, x, y, F.mse_loss, accumulate=4) for _ in range(3)]
        runs[reuse] = (losses, calls[0], copy.deepcopy(gm.state_dict()))
    (l0, n0, sd0), (l1, n1, sd1) = runs[False], runs[True]
    assert l0 == l1
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    names = list(qc.quantizers(gm))
    weights = sum(n.endswith("weight_fake_quant") for n in names)
    assert weights == 2 and len(names) > weights
    # 4 forwards x 3 steps; a weight is computed 2, 1, 1 times per step (the mask on the
    # first reuse, then with the forward); activations every time. Uncached, a weight's
    # copy is recomputed in backward where its layer needs it (train.recompute_weights):
    # the second layer's, not the first's (its input needs no gradient)
    assert n0 == len(names) * 12 + 12
    assert n1 == (len(names) - weights) * 12 + weights * (2 + 1 + 1)


def test_torch_compile_and_export_bypass_the_cache(calls: list[int]) -> None:
    x = torch.randn(4, 32)
    gm = qc.qcompile(mlp(), "int8-qat", (x,))
    qc.freeze(gm)
    with torch.no_grad():
        eager = gm(x)
        gm(x)  # the weight entries are populated
    compiled = torch.compile(gm, backend="aot_eager")
    assert torch.equal(compiled(x), eager)
    out = compiled(x)
    out.sum().backward()
    with torch.no_grad():  # the compiled graph fake-quantizes the new weights itself
        for p in gm.parameters():
            p.mul_(0.5)
        eager = gm(x)
    assert torch.equal(compiled(x), eager)

    ep = torch.export.export(gm, (x,), strict=False)
    assert not ep.constants  # no cached weight baked into the program
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    # 2 weights, 2 outputs, the model input (inputs: auto)
    assert sum("fake_quant" in o or "round" in o for o in ops) == 5
    exported = ep.module()
    assert torch.equal(exported(x), gm(x))


def test_dispatch_modes_bypass_the_cache(calls: list[int]) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    w = nn.Parameter(torch.randn(32, 64))
    fq = make_fq()
    with torch.no_grad():
        fq(w)
    calls[0] = 0
    with FlopCounterMode(display=False), torch.no_grad():
        fq(w)
        fq(w)
    assert calls[0] == 2


def run_python(code: str, timeout: float = 300) -> str:
    """Run ``code`` in a fresh interpreter (nothing imported or registered yet)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_fsdp2_bypasses_the_cache() -> None:
    """FSDP2 all-gathers each step's values into the same unsharded Parameter objects
    without bumping their versions: the cache must stay off once fully_shard is in use
    (for the rest of the process, so in a process of its own)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    out = run_python("""
        import tempfile
        import torch, torch.distributed as dist
        from torch import nn
        import qcompile as qc
        from qcompile.runtime import weight_cache

        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1),
                                rank=0, world_size=1)
        import torch.distributed.fsdp  # imported alone: nothing sharded yet
        from torch.distributed.fsdp import fully_shard

        def mlp():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
        ref = qc.qcompile(mlp(), "int8-qat", (x,))
        for q in qc.quantizers(ref).values():
            q.reuse_weight = False
        sharded = qc.qcompile(mlp(), "int8-qat", (x,))
        assert not weight_cache._fully_shard_used()
        sharded = fully_shard(sharded)
        assert weight_cache._fully_shard_used()
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, sharded)]
        for _ in range(3):
            outs = []
            for m, opt in zip((ref, sharded), opts):
                opt.zero_grad()
                for i in range(2):
                    out = m(x[4 * i:4 * i + 4])
                    out.square().mean().backward()
                outs.append(out.detach())
                opt.step()
            assert torch.equal(outs[0], outs[1])
        assert all(q.__dict__.get(weight_cache.ATTR) is None
                   for q in qc.quantizers(sharded).values())
        dist.destroy_process_group()
        print("ok")
    """)
    assert out.strip().endswith("ok")


# -- optimizer hooks: registered by the first forward using the cache, removable ----------------
def _hook_counts() -> tuple[int, int]:
    return (len(optim_mod._global_optimizer_pre_hooks),
            len(optim_mod._global_optimizer_post_hooks))


def test_import_registers_no_optimizer_hooks_first_forward_does() -> None:
    out = run_python("""
        import torch, torch.optim.optimizer as o

        def counts():
            return len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks)

        before = counts()
        import qcompile as qc, qcompile.runtime.weight_cache, qcompile.runtime.fake_quant
        import qcompile.distributed, qcompile.runtime
        from qcompile.runtime import weight_cache as wc
        assert counts() == before and not wc.step_hooks_installed(), counts()

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 16))
        x = torch.randn(4, 32)
        gm = qc.qcompile(model, "int8-qat", (x,))
        print("after compile", counts() != before)
        gm(x)                                  # a cacheable forward of a QAT graph
        gm(x)
        assert counts() == (before[0] + 1, before[1] + 1) and wc.step_hooks_installed()
        opt = torch.optim.SGD(gm.parameters(), lr=0.1, fused=True)
        gm(x).sum().backward()
        opt.step()
        assert counts() == (before[0] + 1, before[1] + 1)
        assert wc.remove_step_hooks() and counts() == before and not wc.step_hooks_installed()
        assert not wc.remove_step_hooks()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_remove_step_hooks_invalidates_and_the_next_forward_registers_again(
        calls: list[int]) -> None:
    lin = nn.Linear(64, 32)
    fq = make_fq()
    opt = torch.optim.SGD(lin.parameters(), lr=0.5, fused=True)  # no version bumps
    weight_cache.remove_step_hooks()
    base = _hook_counts()
    with torch.no_grad():
        fq(lin.weight)
    assert weight_cache.step_hooks_installed()
    assert _hook_counts() == (base[0] + 1, base[1] + 1)
    with torch.no_grad():
        fq(lin.weight)  # one pair of hooks, however many forwards
    assert _hook_counts() == (base[0] + 1, base[1] + 1)
    assert weight_cache.remove_step_hooks()
    assert _hook_counts() == base and not weight_cache.step_hooks_installed()
    version = lin.weight._version
    lin.weight.grad = torch.ones_like(lin.weight)
    opt.step()  # counted by nobody, and the weight's version is unchanged
    assert lin.weight._version == version
    calls[0] = 0
    with torch.no_grad():
        out = fq(lin.weight)  # an entry of the removed counter: recomputed
    assert calls[0] == 1
    assert torch.equal(out, uncached(fq, lin.weight))
    assert _hook_counts() == (base[0] + 1, base[1] + 1)
    lin.weight.grad = torch.ones_like(lin.weight)
    opt.step()  # counted again
    calls[0] = 0
    with torch.no_grad():
        out = fq(lin.weight)
        fq(lin.weight)
    assert calls[0] == 1
    assert torch.equal(out, uncached(fq, lin.weight))
