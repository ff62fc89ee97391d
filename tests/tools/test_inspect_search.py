"""``qcompile-inspect search`` (the Pareto table and plot of a ``qc.search`` report) and
the picture coloured by weight bits (``--color bits``), checked by structure: the rows and
columns of the table, the JSON, the SVG's nodes, fills and legend."""

from __future__ import annotations

import json
import math
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.mixed_precision import ParetoPoint, SearchDetails, SearchGroup
from qcompile.tools.inspect_cli import main, pareto_rows
from qcompile.tools.inspect_picture import collapse, dot, graph, html, svg

SVG = "{http://www.w3.org/2000/svg}"
CANDIDATES = ["int4/per_group32", "int8/per_channel"]


def details() -> SearchDetails:
    """Three layers and a conv int4 cannot take (score inf); the front has a repeated
    point (two budgets between the same steps) and the chosen point at 5.0 bits."""
    groups = [SearchGroup(name=f"layers.{i}.fc", layers=[f"layers.{i}.fc"],
                          parameters=1024 * (i + 1), scores=[0.1 / (i + 1), 0.001],
                          sqnr_db=[20.0 + i, 45.0]) for i in range(3)]
    groups.append(SearchGroup(name="conv", layers=["conv"], parameters=144,
                              scores=[math.inf, 0.002], sqnr_db=[-math.inf, 40.0]))
    fronts = [(4.0, 3000, 0.2, (0, 0, 0)), (5.0, 3500, 0.1, (1, 0, 0)),
              (5.0, 3500, 0.1, (1, 0, 0)), (6.5, 4300, 0.03, (1, 1, 0)),
              (8.0, 5000, 0.004, (1, 1, 1))]
    pareto = [ParetoPoint(avg_weight_bits=b, weight_bytes=n, predicted_error=e,
                          chosen={**{f"layers.{i}.fc": c for i, c in enumerate(cs)},
                                  "conv": 1})
              for b, n, e, cs in fronts]
    return SearchDetails(
        metric="sqnr", granularity="layer", budget={"avg_weight_bits": 5.0},
        candidates=CANDIDATES, bits=[4.0, 8.0], groups=groups,
        chosen={"layers.0.fc": 1, "layers.1.fc": 0, "layers.2.fc": 0, "conv": 1},
        predicted_error=0.1, avg_weight_bits=5.0, weight_bytes=3500, pareto=pareto,
        seconds={"scoring": 1.5, "solving": 0.01}, batches=4, ranks=1)


@pytest.fixture
def report(tmp_path: Path) -> Path:
    path = tmp_path / "details.json"
    path.write_text(details().model_dump_json(), encoding="utf-8")
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- the table ------------------------------------------------------------------------------
def test_text_table(capsys: pytest.CaptureFixture[str], report: Path) -> None:
    rc, out, err = run(capsys, "search", str(report))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("search: metric sqnr, granularity layer, budget "
                               "avg_weight_bits 5.0; 4 group(s), 4 batch(es), 1 rank(s)")
    assert "int4/per_group32 (4 bits), int8/per_channel (8 bits)" in lines[1]
    assert "5.000 avg weight bits, 0.0035 MB, predicted error 0.1" in lines[2]
    head = lines.index("Pareto front (budget vs error; groups per candidate; * the chosen "
                       "point):")
    front = lines[head + 2:head + 6]  # the repeated point is shown once
    assert [r.split()[0] for r in front] == ["4.000", "*", "6.500", "8.000"]
    assert front[1].split() == ["*", "5.000", "0.0035", "0.1", "2", "2"]
    assert lines[head + 6] == ""
    groups = lines[lines.index("chosen candidate per group (scores: predicted error, sqnr):")
                   + 1:]
    assert groups[0].split()[:3] == ["group", "params", "chosen"]
    assert groups[1].split() == ["layers.0.fc", "1024", "int8/per_channel", "0.1", "0.001",
                                 "20", "45"]
    assert groups[4].split() == ["conv", "144", "int8/per_channel", "inf", "0.002", "-inf", "40"]


def test_json_and_measured_points(capsys: pytest.CaptureFixture[str], report: Path,
                                  tmp_path: Path) -> None:
    measured = tmp_path / "measured.json"
    # 4.0 and 8.0: the ends of the front; 5.002: the chosen point (within SAME_BITS);
    # 4.7: measured where the front has no point, so a row of its own
    measured.write_text(json.dumps({"metric": "perplexity", "values": {
        "4.0": 6.2, "5.002": 5.6, "4.7": 5.9, "8.0": 5.1}}), encoding="utf-8")
    rc, out, err = run(capsys, "search", str(report), "--measured", str(measured), "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["qcompile_inspect"] == 1 and data["measured_metric"] == "perplexity"
    rows = [(r["avg_weight_bits"], r["predicted_error"], r["measured"], r["chosen"])
            for r in data["pareto"]]
    assert rows == [(4.0, 0.2, 6.2, False), (4.7, None, 5.9, False), (5.0, 0.1, 5.6, True),
                    (6.5, 0.03, None, False), (8.0, 0.004, 5.1, False)]
    assert data["pareto"][3]["groups_per_candidate"] == [1, 3]
    assert data["groups"][3]["scores"] == ["inf", 0.002]  # strict JSON, not Infinity
    assert data["chosen"] == {"avg_weight_bits": 5.0, "weight_bytes": 3500,
                              "predicted_error": 0.1}
    # a plain mapping reads the same, with a generic name; text shows the column
    measured.write_text(json.dumps({"4.0": 6.2}), encoding="utf-8")
    rc, out, _ = run(capsys, "search", str(report), "--measured", str(measured))
    assert rc == 0 and "predicted  measured" in out
    assert out.splitlines()[6].split()[:4] == ["4.000", "0.003", "0.2", "6.2"]


def test_pareto_rows_match_measured_once() -> None:
    rows = pareto_rows(details(), {5.0: 1.0, 5.001: 2.0})
    # two measurements near one point: the first takes it, the second gets its own row
    assert [(r["avg_weight_bits"], r["measured"]) for r in rows
            if r["measured"] is not None] == [(5.0, 1.0), (5.001, 2.0)]


@pytest.mark.parametrize(("content", "needle"), [
    ("not json", "not JSON"), ("[1, 2]", "expected a non-empty JSON object"),
    ('{"4.0": "high"}', "entry '4.0'"), ('{"values": {}}', "non-empty")])
def test_bad_measured_file(capsys: pytest.CaptureFixture[str], report: Path, tmp_path: Path,
                           content: str, needle: str) -> None:
    bad = tmp_path / "m.json"
    bad.write_text(content, encoding="utf-8")
    rc, out, err = run(capsys, "search", str(report), "--measured", str(bad))
    assert rc == 1 and out == "" and needle in err and "\n  fix: " in err


def test_bad_details_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, _, err = run(capsys, "search", str(tmp_path / "missing.json"))
    assert rc == 2 and "no such file" in err
    broken = details().model_dump(mode="json")
    del broken["pareto"]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(broken), encoding="utf-8")
    rc, out, err = run(capsys, "search", str(path))
    assert rc == 1 and out == "" and "not a search report: pareto: Field required" in err
    assert "model_dump_json" in err  # the fix says how to write one
    rc, _, err = run(capsys, "search", str(tmp_path / "missing.json"), "--measured",
                     str(tmp_path / "m.json"))
    assert rc == 2


# -- the plot -------------------------------------------------------------------------------
def test_plot_without_matplotlib(capsys: pytest.CaptureFixture[str], report: Path,
                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    rc, out, err = run(capsys, "search", str(report), "--plot", str(tmp_path / "p.svg"))
    assert rc == 1 and out == ""
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err
    assert not (tmp_path / "p.svg").exists()


def test_plot_arguments(capsys: pytest.CaptureFixture[str], report: Path,
                        tmp_path: Path) -> None:
    rc, _, err = run(capsys, "search", str(report), "--plot", str(tmp_path / "p.pdf"))
    assert rc == 2 and ".svg or .png" in err
    rc, _, err = run(capsys, "search", str(report), "--plot", str(tmp_path / "no" / "p.svg"))
    assert rc == 1 and "does not exist" in err


def test_plot_svg_and_png(capsys: pytest.CaptureFixture[str], report: Path,
                          tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"metric": "perplexity", "values": {"4.0": 6.2, "8.0": 5.1}}),
                        encoding="utf-8")
    out_svg = tmp_path / "pareto.svg"
    rc, out, err = run(capsys, "search", str(report), "--measured", str(measured), "--plot",
                       str(out_svg), "--json")
    assert rc == 0, err
    assert json.loads(out)["files"] == [str(out_svg)] and f"wrote {out_svg}" in err
    text = out_svg.read_text(encoding="utf-8")
    ET.fromstring(text)  # well-formed
    for label in ("predicted (sqnr)", "measured (perplexity)", "chosen",
                  "average weight bits (budget)"):
        assert label in text, label
    assert sorted(p.name for p in tmp_path.iterdir()) == ["details.json", "measured.json",
                                                          "pareto.svg"]  # no temporaries
    out_png = tmp_path / "pareto.png"
    assert run(capsys, "search", str(report), "--plot", str(out_png))[0] == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the picture coloured by weight bits ----------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


INT4 = {"dtype": "int4", "granularity": "per_group", "group_size": 32}
INT8 = {"dtype": "int8", "granularity": "per_channel"}
# what qc.search returns for granularity block: one rule per block, then the user's rules
MIXED = [{"match": {"name": "layers.0.*"}, "weight": INT8},
         {"match": {"name": "layers.1.*"}, "weight": INT4},
         {"match": {"name": "layers.2.up"}, "weight": INT4},
         {"match": {"name": "head"}, "skip": True},
         {"match": {"module": "Linear"}, "weight": INT8}]


def compile_mixed() -> Any:
    torch.manual_seed(0)
    spec = qc.CompileSpec.model_validate({"quant": {"mode": "dynamic", "rules": MIXED}})
    return qc.qcompile(Net().eval(), spec, (torch.randn(2, 32),))


def nodes_of(text: str) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    root = ET.fromstring(text)
    nodes = {}
    for g in root.iter(f"{SVG}g"):
        if "node" in (g.get("class") or "").split():
            rect = g.find(f"{SVG}rect")
            assert rect is not None
            nodes[g.get("data-id", "")] = {"dtype": g.get("data-weight-dtype"),
                                           "bits": g.get("data-bits"),
                                           "fill": rect.get("fill"), "kind": g.get("data-kind")}
    legend = [(g.get("data-label", ""), g.find(f"{SVG}rect").get("fill"))  # type: ignore[union-attr]
              for g in root.iter(f"{SVG}g") if g.get("class") == "legend-item"]
    return nodes, legend


def test_picture_coloured_by_weight_bits() -> None:
    gm = compile_mixed()
    pg = graph.from_graph_module(gm)
    nodes, legend = nodes_of(svg.to_svg(pg, colour="bits"))
    ops = {n.title: n.id for n in pg.nodes if n.kind == "op" and n.weight_dtype}
    want = {"layers.0.up": "int8", "layers.0.down": "int8", "layers.1.up": "int4",
            "layers.1.down": "int4", "layers.2.up": "int4", "layers.2.down": "int8",
            "head": "float"}
    assert {t: nodes[i]["dtype"] for t, i in ops.items()} == want
    fills = {"int4": "#fde047", "int8": "#93c5fd", "float": "#ffffff"}
    for title, dtype in want.items():
        assert nodes[ops[title]]["fill"] == fills[dtype], title
    assert nodes[ops["layers.1.up"]]["bits"] == "4" and nodes[ops["head"]]["bits"] is None
    # the weight quantizers carry their layer's colour; activation-free graph: no others
    quantizers = {i: n for i, n in nodes.items() if n["kind"] == "quantizer"}
    assert len(quantizers) == 6 and all(n["fill"] == fills[n["dtype"]]
                                        for n in quantizers.values())
    assert legend == [("int4 · 4 bits", fills["int4"]), ("int8 · 8 bits", fills["int8"]),
                      ("float weights", fills["float"])]
    # without --color bits nothing changes colour, and there is no legend
    plain, no_legend = nodes_of(svg.to_svg(pg))
    assert no_legend == [] and plain[ops["layers.1.up"]]["fill"] == svg.KIND_FILL["op"]


def test_collapsed_boxes_keep_one_dtype_or_say_mixed() -> None:
    gm = compile_mixed()
    pg = collapse.collapse(graph.from_graph_module(gm), 2, classes=graph.module_classes(gm))
    nodes, legend = nodes_of(svg.to_svg(pg, colour="bits"))
    boxes = {i: n for i, n in nodes.items() if n["kind"] == "module"}
    assert {i: (n["dtype"], n["fill"]) for i, n in boxes.items()} == {
        "mod:layers.0": ("int8", "#93c5fd"), "mod:layers.1": ("int4", "#fde047"),
        "mod:layers.2": ("mixed", svg.MIXED_FILL)}
    box = next(n for n in pg.nodes if n.id == "mod:layers.2")
    assert box.details["weight dtypes"] == "int4 x1, int8 x1"
    assert [label for label, _ in legend][-1] == "several dtypes (box)"


def test_dot_html_and_cli_colour_by_bits(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    pg = graph.from_graph_module(compile_mixed())
    text = dot.to_dot(pg, "bits")
    assert "subgraph cluster_legend {" in text
    assert '"legend:int4 · 4 bits" [label="int4 · 4 bits", fillcolor="#fde047"];' in text
    assert 'fillcolor="#fde047"' not in dot.to_dot(pg)
    page = html.to_html(pg, svg.to_svg(pg, colour="bits"), colour="bits")
    assert 'style="background:#fde047"></span>int4 · 4 bits' in page
    with pytest.raises(ValueError, match="colour 'heat'"):
        svg.to_svg(pg, colour="heat")
    # the command line: show --graph svg --color bits on a model file
    models = tmp_path / "models.py"
    models.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def mlp():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    """), encoding="utf-8")
    spec = tmp_path / "mixed.json"
    spec.write_text(json.dumps({"quant": {"mode": "dynamic", "rules": [
        {"match": {"name": "0"}, "weight": INT4}, {"match": {"name": "2"}, "weight": INT8}]}}),
        encoding="utf-8")
    out_svg = tmp_path / "g.svg"
    rc, out, err = run(capsys, "show", str(spec), "--model", f"{models}:mlp", "--input-shape",
                       "2x32", "--graph", "svg", "--layout", "python", "--color", "bits",
                       "--out", str(out_svg), "--format", "json")
    assert rc == 0, err
    drawn = json.loads(out)["picture"]
    assert drawn["colour"] == "bits"
    assert drawn["weight_dtypes"] == ["int4 · 4 bits", "int8 · 8 bits"]
    nodes, _ = nodes_of(out_svg.read_text(encoding="utf-8"))
    assert {n["dtype"]: n["fill"] for n in nodes.values() if n["kind"] == "op"
            and n["dtype"]} == {"int4": "#fde047", "int8": "#93c5fd"}


def test_chosen_point_off_the_front_gets_its_row() -> None:
    d = details().model_copy(update={"pareto": [p for p in details().pareto
                                                if p.avg_weight_bits != 5.0]})
    rows = pareto_rows(d, {})
    assert [(r["avg_weight_bits"], r["chosen"], r["groups_per_candidate"]) for r in rows] == [
        (4.0, False, [3, 1]), (5.0, True, [2, 2]), (6.5, False, [1, 3]), (8.0, False, [0, 4])]


def test_searched_spec_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """qc.search on a small model (one choice per block): the report reads back in the CLI,
    and the picture of the compiled result colours each block by the bits it was given."""
    torch.manual_seed(0)
    model = Net().eval()
    spec = qc.CompileSpec.model_validate({"quant": {"mode": "dynamic", "rules": [
        {"match": {"name": "head"}, "skip": True},
        {"match": {"module": "Linear"}, "weight": INT8}],
        "search": {"candidates": [{"weight": INT4}, {"weight": INT8}],
                   "budget": {"avg_weight_bits": 5.5}, "granularity": "block"}}})
    batches = [(torch.randn(4, 32),) for _ in range(2)]
    found, found_details = qc.search(model, spec, batches, details=True)
    path = tmp_path / "details.json"
    path.write_text(found_details.model_dump_json(), encoding="utf-8")
    rc, out, err = run(capsys, "search", str(path), "--json")
    assert rc == 0, err
    data = json.loads(out)
    chosen = {g["group"]: g["chosen"] for g in data["groups"]}
    assert set(chosen) == {"layers.0", "layers.1", "layers.2"}
    assert sorted(chosen.values()) == ["int4/per_group32", "int4/per_group32",
                                       "int8/per_channel"]  # 5.5 bits: one block in int8
    assert sum(r["chosen"] for r in data["pareto"]) == 1
    pg = collapse.collapse(graph.from_graph_module(qc.qcompile(model, found, batches[0])), 2)
    nodes, _ = nodes_of(svg.to_svg(pg, colour="bits"))
    assert {i.removeprefix("mod:"): n["dtype"] for i, n in nodes.items()
            if n["kind"] == "module"} == {k: v.split("/")[0] for k, v in chosen.items()}
