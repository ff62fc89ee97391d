"""A layered (Sugiyama-style) graph layout in pure Python: no Graphviz needed.

The classic four steps, kept simple and deterministic (every tie is broken by the order
the nodes were given in, which is the graph's topological order):

1. **Layers**: longest path from the sources, in bands (all nodes of pipeline stage s are
   below every node of stage s-1, so stage clusters never overlap); sources that feed
   something further down (weight quantizers) move down next to their first consumer.
2. **Crossing reduction**: edges spanning several layers get dummy points (shared by the
   edges of one value, so a value used far below is one line until it splits), then
   barycenter sweeps down and up reorder each layer.
3. **Coordinates**: each layer is packed left to right, then nodes are pulled towards
   the mean of their neighbours (down and up passes), keeping order and spacing.
4. **Wrapping**: a long, narrow chain of layers (a 32-block transformer) is cut into
   columns, read left to right, so the picture keeps a screen's aspect ratio; the edges
   into the next column are the only ones going up (``Layout.kinds``: ``wrap``). Shorter
   or wider pictures stay one column, read top to bottom.

Only plain data goes in and out (ids, sizes, edges; boxes and polylines), so the SVG and
HTML writers, and the tests, need nothing else.

Example:
    >>> lay = layout(["a", "b", "c"], {"a": (40, 20), "b": (40, 20), "c": (40, 20)},
    ...              [("a", "b"), ("a", "c"), ("b", "c")])
    >>> [lay.boxes[n][1] < lay.boxes[m][1] for n, m in (("a", "b"), ("b", "c"))]
    [True, True]
    >>> overlaps(lay)
    []
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

NODE_GAP = 18.0  # horizontal space between boxes of one layer
LAYER_GAP = 42.0  # vertical space between layers: room for an edge label
BAND_GAP = 58.0  # extra space between pipeline stages: room for the cluster label
COLUMN_GAP = 110.0  # between wrapped columns (a cluster label may stick out a little)
MARGIN = 24.0
CLUSTER_PAD = 10.0  # a stage cluster's rectangle around its boxes
CLUSTER_TOP = 44.0  # above its first layer: padding and a two-line label
DUMMY_WIDTH = 6.0  # a long edge's waypoint takes this much room in its layer
SWEEPS = 4
WRAP_MIN_LAYERS = 14  # shorter pictures are never wrapped
WRAP_ASPECT = 0.15  # nor those wider than that for their height (read top to bottom)
ASPECT = 1.6  # width / height a wrapped picture aims at


@dataclass
class Layout:
    """Boxes (``x, y, w, h``, top-left corner), one polyline per edge (in the edge order
    given), stage clusters (one rectangle per column they span) and the canvas size.
    Every edge runs down the page except those ``kinds`` marks: ``back`` (against the
    given order: a cycle) and ``wrap`` (into the next column of a wrapped picture)."""

    boxes: dict[str, tuple[float, float, float, float]]
    routes: list[list[tuple[float, float]]]
    clusters: dict[int, list[tuple[float, float, float, float]]] = field(default_factory=dict)
    width: float = 0.0
    height: float = 0.0
    columns: int = 1
    kinds: list[str] = field(default_factory=list)  # per edge: "", "back" or "wrap"


def _layers(ids: list[str], edges: list[tuple[str, str]], band: dict[str, float],
            fixed: set[str]) -> dict[str, int]:
    index = {n: i for i, n in enumerate(ids)}
    preds: dict[str, list[str]] = {n: [] for n in ids}
    succs: dict[str, list[str]] = {n: [] for n in ids}
    for s, d in edges:
        if s == d:
            continue
        preds[d].append(s)
        succs[s].append(d)
    layer: dict[str, int] = {}
    band_max: dict[float, int] = {}
    for n in ids:  # ids are in topological order: predecessors come first
        floor = max((m + 1 for b, m in band_max.items() if b < band[n]), default=0)
        layer[n] = max([floor] + [layer[p] + 1 for p in preds[n] if index[p] < index[n]])
        band_max[band[n]] = max(band_max.get(band[n], 0), layer[n])
    for n in reversed(ids):  # sources sit just above their first consumer
        if preds[n] or not succs[n] or n in fixed:
            continue
        floor = max((m + 1 for b, m in band_max.items() if b < band[n]), default=0)
        below = min(layer[s] for s in succs[n])
        # never into a later band: stage clusters must not overlap
        layer[n] = max(layer[n], min(max(floor, below - 1), band_max[band[n]]))
    return layer


def _order(rows: list[list[str]], up: dict[str, list[str]], down: dict[str, list[str]]
           ) -> list[list[str]]:
    pos = {n: i for row in rows for i, n in enumerate(row)}
    for sweep in range(SWEEPS):
        rng = range(1, len(rows)) if sweep % 2 == 0 else range(len(rows) - 2, -1, -1)
        nbrs = up if sweep % 2 == 0 else down
        for r in rng:
            keys = {n: (sum(pos[m] for m in nbrs[n]) / len(nbrs[n]) if nbrs.get(n) else pos[n])
                    for n in rows[r]}
            rows[r] = sorted(rows[r], key=lambda n: (keys[n], pos[n]))
            for i, n in enumerate(rows[r]):
                pos[n] = i
    return rows


def _place_row(row: list[str], want: dict[str, float], w: dict[str, float]) -> dict[str, float]:
    """Centres as close to ``want`` as order and spacing allow (left and right greedy
    passes, averaged, then made non-overlapping)."""
    def left_pass() -> list[float]:
        xs, edge = [], -math.inf
        for n in row:
            x = max(want[n], edge + w[n] / 2)
            xs.append(x)
            edge = x + w[n] / 2 + NODE_GAP
        return xs

    def right_pass() -> list[float]:
        xs, edge = [], math.inf
        for n in reversed(row):
            x = min(want[n], edge - w[n] / 2)
            xs.append(x)
            edge = x - w[n] / 2 - NODE_GAP
        return xs[::-1]

    mid = [(a + b) / 2 for a, b in zip(left_pass(), right_pass())]
    out, edge = {}, -math.inf
    for n, x in zip(row, mid):
        out[n] = max(x, edge + w[n] / 2)
        edge = out[n] + w[n] / 2 + NODE_GAP
    return out


def layout(ids: list[str], sizes: dict[str, tuple[float, float]], edges: list[tuple[str, str]],
           stages: dict[str, int | None] | None = None, fixed: set[str] | None = None
           ) -> Layout:
    """Lay out ``ids`` (in topological order) with their ``(width, height)``; ``stages``
    puts nodes in pipeline-stage bands, ``fixed`` nodes (inputs) stay at the top."""
    stages = stages or {}
    seen_stage = False
    band: dict[str, float] = {}
    for n in ids:  # nodes of no stage before the first staged node (inputs) come first
        s = stages.get(n)
        seen_stage = seen_stage or s is not None
        band[n] = float(s) if s is not None else (math.inf if seen_stage else -1.0)
        if fixed and n in fixed:
            band[n] = -2.0  # inputs alone on the top layer, not inside a group or cluster
    index = {n: i for i, n in enumerate(ids)}
    # an edge against the given order would make a cycle: lay it out reversed
    flow = [(s, d) if index[s] < index[d] else (d, s) for s, d in edges]
    layer = _layers(ids, flow, band, fixed or set())
    # dummy waypoints for edges spanning several layers
    w = {n: float(sizes[n][0]) for n in ids}
    h = {n: float(sizes[n][1]) for n in ids}
    nlayers = max(layer.values(), default=-1) + 1
    rows: list[list[str]] = [[] for _ in range(nlayers)]
    for n in ids:
        rows[layer[n]].append(n)
    up: dict[str, list[str]] = {}
    down: dict[str, list[str]] = {}
    chains: list[list[str]] = []
    linked: set[tuple[str, str]] = set()
    for s, d in flow:
        chain = [s]
        for lay in range(layer[s] + 1, layer[d]):
            dummy = f"\0{s}:{lay}"  # one value's edges share their way down (a bundle)
            if dummy not in w:
                w[dummy], h[dummy] = DUMMY_WIDTH, 0.0
                rows[lay].append(dummy)
            chain.append(dummy)
        chain.append(d)
        for a, b in itertools.pairwise(chain):
            if (a, b) not in linked:
                linked.add((a, b))
                down.setdefault(a, []).append(b)
                up.setdefault(b, []).append(a)
        chains.append(chain)
    rows = _order(rows, up, down)
    row_of = {n: r for r, row in enumerate(rows) for n in row}  # dummies included
    # coordinates: pack, then pull towards neighbours
    x: dict[str, float] = {}
    for row in rows:
        edge = 0.0
        for n in row:
            x[n] = edge + w[n] / 2
            edge += w[n] + NODE_GAP
    for sweep in range(SWEEPS):
        rng = range(1, nlayers) if sweep % 2 == 0 else range(nlayers - 2, -1, -1)
        nbrs = up if sweep % 2 == 0 else down
        for r in rng:
            want = {n: (sum(x[m] for m in nbrs[n]) / len(nbrs[n]) if nbrs.get(n) else x[n])
                    for n in rows[r]}
            x.update(_place_row(rows[r], want, w))
    left = min((x[n] - w[n] / 2 for n in x), default=0.0)
    x = {n: v - left for n, v in x.items()}
    row_width = [max((x[n] + w[n] / 2 for n in row), default=0.0) for row in rows]
    row_height = [max((h[n] for n in row), default=0.0) for row in rows]
    row_band = [min((band[n] for n in row if not n.startswith("\0")), default=0.0)
                for row in rows]
    # wrapping: cut the layers into columns of about ASPECT width / height
    cols = _columns(row_width, row_height, row_band)
    col_x, col_of, row_y = [], {}, {}
    x0 = MARGIN
    height = 0.0
    for c, members in enumerate(cols):
        y = MARGIN
        prev_band = None
        for r in members:
            if prev_band is not None and row_band[r] != prev_band:
                y += BAND_GAP
            prev_band = row_band[r]
            row_y[r] = y
            col_of[r] = c
            y += row_height[r] + LAYER_GAP
        height = max(height, y - LAYER_GAP + MARGIN)
        col_x.append(x0)
        x0 += max(row_width[r] for r in members) + COLUMN_GAP
    width = x0 - COLUMN_GAP + MARGIN
    pos: dict[str, tuple[float, float]] = {}
    for r, row in enumerate(rows):
        for n in row:  # centre x, top y
            pos[n] = (col_x[col_of[r]] + x[n], row_y[r] + (row_height[r] - h[n]) / 2)
    boxes = {n: (pos[n][0] - w[n] / 2, pos[n][1], w[n], h[n]) for n in ids}
    routes, kinds = [], []
    for (s, _), chain in zip(edges, chains):
        wraps = len({col_of[row_of[n]] for n in chain}) > 1
        kinds.append("back" if chain[0] != s else "wrap" if wraps else "")
        if len(chain) == 2 and chain[0] == chain[1]:
            routes.append([])  # a self-loop: not drawn
            continue
        ends = [(pos[n][0], pos[n][1]) for n in chain]
        ends[0] = (ends[0][0], ends[0][1] + h[chain[0]])  # leave from the bottom
        pts = [ends[0]]
        for k in range(1, len(chain)):
            ra, rb = row_of[chain[k - 1]], row_of[chain[k]]
            if col_of[ra] != col_of[rb]:
                # into another column, at right angles through empty space: below the
                # row, along it to the gap between the columns, up (or down) the gap,
                # along the space above the target's row, then into the target
                below = row_y[ra] + row_height[ra] + LAYER_GAP / 2
                above = row_y[rb] - LAYER_GAP / 2
                if rb == cols[col_of[rb]][0] and 0 <= row_band[rb] < math.inf:
                    above = row_y[rb] - CLUSTER_TOP - 8  # over the cluster's label
                gap = col_x[max(col_of[ra], col_of[rb])] - COLUMN_GAP / 2
                x0, x1 = pts[-1][0], ends[k][0]
                pts += [(x0, below), (gap, below), (gap, above), (x1, above)]
            pts.append(ends[k])
        routes.append(pts if chain[0] == s else pts[::-1])
    clusters = _clusters(ids, boxes, stages, layer, col_of)
    top = min([r[1] for rects in clusters.values() for r in rects]
              + [y for route in routes for _, y in route] + [MARGIN])
    if top < MARGIN:  # a cluster's label above a column's first layer: move all down
        dy = MARGIN - top
        boxes = {n: (bx, by + dy, bw, bh) for n, (bx, by, bw, bh) in boxes.items()}
        routes = [[(px, py + dy) for px, py in r] for r in routes]
        clusters = {st: [(cx, cy + dy, cw, ch) for cx, cy, cw, ch in rects]
                    for st, rects in clusters.items()}
        height += dy
    return Layout(boxes=boxes, routes=routes, clusters=clusters, width=round(width, 1),
                  height=round(height, 1), columns=len(cols), kinds=kinds)


def _columns(row_width: list[float], row_height: list[float], row_band: list[float]
             ) -> list[list[int]]:
    n = len(row_width)
    tall = sum(h + LAYER_GAP for h in row_height)
    if n <= WRAP_MIN_LAYERS or max(row_width, default=0.0) >= WRAP_ASPECT * tall:
        return [list(range(n))]  # short, or wide enough: one column, every edge goes down
    best, best_cols = math.inf, [list(range(n))]
    changes = [r for r in range(1, n) if row_band[r] != row_band[r - 1]]
    for c in range(1, max(2, n // 4) + 1):
        per = math.ceil(n / c)
        cuts = []
        for i in range(per, n, per):  # cut where a pipeline stage ends, when one is near
            near = [r for r in changes if abs(r - i) <= per // 3 and (not cuts or r > cuts[-1])]
            cuts.append(min(near, key=lambda r: (abs(r - i), r)) if near else i)
        bounds = [0, *sorted(set(cuts)), n]
        cols = [list(range(a, b)) for a, b in itertools.pairwise(bounds) if b > a]
        width = sum(max(row_width[r] for r in col) for col in cols) + COLUMN_GAP * (len(cols) - 1)
        height = max(sum(row_height[r] + LAYER_GAP for r in col) for col in cols)
        score = abs(math.log(max(width, 1.0) / max(height, 1.0) / ASPECT))
        if score < best - 1e-9:
            best, best_cols = score, cols
    return best_cols


def _clusters(ids: list[str], boxes: dict[str, tuple[float, float, float, float]],
              stages: dict[str, int | None], layer: dict[str, int], col_of: dict[int, int]
              ) -> dict[int, list[tuple[float, float, float, float]]]:
    pad, label = CLUSTER_PAD, CLUSTER_TOP - CLUSTER_PAD
    spans: dict[tuple[int, int], list[float]] = {}
    for n in ids:
        s = stages.get(n)
        if s is None:
            continue
        bx, by, bw, bh = boxes[n]
        key = (s, col_of[layer[n]])
        b = spans.setdefault(key, [bx, by, bx + bw, by + bh])
        b[0], b[1] = min(b[0], bx), min(b[1], by)
        b[2], b[3] = max(b[2], bx + bw), max(b[3], by + bh)
    out: dict[int, list[tuple[float, float, float, float]]] = {}
    for (s, _), (x0, y0, x1, y1) in sorted(spans.items()):
        out.setdefault(s, []).append((x0 - pad, y0 - pad - label, x1 - x0 + 2 * pad,
                                      y1 - y0 + 2 * pad + label))
    return out


def overlaps(lay: Layout) -> list[tuple[str, str]]:
    """Pairs of boxes that overlap (none in a good layout)."""
    items = sorted(lay.boxes.items(), key=lambda kv: kv[1][0])
    found = []
    for i, (a, (ax, ay, aw, ah)) in enumerate(items):
        for b, (bx, by, _, bh) in items[i + 1:]:
            if bx >= ax + aw:
                break
            if by < ay + ah and ay < by + bh:
                found.append((a, b))
    return found
