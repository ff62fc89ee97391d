"""The same picture as Graphviz DOT (``--graph dot``, or ``--layout dot`` for the SVG).

The DOT text says what the SVG shows: stage clusters (``cluster_stage<i>``) labelled with
device, cost, parameters and bytes, fusion groups as dashed clusters inside them, cut edges
in red with their bytes, shapes on the other edges, each node named once (with its SQNR
when measured); with
``colour="bits"`` nodes are filled by their weight bits and ``cluster_legend`` names each
weight dtype drawn.

Example:
    >>> from qcompile.tools.inspect_picture.graph import PEdge, PNode, PictureGraph
    >>> pg = PictureGraph(nodes=[PNode("x", "x", "", "input", ""),
    ...                          PNode("fc", "fc", "linear", "op", "fc")],
    ...                   edges=[PEdge("x", "fc", shape="2x4")])
    >>> print(to_dot(pg))  # doctest: +NORMALIZE_WHITESPACE
    digraph qcompile {
      node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];
      edge [fontname="Helvetica", fontsize=9, color="#6b7280"];
      graph [fontname="Helvetica", fontsize=11];
      "x" [label="x", fillcolor="#e5e7eb"];
      "fc" [label="fc\\nlinear", fillcolor="#f9fafb"];
      "x" -> "fc" [label="2x4"];
    }
"""

from __future__ import annotations

from qcompile.tools.inspect_picture.graph import PictureGraph, PNode
from qcompile.tools.inspect_picture.svg import (
    STAGE_COLOURS,
    bytes_text,
    legend,
    node_fill,
    resolve_colour,
    sqnr_text,
)


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _hex_heat(db: float) -> str:
    # DOT has no hsl(): the same red -> yellow -> green ramp as svg.heat, in hex
    t = min(1.0, max(0.0, (db - 10.0) / 30.0))
    r, g = (255, round(255 * t * 2)) if t < 0.5 else (round(255 * (2 - 2 * t)), 255)
    return f"#{min(255, r // 2 + 128):02x}{min(255, g // 2 + 128):02x}a0"


def _node(n: PNode, indent: str, colour: str) -> str:
    label = n.title + "".join(f"\\n{t}" for t in (n.sub, sqnr_text(n)) if t)
    fill = (_hex_heat(n.sqnr) if colour == "sqnr" and n.sqnr is not None
            else node_fill(n, colour))
    return f'{indent}{_q(n.id)} [label="{label.replace(chr(34), chr(39))}", fillcolor="{fill}"];'


def to_dot(pg: PictureGraph, colour: str = "auto") -> str:
    """The DOT text; ``colour`` as ``svg.to_svg``'s (``bits`` adds ``cluster_legend``)."""
    colour = resolve_colour(colour, pg)
    lines = ["digraph qcompile {", '  node [shape=box, style="rounded,filled", '
             'fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9, color="#6b7280"];',
             '  graph [fontname="Helvetica", fontsize=11];']
    stages = {s.index: s for s in pg.stages}
    groups = {g.id: g for g in pg.groups}
    by_stage: dict[int | None, list[PNode]] = {}
    for n in pg.nodes:
        by_stage.setdefault(n.stage, []).append(n)
    for stage, nodes in by_stage.items():
        indent = "  "
        if stage is not None:
            label = stages[stage].label if stage in stages else f"stage {stage}"
            colour = STAGE_COLOURS[stage % len(STAGE_COLOURS)]
            lines += [f"  subgraph cluster_stage{stage} {{", f"    label={_q(label)};",
                      f'    style="rounded,filled"; fillcolor="{colour}";']
            indent = "    "
        done: set[str] = set()
        for n in nodes:
            if n.id in done:
                continue
            if n.group in groups:
                g = groups[n.group]
                lines += [f"{indent}subgraph cluster_{g.id} {{",
                          f'{indent}  label={_q(g.label)}; style=dashed; color="#9333ea";']
                for m in nodes:
                    if m.group == g.id:
                        lines.append(_node(m, indent + "  ", colour))
                        done.add(m.id)
                lines.append(f"{indent}}}")
            else:
                lines.append(_node(n, indent, colour))
                done.add(n.id)
        if stage is not None:
            lines.append("  }")
    for e in pg.edges:
        if e.cut:
            lines.append(f"  {_q(e.src)} -> {_q(e.dst)} [label={_q(bytes_text(e))}, "
                         'color="#dc2626", penwidth=2];')
        else:
            lines.append(f"  {_q(e.src)} -> {_q(e.dst)}"
                         + (f" [label={_q(e.shape)}];" if e.shape else ";"))
    if colour == "bits":
        lines += ["  subgraph cluster_legend {", '    label="weight bits"; style=rounded;']
        lines += [f'    {_q("legend:" + label)} [label={_q(label)}, fillcolor="{fill}"];'
                  for label, fill in legend(pg)]
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines)
