"""Mixture-of-experts weights: a 3-D expert parameter behind grouped_mm / bmm / einsum /
``W[e]`` + linear (stored [experts, out, in] or [experts, in, out]) and experts as a
ModuleList of Linears are quantized by the presets' ordinary rules, with scales per expert
and output channel (per group along each expert's input), through QAT, calibration,
``qc.convert`` (integer storage), encodings and ONNX; routers are quantized like any
Linear. References are computed here from the definitions, never read back."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_models import KINDS, expert_parameters, moe

import qcompile as qc

X = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
LAYOUTS = [(k, t) for k in KINDS for t in ((False, True) if k != "module_list" else (False,))]


def spec(preset: str, method: str = "symbolic", **quant) -> qc.CompileSpec:
    s = qc.load_spec(preset).model_dump()
    s["trace"]["method"] = method
    s["quant"].update(quant)
    return qc.CompileSpec.model_validate(s)


def expert_coverage(gm, model) -> float:
    qs = qc.quantizers(gm)
    ps = expert_parameters(model)
    if any(n.startswith("experts.up.") for n in ps):  # ModuleList: module weights
        named = {n: p for n, p in ps.items() if n.replace(".weight", "") + ".weight" == n}
    else:
        named = ps
    return sum(p.numel() for n, p in named.items() if f"{n}_fake_quant" in qs) / sum(
        p.numel() for p in named.values())


@pytest.mark.parametrize(("kind", "transposed"), LAYOUTS)
def test_every_expert_weight_is_quantized_per_expert_and_channel(kind, transposed):
    model = moe(kind, transposed=transposed)
    gm = qc.qcompile(model, "int8-qat", example_inputs=(X,))
    assert expert_coverage(gm, model) == 1.0
    qs = qc.quantizers(gm)
    assert "router.weight_fake_quant" in qs  # the router is a functional linear
    assert qc.report(gm).parameters_quantized > 0.95
    if kind != "module_list":
        w = model.experts.up.detach()
        fq = qs["experts.up_fake_quant"]
        e, out = w.shape[0], w.shape[2 if transposed else 1]
        assert fq.scale.shape == (e * out,)
        rows = w.transpose(1, 2) if transposed else w
        ref_scale = rows.abs().amax(-1).reshape(-1)
        assert fq.granularity == "per_channel"
        # symmetric: max |w| of each expert's output channel over the shorter side (127)
        assert torch.allclose(fq.scale, ref_scale / 127, rtol=1e-5)
    # the user's model is untouched
    assert torch.equal(model(X), moe(kind, transposed=transposed)(X))


@pytest.mark.parametrize("kind", ["bmm", "einsum", "index", "module_list"])
def test_export_front_end_quantizes_the_same_weights(kind):
    model = moe(kind)
    sym = qc.qcompile(model, spec("int8-qat", "symbolic"), example_inputs=(X,))
    exp = qc.qcompile(model, spec("int8-qat", "export"), example_inputs=(X,))
    assert expert_coverage(exp, model) == 1.0
    w_sym = {n for n, q in qc.quantizers(sym).items() if n.endswith("weight_fake_quant")
             or n.endswith(("up_fake_quant", "down_fake_quant"))}
    w_exp = {n for n, q in qc.quantizers(exp).items() if n.endswith("weight_fake_quant")
             or n.endswith(("up_fake_quant", "down_fake_quant"))}
    assert w_sym == w_exp
    with torch.no_grad():
        assert torch.allclose(sym(X), exp(X), atol=1e-5)


def test_mode_none_is_bit_identical_and_routes_the_same():
    model = moe("bmm")
    gm = qc.qcompile(model, {"quant": {"mode": "none"}}, example_inputs=(X,))
    assert torch.equal(gm(X), model(X))
    gm.train()
    model.train()
    assert torch.equal(gm(X), model(X))


def test_qat_trains_experts_and_convert_stores_them_as_integers():
    torch.manual_seed(0)
    model = moe("bmm", transposed=True)
    gm = qc.qcompile(model, "int8-qat", example_inputs=(X,))
    target = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.Adam(gm.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(gm(X), target)
        loss.backward()
        assert gm.experts.up.grad is not None and gm.experts.up.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    qc.freeze(gm)
    gm.eval()
    out = qc.convert(gm, example_inputs=(X,))
    rep = qc.report(out)
    assert rep.max_deviation["output0_steps"] <= 1.0 + 1e-6
    stored = {c.module for c in rep.conversions if c.path == "int_storage"}
    assert {"experts.up", "experts.down"} <= stored
    state = out.state_dict()
    assert "experts.up" not in state and state["experts.up.packed"].dtype == torch.int8
    # the stored integers are the fake-quant grid, row (expert, output channel) by row
    w = gm.experts.up.detach()
    scale = qc.quantizers(gm)["experts.up_fake_quant"].scale.reshape(4, 1, 32)
    ref = ((w / scale).round().clamp(-128, 127) * scale)  # [experts, in, out]: out last
    with torch.no_grad():
        deq = out.get_submodule("experts.up")()  # the rows: [experts * out, in]
    assert torch.allclose(deq.reshape(4, 32, 16).transpose(1, 2), ref, atol=1e-6)


def test_w4a8_quantizes_experts_per_group_along_their_inputs():
    model = moe("einsum", dim=32, hidden=64)
    x = torch.randn(4, 32)
    gm = qc.qcompile(model, "w4a8-qat", example_inputs=(x,))
    fq = qc.quantizers(gm)["experts.up_fake_quant"]
    assert fq.granularity == "per_group" and fq.group_size == 32
    assert fq.scale.numel() == 4 * 64 * 32 // 32  # experts x out x (in / 32)
    assert expert_coverage(gm, model) == 1.0


def test_static_calibration_and_encodings_carry_per_expert_scales(tmp_path):
    model = moe("index")
    gm = qc.qcompile(model, "int8-static", example_inputs=(X,))
    gm = qc.calibrate(gm, [(torch.randn(6, 16),) for _ in range(3)], progress=False)
    path = tmp_path / "enc.json"
    qc.export_encodings(gm, path)
    enc = json.loads(path.read_text())["param_encodings"]
    assert len(enc["experts.up"]) == 4 * 32  # one per expert and output channel
    gm2 = qc.qcompile(model, "int8-static", example_inputs=(X,))
    qc.load_encodings(gm2, path)
    assert torch.equal(qc.quantizers(gm2)["experts.up_fake_quant"].scale,
                       qc.quantizers(gm)["experts.up_fake_quant"].scale)


def test_experts_export_to_onnx_and_run_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = moe("bmm")
    gm = qc.qcompile(model, "int8-static", example_inputs=(X,))
    gm = qc.calibrate(gm, [(torch.randn(6, 16),) for _ in range(2)], progress=False)
    path = tmp_path / "moe.onnx"
    qc.export_onnx(gm, path, example_inputs=(X,))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: X.numpy()})
    with torch.no_grad():
        ref = gm.eval()(X)
    step = float(qc.quantizers(gm)["head.output_fake_quant"].scale)
    assert float((torch.from_numpy(got) - ref).abs().max()) <= 2 * step


@settings(max_examples=10)
@given(kind=st.sampled_from([k for k in KINDS if k != "module_list"]),
       transposed=st.booleans(), experts=st.integers(1, 4), dim=st.sampled_from([8, 16]),
       hidden=st.sampled_from([8, 24]), seed=st.integers(0, 2 ** 16))
def test_qat_freeze_convert_equals_fake_quant_within_one_output_step(
        kind, transposed, experts, dim, hidden, seed):
    model = moe(kind, seed=seed, dim=dim, hidden=hidden, experts=experts,
                k=min(2, experts), transposed=transposed)
    x = torch.randn(5, dim, generator=torch.Generator().manual_seed(seed))
    gm = qc.qcompile(model, "int8-qat", example_inputs=(x,))
    gm(x)  # observe a batch
    qc.freeze(gm)
    ref = copy.deepcopy(gm).eval()
    out = qc.convert(gm, example_inputs=(x,))
    step = float(qc.quantizers(ref)["head.output_fake_quant"].scale)
    with torch.no_grad():
        assert float((out(x) - ref(x)).abs().max()) <= step * (1 + 1e-5)


def test_a_rule_naming_expert_weights_it_cannot_reach_is_an_error():
    class Gather(torch.nn.Module):  # the experts' weight is read by an elementwise op
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 16, 16))

        def forward(self, x):
            return (self.w * x.unsqueeze(0)).sum(0)

    with pytest.raises(qc.QCompileError,
                       match=r"(?s)rules\[0\] names w \(Gather\).*drop the weight scheme"):
        qc.qcompile(Gather(), {"quant": {"mode": "qat", "rules": [
            {"match": {"module": "Gather"}, "weight": {"dtype": "int8"}}]}},
            example_inputs=(torch.randn(16, 16),))


def test_reads_weight_selects_only_ops_on_weights():
    class Attn(torch.nn.Module):  # q @ k.T reads no weight; x @ W does
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return (x @ x.t()) @ (x @ self.w)

    s = {"quant": {"mode": "qat", "rules": [
        {"match": {"op": "matmul", "reads_weight": True}, "weight": {"dtype": "int8"}}]}}
    gm = qc.qcompile(Attn(), s, example_inputs=(X,))
    assert sorted(qc.quantizers(gm)) == ["w_fake_quant"]
    (name,) = qc.report(gm).rule_matches[0]  # x @ W, not the other two
    consumer = next(n for n in gm.graph.nodes if n.name == name)
    assert any(getattr(a, "target", None) == "w_fake_quant" for a in consumer.args)


def test_a_preset_with_nothing_to_quantize_says_so():
    with pytest.raises(qc.QCompileError, match=r"select nothing to quantize.*LayerNorm"):
        qc.qcompile(torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Softmax(-1)),
                    "int8-qat", example_inputs=(X,))


def test_hugging_face_mixtral_experts_and_router_are_quantized():
    tf = pytest.importorskip("transformers")
    from qcompile.tools.bench.suites.moe import _router_picks

    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False)).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    gm = qc.qcompile(model, "int8-qat", example_kwargs={"input_ids": ids})
    qs = qc.quantizers(gm)
    experts = {n for n, p in model.named_parameters() if ".experts." in n}
    assert experts and all(f"{n}_fake_quant" in qs for n in experts)
    assert "model.layers.0.mlp.gate.weight_fake_quant" in qs  # the router
    none = qc.qcompile(model, {"quant": {"mode": "none"}}, example_kwargs={"input_ids": ids})
    with torch.no_grad():
        assert torch.equal(none(input_ids=ids)["logits"], model(input_ids=ids).logits)
    assert _router_picks(model, none, ids)


class _FunctionalAndBag(torch.nn.Module):
    """A functional conv on a buffer, a functional linear on a Parameter, an EmbeddingBag."""

    def __init__(self, channels: int, rows: int, dim: int, mode: str) -> None:
        super().__init__()
        self.register_buffer("kernel", torch.randn(channels, 1, 3, 3))
        self.w = torch.nn.Parameter(torch.randn(dim, channels) / channels ** 0.5)
        self.bag = torch.nn.EmbeddingBag(rows, dim, mode=mode)

    def forward(self, img, ids, offsets):
        feat = torch.nn.functional.conv2d(img, self.kernel).mean((2, 3))
        return torch.nn.functional.linear(feat, self.w) + self.bag(ids, offsets)


@settings(max_examples=6)
@given(channels=st.integers(1, 6), rows=st.integers(4, 20), dim=st.sampled_from([4, 8]),
       mode=st.sampled_from(["sum", "mean", "max"]), seed=st.integers(0, 2 ** 16))
def test_functional_weights_and_bags_convert_within_one_output_step(
        channels, rows, dim, mode, seed):
    torch.manual_seed(seed)
    model = _FunctionalAndBag(channels, rows, dim, mode)
    g = torch.Generator().manual_seed(seed)
    args = (torch.randn(2, 1, 6, 6, generator=g), torch.randint(0, rows, (7,), generator=g),
            torch.tensor([0, 3]))
    s = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": [
        {"match": {"op": ["conv2d", "linear"], "reads_weight": True},
         "weight": {"dtype": "int8", "granularity": "per_channel"},
         "activation": {"dtype": "uint8", "symmetric": False}},
        {"match": {"module": "EmbeddingBag"},
         "weight": {"dtype": "int8", "symmetric": False, "granularity": "per_channel"}},
        {"match": {"op": "add"}, "activation": {"dtype": "uint8", "symmetric": False}}]}})
    gm = qc.qcompile(model, s, example_inputs=args)
    assert qc.report(gm).parameters_quantized == 1.0 or channels * dim + rows * dim == sum(
        p.numel() for p in model.parameters())
    gm(*args)
    qc.freeze(gm)
    ref = copy.deepcopy(gm).eval()
    out = qc.convert(gm, example_inputs=args)
    step = float(qc.quantizers(ref)["add_fake_quant"].scale)
    with torch.no_grad():
        assert float((out(*args) - ref(*args)).abs().max()) <= step * (1 + 1e-5)
    assert "bag.weight.packed" in out.state_dict()
