"""Kill a writer mid-write with SIGKILL, deterministically.

``kill_mid_write(code)`` runs ``code`` in a fresh Python. The code makes the write under test
call ``block()`` (defined for it) at the point where it should die: ``block()`` tells the
parent it got there and waits on a pipe the parent never writes to. The parent then sends
SIGKILL: no sleep, no race, whatever the machine's speed. ``torn(write)`` wraps a
``(self, data, ...)`` writer so that it writes half of ``data``, then blocks.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

PRELUDE = textwrap.dedent("""\
    import os, sys

    def block():
        sys.stdout.write("BLOCKED\\n")
        sys.stdout.flush()
        sys.stdin.read()  # the parent never writes: only SIGKILL ends this
        os._exit(3)

    def torn(write):
        def half_then_block(self, data, *args, **kwargs):
            write(self, data[: len(data) // 2], *args, **kwargs)
            block()
        return half_then_block
    """)
DEADLINE_S = 300.0  # only against a hang (imports on a loaded machine); never a measurement


def start_blocked(code: str, cwd: Path) -> subprocess.Popen:
    """Run ``PRELUDE + code`` until it calls ``block()`` and return it, blocked (alive).
    Fails (with the child's stderr) if it exits or never gets there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], cwd=cwd,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
    line = proc.stdout.readline() if ready else ""
    if line != "BLOCKED\n":
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the writer never blocked (stdout {line!r}):\n{err}")
    return proc


def kill_mid_write(code: str, cwd: Path) -> None:
    """Run ``PRELUDE + code`` until it calls ``block()``, then SIGKILL it."""
    proc = start_blocked(code, cwd)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
