"""qcompile-bench tp: the quick run end to end (T = 1 in one process, T = 2 on two gloo
ranks; its numbers are checked for consistency, never timed), and the pieces it measures
with, in this process."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from qcompile.tools.bench import main
from qcompile.tools.bench.suites import SUITES
from qcompile.tools.bench.suites.tp import (
    PRESETS,
    comm_summary,
    float_plan,
    run_tp,
    state_bytes,
    tp_text,
)


def test_tp_is_registered() -> None:
    assert SUITES["tp"].run is run_tp and SUITES["tp"].text is tp_text


def test_state_bytes_counts_params_grads_adamw_state_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    quantizer = nn.Module()
    quantizer.register_buffer("scale", torch.ones(3))
    model[0].add_module("weight_fake_quant", quantizer)  # held, not called
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    params = (8 * 4 + 4 + 4 + 4) * 4
    got = state_bytes(model, opt, [quantizer])
    assert got["params"] == got["grads"] == params
    # exp_avg and exp_avg_sq per parameter, and each parameter's float32 step
    assert got["optimizer"] == 2 * params + 4 * 4
    assert got["quant_buffers"] == 3 * 4
    assert got["other_buffers"] == (4 + 4) * 4 + 8  # running mean, var; int64 batch count
    assert got["total"] == sum(v for k, v in got.items() if k != "total")


def test_float_plan_maps_each_style_to_torchs() -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    rec = [SimpleNamespace(layer="emb", kind="embedding", style="rowwise", gather=False),
           SimpleNamespace(layer="q", kind="linear", style="colwise", gather=False),
           SimpleNamespace(layer="o", kind="linear", style="rowwise", gather=False),
           SimpleNamespace(layer="head", kind="linear", style="colwise", gather=True),
           SimpleNamespace(layer="gate", kind="linear", style="replicate", gather=False)]
    plan = float_plan(rec)
    assert set(plan) == {"emb", "q", "o", "head"}  # a replicated layer is left alone
    assert isinstance(plan["q"], ColwiseParallel) and isinstance(plan["o"], RowwiseParallel)
    assert isinstance(plan["head"].output_layouts[0], Replicate)
    assert isinstance(plan["emb"], RowwiseParallel)
    assert isinstance(plan["emb"].input_layouts[0], Replicate)


def test_input_tensors_are_what_this_rank_puts_in() -> None:
    from qcompile.tools.bench.suites.tp import _input_tensors

    out, mine, other = torch.zeros(8), torch.zeros(4), torch.zeros(3)
    c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional
    assert _input_tensors(c10d._allgather_base_, (out, mine)) == [mine]
    assert _input_tensors(c10d._reduce_scatter_base_, (mine, out)) == [out]
    assert {id(t) for t in _input_tensors(c10d.allreduce_, ([mine, other], None))} == {
        id(mine), id(other)}
    assert _input_tensors(funcol.all_gather_into_tensor, (mine, 2, "0")) == [mine]
    assert _input_tensors(funcol.all_reduce, (out, "sum", "0")) == [out]


@pytest.mark.parametrize(("path", "function", "part"), [
    ("qcompile/distributed/data_parallel.py", "_reduce_observed", "sync"),
    ("qcompile/runtime/fake_quant.py", "forward", "stats"),
    ("qcompile/runtime/sharded.py", "_extremes", "stats"),
    ("qcompile/runtime/sharded.py", "forward", None),  # ShardedLinear: the layer's own
    ("torch/distributed/tensor/parallel/style.py", "_prepare_output_fn", None)])
def test_a_collective_is_the_innermost_qcompile_frames(path: str, function: str,
                                                        part: str | None) -> None:
    """The innermost frame of qcompile's code decides (a stand-in frame per file)."""
    from qcompile.tools.bench.suites import tp

    scope = {"quantizer_part": tp.quantizer_part}
    exec(compile(f"def {function}():\n    return quantizer_part()\n",
                 f"/site/{path}", "exec"), scope)
    assert scope[function]() == part


def test_comm_summary_keeps_the_quantizers_parts_apart() -> None:
    calls = [{"op": "all_reduce", "bytes": 100, "part": None},
             {"op": "all_reduce", "bytes": 8, "part": "stats"},
             {"op": "all_gather_into_tensor", "bytes": 16, "part": "stats"},
             {"op": "allreduce_", "bytes": 40, "part": "sync"}]
    s = comm_summary(calls)
    assert (s["collectives"], s["bytes"]) == (4, 164)
    assert (s["stats_collectives"], s["stats_bytes"]) == (2, 24)
    assert (s["sync_collectives"], s["sync_bytes"]) == (1, 40)
    assert s["ops"] == {"all_reduce": [1, 100], "all_reduce (stats)": [1, 8],
                        "all_gather_into_tensor (stats)": [1, 16], "allreduce_ (sync)": [1, 40]}


def test_text_without_sharded_rows_has_no_collectives_table() -> None:
    from qcompile.tools.bench.suites.tp import config

    row = {"tp": 1, "preset": "int8-qat", "qat_mb": 5.55, "float_mb": 5.51,
           "bytes_ratio": 1.006, "quant_buffer_kb": 36.5, "qat_step_ms": 12.0,
           "float_step_ms": 6.8, "step_ratio": 1.76}
    lines = tp_text({"config": config(True), "cores": 2, "rows": [row]}).splitlines()
    assert len(lines) == 4 and lines[-1].split()[:2] == ["1", "int8-qat"]


def expected_quant_buffers(preset: str, tp: int) -> int:
    """Bytes of the quantizers' buffers on one of ``tp`` ranks, from one process's compile
    of the quick model: a colwise layer's weight quantizer keeps its per-row (or per-group)
    state for its own rows, 1/tp of them; every other buffer is whole on every rank."""
    import qcompile as qc
    from qcompile.tools.bench.suites.tp import build_model, config

    cfg = config(True)
    spec = qc.load_spec(preset).model_dump()
    spec["tensor_parallel"] = {"size": 2, "plan": "auto"}  # the plan only: no ranks here
    ids = torch.zeros(cfg["batch"], cfg["seq"], dtype=torch.long)
    gm = qc.qcompile(build_model(cfg), spec, example_kwargs={"input_ids": ids})
    colwise = {r.layer for r in qc.report(gm).tensor_parallel if r.style == "colwise"}
    total = 0
    for name, q in qc.quantizers(gm).items():
        layer, _, role = name.rpartition(".")
        out = (gm.get_submodule(layer).weight.shape[0]
               if role == "weight_fake_quant" and layer in colwise else 0)
        for b in q.buffers():  # per row or per group: a multiple of the weight's rows
            part = tp if out and b.dim() == 1 and b.numel() % out == 0 else 1
            total += b.numel() // part * b.element_size()
    return total


@pytest.mark.e2e
def test_quick_tp_suite(capsys: pytest.CaptureFixture[str]) -> None:
    """T = 1 and 2, every preset: the QAT model holds at least what the float model holds;
    its quantizers' buffers are one process's, but for a colwise weight's per-row state,
    which each rank keeps for its own rows; at T = 2 the layers' own collectives are the
    float model's (the same styles), the quantizers' come on top; the sharded models'
    first loss is one process's."""
    assert main(["tp", "--quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {(row["tp"], row["preset"]): row for row in data["rows"]}
    assert set(rows) == {(t, p) for t in (1, 2) for p in PRESETS}
    for (tp, preset), row in rows.items():
        assert row["plans_agree"], preset
        assert row["bytes_ratio"] >= 1.0 and row["quant_buffer_kb"] > 0
        assert row["qat_step_ms"] > 0 and row["float_step_ms"] > 0 and row["step_ratio"] > 0
        assert row["comm_debug_mode_counts"] == [row["qat_collectives"],
                                                 row["float_collectives"]]
        one = rows[1, preset]
        assert row["qat_bytes"]["quant_buffers"] == expected_quant_buffers(preset, tp)
        assert row["first_loss"] == pytest.approx(one["first_loss"], rel=1e-4)
        if tp == 1:
            assert row["qat_collectives"] == row["float_collectives"] == 0
            assert row["plan"] == {"colwise": 0, "rowwise": 0, "replicate": 0}
            continue
        assert row["plan"]["colwise"] > 0 and row["plan"]["rowwise"] > 0
        assert row["qat_bytes"]["params"] < 0.6 * one["qat_bytes"]["params"]
        assert row["float_bytes"]["params"] < 0.6 * one["float_bytes"]["params"]
        own = {k: v for k, v in row["qat_ops"].items() if not k.endswith(("(stats)", "(sync)"))}
        assert own == row["float_ops"], preset
        assert row["stats_collectives"] > 0, preset  # statistics across the shards
        assert row["qat_collectives"] == (row["float_collectives"] + row["stats_collectives"]
                                          + row["sync_collectives"])
    text = tp_text(data)
    assert all(p in text for p in PRESETS) and "statistics" in text
