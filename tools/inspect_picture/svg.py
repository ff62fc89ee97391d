"""Draw a ``PictureGraph`` as SVG with the pure-Python layout (``layout.py``).

What is drawn, and how the document marks it (the HTML page and the tests read these),
bottom layer first:

- ``<g class="stage-fills">``: the stages' coloured backgrounds;
- ``<g class="group" data-members="..." data-label="...">``: a fusion group (conv-bn-relu)
  or a weighted op with its weight and output quantizers, a dashed border around its
  boxes (row by row: it never takes in another box);
- ``<g class="edge" data-src data-dst data-label>``: a value, labelled with its shape; a
  cut edge (``class="edge cut"``) is red and labelled with its bytes in fp32 and as
  transferred (``data-fp32-bytes``, ``data-bytes``, ``data-transfer``). Every edge runs
  down the page; the only exceptions are dashed and marked in the class: ``wrap`` (into
  the next column of a wrapped picture) and ``back`` (a cycle). A value is labelled once,
  beside its line (``<rect class="label">`` behind the text), where the label touches no
  box and no other label (``labels``): a shape label that would hide another edge is
  left out (it stays in ``data-label``);
- ``<g class="cluster" data-stage="i">``: a pipeline stage's border and its label (device,
  cost, parameters, bytes in / out), over the edges so no line hides it (one rectangle
  per wrapped column it spans);
- ``<g class="node" data-id data-kind>``: a box, its name once, a second line saying what
  it is and, when measured, a third with its SQNR (``data-sqnr``; a module box: the worst
  inside); a module called again is another box (``data-call="2"``); quantizers are red,
  module boxes blue, and with SQNR each measured node is coloured from red (low dB) to
  green (high dB);
- with ``colour="bits"`` each weighted op, its weight quantizer and each module box is
  filled by its weight's storage bits (``bits_fill``: int4 yellow, int8 blue, float white,
  a box of several dtypes grey), marked ``data-weight-dtype`` / ``data-bits``, and
  ``<g class="legend">`` under the graph names each dtype drawn (``legend``).

There is no stylesheet: every shape carries ``fill`` and ``stroke``, every text its
``font-family``, ``font-size`` and ``fill`` as attributes, so renderers without CSS
(image converters, editors, PDF tools) draw what a browser draws.

The output depends only on the graph: same model, same bytes.

Example:
    >>> from qcompile.tools.inspect_picture.graph import PEdge, PNode, PictureGraph
    >>> pg = PictureGraph(nodes=[PNode("x", "x", "2x4", "input", ""),
    ...                          PNode("fc", "fc", "linear", "op", "fc")],
    ...                   edges=[PEdge("x", "fc", shape="2x4")])
    >>> svg = to_svg(pg)
    >>> svg.count('<g class="node"'), 'data-id="fc"' in svg, ">2x4</text>" in svg
    (2, True, True)
"""

from __future__ import annotations

import colorsys
import itertools
from html import escape
from types import MappingProxyType

from qcompile.tools.inspect_picture import labels
from qcompile.tools.inspect_picture.graph import (
    FLOAT_WEIGHT,
    MIXED_WEIGHT,
    PEdge,
    PGroup,
    PictureGraph,
    PNode,
)
from qcompile.tools.inspect_picture.layout import Layout, layout

CHAR_W = 6.4  # average glyph width of 11px Helvetica / Arial
LABEL_CHAR_W = 6.9  # the same for a cluster's 12px bold label
TITLE_MAX = 36  # characters of a name shown (the whole name is in the tooltip / details)
SUB_MAX = 44
STAGE_COLOURS = ("#dbeafe", "#dcfce7", "#fef9c3", "#fce7f3", "#ede9fe", "#ffedd5")
KIND_FILL = MappingProxyType({"input": "#e5e7eb", "output": "#e5e7eb", "op": "#f9fafb",
                              "quantizer": "#fecaca", "module": "#e0e7ff"})  # read-only
# weight storage bits (at most) -> fill: one colour per common width, apart from the kinds'
BITS_FILLS = ((2.0, "#f9a8d4"), (3.0, "#fdba74"), (4.0, "#fde047"), (5.0, "#bef264"),
              (6.0, "#5eead4"), (8.0, "#93c5fd"), (12.0, "#c4b5fd"), (float("inf"), "#d8b4fe"))
FLOAT_FILL = "#ffffff"  # a weighted op left in float
MIXED_FILL = "#d1d5db"  # a module box holding several weight dtypes
COLOURS = ("auto", "kind", "sqnr", "bits")
LEGEND_H = 30.0  # height of the legend row under the graph
FONT = "Helvetica, Arial, sans-serif"
INK, GREY, LINE = "#111827", "#4b5563", "#6b7280"  # text, second lines, edges and borders
CUT, CUT_TEXT, GROUP, GROUP_TEXT = "#dc2626", "#b91c1c", "#9333ea", "#7e22ce"
EDGE_FONT, CUT_FONT = 9.0, 10.0  # px of the edge labels
EDGE_CHAR_W = 5.3  # average glyph width of 9px text (10px bold: CUT_CHAR_W)
CUT_CHAR_W = 6.2
GROUP_FONT, GROUP_CHAR_W = 9.0, 5.3
STAGE_OPACITY = 0.55


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def sqnr_text(n: PNode) -> str:
    """The SQNR line of a measured node (a module box shows the worst inside)."""
    if n.sqnr is None:
        return ""
    return f"{'worst ' if n.kind == 'module' else ''}SQNR {n.sqnr:.1f} dB"


def box_size(n: PNode) -> tuple[float, float]:
    """Width and height of a node's box, from its (clipped) text."""
    chars = max(len(_clip(n.title, TITLE_MAX)) * 1.08, len(_clip(n.sub, SUB_MAX)),
                len(sqnr_text(n)))
    lines = 1 + bool(n.sub) + (n.sqnr is not None)
    return round(max(48.0, chars * CHAR_W + 16), 1), 22.0 + 12.0 * (lines - 1)


def heat(db: float) -> str:
    """SQNR (dB) -> fill colour: red below 10 dB, green above 40 dB (the hue of
    ``hsl(0..120, 75%, 78%)``, written in hex: SVG 1.1 renderers know no ``hsl()``).

    >>> heat(5.0), heat(25.0), heat(50.0)
    ('#f19d9d', '#f1f19d', '#9df19d')
    """
    t = min(1.0, max(0.0, (db - 10.0) / 30.0))
    rgb = colorsys.hls_to_rgb(round(120 * t) / 360, 0.78, 0.75)
    return "#" + "".join(f"{round(c * 255):02x}" for c in rgb)


def bits_fill(n: PNode) -> str | None:
    """The fill of ``n`` by its weight bits (None: ``n`` has no weight).

    >>> bits_fill(PNode("fc", "fc", "", "op", "", weight_dtype="int4", bits=4.0))
    '#fde047'
    >>> bits_fill(PNode("fc", "fc", "", "op", "", weight_dtype="int8", bits=8.0))
    '#93c5fd'
    """
    if n.weight_dtype is None:
        return None
    if n.weight_dtype == MIXED_WEIGHT:
        return MIXED_FILL
    if n.bits is None:  # float
        return FLOAT_FILL
    return next(fill for top, fill in BITS_FILLS if n.bits <= top)


def legend(pg: PictureGraph) -> list[tuple[str, str]]:
    """(label, fill) for each weight dtype drawn in ``pg``, fewest bits first (float, then
    mixed boxes, last).

    >>> pg = PictureGraph(nodes=[PNode("a", "a", "", "op", "", weight_dtype="int8", bits=8.0),
    ...                          PNode("b", "b", "", "op", "", weight_dtype="int4", bits=4.0),
    ...                          PNode("c", "c", "", "op", "", weight_dtype="float")], edges=[])
    >>> [label for label, _ in legend(pg)]
    ['int4 · 4 bits', 'int8 · 8 bits', 'float weights']
    """
    seen: dict[str, PNode] = {}
    for n in pg.nodes:
        if n.weight_dtype is not None:
            seen.setdefault(n.weight_dtype, n)
    rank = {FLOAT_WEIGHT: float("inf"), MIXED_WEIGHT: float("inf")}

    def key(dtype: str) -> tuple[float, bool, str]:
        bits = seen[dtype].bits
        return (rank.get(dtype, bits if bits is not None else float("inf")),
                dtype == MIXED_WEIGHT, dtype)

    out = []
    for dtype in sorted(seen, key=key):
        n = seen[dtype]
        label = ("float weights" if dtype == FLOAT_WEIGHT else
                 "several dtypes (box)" if dtype == MIXED_WEIGHT else
                 f"{dtype} · {n.bits:g} bits")
        out.append((label, bits_fill(n) or FLOAT_FILL))
    return out


def node_fill(n: PNode, colour: str) -> str:
    """A node's fill for ``colour`` (``kind``, ``sqnr``: SQNR where measured, ``bits``:
    weight bits where the node has a weight; the kind's fill otherwise)."""
    if colour == "sqnr" and n.sqnr is not None:
        return heat(n.sqnr)
    if colour == "bits":
        return bits_fill(n) or KIND_FILL[n.kind]
    return KIND_FILL[n.kind]


def resolve_colour(colour: str, pg: PictureGraph) -> str:
    """``auto`` -> ``sqnr`` when a node has an SQNR, else ``kind``; others unchanged."""
    if colour not in COLOURS:
        raise ValueError(f"colour {colour!r} is not one of {', '.join(COLOURS)}")
    if colour == "auto":
        return "sqnr" if any(n.sqnr is not None for n in pg.nodes) else "kind"
    return colour


def bytes_text(e: PEdge) -> str:
    if e.transfer == "int8" and e.bytes != e.fp32_bytes:
        return f"int8 {e.bytes} B (fp32 {e.fp32_bytes} B)"
    return f"fp32 {e.fp32_bytes} B"


def _f(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _path(pts: list[tuple[float, float]]) -> str:
    d = [f"M{_f(pts[0][0])} {_f(pts[0][1])}"]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if y1 <= y0 or x0 == x1:  # right angles (between wrapped columns), straight down
            d.append(f"L{_f(x1)} {_f(y1)}")
            continue
        dy = (y1 - y0) / 2
        d.append(f"C{_f(x0)} {_f(y0 + dy)} {_f(x1)} {_f(y1 - dy)} {_f(x1)} {_f(y1)}")
    return " ".join(d)


def compute_layout(pg: PictureGraph) -> Layout:
    """The pure-Python layout of ``pg`` (inputs pinned to the top, stages in bands)."""
    return layout([n.id for n in pg.nodes], {n.id: box_size(n) for n in pg.nodes},
                  [(e.src, e.dst) for e in pg.edges], stages={n.id: n.stage for n in pg.nodes},
                  fixed={n.id for n in pg.nodes if n.kind == "input"})


def _text(x: float, y: float, body: str, size: float = 11.0, fill: str = INK,
          extra: str = "") -> str:
    """A ``<text>`` with its font, size and colour as attributes (no stylesheet needed)."""
    return (f'<text x="{_f(x)}" y="{_f(y)}" font-family="{FONT}" font-size="{_f(size)}" '
            f'fill="{fill}"{extra}>{body}</text>')


def _legend_svg(entries: list[tuple[str, str]], y: float) -> tuple[str, float]:
    """The legend row at height ``y`` and its width."""
    x = 8.0
    parts = ['<g class="legend">' + _text(8, y + 15, "weight bits", extra=' font-weight="bold"')]
    x += len("weight bits") * CHAR_W + 14
    for label, fill in entries:
        parts.append(f'<g class="legend-item" data-label="{escape(label)}">'
                     f'<rect x="{_f(x)}" y="{_f(y + 5)}" width="12" height="12" '
                     f'fill="{fill}" stroke="{LINE}" stroke-width="1"/>'
                     + _text(x + 16, y + 15, escape(label)) + "</g>")
        x += 16 + len(label) * CHAR_W + 14
    parts.append("</g>")
    return "".join(parts), x


def edge_label(e: PEdge) -> str:
    """What an edge says: its shape; a cut edge, its bytes first."""
    if e.cut:
        return bytes_text(e) + (f" · {e.shape}" if e.shape else "")
    return e.shape


def _label_size(text: str, cut: bool) -> tuple[float, float]:
    if cut:
        return round(len(text) * CUT_CHAR_W + 4, 1), CUT_FONT + 4
    return round(len(text) * EDGE_CHAR_W + 4, 1), EDGE_FONT + 4


def _blend(colour: str, opacity: float) -> str:
    """``colour`` at ``opacity`` over white, as an opaque colour."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c * opacity + 255 * (1 - opacity)):02x}" for c in rgb)


def _cluster_lines(label: str) -> list[str]:
    lines = label.split(" · ", 3)
    return [" · ".join(lines[:3]), lines[3]] if len(lines) == 4 else [label]


def group_rects(g: PGroup, lay: Layout, pad: float = 5.0) -> list[tuple[float, ...]]:
    """The rectangles a group is drawn around: per row, each run of its boxes with no
    other box between them, and between rows, the span two runs share (the border of
    their union is drawn, so a group never takes in a box that is not its own)."""
    def centre(b: tuple[float, float, float, float]) -> float:
        return round(b[1] + b[3] / 2, 1)

    members = set(g.members)
    rows: dict[float, list[tuple[str, tuple[float, float, float, float]]]] = {}
    for n, b in lay.boxes.items():
        rows.setdefault(centre(b), []).append((n, b))
    mine = sorted({centre(lay.boxes[m]) for m in members if m in lay.boxes})
    runs: list[list[tuple[float, float, float, float]]] = []  # per row, its runs
    for cy in mine:
        row, current = [], []
        for n, b in sorted(rows[cy], key=lambda nb: nb[1][0]):
            if n in members:
                current.append(b)
            elif current:
                row.append(current)
                current = []
        if current:
            row.append(current)
        runs.append([(min(b[0] for b in r) - pad, min(b[1] for b in r) - pad,
                      max(b[0] + b[2] for b in r) + pad, max(b[1] + b[3] for b in r) + pad)
                     for r in row])
    rects = [(x0, y0, x1 - x0, y1 - y0) for row in runs for x0, y0, x1, y1 in row]
    for upper, lower in itertools.pairwise(runs):
        for ax0, _, ax1, ay1 in upper:
            for bx0, by0, bx1, _ in lower:
                x0, x1 = max(ax0, bx0), min(ax1, bx1)
                joint = (x0, ay1, x1 - x0, by0 - ay1)
                if x1 - x0 > 2 * pad and by0 > ay1 and not any(
                        labels.intersects(joint, b) for b in lay.boxes.values()):
                    rects.append(joint)
    return rects


def to_svg(pg: PictureGraph, lay: Layout | None = None, sqnr_colours: bool = True,
           colour: str = "auto") -> str:
    """The SVG document (a string); ``lay`` defaults to ``compute_layout(pg)``; ``colour``
    fills the nodes by ``kind``, ``sqnr``, ``bits`` (with a legend) or ``auto`` (SQNR
    when measured, unless ``sqnr_colours`` is off). Every element carries its colours and
    font as attributes, so renderers without CSS draw it the same."""
    lay = lay or compute_layout(pg)
    colour = resolve_colour(colour, pg)
    if colour == "sqnr" and not sqnr_colours:
        colour = "kind"
    width, height, legend_svg = lay.width, lay.height, ""
    if colour == "bits":
        legend_svg, legend_w = _legend_svg(legend(pg), lay.height)
        width, height = max(width, legend_w), height + LEGEND_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="qc-graph" '
           f'viewBox="0 0 {_f(width)} {_f(height)}" width="{_f(width)}" '
           f'height="{_f(height)}" font-family="{FONT}" font-size="11">',
           '<defs><marker id="qc-arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" '
           f'markerHeight="7" orient="auto"><path d="M0 0L8 4L0 8z" fill="{LINE}"/></marker>'
           '</defs>', '<g class="stage-fills">']
    # labels go where nothing is: node boxes and the clusters' labels are taken first
    taken: list[labels.Box] = list(lay.boxes.values())
    stages = {s.index: s for s in pg.stages}
    clusters = []  # drawn over the edges: a stage's label is never hidden by a line
    for s, rects in sorted(lay.clusters.items()):
        fill = STAGE_COLOURS[s % len(STAGE_COLOURS)]
        label = stages[s].label if s in stages else f"stage {s}"
        parts = [f'<g class="cluster" id="cluster-stage{s}" data-stage="{s}">'
                 f"<title>{escape(label)}</title>"]
        # two lines, and never narrower than them: the label must stay inside
        lines = _cluster_lines(label)
        wide = max(len(t) for t in lines) * LABEL_CHAR_W + 16
        for x, y, w, h in rects:
            spot = (x + 4, y + 2, wide - 8, 14.0 * len(lines) + 4)
            taken.append(spot)
            out.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(max(w, wide))}" '
                       f'height="{_f(h)}" rx="8" fill="{fill}" fill-opacity="{STAGE_OPACITY}" '
                       'stroke="none"/>')
            parts.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(max(w, wide))}" '
                         f'height="{_f(h)}" rx="8" fill="none" stroke="#94a3b8" '
                         'stroke-width="1"/>'
                         f'<rect x="{_f(spot[0])}" y="{_f(spot[1])}" width="{_f(spot[2])}" '
                         f'height="{_f(spot[3])}" fill="{_blend(fill, STAGE_OPACITY)}" '
                         'stroke="none"/>'
                         + _text(x + 8, y + 15, "".join(
                             f'<tspan x="{_f(x + 8)}" dy="{0 if i == 0 else 14}">'
                             f"{escape(t)}</tspan>" for i, t in enumerate(lines)),
                             size=12, extra=' font-weight="bold"'))
        clusters.append("".join(parts) + "</g>")
    out.append('</g><g class="groups">')
    bounds = (width, height)
    for g in pg.groups:
        rects = group_rects(g, lay)
        if not rects:
            continue
        border = " ".join(f"M{_f(a[0])} {_f(a[1])}L{_f(b[0])} {_f(b[1])}"
                          for a, b in labels.outline(rects))
        text = ""
        if g.label:
            spot = labels.place_beside(rects[0], len(g.label) * GROUP_CHAR_W + 2,
                                       GROUP_FONT + 3, taken, bounds)
            if spot is not None:
                taken.append(spot)
                text = _text(spot[0] + 1, spot[1] + GROUP_FONT, escape(g.label),
                             size=GROUP_FONT, fill=GROUP_TEXT)
        out.append(f'<g class="group" id="{g.id}" data-members="{escape(" ".join(g.members))}"'
                   f' data-label="{escape(g.label)}">'
                   f'<path d="{border}" fill="none" stroke="{GROUP}" stroke-width="1" '
                   f'stroke-dasharray="4 3"/>{text}</g>')
    out.append('</g><g class="edges">')
    lines_of = [labels.polyline(pts) for pts in lay.routes]
    taken += [(pts[-1][0] - 5, pts[-1][1] - 8, 10.0, 8.0) for pts in lay.routes if pts]  # arrows
    labelled: set[tuple[str, str]] = set()  # (source, text): a value is labelled once
    kinds = lay.kinds or [""] * len(pg.edges)
    texts: dict[int, str] = {}
    # bytes across a cut first, and wherever there is room; shapes only where they hide
    # no other edge (each shape is in the edge's data-label and the details anyway)
    for k in sorted(range(len(pg.edges)), key=lambda k: not pg.edges[k].cut):
        e, pts, label = pg.edges[k], lay.routes[k], edge_label(pg.edges[k])
        if not pts or not label or (e.src, label) in labelled:
            continue
        w, h = _label_size(label, e.cut)
        others = [line for j, line in enumerate(lines_of) if j != k]
        spot = labels.place_on_route(pts, w, h, taken, others, bounds, clear_only=not e.cut)
        if spot is None:
            continue
        taken.append(spot)
        labelled.add((e.src, label))
        x, y, w, h = spot
        size, fill = (CUT_FONT, CUT_TEXT) if e.cut else (EDGE_FONT, LINE)
        texts[k] = (f'<rect class="label" x="{_f(x)}" y="{_f(y)}" width="{_f(w)}" '
                    f'height="{_f(h)}" fill="#ffffff" fill-opacity="0.85" stroke="none"/>'
                    + _text(x + 2, y + h - 3.5, escape(label), size=size, fill=fill,
                            extra=' font-weight="bold"' if e.cut else ""))
    for k, (e, pts) in enumerate(zip(pg.edges, lay.routes)):
        if not pts:
            continue
        label = edge_label(e)
        attrs = (f'data-src="{escape(e.src)}" data-dst="{escape(e.dst)}"'
                 + (f' data-label="{escape(label)}"' if label else ""))
        if e.cut:
            attrs += (f' data-fp32-bytes="{e.fp32_bytes}" data-bytes="{e.bytes}" '
                      f'data-transfer="{e.transfer}"')
        text = texts.get(k, "")
        cls = " ".join(filter(None, ["edge", "cut" if e.cut else "", kinds[k]]))
        stroke = (f'stroke="{CUT}" stroke-width="2.4"' if e.cut
                  else f'stroke="{LINE}" stroke-width="1.2"')
        dash = ' stroke-dasharray="6 3"' if kinds[k] else ""
        out.append(f'<g class="{cls}" {attrs}><path d="{_path(pts)}" fill="none" {stroke}'
                   f'{dash} marker-end="url(#qc-arrow)"/>{text}</g>')
    out.append('</g><g class="clusters">' + "".join(clusters) + '</g><g class="nodes">')
    for i, n in enumerate(pg.nodes):
        x, y, w, h = lay.boxes[n.id]
        fill = node_fill(n, colour)
        attrs = (f'id="node{i}" data-id="{escape(n.id)}" data-kind="{n.kind}"'
                 + (f' data-stage="{n.stage}"' if n.stage is not None else "")
                 + (f' data-sqnr="{n.sqnr:.2f}"' if n.sqnr is not None else "")
                 + (f' data-weight-dtype="{escape(n.weight_dtype)}"'
                    if n.weight_dtype is not None else "")
                 + (f' data-bits="{n.bits:g}"' if n.bits is not None else "")
                 + (f' data-call="{n.details["call"].split()[0]}"' if "call" in n.details
                    else ""))
        cx = x + w / 2
        rx = 11 if n.kind in ("input", "output") else 4
        mid = ' text-anchor="middle"'
        parts = [f'<g class="node" {attrs}><title>{escape(n.title)}</title>',
                 f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(w)}" height="{_f(h)}" rx="{rx}" '
                 f'fill="{fill}" stroke="{LINE}" stroke-width="1"/>',
                 _text(cx, y + 15, escape(_clip(n.title, TITLE_MAX)),
                       extra=' class="t" font-weight="bold"' + mid)]
        row = y + 28
        if n.sub:
            parts.append(_text(cx, row, escape(_clip(n.sub, SUB_MAX)), fill=GREY,
                               extra=' class="s"' + mid))
            row += 12
        if n.sqnr is not None:
            parts.append(_text(cx, row, escape(sqnr_text(n)), extra=' class="q"' + mid))
        out.append("".join(parts) + "</g>")
    out.append("</g>" + legend_svg + "</svg>")
    return "\n".join(out) + "\n"
