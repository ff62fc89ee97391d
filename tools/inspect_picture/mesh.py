"""Draw the device mesh of ``qcompile-inspect show --world N`` as SVG.

It draws the JSON ``mesh`` object of ``show`` (``dims``, ``ranks[]`` with ``coords``,
``stage`` and ``holds``), so the picture says what the JSON says. One box per rank, in a
grid: one column group per ``pp`` index (headed by its pipeline stage), one row per ``dp``
replica (labelled on the left), the ``tp`` ranks of a group side by side inside a dashed
frame. Each box names the rank, its coordinates, its stage and the parameters it holds
(elements, and their share of the model's). A title line gives the dims and how a rank
number is made from its coordinates.

How the document marks it (tests and tools read these): ``<g class="title">``;
``<g class="pp-column" data-pp>`` (a column group's header); ``<g class="dp-row"
data-dp>`` (a row's label); ``<g class="tp-group" data-pp data-dp data-ranks>`` (a tp
group's frame); ``<g class="rank" data-rank data-pp data-dp data-tp data-stage
data-parameters>`` (a box; ``data-stage`` only with pipeline stages). Boxes are filled by
their stage with the graph picture's stage colours (``svg.STAGE_COLOURS``). As in
``svg``, there is no stylesheet: every shape carries its ``fill`` and ``stroke``, every
text its font, size and colour, and the output depends only on the mesh.

Example:
    >>> mesh = {"world": 2, "dims": {"tp": 2}, "data_parallel": "none", "parameters": 10,
    ...         "stages": [], "ranks": [
    ...             {"rank": t, "coords": {"pp": 0, "dp": 0, "tp": t}, "stage": None,
    ...              "stages": [], "holds": {"parameters": 6, "share": 0.6}}
    ...             for t in (0, 1)]}
    >>> doc = to_svg(mesh)
    >>> doc.count('<g class="rank"'), doc.count('<g class="tp-group"'), "tp 2 on 2 ranks" in doc
    (2, 1, True)
"""

from __future__ import annotations

from html import escape
from typing import Any

from qcompile.tools.inspect_picture.svg import (
    CHAR_W,
    FONT,
    GREY,
    GROUP,
    GROUP_TEXT,
    INK,
    LINE,
    STAGE_COLOURS,
)

DIMS = ("pp", "dp", "tp")
PLAIN_FILL = "#f9fafb"  # a rank's box without pipeline stages
LINE_H = 14.0  # px between the lines of a box
PAD = 8.0  # around the picture and inside a tp group's frame
GAP_X, GAP_Y = 24.0, 18.0  # between column groups, between rows
TP_GAP = 8.0  # between the boxes of one tp group
TITLE_H = 44.0  # the title and its second line
HEADER_H = 34.0  # a column group's header (two lines)
FRAME_LABEL_H = 14.0  # a tp group's label, inside its frame above its boxes


def _f(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _text(x: float, y: float, body: str, size: float = 11.0, fill: str = INK,
          extra: str = "") -> str:
    """A ``<text>`` with its font, size and colour as attributes (no stylesheet needed);
    ``body`` is escaped here."""
    return (f'<text x="{_f(x)}" y="{_f(y)}" font-family="{FONT}" font-size="{_f(size)}" '
            f'fill="{fill}"{extra}>{escape(body)}</text>')


def formula(dims: dict[str, int]) -> str:
    """How a rank number is made from its coordinates (tp innermost).

    >>> formula({"pp": 2, "dp": 2, "tp": 2})
    'rank = (pp x 2 + dp) x 2 + tp'
    >>> formula({"dp": 4})
    'rank = dp'
    """
    names = [d for d in DIMS if d in dims]
    if not names:
        return "rank = 0"
    expr = names[0]
    for name in names[1:]:
        expr = f"{f'({expr})' if '+' in expr else expr} x {dims[name]} + {name}"
    return f"rank = {expr}"


def title(mesh: dict[str, Any]) -> str:
    """The title line: ``mesh: pp 2 x dp 2 x tp 2 on 8 ranks``."""
    dims = mesh["dims"]
    if not dims:
        return "mesh: 1 rank (no pipeline, data- or tensor-parallel dims)"
    shape = " x ".join(f"{d} {dims[d]}" for d in DIMS if d in dims)
    return f"mesh: {shape} on {mesh['world']} rank{'s' if mesh['world'] != 1 else ''}"


def stage_text(rank: dict[str, Any]) -> str:
    """``stage 1``, ``stages 0, 2`` (interleaved), or ``all layers`` (no pipeline)."""
    stages = rank["stages"]
    if not stages:
        return "all layers"
    return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


def rank_lines(rank: dict[str, Any], dims: dict[str, int]) -> list[str]:
    """What a rank's box says: rank, coordinates, stage, parameters held."""
    c = rank["coords"]
    held = rank["holds"]
    return [f"rank {rank['rank']}",
            " · ".join(f"{d} {c[d]}" for d in DIMS if d in dims) or "no mesh dims",
            stage_text(rank),
            f"{held['parameters']:,} params ({held['share']:.1%})"]


def _stage_header(mesh: dict[str, Any], p: int) -> list[str]:
    """A column group's header: its pp index and stage(s); then one stage's first and last
    module, and the parameters of its stage(s) (several, interleaved, are not one span)."""
    ranks = [r for r in mesh["ranks"] if r["coords"]["pp"] == p]
    stages = ranks[0]["stages"] if ranks else []
    first = f"pp {p} · {stage_text(ranks[0])}" if ranks else f"pp {p}"
    records = {s["stage"]: s for s in mesh.get("stages", [])}
    shown = [records[s] for s in stages if s in records]
    if not shown:
        return [first, ""]
    params = f"{sum(s['parameters'] for s in shown):,} params"
    span = shown[0].get("range") or []
    if len(shown) > 1 or not span:
        return [first, params]
    return [first, f"{span[0]} .. {span[-1]} · {params}"]


def to_svg(mesh: dict[str, Any]) -> str:
    """The SVG document (a string) of a ``show --world`` mesh object."""
    dims = mesh["dims"]
    pp, dp, tp = (dims.get(d, 1) for d in DIMS)
    by_coords = {(r["coords"]["pp"], r["coords"]["dp"], r["coords"]["tp"]): r
                 for r in mesh["ranks"]}
    texts = {k: rank_lines(r, dims) for k, r in by_coords.items()}
    headers = {p: _stage_header(mesh, p) for p in range(pp)} if "pp" in dims else {}
    box_w = max([len(t) * CHAR_W + 16 for lines in texts.values() for t in lines] or [80.0])
    box_h = LINE_H * 4 + 8
    framed = "tp" in dims
    inner = PAD if framed else 0.0  # a tp group's frame around its boxes
    group_w = tp * box_w + (tp - 1) * TP_GAP + 2 * inner  # a tp group's frame
    column_w = group_w  # a column group is as wide as its frames, or its header
    for lines in headers.values():
        column_w = max(column_w, max(len(t) for t in lines) * CHAR_W + 8)
    group_h = box_h + 2 * inner + (FRAME_LABEL_H if framed else 0.0)
    label_w = len(f"dp replica {dp - 1}") * CHAR_W + 16 if "dp" in dims else 0.0
    top = PAD + TITLE_H + (HEADER_H if headers else 0.0)
    left = PAD + label_w
    width = left + pp * column_w + (pp - 1) * GAP_X + PAD
    width = max(width, PAD * 2 + max(len(title(mesh)) * 8.2, len(_subtitle(mesh)) * CHAR_W))
    height = top + dp * group_h + (dp - 1) * GAP_Y + PAD
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="qc-mesh" '
           f'viewBox="0 0 {_f(width)} {_f(height)}" width="{_f(width)}" '
           f'height="{_f(height)}" font-family="{FONT}" font-size="11">',
           f'<rect x="0" y="0" width="{_f(width)}" height="{_f(height)}" fill="#ffffff" '
           'stroke="none"/>',
           '<g class="title">' + _text(PAD, PAD + 16, title(mesh), size=14,
                                       extra=' font-weight="bold"')
           + _text(PAD, PAD + 34, _subtitle(mesh), fill=GREY) + "</g>"]
    for p, (first, second) in headers.items():
        x = left + p * (column_w + GAP_X)
        out.append(f'<g class="pp-column" data-pp="{p}">'
                   + _text(x, PAD + TITLE_H + 12, first, size=12, extra=' font-weight="bold"')
                   + (_text(x, PAD + TITLE_H + 26, second, fill=GREY) if second else "")
                   + "</g>")
    if "dp" in dims:
        for d in range(dp):
            y = top + d * (group_h + GAP_Y) + group_h / 2 + 4
            out.append(f'<g class="dp-row" data-dp="{d}">'
                       + _text(PAD, y, f"dp replica {d}", extra=' font-weight="bold"')
                       + "</g>")
    for p in range(pp):
        for d in range(dp):
            gx, gy = left + p * (column_w + GAP_X), top + d * (group_h + GAP_Y)
            members = [by_coords[(p, d, t)] for t in range(tp) if (p, d, t) in by_coords]
            if framed:
                numbers = [r["rank"] for r in members]
                label = f"tp group: ranks {numbers[0]}-{numbers[-1]}" if numbers else "tp group"
                out.append(f'<g class="tp-group" data-pp="{p}" data-dp="{d}" '
                           f'data-ranks="{" ".join(map(str, numbers))}">'
                           f'<rect x="{_f(gx)}" y="{_f(gy)}" width="{_f(group_w)}" '
                           f'height="{_f(group_h)}" rx="8" fill="none" stroke="{GROUP}" '
                           'stroke-width="1" stroke-dasharray="4 3"/>'
                           + _text(gx + inner, gy + 12, label, size=9, fill=GROUP_TEXT)
                           + "</g>")
            by = gy + inner + (FRAME_LABEL_H if framed else 0.0)
            for t in range(tp):
                rank = by_coords.get((p, d, t))
                if rank is not None:
                    out.append(_rank_box(rank, texts[(p, d, t)], gx + inner
                                         + t * (box_w + TP_GAP), by, box_w, box_h, dims))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _subtitle(mesh: dict[str, Any]) -> str:
    """The second title line: the rank formula and how data parallelism holds parameters."""
    dims = mesh["dims"]
    parts = [formula(dims)]
    kind = mesh.get("data_parallel", "none")
    if "dp" in dims and kind == "fsdp2":
        parts.append(f"fsdp2: each rank keeps 1/{dims['dp']} of the rows of what it holds")
    elif "dp" in dims and kind == "ddp":
        parts.append("ddp: each replica a whole copy")
    parts.append(f"model: {mesh['parameters']:,} params")
    return " · ".join(parts)


def _rank_box(rank: dict[str, Any], lines: list[str], x: float, y: float, w: float,
              h: float, dims: dict[str, int]) -> str:
    c = rank["coords"]
    stage = rank["stage"]
    fill = STAGE_COLOURS[rank["stages"][0] % len(STAGE_COLOURS)] if rank["stages"] \
        else PLAIN_FILL
    attrs = (f'data-rank="{rank["rank"]}" data-pp="{c["pp"]}" data-dp="{c["dp"]}" '
             f'data-tp="{c["tp"]}"' + (f' data-stage="{stage}"' if stage is not None else "")
             + f' data-parameters="{rank["holds"]["parameters"]}"')
    cx = x + w / 2
    mid = ' text-anchor="middle"'
    parts = [f'<g class="rank" {attrs}><title>{escape(", ".join(lines))}</title>',
             f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(w)}" height="{_f(h)}" rx="4" '
             f'fill="{fill}" stroke="{LINE}" stroke-width="1"/>',
             _text(cx, y + 15, lines[0], extra=' class="t" font-weight="bold"' + mid)]
    for i, line in enumerate(lines[1:], start=1):
        parts.append(_text(cx, y + 15 + i * LINE_H, line, fill=INK if i == 3 else GREY,
                           extra=mid))
    return "".join(parts) + "</g>"
