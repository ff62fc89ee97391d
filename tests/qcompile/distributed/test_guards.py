"""Wrappers people reach for (issue 13, items 3 and 4), in one process: ``nn.DataParallel``
is refused with the DDP recipe, a ``torch.compile``'d model is compiled from its original
module, and the once-only warning for observers nothing synchronises (its logic, with the
process group's answers monkeypatched; the 2-rank behaviour is in tests/dist)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qcompile as qc
import qcompile.distributed.data_parallel as dp
from qcompile.distributed.guards import refuse_wrapped, unwrap_compiled, wrapper_kind

X = torch.randn(4, 8)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# -- nn.DataParallel --------------------------------------------------------------------------
def test_data_parallel_is_refused_with_the_ddp_recipe() -> None:
    with pytest.raises(qc.QCompileError) as info:
        qc.qcompile(nn.DataParallel(mlp()), "int8-qat", (X,))
    e = info.value
    assert "nn.DataParallel" in e.message
    assert "replicas" in e.message and "observer" in e.message and "BatchNorm" in e.message
    recipe = e.fix.splitlines()[1:]
    assert len(recipe) == 3, e.fix
    assert "qc.qcompile" in recipe[0] and ".module" in recipe[0]
    assert "qc.distributed.wrap(gm, spec)" in recipe[1] and "ddp" in recipe[1]
    assert "torchrun" in recipe[2]


def test_data_parallel_inside_a_model_is_refused() -> None:
    outer = nn.Sequential(nn.DataParallel(mlp()), nn.ReLU())
    assert wrapper_kind(outer) == "DataParallel"
    with pytest.raises(qc.QCompileError, match=r"nn\.DataParallel"):
        refuse_wrapped(outer)


# -- torch.compile'd models -------------------------------------------------------------------
def test_compiled_model_is_compiled_from_its_original_module() -> None:
    model = mlp()
    gm = qc.qcompile(torch.compile(model), "int8-qat", (X,))
    ref = qc.qcompile(model, "int8-qat", (X,))
    names = [n for n, _ in gm.named_modules()]
    assert names == [n for n, _ in ref.named_modules()]
    assert not any("_orig_mod" in n for n in names) and "0.weight_fake_quant" in names
    assert any("torch.compile" in n and "_orig_mod" in n for n in qc.report(gm).passes[0].notes)
    assert not any("torch.compile" in n for p in qc.report(ref).passes for n in p.notes)
    torch.testing.assert_close(gm(X), ref(X), rtol=0, atol=0)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model is untouched


def test_duck_typed_compiled_wrapper_is_unwrapped() -> None:
    class Wrapper(nn.Module):  # what OptimizedModule looks like from outside
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self._orig_mod(x)

    inner = mlp()
    model, note = unwrap_compiled(Wrapper(inner))
    assert model is inner and note is not None
    assert unwrap_compiled(inner) == (inner, None)


def test_compiled_submodule_is_refused_naming_it() -> None:
    model = mlp()
    model[2] = torch.compile(model[2])
    with pytest.raises(qc.QCompileError) as info:
        qc.qcompile(model, "int8-qat", (X,))
    assert "'2'" in info.value.message and "torch.compile" in info.value.message
    assert "2._orig_mod" in info.value.fix


# -- observers nothing synchronises -----------------------------------------------------------
@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Pretend a process group of ``world["size"]`` ranks is initialised."""
    state = {"size": 2}
    monkeypatch.setattr(dp, "initialised", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: state["size"])
    return state


def unsynced(run) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
    return [w for w in seen if "nothing synchronises" in str(w.message)]


def steps(gm: nn.Module, n: int, after=None) -> None:
    for _ in range(n):
        gm(X).square().mean().backward()
        if after is not None:
            after(gm)


def test_unsynced_observers_warn_once_under_a_group(world: dict[str, int]) -> None:
    gm = qc.qcompile(mlp(), "int8-qat", (X,))
    seen = unsynced(lambda: steps(gm, 5))
    assert len(seen) == 1
    text = str(seen[0].message)
    assert "qc.distributed.wrap(gm, spec)" in text and "sync_observers(gm)" in text
    assert seen[0].category is UserWarning


def test_no_warning_when_synced_by_hand(world: dict[str, int],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gm = qc.qcompile(mlp(), "int8-qat", (X,))
    monkeypatch.setattr(dp, "collective_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None: None)
    assert unsynced(lambda: steps(gm, 5, after=qc.distributed.sync_observers)) == []


@pytest.mark.parametrize("case", ["one_rank", "no_group", "frozen", "eval", "spec_off",
                                  "wrapped"])
def test_no_warning_where_nothing_drifts(world: dict[str, int],
                                         monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    spec = qc.load_spec("int8-qat").model_dump()
    spec["quant"]["sync_observers"] = case != "spec_off"
    gm = qc.qcompile(mlp(), spec, (X,))
    if case == "one_rank":
        world["size"] = 1
    elif case == "no_group":
        monkeypatch.setattr(dp, "initialised", lambda: False)
    elif case == "frozen":
        qc.freeze(gm)
    elif case == "eval":
        gm.eval()
    elif case == "wrapped":
        monkeypatch.setattr(dp, "initialised", lambda: False)  # wrap with kind none: gm
        assert qc.distributed.wrap(gm, {**spec, "data_parallel": {"kind": "none"}}) is gm
        monkeypatch.setattr(dp, "initialised", lambda: True)
    assert unsynced(lambda: steps(gm, 4)) == []


def test_the_watch_is_one_hook_and_survives_pickling_by_reference() -> None:
    import pickle

    gm = qc.qcompile(mlp(), "int8-qat", (X,))
    hooks = list(gm._forward_pre_hooks.values())
    assert hooks.count(dp._check_observer_sync) == 1
    assert hooks.count(dp._apply_after_step) == 1  # step updates: applied after a step
    for hook in hooks:  # module-level functions: the graph pickles
        assert pickle.loads(pickle.dumps(hook)) is hook
    dp.watch_observer_sync(gm)  # idempotent
    assert list(gm._forward_pre_hooks.values()) == hooks


def test_compile_once_unwraps_a_compiled_model_too() -> None:
    gm = qc.distributed.compile_once(lambda: torch.compile(mlp()), "int8-qat", (X,))
    assert not any("_orig_mod" in n for n, _ in gm.named_modules())
    assert any("torch.compile" in n for n in qc.report(gm).passes[0].notes)
    assert dp._check_observer_sync in gm._forward_pre_hooks.values()
