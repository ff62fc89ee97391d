"""The ``equalize`` pass (``quant.algorithms: cross_layer_equalization``): the float function
is preserved (both front ends, depthwise chains, random channel scalings), per-tensor int8
weights lose less than round-to-nearest on badly scaled channels, results are
deterministic, and pairs it must not touch are left alone with a note."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qcompile as qc

CLE = {"kind": "cross_layer_equalization"}
W8 = {"dtype": "int8"}  # per-tensor symmetric int8 weights: RTN's weak spot


def spec(*, algorithms=(CLE,), method: str = "symbolic", activation: bool = False) -> dict:
    rule = {"match": {"module": ["Linear", "Conv2d"]}, "weight": W8}
    if activation:
        rule["activation"] = {"dtype": "uint8", "symmetric": False}
    return {"quant": {"mode": "static", "algorithms": list(algorithms), "rules": [rule]},
            "trace": {"method": method}}


def float_graph(gm):
    for q in qc.quantizers(gm).values():
        q.enabled = False
    return gm


def notes(gm, name: str = "equalize") -> list[str]:
    return [n for p in qc.report(gm).passes if p.name == name for n in p.notes]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(),
                         nn.Linear(12, 3)).eval()


class ConvChain(nn.Module):
    """conv -> ReLU -> depthwise conv -> ReLU -> conv (MobileNet's shape)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.conv2 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.conv2(torch.relu(self.dw(torch.relu(self.conv1(x)))))


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    return bool((a - b).abs().max() <= rtol * b.abs().max())


X = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
IMG = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def test_mlp_function_preserved_both_front_ends():
    m = mlp()
    for method in ("symbolic", "export"):
        gm = float_graph(qc.qcompile(m, spec(method=method), example_inputs=(X,)))
        assert close(gm(X), m(X)), method
        found = notes(gm)
        assert len(found) == 3 and found[0].startswith("equalized 0 -> 2 (16 channels)"), found


def test_depthwise_chain_equalized_and_preserved():
    m = ConvChain().eval()
    for method in ("symbolic", "export"):
        gm = float_graph(qc.qcompile(m, spec(method=method), example_inputs=(IMG,)))
        assert close(gm(IMG), m(IMG)), method
        found = notes(gm)
        assert [n.split(" (")[0] for n in found[:2]] == ["equalized conv1 -> dw",
                                                          "equalized dw -> conv2"], found


def test_user_model_untouched():
    m = mlp()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    qc.qcompile(m, spec(), example_inputs=(X,))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_equalized_ranges_match():
    """After the sweeps, each hidden channel has the same range on both sides."""
    gm = qc.qcompile(mlp(), spec(), example_inputs=(X,))
    for a, b in (("0", "2"), ("2", "4")):
        r1 = gm.get_parameter(f"{a}.weight").abs().amax(1)
        r2 = gm.get_parameter(f"{b}.weight").abs().amax(0)
        torch.testing.assert_close(r1, r2, rtol=1e-3, atol=0)


@settings(max_examples=15)
@given(st.lists(st.floats(-3.0, 3.0), min_size=16, max_size=16))
def test_random_channel_scaling_preserved_and_undone(log_scales):
    """Rescaling hidden channels by positive c (fc1 rows / c, fc2 columns * c) is a float
    identity; CLE keeps the function and lands on the same weights whatever c was."""
    m = mlp()
    c = torch.tensor(log_scales).exp()
    scaled = mlp()
    with torch.no_grad():
        scaled[0].weight.div_(c[:, None])
        scaled[0].bias.div_(c)
        scaled[2].weight.mul_(c[None, :])
    gm = float_graph(qc.qcompile(scaled, spec(), example_inputs=(X,)))
    assert close(gm(X), m(X), rtol=1e-5)
    ref = qc.qcompile(m, spec(), example_inputs=(X,))
    for name in ("0.weight", "0.bias", "2.weight"):
        torch.testing.assert_close(gm.get_parameter(name), ref.get_parameter(name),
                                   rtol=1e-4, atol=1e-6)


def _rtn_mse(m: nn.Module, algorithms, x: torch.Tensor) -> float:
    gm = qc.qcompile(m, spec(algorithms=algorithms, activation=True), example_inputs=(x,))
    qc.calibrate(gm, [x], progress=False)
    with torch.no_grad():
        return float((gm(x) - m(x)).pow(2).mean())


def badly_scaled(seed: int = 0) -> nn.Module:
    """Hidden channels of ranges spanning 1e-2 .. 1e2, compensated in the next layer."""
    m = mlp(seed)
    g = torch.Generator().manual_seed(seed)
    c = torch.logspace(-2, 2, 16)[torch.randperm(16, generator=g)]
    with torch.no_grad():
        m[0].weight.mul_(c[:, None])
        m[0].bias.mul_(c)
        m[2].weight.div_(c[None, :])
    return m


def test_beats_round_to_nearest_on_badly_scaled_channels():
    m = badly_scaled()
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(2))
    rtn, cle = _rtn_mse(m, [], x), _rtn_mse(m, [CLE], x)
    assert cle < rtn / 10, (rtn, cle)


def test_deterministic():
    m = badly_scaled()
    a = qc.qcompile(m, spec(), example_inputs=(X,)).state_dict()
    b = qc.qcompile(m, spec(), example_inputs=(X,)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class NoPair(nn.Module):
    """GELU and ReLU6 between the layers, a value read twice: nothing to equalize."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
        self.act = nn.ReLU6()

    def forward(self, x):
        h = self.a(x)
        y = self.b(torch.nn.functional.gelu(h)) + h
        return self.d(self.act(self.c(y)))


def test_no_pair_leaves_the_graph_unchanged():
    m = NoPair().eval()
    x = torch.randn(3, 4)
    with_cle = qc.qcompile(m, spec(), example_inputs=(x,))
    without = qc.qcompile(m, spec(algorithms=()), example_inputs=(x,))
    assert with_cle.code == without.code
    sa, sb = with_cle.state_dict(), without.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert notes(with_cle) == [
        "not equalized after c: act is not positively homogeneous (only ReLU is)",
        "quant.algorithms[0] (cross_layer_equalization): no conv/linear pair to equalize "
        "(layer -> [ReLU] -> layer, same kind, the value used by the second layer only); "
        "graph unchanged"]


def test_runs_after_fold_bn_and_before_annotate_in_spec_order():
    s = qc.CompileSpec.model_validate(spec(algorithms=[CLE, {"kind": "smoothquant"}, CLE]))
    from qcompile.passes import default_passes
    assert [p.name for p in default_passes(s)] == [
        "trace", "fold_bn", "equalize", "smooth", "equalize", "annotate", "insert_quant",
        "overwrite_inputs"]


def test_compile_once_with_real_weights_equalizes_and_refuses_a_checkpoint(tmp_path):
    """Single process: compile_once compiles the real model (equalized like qcompile); from
    a checkpoint it builds on meta and loads the weights afterwards, which the algorithm
    would never see: refused, naming the entry."""
    from safetensors.torch import save_file

    m = badly_scaled()
    s = qc.CompileSpec.model_validate(spec())
    gm = qc.distributed.compile_once(badly_scaled, s, (X,))
    ref = qc.qcompile(m, s, example_inputs=(X,))
    assert torch.equal(gm.get_parameter("0.weight"), ref.get_parameter("0.weight"))
    path = tmp_path / "m.safetensors"
    save_file({k: v.detach().contiguous() for k, v in m.state_dict().items()}, str(path))
    with pytest.raises(qc.QCompileError) as info:
        qc.distributed.compile_once(badly_scaled, s, (X,), checkpoint=str(path))
    assert info.value.message.startswith("quant.algorithms[0] (cross_layer_equalization): "
                                         "compile_once here builds the graph on the meta")


def test_pass_outside_its_spec_entry_is_refused():
    from qcompile.graph.context import Context
    from qcompile.passes.equalize import equalize

    ctx = Context(spec=qc.CompileSpec.model_validate(spec(algorithms=())), model=mlp())
    with pytest.raises(qc.QCompileError) as info:
        equalize(torch.fx.symbolic_trace(mlp()), ctx)
    assert info.value.message == ("the cross_layer_equalization pass runs for "
                                  "quant.algorithms[0], which is not in the spec")
