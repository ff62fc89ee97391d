"""Every code block in the README and the docs runs.

Per page (``README.md`` and ``docs/**/*.md``, except the generated ``docs/reference/``):

- ```` ```python ```` blocks run in order in one fresh namespace (a module of their own, so
  classes a page defines pickle), in a temporary working directory; a failure points at
  the page's own line. A ``no-run`` flag (```` ```python no-run ```` or the attribute form
  ```` ```python {.no-run} ````) shows a block without running it: torchrun-only or GPU
  code, kept rare (``test_no_run_is_rare``).
- Blocks flagged ``run`` (```` ```bash run ````) run in ``bash -euo pipefail`` in that
  directory with this interpreter's ``bin/`` first on ``PATH``; other ``bash`` blocks are
  not run.

The working directory reads like the repository root (``.venv``, ``examples``, ``specs``,
``tools`` and ``docs`` are links to it), so ``specs/presets/int8-qat.yaml`` or
``.venv/bin/qcompile-inspect`` resolve as written, while files a page writes land in the
temporary directory. Pages run in this process (a subprocess per page would cost an
interpreter and a torch import each); what a page can change globally (threads, default
dtype, quantized engine, RNG, environment, a process group it started) is restored after
it. A page that shards with FSDP2 runs in a process of its own: ``fully_shard`` leaves
process-wide state no test can undo (torch keeps the classes it makes, and qcompile's weight
cache stays off in a process where it was used). A page whose code imports a missing
optional extra (``OPTIONAL``) is skipped.

The fences are read by the small parser below rather than with ``mktestdocs`` (it joins a
page's blocks into one string, so a failure's line number is not the page's, and its
scanner toggles on any line holding three backticks) or ``pytest-markdown-docs`` (one
test per block, a namespace shared only through a ``continuation`` flag on every later
block, Python fences only, a ``notest`` flag instead of ``no-run``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "docs" / "reference"
LINKED = (".venv", "examples", "specs", "tools", "docs")
FLAGS = {"python": {"no-run"}, "bash": {"run"}}
# a page whose code needs one of these optional extras is skipped without it
OPTIONAL = {"transformers", "peft", "onnx", "onnxruntime", "onnxscript", "torchao", "gguf",
            "compressed_tensors", "llama_cpp",
            "lightning", "matplotlib", "sklearn", "bitsandbytes", "expecttest"}
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")


@dataclass(frozen=True)
class Block:
    lang: str
    flags: frozenset[str]
    code: str
    line: int  # 1-based line of the first code line in the page


def _words(info: str) -> list[str]:
    """The language and flags of a fence's info string: ``python no-run``, or the attribute
    form ``python {.no-run}`` / ``{.python .no-run}`` (what Python-Markdown's SuperFences
    accepts); ``key="value"`` options (``title=...``) are not flags."""
    return [w.lstrip(".") for w in re.findall(r"[^\s{}]+", info) if "=" not in w]


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text (CommonMark fences: backticks or tildes,
    closed by the same character at least as long; fences inside list items may be indented
    beyond three spaces, their content loses that indent)."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        stripped = lines[i].lstrip(" ")
        indent = len(lines[i]) - len(stripped)
        m = FENCE.match(stripped)
        if m is None:
            i += 1
            continue
        fence, words = m["fence"], _words(m["info"])
        close = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        body = [line[indent:] if line[:indent].strip() == "" else line.lstrip(" ")
                for line in lines[i + 1:j]]
        lang = words[0].lower() if words else ""
        found.append(Block(lang, frozenset(words[1:]), "\n".join(body) + "\n", i + 2))
        i = j + 1
    return found


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if GENERATED not in p.parents)
    return [ROOT / "README.md", *docs]


def _id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _workdir(tmp_path: Path) -> Path:
    for name in LINKED:
        target = Path(sys.prefix) if name == ".venv" else ROOT / name
        if target.exists():
            (tmp_path / name).symlink_to(target, target_is_directory=True)
    return tmp_path


def _run_python(page: Path, block: Block, namespace: dict) -> None:
    # pad with newlines so tracebacks give the page's own line numbers
    code = compile("\n" * (block.line - 1) + block.code, str(page), "exec")
    try:
        exec(code, namespace)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] in OPTIONAL:
            pytest.skip(f"{_id(page)}:{block.line} needs the optional package {e.name}")
        raise


def _run_bash(page: Path, block: Block, cwd: Path) -> None:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (
        f"{_id(page)}:{block.line}: bash block exited {out.returncode}\n{block.code}\n"
        f"--- stdout ---\n{out.stdout[-3000:]}\n--- stderr ---\n{out.stderr[-3000:]}")


def _restore_process_group(had_group: bool) -> None:
    dist = torch.distributed
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# code that leaves process-wide state behind: such a page runs in a process of its own
_OWN_PROCESS = re.compile(r"\bfully_shard\b|\bcompile_once\b|kind\W+fsdp2")


def _runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page.read_text(encoding="utf-8"))
            if (b.lang == "python" and "no-run" not in b.flags)
            or (b.lang == "bash" and "run" in b.flags)]


@pytest.mark.parametrize("page", pages(), ids=_id)
def test_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runnable = _runnable(page)
    if not runnable:
        return
    if any(b.lang == "python" and _OWN_PROCESS.search(b.code) for b in runnable) \
            and os.environ.get("QCOMPILE_DOCS_PAGE") != str(page):
        env = dict(os.environ, QCOMPILE_DOCS_PAGE=str(page))
        node = f"{Path(__file__)}::test_page_runs[{_id(page)}]"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               node], env=env, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
        return
    cwd = _workdir(tmp_path)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))
    module = types.ModuleType("qcompile_docs_page_" + re.sub(r"\W", "_", _id(page)))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    saved = (torch.get_num_threads(), torch.get_default_dtype(),
             torch.backends.quantized.engine, torch.random.get_rng_state())
    had_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    environ = dict(os.environ)
    torch.manual_seed(0)
    try:
        for block in runnable:
            if block.lang == "python":
                _run_python(page, block, module.__dict__)
            else:
                _run_bash(page, block, cwd)
    finally:
        _restore_process_group(had_group)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        torch.set_num_threads(saved[0])
        torch.set_default_dtype(saved[1])
        torch.backends.quantized.engine = saved[2]
        torch.random.set_rng_state(saved[3])


def test_fence_flags_are_known() -> None:
    """A misspelt flag (```` ```python norun ````) would silently run or skip a block."""
    wrong = [f"{_id(p)}:{b.line - 1}: ```{b.lang} {' '.join(sorted(b.flags))}"
             for p in pages() for b in blocks(p.read_text(encoding="utf-8"))
             if b.lang in FLAGS and not b.flags <= FLAGS[b.lang]]
    assert not wrong, "unknown fence flags (python: no-run; bash: run):\n" + "\n".join(wrong)


def test_no_run_is_rare() -> None:
    """``no-run`` is for torchrun-only or GPU code: under a fifth of the Python blocks."""
    python = [(p, b) for p in pages() for b in blocks(p.read_text(encoding="utf-8"))
              if b.lang == "python"]
    assert python, "no ```python block found in the README or the docs"
    shown = [f"{_id(p)}:{b.line - 1}" for p, b in python if "no-run" in b.flags]
    assert len(shown) < 0.2 * len(python), (
        f"{len(shown)} of {len(python)} Python blocks are no-run: {shown}")


def test_parser_reads_fences() -> None:
    text = ("intro\n```python\nx = 1\n```\n\n1. step\n\n    ```bash run\n    echo hi\n"
            "    ```\n\n~~~~python no-run\n```\nnot a close\n~~~~\n```yaml\na: 1\n```\n"
            '``` {.python .no-run title="a.py"}\ny = 2\n```\n```bash {.run}\nls\n```\n')
    got = [(b.lang, sorted(b.flags), b.code, b.line) for b in blocks(text)]
    assert got == [("python", [], "x = 1\n", 3), ("bash", ["run"], "echo hi\n", 9),
                   ("python", ["no-run"], "```\nnot a close\n", 13), ("yaml", [], "a: 1\n", 17),
                   ("python", ["no-run"], "y = 2\n", 20), ("bash", ["run"], "ls\n", 23)]


def test_bash_run_blocks_see_the_repository_and_write_to_the_temporary_directory(
        tmp_path: Path) -> None:
    label = ROOT / "docs" / "example.md"
    cwd = _workdir(tmp_path)
    python = Path(sys.executable).parent / "python"
    ok = Block("bash", frozenset({"run"}), (
        "test -f specs/presets/int8-qat.yaml && test -x .venv/bin/python\n"
        f'test "$(command -v python)" = "{python}"\necho written > out.txt\n'), 3)
    _run_bash(label, ok, cwd)
    assert (tmp_path / "out.txt").read_text() == "written\n"
    failing = Block("bash", frozenset({"run"}), "false\necho never\n", 7)
    with pytest.raises(AssertionError, match=r"docs/example\.md:7: bash block exited 1"):
        _run_bash(label, failing, cwd)
