"""``qc.export_onnx`` against references computed here: the qparams and stored integers in
the file are read back with ``onnx`` and compared with the graph's quantizers (read through
``qc.quantizers``) and with ``clamp(round(w / scale) + zero_point)`` computed in the test;
onnxruntime's outputs are compared with the fake-quant graph within one step of the
quantizer producing the output (the contract's tolerance). Cases today's other tests do not
cover: asymmetric weights, per-channel activations, int8 activations before max-pool and
reshape, a QAT graph whose quantizers still observe, keyword inputs, a pipeline with
``transfer: int8``, and a failed write that must leave the previous file."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import qcompile as qc

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
from onnx import numpy_helper  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


class PoolNet(nn.Module):
    """Quantized conv outputs go through max-pool and a reshape (flatten) before the
    next layer: what onnxruntime moves Q/DQ pairs across."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        y = nn.functional.max_pool2d(torch.relu(self.conv2(y)), 2)
        return self.fc(torch.flatten(y, 1))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fa, self.fb = nn.Linear(16, 32), nn.Linear(4, 32)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fa(a) + self.fb(b)


def spec(mode: str, rules: list[dict], **top: object) -> qc.CompileSpec:
    return qc.CompileSpec.model_validate({"quant": {"mode": mode, "target": "x86",
                                                    "rules": rules}, **top})


def data(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def session(path: Path, fuse: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if not fuse:  # the file as written, before QDQ groups become integer kernels
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def within_one_step(path: Path, feeds: dict[str, torch.Tensor], ref: torch.Tensor,
                    step: float, *, fused: bool = True) -> None:
    """onnxruntime (as written, and with all its fusions) within one output step."""
    for fuse in (False, True) if fused else (False,):
        got = session(path, fuse).run(None, {k: v.numpy() for k, v in feeds.items()})[0]
        dev = float(np.abs(got - ref.numpy()).max())
        assert dev <= step * 1.001, f"fused={fuse}: {dev} > one step {step}"


def output_step(gm: nn.Module, name: str) -> float:
    return float(qc.quantizers(gm)[name].scale.max())


# -- reading the file back ---------------------------------------------------------------
class File:
    """Constants of an ONNX model by value name, following Cast / CastLike / Identity
    (the exporter's carriers) back to an initializer or Constant."""

    def __init__(self, path: Path) -> None:
        self.model = onnx.load(str(path))
        onnx.checker.check_model(self.model, full_check=True)
        self.inits = {t.name: t for t in self.model.graph.initializer}
        self.producer = {o: n for n in self.model.graph.node for o in n.output}

    def const(self, name: str) -> tuple[str, np.ndarray, int]:
        """``(root name, value, ONNX element type)`` of a constant value."""
        if name in self.inits:
            t = self.inits[name]
            return name, numpy_helper.to_array(t), t.data_type
        node = self.producer[name]
        if node.op_type == "Constant":
            t = node.attribute[0].t
            return name, numpy_helper.to_array(t), t.data_type
        assert node.op_type in ("Cast", "CastLike", "Identity"), node.op_type
        root, value, dtype = self.const(node.input[0])
        if node.op_type == "Cast":
            dtype = next(a.i for a in node.attribute if a.name == "to")
        return root, value, dtype

    def nodes(self, op: str) -> list[onnx.NodeProto]:
        return [n for n in self.model.graph.node if n.op_type == op]


def attr(node: onnx.NodeProto, name: str, default: int = 1) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


INT8, UINT8 = onnx.TensorProto.INT8, onnx.TensorProto.UINT8


def check_weights(f: File, gm: nn.Module) -> int:
    """Every weight quantizer's DequantizeLinear: scale, zero point, axis and element type
    as the quantizer's, and the stored integers ``clamp(round(w / s) + z)`` of the
    weight the graph holds. Returns how many were checked."""
    checked = 0
    for name, fq in qc.quantizers(gm).items():
        if not name.endswith("weight_fake_quant"):
            continue
        owner = gm.get_submodule(name.rpartition(".")[0])
        w = owner.weight.detach().float()
        dq = [n for n in f.nodes("DequantizeLinear") if n.input[1] == f"{name}.scale"]
        assert len(dq) == 1, name
        _, scale, _ = f.const(dq[0].input[1])
        _, zp, zp_type = f.const(dq[0].input[2])
        _, q, q_type = f.const(dq[0].input[0])
        s = fq.scale.detach().float().reshape(-1)
        z = fq.zero_point.detach().reshape(-1)
        assert np.array_equal(scale.reshape(-1), s.numpy()), name
        assert np.array_equal(zp.reshape(-1).astype(np.int64), z.numpy().astype(np.int64)), name
        assert zp_type == q_type == (INT8 if fq.quant_min < 0 else UINT8), name
        if fq.axis is not None:
            assert attr(dq[0], "axis") == fq.axis % w.dim(), name
            shape = [1] * w.dim()
            shape[fq.axis] = -1
            s, z = s.reshape(shape), z.reshape(shape)
        want = torch.clamp(torch.round(w / s) + z, fq.quant_min, fq.quant_max)
        assert np.array_equal(q.astype(np.int64), want.numpy().astype(np.int64)), name
        checked += 1
    return checked


def activation_qparams(f: File) -> list[tuple[tuple[float, ...], tuple[int, ...], int, int]]:
    """``(scale, zero point, axis, element type)`` of each QuantizeLinear the export
    wrote for an activation quantizer (the exporter names its module in ``namespace``)."""
    out = []
    for n in f.nodes("QuantizeLinear"):
        where = next((p.value for p in n.metadata_props if p.key == "namespace"), "")
        if "/qdq" not in where:
            continue  # a pair onnxruntime would otherwise insert (checked separately)
        _, scale, _ = f.const(n.input[1])
        _, zp, zp_type = f.const(n.input[2])
        axis = attr(n, "axis") if scale.size > 1 else -1
        out.append((tuple(scale.reshape(-1).tolist()),
                    tuple(zp.reshape(-1).astype(np.int64).tolist()), axis, zp_type))
    return sorted(out)


def expected_activation_qparams(gm: nn.Module
                                ) -> list[tuple[tuple[float, ...], tuple[int, ...], int, int]]:
    out = []
    for name, fq in qc.quantizers(gm).items():
        if name.endswith("weight_fake_quant") or fq.dynamic or not fq.enabled:
            continue
        scale = fq.scale.detach().float().reshape(-1)
        out.append((tuple(scale.tolist()), tuple(fq.zero_point.reshape(-1).tolist()),
                    fq.axis if fq.axis is not None else -1,
                    INT8 if fq.quant_min < 0 else UINT8))
    return sorted(out)


# -- the cases -----------------------------------------------------------------------------
def test_asymmetric_weights_and_per_channel_activations(tmp_path: Path) -> None:
    """Asymmetric per-channel int8 weights (non-zero zero points) and per-channel uint8
    activations; the example input is one bare tensor."""
    rules = [{"match": {"module": "Linear"},
              "weight": {"dtype": "int8", "symmetric": False, "granularity": "per_channel"},
              "activation": {"dtype": "uint8", "symmetric": False,
                             "granularity": "per_channel"}}]
    torch.manual_seed(0)
    x = data(8, 16)
    gm = qc.qcompile(mlp(), spec("static", rules), example_inputs=(x,))
    qc.calibrate(gm, [x, data(8, 16, seed=1)], progress=False)
    gm.eval()
    zps = [fq.zero_point for n, fq in qc.quantizers(gm).items() if "weight" in n]
    assert any(bool((z != 0).any()) for z in zps)  # the case a dropped zero point breaks
    path = qc.export_onnx(gm, tmp_path / "m.onnx", x)  # a bare tensor
    f = File(path)
    assert check_weights(f, gm) == 2
    got = activation_qparams(f)
    assert got == expected_activation_qparams(gm)
    assert {axis for _, _, axis, _ in got} == {1}
    x2 = data(5, 16, seed=2) * 1.5
    with torch.no_grad():
        ref = gm(x2)
    # per-channel activations stay in float kernels; the per-channel step bounds it
    within_one_step(path, {f.model.graph.input[0].name: x2}, ref,
                    output_step(gm, "2.output_fake_quant"))


def test_int8_activations_before_max_pool_and_reshape(tmp_path: Path) -> None:
    """Signed 8-bit asymmetric activations (x86: -64..63) feed max-pool and flatten: the
    file loads with all of onnxruntime's optimisations and matches within one step."""
    rules = [{"match": {"module": ["Conv2d", "Linear"]}, "weight": {"dtype": "int8"},
              "activation": {"dtype": "int8", "symmetric": False}}]
    x = data(4, 1, 8, 8)
    torch.manual_seed(0)
    gm = qc.qcompile(PoolNet(), spec("static", rules), example_inputs=(x,))
    qc.calibrate(gm, [(x,), (data(4, 1, 8, 8, seed=1),)], progress=False)
    gm.eval()
    assert all(q.quant_min == -64 for n, q in qc.quantizers(gm).items() if "output" in n)
    path = qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(x,))
    f = File(path)
    assert check_weights(f, gm) == 3
    assert activation_qparams(f) == expected_activation_qparams(gm)
    # the max-pooled and the flattened values each carry a Q/DQ pair of the conv2 output's
    # qparams, so onnxruntime finds no pair to copy across them
    conv2 = qc.quantizers(gm)["conv2.output_fake_quant"]
    pinned = [n for n in f.nodes("QuantizeLinear")
              if f.producer[n.input[0]].op_type in ("MaxPool", "Reshape")]
    assert len(pinned) == 2
    for n in pinned:
        assert float(f.const(n.input[1])[1]) == float(conv2.scale)
        assert int(f.const(n.input[2])[1]) == int(conv2.zero_point)
    x2 = data(6, 1, 8, 8, seed=3) * 1.5
    with torch.no_grad():
        ref = gm(x2)
    within_one_step(path, {"x": x2}, ref, output_step(gm, "fc.output_fake_quant"))


def test_qat_still_observing_exports_current_qparams(tmp_path: Path) -> None:
    """A QAT graph trained a few steps, not frozen: the file holds the qparams as they are
    (weights' too, though the weights moved since they were observed), with a warning,
    and computes the graph with its observers off. The graph itself is untouched."""
    x = data(8, 16)
    torch.manual_seed(0)
    gm = qc.qcompile(mlp(), "int8-qat", example_inputs=(x,))
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    for i in range(3):
        gm(data(8, 16, seed=10 + i)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    gm.eval()
    assert all(q.observe for q in qc.quantizers(gm).values())
    frozen = qc.freeze(copy.deepcopy(gm))  # freezing would re-observe the moved weights
    moved = [n for n, q in qc.quantizers(gm).items() if "weight" in n
             and not torch.equal(q.scale, qc.quantizers(frozen)[n].scale)]
    assert moved  # so a file holding freeze()'s qparams would fail the checks below
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    with pytest.warns(UserWarning, match="still observe"):
        path = qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(x,))
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())
    f = File(path)
    assert check_weights(f, gm) == 2
    assert activation_qparams(f) == expected_activation_qparams(gm)
    off = copy.deepcopy(gm)
    for q in qc.quantizers(off).values():
        q.observe = False
    x2 = data(5, 16, seed=4)
    with torch.no_grad():
        ref = off(x2)
    within_one_step(path, {f.model.graph.input[0].name: x2}, ref,
                    output_step(off, "2.output_fake_quant"))


def test_keyword_inputs_and_external_data(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyword inputs; and the initializers in ``m.onnx.data`` beside the model, as for a
    model too large for one protobuf (the size limit lowered to 0 here)."""
    monkeypatch.setattr("qcompile.deploy.onnx._EXTERNAL_DATA_BYTES", 0)
    rules = [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
              "activation": {"dtype": "uint8", "symmetric": False}}]
    a, b = data(4, 16), data(4, 4, seed=1)
    torch.manual_seed(0)
    gm = qc.qcompile(TwoInputs(), spec("static", rules), example_inputs=(a, b))
    qc.calibrate(gm, [{"a": a, "b": b}], progress=False)
    gm.eval()
    path = qc.export_onnx(gm, tmp_path / "m.onnx", example_kwargs={"a": a, "b": b})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    bare = onnx.load(str(path), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in bare.graph.initializer)
    f = File(path)
    assert [i.name for i in f.model.graph.input] == ["a", "b"]
    assert check_weights(f, gm) == 2
    assert activation_qparams(f) == expected_activation_qparams(gm)
    a2, b2 = data(3, 16, seed=5), data(3, 4, seed=6)
    with torch.no_grad():
        ref = gm(a=a2, b=b2)
    # the sum of two quantized outputs is not quantized again: the larger step bounds it
    step = output_step(gm, "fa.output_fake_quant") + output_step(gm, "fb.output_fake_quant")
    within_one_step(path, {"a": a2, "b": b2}, ref, step)


def test_pipeline_int8_transfer_and_atomic_write(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-stage graph with ``transfer: int8`` exports whole (the integers that cross the
    cut are the quantizer's own values); a second export that fails while writing leaves
    the first file as it was, and no temporary."""
    rules = [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
              "activation": {"dtype": "uint8", "symmetric": False}}]
    x = data(8, 16)
    torch.manual_seed(0)
    s = spec("static", rules, pipeline={"stages": 2, "devices": ["cpu", "cpu"],
                                        "transfer": "int8"})
    gm = qc.qcompile(mlp(), s, example_inputs=(x,))
    qc.calibrate(gm, [(x,)], progress=False)
    gm.eval()
    target = tmp_path / "m.onnx"
    qc.export_onnx(gm, target, example_inputs=(x,))
    f = File(target)
    assert activation_qparams(f) == expected_activation_qparams(gm)
    x2 = data(5, 16, seed=7)
    with torch.no_grad():
        ref = gm(x2)
    step = max(float(q.scale.max()) for n, q in qc.quantizers(gm).items()
               if n.startswith("stage_1") and "output" in n)
    within_one_step(path=target, feeds={f.model.graph.input[0].name: x2}, ref=ref, step=step)

    good = target.read_bytes()

    def torn(self: Path, payload: bytes) -> int:  # the disk fills up halfway
        with open(self, "wb") as out:
            out.write(payload[: len(payload) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", torn)
    with pytest.raises(OSError, match="No space"):
        qc.export_onnx(gm, target, example_inputs=(x,))
    monkeypatch.undo()
    assert target.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
