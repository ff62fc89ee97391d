"""``qc.convert``: integer kernels match the fake-quant graph within one quantization
step, serialized weights shrink, the input graph is untouched, and bad input is refused;
``qc.calibrate`` refuses QAT and dynamic graphs."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from convert_specs import spec
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import qcompile as qc
from qcompile.runtime.quantized import ActivationQParams, IntWeight, pack_int4, unpack_int4

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(8, 8, 3, padding="same")  # no kernel path: int storage
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        y = torch.relu(self.conv3(y))
        return self.fc(torch.flatten(nn.functional.max_pool2d(y, 2), 1))


def mlp(width: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def data(shape: tuple[int, ...], n: int, seed: int = 0) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen),) for _ in range(n)]


def ready(model: nn.Module, s: qc.CompileSpec, shape: tuple[int, ...]) -> torch.fx.GraphModule:
    batches = data(shape, 4)
    gm = qc.qcompile(model, s, example_inputs=batches[0])
    if s.quant.mode == "static":
        qc.calibrate(gm, batches, progress=False)
    elif s.quant.mode == "qat":
        opt = torch.optim.SGD(gm.parameters(), lr=1e-3)
        gm.train()
        for (x,) in batches:  # a few real steps: weights, BN statistics and ranges move
            gm(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return gm


def last_step(gm: torch.fx.GraphModule) -> float:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    (node,) = torch.utils._pytree.tree_leaves(out.args[0])
    return float(gm.get_submodule(str(node.target)).scale[0])


def size(state: dict) -> int:
    buf = io.BytesIO()
    torch.save(state, buf)
    return len(buf.getvalue())


# -- numerics ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["symbolic", "export"])
@pytest.mark.parametrize("preset", ["int8-static", "int8-qat"])
def test_converted_cnn_within_one_step_of_fake_quant(preset: str, method: str) -> None:
    torch.manual_seed(0)
    gm = ready(CNN(), spec(preset, trace={"method": method}), (4, 3, 8, 8))
    ref = qc.freeze(copy.deepcopy(gm)).eval()
    example = data((4, 3, 8, 8), 1, seed=9)[0]
    out = qc.convert(gm, example_inputs=example)
    rep = qc.report(out)
    step = last_step(ref)
    with torch.no_grad():  # the check qc.convert ran on itself, redone here
        assert float((out(*example) - ref(*example)).abs().max()) <= step * (1 + 1e-5)
    assert rep.max_deviation["output0_steps"] <= 1.0 + 1e-6  # and the report says so
    kinds = {c.op for c in rep.conversions}
    assert {"quantized::conv_relu", "quantized::add", "quantized::linear"} <= kinds
    if method == "symbolic":  # (export spells padding='same' out as numbers)
        assert any(c.path == "int_storage" for c in rep.conversions), "padding='same' conv"
    with torch.no_grad():
        for (x,) in data((4, 3, 8, 8), 3, seed=5):  # other data than the check's
            assert float((out(x) - ref(x)).abs().max()) <= step * (1 + 1e-5)


@pytest.mark.parametrize("preset", ["int8-static", "int8-qat"])
def test_converted_mlp_is_all_kernels_within_one_step(preset: str) -> None:
    """Every Linear becomes an integer kernel, and the output is within one output step
    of the fake-quant graph (not exact: the float32 fake-quant and the integer kernel may
    round a near-tie apart; test_convert_reference.py checks the integers themselves)."""
    torch.manual_seed(0)
    gm = ready(mlp(), spec(preset), (8, 16))
    ref = qc.freeze(copy.deepcopy(gm)).eval()
    out = qc.convert(gm, example_inputs=data((64, 16), 1, seed=3)[0])
    kernels = [m for m in out.children() if not isinstance(m, ActivationQParams)]
    assert len(kernels) == 3 and all(isinstance(m, torch.ao.nn.quantized.Linear)
                                     for m in kernels)
    step = last_step(ref)
    with torch.no_grad():
        for (x,) in data((64, 16), 4, seed=3):  # the example input first, then others
            assert float((out(x) - ref(x)).abs().max()) <= step * (1 + 1e-5)


def test_dynamic_linear_matches_dynamic_fake_quant() -> None:
    torch.manual_seed(0)
    gm = ready(mlp(), spec("int8-dynamic", inputs=False), (8, 16))
    out = qc.convert(gm)
    assert [c.op for c in qc.report(out).conversions] == ["quantized::linear_dynamic"] * 3
    with torch.no_grad():
        for (x,) in data((32, 16), 3, seed=2):
            ref = gm.eval()(x)
            # activation qparams per batch from fbgemm's own min/max: rounding may differ
            # in the last bit of a scale, far below one step
            assert float((out(x) - ref).abs().max()) <= 1e-3 * float(ref.abs().max())


def test_int4_weights_reproduce_fake_quant() -> None:
    torch.manual_seed(0)
    d = spec("w4a8-qat", inputs=False).model_dump()
    d["quant"]["rules"][0]["weight"] = {"dtype": "int4", "granularity": "per_channel"}
    gm = ready(mlp(64), qc.CompileSpec.model_validate(d), (8, 16))
    out = qc.convert(gm)
    assert {c.op for c in qc.report(out).conversions if c.path == "int_storage"} == {
        "int4 weight"}
    ref = qc.freeze(gm).eval()
    with torch.no_grad():
        x = torch.randn(8, 16)
        assert torch.equal(out(x), ref(x)), "fp32 scales: bit-identical"


# -- size --------------------------------------------------------------------------------
def _big(layers: int = 2, width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


@pytest.mark.parametrize(("weight", "budget"), [
    ({"dtype": "int8", "granularity": "per_channel"}, 0.26),
    ({"dtype": "int4", "granularity": "per_channel"}, 0.14),
    # groups of 32 carry a float16 scale per 32 weights: 1/64 of fp32 on top of 1/8
    ({"dtype": "int4", "granularity": "per_group", "group_size": 32}, 0.1425),
])
def test_serialized_size(weight: dict, budget: float) -> None:
    model = _big()
    s = qc.CompileSpec.model_validate({"quant": {"mode": "static", "rules": [
        {"match": {"module": "Linear"}, "weight": weight}]}})
    gm = qc.qcompile(model, s, example_inputs=(torch.randn(2, 1024),))
    out = qc.convert(gm)
    ratio = size(out.state_dict()) / size(model.state_dict())
    assert ratio <= budget, f"{ratio:.4f}"
    x = torch.randn(4, 1024)
    with torch.no_grad():
        assert float((out(x) - gm.eval()(x)).abs().max()) < 1e-2


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")  # torch's load
def test_state_dict_round_trips_and_loads_without_pickle_code() -> None:
    torch.manual_seed(0)
    gm = ready(CNN(), spec("int8-static"), (2, 3, 8, 8))
    a, b = qc.convert(gm), qc.convert(gm)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(a(x), b(x))
    assert "fc.weight" not in a.state_dict(), "float weights are not kept"


def test_pipeline_stages_convert_and_keep_their_names() -> None:
    torch.manual_seed(0)
    gm = ready(mlp(), spec("int8-static", pipeline={"stages": 2}), (8, 16))
    ref = qc.freeze(copy.deepcopy(gm)).eval()
    out = qc.convert(gm, example_inputs=(torch.randn(8, 16),))
    step = float(qc.quantizers(ref)["stage_1.4.output_fake_quant"].scale[0])  # the output's
    with torch.no_grad():
        for (x,) in data((8, 16), 3, seed=4):
            assert float((out(x) - ref(x)).abs().max()) <= step * (1 + 1e-5)
    state = out.state_dict()
    assert {k.split(".")[0] for k in state} >= {"stage_0", "stage_1"}
    again = qc.convert(gm)
    again.load_state_dict(state)
    x = torch.randn(8, 16)
    assert torch.equal(again(x), out(x))


# -- the input graph is untouched -------------------------------------------------------------
def test_convert_leaves_its_input_alone() -> None:
    torch.manual_seed(0)
    gm = ready(CNN(), spec("int8-qat"), (2, 3, 8, 8))
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    flags = {n: (q.enabled, q.observe) for n, q in qc.quantizers(gm).items()}
    code, training = gm.code, gm.training
    qc.convert(gm, example_inputs=(torch.randn(2, 3, 8, 8),))
    assert gm.code == code and gm.training == training
    assert flags == {n: (q.enabled, q.observe) for n, q in qc.quantizers(gm).items()}
    after = gm.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- refusals -----------------------------------------------------------------------------
def test_convert_refuses_an_uncalibrated_static_graph() -> None:
    gm = qc.qcompile(mlp(), "int8-static", example_inputs=(torch.randn(2, 16),))
    with pytest.raises(qc.QCompileError, match="no ranges yet") as e:
        qc.convert(gm)
    assert "qc.calibrate" in e.value.fix


def test_convert_refuses_an_untrained_qat_graph_and_a_float_graph() -> None:
    gm = qc.qcompile(mlp(), "int8-qat", example_inputs=(torch.randn(2, 16),))
    with pytest.raises(qc.QCompileError, match="no ranges yet"):
        qc.convert(gm)
    with pytest.raises(qc.QCompileError, match="no quantizers"):
        qc.convert(qc.qcompile(mlp(), qc.CompileSpec()))
    with pytest.raises(qc.QCompileError, match="no qcompile report"):
        qc.convert(mlp())


@pytest.mark.parametrize("preset", ["int8-qat", "int8-dynamic"])
def test_calibrate_refuses_qat_and_dynamic_graphs(preset: str) -> None:
    gm = qc.qcompile(mlp(), preset, example_inputs=(torch.randn(2, 16),))
    with pytest.raises(qc.QCompileError, match=f"quant.mode '{preset.split('-')[1]}'") as e:
        qc.calibrate(gm, [(torch.randn(2, 16),)])
    assert "static" in e.value.fix


# -- int4 packing -------------------------------------------------------------------------------
@given(st.lists(st.integers(-8, 7), min_size=0, max_size=64))
def test_int4_pack_round_trip(values: list[int]) -> None:
    q = torch.tensor(values, dtype=torch.int8)
    packed = pack_int4(torch.cat([q, q.new_zeros(len(values) % 2)]))
    assert packed.numel() == (len(values) + 1) // 2
    assert torch.equal(unpack_int4(packed, len(values)), q)


def test_int_weight_dequantizes_like_the_formula() -> None:
    q = torch.randint(-8, 8, (6, 64), dtype=torch.int8)
    scale = torch.rand(6 * 2) + 0.1
    w = IntWeight(q, scale, torch.zeros(12, dtype=torch.int32), group_size=32, bits=4)
    expect = (q.float().reshape(6, 2, 32) * scale.view(6, 2, 1)).reshape(6, 64)
    assert torch.equal(w(), expect)
    assert w.zero_point.numel() == 1



@pytest.mark.parametrize(("weight", "path"), [
    # fbgemm wants zero point 0: an asymmetric grid that lands on 0 still gets the kernel
    ({"dtype": "int8", "symmetric": False}, "either"),
    ({"dtype": "int7", "granularity": "per_channel"}, "kernel"),  # fits the int8 grid
    ({"dtype": "uint8", "symmetric": True}, "kernel"),  # zero point 128: the int8 grid shifted
    ({"dtype": "int16"}, "int_storage"),  # no 16-bit kernel
])
def test_weights_without_a_kernel_fall_back_with_a_note(weight: dict, path: str) -> None:
    torch.manual_seed(0)
    s = qc.CompileSpec.model_validate({"quant": {
        "mode": "static", "inputs": {"dtype": "uint8", "symmetric": False},
        "rules": [{"match": {"module": "Linear"}, "weight": weight,
                   "activation": {"dtype": "uint8", "symmetric": False}}]}})
    gm = ready(mlp(), s, (8, 16))
    ref = qc.freeze(copy.deepcopy(gm)).eval()
    out = qc.convert(gm, example_inputs=(torch.randn(8, 16),))
    rep = qc.report(out)
    layer = [c for c in rep.conversions if c.path in ("kernel", "int_storage")]
    assert {c.path for c in layer} <= ({"kernel", "int_storage"} if path == "either" else {path})
    assert all("no integer kernel" in c.note for c in layer if c.path == "int_storage")
    with torch.no_grad():
        for (x,) in data((8, 16), 3, seed=6):
            assert float((out(x) - ref(x)).abs().max()) <= last_step(ref) * (1 + 1e-5)
