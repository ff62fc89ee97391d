"""The ``torchrun`` commands the docs show for the examples run as shown (CPU, gloo), with
fewer steps: each command of a ``bash`` block that launches ``examples/*.py`` on the CPU
(a ``--cuda`` line needs GPUs) exits 0 and prints its closing line.

Two minutes of launches: ``.ci/run`` runs them (``QCOMPILE_DOCS_TORCHRUN=1``) after the
default suite, which skips them; the examples' APIs have tests of their own there."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
LAUNCHES = pytest.mark.skipif(
    os.environ.get("QCOMPILE_DOCS_TORCHRUN") != "1",
    reason="two minutes of torchrun launches: .ci/run sets QCOMPILE_DOCS_TORCHRUN=1")

ROOT = Path(__file__).resolve().parents[2]
# what each example prints last when it worked
DONE = {"ddp_train.py": "identical on every rank: True",
        "sharded_compile_once.py": "identical on every rank: True",
        "qlora_train.py": "max |peft - qcompile|",
        "pipeline_train.py": "stage", "hybrid_train.py": "loss",
        "tp_train.py": "identical on every rank: True"}
# modes of an example that end on another line: (script, flag) -> that line
DONE_WITH = {("tp_train.py", "--pipeline"): "transformers' loss on the batch"}
# fewer steps: what is checked is that the command runs, the examples' APIs have tests of
# their own
SHORT = {"ddp_train.py": ["--steps", "2"], "sharded_compile_once.py": ["--steps", "2"],
         "qlora_train.py": ["--steps", "2"], "pipeline_train.py": ["--steps", "2"],
         "hybrid_train.py": ["--epochs", "1"], "tp_train.py": ["--steps", "2"]}


def commands() -> list[list[str]]:
    found: dict[str, list[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```bash[^\n]*\n(.*?)```", page.read_text(encoding="utf-8"),
                                re.S):
            for line in block.replace("\\\n", " ").splitlines():  # continued lines joined
                try:
                    words = shlex.split(line.split("#", 1)[0])
                except ValueError:  # not a command line (a heredoc's text): no launch there
                    continue
                if not words or not words[0].endswith("torchrun") or "--cuda" in words:
                    continue
                script = next((w for w in words if w.startswith("examples/")), None)
                if script is not None:
                    found.setdefault(" ".join(words[1:]), words[1:])
    return list(found.values())


def test_the_docs_show_the_examples() -> None:
    shown = {next(w for w in c if w.startswith("examples/")).split("/")[1] for c in commands()}
    assert shown == set(DONE), shown


def _nodes(args: list[str]) -> int:
    for i, w in enumerate(args):
        if w.startswith("--nnodes"):
            return int(w.split("=", 1)[1] if "=" in w else args[i + 1])
    return 1


def _as_node(args: list[str], node: int) -> list[str]:
    """``args`` with ``--node_rank`` set to ``node``."""
    out, skip = [], False
    for w in args:
        if skip:
            out.append(str(node))
            skip = False
        elif w.startswith(("--node_rank", "--node-rank")):
            if "=" in w:
                out.append(f"{w.split('=', 1)[0]}={node}")
            else:
                out.append(w)
                skip = True
        else:
            out.append(w)
    return out


@LAUNCHES
@pytest.mark.parametrize("args", commands(), ids=lambda a: " ".join(a[-2:]))
def test_torchrun_command_runs(args: list[str], tmp_path: Path) -> None:
    """A multi-node command (``--nnodes N``) runs as N nodes would: N launches of it on
    this machine, ``--node_rank`` 0 .. N-1, meeting at its rendezvous endpoint."""
    script = next(w for w in args if w.startswith("examples/")).split("/")[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    nodes = [subprocess.Popen([str(torchrun), *_as_node(args, n), *SHORT[script]], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for n in range(_nodes(args))]
    # A node whose rank gloo aborted at exit (below) skips torchrun's exit barrier, where
    # the other nodes then wait out its timeout (300 s) before they exit 0: a multi-node
    # launch gets that much longer
    deadline = 300 + (330 if len(nodes) > 1 else 0)
    try:
        outs = [p.communicate(timeout=deadline) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(nodes, outs, strict=True):
        out = stdout + stderr
        # gloo can abort a rank at interpreter exit, after destroy_process_group, when a
        # worker thread still holds work ("terminate called without an active exception",
        # about one launch in five here): the script's work is done by then, so that alone
        # is no failure
        shutdown = "terminate called without an active exception" in out
        assert p.returncode == 0 or shutdown, out[-4000:]
    done = next((line for (name, flag), line in DONE_WITH.items()
                 if name == script and flag in args), DONE[script])
    assert done in outs[0][0], (outs[0][0] + outs[0][1])[-4000:]
