"""The ``qcompile-inspect`` commands of the mixed-precision page run as written: their
``bash`` block is flagged ``run``, so ``test_code_blocks.py`` runs it after the page's
Python (which writes ``details.json``, ``found.yaml`` and the ``models.py`` they read) in
the same folder, and fails when a command exits non-zero."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "mixed-precision.md"


def test_the_inspect_commands_are_run() -> None:
    text = PAGE.read_text(encoding="utf-8")
    fences = re.findall(r"^```(bash[^\n]*)\n(.*?)^```", text, re.S | re.M)
    commands = [(info, line) for info, body in fences for line in body.splitlines()
                if line.startswith("qcompile-inspect ")]
    assert any(" search " in line for _, line in commands), commands
    for info, line in commands:
        assert info.split() == ["bash", "run"], f"not run by test_code_blocks: {line}"
    # every file a command reads is one the page's Python writes
    written = set(re.findall(r'(?:Path|write_text|save_spec)\(?[^"\n]*"([\w.]+)"', text))
    for _, line in commands:
        words = shlex.split(line.split("#", 1)[0])
        read = [w.split(":")[0] for w in words[2:] if re.fullmatch(r"[\w.]+\.(json|yaml|py)"
                                                                  r"(:\w+)?", w)]
        assert read and set(read) <= written, (line, read, written)
