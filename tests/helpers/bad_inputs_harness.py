"""The harness of the bad-input tables (``tests/test_bad_inputs*.py``).

A case builds a fresh model, inputs and graph (``World``), snapshots them, runs the mistake
and asserts the error class, that the message names what is wrong and says the fix, and
that nothing changed. ``check_case(case, tmp_path)`` runs one case.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
from torch import nn

import qcompile as qc

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Branchy(MLP):
    """Python control flow on a tensor's value: neither front end can capture it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc2(self.act(self.fc1(x)))
        return self.fc2(self.fc1(x))


class InPlace(MLP):
    """Writes its input in place (a timing run must not change the caller's tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc2(self.act(self.fc1(x)))


def spec_dict(mode: str = "static", target: str = "x86", **top: Any) -> dict[str, Any]:
    rules = [] if mode == "none" else [{"match": {"module": "Linear"},
                                        "weight": {"dtype": "int8"},
                                        "activation": {"dtype": "uint8", "symmetric": False}}]
    return {"quant": {"mode": mode, "target": target, "rules": rules}, **top}


# -- the harness ----------------------------------------------------------------------------
def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _flags(m: nn.Module) -> list[tuple[str, bool, str]]:
    return [(n, sub.training, type(sub).__name__) for n, sub in m.named_modules()]


def _quantizer_flags(gm: nn.Module) -> dict[str, tuple[bool, bool]]:
    return {n: (q.enabled, q.observe) for n, q in qc.quantizers(gm).items()}


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and (a[k].device.type == "meta" or torch.equal(a[k], b[k])) for k in a)


@dataclass
class World:
    """What a case may touch: a model, its example inputs, a tmp folder, and (built on
    first use) a graph compiled from a copy of the model with ``mode``."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    tmp: Path
    _graphs: dict[str, nn.Module]

    def graph(self, mode: str = "static", target: str = "x86", **top: Any) -> nn.Module:
        key = json.dumps([mode, target, top], sort_keys=True, default=str)
        if key not in self._graphs:
            spec = qc.CompileSpec.model_validate(spec_dict(mode, target, **top))
            self._graphs[key] = qc.qcompile(copy.deepcopy(self.model), spec,
                                            example_inputs=self.inputs)
        return self._graphs[key]

    def calibrated(self) -> nn.Module:
        gm = self.graph("static")
        if not all(q.enabled for q in qc.quantizers(gm).values()):
            qc.calibrate(gm, [self.inputs], progress=False)
        return gm

    def snapshot(self) -> Any:
        graphs = {k: (g.code if hasattr(g, "code") else None, _state(g), _flags(g),
                      _quantizer_flags(g)) for k, g in self._graphs.items()}
        return (_state(self.model), _flags(self.model), [t.clone() for t in self.inputs],
                graphs)


def assert_unchanged(before: Any, after: Any) -> None:
    (m0, f0, i0, g0), (m1, f1, i1, g1) = before, after
    assert _same_state(m0, m1), "the model's state changed"
    assert f0 == f1, "the model's structure or training flags changed"
    assert all(torch.equal(a, b) for a, b in zip(i0, i1)), "the example inputs changed"
    assert set(g0) <= set(g1)
    for k, (code, state, flags, qflags) in g0.items():
        code1, state1, flags1, qflags1 = g1[k]
        assert code == code1, f"graph {k}: code changed"
        assert _same_state(state, state1), f"graph {k}: state changed"
        assert flags == flags1, f"graph {k}: structure or training flags changed"
        assert qflags == qflags1, f"graph {k}: quantizer flags changed"


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[World], Any]
    error: type[Exception]
    names: tuple[str, ...]          # what the message must name (field, node, input, ...)
    fix: tuple[str, ...] = ()       # what the fix must say (QCompileError only)
    model: Callable[[], nn.Module] = MLP
    prepare: Callable[[World], Any] | None = None   # graphs to build before the snapshot


def case_table(cases: list[Case]) -> Callable[..., Callable[[Callable], Callable]]:
    """A ``@case(id, error, names, fix, model=..., prepare=...)`` decorator that appends
    to ``cases``."""
    def case(id: str, error: type[Exception], names: tuple[str, ...],
             fix: tuple[str, ...] = (), model: Callable[[], nn.Module] = MLP,
             prepare: Callable[[World], Any] | None = None) -> Callable[[Callable], Callable]:
        def register(run: Callable[[World], Any]) -> Callable[[World], Any]:
            cases.append(Case(id, run, error, names, fix, model, prepare))
            return run
        return register
    return case


def compile_(w: World, spec: Any, *args: Any, **kwargs: Any) -> nn.Module:
    if isinstance(spec, dict):
        spec = qc.CompileSpec.model_validate(spec)
    return qc.qcompile(w.model, spec, *args, **kwargs)



# -- running the suite ------------------------------------------------------------------------
def message_ok(err: BaseException, case: Case) -> None:
    text = str(err)
    for name in case.names:
        assert name in text, f"the message does not name {name!r}:\n{text}"
    if isinstance(err, qc.QCompileError):
        assert err.fix, f"no fix given:\n{text}"
        for word in case.fix:
            assert word in err.fix or word in text, f"the fix does not say {word!r}:\n{text}"
    else:
        assert isinstance(err, pydantic.ValidationError)


def check_case(c: Case, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = c.model()
    world = World(model=model, inputs=(X.clone(),), tmp=tmp_path, _graphs={})
    if c.prepare is not None:
        c.prepare(world)
    before = world.snapshot()
    with pytest.raises(c.error) as info:
        c.run(world)
    message_ok(info.value, c)
    assert_unchanged(before, world.snapshot())
