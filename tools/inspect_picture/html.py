"""One self-contained, offline HTML page around the SVG picture.

Everything is inline (the SVG, a small stylesheet, a small hand-written script and the
node details as JSON): the page opens from a file with no network. It offers:

- pan (drag the background) and zoom (mouse wheel, the + / - / fit buttons);
- search: typing highlights the nodes whose name contains the text and centres the first
  (Enter goes to the next match);
- a click on a node opens a details panel: its rule, scheme, qparams (scale / zero-point
  ranges of its quantizers), shape, parameters, stage and, after ``sqnr``, its SQNR;
- with SQNR values the legend explains the red (low) to green (high) colouring; coloured
  by weight bits (``colour="bits"``), it names the colour of each weight dtype drawn;
- all nodes as a table, in a folded section below the picture.

Example:
    >>> from qcompile.tools.inspect_picture.graph import PNode, PictureGraph
    >>> pg = PictureGraph(nodes=[PNode("x", "x", "", "input", "", details={"shape": "2x4"})],
    ...                   edges=[])
    >>> page = to_html(pg, "<svg></svg>", title="demo")
    >>> page.startswith("<!DOCTYPE html>"), "http" in page.replace("http://www.w3.org", "")
    (True, False)
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from qcompile.tools.inspect_picture.graph import PictureGraph
from qcompile.tools.inspect_picture.svg import legend as bits_legend
from qcompile.tools.inspect_picture.svg import resolve_colour

CSS = """
*{box-sizing:border-box}html,body{margin:0;height:100%;font:13px Helvetica,Arial,sans-serif;
color:#111827}body{display:flex;flex-direction:column}
header{display:flex;gap:10px;align-items:center;padding:6px 10px;background:#1f2937;color:#f9fafb;
flex-wrap:wrap}header h1{font-size:15px;margin:0 8px 0 0}header .info{color:#d1d5db;font-size:12px}
header input{padding:3px 6px;width:220px}header button{padding:2px 8px}
.legend{display:flex;gap:6px;align-items:center;font-size:11px}
.chip{display:inline-block;width:12px;height:12px;border:1px solid #6b7280;vertical-align:middle}
main{flex:1;display:flex;min-height:0}#canvas{flex:1;overflow:hidden;background:#fff;cursor:grab}
#canvas.drag{cursor:grabbing}#canvas svg{width:100%;height:100%;display:block}
#details{width:340px;overflow:auto;border-left:1px solid #d1d5db;padding:10px;background:#f9fafb}
#details[hidden]{display:none}#details h2{font-size:14px;margin:0 0 6px;word-break:break-all}
#details table{border-collapse:collapse;width:100%}#details td{border-top:1px solid #e5e7eb;
padding:3px 4px;vertical-align:top;font-size:12px;word-break:break-word}#details td:first-child{
color:#6b7280;white-space:nowrap}.node{cursor:pointer}.node.hit rect{stroke:#f59e0b;stroke-width:3}
.node.sel rect{stroke:#2563eb;stroke-width:3}svg.searching .node:not(.hit){opacity:.3}
#nodes{max-height:40vh;overflow:auto;border-top:1px solid #d1d5db}#nodes summary{padding:4px 10px;
cursor:pointer}#nodes table{border-collapse:collapse;font-size:11px}#nodes td,#nodes th{
border:1px solid #e5e7eb;padding:1px 5px}
"""

# Hand-written, no library: pan/zoom by editing the viewBox, search, details on click.
SCRIPT = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("qc-data").textContent);
  var box = document.getElementById("canvas");
  var svg = box.querySelector("svg");
  var full = svg.viewBox.baseVal;
  var world = {x: full.x, y: full.y, w: full.width, h: full.height};
  var vb = {x: world.x, y: world.y, w: world.w, h: world.h};
  svg.removeAttribute("width");
  svg.removeAttribute("height");
  function apply() { svg.setAttribute("viewBox", vb.x + " " + vb.y + " " + vb.w + " " + vb.h); }
  function fit() {
    vb = {x: world.x - 10, y: world.y - 10, w: world.w + 20, h: world.h + 20};
    apply();
  }
  function toWorld(cx, cy) {
    var r = svg.getBoundingClientRect();
    var s = Math.max(vb.w / r.width, vb.h / r.height);
    var ox = vb.x + vb.w / 2 - (r.width * s) / 2, oy = vb.y + vb.h / 2 - (r.height * s) / 2;
    return {x: ox + (cx - r.left) * s, y: oy + (cy - r.top) * s, s: s};
  }
  function zoom(f, cx, cy) {
    var r = svg.getBoundingClientRect();
    if (cx === undefined) { cx = r.left + r.width / 2; cy = r.top + r.height / 2; }
    var p = toWorld(cx, cy);
    vb = {x: p.x - (p.x - vb.x) * f, y: p.y - (p.y - vb.y) * f, w: vb.w * f, h: vb.h * f};
    apply();
  }
  function centre(g) {
    var b = g.getBBox(), w = Math.max(b.width * 4, 500), h = Math.max(b.height * 8, 350);
    vb = {x: b.x + b.width / 2 - w / 2, y: b.y + b.height / 2 - h / 2, w: w, h: h};
    apply();
  }
  box.addEventListener("wheel", function (e) {
    e.preventDefault();
    zoom(e.deltaY > 0 ? 1.15 : 1 / 1.15, e.clientX, e.clientY);
  }, {passive: false});
  var drag = null;
  box.addEventListener("mousedown", function (e) {
    drag = {x: e.clientX, y: e.clientY, vx: vb.x, vy: vb.y, moved: false};
    box.classList.add("drag");
  });
  window.addEventListener("mousemove", function (e) {
    if (!drag) { return; }
    var s = toWorld(0, 0).s, dx = e.clientX - drag.x, dy = e.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 3) { drag.moved = true; }
    vb.x = drag.vx - dx * s; vb.y = drag.vy - dy * s; apply();
  });
  window.addEventListener("mouseup", function () {
    box.classList.remove("drag");
    setTimeout(function () { drag = null; }, 0);
  });
  var panel = document.getElementById("details");
  function show(g) {
    var d = data[g.getAttribute("data-id")];
    Array.prototype.forEach.call(svg.querySelectorAll(".node.sel"), function (n) {
      n.classList.remove("sel");
    });
    g.classList.add("sel");
    panel.hidden = false;
    panel.innerHTML = "";
    var h = document.createElement("h2");
    h.textContent = d.title;
    panel.appendChild(h);
    var t = document.createElement("table");
    [["kind", d.kind], ["is", d.sub]].concat(d.details).forEach(function (kv) {
      if (!kv[1]) { return; }
      var tr = document.createElement("tr"), a = document.createElement("td"),
          b = document.createElement("td");
      a.textContent = kv[0]; b.textContent = kv[1];
      tr.setAttribute("data-key", kv[0]);
      tr.appendChild(a); tr.appendChild(b); t.appendChild(tr);
    });
    panel.appendChild(t);
  }
  Array.prototype.forEach.call(svg.querySelectorAll(".node"), function (g) {
    g.addEventListener("click", function (e) {
      if (drag && drag.moved) { return; }
      e.stopPropagation();
      show(g);
    });
  });
  var search = document.getElementById("search"), count = document.getElementById("count");
  var hits = [], at = 0;
  function find() {
    var q = search.value.trim().toLowerCase();
    hits = [];
    Array.prototype.forEach.call(svg.querySelectorAll(".node"), function (g) {
      var d = data[g.getAttribute("data-id")];
      var on = q !== "" && (d.title + " " + d.sub + " " + g.getAttribute("data-id"))
        .toLowerCase().indexOf(q) >= 0;
      g.classList.toggle("hit", on);
      if (on) { hits.push(g); }
    });
    svg.classList.toggle("searching", q !== "");
    count.textContent = q ? hits.length + " match" + (hits.length === 1 ? "" : "es") : "";
    at = 0;
    if (hits.length) { centre(hits[0]); }
  }
  search.addEventListener("input", find);
  search.addEventListener("keydown", function (e) {
    if (e.key === "Enter" && hits.length) { at = (at + 1) % hits.length; centre(hits[at]); }
  });
  document.getElementById("fit").addEventListener("click", fit);
  document.getElementById("zin").addEventListener("click", function () { zoom(1 / 1.3); });
  document.getElementById("zout").addEventListener("click", function () { zoom(1.3); });
  fit();
})();
"""


def _json_for_script(obj: Any) -> str:
    # "</" would end the <script> element early: escape it (still valid JSON)
    return json.dumps(obj, ensure_ascii=False, sort_keys=True).replace("</", "<\\/")


def node_data(pg: PictureGraph) -> dict[str, Any]:
    """What the details panel shows, per node id (lists keep the details' order)."""
    return {n.id: {"title": n.title, "kind": n.kind, "sub": n.sub,
                   "details": [[k, v] for k, v in n.details.items()]} for n in pg.nodes}


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(
        f"<td>{escape('' if r.get(c) is None else str(r.get(c)))}</td>" for c in columns)
        + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def to_html(pg: PictureGraph, svg: str, title: str = "qcompile graph", info: str = "",
            rows: list[dict[str, Any]] | None = None, columns: list[str] | None = None,
            colour: str = "auto") -> str:
    """The page: ``svg`` (from ``svg.to_svg(pg, colour=colour)``) with search, pan/zoom,
    details; the legend follows ``colour``."""
    colour = resolve_colour(colour, pg)
    legend = ['<span class="legend">',
              '<span class="chip" style="background:#fecaca"></span>quantizer',
              '<span class="chip" style="background:#e0e7ff"></span>module (collapsed)',
              '<span class="chip" style="border:2px dashed #9333ea"></span>fusion group',
              '<span class="chip" style="background:#dc2626"></span>pipeline cut']
    if colour == "bits":
        legend += [f'<span class="chip" style="background:{fill}"></span>{escape(label)}'
                   for label, fill in bits_legend(pg)]
    elif colour == "sqnr":
        legend.append('<span class="chip" style="width:60px;background:linear-gradient(90deg,'
                      'hsl(0,75%,78%),hsl(60,75%,78%),hsl(120,75%,78%))"></span>'
                      "SQNR 10 dB → 40 dB")
    legend.append("</span>")
    table = ""
    if rows is not None and columns:
        table = (f'<details id="nodes"><summary>all {len(rows)} graph nodes (table)</summary>'
                 f"{_table(rows, columns)}</details>")
    return ("<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>{escape(title)}</h1>"
            '<input id="search" type="search" placeholder="search nodes" aria-label="search">'
            '<span id="count"></span><button id="zin" type="button">+</button>'
            '<button id="zout" type="button">-</button><button id="fit" type="button">fit'
            f'</button>{"".join(legend)}<span class="info">{escape(info)}</span></header>'
            f'<main><div id="canvas">{svg}</div><aside id="details" hidden></aside></main>'
            f"{table}"
            f'<script type="application/json" id="qc-data">{_json_for_script(node_data(pg))}'
            f"</script><script>{SCRIPT}</script></body></html>\n")
