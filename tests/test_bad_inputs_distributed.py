"""Distributed mistakes that one process can make (the two-rank ones are in
``tests/dist/test_mistakes.py``), ``compile_once`` leaving the user's model alone, the
ranks' fingerprint comparison, and the compile cache's clean-up of killed writers."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from bad_inputs_harness import MLP, Case, World, X, case_table, check_case, spec_dict
from safetensors.torch import save_file
from torch import nn

import qcompile as qc
from qcompile.distributed.agree import differences
from qcompile.distributed.cache import STALE_AFTER_S, CompileCache

CASES: list[Case] = []
case = case_table(CASES)


@case("compile_once with a factory returning an nn.DataParallel", qc.QCompileError,
      ("DataParallel",), ("DistributedDataParallel",))
def _(w: World):
    return qc.distributed.compile_once(lambda: nn.DataParallel(w.model), spec_dict("static"),
                                       w.inputs, calibration=[w.inputs])


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path) -> None:
    check_case(c, tmp_path)


# -- compile_once never mutates the user's model -------------------------------------------------
class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def _conv_bn() -> nn.Module:
    torch.manual_seed(0)
    m = ConvBN()
    with torch.no_grad():  # statistics far from the defaults: a fold moves the weights
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.25, 4)
        m.bn.weight.uniform_(-2, 2)
    return m.eval()


@pytest.mark.parametrize("how", ["factory", "checkpoint"])
@pytest.mark.parametrize("make, x", [(_conv_bn, torch.randn(2, 3, 8, 8)), (MLP, X)],
                         ids=["conv_bn", "mlp"])
def test_compile_once_leaves_the_factorys_model_alone(make, x, how, tmp_path) -> None:
    """``lambda: model`` returns the user's own model: its state, structure and outputs
    stay as they were, and the graph equals compiling a copy with qc.qcompile and
    calibrating it (bit-identical: the same arithmetic)."""
    model = make()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [(n, type(m).__name__) for n, m in model.named_modules()]
    before = model(x)
    checkpoint = None
    if how == "checkpoint":
        checkpoint = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, checkpoint)
    gm = qc.distributed.compile_once(lambda: model, "int8-static", (x,), calibration=[x],
                                     checkpoint=checkpoint)
    assert [(n, type(m).__name__) for n, m in model.named_modules()] == modules
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(x), before)
    ref = qc.calibrate(qc.qcompile(copy.deepcopy(model), "int8-static", example_inputs=(x,)),
                       [x], progress=False)
    assert torch.equal(gm.eval()(x), ref.eval()(x))


# -- the fingerprint comparison --------------------------------------------------------------------
def test_differences_name_the_field_and_every_ranks_value() -> None:
    a = {"spec": {"quant": {"rules": [{"weight": {"dtype": "int8"}}]}}, "cache_dir": None}
    b = {"spec": {"quant": {"rules": [{"weight": {"dtype": "int4"}}]}}, "cache_dir": "/c"}
    c = {"spec": {"quant": {"rules": [{"weight": {"dtype": "int8"}}, {}]}}, "cache_dir": None}
    assert differences([a, a]) == []
    assert differences([a, b, a]) == [
        ("spec.quant.rules[0].weight.dtype", ["int8", "int4", "int8"]),
        ("cache_dir", [None, "/c", None])]
    # a list of another length is named once, with its lengths
    assert differences([a, c]) == [("spec.quant.rules", ["1 entries", "2 entries"])]


# -- the cache removes what killed writers left --------------------------------------------------
def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (then, then))


def test_cache_removes_stale_temporaries_only(tmp_path) -> None:
    gm = qc.qcompile(MLP(), "int8-qat", example_inputs=(X,))
    CompileCache(tmp_path).store("a" * 64, gm)  # a complete entry, old
    _age(tmp_path / ("a" * 64), 10 * STALE_AFTER_S)
    stale = {tmp_path / ".0123456789ab-killed", tmp_path / ".old-x1"}
    young = tmp_path / ".fedcba987654-writing"
    for d in (*stale, young):
        d.mkdir()
        (d / "state.pt").write_bytes(b"partial")
    stale_file = tmp_path / ".manifest.json.k2.tmp"
    stale_file.write_text("{")
    for p in (*stale, stale_file):
        _age(p, 2 * STALE_AFTER_S)
    # a folder whose own time is old but whose file is being written is in use
    busy = tmp_path / ".00000000000b-busy"
    busy.mkdir()
    (busy / "state.pt").write_bytes(b"growing")
    _age(busy, 2 * STALE_AFTER_S)
    os.utime(busy / "state.pt")
    cache = CompileCache(tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([".00000000000b-busy", ".fedcba987654-writing", "a" * 64]), left
    state, why = cache.load("a" * 64)
    assert why == "hit" and all(torch.equal(state[k], v) for k, v in gm.state_dict().items())
