"""Draw a ``PictureGraph`` as SVG with the pure-Python layout (``layout.py``).

What is drawn, and how the document marks it (the HTML page and the tests read these):

- ``<g class="cluster" data-stage="i">``: a pipeline stage, labelled with its device,
  cost, parameters and bytes in / out (one rectangle per wrapped column it spans);
- ``<g class="group" data-members="...">``: a fusion group (conv-bn-relu) or a weighted op
  with its weight and output quantizers, as a dashed box;
- ``<g class="edge" data-src data-dst>``: a value, labelled with its shape; a cut edge
  (``class="edge cut"``) is red and labelled with its bytes in fp32 and as transferred
  (``data-fp32-bytes``, ``data-bytes``, ``data-transfer``);
- ``<g class="node" data-id data-kind>``: a box, its name once, and a second line saying
  what it is; quantizers are red, module boxes blue, and with SQNR each measured node is
  coloured from red (low dB) to green (high dB);
- with ``colour="bits"`` each weighted op, its weight quantizer and each module box is
  filled by its weight's storage bits (``bits_fill``: int4 yellow, int8 blue, float white,
  a box of several dtypes grey), marked ``data-weight-dtype`` / ``data-bits``, and
  ``<g class="legend">`` under the graph names each dtype drawn (``legend``).

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

import itertools
from html import escape
from types import MappingProxyType

from qcompile.tools.inspect_picture.graph import (
    FLOAT_WEIGHT,
    MIXED_WEIGHT,
    PEdge,
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
STYLE = (".node rect{stroke:#6b7280;stroke-width:1}.node .t{font-weight:bold}"
         ".node .s{fill:#4b5563}.edge path{fill:none;stroke:#6b7280;stroke-width:1.2}"
         ".edge text{fill:#6b7280;font-size:9px;paint-order:stroke;stroke:#fff;stroke-width:3px}"
         ".edge.cut path{stroke:#dc2626;stroke-width:2.4}"
         ".edge.cut text{fill:#b91c1c;font-size:10px;font-weight:bold}"
         ".group rect{fill:none;stroke:#9333ea;stroke-dasharray:4 3}"
         ".group text{fill:#7e22ce;font-size:9px}.cluster text{font-size:12px;font-weight:bold}")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def box_size(n: PNode) -> tuple[float, float]:
    """Width and height of a node's box, from its (clipped) text."""
    chars = max(len(_clip(n.title, TITLE_MAX)) * 1.08, len(_clip(n.sub, SUB_MAX)))
    return round(max(48.0, chars * CHAR_W + 16), 1), (34.0 if n.sub else 22.0)


def heat(db: float) -> str:
    """SQNR (dB) -> fill colour: red below 10 dB, green above 40 dB."""
    t = min(1.0, max(0.0, (db - 10.0) / 30.0))
    return f"hsl({round(120 * t)},75%,78%)"


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


def _legend_svg(entries: list[tuple[str, str]], y: float) -> tuple[str, float]:
    """The legend row at height ``y`` and its width."""
    x = 8.0
    parts = [f'<g class="legend"><text x="8" y="{_f(y + 15)}" font-weight="bold">'
             "weight bits</text>"]
    x += len("weight bits") * CHAR_W + 14
    for label, fill in entries:
        parts.append(f'<g class="legend-item" data-label="{escape(label)}">'
                     f'<rect x="{_f(x)}" y="{_f(y + 5)}" width="12" height="12" '
                     f'fill="{fill}" stroke="#6b7280"/>'
                     f'<text x="{_f(x + 16)}" y="{_f(y + 15)}">{escape(label)}</text></g>')
        x += 16 + len(label) * CHAR_W + 14
    parts.append("</g>")
    return "".join(parts), x


def to_svg(pg: PictureGraph, lay: Layout | None = None, sqnr_colours: bool = True,
           colour: str = "auto") -> str:
    """The SVG document (a string); ``lay`` defaults to ``compute_layout(pg)``; ``colour``
    fills the nodes by ``kind``, ``sqnr``, ``bits`` (with a legend) or ``auto`` (SQNR
    when measured, unless ``sqnr_colours`` is off)."""
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
           f'height="{_f(height)}" font-family="Helvetica, Arial, sans-serif" '
           f'font-size="11">', f"<style>{STYLE}</style>",
           '<defs><marker id="qc-arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0 0L8 4L0 8z" fill="#6b7280"/></marker>'
           '</defs>', '<g class="clusters">']
    stages = {s.index: s for s in pg.stages}
    for s, rects in sorted(lay.clusters.items()):
        colour = STAGE_COLOURS[s % len(STAGE_COLOURS)]
        label = stages[s].label if s in stages else f"stage {s}"
        out.append(f'<g class="cluster" id="cluster-stage{s}" data-stage="{s}">'
                   f"<title>{escape(label)}</title>")
        # two lines, and never narrower than them: the label must stay inside
        lines = label.split(" · ", 3)
        lines = [" · ".join(lines[:3]), lines[3]] if len(lines) == 4 else [label]
        wide = max(len(t) for t in lines) * LABEL_CHAR_W + 16
        for x, y, w, h in rects:
            out.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(max(w, wide))}" '
                       f'height="{_f(h)}" rx="8" fill="{colour}" fill-opacity="0.55" '
                       f'stroke="#94a3b8"/><text x="{_f(x + 8)}" y="{_f(y + 15)}">'
                       + "".join(f'<tspan x="{_f(x + 8)}" dy="{0 if i == 0 else 14}">'
                                 f"{escape(t)}</tspan>" for i, t in enumerate(lines))
                       + "</text>")
        out.append("</g>")
    out.append('</g><g class="groups">')
    for g in pg.groups:
        boxes = [lay.boxes[m] for m in g.members if m in lay.boxes]
        if not boxes:
            continue
        x0 = min(b[0] for b in boxes) - 5
        y0 = min(b[1] for b in boxes) - 5
        x1 = max(b[0] + b[2] for b in boxes) + 5
        y1 = max(b[1] + b[3] for b in boxes) + 5
        out.append(f'<g class="group" id="{g.id}" data-members="{escape(" ".join(g.members))}">'
                   f'<rect x="{_f(x0)}" y="{_f(y0)}" width="{_f(x1 - x0)}" '
                   f'height="{_f(y1 - y0)}" rx="6"/>'
                   + (f'<text x="{_f(x1 + 3)}" y="{_f(y0 + 9)}">{escape(g.label)}</text>'
                      if g.label else "") + "</g>")
    out.append('</g><g class="edges">')
    for e, pts in zip(pg.edges, lay.routes):
        if not pts:
            continue
        attrs = f'data-src="{escape(e.src)}" data-dst="{escape(e.dst)}"'
        label = e.shape
        if e.cut:
            attrs += (f' data-fp32-bytes="{e.fp32_bytes}" data-bytes="{e.bytes}" '
                      f'data-transfer="{e.transfer}"')
            label = bytes_text(e) + (f" · {e.shape}" if e.shape else "")
        (x0, y0), (x1, y1) = pts[0], pts[1]
        text = (f'<text x="{_f((x0 + x1) / 2 + 4)}" y="{_f(y0 + min(16.0, (y1 - y0) / 2 + 4))}">'
                f"{escape(label)}</text>" if label else "")
        out.append(f'<g class="edge{" cut" if e.cut else ""}" {attrs}>'
                   f'<path d="{_path(pts)}" marker-end="url(#qc-arrow)"/>{text}</g>')
    out.append('</g><g class="nodes">')
    for i, n in enumerate(pg.nodes):
        x, y, w, h = lay.boxes[n.id]
        fill = node_fill(n, colour)
        attrs = (f'id="node{i}" data-id="{escape(n.id)}" data-kind="{n.kind}"'
                 + (f' data-stage="{n.stage}"' if n.stage is not None else "")
                 + (f' data-sqnr="{n.sqnr:.2f}"' if n.sqnr is not None else "")
                 + (f' data-weight-dtype="{escape(n.weight_dtype)}"'
                    if n.weight_dtype is not None else "")
                 + (f' data-bits="{n.bits:g}"' if n.bits is not None else ""))
        cx = x + w / 2
        rx = 11 if n.kind in ("input", "output") else 4
        parts = [f'<g class="node" {attrs}><title>{escape(n.title)}</title>',
                 f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(w)}" height="{_f(h)}" rx="{rx}" '
                 f'fill="{fill}"/>',
                 f'<text class="t" x="{_f(cx)}" y="{_f(y + 15)}" text-anchor="middle">'
                 f"{escape(_clip(n.title, TITLE_MAX))}</text>"]
        if n.sub:
            parts.append(f'<text class="s" x="{_f(cx)}" y="{_f(y + 28)}" text-anchor="middle">'
                         f"{escape(_clip(n.sub, SUB_MAX))}</text>")
        out.append("".join(parts) + "</g>")
    out.append("</g>" + legend_svg + "</svg>")
    return "\n".join(out) + "\n"
