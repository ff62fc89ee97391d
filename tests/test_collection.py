"""The default run collects every multi-process test.

pytest's default ``norecursedirs`` skips folders named ``dist``; ours holds the
multi-process tests, so ``pyproject.toml`` lists the defaults without it. This guard
collects the suite the way ``tools/test`` (and CI) does and fails if fewer tests under
``tests/dist`` are collected than naming the folder explicitly finds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "-- next collection --"
# the collections one after another in one interpreter: starting one (torch, qcompile and
# the conftests imported) costs several times the collection itself
_SCRIPT = f"""
import json, sys
import pytest
for args in json.loads(sys.argv[1]):
    print({MARK!r}, flush=True)
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args])
    if code != 0:
        sys.exit(int(code))
"""


def _collected(*collections: list[str]) -> list[list[str]]:
    """The test ids each of ``collections`` (pytest arguments) collects."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(collections)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    parts = out.stdout.split(MARK + "\n")[1:]
    assert len(parts) == len(collections), out.stdout[-2000:]
    return [[line for line in part.splitlines() if "::" in line] for part in parts]


def test_default_run_collects_every_multiprocess_test(request: pytest.FixtureRequest) -> None:
    # the default test path (`testpaths`, what tools/test runs), recursed into as pytest
    # does by default, narrowed to the `dist` marker (which every multi-process test
    # carries); the other folders and modules are left out of this collection only to
    # save importing them: recursion into `tests/dist` is what norecursedirs decides
    others = [f"--ignore={p.relative_to(ROOT)}" for p in sorted((ROOT / "tests").iterdir())
              if p.name != "dist" and (p.is_dir() or p.suffix == ".py")
              and p.name != "conftest.py"]
    collections = [["tests", *others, "-m", "dist"]]
    # what naming the folder finds: this session's own items when it holds them (the
    # whole suite: one collection less), else a collection of tests/dist (in the same
    # interpreter: it does not decide whether the default run recurses into the folder)
    explicit = {i.nodeid for i in request.session.items if i.nodeid.startswith("tests/dist/")}
    if len(explicit) < 20:
        collections.append(["tests/dist"])
    found = _collected(*collections)
    default = {t for t in found[0] if t.startswith("tests/dist/")}
    if len(found) > 1:
        explicit = {t for t in found[1] if t.startswith("tests/dist/")}
    assert len(explicit) >= 20, "tests/dist should hold the multi-process tests"
    missing = sorted(explicit - default)
    assert not missing, f"tools/test does not collect {len(missing)} multi-process test(s), " \
                        f"e.g. {missing[0]}"
