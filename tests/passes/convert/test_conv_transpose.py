"""``qc.convert`` of transposed convolutions (static and QAT, + BatchNorm) and of
EmbeddingBag: torch's quantized ConvTranspose kernels where the engine takes the weight,
the float op on integer weights elsewhere (with the reason), always within one output
step of the fake-quant graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qcompile as qc
from qcompile.passes.convert.common import IntTensor, transposed_kernel_refusal
from qcompile.runtime.quantized import IntWeight

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")

CT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class Up(nn.Module):
    """ConvTranspose(-BN)-ReLU, then a second ConvTranspose."""

    def __init__(self, dims: int, cin: int, cout: int, kernel: int, stride: int, groups: int,
                 bn: bool) -> None:
        super().__init__()
        self.up = CT[dims](cin, cout, kernel, stride=stride, padding=kernel // 2,
                           output_padding=stride - 1, groups=groups)
        self.bn = BN[dims](cout) if bn else nn.Identity()
        self.out = CT[dims](cout, 2, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.up(x))))


def trained(model: nn.Module, preset: str, shape: tuple[int, ...], seed: int = 0,
            per_channel: bool = False, axis: int | None = 1, method: str = "auto"
            ) -> torch.fx.GraphModule:
    """Compiled with ``preset`` (per-tensor transposed-conv weights as shipped, or per
    channel along ``axis``; None: the axis the compiler infers), calibrated or trained two
    SGD steps, frozen."""
    spec = qc.load_spec(preset).model_dump()
    spec["trace"]["method"] = method
    if per_channel:
        weight = {"dtype": "int8", "granularity": "per_channel"}
        if axis is not None:
            weight["axis"] = axis
        spec["quant"]["rules"].insert(0, {
            "match": {"module": "ConvTranspose*"}, "weight": weight,
            "activation": {"dtype": "uint8", "symmetric": False}})
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(shape, generator=gen),) for _ in range(2)]
    gm = qc.qcompile(model, qc.CompileSpec.model_validate(spec), example_inputs=batches[0])
    if preset == "int8-static":
        return qc.calibrate(gm, batches, progress=False)
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    gm.train()
    for (x,) in batches:
        gm(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return qc.freeze(gm)


def within_one_step(gm: torch.fx.GraphModule, xs: list[torch.Tensor]) -> nn.Module:
    ref = copy.deepcopy(gm).eval()
    out = qc.convert(gm, example_inputs=(xs[0],))
    step = float(qc.quantizers(ref)["out.output_fake_quant"].scale[0])
    with torch.no_grad():
        for x in xs:
            assert float((out(x) - ref(x)).abs().max()) <= step * (1 + 1e-5)
    return out


def records(out: nn.Module) -> list[tuple[str, str, str]]:
    return [(c.module, c.op, c.note) for c in qc.report(out).conversions
            if c.path in ("kernel", "fold", "int_storage")]


@pytest.mark.parametrize(("dims", "groups"), [(1, 2), (2, 1), (3, 2)])
def test_static_per_tensor_becomes_quantized_conv_transpose(dims: int, groups: int) -> None:
    torch.manual_seed(0)
    shape = (2, 4, *([5] * dims))
    gm = trained(Up(dims, 4, 6, 3, 2, groups, bn=True).eval(), "int8-static", shape)
    out = within_one_step(gm, [torch.randn(shape), 2 * torch.randn(shape)])
    assert [(m, op) for m, op, _ in records(out)] == [
        ("up", "quantized::conv_transpose_relu"), ("out", "quantized::conv_transpose")]
    kernel = out.get_submodule("up")
    assert isinstance(kernel, torch.ao.nn.quantized.modules.conv._ConvTransposeNd)
    assert kernel.groups == groups and kernel.weight().qscheme() == torch.per_tensor_affine


def test_qat_bn_folds_along_axis_1_and_stays_exact() -> None:
    """QAT keeps BatchNorm; convert folds it into the weight's scales along axis 1 (the
    output channels), which leaves a per-channel weight: torch's x86 transposed-conv kernel
    takes per-tensor weights only, so that layer runs the float op on its integers."""
    torch.manual_seed(0)
    gm = trained(Up(2, 4, 6, 3, 2, 1, bn=True), "int8-qat", (2, 4, 5, 5))
    out = within_one_step(gm, [torch.randn(2, 4, 5, 5) for _ in range(2)])
    (fold, *rest) = records(out)
    assert fold[:2] == ("up", "batchnorm")
    assert ("out", "quantized::conv_transpose") in [r[:2] for r in rest]
    (stored,) = [r for r in rest if r[1] == "int8 weight"]
    assert stored[0] == "up.weight" and "per-tensor weight only" in stored[2]
    weight = out.get_submodule("up.weight")
    assert isinstance(weight, IntWeight) and weight.axis == 1
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in out.modules())


def test_qat_grouped_conv_transpose_keeps_its_bn() -> None:
    torch.manual_seed(0)
    gm = trained(Up(1, 4, 6, 3, 2, 2, bn=True), "int8-qat", (2, 4, 7))
    out = within_one_step(gm, [torch.randn(2, 4, 7)])
    step = next(p for p in qc.report(out).passes if p.name == "convert.fold_batchnorm")
    assert any("transposed conv with groups" in n for n in step.notes)
    assert any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in out.modules())


def test_which_weights_an_engine_takes() -> None:
    def t(axis: int | None, zero_point: int = 0) -> IntTensor:
        n = 1 if axis is None else 3
        return IntTensor(torch.zeros(3, 3, 2, dtype=torch.int8), torch.ones(n),
                         torch.full((n,), zero_point, dtype=torch.int32), axis, None, -128, 127)

    assert transposed_kernel_refusal(t(None), 3, 4, "x86") is None
    assert "per-tensor weight only" in transposed_kernel_refusal(t(1), 1, 1, "x86")
    assert transposed_kernel_refusal(t(1), 2, 1, "qnnpack") is None
    assert "without groups" in transposed_kernel_refusal(t(1), 2, 2, "qnnpack")
    assert "3-D" in transposed_kernel_refusal(t(None), 3, 1, "qnnpack")
    assert "symmetric" in transposed_kernel_refusal(t(None, zero_point=3), 1, 1, "x86")
    assert "per_channel axis 0" in transposed_kernel_refusal(t(0), 1, 1, "qnnpack")


@settings(max_examples=10, deadline=None)
@given(dims=st.sampled_from([1, 2]), cin=st.integers(1, 3), cout=st.integers(1, 3),
       groups=st.sampled_from([1, 2]), kernel=st.integers(1, 3), stride=st.integers(1, 2),
       bn=st.booleans(), per_channel=st.booleans(), seed=st.integers(0, 2**16))
def test_qat_freeze_convert_is_within_one_step(dims: int, cin: int, cout: int, groups: int,
                                               kernel: int, stride: int, bn: bool,
                                               per_channel: bool, seed: int) -> None:
    torch.manual_seed(seed)
    cin, cout = cin * groups, cout * groups
    shape = (2, cin, *([4] * dims))
    gm = trained(Up(dims, cin, cout, kernel, stride, groups, bn), "int8-qat", shape, seed,
                 per_channel=per_channel)
    gen = torch.Generator().manual_seed(seed + 1)
    within_one_step(gm, [torch.randn(shape, generator=gen) for _ in range(2)])


def per_channel_axis1(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 along dim 1 (a transposed conv's output channels), written out."""
    dims = [d for d in range(w.dim()) if d != 1]
    scale = w.abs().amax(dim=dims, keepdim=True) / 127.0
    return torch.clamp(torch.round(w / scale), -128, 127) * scale


@pytest.mark.parametrize("method", ["symbolic", "export"])
@pytest.mark.parametrize(("dims", "groups"), [(1, 1), (2, 2), (3, 1)])
def test_per_channel_axis_is_inferred_as_the_output_channels(dims: int, groups: int,
                                                             method: str) -> None:
    """``granularity: per_channel`` without ``axis`` on a transposed conv: both front ends
    infer dim 1 of its [in, out / groups, k...] weight; the fake-quantized weight is the
    per-channel reference along dim 1, and convert keeps that axis."""
    torch.manual_seed(0)
    cin, cout = 2 * groups, 3 * groups
    model = Up(dims, cin, cout, 3, 2, groups, bn=False)
    shape = (2, cin, *([4] * dims))
    x = torch.randn(shape)
    spec = {"quant": {"mode": "qat", "rules": [
        {"match": {"module": "ConvTranspose*"},
         "weight": {"dtype": "int8", "granularity": "per_channel"}}]},
        "trace": {"method": method}}
    fresh = qc.qcompile(model, spec, example_inputs=(x,))
    fq = qc.quantizers(fresh)["up.weight_fake_quant"]
    assert fq.axis == 1 and fq.scale.numel() == cout // groups, (fq.axis, fq.scale.shape)
    with torch.no_grad():  # the first forward observes the weight: the reference's qparams
        got = fresh.eval()(x)
        wq = per_channel_axis1(model.up.weight)
        up = copy.deepcopy(model.up)
        up.weight.copy_(wq)
        out_w = model.out.weight
        scale = out_w.abs().amax(dim=[d for d in range(out_w.dim()) if d != 1],
                                 keepdim=True) / 127.0
        model_out = copy.deepcopy(model.out)
        model_out.weight.copy_(torch.clamp(torch.round(out_w / scale), -128, 127) * scale)
        want = model_out(torch.relu(up(x)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    gm = trained(copy.deepcopy(model), "int8-qat", shape, per_channel=True, axis=None,
                 method=method)
    assert qc.quantizers(gm)["up.weight_fake_quant"].axis == 1
    out = within_one_step(gm, [torch.randn(shape) for _ in range(2)])
    stored = [m for n, m in out.named_modules()
              if n.startswith("up") and isinstance(m, IntWeight)]
    assert stored and all(m.axis == 1 for m in stored), [m.axis for m in stored]


class BagWeighted(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(12, 5, mode=mode)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        return self.bag(ids, offsets, per_sample_weights=weights)


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_embedding_bag_per_sample_weights_are_applied(method: str) -> None:
    """``per_sample_weights`` reach the quantized op: the graph computes the weighted sum
    of the per-row int8 rows (written out here), on other weights than the example's."""
    model = BagWeighted("sum")
    ids, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 11]), torch.tensor([0, 2, 4])
    example = (ids, offsets, torch.ones(7))
    spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "EmbeddingBag"},
                                                "weight": {"dtype": "int8",
                                                           "granularity": "per_channel"}}]},
            "trace": {"method": method}}
    gm = qc.qcompile(model, spec, example_inputs=example)
    w = model.bag.weight.detach()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    wq = torch.clamp(torch.round(w / scale), -128, 127) * scale
    for weights in (torch.tensor([0.5, 2.0, -1.0, 3.0, 1.0, 0.25, -4.0]), torch.zeros(7)):
        want = F.embedding_bag(ids, wq, offsets, mode="sum", per_sample_weights=weights)
        with torch.no_grad():
            got = gm(ids, offsets, weights)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


class Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag, self.fc = nn.EmbeddingBag(40, 8, mode="mean"), nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(ids, offsets))


BAG_SPEC = {"quant": {"mode": "static", "rules": [
    {"match": {"module": "EmbeddingBag"}, "weight": {"dtype": "int8", "symmetric": False,
                                                     "granularity": "per_channel"}},
    {"match": {"module": "Linear"}, "weight": {"dtype": "int8", "granularity": "per_channel"},
     "activation": {"dtype": "uint8", "symmetric": False}}]}}


def bags() -> tuple[torch.fx.GraphModule, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    example = (torch.randint(0, 40, (10,), generator=gen), torch.tensor([0, 4, 6]))
    gm = qc.qcompile(Bags(), BAG_SPEC, example_inputs=example)
    return qc.calibrate(gm, [example], progress=False), example


def test_embedding_bag_weight_is_stored_as_integers() -> None:
    gm, example = bags()
    out = qc.convert(gm, example_inputs=example)
    assert isinstance(out.get_submodule("bag.weight"), IntWeight)
    assert "bag.weight" not in dict(out.named_parameters())
    assert qc.report(out).max_deviation["output0"] == 0.0
    ids, offsets = torch.randint(0, 40, (17,)), torch.tensor([0, 1, 9, 12])
    with torch.no_grad():
        assert torch.equal(out(ids, offsets), gm.eval()(ids, offsets))


def test_embedding_bag_exports_to_onnx_with_its_own_lengths(tmp_path) -> None:
    """Indices and offsets differ in length: each gets a dynamic dim of its own, and
    onnxruntime runs other lengths than the example's."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    gm, example = bags()
    path = qc.export_onnx(gm, tmp_path / "bags.onnx", example_inputs=example)
    session = ort.InferenceSession(str(path))
    ids, offsets = torch.randint(0, 40, (23,)), torch.tensor([0, 5, 6, 15, 20])
    names = [i.name for i in session.get_inputs()]
    (got,) = session.run(None, dict(zip(names, (ids.numpy(), offsets.numpy()))))
    with torch.no_grad():
        want = gm.eval()(ids, offsets)
    step = float(qc.quantizers(gm)["fc.output_fake_quant"].scale[0])
    assert float((torch.from_numpy(got) - want).abs().max()) <= step * (1 + 1e-5)
