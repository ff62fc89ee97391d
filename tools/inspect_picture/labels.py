"""Where the texts next to edges and boxes go: never on a box or on another label.

Each label is a rectangle to put beside its anchor line (an edge's route, as the SVG
draws it: straight segments, or vertical-tangent cubic curves going down) or beside a
group's box. Candidate spots are tried in a fixed order (along the route from its source,
right of the line then left of it); the first spot touching no node box and no label
placed before wins, preferring spots that cross no other edge. A label with no free spot
is left out of the drawing (its text stays in the SVG as the edge's ``data-label``), so
labels never overlap, whatever the graph. ``outline`` draws a group as the border of the
rectangles around its boxes (row by row), not as one rectangle that would take in other
boxes. Everything is plain geometry, deterministic.

Example:
    >>> taken = [(0.0, 0.0, 40.0, 20.0)]  # a node box
    >>> route = [(20.0, 20.0), (20.0, 80.0)]  # straight down from its bottom
    >>> spot = place_on_route(route, 30.0, 10.0, taken)
    >>> spot, intersects(spot, taken[0])
    ((24.0, 45.0, 30.0, 10.0), False)
    >>> len(outline([(0, 0, 10, 10), (5, 10, 10, 10)]))  # an S-shaped border: 8 sides
    8
"""

from __future__ import annotations

import itertools

Box = tuple[float, float, float, float]  # x, y, width, height
Point = tuple[float, float]

GAP = 4.0  # between a label and its line
PAD = 1.0  # labels keep this far from boxes and each other
FRACTIONS = (0.5, 0.35, 0.65, 0.2, 0.8)  # where along a segment labels are tried


def curved(p0: Point, p1: Point) -> bool:
    """Whether the SVG draws the segment ``p0 -> p1`` as a curve (down and sideways)."""
    return not (p1[1] <= p0[1] or p0[0] == p1[0])


def point_at(p0: Point, p1: Point, t: float) -> Point:
    """The point at ``t`` (0..1) on the segment as drawn: straight, or the cubic curve
    with vertical tangents that ``svg`` draws when the segment goes down and sideways."""
    (x0, y0), (x1, y1) = p0, p1
    if not curved(p0, p1):
        return (x0 + (x1 - x0) * t, y0 + (y1 - y0) * t)
    dy = (y1 - y0) / 2
    u = 1 - t
    b0, b1, b2, b3 = u * u * u, 3 * u * u * t, 3 * u * t * t, t * t * t
    return (b0 * x0 + b1 * x0 + b2 * x1 + b3 * x1,
            b0 * y0 + b1 * (y0 + dy) + b2 * (y1 - dy) + b3 * y1)


def polyline(route: list[Point], steps: int = 8) -> list[Point]:
    """The route as drawn, curves flattened into ``steps`` straight pieces each."""
    if not route:
        return []
    out = [route[0]]
    for p0, p1 in itertools.pairwise(route):
        if curved(p0, p1):
            out += [point_at(p0, p1, k / steps) for k in range(1, steps + 1)]
        else:
            out.append(p1)
    return out


def intersects(a: Box, b: Box, pad: float = 0.0) -> bool:
    """Whether two boxes overlap (touching at ``pad`` or closer counts)."""
    return (a[0] < b[0] + b[2] + pad and b[0] < a[0] + a[2] + pad
            and a[1] < b[1] + b[3] + pad and b[1] < a[1] + a[3] + pad)


def crosses(box: Box, line: list[Point]) -> bool:
    """Whether a flattened line passes through a box."""
    x, y, w, h = box
    for (x0, y0), (x1, y1) in itertools.pairwise(line):
        if max(x0, x1) < x or min(x0, x1) > x + w or max(y0, y1) < y or min(y0, y1) > y + h:
            continue
        # clip the segment to the box's vertical span, then test its x range there
        if y0 == y1:
            if y <= y0 <= y + h:
                return True
            continue
        ta, tb = sorted(((y - y0) / (y1 - y0), (y + h - y0) / (y1 - y0)))
        ta, tb = max(ta, 0.0), min(tb, 1.0)
        if ta > tb:
            continue
        xa, xb = x0 + (x1 - x0) * ta, x0 + (x1 - x0) * tb
        if min(xa, xb) <= x + w and max(xa, xb) >= x:
            return True
    return False


def free(box: Box, taken: list[Box], bounds: tuple[float, float] | None = None) -> bool:
    """Whether ``box`` touches none of ``taken`` and lies inside ``bounds`` (width, height)."""
    if bounds is not None and (box[0] < 0 or box[1] < 0 or box[0] + box[2] > bounds[0]
                               or box[1] + box[3] > bounds[1]):
        return False
    return not any(intersects(box, t, PAD) for t in taken)


def _spots(route: list[Point], w: float, h: float) -> list[Box]:
    out = []
    for p0, p1 in itertools.pairwise(route):
        if p1[1] <= p0[1] and p0[0] != p1[0]:
            continue  # along a row (between wrapped columns): no room for a label there
        for t in FRACTIONS:
            x, y = point_at(p0, p1, t)
            out += [(round(x + GAP, 1), round(y - h / 2, 1), w, h),
                    (round(x - GAP - w, 1), round(y - h / 2, 1), w, h)]
    return out


def place_on_route(route: list[Point], w: float, h: float, taken: list[Box],
                   lines: list[list[Point]] | None = None,
                   bounds: tuple[float, float] | None = None,
                   clear_only: bool = False) -> Box | None:
    """The first free spot for a ``w`` x ``h`` label beside ``route`` (None: no room),
    preferring one that crosses none of ``lines`` (the other edges, flattened; with
    ``clear_only``, only such a spot)."""
    spots = [s for s in _spots(route, w, h) if free(s, taken, bounds)]
    clear = next((s for s in spots if not any(crosses(s, line) for line in lines or [])),
                 None)
    return clear or (spots[0] if spots and not clear_only else None)


def place_beside(box: Box, w: float, h: float, taken: list[Box],
                 bounds: tuple[float, float] | None = None) -> Box | None:
    """A free spot for a label at a corner of ``box`` (a group's): right of its top, left
    of its top, then the same at its bottom (None: no room)."""
    x, y, bw, bh = box
    for sx, sy in ((x + bw + 3, y), (x - 3 - w, y), (x + bw + 3, y + bh - h),
                   (x - 3 - w, y + bh - h), (x, y - h - 2)):
        spot = (round(sx, 1), round(sy, 1), w, h)
        if free(spot, taken, bounds):
            return spot
    return None


def outline(rects: list[Box]) -> list[tuple[Point, Point]]:
    """The border of the union of ``rects``: horizontal and vertical segments (merged
    where they continue each other), for a group drawn around the boxes it holds."""
    xs = sorted({v for x, _, w, _ in rects for v in (x, x + w)})
    ys = sorted({v for _, y, _, h in rects for v in (y, y + h)})

    def covered(i: int, j: int) -> bool:
        if not (0 <= i < len(xs) - 1 and 0 <= j < len(ys) - 1):
            return False
        cx, cy = (xs[i] + xs[i + 1]) / 2, (ys[j] + ys[j + 1]) / 2
        return any(x < cx < x + w and y < cy < y + h for x, y, w, h in rects)

    cells = {(i, j) for i in range(len(xs) - 1) for j in range(len(ys) - 1) if covered(i, j)}
    segments: list[tuple[Point, Point]] = []
    for j in range(len(ys)):  # horizontal borders, left to right, merged
        run = None
        for i in range(len(xs) - 1):
            edge = ((i, j - 1) in cells) != ((i, j) in cells)
            if edge and run is None:
                run = xs[i]
            if not edge and run is not None:
                segments.append(((run, ys[j]), (xs[i], ys[j])))
                run = None
        if run is not None:
            segments.append(((run, ys[j]), (xs[-1], ys[j])))
    for i in range(len(xs)):  # vertical borders, top to bottom, merged
        run = None
        for j in range(len(ys) - 1):
            edge = ((i - 1, j) in cells) != ((i, j) in cells)
            if edge and run is None:
                run = ys[j]
            if not edge and run is not None:
                segments.append(((xs[i], run), (xs[i], ys[j])))
                run = None
        if run is not None:
            segments.append(((xs[i], run), (xs[i], ys[-1])))
    return segments
