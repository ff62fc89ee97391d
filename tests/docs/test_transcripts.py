"""Console transcripts in the docs (```` ```console ```` blocks: ``$ command`` lines, then
what the command prints, ``[exit N]`` for a non-zero exit) show what the commands print:
each command runs from the repository root with this interpreter's ``bin/`` first on
``PATH``, and its output must equal the lines shown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def transcripts() -> list[tuple[str, str, list[str], int]]:
    """(page, command, expected lines, expected exit code) for every console command."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```console\n(.*?)```", text, re.S):
            command, lines = None, []
            for line in [*block.rstrip("\n").splitlines(), "$ "]:
                if line.startswith("$ "):
                    if command:
                        code = 0
                        while lines and not lines[-1].strip():
                            lines.pop()
                        if lines and re.fullmatch(r"\[exit \d+\]", lines[-1]):
                            code = int(lines.pop()[6:-1])
                        found.append((str(page.relative_to(ROOT)), command, lines, code))
                    command, lines = line[2:].strip(), []
                else:
                    lines.append(line)
    return found


CASES = transcripts()


def test_the_docs_hold_transcripts() -> None:
    assert len(CASES) >= 4


@pytest.mark.parametrize(("page", "command", "lines", "code"), CASES,
                         ids=[f"{c[0]}:{c[1][:60]}" for c in CASES])
def test_transcript_is_what_the_command_prints(page: str, command: str, lines: list[str],
                                               code: int) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    printed = (done.stdout + done.stderr).rstrip("\n").splitlines()
    assert (printed, done.returncode) == (lines, code), f"{page}: {command}"
