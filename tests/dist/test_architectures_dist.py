"""``qc.distributed.compile_once`` of tiny Hugging Face models under FSDP2 on two ranks
(gloo): every family under every LLM preset compiled once from a safetensors checkpoint
computes what one process's ``qc.qcompile`` of the same model computes (``int8-static``:
calibrated on each rank's batch, against one process calibrated on both).

The default run takes a dense decoder and an MoE; ``.ci/run`` sets ``QCOMPILE_SWEEP=1``
for the whole table (the column ``compile_once`` of docs/reference/architectures.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from qcompile.tools.architectures import ARCHITECTURES
from qcompile.tools.bench.suites.architectures import PRESETS

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_architectures_worker.py")
FULL = os.environ.get("QCOMPILE_SWEEP") == "1"
DEFAULT = ["llama__qlora-nf4", "llama__int8-static", "mixtral__nvfp4-qat"]
CASES = [f"{a}__{p}" for a in ARCHITECTURES for p in PRESETS] if FULL else DEFAULT
DEADLINE = 60.0 + 20.0 * len(CASES)  # seconds for every case together


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory: pytest.TempPathFactory, dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, CASES, tmp_path_factory.mktemp("architectures"), DEADLINE)


@pytest.mark.parametrize("case", CASES)
def test_compile_once_equals_one_process(dist_run: Any, case: str) -> None:
    for rank, row in enumerate(dist_run.case(case)):
        assert "once_error" not in row, f"rank {rank}: {row['once_error']}"
        assert row["once_equal"], f"rank {rank}: relative deviation {row['once_deviation']}"
