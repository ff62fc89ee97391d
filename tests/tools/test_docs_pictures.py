"""The pictures of the documentation (``docs/pictures/*.svg``, drawn by
``python -m qcompile.tools.docs_pictures``) are current and readable.

- current: the committed files are what the commands drawn in ``docs/how-to/pictures.md``
  draw now (the same bytes on the machine that drew them; on another CPU, float sums being
  ordered differently on AVX2 and AVX-512, an SQNR may differ by up to ``SQNR_DB`` with the
  fill colour that follows it, any other number in its last printed digit, and nothing
  else may);
- readable: data flows down the page (every edge leaves its source's bottom for a box
  further down, unless marked ``wrap`` / ``back``), a module called twice is drawn twice,
  no label touches another label or a box, every shape and text carries its colours and
  font as attributes (renderers without CSS draw the same), SQNR is printed on the nodes
  it measures, and the pipeline picture shows its two stages and the cut between them;
- a real browser (system Chromium through playwright, skipped without them) renders
  both with no console error, and the labels it lays out do not overlap either.
"""

from __future__ import annotations

import importlib.util
import re
import xml.etree.ElementTree as ET
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from qcompile.tools import docs_pictures

ROOT = Path(__file__).resolve().parents[2]
PICTURES = ROOT / "docs" / "pictures"
PAGE = ROOT / "docs" / "how-to" / "pictures.md"
SVG = "{http://www.w3.org/2000/svg}"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
RESNET, LLAMA = "resnet18-int8-qat.svg", "llama-pipeline.svg"


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the commands draw now."""
    out = tmp_path_factory.mktemp("pictures")
    return {name: docs_pictures.draw(name, out).read_text(encoding="utf-8")
            for name in docs_pictures.COMMANDS}


def committed(name: str) -> str:
    return (PICTURES / name).read_text(encoding="utf-8")


# A measured node's SQNR depends on the CPU's float rounding (the model's convolutions sum
# in another order on AVX2 than on AVX-512: a few tenths of a dB on the ResNet), and so do
# the fill that follows it (``heat``) and a module's worst-node SQNR: SQNRs are compared
# within SQNR_DB, each fill checked against its own SQNR; all else to the last digit.
SQNR_DB = 0.5
SQNR_FILL = re.compile(r'(data-sqnr="([^"]*)"[^>]*><title>[^<]*</title><rect [^>]*?fill=")'
                       r'(#[0-9a-f]{6})')
SQNR = re.compile(r'(data-sqnr="|SQNR )(-?\d+(?:\.\d+)?)')


def _sqnr_fills_follow_their_sqnr(text: str) -> str | None:
    from qcompile.tools.inspect_picture.svg import heat

    for m in SQNR_FILL.finditer(text):
        if heat(float(m.group(2))) != m.group(3):
            return f"fill {m.group(3)} for SQNR {m.group(2)} dB"
    return None


def _same_up_to_last_digit(a: str, b: str) -> str | None:
    """None when ``a`` and ``b`` are equal but for SQNRs within ``SQNR_DB`` (and the fills
    that follow them) and other numbers one unit apart in their last printed digit; else
    where they first differ."""
    a, b = (SQNR_FILL.sub(r"\1#sqnr", t) for t in (a, b))
    sa, sb = ([float(m.group(2)) for m in SQNR.finditer(t)] for t in (a, b))
    if len(sa) != len(sb):
        return f"{len(sa)} SQNRs vs {len(sb)}"
    for x, y in zip(sa, sb):
        if abs(x - y) > SQNR_DB:
            return f"SQNR {x} vs {y} dB"
    a, b = (SQNR.sub(r"\1sqnr", t) for t in (a, b))
    ta, tb = NUMBER.split(a), NUMBER.split(b)
    na, nb = NUMBER.findall(a), NUMBER.findall(b)
    if ta != tb or len(na) != len(nb):
        i = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        return f"text differs near {ta[i][:80]!r} vs {tb[i][:80] if i < len(tb) else ''!r}"
    for x, y in zip(na, nb):
        decimals = max(len(x.partition(".")[2]), len(y.partition(".")[2]))
        if abs(float(x) - float(y)) > 1.01 * 10.0 ** -decimals:
            return f"number {x} vs {y}"
    return None


def test_pictures_are_what_the_commands_draw(drawn: dict[str, str]) -> None:
    for name, now in drawn.items():
        assert (PICTURES / name).is_file(), "run python -m qcompile.tools.docs_pictures"
        assert _sqnr_fills_follow_their_sqnr(now) is None, _sqnr_fills_follow_their_sqnr(now)
        old = committed(name)
        if old != now:
            why = _same_up_to_last_digit(old, now)
            assert why is None, (f"docs/pictures/{name} is out of date ({why}): "
                                 "run python -m qcompile.tools.docs_pictures")


def test_page_shows_the_commands_and_the_pictures() -> None:
    page = PAGE.read_text(encoding="utf-8")
    for name in docs_pictures.COMMANDS:
        assert docs_pictures.command(name) in page, name
        assert f"](../pictures/{name})" in page, name
    for ref in re.findall(r"examples/[\w.-]+", page):  # the files the commands use ship
        assert (ROOT / ref.rstrip(".")).is_file(), ref


# -- reading a picture back ------------------------------------------------------------------
def _points(d: str) -> list[tuple[float, float]]:
    """The end points of a path's commands (M, L, and the last point of each C)."""
    out = []
    for _cmd, args in re.findall(r"([MLC])([^MLC]*)", d):
        values = [float(v) for v in args.split()]
        out.append((values[-2], values[-1]))
    return out


class Picture:
    def __init__(self, text: str) -> None:
        self.root = ET.fromstring(text)
        self.nodes: dict[str, dict[str, Any]] = {}
        self.edges: list[dict[str, Any]] = []
        self.labels: list[tuple[float, ...]] = []  # every label's box
        self.clusters: list[str] = []
        for g in self.root.iter(f"{SVG}g"):
            cls = (g.get("class") or "").split()
            if "node" in cls:
                rect = g.find(f"{SVG}rect")
                assert rect is not None
                self.nodes[g.get("data-id", "")] = {
                    "title": g.findtext(f"{SVG}title"), "attrs": dict(g.attrib),
                    "texts": ["".join(t.itertext()) for t in g.findall(f"{SVG}text")],
                    "box": tuple(float(rect.get(k, "0")) for k in ("x", "y", "width",
                                                                  "height"))}
            elif "edge" in cls:
                path = g.find(f"{SVG}path")
                assert path is not None
                self.edges.append({"src": g.get("data-src"), "dst": g.get("data-dst"),
                                   "class": cls, "points": _points(path.get("d", ""))})
                for rect in g.findall(f"{SVG}rect"):
                    self.labels.append(tuple(float(rect.get(k, "0"))
                                             for k in ("x", "y", "width", "height")))
            elif "cluster" in cls:
                self.clusters.append(g.get("data-stage", ""))

    def named(self, title: str) -> list[dict[str, Any]]:
        return [n for n in self.nodes.values() if n["title"] == title]


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


@pytest.mark.parametrize("name", [RESNET, LLAMA])
def test_renders_without_css(name: str) -> None:
    root = ET.fromstring(committed(name))
    assert root.find(f".//{SVG}style") is None  # no stylesheet to depend on
    for el in root.iter():
        tag = el.tag.removeprefix(SVG)
        if tag in ("rect", "path") and not el.get("d", "").startswith("M0 0L8"):
            assert el.get("fill") and el.get("stroke"), ET.tostring(el)[:200]
        if tag == "text":
            assert el.get("fill") and el.get("font-family") and el.get("font-size"), (
                ET.tostring(el)[:200])
    nodes = [g for g in root.iter(f"{SVG}g") if g.get("class") == "node"]
    assert nodes and all(re.fullmatch(r"#[0-9a-f]{6}", g.find(f"{SVG}rect").get("fill", ""))
                         for g in nodes)  # hex: SVG 1.1 renderers know no hsl()


@pytest.mark.parametrize("name", [RESNET, LLAMA])
def test_flows_down_and_labels_do_not_touch(name: str) -> None:
    p = Picture(committed(name))
    for e in p.edges:
        if {"wrap", "back"} & set(e["class"]):
            continue
        ys = [y for _, y in e["points"]]
        assert ys == sorted(ys), f"{e['src']} -> {e['dst']} goes up"
        src, dst = p.nodes[e["src"]]["box"], p.nodes[e["dst"]]["box"]
        assert src[1] + src[3] <= dst[1], f"{e['src']} is not above {e['dst']}"
    if name == RESNET:
        assert not [e for e in p.edges if {"wrap", "back"} & set(e["class"])]
    boxes = [n["box"] for n in p.nodes.values()]
    assert p.labels
    for a, b in combinations(p.labels, 2):
        assert not _overlap(a, b), (a, b)
    for a in p.labels:
        assert not any(_overlap(a, b) for b in boxes), a
    for a, b in combinations(boxes, 2):
        assert not _overlap(a, b), (a, b)


def test_resnet_draws_each_call_of_a_module() -> None:
    p = Picture(committed(RESNET))
    # BasicBlock calls its relu twice: after conv1-bn1, and after the residual add
    first, second = sorted(p.named("layer2.0.relu"), key=lambda n: n["box"][1])
    assert first["box"][1] + first["box"][3] < second["box"][1]
    ids = {v["title"]: k for k, v in p.nodes.items()}
    path = [e for e in p.edges if e["dst"] == next(k for k, v in p.nodes.items()
                                                   if v is second)]
    assert [e["src"] for e in path] == [ids["layer2.0.add_2_fake_quant"]]
    # the downsampling shortcut runs beside the main branch into the add
    assert {e["src"] for e in p.edges if e["dst"] == ids["add_2"]} == {
        ids["layer2.0.downsample.0.output_fake_quant"], ids["layer2.0.conv2.output_fake_quant"]}
    # the other blocks are boxes, each with the worst SQNR inside
    for block in ("layer1.0", "layer1.1", "layer2.1", "layer3.0", "layer4.1"):
        (box,) = p.named(block)
        assert box["attrs"]["data-kind"] == "module"
        assert box["texts"][1].startswith("BasicBlock · ")
        assert box["texts"][2].startswith("worst SQNR ")


@pytest.mark.parametrize("name", [RESNET, LLAMA])
def test_sqnr_is_printed_on_the_nodes(name: str) -> None:
    p = Picture(committed(name))
    measured = [n for n in p.nodes.values() if "data-sqnr" in n["attrs"]]
    assert len(measured) >= (15 if name == RESNET else 6)
    for n in measured:
        line = n["texts"][-1]
        assert re.fullmatch(r"(worst )?SQNR -?\d+\.\d dB", line), line
        assert abs(float(line.split()[-2]) - float(n["attrs"]["data-sqnr"])) <= 0.051


def test_llama_pipeline_shows_its_stages_and_the_cut() -> None:
    p = Picture(committed(LLAMA))
    assert sorted(p.clusters) == ["0", "1"]
    stage_of = {k: n["attrs"].get("data-stage") for k, n in p.nodes.items()}
    blocks = {n["title"]: n["attrs"].get("data-stage") for n in p.nodes.values()
              if n["title"].startswith("layers.")}
    assert blocks == {"layers.0": "0", "layers.1": "0", "layers.2": "1", "layers.3": "1"}
    cut = [e for e in p.edges if "cut" in e["class"]]
    assert cut and all(stage_of[e["src"]] == "0" and stage_of[e["dst"]] == "1" for e in cut)
    root = ET.fromstring(committed(LLAMA))
    transfers = {g.get("data-transfer") for g in root.iter(f"{SVG}g") if g.get("data-transfer")}
    assert transfers == {"int8", "fp32"}  # activations as int8, the rotary tables as fp32


# -- a real browser ----------------------------------------------------------------------------
def _browser_module() -> Any:
    """``test_inspect_browser``'s fixture and helpers (its Chromium launch and skips)."""
    path = Path(__file__).with_name("test_inspect_browser.py")
    spec = importlib.util.spec_from_file_location("inspect_browser_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _browser_module()
browser = _helpers.browser


@pytest.mark.parametrize("name", [RESNET, LLAMA])
def test_browser_renders_the_pictures(browser: Any, name: str) -> None:
    page = browser.new_page(viewport={"width": 1000, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto((PICTURES / name).as_uri())
    assert page.locator("svg g.node").count() == len(Picture(committed(name)).nodes)
    assert _helpers._png_is_not_blank(page.screenshot())
    # the labels as the browser lays out their text: inside their boxes, apart
    drawn = page.evaluate("""() => Array.from(document.querySelectorAll(
        'g.edge text, g.group text, g.cluster text')).map(t => {
          const b = t.getBBox(); return [b.x, b.y, b.width, b.height]; })""")
    for a, b in combinations(drawn, 2):
        assert not _overlap(a, b), (a, b)
    assert errors == []
    page.close()
