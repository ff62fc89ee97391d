"""``qc.sqnr`` against references computed here from the definition
``10 * log10(sum(ref ** 2) / sum((ref - q) ** 2))`` (float64, all batches together):
the reference of a layer is the float model's output of its whole fusion group (a folded
BatchNorm's output, not the conv's), batches may be dicts of keyword inputs, and the
edge cases (no error, no signal) are what the docstring says.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch import nn

import qcompile as qc
from qcompile.measure import power, sqnr_db


class Block(nn.Module):
    """A ResNet basic block: conv-bn-relu, conv-bn (no ReLU: what a static graph folds
    into the conv), the skip add, a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(y)) + x)


def block() -> Block:
    torch.manual_seed(0)
    m = Block()
    with torch.no_grad():  # BatchNorm far from identity: pre- and post-BN values differ
        for bn in (m.bn1, m.bn2):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.25, 4)
            bn.weight.uniform_(0.5, 3)
            bn.bias.uniform_(-2, 2)
    return m.eval()


def inputs(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, 6, 6, generator=gen) for _ in range(n)]


def reference_db(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The definition, in numpy float64, over all batches together."""
    ref = np.concatenate([r.detach().numpy().astype(np.float64).ravel() for r, _ in pairs])
    q = np.concatenate([o.detach().numpy().astype(np.float64).ravel() for _, o in pairs])
    return float(10 * np.log10(np.sum(ref ** 2) / np.sum((ref - q) ** 2)))


def capture(module: nn.Module, store: list[torch.Tensor], pre: bool = False) -> None:
    if pre:  # the module's input: the value before it (here: the skip add)
        module.register_forward_pre_hook(lambda m, a: store.append(a[0].detach().clone()))
    else:
        module.register_forward_hook(lambda m, a, out: store.append(out.detach().clone()))


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_conv_bn_rows_compare_with_the_float_batchnorm_output(method: str) -> None:
    xs = inputs()
    spec = qc.load_spec("int8-static").model_dump()
    spec["trace"]["method"] = method
    spec["quant"]["inputs"] = None  # the model input stays float: the rows are the layers'
    gm = qc.calibrate(qc.qcompile(block(), spec, example_inputs=(xs[0],)), xs,
                      progress=False)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())  # folded
    rows = qc.sqnr(gm, block(), xs)

    # the values the definition compares, taken with hooks on separate copies: the float
    # model's group outputs (bn1+relu1, bn2, the add) and the graph's quantizers after them
    ref_model, graph = block(), qc.qcompile(block(), spec, example_inputs=(xs[0],))
    graph.load_state_dict(gm.state_dict())
    for q in qc.quantizers(graph).values():
        q.observe = False
        q.enabled = True
    graph.eval()
    float_at = {"conv1": (ref_model.relu1, False), "conv2": (ref_model.bn2, False),
                "add": (ref_model.relu2, True)}
    quant_at = {"conv1": "conv1.output_fake_quant", "conv2": "conv2.output_fake_quant",
                "add": "add_fake_quant"}
    got: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for key, (module, pre) in float_at.items():
        got[key] = ([], [])
        capture(module, got[key][0], pre)
        capture(graph.get_submodule(quant_at[key]), got[key][1])
    with torch.no_grad():
        for x in xs:
            ref_model(x)
            graph(x)
    expected = {k: reference_db(list(zip(*v))) for k, v in got.items()}

    # rows are named by the float graph: the layer (its call, or its re-expressed op)
    names = {"symbolic": {"conv1": "relu1", "conv2": "conv2", "add": "add"},
             "export": {"conv1": "relu", "conv2": "conv2d_1", "add": "add"}}[method]
    by_row = {r["node"]: r["sqnr_db"] for r in rows}
    assert set(by_row) == set(names.values())
    for key, row in names.items():
        assert abs(by_row[row] - expected[key]) < 0.5, (row, by_row[row], expected[key])
    # the conv2 row is an int8 conv+bn output: far above the pre-BN comparison's < 0 dB
    assert by_row[names["conv2"]] > 20
    assert [r["sqnr_db"] for r in rows] == sorted(r["sqnr_db"] for r in rows)


class Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x) + shift)


def test_dict_batches_measure_like_tuples() -> None:
    torch.manual_seed(0)
    model = Keyword().eval()
    gen = torch.Generator().manual_seed(2)
    tuples = [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen))
              for _ in range(3)]
    dicts = [{"x": x, "shift": s} for x, s in tuples]
    gm = qc.qcompile(model, "int8-static", example_kwargs=dicts[0])
    gm = qc.calibrate(gm, dicts, progress=False)
    by_dict, by_tuple = qc.sqnr(gm, model, dicts), qc.sqnr(gm, model, tuples)
    assert [r["node"] for r in by_dict] == [r["node"] for r in by_tuple] and by_dict
    assert all(a["sqnr_db"] == b["sqnr_db"] and 10 < a["sqnr_db"] < math.inf
               for a, b in zip(by_dict, by_tuple))


def test_zero_error_is_inf_and_zero_reference_reproduced_is_inf() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with torch.no_grad():  # every output is 0: a zero reference, exactly representable
        model[0].weight.zero_()
        model[0].bias.zero_()
    xs = inputs(1)[0].reshape(-1, 8)[:16]
    gm = qc.calibrate(qc.qcompile(model, "int8-static", example_inputs=(xs,)), [xs],
                      progress=False)
    rows = {r["node"]: r["sqnr_db"] for r in qc.sqnr(gm, model, [xs])}
    assert rows.pop("input_1") < math.inf  # the quantized model input (inputs: auto)
    assert list(rows.values()) == [math.inf]


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@given(arrays(np.float32, st.integers(1, 64), elements=finite),
       arrays(np.float32, 64, elements=st.floats(-1, 1, width=32)))
def test_formula_against_numpy_definition(ref: np.ndarray, noise: np.ndarray) -> None:
    out = ref + noise[: ref.size]
    signal, err = power(torch.from_numpy(ref), torch.from_numpy(out))
    r64, o64 = ref.astype(np.float64), out.astype(np.float64)
    want_s, want_n = np.sum(r64 ** 2), np.sum((r64 - o64) ** 2)
    assert signal == pytest.approx(want_s, rel=1e-12, abs=1e-300)
    assert err == pytest.approx(want_n, rel=1e-12, abs=1e-300)
    got = sqnr_db(signal, err)
    if want_n == 0:
        assert got == math.inf
    elif want_s == 0:
        assert got == -math.inf
    else:
        assert got == pytest.approx(10 * np.log10(want_s / want_n), abs=1e-9)


def test_formula_known_values() -> None:
    ref = torch.tensor([3.0, -4.0])  # signal 25
    assert sqnr_db(*power(ref, ref + torch.tensor([0.5, 0.0]))) == pytest.approx(20.0)
    assert sqnr_db(*power(ref, ref)) == math.inf
    assert sqnr_db(*power(torch.zeros(3), torch.ones(3))) == -math.inf
