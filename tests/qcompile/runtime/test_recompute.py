"""Fake-quantized weights recomputed in backward (``qcompile.runtime.recompute``): what
autograd keeps after a QAT forward is what it keeps after the float forward, and the
gradients are those of a graph that keeps the copies, bit for bit."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.runtime import recompute

torch.manual_seed(0)


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D: a weight stored [in, out], ``addmm(b, x, W)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))
        self.nf = nf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.conv = Conv1D(64, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.conv(torch.relu(self.fc1(x)))))


X = torch.randn(8, 32)


def spec(recompute_weights: bool = True, weight: dict | None = None,
         learnable: bool = False) -> dict:
    s = qc.load_spec("int8-qat").model_dump()
    s["train"] = {"recompute_weights": recompute_weights}
    if weight is not None or learnable:
        for rule in s["quant"]["rules"]:
            if rule.get("weight"):
                rule["weight"].update(weight or {})
                rule["weight"]["learnable"] = learnable
    return s


def compiled(s: dict, model: nn.Module | None = None) -> torch.fx.GraphModule:
    torch.manual_seed(1)
    gm = qc.qcompile(model or Net(), s, example_inputs=(X,))
    for q in qc.quantizers(gm).values():
        q.reuse_weight = False  # the weight cache holds copies of its own: measure without
    return gm


def kept_bytes(module: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the storages autograd keeps from one forward, parameters excluded (a float
    layer keeps its weight, which exists anyway)."""
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    return sum(s.nbytes() for k, s in seen.items() if k not in params), out


def grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    module(x).square().sum().backward()
    return [p.grad.clone() for p in module.parameters()]


def weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() > 1)


@pytest.mark.parametrize("weight", [None, {"granularity": "per_group", "group_size": 16}],
                         ids=["per_channel", "per_group_transposed"])
def test_a_qat_forward_keeps_what_the_float_forward_keeps(weight):
    x = X.clone().requires_grad_(True)
    float_bytes, _ = kept_bytes(Net(), x)
    qat_bytes, _ = kept_bytes(compiled(spec(weight=weight)), x)
    kept, _ = kept_bytes(compiled(spec(False, weight=weight)), x)
    # the copies are the weights' size: the switch decides whether they are kept
    assert kept - qat_bytes >= weight_bytes(Net())
    # activations: the quantizers' outputs replace the float ones, plus 1-bit masks
    assert qat_bytes <= 1.1 * float_bytes


@pytest.mark.parametrize("learnable", [False, True], ids=["ste", "lsq"])
@pytest.mark.parametrize("weight", [None, {"granularity": "per_group", "group_size": 16}],
                         ids=["per_channel", "per_group_transposed"])
def test_gradients_equal_those_of_kept_copies(weight, learnable):
    a, b = compiled(spec(True, weight, learnable)), compiled(spec(False, weight, learnable))
    x = X.clone().requires_grad_(True)
    for _ in range(2):  # the second forward quantizes activations (step updates applied)
        ga, gb = grads(a, x), grads(b, x)
        assert all(torch.equal(u, v) for u, v in zip(ga, gb))
        for gm in (a, b):  # an optimizer step between, as in training
            with torch.no_grad():
                for p in gm.parameters():
                    p.sub_(0.01 * p.grad)
            torch.optim.SGD(gm.parameters(), lr=0.0).step()


def test_hooks_are_installed_by_the_spec_and_popped_after_the_forward():
    gm = compiled(spec())
    assert recompute.installed(gm)
    assert not recompute.installed(compiled(spec(False)))
    gm(X)
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_hooks_are_popped_when_the_forward_raises():
    gm = compiled(spec())
    with pytest.raises(Exception):  # noqa: B017  (whichever the front end raises)
        gm(torch.randn(8, 31))  # wrong width
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_a_users_saved_tensor_hooks_still_see_everything_else():
    """save_on_cpu-like outer hooks: the activations still go through them; the weight
    copies are recipes, the user's unpack runs for each of its packs."""
    gm = compiled(spec())
    packed, unpacked = [], []

    def pack(t: torch.Tensor) -> tuple[str, torch.Tensor]:
        packed.append(tuple(t.shape))
        return ("mine", t)

    def unpack(box: tuple[str, torch.Tensor]) -> torch.Tensor:
        assert box[0] == "mine"
        unpacked.append(tuple(box[1].shape))
        return box[1]

    x = X.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = gm(x)
    out.square().sum().backward()
    assert packed and sorted(packed) == sorted(unpacked)
    assert (64, 32) not in packed and (32, 64) not in packed  # fc1's copy: a recipe
    hooked = [p.grad.clone() for p in gm.parameters()]
    assert all(torch.equal(u, v) for u, v in zip(hooked, grads(compiled(spec(False)), x)))


def test_a_weight_changed_in_place_before_backward_is_an_error():
    gm = compiled(spec())
    out = gm(X.clone().requires_grad_(True))
    with torch.no_grad():
        gm.get_submodule("fc1").weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place between the forward and"):
        out.sum().backward()


def test_no_hooks_under_no_grad_and_the_graph_pickles_with_them():
    gm = compiled(spec())
    with torch.no_grad():
        ref = gm(X)
    f = io.BytesIO()
    torch.save(gm, f)
    f.seek(0)
    loaded = torch.load(f, weights_only=False)
    assert recompute.installed(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(X), ref)


def test_activation_checkpointing_around_the_graph_gives_the_same_gradients():
    """Non-reentrant checkpointing's hooks are outside the graph's: it sees (and
    recomputes) everything but the weight copies, the same way in both forwards."""
    gm = compiled(spec())
    x = X.clone().requires_grad_(True)
    gm(x)  # step updates: activations quantize from the next training step on
    torch.optim.SGD(gm.parameters(), lr=0.0).step()
    expected = grads(gm, x)
    gm.zero_grad(set_to_none=True)
    out = torch.utils.checkpoint.checkpoint(gm, x, use_reentrant=False)
    out.square().sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(gm.parameters(), expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_weight_node_saves_the_weight_not_a_mask_and_matches(dtype):
    """Devices without the CPU kernels (CUDA) run the eager formula: for a weight it keeps
    the weight itself (no one-byte-per-element mask), with the same bits both ways."""
    from qcompile.runtime.quant_math import _FakeQuantSTEWeight, fake_quantize_eager

    w = nn.Parameter((torch.randn(16, 64) * 3).to(dtype))
    scale = torch.rand(16, 1) * 0.05 + 0.01  # values beyond the range: a real mask
    zp = torch.zeros(16, 1, dtype=torch.int32)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        a = _FakeQuantSTEWeight.apply(w, scale, zp.float(), -128, 127)
    b = fake_quantize_eager(w, scale, zp, -128, 127)
    assert torch.equal(a, b) and a.dtype == dtype
    grad = torch.randn_like(a)
    ga, = torch.autograd.grad(a, w, grad)
    gb, = torch.autograd.grad(b, w, grad)
    assert torch.equal(ga, gb)
    assert bool((gb == 0).any())  # the mask mattered
    assert w.untyped_storage()._cdata in saved
    assert sum(saved.values()) < w.untyped_storage().nbytes() + 1024


def test_the_fp8_weight_node_saves_the_weight_and_matches():
    from qcompile.runtime.quant_math import fake_quantize_fp8

    w = nn.Parameter(torch.randn(16, 64) * 300)  # beyond e4m3's range: a real mask
    scale = torch.ones(16, 1)
    a = fake_quantize_fp8(w, scale, "fp8_e4m3", 448.0, weight=True)
    b = fake_quantize_fp8(w, scale, "fp8_e4m3", 448.0)
    assert type(a.grad_fn) is not type(b.grad_fn) and torch.equal(a, b)  # the weight node
    grad = torch.randn_like(a)
    ga, = torch.autograd.grad(a, w, grad)
    gb, = torch.autograd.grad(b, w, grad)
    assert torch.equal(ga, gb) and bool((gb == 0).any())


@pytest.mark.parametrize("preset", ["nvfp4-qat", "mxfp4-qat"])
def test_block_format_weights_are_recomputed_not_kept(preset):
    def block_spec(recompute: bool) -> dict:
        s = qc.load_spec(preset).model_dump()
        s["train"] = {"recompute_weights": recompute}
        return s

    x = X.clone().requires_grad_(True)
    float_bytes, _ = kept_bytes(Net(), x)
    a, b = compiled(block_spec(True)), compiled(block_spec(False))
    qat_bytes, _ = kept_bytes(a, x)
    kept, _ = kept_bytes(b, x)
    assert kept - qat_bytes >= weight_bytes(Net())
    # each Linear keeps its quantized input next to the float one ReLU keeps: at most one
    # more activation per layer, no weight copies
    assert qat_bytes <= 2 * float_bytes
    assert all(torch.equal(u, v) for u, v in zip(grads(a, x), grads(b, x)))


def test_a_deep_copy_keeps_the_graph_hooks_and_trains_the_same():
    """GraphModule's deepcopy drops forward hooks; qcompile's come back on the copy: step
    updates still apply and weights are still recomputed."""
    gm = compiled(spec())
    twin = copy.deepcopy(gm)
    assert list(twin._forward_pre_hooks.values()) == list(gm._forward_pre_hooks.values())
    for g in (gm, twin):
        opt = torch.optim.SGD(g.parameters(), lr=0.01)
        for _ in range(2):
            opt.zero_grad()
            g(X).square().mean().backward()
            opt.step()
    scales = [q.scale for q in qc.quantizers(twin).values() if not q.weight]
    assert scales and all(float(s.max()) != 1.0 for s in scales)  # observations applied
    assert all(torch.equal(a, b) for a, b in zip(gm.state_dict().values(),
                                                 twin.state_dict().values()))
