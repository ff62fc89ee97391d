"""The GPU tooling itself, on the CPU (no ``cuda`` mark: these run everywhere):
``tools/gpu-check`` skips its GPU parts cleanly without a GPU, and the ``cuda`` benchmark
suite's code runs end to end on the CPU (small workloads, ``torch.compile`` left out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qcompile.tools.bench.suites import cuda

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: gpu-check runs it all")
def test_gpu_check_without_a_gpu_skips_and_exits_0(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu-check"), "--parts", "install,bench",
         "--python", sys.executable, "--budget", "120"],
        cwd=tmp_path, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["ok"] is True and result["gpu"]["available"] is False
    assert result["parts"]["install"]["installed"] == "already"
    assert result["parts"]["bench"] == {"skipped": "no CUDA device"}
    assert "gpu-check: no GPU" in proc.stdout
    assert (tmp_path / "gpu-check.log").stat().st_size > 0


def test_cuda_suite_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every measurement of the suite, on small CPU workloads, uncompiled (Inductor's CPU
    compile would take minutes here): rows for each quantizer kind and each training-step
    variant, the JSON file rewritten as it goes, and the text view."""
    monkeypatch.setattr(cuda, "KINDS", {k: cuda.KINDS[k] for k in
                                        ("int8_per_tensor", "int4_per_group32", "nvfp4")})
    monkeypatch.setattr(cuda, "COMPILED", ("int8_per_tensor",))
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    out = tmp_path / "bench.json"
    result = cuda.run(torch.device("cpu"), quick=True, budget_s=200, out_path=str(out))
    assert json.loads(out.read_text())["step"] == json.loads(json.dumps(result["step"]))
    assert result["errors"] == {}
    assert result["copy_GBps"] > 0
    for kind in ("int8_per_tensor", "int4_per_group32", "nvfp4"):
        row = result["fakequant"][kind]
        assert row["eager_fwd_vs_copy"] > 0 and row["eager_fwd_bwd_vs_copy"] > 0, row
    assert result["fakequant"]["int8_per_tensor"]["compiled_fwd_bwd_vs_copy"] > 0
    step = result["step"]
    assert step["bf16"]["step_ms"] > 0
    assert step["qcompile_8da4w"]["vs_bf16"] > 0, step
    ao = step.get("torchao_8da4w", {})
    if "skipped" not in ao:  # torchao installed: measured on the same model
        assert ao.get("vs_bf16", 0) > 0, ao
    text = cuda.cuda_text(result)
    assert "qcompile_8da4w" in text and "int4_per_group32" in text


def test_budget_stops_a_part_that_runs_too_long() -> None:
    budget = cuda.Budget(60)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError), budget.part(0.3):
        while time.monotonic() - t0 < 10:
            time.sleep(0.01)
    assert time.monotonic() - t0 < 5
