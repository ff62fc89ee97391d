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

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collected(*args: str) -> list[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_default_run_collects_every_multiprocess_test(request: pytest.FixtureRequest) -> None:
    # what naming the folder finds: this session's own items when it holds them (the
    # whole suite: one collection less), else a collection of tests/dist
    explicit = {i.nodeid for i in request.session.items if i.nodeid.startswith("tests/dist/")}
    if len(explicit) < 20:
        explicit = {t for t in _collected("tests/dist") if t.startswith("tests/dist/")}
    assert len(explicit) >= 20, "tests/dist should hold the multi-process tests"
    # the default test path (`testpaths`, what tools/test runs), recursed into as pytest
    # does by default, narrowed to the `dist` marker (which every multi-process test
    # carries); the other folders and modules are left out of this collection only to
    # save importing them: recursion into `tests/dist` is what norecursedirs decides
    others = [f"--ignore={p.relative_to(ROOT)}" for p in sorted((ROOT / "tests").iterdir())
              if p.name != "dist" and (p.is_dir() or p.suffix == ".py")
              and p.name != "conftest.py"]
    default = {t for t in _collected("tests", *others, "-m", "dist")
               if t.startswith("tests/dist/")}
    missing = sorted(explicit - default)
    assert not missing, f"tools/test does not collect {len(missing)} multi-process test(s), " \
                        f"e.g. {missing[0]}"
