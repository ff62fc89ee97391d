"""Resuming a distributed QAT run from torch.distributed.checkpoint: the model state
(``get_model_state_dict``) and the optimizer's (``qc.distributed.optimizer_state_dict``)
saved with ``dcp.save`` after two AdamW steps, loaded into a fresh compile and wrap with
``dcp.load`` and torch's ``set_state_dict``: the next two steps give the original's losses
and state bit for bit. Under FSDP2 (each block a child graph; plain and flattened optimizer
state), tp 2, and dp 2 x tp 2 on 4 ranks; the keys are the model's names.

With ``QCOMPILE_SWEEP=1``, as ``.ci/run`` runs it after the default suite (the one-process
case is in ``tests/qcompile/distributed/test_state_dict.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.skipif(
    os.environ.get("QCOMPILE_SWEEP") != "1",
    reason="2- and 4-rank launches of training and checkpoints: .ci/run runs it "
           "(QCOMPILE_SWEEP=1)")]

WORKER = Path(__file__).with_name("_resume_worker.py")
LAUNCH_DEADLINE = 180.0


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, ["fsdp2", "fsdp2_flat", "tp"],
                         tmp_path_factory.mktemp("resume2"), LAUNCH_DEADLINE, world=2)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, ["dp_tp"], tmp_path_factory.mktemp("resume4"),
                         LAUNCH_DEADLINE, world=4)


def _resumed_exactly(ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        assert got["resumed_losses"] == got["losses"], got
        assert got["state_equal"], got
        assert got["model_keys"] and not any(k.startswith("stage_") for k in got["model_keys"])
        names = [k.removeprefix("state.") for k in got["optim_keys"]]
        assert names and not any(k.startswith("stage_") for k in names), got["optim_keys"]
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)  # one run, every rank


@pytest.mark.parametrize("case", ["fsdp2", "fsdp2_flat", "tp"])
def test_two_ranks_resume_bit_for_bit(two: Any, case: str) -> None:
    ranks = two.case(case)
    _resumed_exactly(ranks)
    if case == "fsdp2":  # what torch's own function names the same state: the block child
        assert all(k.startswith("stage_") for k in ranks[0]["torch_keys"])


def test_dp_x_tp_resumes_bit_for_bit(four: Any) -> None:
    _resumed_exactly(four.case("dp_tp"))
