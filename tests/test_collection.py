"""The default run collects every multi-process test.

pytest's default ``norecursedirs`` skips folders named ``dist``; ours holds the
multi-process tests, so ``pyproject.toml`` lists the defaults without it. This guard
collects the suite the way ``tools/test`` (and CI) does and fails if fewer tests under
``tests/dist`` are collected than naming the folder explicitly finds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collected(*args: str) -> list[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_default_run_collects_every_multiprocess_test() -> None:
    explicit = {t for t in _collected("tests/dist") if t.startswith("tests/dist/")}
    assert len(explicit) >= 20, "tests/dist should hold the multi-process tests"
    # the default test paths, as tools/test runs them, narrowed to the `dist` marker (which
    # every multi-process test carries): one collection checks both
    default = {t for t in _collected("-m", "dist") if t.startswith("tests/dist/")}
    missing = sorted(explicit - default)
    assert not missing, f"tools/test does not collect {len(missing)} multi-process test(s), " \
                        f"e.g. {missing[0]}"
