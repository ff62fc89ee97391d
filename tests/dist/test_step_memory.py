"""A QAT training step keeps what the float step keeps (``train.recompute_weights``), on
2 gloo ranks (``qcompile-bench memory`` measures 1, 2 and 4; what is kept does not
depend on the world size): under FSDP2 (``qc.distributed.wrap`` of a graph compiled with
``data_parallel: fsdp2``, and ``compile_once``) autograd keeps no unsharded weight copy
past the forward (what it keeps beyond the float FSDP2 step is activation-sized, under
10% of a rank's share of the model), where keeping the
copies costs the whole model per rank whatever the world size; under DDP at most one
weight copy per layer (the weight cache's). Gradients are bit-identical either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_step_memory_worker.py")
LAUNCH_DEADLINE = 120.0


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, ["ddp", "fsdp2"], tmp_path_factory.mktemp("mem2"),
                         LAUNCH_DEADLINE, world=2)


def test_fsdp2_qat_step_keeps_what_the_float_step_keeps(two: Any) -> None:
    launch = two
    world = launch.world
    for rank in launch.case("fsdp2"):
        for how in [h for h in ("wrap", "compile_once") if h in rank]:
            got = rank[how]
            # what QAT adds: activation-sized (a quantized activation and its input are
            # both kept, plus 1-bit masks), far below 10% of a rank's float step (which
            # holds at least its parameter and gradient shards)
            assert got["on"] - rank["float"] <= 0.1 * rank["model"] / world, (how, got, rank)
            # kept copies: every unsharded weight, on every rank
            assert got["off"] >= got["on"] + 0.9 * rank["model"], (how, got)
            assert got["same_grads"], how


def test_ddp_qat_step_keeps_at_most_one_weight_copy(two: Any) -> None:
    for rank in two.case("ddp"):
        assert rank["on"] <= rank["float"] + 1.05 * rank["model"], rank
        assert rank["same_grads"]
