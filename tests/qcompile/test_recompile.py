"""A graph ``qcompile`` returned is not compiled again: a clear ``QCompileError`` up front
(naming the cause and the fix), for both front ends, pipelines, converted graphs, graphs
loaded with ``torch.load``, and models an ``inplace=True`` compile took over; the graph
is left as it was.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.graph.meta import COMPILED_KEY

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def spec(mode: str = "qat", method: str = "symbolic", **extra: object) -> dict:
    rules = [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
              "activation": {"dtype": "uint8", "symmetric": False}}]
    quant = {"mode": mode, "rules": rules} if mode != "none" else {"mode": "none"}
    return {"quant": quant, "trace": {"method": method}, **extra}


def assert_refused(gm: nn.Module, new_spec: dict | str = "int8-qat") -> str:
    before = copy.deepcopy(gm.state_dict())
    modules = [(n, type(m)) for n, m in gm.named_modules()]
    with pytest.raises(qc.QCompileError) as info:
        qc.qcompile(gm, new_spec, example_inputs=(X,))
    text = str(info.value)
    assert "already" in text and "qcompile" in text
    assert "matched no node" not in text  # not the misleading rule error of before
    assert "fix: compile the original float model" in text
    assert "load" in info.value.fix and "state" in info.value.fix
    after = gm.state_dict()  # the refused graph is untouched
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert [(n, type(m)) for n, m in gm.named_modules()] == modules
    return text


@pytest.mark.parametrize("method", ["symbolic", "export"])
@pytest.mark.parametrize("mode", ["qat", "static", "dynamic", "none"])
def test_compiled_graph_is_refused(mode: str, method: str) -> None:
    gm = qc.qcompile(mlp(), spec(mode, method), example_inputs=(X,))
    assert gm.meta[COMPILED_KEY] == qc.__version__
    text = assert_refused(gm)
    assert text.startswith("qcompile: the model is already a graph returned by qcompile")
    assert f"quant.mode {mode!r}" in text


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_pipeline_graph_and_its_stages_are_refused(method: str) -> None:
    gm = qc.qcompile(mlp(), spec("qat", method, pipeline={"stages": 2}), example_inputs=(X,))
    assert_refused(gm)
    with pytest.raises(qc.QCompileError, match="already a graph returned by qcompile"):
        qc.qcompile(gm.get_submodule("stage_0"), "int8-qat")


def test_converted_graph_is_refused() -> None:
    gm = qc.qcompile(mlp(), spec("dynamic"), example_inputs=(X,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        int8 = qc.convert(gm, example_inputs=(X,))
    with pytest.raises(qc.QCompileError, match="already a graph returned by qcompile"):
        qc.qcompile(int8, "int8-dynamic", example_inputs=(X,))


def test_loaded_graph_is_refused() -> None:
    gm = qc.qcompile(mlp(), spec("qat"), example_inputs=(X,))
    f = io.BytesIO()
    torch.save(gm, f)
    f.seek(0)
    assert_refused(torch.load(f, weights_only=False))


def test_model_holding_a_compiled_graph_is_refused() -> None:
    gm = qc.qcompile(mlp(), spec("qat"), example_inputs=(X,))
    wrapper = nn.Sequential(gm, nn.Linear(4, 2))
    with pytest.raises(qc.QCompileError, match="module '0' of the model is already a graph"):
        qc.qcompile(wrapper, "int8-qat", example_inputs=(X,))


def test_model_taken_over_by_an_inplace_compile_is_refused() -> None:
    model = mlp()
    qc.qcompile(model, spec("qat"), example_inputs=(X,), inplace=True)
    with pytest.raises(qc.QCompileError, match="qcompile quantizer") as info:
        qc.qcompile(model, spec("qat"), example_inputs=(X,))
    assert "fresh instance" in info.value.fix


def test_the_documented_fix_works() -> None:
    """Changing the scheme: compile the float model with the new spec, load the state."""
    model = mlp()
    gm = qc.qcompile(model, spec("qat"), example_inputs=(X,))
    gm(X).sum().backward()
    with torch.no_grad():
        for p in gm.parameters():
            p.add_(0.01)
    model.load_state_dict(gm.state_dict(), strict=False)
    new = qc.qcompile(model, "int8-static", example_inputs=(X,))
    assert torch.equal(new.get_submodule("0").weight, gm.get_submodule("0").weight)


def test_float_model_still_compiles_twice() -> None:
    model = mlp()
    a = qc.qcompile(model, spec("qat"), example_inputs=(X,))
    b = qc.qcompile(model, spec("qat"), example_inputs=(X,))
    assert torch.equal(a(X), b(X))
