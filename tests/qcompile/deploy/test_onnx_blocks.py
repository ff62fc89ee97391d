"""Block-format quantizers leaving the training world: ONNX (MXFP8 weights as FLOAT8
initializers under a blocked DequantizeLinear, which onnxruntime runs; the formats it cannot
run refused by name) and the encodings file (format and block size per quantizer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.runtime.block_formats import fake_quant_eager

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def block_spec(rules: list[dict], mode: str = "static") -> qc.CompileSpec:
    return qc.CompileSpec.model_validate({"quant": {"mode": mode, "rules": rules}})


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))


X = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))


# -- what onnxruntime runs ------------------------------------------------------------------
def _session(elem: int, raw: bytes, opset: int, op: str) -> object:
    """A one-node model reading a [2, 4] initializer of element type ``elem``."""
    q = helper.make_tensor("q", elem, [2, 4], raw, raw=True)
    s = helper.make_tensor("s", TensorProto.FLOAT, [2, 2], np.ones((2, 2), np.float32).tobytes(),
                           raw=True)
    node = (helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1, block_size=2)
            if op == "dq" else helper.make_node("Cast", ["q"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, [2, 4])], initializer=[q, s] if op == "dq" else [q])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 11
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_onnxruntime_runs_blocked_float8_but_not_float4() -> None:
    """The facts behind the export: blocked FLOAT8 DequantizeLinear runs on the CPU
    provider; FLOAT4E2M1 has neither a DequantizeLinear nor a Cast kernel (if a new
    onnxruntime adds them, mxfp4 / nvfp4 export can be enabled)."""
    e4m3 = bytes([0x38, 0x40, 0xB8, 0x7E, 0x01, 0x30, 0x3C, 0x44])  # 1 2 -1 448 ...
    y = _session(TensorProto.FLOAT8E4M3FN, e4m3, 21, "dq").run(None, {})[0]
    assert y[0].tolist() == [1.0, 2.0, -1.0, 448.0]
    fp4 = bytes([0x21, 0x43, 0x65, 0xF7])
    for op in ("dq", "cast"):
        with pytest.raises(Exception, match=r"NOT_IMPLEMENTED|Could not find an implementation"):
            _session(TensorProto.FLOAT4E2M1, fp4, 23, op)


# -- export ---------------------------------------------------------------------------------
def test_mxfp8_weights_export_as_blocked_float8_and_compute_the_fake_quant(
        tmp_path: Path) -> None:
    gm = qc.qcompile(mlp(), block_spec([
        {"match": {"name": "0"}, "weight": {"dtype": "mxfp8_e4m3"}},
        {"match": {"name": "2"}, "weight": {"dtype": "mxfp8_e5m2"}}]), example_inputs=(X,))
    path = qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(X,))
    model = onnx.load(path)
    inits = {i.name: i for i in model.graph.initializer}
    elems = sorted((i.data_type, tuple(i.dims)) for i in inits.values()
                   if i.data_type in (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2))
    assert elems == [(TensorProto.FLOAT8E4M3FN, (64, 64)), (TensorProto.FLOAT8E5M2, (32, 64))]
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 2
    for n in dqs:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["block_size"] == 32 and attrs["axis"] == 1 and len(n.input) == 2
        scale = onnx.numpy_helper.to_array(inits[n.input[1]])
        assert scale.shape[1] == 2 and np.all(np.log2(scale) == np.round(np.log2(scale)))
    # the dequantized weights are the fake-quant's, bit for bit
    model.graph.output.extend(helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT,
                                                            None) for n in dqs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    got, w0, w2 = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    sd = gm.state_dict()
    for w, name, fmt in ((w0, "0.weight", "mxfp8_e4m3"), (w2, "2.weight", "mxfp8_e5m2")):
        assert np.array_equal(w, fake_quant_eager(sd[name], fmt, 32).numpy())
    # the model: onnxruntime's Gemm sums in its own order (a few ulps of each sum)
    with torch.no_grad():
        ref = gm.eval()(x).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize(("fmt", "reason"), [
    ("mxfp4", "FLOAT4E2M1"), ("nvfp4", "FLOAT4E2M1"), ("mxfp6_e2m3", "6-bit float"),
    ("nf4", "NF4")])
def test_formats_onnxruntime_cannot_run_are_refused_by_layer(tmp_path: Path, fmt: str,
                                                            reason: str) -> None:
    gm = qc.qcompile(mlp(), block_spec([
        {"match": {"name": "0"}, "weight": {"dtype": "mxfp8_e4m3"}},
        {"match": {"name": "2"}, "weight": {"dtype": fmt}}]), example_inputs=(X,))
    with pytest.raises(qc.QCompileError) as e:
        qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(X,))
    assert "'2.weight'" in e.value.message and fmt in e.value.message
    assert reason in e.value.message and "qc.convert" in e.value.fix
    assert not (tmp_path / "m.onnx").exists()


def test_block_activations_are_refused(tmp_path: Path) -> None:
    gm = qc.qcompile(mlp(), block_spec([{"match": {"module": "Linear"},
                                         "weight": {"dtype": "mxfp8_e4m3"},
                                         "activation": {"dtype": "mxfp8_e4m3"}}]),
                     example_inputs=(X,))
    gm = qc.calibrate(gm, [(X,)], progress=False)
    with pytest.raises(qc.QCompileError) as e:
        qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(X,))
    assert "output_fake_quant" in e.value.message and "activation" in e.value.message
    assert "mxfp8_e4m3" in e.value.message


# -- encodings ------------------------------------------------------------------------------
ENC_RULES = [{"match": {"name": "0"}, "weight": {"dtype": "nvfp4"},
              "activation": {"dtype": "mxfp8_e4m3"}},
             {"match": {"name": "2"}, "weight": {"dtype": "int8"}}]


@pytest.fixture
def encoded(tmp_path: Path) -> tuple[torch.fx.GraphModule, Path, dict]:
    gm = qc.calibrate(qc.qcompile(mlp(), block_spec(ENC_RULES), example_inputs=(X,)), [(X,)],
                      progress=False)
    path = tmp_path / "m.encodings"
    qc.export_encodings(gm, path)
    return gm, path, json.loads(path.read_text())


def test_encodings_name_each_block_format_and_load_back(encoded) -> None:
    gm, path, data = encoded
    assert data["param_encodings"]["0.weight"] == [{
        "bitwidth": 4, "dtype": "float", "is_symmetric": True, "block_format": "nvfp4",
        "block_size": 16, "scale_format": "e4m3*fp32", "qcompile_dtype": "nvfp4",
        "granularity": "per_group", "group_size": 16}]
    act = data["activation_encodings"]["0.output"]
    assert len(act) == 1 and act[0]["block_format"] == "mxfp8_e4m3"
    assert act[0]["block_size"] == 32 and act[0]["scale_format"] == "e8m0"
    assert act[0]["bitwidth"] == 8
    assert "block_format" not in data["param_encodings"]["2.weight"][0]
    with torch.no_grad():
        before = gm(X)
        qc.load_encodings(gm, path)
        assert torch.equal(gm(X), before)


@pytest.mark.parametrize(("key", "change", "said"), [
    ("0.weight", {"block_format": "mxfp4"}, "block_format 'mxfp4', the quantizer's is 'nvfp4'"),
    ("0.weight", {"block_size": 32}, "block_size 32, the quantizer's is 16"),
    ("0.weight", {"block_format": None}, "has no 'block_format'"),
    ("2.weight", {"block_format": "nvfp4"}, "is a block-format encoding ('nvfp4')"),
])
def test_load_encodings_refuses_another_block_format(encoded, key: str, change: dict,
                                                     said: str) -> None:
    gm, path, data = encoded
    entry = data["param_encodings"][key][0]
    for field, value in change.items():
        if value is None:
            del entry[field]
        else:
            entry[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(qc.QCompileError) as e:
        qc.load_encodings(gm, path)
    assert said in e.value.message and key in e.value.message


def test_load_encodings_refuses_an_integer_entry_for_a_block_quantizer(encoded) -> None:
    gm, path, data = encoded
    data["param_encodings"]["0.weight"] = data["param_encodings"]["2.weight"][:1]
    path.write_text(json.dumps(data))
    with pytest.raises(qc.QCompileError) as e:
        qc.load_encodings(gm, path)
    assert "'0.weight'" in e.value.message and "nvfp4 in blocks of 16" in e.value.message
