"""``qc.export_onnx``: QDQ ONNX models that onnxruntime (CPU) runs at batch sizes other
than the export's, within one output quantization step of the fake-quant graph (eval
mode, frozen) on random data and on scikit-learn's digits; every quantizer kind; both
front ends; a 2-stage pipeline graph; errors that name the fix."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import qcompile as qc

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y)) + y
        return self.fc(torch.flatten(nn.functional.max_pool2d(y, 2), 1))


class Block(nn.Module):
    """A small pre-norm transformer block: attention by matmul/softmax, then an MLP."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // self.heads),
                            dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(torch.relu(self.up(self.norm2(x))))


def mlp(d_in: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def spec(preset: str, **changes: object) -> qc.CompileSpec:
    d = qc.load_spec(preset).model_dump()
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            d[section][field] = value
        else:
            d[section] = value
    return qc.CompileSpec.model_validate(d)


def with_rules(preset: str, rules: list[dict], **changes: object) -> qc.CompileSpec:
    return spec(preset, quant__rules=rules, **changes)


def ready(model: nn.Module, s: qc.CompileSpec, shape: tuple[int, ...], *,
          batches: list[torch.Tensor] | None = None) -> torch.fx.GraphModule:
    """Compiled, observed on a few batches (QAT: trained a few steps), frozen, eval."""
    torch.manual_seed(0)
    batches = batches or [torch.randn(shape) for _ in range(4)]
    gm = qc.qcompile(model, s, example_inputs=(batches[0],))
    if s.quant.mode == "static":
        qc.calibrate(gm, [(b,) for b in batches], progress=False)
    elif s.quant.mode == "qat":
        opt = torch.optim.SGD(gm.parameters(), lr=1e-3)
        for b in batches:  # real steps: weights, BN statistics and ranges move
            gm(b).square().mean().backward()
            opt.step()
            opt.zero_grad()
        qc.freeze(gm)
    return gm.eval()


def run_ort(path: Path, x: torch.Tensor, *, fuse: bool = True) -> np.ndarray:
    """onnxruntime's CPU output; ``fuse=False`` stops at its basic optimisations (before
    QDQ groups become QLinear* integer kernels)."""
    options = ort.SessionOptions()
    if not fuse:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def output_step(gm: torch.fx.GraphModule) -> float | None:
    """The scale of the quantizer producing the graph's output (None when the output is
    not quantized): the tolerance the contract gives."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = torch.utils._pytree.tree_leaves(out.args[0])
    node = leaves[0]
    if node.op != "call_module":
        return None
    fq = gm.get_submodule(str(node.target))
    return float(fq.scale.max()) if isinstance(fq, qc.FakeQuantize) else None


def export_and_compare(gm: torch.fx.GraphModule, tmp_path: Path, example: torch.Tensor,
                       inputs: list[torch.Tensor], *, tol: float | None = None,
                       fused_steps: float | None = 1.0) -> onnx.ModelProto:
    """Export at ``example``'s batch size, check the file, and compare onnxruntime with the
    fake-quant graph on every input (other batch sizes): the model as written (basic
    optimisations) within one output step, and after onnxruntime fused it into integer
    kernels within ``fused_steps`` steps (None: not checked). Returns the ONNX model."""
    path = qc.export_onnx(gm, tmp_path / "model.onnx", example_inputs=(example,))
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    step = tol if tol is not None else output_step(gm)
    for x in inputs:
        assert x.shape[0] != example.shape[0]
        with torch.no_grad():
            ref = gm(x).numpy()
        for fuse, steps in ((False, 1.0), (True, fused_steps)):
            if steps is None:
                continue
            got = run_ort(path, x, fuse=fuse)
            assert got.shape == ref.shape
            # no output quantizer (dynamic, weight-only): float rounding of the same math
            bound = (step * steps * 1.001 if step is not None
                     else 1e-4 * max(1.0, float(np.abs(ref).max())))
            dev = float(np.abs(got - ref).max())
            assert dev <= bound, f"fused={fuse}: max |onnxruntime - fake-quant| {dev} > {bound}"
    return model


def op_types(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


def initializer_types(model: onnx.ModelProto) -> set[str]:
    return {onnx.TensorProto.DataType.Name(t.data_type) for t in model.graph.initializer}


def batches_of(shape: tuple[int, ...], sizes: tuple[int, ...] = (1, 5)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn((n, *shape[1:]), generator=gen) * 1.5 for n in sizes]


# -- every mode, both front ends -------------------------------------------------------
@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_qat_cnn_per_channel_within_one_step(tmp_path: Path, method: str) -> None:
    shape = (4, 1, 8, 8)
    s = spec("int8-qat", trace={"method": method, "dynamic_dims": {"x": {0: "batch"}}}
             if method == "export" else {"method": "symbolic"})
    gm = ready(CNN(), s, shape)
    before = copy.deepcopy(gm.state_dict())
    code = gm.code
    # 1.5x the calibrated inputs go past the frozen ranges: the 7-bit clamp is exercised
    model = export_and_compare(gm, tmp_path, torch.randn(shape), batches_of(shape))
    assert {"QuantizeLinear", "DequantizeLinear", "Conv", "Clip"} <= op_types(model)
    assert "INT8" in initializer_types(model)  # weights stored as integers
    dq_axes = [a.i for n in model.graph.node if n.op_type == "DequantizeLinear"
               for a in n.attribute if a.name == "axis"]
    assert 0 in dq_axes  # per-channel weights
    # the batch is symbolic
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    # gm untouched
    assert gm.code == code
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())


def test_static_mlp(tmp_path: Path) -> None:
    shape = (8, 64)
    gm = ready(mlp(), spec("int8-static"), shape)
    model = export_and_compare(gm, tmp_path, torch.randn(shape), batches_of(shape, (3, 17)))
    assert "Clip" in op_types(model)  # x86: 7-bit activations


def test_full_range_has_no_clip(tmp_path: Path) -> None:
    """onednn_vnni: full 8-bit activations, QuantizeLinear's own saturation. The file
    computes the graph exactly (basic optimisations); onnxruntime's fused u8 x s8 kernels
    saturate 16-bit pair sums on CPUs without VNNI, as the target's name warns (and why
    x86 activations use 7 bits), so the fused result is only checked where VNNI exists."""
    shape = (8, 64)
    gm = ready(mlp(), spec("int8-static", quant__target="onednn_vnni"), shape)
    model = export_and_compare(gm, tmp_path, torch.randn(shape), batches_of(shape, (3, 17)),
                               fused_steps=None)
    assert "Clip" not in op_types(model)


@pytest.mark.parametrize("target", ["x86", "onednn_vnni"])
def test_dynamic_mlp(tmp_path: Path, target: str) -> None:
    shape = (4, 64)
    gm = ready(mlp(), spec("int8-dynamic", quant__target=target), shape)
    model = export_and_compare(gm, tmp_path, torch.randn(shape), batches_of(shape))
    if target == "onednn_vnni":  # full uint8 range: onnxruntime's own dynamic quantizer
        assert "DynamicQuantizeLinear" in op_types(model)
    else:  # 7-bit: the same qparam formula in ONNX ops, then QuantizeLinear + Clip
        assert {"ReduceMin", "ReduceMax", "QuantizeLinear", "Clip"} <= op_types(model)


def test_w4a8_per_group_int4_and_per_token(tmp_path: Path) -> None:
    shape = (4, 64)
    gm = ready(mlp(), spec("w4a8-qat"), shape)
    model = export_and_compare(gm, tmp_path, torch.randn(shape), batches_of(shape))
    assert "INT4" in initializer_types(model)
    blocks = {a.i for n in model.graph.node if n.op_type == "DequantizeLinear"
              for a in n.attribute if a.name == "block_size"}
    assert 32 in blocks  # blocked (per-group) dequantization, group_size 32


def test_per_tensor_weights_and_int16_activations(tmp_path: Path) -> None:
    rules = [{"match": {"module": "Linear"},
              "weight": {"dtype": "int8", "granularity": "per_tensor"},
              "activation": {"dtype": "int16", "symmetric": False}}]
    shape = (4, 64)
    gm = ready(mlp(), with_rules("int8-qat", rules), shape)
    model = export_and_compare(gm, tmp_path, torch.randn(shape), batches_of(shape))
    assert "INT16" in initializer_types(model) or any(
        "INT16" in str(v.type) for v in model.graph.value_info)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8(tmp_path: Path, fmt: str) -> None:
    rules = [{"match": {"module": "Linear"},
              "weight": {"dtype": "fp8_e4m3", "granularity": "per_channel"},
              "activation": {"dtype": fmt}}]
    shape = (4, 64)
    gm = ready(mlp(), with_rules("int8-qat", rules), shape)
    # fp8 steps grow with the value: one step of the format at the largest output
    with torch.no_grad():
        top = float(gm(batches_of(shape)[1]).abs().max())
    mantissa = 3 if fmt == "fp8_e4m3" else 2
    step = 2.0 ** (math.floor(math.log2(top)) - mantissa)
    model = export_and_compare(gm, tmp_path, torch.randn(shape), batches_of(shape), tol=step)
    assert "FLOAT8E4M3FN" in initializer_types(model)


def test_transformer_block(tmp_path: Path) -> None:
    shape = (2, 6, 32)
    gm = ready(Block(), spec("int8-qat"), shape)
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(3, 6, 32, generator=gen), torch.randn(1, 6, 32, generator=gen)]
    # onnxruntime's integer kernels (QLinearAdd, MatMulIntegerToFloat...) round at each of
    # the block's requantizations on their own: seen up to 2 steps on <1% of the outputs
    model = export_and_compare(gm, tmp_path, torch.randn(shape), inputs, fused_steps=2.0)
    assert {"MatMul", "Softmax", "LayerNormalization"} <= op_types(model)


def test_two_stage_pipeline_exports_whole(tmp_path: Path) -> None:
    shape = (4, 64)
    gm = ready(mlp(), spec("int8-qat", pipeline={"stages": 2, "devices": ["cpu", "cpu"]}),
               shape)
    assert {"stage_0", "stage_1"} <= {n for n, _ in gm.named_children()}
    ref_step = max(float(fq.scale.max()) for n, fq in qc.quantizers(gm).items()
                   if n.startswith("stage_1") and "output" in n)
    model = export_and_compare(gm, tmp_path, torch.randn(shape), batches_of(shape),
                               tol=ref_step)
    assert sum(n.op_type == "Gemm" for n in model.graph.node) == 3


def test_digits_accuracy_matches(tmp_path: Path) -> None:
    sklearn = pytest.importorskip("sklearn.datasets")
    data = sklearn.load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    gm = ready(CNN(), spec("int8-static"), (32, 1, 8, 8), batches=list(x[:256].split(64)))
    test = x[1000:1301]  # 301 digits: a batch size the export never saw
    export_and_compare(gm, tmp_path, x[:8], [test])
    with torch.no_grad():
        fake = gm(test).argmax(1)
    got = torch.from_numpy(run_ort(tmp_path / "model.onnx", test)).argmax(1)
    labels = torch.tensor(data.target[1000:1301])
    assert abs((got == labels).float().mean() - (fake == labels).float().mean()) <= 0.01
    assert (fake == got).float().mean() >= 0.99


def test_int8_weights_file_is_small(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    gm = ready(model, spec("int8-qat"), (4, 512))
    path = qc.export_onnx(gm, tmp_path / "q.onnx", example_inputs=(torch.randn(4, 512),))
    torch.onnx.export(model.eval(), (torch.randn(4, 512),), str(tmp_path / "f.onnx"),
                      dynamo=True, verbose=False, external_data=False)
    ratio = path.stat().st_size / (tmp_path / "f.onnx").stat().st_size
    assert ratio <= 0.27, ratio


# -- errors ------------------------------------------------------------------------------
def test_missing_extra_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def no_onnx(name: str, *args: object) -> object:
        if name.split(".")[0] in ("onnx", "onnxscript"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_onnx)
    gm = qc.qcompile(mlp(), "int8-qat", example_inputs=(torch.randn(2, 64),))
    with pytest.raises(qc.QCompileError, match=r"pip install qcompile\[onnx\]"):
        qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(torch.randn(2, 64),))


@torch.library.custom_op("qcompile_test_onnx::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Mystery(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.qcompile_test_onnx.mystery(self.fc(x))


def test_op_without_onnx_form_names_the_node(tmp_path: Path) -> None:
    gm = ready(Mystery(), spec("int8-static"), (4, 8))
    with pytest.raises(qc.QCompileError, match=r"graph node mystery.*no ONNX form"):
        qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(torch.randn(4, 8),))


class Flat(CNN):
    """Flattens by ``reshape(batch, -1)``: torch.export fixes the batch in the reshape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y)) + y
        return self.fc(nn.functional.max_pool2d(y, 2).reshape(x.shape[0], -1))


def test_specialised_batch_says_how_to_keep_it_dynamic(tmp_path: Path) -> None:
    shape = (4, 1, 8, 8)
    gm = ready(Flat(), spec("int8-qat", trace={"method": "export"}), shape)
    with pytest.raises(qc.QCompileError, match="dynamic_dims"):
        qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(torch.randn(shape),))
    # and with a fixed batch it exports
    path = qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(torch.randn(shape),),
                          dynamic_batch=False)
    x = torch.randn(shape)
    with torch.no_grad():
        ref = gm(x).numpy()
    assert np.abs(run_ort(path, x) - ref).max() <= output_step(gm) * 1.001


def test_needs_example_inputs(tmp_path: Path) -> None:
    gm = qc.qcompile(mlp(), "int8-qat")
    with pytest.raises(qc.QCompileError, match="example_inputs"):
        qc.export_onnx(gm, tmp_path / "m.onnx")


def test_demo_prints_a_hint_without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from qcompile.tools.quickstart import onnx_accuracy

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    lines: list[str] = []
    gm = qc.qcompile(mlp(), "int8-qat", example_inputs=(torch.randn(2, 64),))
    assert onnx_accuracy(gm, torch.randn(4, 64), torch.zeros(4), lines.append) is None
    assert len(lines) == 1 and "pip install qcompile[onnx]" in lines[0]


def test_a_quantized_layer_whose_output_nothing_reads_exports(tmp_path: Path) -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            self.a(x).argmax(-1)  # computed, never read
            return self.b(x)

    torch.manual_seed(0)
    gm = ready(Unused(), spec("int8-static"), (4, 8))
    export_and_compare(gm, tmp_path, torch.randn(4, 8), batches_of((4, 8), (3, 5)))
