"""Launching the workers of the multi-process tests (two ranks unless told otherwise).

``dist_launcher(worker, cases, outdir, deadline, world=2)`` starts ``world`` worker
processes (a FileStore rendezvous in ``outdir``: no port to find), supervises them — when
one rank fails the others are killed after a short grace period, and the whole launch has a
deadline — and returns a ``Launch`` with every rank's JSON results and logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
GRACE = 5.0  # seconds a rank may outlive its failed peer before it is killed


@dataclass
class Launch:
    outdir: Path
    cases: list[str]
    codes: list[int | None]
    timed_out: bool
    deadline: float
    results: list[dict[str, Any]] = field(default_factory=list)
    world: int = WORLD

    def logs(self) -> str:
        text = []
        for rank in range(self.world):
            log = self.outdir / f"rank{rank}.log"
            body = log.read_text(errors="replace") if log.exists() else "(no log)"
            text.append(f"--- rank {rank} (exit {self.codes[rank]}) ---\n{body[-6000:]}")
        return "\n".join(text)

    def case(self, name: str) -> tuple[dict[str, Any], ...]:
        """Every rank's results for ``name``; fails with the workers' output otherwise."""
        got = [r.get(name) for r in self.results]
        where = (f"launch of {self.cases} timed out after {self.deadline:.0f} s"
                 if self.timed_out else f"exit codes {self.codes}")
        if any(g is None for g in got):
            pytest.fail(f"case {name!r}: no result from rank(s) "
                        f"{[i for i, g in enumerate(got) if g is None]} ({where})\n{self.logs()}")
        crashed = [i for i, g in enumerate(got) if "crash" in g]
        if crashed:
            pytest.fail(f"case {name!r} crashed on rank(s) {crashed} ({where})\n"
                        + "\n".join(got[i]["crash"] for i in crashed))
        return tuple(got)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started
    proc.wait()


def launch(worker: Path, cases: list[str], outdir: Path, deadline_s: float,
           world: int = WORLD) -> Launch:
    """Run ``cases`` in ``world`` worker processes; never blocks past the deadline."""
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "QC_DIST_INIT": (outdir / "store").as_uri()}
    procs = []
    try:
        for rank in range(world):
            with open(outdir / f"rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(worker), str(outdir), *cases],
                    env={**env, "RANK": str(rank)}, cwd=ROOT, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + deadline_s
        failed_at = None
        timed_out = False
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # fail fast: the peer gets a short grace, then is killed
            if now > deadline:
                timed_out = True
                break
            if failed_at is not None and now - failed_at > GRACE:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            _kill(p)
    result = Launch(outdir, cases, [p.returncode for p in procs], timed_out, deadline_s,
                    world=world)
    for rank in range(world):
        path = outdir / f"rank{rank}.json"
        result.results.append(json.loads(path.read_text()) if path.exists() else {})
    return result


@pytest.fixture(scope="session")
def dist_launcher() -> Callable[..., Launch]:
    """The launcher, for the test modules' own (module-scoped) fixtures."""
    return launch
