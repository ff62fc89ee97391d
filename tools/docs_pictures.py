"""The pictures of ``docs/how-to/pictures.md``, drawn by ``qcompile-inspect`` itself.

``python -m qcompile.tools.docs_pictures`` runs, from the repository root, the exact
``qcompile-inspect`` commands the page shows (``COMMANDS``) and writes:

- ``docs/pictures/resnet18-int8-qat.svg``: ResNet-18 (``examples/models.py:resnet18``)
  compiled with the ``int8-qat`` preset, per-layer SQNR on 4 random batches printed on the
  nodes, the downsampling block ``layer2.0`` expanded and the other blocks as boxes;
- ``docs/pictures/llama-pipeline.svg``: a 4-block Llama-style decoder
  (``examples/models.py:llama``) compiled with ``examples/llama-pipeline.yaml`` (int8 QAT,
  2 pipeline stages, int8 transfer), one box per block, SQNR on the boxes.

The SVGs are drawn by the pure-Python layout (``--layout python``), so they do not depend
on a Graphviz install: the same checkout writes the same bytes on every run.
``--check`` writes nothing and exits 1 when a picture differs from what the commands draw
now; ``--out DIR`` writes the pictures to ``DIR`` instead.

Example:
    >>> print(command("llama-pipeline.svg"))  # doctest: +NORMALIZE_WHITESPACE
    qcompile-inspect sqnr examples/llama-pipeline.yaml --model examples/models.py:llama
      --input-shape 1x16 --dtype int64 --depth 2 --graph svg --layout python
      --out docs/pictures/llama-pipeline.svg
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PICTURES = Path("docs") / "pictures"

# picture name -> qcompile-inspect arguments, paths relative to the repository root
COMMANDS: dict[str, list[str]] = {
    "resnet18-int8-qat.svg": [
        "sqnr", "int8-qat", "--model", "examples/models.py:resnet18",
        "--input-shape", "1x3x32x32", "--focus", "layer2.0",
        "--graph", "svg", "--layout", "python", "--out", "docs/pictures/resnet18-int8-qat.svg"],
    "llama-pipeline.svg": [
        "sqnr", "examples/llama-pipeline.yaml", "--model", "examples/models.py:llama",
        "--input-shape", "1x16", "--dtype", "int64", "--depth", "2",
        "--graph", "svg", "--layout", "python", "--out", "docs/pictures/llama-pipeline.svg"],
}


def command(name: str) -> str:
    """The shell command drawing picture ``name``, as the documentation shows it."""
    return shlex.join(["qcompile-inspect", *COMMANDS[name]])


def _argv(name: str, out_dir: Path) -> list[str]:
    """The command's arguments with its files under ``ROOT`` and its output in ``out_dir``
    (the same command, whatever the working directory)."""
    args = list(COMMANDS[name])
    for i, a in enumerate(args):
        if a.startswith("examples/"):
            path, sep, factory = a.partition(":")
            args[i] = str(ROOT / path) + sep + factory
    args[args.index("--out") + 1] = str(out_dir / name)
    return args


def draw(name: str, out_dir: Path) -> Path:
    """Run the command of picture ``name``, writing it into ``out_dir``; its report (the
    SQNR table) is not printed."""
    from qcompile.tools.inspect_cli import main

    out_dir.mkdir(parents=True, exist_ok=True)
    report, notes = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(report), contextlib.redirect_stderr(notes):
        rc = main([*_argv(name, out_dir), "--format", "json"])
    if rc != 0:
        raise RuntimeError(f"{command(name)} failed (exit {rc}): {notes.getvalue().strip()}")
    return out_dir / name


def stale(out_dir: Path | None = None) -> list[str]:
    """The pictures under ``out_dir`` (default ``docs/pictures``) that differ from what the
    commands draw now (missing ones included)."""
    target = out_dir or ROOT / PICTURES
    with tempfile.TemporaryDirectory() as tmp:
        return [name for name in COMMANDS
                if not (target / name).is_file()
                or draw(name, Path(tmp)).read_bytes() != (target / name).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qcompile.tools.docs_pictures",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a picture is out of date")
    parser.add_argument("--out", type=Path, help=f"write here instead of {PICTURES}")
    args = parser.parse_args(argv)
    if args.check:
        old = stale(args.out)
        for name in old:
            print(f"out of date: {(args.out or PICTURES) / name} (run: {command(name)})")
        return 1 if old else 0
    for name in COMMANDS:
        print(f"wrote {draw(name, args.out or ROOT / PICTURES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
