"""``torch.save(gm)`` / ``torch.load(f, weights_only=False)`` round-trips a compiled graph
whole: both front ends, QAT / static / dynamic, pipelines and converted graphs give the
same outputs, quantizer state, state_dict, report and train flags after loading; the
safe recipe (state_dict + recompile + ``weights_only=True``) gives the same outputs too.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.graph.meta import QSCHEME_KEY, TENSOR_META


class Net(nn.Module):
    """conv-bn-relu, a residual add and a linear head (module level: picklable)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)))
        y = y + self.conv2(y)
        return self.fc(torch.flatten(y, 1))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


X_NET = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
X_MLP = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
PRESET = {"qat": "int8-qat", "static": "int8-static", "dynamic": "int8-dynamic"}


def spec_for(mode: str, method: str, **extra: object) -> dict:
    spec = qc.load_spec(PRESET[mode]).model_dump()
    spec["trace"]["method"] = method
    spec.update(extra)
    return spec


def roundtrip(obj: object) -> object:
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation
        return torch.load(f, weights_only=False)


def build(mode: str, method: str, model: nn.Module, x: torch.Tensor, **extra: object
          ) -> torch.fx.GraphModule:
    gm = qc.qcompile(model, spec_for(mode, method, **extra), example_inputs=(x,))
    if mode == "static":
        gen = torch.Generator().manual_seed(2)
        qc.calibrate(gm, [(torch.randn(x.shape, generator=gen),) for _ in range(3)],
                     progress=False)
    elif mode == "qat":  # a few training steps: live observers moved the qparams
        opt = torch.optim.SGD(gm.parameters(), lr=0.0)
        for _ in range(2):
            gm(x).sum().backward()
            opt.step()
            # the step's observations apply now, as train_step does (the state dict then
            # holds all of them)
            qc.distributed.sync_observers(gm)
    return gm


def quantizer_state(gm: nn.Module) -> dict[str, tuple]:
    return {name: (q.enabled, q.observe, q.scale.clone(), q.zero_point.clone())
            for name, q in qc.quantizers(gm).items()}


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    qa, qb = quantizer_state(a), quantizer_state(b)
    assert list(qa) == list(qb)
    for k in qa:
        assert qa[k][:2] == qb[k][:2], k
        assert torch.equal(qa[k][2], qb[k][2]) and torch.equal(qa[k][3], qb[k][3]), k
    assert [m.training for m in a.modules()] == [m.training for m in b.modules()]
    # the same modules (a deep copy renames a GraphModule's class "GraphModule": torch's)
    def kinds(g: nn.Module) -> list[str]:
        return [(n, "GraphModule" if isinstance(m, torch.fx.GraphModule) else type(m).__name__)
                for n, m in g.named_modules()]

    assert kinds(a) == kinds(b)


def assert_same_outputs(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        ya, yb = a(x), b(x)
    assert torch.equal(ya, yb)


@pytest.mark.parametrize("method", ["symbolic", "export"])
@pytest.mark.parametrize("mode", ["qat", "static", "dynamic"])
def test_whole_graph_round_trips(mode: str, method: str) -> None:
    gm = build(mode, method, net(), X_NET)
    loaded = roundtrip(gm)
    assert_same_state(gm, loaded)
    assert_same_outputs(gm.eval() if mode != "qat" else gm, loaded, X_NET)
    assert qc.report(loaded).model_dump() == qc.report(gm).model_dump()
    assert qc.report(loaded).trace_method == method
    assert set(loaded.meta) == set(gm.meta)  # every gm.meta key (spec, folds, ...) kept
    # the graph keeps its node facts (annotate's schemes, shapes): passes still read them
    kept = [n.name for n in loaded.graph.nodes if QSCHEME_KEY in n.meta]
    assert kept == [n.name for n in gm.graph.nodes if QSCHEME_KEY in n.meta] and kept
    assert ([n.name for n in loaded.graph.nodes if TENSOR_META in n.meta]
            == [n.name for n in gm.graph.nodes if TENSOR_META in n.meta])


def test_qat_graph_keeps_training_after_load() -> None:
    gm = build("qat", "symbolic", net(), X_NET)
    loaded = roundtrip(gm)
    assert loaded.training and gm.training
    opt_a = torch.optim.SGD(gm.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(loaded.parameters(), lr=0.1)
    for opt, g in ((opt_a, gm), (opt_b, loaded)):  # the same step on both: same result
        opt.zero_grad()  # (gradients are not saved; build() left some on gm)
        g(X_NET).square().mean().backward()
        opt.step()
    assert_same_state(gm, loaded)
    assert_same_outputs(gm, loaded, X_NET)


def test_observer_sync_watch_survives() -> None:
    gm = build("qat", "symbolic", mlp(), X_MLP)
    loaded = roundtrip(gm)
    assert [h.__name__ for h in loaded._forward_pre_hooks.values()] == [
        h.__name__ for h in gm._forward_pre_hooks.values()]


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_pipeline_round_trips(method: str) -> None:
    gm = build("qat", method, mlp(), X_MLP, pipeline={"stages": 2})
    assert {n for n, _ in gm.named_children()} >= {"stage_0", "stage_1"}
    loaded = roundtrip(gm)
    assert {n for n, _ in loaded.named_children()} >= {"stage_0", "stage_1"}
    assert all(isinstance(loaded.get_submodule(s), torch.fx.GraphModule)
               for s in ("stage_0", "stage_1"))
    assert_same_state(gm, loaded)  # the state_dict under the model's own names
    assert_same_outputs(gm, loaded, X_MLP)
    assert qc.report(loaded).stages == qc.report(gm).stages
    # and it loads back into a fresh compile (the pipeline's load hook survived)
    fresh = qc.qcompile(mlp(), spec_for("qat", method, pipeline={"stages": 2}),
                        example_inputs=(X_MLP,))
    fresh.load_state_dict(loaded.state_dict())
    assert_same_outputs(gm, fresh, X_MLP)


@pytest.mark.parametrize(("mode", "method"), [("static", "symbolic"), ("static", "export"),
                                              ("dynamic", "symbolic"), ("qat", "symbolic")])
def test_converted_graph_round_trips(mode: str, method: str) -> None:
    gm = build(mode, method, net(), X_NET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        int8 = qc.convert(gm, example_inputs=(X_NET,))
    loaded = roundtrip(int8)
    assert_same_outputs(int8, loaded, X_NET)
    assert qc.report(loaded).conversions == qc.report(int8).conversions
    assert not loaded.training


def test_loaded_graph_converts_like_the_original() -> None:
    gm = build("static", "symbolic", net(), X_NET)
    loaded = roundtrip(gm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = qc.convert(gm, example_inputs=(X_NET,))
        b = qc.convert(loaded, example_inputs=(X_NET,))
    assert_same_outputs(a, b, X_NET)


def test_export_graph_keeps_its_input_guards() -> None:
    gm = build("static", "export", mlp(), X_MLP)
    loaded = roundtrip(gm)
    for g in (gm, loaded):
        with pytest.raises(AssertionError, match="Guard failed"):
            g(torch.randn(4, 9))


def test_model_class_is_not_needed_to_load() -> None:
    """The traced model's own class is recorded by name: a class defined in a function
    (not importable) does not stop the graph from saving or loading."""

    class Local(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    gm = build("qat", "symbolic", Local(), X_MLP)
    loaded = roundtrip(gm)
    assert_same_outputs(gm, loaded, X_MLP)


def test_loaded_copy_saves_again() -> None:
    import copy

    gm = build("static", "symbolic", mlp(), X_MLP)
    twice = roundtrip(copy.deepcopy(roundtrip(gm)))
    assert_same_state(gm, twice)
    assert qc.report(twice).model_dump() == qc.report(gm).model_dump()


@pytest.mark.parametrize(("mode", "method", "extra"), [
    ("qat", "symbolic", {}), ("static", "export", {}), ("dynamic", "symbolic", {}),
    ("qat", "symbolic", {"pipeline": {"stages": 2}})],
    ids=["qat", "static-export", "dynamic", "pipeline"])
def test_state_dict_recipe(mode: str, method: str, extra: dict, tmp_path) -> None:
    """The safe recipe: save the state_dict, compile the float model again from the spec,
    load with weights_only=True."""
    model_fn, x = (mlp, X_MLP) if extra else (net, X_NET)
    gm = build(mode, method, model_fn(), x, **extra)
    path = tmp_path / "gm.pt"
    torch.save(gm.state_dict(), path)
    fresh = qc.qcompile(model_fn(), spec_for(mode, method, **extra), example_inputs=(x,))
    fresh.load_state_dict(torch.load(path, weights_only=True))
    fresh.train(gm.training)
    assert_same_state(gm, fresh)
    assert_same_outputs(gm, fresh, x)


# -- casting: qparams stay float32 (the contract), also through save / load ------------------
@pytest.mark.parametrize("cast", ["bfloat16", "half"])
@pytest.mark.parametrize("mode", ["qat", "static", "dynamic"])
def test_cast_keeps_qparams_float32(mode: str, cast: str) -> None:
    gm = build(mode, "symbolic", mlp(), X_MLP)
    dtype = {"bfloat16": torch.bfloat16, "half": torch.float16}[cast]

    def qparam_dtypes(g: nn.Module) -> dict[str, torch.dtype]:
        return {k: v.dtype for k, v in g.state_dict().items()
                if k.rsplit(".", 1)[-1] in ("scale", "zero_point")}

    before = qparam_dtypes(gm)
    assert before and {d for k, d in before.items() if k.endswith(".scale")} == {torch.float32}
    gm = gm.to(torch.bfloat16) if cast == "bfloat16" else gm.half()
    assert qparam_dtypes(gm) == before  # scales float32, zero points their integer type
    assert gm.get_submodule("0").weight.dtype == dtype  # the model itself was cast
    assert all(q.scale.dtype == torch.float32 for q in qc.quantizers(gm).values())
    loaded = roundtrip(gm)
    assert qparam_dtypes(loaded) == before
    assert_same_outputs(gm.eval(), loaded.eval(), X_MLP.to(dtype))


def test_state_dict_recipe_for_converted_graphs(tmp_path) -> None:
    """Converted graphs: keep the state_dict of the graph before convert; recompile, load,
    convert again gives the same integer graph."""
    gm = build("static", "symbolic", net(), X_NET)
    torch.save(gm.state_dict(), tmp_path / "gm.pt")
    fresh = qc.qcompile(net(), spec_for("static", "symbolic"), example_inputs=(X_NET,))
    fresh.load_state_dict(torch.load(tmp_path / "gm.pt", weights_only=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = qc.convert(gm, example_inputs=(X_NET,))
        b = qc.convert(fresh, example_inputs=(X_NET,))
    assert_same_outputs(a, b, X_NET)
