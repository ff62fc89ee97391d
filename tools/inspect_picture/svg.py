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
  coloured from red (low dB) to green (high dB).

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

from qcompile.tools.inspect_picture.graph import PEdge, PictureGraph, PNode
from qcompile.tools.inspect_picture.layout import Layout, layout

CHAR_W = 6.4  # average glyph width of 11px Helvetica / Arial
LABEL_CHAR_W = 6.9  # the same for a cluster's 12px bold label
TITLE_MAX = 36  # characters of a name shown (the whole name is in the tooltip / details)
SUB_MAX = 44
STAGE_COLOURS = ("#dbeafe", "#dcfce7", "#fef9c3", "#fce7f3", "#ede9fe", "#ffedd5")
KIND_FILL = MappingProxyType({"input": "#e5e7eb", "output": "#e5e7eb", "op": "#f9fafb",
                              "quantizer": "#fecaca", "module": "#e0e7ff"})  # read-only
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


def to_svg(pg: PictureGraph, lay: Layout | None = None, sqnr_colours: bool = True) -> str:
    """The SVG document (a string); ``lay`` defaults to ``compute_layout(pg)``."""
    lay = lay or compute_layout(pg)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="qc-graph" '
           f'viewBox="0 0 {_f(lay.width)} {_f(lay.height)}" width="{_f(lay.width)}" '
           f'height="{_f(lay.height)}" font-family="Helvetica, Arial, sans-serif" '
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
        fill = heat(n.sqnr) if sqnr_colours and n.sqnr is not None else KIND_FILL[n.kind]
        attrs = (f'id="node{i}" data-id="{escape(n.id)}" data-kind="{n.kind}"'
                 + (f' data-stage="{n.stage}"' if n.stage is not None else "")
                 + (f' data-sqnr="{n.sqnr:.2f}"' if n.sqnr is not None else ""))
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
    out.append("</g></svg>")
    return "\n".join(out) + "\n"
