"""``qcompile-inspect``: every subcommand in-process (``main([...])``) and through the
installed console script, text and JSON, pictures, exit codes and error messages.

The models live in a small file written per session (``inspect_models.py``): ``net`` is
conv-bn-relu + a residual add + linear, ``mlp`` is a pipeline-friendly stack of Linears,
``broken`` raises and ``not_a_module`` returns 3.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch

from qcompile.specs import presets
from qcompile.tools.inspect_cli import main

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            y = self.relu(self.bn(self.conv(x)))
            y = y + self.conv2(y)
            return self.fc(torch.flatten(self.pool(y), 1))


    def net():
        torch.manual_seed(0)
        return Net().eval()


    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                             nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


    def broken():
        raise RuntimeError("factory exploded")


    def not_a_module():
        return 3


    def exits():
        raise SystemExit(3)
''')

SPECS = {
    # a QAT spec with a two-stage pipeline, for the mlp
    "pipe.yaml": """\
        version: 1
        quant:
          mode: qat
          rules:
            - match: {module: Linear}
              weight: {dtype: int8, symmetric: true, granularity: per_channel}
              activation: {dtype: uint8, symmetric: false}
        pipeline: {stages: 2}
        """,
    # rule 1 matches nothing in `net` (and is not optional)
    "nomatch.yaml": """\
        version: 1
        quant:
          mode: qat
          rules:
            - match: {module: Linear}
              weight: {dtype: int8, symmetric: true, granularity: per_channel}
              activation: {dtype: uint8, symmetric: false}
            - match: {module: LSTM}
              weight: {dtype: int8, symmetric: true, granularity: per_channel}
        """,
    "unknown_key.yaml": """\
        version: 1
        quant:
          mode: qat
          rulez: []
        """,
    "group_size.yaml": """\
        version: 1
        quant:
          mode: qat
          rules:
            - match: {module: Linear}
              weight: {dtype: int4, symmetric: true, granularity: per_channel, group_size: 32}
        """,
    "bad_yaml.yaml": "version: 1\nquant: {mode: qat\n  rules: [\n",
    "tp.yaml": """\
        version: 1
        quant: {mode: qat}
        tensor_parallel: {size: 2}
    """,
}

NET_SHAPE = ["--input-shape", "1x3x8x8"]
TABLE_COLUMNS = ["node", "op", "target", "shape", "rule_match", "weight", "activation",
                 "quantizer"]
NODE_KEYS = {"node", "op", "target", "shape", "rule", "rule_match", "weight", "activation",
             "skip", "quantizer", "stage", "device"}
SUMMARY_KEYS = {"quantizers", "fp32_bytes", "quantized_bytes", "stages", "balance_ratio",
                "mode", "trace_method", "tensor_parallel"}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("inspect")
    (d / "inspect_models.py").write_text(MODELS, encoding="utf-8")
    for name, text in SPECS.items():
        (d / name).write_text(textwrap.dedent(text), encoding="utf-8")
    return d


def ref(work: Path, factory: str) -> str:
    return f"{work / 'inspect_models.py'}:{factory}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in-process -> (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def cli(*argv: str, cwd: Path, module: bool = False) -> subprocess.CompletedProcess[str]:
    """The installed console script (or ``python -m``) in a subprocess."""
    script = Path(sys.executable).with_name("qcompile-inspect")
    if module or not script.exists():
        cmd = [sys.executable, "-m", "qcompile.tools.inspect_cli"]
    else:
        cmd = [str(script)]
    return subprocess.run([*cmd, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def assert_user_error(rc: int, out: str, err: str, *needles: str) -> str:
    """Exit 1, nothing on stdout, a one-line reason (plus an optional fix line) on stderr,
    no traceback. Returns the reason."""
    assert rc == 1, err
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith("error: "), err
    assert all(line.startswith("  ") for line in lines[1:]), err  # only fix/hint lines
    assert len(lines) <= 2, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def table_rows(text: str, columns: list[str]) -> tuple[list[str], list[dict[str, str]]]:
    """Parse a fixed-width table (header line, then rows) printed by the CLI."""
    lines = text.splitlines()
    header = lines[0]
    starts = [header.index(c if i == 0 else f"  {c}") + (0 if i == 0 else 2)
              for i, c in enumerate(columns)]
    rows = []
    for line in lines[1:]:
        if not line.strip():
            break
        cells = [line[s:e].strip() for s, e in zip(starts, [*starts[1:], None])]
        rows.append(dict(zip(columns, cells)))
    return header.split(), rows


class HTMLChecker(HTMLParser):
    """Checks tags nest and close properly; counts table rows and header cells."""

    VOID = {"meta", "br", "hr", "img", "input", "link"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.doctype = False
        self.head_cells: list[str] = []
        self.body_rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl.lower() == "doctype html"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr" and "tbody" in self.stack:
            self.body_rows.append([])
        if tag in ("td", "th"):
            self._cell = []
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()
        if tag in ("td", "th"):
            text = "".join(self._cell or [])
            if tag == "th":
                self.head_cells.append(text)
            else:
                self.body_rows[-1].append(text)
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def check_dot(text: str, picture: dict[str, Any]) -> list[str]:
    """A well-formed DOT picture: one node statement per drawn box (ids unique), clusters
    balanced, every edge between declared nodes. Returns the node ids."""
    lines = text.strip().splitlines()
    assert lines[0].startswith("digraph ") and lines[0].endswith("{")
    assert lines[-1] == "}"
    assert lines[1].startswith("  node [")  # the default node style
    nodes = [m.group(1) for line in lines
             if (m := re.match(r'\s*"([^"]+)" \[label="(?:[^"\\]|\\.)*", fillcolor="#[0-9a-f]{6}"'
                               r"\];$", line))]
    assert len(nodes) == picture["boxes"]
    assert len(set(nodes)) == len(nodes)
    depth = 0
    edges = 0
    for line in lines[2:-1]:
        if re.match(r"\s*subgraph cluster_\w+ \{$", line):
            depth += 1
        elif line.strip() == "}":
            depth -= 1
        elif (m := re.match(r'\s*"([^"]+)" -> "([^"]+)"( \[.*\])?;$', line)):
            assert m.group(1) in nodes and m.group(2) in nodes, line
            edges += 1
        assert depth >= 0, line
    assert depth == 0 and edges > 0
    return nodes


# -- validate / schema ---------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(presets()))
def test_validate_every_preset(capsys: pytest.CaptureFixture[str], preset: str) -> None:
    rc, out, err = run(capsys, "validate", preset)
    assert rc == 0, err
    assert out.startswith(f"ok: {preset}: mode ")
    assert re.search(r"\d+ rule\(s\)", out)
    rc, out, _ = run(capsys, "validate", preset, "--format", "json")
    data = json.loads(out)
    assert rc == 0 and data["valid"] is True and data["qcompile_inspect"] == 1
    assert data["spec"]["quant"]["rules"]


def test_validate_pipeline_spec_mentions_stages(capsys: pytest.CaptureFixture[str],
                                                work: Path) -> None:
    rc, out, _ = run(capsys, "validate", str(work / "pipe.yaml"))
    assert rc == 0
    assert "2 pipeline stage(s)" in out


@pytest.mark.parametrize(("name", "field", "words"), [
    ("unknown_key.yaml", "quant.rulez", "Extra inputs"),
    ("group_size.yaml", "quant.rules.0.weight", "group_size"),
])
def test_validate_bad_spec(capsys: pytest.CaptureFixture[str], work: Path, name: str,
                           field: str, words: str) -> None:
    rc, out, err = run(capsys, "validate", str(work / name))
    assert rc == 1
    assert f"invalid: {field}: " in out and words in out
    assert "Traceback" not in out + err
    rc, out, _ = run(capsys, "validate", str(work / name), "--format", "json")
    assert rc == 1
    data = json.loads(out)
    assert data["valid"] is False
    assert any(e["field"] == field and words in e["message"] for e in data["errors"])
    assert all(set(e) == {"field", "message"} for e in data["errors"])


def test_validate_invalid_yaml(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    # validate's verdict is its result: on stdout, like the field errors of a parsed spec
    rc, out, err = run(capsys, "validate", str(work / "bad_yaml.yaml"))
    assert rc == 1
    assert "Traceback" not in err and "Traceback" not in out
    first = out.splitlines()[0]
    assert first.startswith("invalid: ") and "bad_yaml.yaml" in first and "not valid yaml" in first
    assert "line 2" in out  # where the syntax error is


def test_validate_missing_file(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, err = run(capsys, "validate", str(work / "nope.yaml"))
    assert rc == 1 and out.startswith("invalid: ")
    assert "does not exist" in out and "int8-qat" in out  # the fix names the presets
    assert "Traceback" not in err and "Traceback" not in out


@pytest.mark.parametrize("name", ["bad_yaml.yaml", "nope.yaml"])
def test_validate_json_for_unreadable_spec(capsys: pytest.CaptureFixture[str], work: Path,
                                           name: str) -> None:
    rc, out, _ = run(capsys, "validate", str(work / name), "--format", "json")
    assert rc == 1
    data = json.loads(out)
    assert data["valid"] is False and data["errors"][0]["message"]


def test_validate_subprocess_and_without_torch(work: Path) -> None:
    code = ("import sys; from qcompile.tools.inspect_cli import main; "
            "rc = main(['validate', 'int8-qat']); assert 'torch' not in sys.modules; "
            "sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ok: int8-qat: mode qat")
    p = cli("validate", "group_size.yaml", "--format", "json", cwd=work)
    assert p.returncode == 1, p.stderr
    errors = json.loads(p.stdout)["errors"]
    assert errors[0]["field"] == "quant.rules.0.weight"


def test_schema(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, _ = run(capsys, "schema")
    assert rc == 0
    schema = json.loads(out)
    assert "quant" in schema["properties"] and "pipeline" in schema["properties"]
    p = cli("schema", cwd=work, module=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == schema


# -- show ----------------------------------------------------------------------------------
def test_show_text(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE)
    assert rc == 0, err
    header, rows = table_rows(out, TABLE_COLUMNS)
    assert header == TABLE_COLUMNS  # no stage/device columns without a pipeline
    by_node = {r["node"]: r for r in rows}
    assert by_node["x"]["op"] == "placeholder" and by_node["x"]["shape"] == "[1, 3, 8, 8]"
    assert by_node["add"]["rule_match"] == "#3 op=add,matmul,cat"
    assert by_node["add"]["activation"] == "uint8/per_tensor/asym"
    assert by_node["conv2d"]["rule_match"].startswith("#0 module=Conv1d")
    assert by_node["conv2d"]["weight"] == "int8/per_channel/sym"
    assert by_node["conv_weight_fake_quant"]["quantizer"] == "int8/per_channel"
    assert by_node["add_fake_quant"]["quantizer"] == "uint8/per_tensor"
    assert by_node["linear"]["shape"] == "[1, 4]"
    summary = out.split("\n\n", 1)[1]
    assert "mode qat, traced by symbolic" in summary
    assert "quantizers: 3 x weight int8 per_channel" in summary
    assert "quantizers: 4 x activation uint8 per_tensor" in summary
    m = re.search(r"parameters: fp32 (\d+) bytes, quantized (\d+) bytes \((\d+)%\)", summary)
    assert m is not None
    fp32, quantized = int(m.group(1)), int(m.group(2))
    # conv 216 + conv2 576 + fc 32 int8 weights; biases and the (QAT, unfolded) bn in fp32
    assert (fp32, quantized) == (860 * 4, 824 + 36 * 4)
    assert "stages: none" in summary


def test_show_lists_the_tensor_parallel_plan(capsys: pytest.CaptureFixture[str],
                                             work: Path) -> None:
    """The mlp's Linear pairs: colwise then rowwise, twice (the last ReLU reaches the head:
    colwise, gathered); each line says why."""
    rc, out, _ = run(capsys, "show", str(work / "tp.yaml"), "--model", ref(work, "mlp"),
                     "--input-shape", "2x16")
    assert rc == 0, out
    plan = out[out.index("tensor parallel:"):].splitlines()
    assert plan[0] == "tensor parallel: 2 colwise, 2 rowwise", plan
    styles = [line.split()[:2] for line in plan[1:5]]
    assert styles == [["0", "colwise"], ["2", "rowwise"], ["4", "colwise"], ["6", "rowwise"]]
    assert "partial sums reduced across tp" in plan[2]
    rc, out, _ = run(capsys, "show", str(work / "tp.yaml"), "--model", ref(work, "mlp"),
                     "--input-shape", "2x16", "--format", "json")
    records = json.loads(out)["summary"]["tensor_parallel"]
    assert [r["style"] for r in records] == ["colwise", "rowwise", "colwise", "rowwise"]


def test_show_json(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, _ = run(capsys, "show", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--format", "json")
    assert rc == 0
    data = json.loads(out)
    assert set(data) == {"qcompile_inspect", "nodes", "summary", "files"}
    assert data["qcompile_inspect"] == 1 and data["files"] == []
    assert all(set(n) == NODE_KEYS for n in data["nodes"])
    nodes = {n["node"]: n for n in data["nodes"]}
    assert nodes["add"]["rule"] == 3 and nodes["add"]["weight"] is None
    assert nodes["conv2d"]["rule"] == 0 and nodes["conv2d"]["shape"] == [1, 8, 8, 8]
    assert nodes["fc_weight_fake_quant"]["quantizer"] == "int8/per_channel"
    assert all(n["stage"] is None and n["device"] is None for n in data["nodes"])
    assert "bn" not in nodes  # static mode folds batch norm
    s = data["summary"]
    assert set(s) == SUMMARY_KEYS
    assert s["mode"] == "static" and s["trace_method"] == "symbolic"
    assert s["quantizers"] == {"weight int8 per_channel": 3, "activation uint8 per_tensor": 4,
                              "input uint8 per_tensor": 1}
    assert 0 < s["quantized_bytes"] < s["fp32_bytes"]
    assert s["stages"] == [] and s["balance_ratio"] is None


def test_show_pipeline(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, _ = run(capsys, "show", str(work / "pipe.yaml"), "--model", ref(work, "mlp"),
                     "--input-shape", "2x16", "--format", "json")
    assert rc == 0
    data = json.loads(out)
    assert {n["stage"] for n in data["nodes"]} == {0, 1}
    assert {n["device"] for n in data["nodes"]} == {"cpu"}
    stages = data["summary"]["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert sum(s["parameters"] for s in stages) == 2788
    assert data["summary"]["balance_ratio"] >= 1.0
    rc, out, _ = run(capsys, "show", str(work / "pipe.yaml"), "--model", ref(work, "mlp"),
                     "--input-shape", "2x16")
    assert rc == 0
    header, rows = table_rows(out, [*TABLE_COLUMNS, "stage", "device"])
    assert header == [*TABLE_COLUMNS, "stage", "device"]
    assert {r["stage"] for r in rows} == {"0", "1"}
    assert "stages: 2, max/mean cost" in out
    assert re.search(r"stage 1 on cpu: \d+ nodes", out)


def test_show_pipeline_quantized_size(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    _, out, _ = run(capsys, "show", str(work / "pipe.yaml"), "--model", ref(work, "mlp"),
                    "--input-shape", "2x16", "--format", "json")
    s = json.loads(out)["summary"]
    # 2688 int8 weights at 1 byte + 100 fp32 biases, as without the pipeline
    assert (s["fp32_bytes"], s["quantized_bytes"]) == (2788 * 4, 2688 + 100 * 4)


def test_show_graph_html(capsys: pytest.CaptureFixture[str], work: Path, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default file name is relative
    rc, out, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                       "--graph", "html", "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["files"] == ["qcompile-graph.html"]
    assert "wrote qcompile-graph.html" in err
    checker = HTMLChecker()
    checker.feed((tmp_path / "qcompile-graph.html").read_text(encoding="utf-8"))
    checker.close()
    assert checker.doctype and checker.stack == []
    assert checker.head_cells[:8] == TABLE_COLUMNS
    assert len(checker.body_rows) == len(data["nodes"])
    assert [r[0] for r in checker.body_rows] == [n["node"] for n in data["nodes"]]


def test_show_graph_dot_pipeline(capsys: pytest.CaptureFixture[str], work: Path,
                                 tmp_path: Path) -> None:
    out_file = tmp_path / "pic.dot"
    rc, out, _ = run(capsys, "show", str(work / "pipe.yaml"), "--model", ref(work, "mlp"),
                     "--input-shape", "2x16", "--graph", "dot", "--out", str(out_file),
                     "--format", "json")
    assert rc == 0
    data = json.loads(out)
    assert data["files"] == [str(out_file)]
    text = out_file.read_text(encoding="utf-8")
    nodes = check_dot(text, data["picture"])
    assert "s0.linear" in nodes and "s1.linear_2" in nodes  # stage-prefixed ids
    assert "subgraph cluster_stage0 {" in text and "subgraph cluster_stage1 {" in text
    # the value crossing the cut, with its bytes (2x32 float32)
    assert re.search(r'-> "s1\.linear_2" \[label="fp32 256 B", color="#dc2626"', text)


def test_picture_is_written_atomically(capsys: pytest.CaptureFixture[str], work: Path,
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    """A write that fails half-way (a full disk, a kill) leaves the previous picture whole
    and no temporary behind; a missing --out folder is refused before anything is drawn."""
    out_file = tmp_path / "pic.dot"
    out_file.write_text("previous picture\n", encoding="utf-8")
    real = Path.write_text

    def half_then_fail(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    rc, _, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                     "--graph", "dot", "--out", str(out_file))
    monkeypatch.undo()
    assert rc != 0 and "No space left on device" in err
    assert out_file.read_text(encoding="utf-8") == "previous picture\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pic.dot"]  # no temporaries

    rc, out, _ = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                     "--graph", "dot", "--out", str(out_file))
    assert rc == 0 and out_file.read_text(encoding="utf-8").startswith("digraph")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pic.dot"]

    missing = tmp_path / "no" / "such" / "pic.svg"
    rc, out, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                       "--graph", "svg", "--out", str(missing))
    assert_user_error(rc, out, err, str(missing.parent), "does not exist")
    assert not (tmp_path / "no").exists()


def test_show_graph_svg_without_graphviz(capsys: pytest.CaptureFixture[str], work: Path,
                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """No Graphviz: the SVG comes from the built-in layout; --layout dot says what to do."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `dot` on PATH
    rc, out, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                       "--graph", "svg", "--out", str(tmp_path / "g.svg"), "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["files"] == [str(tmp_path / "g.svg")] and data["picture"]["layout"] == "python"
    assert _count_svg_nodes(tmp_path / "g.svg") == data["picture"]["boxes"]
    assert not (tmp_path / "g.dot").exists()
    rc, out, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                       "--graph", "svg", "--layout", "dot", "--out", str(tmp_path / "h.svg"))
    assert_user_error(rc, out, err, "--layout dot", "Graphviz")
    assert "--layout python" in err.splitlines()[1]
    assert not (tmp_path / "h.svg").exists()


FAKE_DOT = '''\
import re, sys
args = sys.argv[1:]
assert args[0] == "-Tsvg" and args[2] == "-o", args
names = re.findall(r'^\\s*"([^"]+)" \\[label', open(args[1]).read(), re.M)
with open(args[3], "w") as f:
    f.write('<svg xmlns="http://www.w3.org/2000/svg">')
    f.writelines(f'<g class="node"><title>{n}</title></g>' for n in names)
    f.write("</svg>")
'''


def _count_svg_nodes(path: Path) -> int:
    root = ET.parse(path).getroot()  # well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return sum(1 for g in root.iter("{http://www.w3.org/2000/svg}g")
               if g.get("class") == "node")


def test_show_graph_svg_runs_dot(capsys: pytest.CaptureFixture[str], work: Path,
                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SVG plumbing, with a stand-in `dot` on PATH (Graphviz is not needed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fake_dot.py").write_text(FAKE_DOT, encoding="utf-8")
    dot = bin_dir / "dot"
    dot.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{bin_dir / "fake_dot.py"}" "$@"\n',
                   encoding="utf-8")
    dot.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    rc, out, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                       "--graph", "svg", "--out", str(tmp_path / "g.svg"), "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["files"] == [str(tmp_path / "g.dot"), str(tmp_path / "g.svg")]
    assert data["picture"]["layout"] == "dot"  # auto: Graphviz when it is installed
    assert _count_svg_nodes(tmp_path / "g.svg") == data["picture"]["boxes"]


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot")
def test_show_graph_svg_with_graphviz(capsys: pytest.CaptureFixture[str], work: Path,
                                      tmp_path: Path) -> None:
    rc, out, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                       "--graph", "svg", "--out", str(tmp_path / "g.svg"), "--format", "json")
    assert rc == 0, err
    assert _count_svg_nodes(tmp_path / "g.svg") == json.loads(out)["picture"]["boxes"]


def test_show_subprocess(work: Path, tmp_path: Path) -> None:
    p = cli("show", "int8-static", "--model", "inspect_models.py:net", *NET_SHAPE, "--format",
            "json", "--graph", "html", "--out", str(tmp_path / "page.html"), cwd=work)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)  # data only on stdout
    assert {n["node"] for n in data["nodes"]} >= {"x", "conv2d", "add", "linear", "output"}
    assert data["summary"]["quantizers"]["weight int8 per_channel"] == 3
    assert f"wrote {tmp_path / 'page.html'}" in p.stderr
    checker = HTMLChecker()
    checker.feed((tmp_path / "page.html").read_text(encoding="utf-8"))
    assert len(checker.body_rows) == len(data["nodes"])


def test_show_module_style_reference(capsys: pytest.CaptureFixture[str], work: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(work))
    monkeypatch.delitem(sys.modules, "inspect_models", raising=False)
    try:
        rc, out, err = run(capsys, "show", "int8-dynamic", "--model", "inspect_models:mlp",
                           "--input-shape", "2x16", "--format", "json")
    finally:
        sys.modules.pop("inspect_models", None)
    assert rc == 0, err
    s = json.loads(out)["summary"]
    assert s["mode"] == "dynamic" and s["quantizers"]["weight int8 per_channel"] == 4


# -- explain -------------------------------------------------------------------------------
def test_explain_rules(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, _ = run(capsys, "explain", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--format", "json")
    assert rc == 0
    data = json.loads(out)
    # the preset's rules for transposed convs and functional weights select nothing here
    assert [(r["rule"], r["nodes"]) for r in data["rules"]] == [
        (0, ["conv", "conv2", "fc"]), (1, []), (2, []), (3, ["add"])]
    assert data["rules"][3]["match"] == "#3 op=add,matmul,cat" and not data["rules"][3]["skip"]
    rc, out, _ = run(capsys, "explain", "int8-static", "--model", ref(work, "net"), *NET_SHAPE)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("rule #0 module=Conv1d,Conv2d,Conv3d,Linear,Conv1D,LSTM")
    assert lines[0].endswith(": 3 node(s): conv, conv2, fc")
    assert lines[-1] == "rule #3 op=add,matmul,cat: 1 node(s): add"


def test_explain_node(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, _ = run(capsys, "explain", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--node", "add", "--format", "json")
    assert rc == 0
    data = json.loads(out)
    assert data["node"] == "add" and data["chosen_rule"] == 3
    r0, _, _, r1 = data["rules"]
    assert r0["matched"] is False and r0["why"] and r0["why"] != "matches"
    assert r1["matched"] is True and r1["why"] == "matches"
    rc, out, _ = run(capsys, "explain", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--node", "relu")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("node relu (call_module relu): no rule applies")
    assert "no owner has module" in lines[1] and "relu (ReLU)" in lines[1]
    assert any("not a function/method call" in line for line in lines[2:])
    assert not any(line.startswith("  *") for line in lines)
    rc, out, _ = run(capsys, "explain", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--node", "fc")
    assert rc == 0 and "rule 0 applies" in out.splitlines()[0]
    assert out.splitlines()[1].startswith("  * #0")


def test_explain_unknown_node(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, err = run(capsys, "explain", "int8-static", "--model", ref(work, "net"),
                       *NET_SHAPE, "--node", "nope")
    assert_user_error(rc, out, err, "'nope'", "not a node of the graph")
    assert "add" in err.splitlines()[1]  # suggests real node names


def test_explain_accepts_names_from_show(capsys: pytest.CaptureFixture[str],
                                         work: Path) -> None:
    _, out, _ = run(capsys, "show", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                    "--format", "json")
    ruled = [n for n in json.loads(out)["nodes"] if n["rule"] is not None]
    assert {n["node"] for n in ruled} >= {"conv2d", "add", "linear"}
    for n in ruled:
        rc, out, err = run(capsys, "explain", "int8-static", "--model", ref(work, "net"),
                           *NET_SHAPE, "--node", n["node"], "--format", "json")
        assert rc == 0, err
        assert json.loads(out)["chosen_rule"] == n["rule"]


def test_explain_with_unmatched_rule(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, err = run(capsys, "explain", str(work / "nomatch.yaml"), "--model",
                       ref(work, "net"), *NET_SHAPE, "--format", "json")
    assert rc == 1  # as `show`: the spec does not compile this model (explained anyway)
    assert err.startswith("note: quant.rules[1] (module: LSTM) matched no node")
    data = json.loads(out)
    assert [r["rule"] for r in data["rules"]] == [0, 1]
    assert data["rules"][1]["nodes"] == []
    # a single node is still explained against every rule
    rc, out, err = run(capsys, "explain", str(work / "nomatch.yaml"), "--model",
                       ref(work, "net"), *NET_SHAPE, "--node", "fc", "--format", "json")
    assert rc == 1 and "matched no node" in err
    data = json.loads(out)
    assert [r["matched"] for r in data["rules"]] == [True, False]
    assert "LSTM" in data["rules"][1]["why"]


def test_explain_with_unmatched_rule_lists_other_matches(capsys: pytest.CaptureFixture[str],
                                                         work: Path) -> None:
    _, out, _ = run(capsys, "explain", str(work / "nomatch.yaml"), "--model", ref(work, "net"),
                    *NET_SHAPE, "--format", "json")
    assert json.loads(out)["rules"][0]["nodes"] == ["fc"]


def test_explain_subprocess(work: Path) -> None:
    p = cli("explain", "int8-static", "--model", "inspect_models.py:net", *NET_SHAPE,
            "--node", "add", cwd=work)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "node add (call_function <built-in function add>): rule 3 applies"
    assert "  * #3 op=add,matmul,cat: matches" in lines


def test_explain_runs_its_passes_through_the_pipeline(capsys: pytest.CaptureFixture[str],
                                                      work: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from qcompile.graph.pipeline import Pipeline

    ran: list[list[str]] = []
    original = Pipeline.run

    def spy(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
        ran.append([p.name for p in self.passes])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "run", spy)
    rc, _, err = run(capsys, "explain", "int8-static", "--model", ref(work, "net"), *NET_SHAPE)
    assert rc == 0, err
    assert ran[:2] == [["trace", "fold_bn"], ["trace", "fold_bn", "annotate"]]


def test_json_goes_through_the_shared_sink(capsys: pytest.CaptureFixture[str]) -> None:
    from qcompile.tools.output import to_json

    rc, out, _ = run(capsys, "validate", "int8-qat", "--format", "json")
    assert rc == 0
    assert out == to_json(json.loads(out)) + "\n"  # indent 2, "qcompile_inspect" first
    assert next(iter(json.loads(out))) == "qcompile_inspect"


# -- passes --------------------------------------------------------------------------------
def test_passes(capsys: pytest.CaptureFixture[str], work: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dumps"
    rc, out, _ = run(capsys, "passes", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--dump-dir", str(dump), "--diff", "insert_quant", "--format", "json")
    assert rc == 0
    data = json.loads(out)
    files = ["01_trace.txt", "02_fold_bn.txt", "03_annotate.txt", "04_insert_quant.txt",
             "05_overwrite_inputs.txt", "report.json"]
    assert data["files"] == files and sorted(p.name for p in dump.iterdir()) == files
    report = json.loads((dump / "report.json").read_text(encoding="utf-8"))
    assert [p["name"] for p in report["passes"]] == ["trace", "fold_bn", "annotate",
                                                     "insert_quant", "overwrite_inputs"]
    assert "bn" in (dump / "01_trace.txt").read_text(encoding="utf-8").split()
    assert "bn" not in (dump / "02_fold_bn.txt").read_text(encoding="utf-8").split()
    assert "weight_fake_quant" in (dump / "04_insert_quant.txt").read_text(encoding="utf-8")
    diff = data["diff"]
    assert diff["pass"] == "insert_quant"
    assert "conv_weight_fake_quant" in diff["added"] and "add_fake_quant" in diff["added"]
    assert set(diff["removed"]) == {"conv", "conv2", "fc"}
    # text
    rc, out, _ = run(capsys, "passes", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--dump-dir", str(tmp_path / "d2"), "--diff", "insert_quant")
    assert rc == 0
    assert f"wrote 6 files to {tmp_path / 'd2'}" in out
    assert f"pass insert_quant: +{len(diff['added'])} -3" in out
    assert "  + fc_weight_fake_quant" in out.splitlines() and "  - fc" in out.splitlines()


def test_passes_pipeline_dumps(capsys: pytest.CaptureFixture[str], work: Path,
                               tmp_path: Path) -> None:
    rc, out, _ = run(capsys, "passes", str(work / "pipe.yaml"), "--model", ref(work, "mlp"),
                     "--input-shape", "2x16", "--dump-dir", str(tmp_path), "--diff", "place",
                     "--format", "json")
    assert rc == 0
    data = json.loads(out)
    assert data["files"][4:] == ["05_partition.txt", "06_place.txt", "07_overwrite_inputs.txt",
                                 "report.json"]
    assert set(data["diff"]["added"]) == {"stage_0", "stage_1"}


def test_passes_unknown_diff(capsys: pytest.CaptureFixture[str], work: Path,
                             tmp_path: Path) -> None:
    rc, out, err = run(capsys, "passes", "int8-static", "--model", ref(work, "net"),
                       *NET_SHAPE, "--dump-dir", str(tmp_path), "--diff", "nope")
    assert rc == 2 and out == ""
    assert "usage error: --diff 'nope' is not a pass" in err and "insert_quant" in err


CONVERT_STEPS = ["collect_weights", "fold_batchnorm", "lower_activations", "sink_dequantize",
                 "use_kernels", "use_recurrent_kernels", "store_weights", "tidy"]


def test_passes_convert(capsys: pytest.CaptureFixture[str], work: Path, tmp_path: Path) -> None:
    rc, out, _ = run(capsys, "passes", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--dump-dir", str(tmp_path), "--convert", "--diff", "convert.tidy",
                     "--format", "json")
    assert rc == 0
    data = json.loads(out)
    steps = [f"{i:02d}_convert.{s}.txt" for i, s in enumerate(CONVERT_STEPS, start=6)]
    assert data["files"] == ["01_trace.txt", "02_fold_bn.txt", "03_annotate.txt",
                             "04_insert_quant.txt", "05_overwrite_inputs.txt", *steps,
                             "report.json"]
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert [p["name"] for p in report["passes"]][5:] == [f"convert.{s}" for s in CONVERT_STEPS]
    assert data["conversions"] == report["conversions"] and data["conversions"]
    assert data["diff"]["pass"] == "convert.tidy"
    # text, and a pipeline-placed QAT graph: each stage's steps
    rc, out, _ = run(capsys, "passes", str(work / "pipe.yaml"), "--model", ref(work, "mlp"),
                     "--input-shape", "2x16", "--dump-dir", str(tmp_path / "d2"), "--convert")
    assert rc == 0
    assert "converted: " in out and "15_convert.stage_0.tidy.txt" in out
    assert "23_convert.stage_1.tidy.txt" in out


def test_passes_convert_needs_shapes_and_quantizers(capsys: pytest.CaptureFixture[str],
                                                    work: Path, tmp_path: Path) -> None:
    rc, out, err = run(capsys, "passes", "int8-static", "--model", ref(work, "net"),
                       "--dump-dir", str(tmp_path / "a"), "--convert")
    assert rc == 2 and out == "" and "--convert needs --input-shape" in err
    (tmp_path / "float.yaml").write_text("version: 1\n", encoding="utf-8")
    rc, out, err = run(capsys, "passes", str(tmp_path / "float.yaml"), "--model",
                       ref(work, "net"), *NET_SHAPE, "--dump-dir", str(tmp_path / "b"),
                       "--convert")
    assert rc == 1 and out == "" and "no quantizers" in err


def test_passes_subprocess(work: Path, tmp_path: Path) -> None:
    p = cli("passes", "int8-qat", "--model", "inspect_models.py:net", *NET_SHAPE,
            "--dump-dir", str(tmp_path), "--diff", "insert_quant", "--format", "json", cwd=work)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["files"][0] == "01_trace.txt" and data["files"][-1] == "report.json"
    assert any(n.endswith("weight_fake_quant") for n in data["diff"]["added"])
    assert (tmp_path / "04_insert_quant.txt").is_file()


# -- sqnr ----------------------------------------------------------------------------------
def _check_layers(data: dict[str, Any], batches: int) -> list[float]:
    assert data["batches"] == batches
    values = [r["sqnr_db"] for r in data["layers"]]
    assert values, "no layers measured"
    assert values == sorted(values)  # worst first
    assert all(math.isfinite(v) and v > 20 for v in values), values
    return values


def test_sqnr_random(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, _ = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--random", "2", "--format", "json")
    assert rc == 0
    data = json.loads(out)
    _check_layers(data, 2)
    assert {"add", "relu"} <= {r["node"] for r in data["layers"]}
    rc, out, _ = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--random", "2")
    assert rc == 0
    header, rows = table_rows(out, ["node", "sqnr_db"])
    assert header == ["node", "sqnr_db"]
    assert [r["node"] for r in rows] == [r["node"] for r in data["layers"]]
    assert [float(r["sqnr_db"]) for r in rows] == [round(r["sqnr_db"], 2)
                                                   for r in data["layers"]]


@pytest.mark.parametrize("tuples", [True, False], ids=["tuples", "tensors"])
def test_sqnr_calib_file(capsys: pytest.CaptureFixture[str], work: Path, tmp_path: Path,
                         tuples: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(1, 3, 8, 8, generator=gen) for _ in range(3)]
    calib = tmp_path / "calib.pt"
    torch.save([(b,) for b in batches] if tuples else batches, calib)
    rc, out, err = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"),
                       "--calib", str(calib), "--format", "json")
    assert rc == 0, err
    _check_layers(json.loads(out), 3)


def test_sqnr_measures_every_activation_quantizer(capsys: pytest.CaptureFixture[str],
                                                  work: Path) -> None:
    _, out, _ = run(capsys, "show", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                    "--format", "json")
    counts = json.loads(out)["summary"]["quantizers"]
    # the layers' outputs, and the model input the first conv reads (inputs: auto)
    activations = counts["activation uint8 per_tensor"] + counts["input uint8 per_tensor"]
    _, out, _ = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                    "--random", "2", "--format", "json")
    assert len(json.loads(out)["layers"]) == activations == 5


def test_sqnr_qat_spec_observes_batches(capsys: pytest.CaptureFixture[str],
                                        work: Path) -> None:
    rc, out, _ = run(capsys, "sqnr", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE,
                     "--random", "2", "--format", "json")
    assert rc == 0
    _check_layers(json.loads(out), 2)


def test_sqnr_pipeline(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, _ = run(capsys, "sqnr", str(work / "pipe.yaml"), "--model", ref(work, "mlp"),
                     "--input-shape", "2x16", "--random", "1", "--format", "json")
    assert rc == 0
    assert json.loads(out)["layers"]


def test_sqnr_without_activation_quantizers(capsys: pytest.CaptureFixture[str],
                                            work: Path) -> None:
    rc, out, _ = run(capsys, "sqnr", "w8-weight-only", "--model", ref(work, "mlp"),
                     "--input-shape", "2x16", "--random", "1")
    assert rc == 0
    assert out.strip() == "no quantized activations"


def test_sqnr_usage(capsys: pytest.CaptureFixture[str], work: Path, tmp_path: Path) -> None:
    rc, out, err = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"))
    assert rc == 2 and out == ""
    assert "sqnr needs --input-shape" in err
    rc, _, err = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--random", "2", "--calib", str(tmp_path / "c.pt"))
    assert rc == 2 and "not allowed with" in err


def test_sqnr_subprocess(work: Path) -> None:
    p = cli("sqnr", "int8-static", "--model", "inspect_models.py:net", *NET_SHAPE,
            "--random", "2", "--format", "json", cwd=work)
    assert p.returncode == 0, p.stderr
    _check_layers(json.loads(p.stdout), 2)


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(("model", "needles"), [
    ("inspect_models.py", ["is not MODULE:FACTORY"]),
    ("missing.py:net", ["no file missing.py"]),
    ("inspect_models.py:nothere", ["has no callable 'nothere'"]),
    ("no_such_package_xyz.mod:net", ["importing no_such_package_xyz.mod failed",
                                     "ModuleNotFoundError"]),
    ("inspect_models.py:broken", ["raised RuntimeError: factory exploded"]),
    ("inspect_models.py:not_a_module", ["returned int, not a torch.nn.Module"]),
], ids=["no-colon", "missing-file", "missing-attribute", "missing-package", "raises",
        "not-a-module"])
@pytest.mark.parametrize("command", ["show", "explain", "passes", "sqnr"])
def test_bad_model_reference(capsys: pytest.CaptureFixture[str], work: Path,
                             monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str,
                             model: str, needles: list[str]) -> None:
    monkeypatch.chdir(work)
    extra = ["--dump-dir", str(tmp_path / "d")] if command == "passes" else []
    rc, out, err = run(capsys, command, "int8-static", "--model", model, *NET_SHAPE, *extra)
    assert_user_error(rc, out, err, "--model", *needles)


def test_wrong_input_shape(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, err = run(capsys, "show", "int8-static", "--model", ref(work, "net"),
                       "--input-shape", "1x5x8x8")
    reason = assert_user_error(rc, out, err, "node 'conv'")
    assert "3 channels" in reason


def test_unmatched_rule(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, err = run(capsys, "show", str(work / "nomatch.yaml"), "--model",
                       ref(work, "net"), *NET_SHAPE)
    assert_user_error(rc, out, err, "quant.rules[1]", "matched no node")
    assert "optional: true" in err


def test_invalid_spec_for_model_commands(capsys: pytest.CaptureFixture[str],
                                         work: Path) -> None:
    rc, out, err = run(capsys, "show", str(work / "unknown_key.yaml"), "--model",
                       ref(work, "net"), *NET_SHAPE)
    assert_user_error(rc, out, err, "invalid spec: quant.rulez")


@pytest.mark.parametrize("argv", [
    ["show", "int8-qat", "--input-shape", "1x3x8x8"],                       # no --model
    ["show", "int8-qat", "--model", "M:net", "--input-shape", "2xfoo"],
    ["show", "int8-qat", "--model", "M:net", "--input-shape", "1x3x8x8", "--dtype", "nope"],
    ["show", "int8-qat", "--model", "M:net", "--graph", "png"],
    ["show", "int8-qat", "--model", "M:net", "--format", "yaml"],
    ["passes", "int8-qat", "--model", "M:net"],                             # no --dump-dir
    ["frobnicate"],
    [],
], ids=["no-model", "bad-shape", "bad-dtype", "bad-graph", "bad-format", "no-dump-dir",
        "unknown-command", "no-command"])
def test_usage_errors(capsys: pytest.CaptureFixture[str], work: Path, argv: list[str]) -> None:
    argv = [ref(work, "net") if a == "M:net" else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert "Traceback" not in err
    assert "usage" in err


def test_bad_input_shape_message(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, _, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"),
                     "--input-shape", "2xfoo")
    assert rc == 2
    assert err.strip() == "usage error: --input-shape '2xfoo' is not like 1x3x32x32"


def test_negative_input_shape_is_usage_error(capsys: pytest.CaptureFixture[str],
                                             work: Path) -> None:
    rc, _, err = run(capsys, "show", "int8-qat", "--model", ref(work, "net"),
                     "--input-shape", "1x-3x8x8")
    assert rc == 2 and "usage error: --input-shape" in err


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.startswith("qcompile-inspect ")
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    assert all(c in out for c in ("validate", "schema", "show", "explain", "passes", "sqnr"))


def test_debug_shows_traceback(capsys: pytest.CaptureFixture[str], work: Path,
                               tmp_path: Path) -> None:
    rc, out, err = run(capsys, "show", "int8-qat", "--model", ref(work, "broken"), *NET_SHAPE,
                       "--debug")
    assert rc == 1 and out == ""
    assert "Traceback (most recent call last)" in err
    assert 'raise RuntimeError("factory exploded")' in err  # the user's own frame
    assert err.strip().splitlines()[-2].startswith("error: --model")
    # the picture's folder does not exist: refused before drawing, traceback on --debug
    argv = ["show", "int8-qat", "--model", ref(work, "net"), *NET_SHAPE, "--graph", "html",
            "--out", str(tmp_path / "missing" / "g.html")]
    rc, out, err = run(capsys, *argv)
    assert_user_error(rc, out, err, "missing does not exist")
    rc, _, err = run(capsys, *argv, "--debug")
    assert rc == 1 and "Traceback (most recent call last)" in err and "does not exist" in err


def test_errors_subprocess(work: Path) -> None:
    p = cli("show", "int8-qat", "--model", "inspect_models.py:broken", *NET_SHAPE, cwd=work)
    assert p.returncode == 1
    assert p.stdout == ""
    assert "Traceback" not in p.stderr
    assert p.stderr.splitlines()[0] == (
        "error: --model: inspect_models.py:broken raised RuntimeError: factory exploded")
    p = cli("show", "int8-qat", "--model", "inspect_models.py:net", "--input-shape", "2xfoo",
            cwd=work)
    assert p.returncode == 2 and "Traceback" not in p.stderr


# -- bad input and everyday use (issue 15) -----------------------------------------------------
def test_factory_exiting_is_reported(capsys: pytest.CaptureFixture[str], work: Path) -> None:
    rc, out, err = run(capsys, "show", "int8-static", "--model", ref(work, "exits"),
                       *NET_SHAPE)
    assert_user_error(rc, out, err, "--model", "exited with code 3")


def test_factory_exiting_subprocess(work: Path) -> None:
    p = cli("show", "int8-static", "--model", "inspect_models.py:exits", *NET_SHAPE, cwd=work)
    assert p.returncode == 1 and p.stdout == ""
    assert "exited with code 3" in p.stderr.splitlines()[0]


def test_explain_and_show_agree_on_unmatched_rules(capsys: pytest.CaptureFixture[str],
                                                   work: Path) -> None:
    argv = [str(work / "nomatch.yaml"), "--model", ref(work, "net"), *NET_SHAPE]
    show_rc, _, _ = run(capsys, "show", *argv)
    explain_rc, out, _ = run(capsys, "explain", *argv)
    assert show_rc == explain_rc == 1
    assert "rule #1 module=LSTM" in out  # still explained


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_random_must_be_positive(capsys: pytest.CaptureFixture[str], work: Path,
                                 value: str) -> None:
    rc, out, err = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                       "--random", value)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert "argument --random" in err
    assert ("must be >= 1" in err) == (value != "two")


def _calib(tmp_path: Path, name: str, data: Any) -> str:
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        torch.save(data, path)
    return str(path)


@pytest.mark.parametrize(("data", "shape", "needle"), [
    (None, False, "no such file"),
    (b"not a torch file", False, "torch.load(weights_only=True) cannot read it"),
    ([], False, "holds no batches"),
    ({"x": torch.randn(1, 3, 8, 8)}, False, "batch 0 input 0 is a dict, not a tensor"),
    (["text"], False, "batch 0 input 0 is a str"),
    ([torch.full((1, 3, 8, 8), float("nan"))], False, "contains NaN or Inf"),
    ([torch.randn(1, 5, 8, 8)], False, "batch 0 does not fit the model"),
    ([torch.randn(1, 5, 8, 8)], True, "batch 0 input 0 has shape [1, 5, 8, 8], "
                                      "--input-shape gives [1, 3, 8, 8]"),
    ([(torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8))], True, "has 2 input(s)"),
], ids=["missing", "garbage", "empty", "dict", "str", "nan", "wrong-shape",
        "wrong-shape-vs-input-shape", "wrong-arity"])
def test_bad_calib_data_is_a_usage_error(capsys: pytest.CaptureFixture[str], work: Path,
                                         tmp_path: Path, data: Any, shape: bool,
                                         needle: str) -> None:
    path = str(tmp_path / "missing.pt") if data is None else _calib(tmp_path, "c.pt", data)
    rc, out, err = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"),
                       *(NET_SHAPE if shape else []), "--calib", path)
    assert rc == 2 and out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"usage error: --calib {path}: "), err
    assert needle in lines[0]


def test_bad_calib_data_subprocess(work: Path, tmp_path: Path) -> None:
    path = _calib(tmp_path, "c.pt", b"garbage")
    p = cli("sqnr", "int8-static", "--model", "inspect_models.py:net", "--calib", path,
            cwd=work)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_sqnr_leaves_the_float_model_alone(work: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The measuring path does not switch the user's model to eval mode (qc.sqnr measures
    a copy)."""
    import qcompile.tools.inspect_cli as inspect_cli

    built: list[torch.nn.Module] = []
    real_build = inspect_cli.build

    def spy(args: Any) -> Any:
        model, spec, inputs = real_build(args)
        built.append(model.train())
        return model, spec, inputs

    monkeypatch.setattr(inspect_cli, "build", spy)
    rc, _, err = run(capsys, "sqnr", "int8-static", "--model", ref(work, "net"), *NET_SHAPE,
                     "--random", "1")
    assert rc == 0, err
    assert built and all(m.training for m in built[0].modules())

