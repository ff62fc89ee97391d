"""``quant.target``: qcompile's fake-quant numerics against a reference of what the integer
kernels compute (``tests/helpers/int_reference.py``), on any machine.

fbgemm / onednn add pairs of u8 x s8 products in int16 with saturation on CPUs without
VNNI; the ``x86`` target's 7-bit activations never saturate. The tests here do not depend
on the CPU they run on: the reference computes both arithmetics (``vnni=False`` and
``vnni=True``), and where torch's kernels are compared, the reference is told which one
this CPU has.
"""

from __future__ import annotations

from dataclasses import dataclass

import int_reference as ref
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import qcompile as qc
from qcompile.runtime.engines import use_engine

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")

A8 = {"dtype": "uint8", "symmetric": False}
VNNI = ref.cpu_has_vnni()


class One(nn.Module):
    """One weighted layer: what the kernels compute is what the reference computes."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.fc = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def spec(target: str, method: str = "symbolic", mode: str = "static",
         granularity: str = "per_channel", module: str = "Linear") -> qc.CompileSpec:
    quant = {"mode": mode, "target": target,
             "rules": [{"match": {"module": module},
                        "weight": {"dtype": "int8", "granularity": granularity},
                        "activation": A8}]}
    if mode != "dynamic":
        quant["inputs"] = A8  # the layer reads integers
    return qc.CompileSpec.model_validate({"quant": quant, "trace": {"method": method}})


def linear_model(k: int, n: int, w_std: float, bias_std: float, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * w_std)
        layer.bias.copy_(torch.randn(n, generator=gen) * bias_std)
    return One(layer).eval()


def calibrated(model: nn.Module, x: torch.Tensor, s: qc.CompileSpec) -> torch.fx.GraphModule:
    gm = qc.qcompile(model, s, example_inputs=(x,))
    if s.quant.mode == "static":
        qc.calibrate(gm, [(x,)], progress=False)
    return gm.eval()


@dataclass
class Ints:
    """The integers and qparams of one quantized layer, read from its quantizers."""

    xq: torch.Tensor  # input integers, zero point included
    x_scale: float
    x_zp: int
    wq: torch.Tensor  # weight integers (s8)
    w_scale: torch.Tensor
    w_zp: torch.Tensor
    bias: torch.Tensor | None
    out_scale: float
    out_zp: int
    out_min: int
    out_max: int
    x_range: tuple[int, int]


def integers(gm: torch.fx.GraphModule, x: torch.Tensor) -> Ints:
    roles = {r.name: r.role for r in qc.report(gm).quantizers}
    qs = qc.quantizers(gm)
    (inp,) = [qs[n] for n, r in roles.items() if r == "input"]
    (wfq,) = [qs[n] for n, r in roles.items() if r == "weight"]
    (out,) = [qs[n] for n, r in roles.items() if r == "activation"]
    layer = gm.get_submodule("fc")
    xs, xz = float(inp.scale[0]), int(inp.zero_point[0])
    w = layer.weight.detach()
    shape = [-1] + [1] * (w.dim() - 1)
    wq = ref.quantize(w, wfq.scale.detach().view(shape), wfq.zero_point.view(shape),
                      wfq.quant_min, wfq.quant_max)
    xq = ref.quantize(x, xs, xz, inp.quant_min, inp.quant_max)
    w_scale = wfq.scale.detach().double().expand(w.shape[0]).clone()
    w_zp = wfq.zero_point.long().expand(w.shape[0]).clone()
    return Ints(xq, xs, xz, wq, w_scale, w_zp, layer.bias, float(out.scale[0]),
                int(out.zero_point[0]), out.quant_min, out.quant_max,
                (inp.quant_min, inp.quant_max))


def reference(t: Ints, *, vnni: bool, full_output_range: bool = False) -> torch.Tensor:
    """Output integers of the layer; the output clamped to the quantizer's range (as the
    fake-quant graph does) or to the kernels' uint8 range."""
    lo, hi = (0, 255) if full_output_range else (t.out_min, t.out_max)
    if t.xq.dim() == 4:
        return ref.conv2d(t.xq, t.x_scale, t.x_zp, t.wq, t.w_scale, t.w_zp, t.bias,
                          t.out_scale, t.out_zp, vnni=vnni, padding=1, quant_min=lo,
                          quant_max=hi)
    return ref.linear(t.xq, t.x_scale, t.x_zp, t.wq, t.w_scale, t.w_zp, t.bias, t.out_scale,
                      t.out_zp, vnni=vnni, quant_min=lo, quant_max=hi)


def kernel(t: Ints) -> torch.Tensor:
    """torch's int8 kernel (current engine) on the same integers: output integers."""
    qx = torch._make_per_tensor_quantized_tensor(t.xq.to(torch.uint8), t.x_scale, t.x_zp)
    qw = torch._make_per_channel_quantized_tensor(t.wq.to(torch.int8), t.w_scale, t.w_zp, 0)
    bias = None if t.bias is None else t.bias.detach().float()
    if t.xq.dim() == 4:
        packed = torch.ops.quantized.conv2d_prepack(qw, bias, [1, 1], [1, 1], [1, 1], 1)
        y = torch.ops.quantized.conv2d(qx, packed, t.out_scale, t.out_zp)
    else:
        packed = torch.ops.quantized.linear_prepack(qw, bias)
        y = torch.ops.quantized.linear(qx, packed, t.out_scale, t.out_zp)
    return y.int_repr().long()


def steps(y: torch.Tensor, t: Ints) -> torch.Tensor:
    """A float output in steps of the output quantizer (integers on its grid)."""
    return y.detach().double() / t.out_scale + t.out_zp


def max_steps(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# -- the reference itself ----------------------------------------------------------------
def test_no_7_bit_pair_saturates() -> None:
    """The extremes: u8 127 (or 255) against s8 -128 / 127 in every position."""
    for w in (-128, 127):
        wq = torch.full((3, 64), w)
        assert torch.equal(ref.accumulate(torch.full((2, 64), 127), wq, vnni=False),
                           ref.accumulate(torch.full((2, 64), 127), wq, vnni=True))
        full = torch.full((2, 64), 255)
        sat = ref.accumulate(full, wq, vnni=False)
        assert torch.equal(sat, torch.full_like(sat, 32 * (32767 if w > 0 else -32768)))
        assert not torch.equal(sat, ref.accumulate(full, wq, vnni=True))


def test_pairs_are_adjacent_along_k_and_odd_k_is_padded() -> None:
    x = torch.tensor([[255, 255, 255]])
    # (0, 1) saturate together; 2 pairs with the padding
    assert ref.accumulate(x, torch.tensor([[-128, -128, -128]]), vnni=False).item() == \
        -32768 - 255 * 128
    # signs alternating inside a pair cancel before saturating
    assert ref.accumulate(x, torch.tensor([[-128, 127, -128]]), vnni=False).item() == \
        255 * (127 - 128) - 255 * 128


@pytest.mark.parametrize("engine_name", ["x86", "fbgemm", "onednn", "qnnpack"])
@pytest.mark.parametrize("x_max", [127, 255])
def test_reference_is_the_kernels_arithmetic(engine_name: str, x_max: int) -> None:
    """Raw integers, full and 7-bit: the reference with this CPU's arithmetic is torch's
    kernel; qnnpack accumulates exactly (the VNNI arithmetic) on every CPU."""
    if engine_name not in torch.backends.quantized.supported_engines:
        pytest.skip(f"no {engine_name} engine in this torch")
    if engine_name == "onednn" and x_max == 255 and not VNNI and "avx_vnni" in ref.cpu_flags():
        pytest.skip("onednn may use AVX-VNNI on this CPU, fbgemm does not")
    vnni = VNNI or engine_name == "qnnpack"
    for seed, k in enumerate([1, 2, 3, 17, 64, 255, 1024]):
        gen = torch.Generator().manual_seed(seed)
        xq = torch.randint(0, x_max + 1, (8, k), generator=gen)
        wq = torch.randint(-128, 128, (16, k), generator=gen)
        t = Ints(xq, 0.05, int(torch.randint(0, x_max + 1, (1,), generator=gen)), wq,
                 torch.rand(16, generator=gen).double() * 0.01 + 0.001,
                 torch.zeros(16, dtype=torch.long), torch.randn(16, generator=gen), 0.0, 0,
                 0, 255, (0, x_max))
        exact = ref.dequantize_acc(ref.linear_acc(xq, t.x_zp, wq, 0, vnni=True), t.x_scale,
                                   t.w_scale, t.bias)
        lo, hi = min(float(exact.min()), 0.0), max(float(exact.max()), 0.0)
        t.out_scale, t.out_zp = (hi - lo) / 255, round(-lo * 255 / (hi - lo))
        with use_engine(engine_name):
            got = kernel(t)
        assert max_steps(got, reference(t, vnni=vnni)) <= 1, (seed, k)
        if x_max == 127:  # no saturation: both arithmetics agree exactly
            assert torch.equal(reference(t, vnni=False), reference(t, vnni=True))


# -- the x86 target through qcompile's graphs ----------------------------------------------
widths = st.integers(1, 1024)
FRONT_ENDS = ["symbolic", "export"]


@st.composite
def layers(draw: st.DrawFn) -> dict:
    return {
        "k": draw(widths), "n": draw(widths), "m": draw(st.integers(1, 8)),
        "spread": 10.0 ** draw(st.integers(-3, 3)),
        "center": draw(st.floats(-2.0, 2.0, allow_nan=False)),
        "w_std": 10.0 ** draw(st.integers(-3, 1)),
        "bias_std": draw(st.sampled_from([0.0, 0.1, 10.0])),
        "granularity": draw(st.sampled_from(["per_channel", "per_tensor"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def layer_graph(p: dict, target: str, method: str) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    model = linear_model(p["k"], p["n"], p["w_std"], p["bias_std"], p["seed"])
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    x = (torch.rand(p["m"], p["k"], generator=gen) * 2 - 1 + p["center"]) * p["spread"]
    return calibrated(model, x, spec(target, method, granularity=p["granularity"])), x


# Each example compiles (and calibrates) a graph: a fifth of the profile's examples (ci: 12).
EXAMPLES = max(12, settings().max_examples // 5)
EXPENSIVE = settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow],
                     deadline=None)


@pytest.mark.parametrize("method", FRONT_ENDS)
@EXPENSIVE
@given(p=layers())
def test_x86_graph_and_kernels_match_the_reference(method: str, p: dict) -> None:
    """x86 target, random widths and ranges, both front ends: activations are 7-bit, the
    reference gives the same integers with and without VNNI, torch's kernels (every
    engine) give those integers within one step, and so does the frozen fake-quant
    graph."""
    gm, x = layer_graph(p, "x86", method)
    t = integers(gm, x)
    assert t.x_range == (0, 127) and (t.out_min, t.out_max) == (0, 127)
    assert int(t.xq.min()) >= 0 and int(t.xq.max()) <= 127
    r = reference(t, vnni=False)
    assert torch.equal(r, reference(t, vnni=True))  # no pair saturates
    with torch.no_grad():
        fq = steps(gm(x), t)
    assert max_steps(fq, r) <= 1 + 1e-6, "fake-quant graph vs integer reference"
    r_kernel = reference(t, vnni=False, full_output_range=True)
    for name in ("x86", "onednn", "qnnpack"):
        with use_engine(name):
            assert max_steps(kernel(t), r_kernel) <= 1, name


@pytest.mark.parametrize("method", FRONT_ENDS)
@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow], deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: expensive
@given(p=layers())
def test_x86_converted_matches_the_reference(method: str, p: dict) -> None:
    """``qc.convert`` of an x86 graph: the layer runs as torch's integer kernel and its
    output is within one step of the reference (and so of the fake-quant graph), on every
    CPU."""
    gm, x = layer_graph(p, "x86", method)
    t = integers(gm, x)
    int8 = qc.convert(gm)
    assert "quantized::linear" in {c.op for c in qc.report(int8).conversions}
    with torch.no_grad():
        got = steps(int8(x), t)
    assert max_steps(got, reference(t, vnni=False)) <= 1 + 1e-6


@pytest.mark.parametrize("method", FRONT_ENDS)
def test_x86_conv_graph_and_kernel_match_the_reference(method: str) -> None:
    """Conv2d through im2col, channels paired as fbgemm pairs them."""
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 8, 3, padding=1)
    x = torch.rand(2, 16, 9, 9) * 4 - 1
    gm = calibrated(One(conv).eval(), x, spec("x86", method, module="Conv2d"))
    t = integers(gm, x)
    assert t.x_range == (0, 127)
    r = reference(t, vnni=False)
    assert torch.equal(r, reference(t, vnni=True))
    with torch.no_grad():
        assert max_steps(steps(gm(x), t), r) <= 1 + 1e-6
    with use_engine("x86"):
        assert max_steps(kernel(t), reference(t, vnni=False, full_output_range=True)) <= 1


# -- full 8-bit activations: what the x86 target prevents ---------------------------------
def saturating_layer() -> tuple[nn.Module, torch.Tensor]:
    """Non-negative inputs (zero point 0, u8 up to 255) and large weights of both signs:
    many pairs of products leave int16."""
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(256, 32)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(32, 256, generator=gen) * 2 - 1)
        layer.bias.zero_()
    return One(layer).eval(), torch.rand(8, 256, generator=gen)


@pytest.mark.parametrize("target", ["generic", "qnnpack", "onednn_vnni"])
def test_full_range_saturates_without_vnni(target: str) -> None:
    """The test that would have caught the bug on any machine: with full-range activations
    the arithmetic of CPUs without VNNI is many steps from the exact one (and from the
    fake-quant graph, which is exact); the x86 target's graph of the same layer is not."""
    model, x = saturating_layer()
    gm = calibrated(model, x, spec(target))
    t = integers(gm, x)
    assert t.x_range == (0, 255) and int(t.xq.max()) > 127
    exact, saturated = reference(t, vnni=True), reference(t, vnni=False)
    with torch.no_grad():
        fq = steps(gm(x), t)
    assert max_steps(fq, exact) <= 1 + 1e-6
    assert max_steps(saturated, exact) > 4  # far beyond one step
    assert max_steps(fq, saturated) > 4

    gm86 = calibrated(model, x, spec("x86"))
    t86 = integers(gm86, x)
    assert torch.equal(reference(t86, vnni=False), reference(t86, vnni=True))
    with torch.no_grad():
        assert max_steps(steps(gm86(x), t86), reference(t86, vnni=False)) <= 1 + 1e-6


def test_this_cpu_computes_what_the_reference_says() -> None:
    """On this machine, torch's x86 kernel on the full-range integers is the reference
    with this CPU's arithmetic (saturating unless it has VNNI)."""
    model, x = saturating_layer()
    t = integers(calibrated(model, x, spec("generic")), x)
    with use_engine("x86"):
        got = kernel(t)
    assert max_steps(got, reference(t, vnni=VNNI, full_output_range=True)) <= 1
    if not VNNI:
        assert max_steps(got, reference(t, vnni=True, full_output_range=True)) > 4


def test_convert_refuses_onednn_vnni_without_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without VNNI (pretended here, so every machine runs it) the full-range
    target is refused, naming the target to choose, and the graph is left as it was."""
    monkeypatch.setenv("QCOMPILE_ASSUME_NO_VNNI", "1")
    model, x = saturating_layer()
    gm = calibrated(model, x, spec("onednn_vnni"))
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    with pytest.raises(qc.QCompileError, match="no AVX-512 VNNI") as info:
        qc.convert(gm)
    assert "quant.target: x86" in info.value.fix
    assert all(torch.equal(v, gm.state_dict()[k]) for k, v in before.items())


@pytest.mark.skipif(not VNNI, reason="needs a CPU with AVX-512 VNNI")
def test_onednn_vnni_converts_exactly_on_a_vnni_cpu() -> None:
    model, x = saturating_layer()
    gm = calibrated(model, x, spec("onednn_vnni"))
    t = integers(gm, x)
    int8 = qc.convert(gm)
    with torch.no_grad():
        assert max_steps(steps(int8(x), t), reference(t, vnni=True)) <= 1 + 1e-6


def test_generic_target_converts_exactly_without_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generic`` (full range) takes the engine that accumulates in int32 (qnnpack) where
    the CPU's x86 kernels would saturate."""
    monkeypatch.setenv("QCOMPILE_ASSUME_NO_VNNI", "1")
    model, x = saturating_layer()
    gm = calibrated(model, x, spec("generic"))
    t = integers(gm, x)
    int8 = qc.convert(gm)
    ops = {c.op: c.note for c in qc.report(int8).conversions}
    assert "qnnpack engine" in ops["quantized::linear"]
    with torch.no_grad():
        assert max_steps(steps(int8(x), t), reference(t, vnni=True)) <= 1 + 1e-6


def test_qnnpack_target_converts_exactly() -> None:
    """qnnpack accumulates in int32: full-range graphs convert within one step."""
    model, x = saturating_layer()
    gm = calibrated(model, x, spec("qnnpack"))
    t = integers(gm, x)
    int8 = qc.convert(gm)
    assert "quantized::linear" in {c.op for c in qc.report(int8).conversions}
    with torch.no_grad():
        assert max_steps(steps(int8(x), t), reference(t, vnni=True)) <= 1 + 1e-6


# -- dynamic mode ------------------------------------------------------------------------
@pytest.mark.parametrize("method", FRONT_ENDS)
def test_x86_dynamic_input_is_7_bit_and_matches_the_dynamic_kernel(method: str) -> None:
    """The per-batch input quantizer uses the target's range; the fake-quant layer is then
    what ``quantized::linear_dynamic(..., reduce_range=True)`` computes (the reference's
    per-batch qparams, 7-bit, saturation-free), and not what it computes with
    ``reduce_range=False`` on a CPU without VNNI."""
    model, x = saturating_layer()
    x = x * 3 - 0.5
    gm = calibrated(model, x, spec("x86", method, mode="dynamic"))
    fq = qc.quantizers(gm)["fc.input_fake_quant"]
    assert fq.dynamic and (fq.quant_min, fq.quant_max) == (0, 127) and fq.reduce_range
    wfq = qc.quantizers(gm)["fc.weight_fake_quant"]
    layer = gm.get_submodule("fc")
    wq = ref.quantize(layer.weight.detach(), wfq.scale.detach()[:, None],
                      wfq.zero_point[:, None], -128, 127)
    r = ref.linear_dynamic(x, wq, wfq.scale.detach(), 0, layer.bias, reduce_range=True,
                           vnni=False)
    assert torch.equal(r, ref.linear_dynamic(x, wq, wfq.scale.detach(), 0, layer.bias,
                                             reduce_range=True, vnni=True))
    with torch.no_grad():
        got = gm(x).double()
    scale = float(r.abs().max())
    assert max_steps(got, r) <= 1e-4 * scale
    qw = torch._make_per_channel_quantized_tensor(wq.to(torch.int8), wfq.scale.double(),
                                                  torch.zeros(32, dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(qw, layer.bias.detach())
    with use_engine("x86"):
        dyn = torch.ops.quantized.linear_dynamic(x, packed, True).double()
        assert max_steps(dyn, r) <= 1e-4 * scale
        full = torch.ops.quantized.linear_dynamic(x, packed, False).double()
    full_ref = ref.linear_dynamic(x, wq, wfq.scale.detach(), 0, layer.bias,
                                  reduce_range=False, vnni=VNNI)
    assert max_steps(full, full_ref) <= 1e-4 * scale
    if not VNNI:
        assert max_steps(full, got) > 0.05 * scale  # reduce_range=False: saturated


def mlp_1024() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 4096), nn.ReLU(),
                         nn.Linear(4096, 1024)).eval()


def test_dynamic_mlp_converts_within_one_percent() -> None:
    """Dynamic conversion of a 1024-2048-4096-1024 MLP (x86 target): integer kernels,
    within 1% of the dynamic fake-quant graph."""
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(1))
    gm = calibrated(mlp_1024(), x, qc.load_spec("int8-dynamic"))
    assert all(q.reduce_range for n, q in qc.quantizers(gm).items() if "input" in n)
    int8 = qc.convert(gm)
    assert [c.op for c in qc.report(int8).conversions] == ["quantized::linear_dynamic"] * 3
    with torch.no_grad():
        want, got = gm(x), int8(x)
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.01, rel


# -- what the graph reports ----------------------------------------------------------------
@pytest.mark.parametrize("target", ["x86", "qnnpack"])
def test_ranges_in_encodings_and_repr(target: str, tmp_path) -> None:
    import json

    model, x = saturating_layer()
    gm = calibrated(model, x, spec(target))
    path = tmp_path / "enc.json"
    qc.export_encodings(gm, path)
    data = json.loads(path.read_text())
    hi = 127 if target == "x86" else 255
    for key in ("x_input", "fc.output"):
        (e,) = data["activation_encodings"][key]
        assert (e["quant_min"], e["quant_max"]) == (0, hi), key
        assert e["max"] == pytest.approx((hi - e["zero_point"]) * e["scale"])
    w = data["param_encodings"]["fc.weight"]
    assert all((e["quant_min"], e["quant_max"]) == (-128, 127) for e in w)
    assert f"range=[0, {hi}]" in repr(qc.quantizers(gm)["fc.output_fake_quant"])


def test_x86_lsq_activation_trains_in_7_bits() -> None:
    """A learnable (LSQ) activation scale: 7-bit range, values on it after a step."""
    s = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "target": "x86", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
         "activation": {**A8, "learnable": True}}]}})
    model, x = saturating_layer()
    gm = qc.qcompile(model.train(), s, example_inputs=(x,))
    fq = qc.quantizers(gm)["fc.output_fake_quant"]
    assert fq.learnable and (fq.quant_min, fq.quant_max) == (0, 127)
    with torch.no_grad():  # a batch initialises the learnable scale (observed at once)
        gm(x)
    gm(x).square().mean().backward()
    assert fq.scale_offset.grad is not None and torch.isfinite(fq.scale_offset.grad).all()
    with torch.no_grad():
        q = gm(x) / fq.scale + fq.zero_point
    assert float(q.min()) >= -1e-3 and float(q.max()) <= 127 + 1e-3
    assert max_steps(q, q.round()) < 1e-3
