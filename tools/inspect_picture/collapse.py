"""Any model size on one screen: collapse a ``PictureGraph`` by module hierarchy.

At ``depth`` d every node owned by a module is drawn inside the box of the first d parts
of that module's path (``layers.3.mlp.up_proj`` at depth 2 is in ``layers.3``, ``norm`` in
``norm``); nodes the root owns (functional ops of the top-level forward) stay as they are,
and a box holding a single node is drawn as that node. A box
counts its nodes and quantizers, keeps the worst SQNR of what it holds and the weight dtype
of its weighted ops (``"mixed"`` when they differ, the dtypes listed in its details). ``focus``
expands one module subtree completely, and around it shows the siblings of every
ancestor as boxes, so the focused part is seen in its context. ``auto_depth`` picks the
most detailed depth that keeps the picture under a box budget (default 60).

Example:
    >>> from qcompile.tools.inspect_picture.graph import PEdge, PNode, PictureGraph
    >>> nodes = [PNode(id=f"n{i}", title=f"n{i}", sub="", kind="op", module=f"layers.{i}.fc")
    ...          for i in range(3)]
    >>> pg = PictureGraph(nodes=nodes, edges=[PEdge("n0", "n1"), PEdge("n1", "n2")])
    >>> [n.title for n in collapse(pg, depth=2).nodes]  # boxes of one node: the node
    ['n0', 'n1', 'n2']
    >>> pg.nodes.append(PNode(id="q", title="q", sub="", kind="quantizer", module="layers.0.fc",
    ...                       quantizers=1))
    >>> [(n.title, n.sub) for n in collapse(pg, depth=2).nodes]
    [('layers.0', '2 nodes · 1 quant'), ('n1', ''), ('n2', '')]
    >>> [n.title for n in collapse(pg, depth=1).nodes]
    ['layers']
    >>> [n.title for n in collapse(pg, depth=1, focus="layers.0").nodes]
    ['n0', 'n1', 'n2', 'q']
"""

from __future__ import annotations

from qcompile.errors import QCompileError
from qcompile.tools.inspect_picture.graph import (
    MIXED_WEIGHT,
    PEdge,
    PictureGraph,
    PNode,
    dtype_bits,
)

DEFAULT_BUDGET = 60  # boxes a readable screen holds


def parse_depth(text: str | int | None) -> int | str | None:
    """``--depth``: ``"auto"`` (the default), ``"full"`` (None: nothing collapsed) or an
    integer >= 1; anything else is a ``QCompileError`` naming the flag."""
    if text is None or text == "auto":
        return "auto"
    if text == "full":
        return None
    try:
        depth = int(text)
    except (TypeError, ValueError):
        depth = 0
    if depth < 1:
        raise QCompileError(f"--depth {text!r} is not a module depth",
                            fix="use --depth N with N >= 1 (1: top-level modules as boxes), "
                            "--depth full (every node) or --depth auto (the default)")
    return depth


def _parts(path: str) -> list[str]:
    return path.split(".") if path else []


def box_path(path: str, depth: int | None, focus: str | None) -> str | None:
    """The module box a node owned by ``path`` is drawn in, or None to draw it itself."""
    parts = _parts(path)
    if focus is not None:
        f = _parts(focus)
        if parts[:len(f)] == f or f[:len(parts)] == parts:
            return None  # inside the focused subtree, or an ancestor's own glue: shown
        common = next((i for i, (a, b) in enumerate(zip(parts, f)) if a != b),
                      min(len(parts), len(f)))
        if common:  # a sibling of an ancestor of the focus: one box per sibling
            depth = max(depth or 0, common + 1)
    if depth is None or not parts:
        return None
    return ".".join(parts[:depth])  # a shallower module is one box too (a norm, a head)


def module_paths(pg: PictureGraph) -> list[str]:
    """Every module path (and its ancestors) owning a node, in first-seen order."""
    seen: dict[str, None] = {}
    for n in pg.nodes:
        parts = _parts(n.module)
        for i in range(1, len(parts) + 1):
            seen.setdefault(".".join(parts[:i]), None)
    return list(seen)


def check_focus(pg: PictureGraph, focus: str) -> None:
    paths = module_paths(pg)
    if focus not in paths:
        tops = [p for p in paths if "." not in p][:8]
        near = [p for p in paths if p.rsplit(".", 1)[-1] == focus.rsplit(".", 1)[-1]][:3]
        hint = f"did you mean {', '.join(near)}? " if near else ""
        raise QCompileError(f"--focus {focus!r} names no module of the graph",
                            fix=f"{hint}name a module path (dotted, as in the model), e.g. "
                            f"{', '.join(tops) or '(the graph has no modules)'}")


def max_depth(pg: PictureGraph) -> int:
    return max((len(_parts(n.module)) for n in pg.nodes), default=0)


def count_boxes(pg: PictureGraph, depth: int | None, focus: str | None = None) -> int:
    keys = set()
    for n in pg.nodes:
        b = box_path(n.module, depth, focus)
        keys.add(n.id if b is None else (n.stage, b))
    return len(keys)


def auto_depth(pg: PictureGraph, budget: int = DEFAULT_BUDGET) -> int | None:
    """The most detailed depth whose picture has at most ``budget`` boxes (None: every
    node fits); depth 1 when even that is over the budget."""
    if count_boxes(pg, None) <= budget:
        return None
    for depth in range(max_depth(pg), 0, -1):
        if count_boxes(pg, depth) <= budget:
            return depth
    return 1


def collapse(pg: PictureGraph, depth: int | None, focus: str | None = None,
             classes: dict[str, str] | None = None) -> PictureGraph:
    """A new ``PictureGraph`` with module boxes; ``pg`` is not changed. ``classes`` maps
    module paths to class names, shown on the boxes."""
    if depth is not None and depth < 1:
        raise QCompileError(f"--depth {depth} is not a module depth",
                            fix="use --depth 1 or more (1: top-level modules), --depth full "
                            "or --depth auto")
    if focus is not None:
        check_focus(pg, focus)
    classes = classes or {}
    rep: dict[str, str] = {}
    boxes: dict[str, PNode] = {}
    worst: dict[str, float] = {}
    dtypes: dict[str, dict[str, int]] = {}  # box -> weight dtype -> weighted ops holding it
    out: list[PNode] = []
    for n in pg.nodes:
        b = box_path(n.module, depth, focus)
        if b is None:
            rep[n.id] = n.id
            out.append(n)
            continue
        bid = f"mod:{'' if n.stage is None else f's{n.stage}.'}{b}"
        rep[n.id] = bid
        box = boxes.get(bid)
        if box is None:
            box = boxes[bid] = PNode(id=bid, title=b, sub="", kind="module", module=b,
                                     stage=n.stage, members=0)
            out.append(box)
        box.members += n.members
        box.quantizers += n.quantizers
        if n.sqnr is not None:
            worst[bid] = min(worst.get(bid, n.sqnr), n.sqnr)
        if n.weight_dtype is not None and n.kind != "quantizer":  # a layer counts once
            held = dtypes.setdefault(bid, {})
            held[n.weight_dtype] = held.get(n.weight_dtype, 0) + 1
        for key in ("rule", "scheme"):
            if key in n.details:
                values = box.details.setdefault(key + "s", "")
                if n.details[key] not in values.split("; "):
                    box.details[key + "s"] = "; ".join(filter(None, [values, n.details[key]]))
    for bid, box in boxes.items():
        cls = classes.get(box.module)
        box.sub = f"{cls + ' · ' if cls else ''}{box.members} nodes · {box.quantizers} quant"
        box.details = {"module": box.module, "class": cls or "-", "nodes": str(box.members),
                       "quantizers": str(box.quantizers), **box.details}
        if bid in worst:
            box.sqnr = worst[bid]
            box.details["sqnr"] = f"{worst[bid]:.2f} dB (worst inside)"
        if bid in dtypes:
            held = dtypes[bid]
            box.details["weight dtypes"] = ", ".join(f"{k} x{v}" for k, v in sorted(held.items()))
            if len(held) == 1:
                box.weight_dtype = next(iter(held))
                box.bits = dtype_bits(box.weight_dtype)
            else:
                box.weight_dtype = MIXED_WEIGHT
    singles = {bid for bid, box in boxes.items() if box.members == 1}
    if singles:  # a box of one node: draw the node itself
        only = {rep[n.id]: n for n in pg.nodes if rep[n.id] in singles}
        out = [only[n.id] if n.id in singles else n for n in out]
        rep = {k: only[v].id if v in singles else v for k, v in rep.items()}
    return PictureGraph(nodes=out, edges=_merge_edges(pg.edges, rep),
                        stages=pg.stages, transfer=pg.transfer,
                        groups=[g for g in pg.groups if all(rep[m] == m for m in g.members)])


def _merge_edges(edges: list[PEdge], rep: dict[str, str]) -> list[PEdge]:
    """Edges between boxes: one per (box, box); a cut edge sums the bytes of the distinct
    values crossing (one value used twice crosses once)."""
    merged: dict[tuple[str, str], PEdge] = {}
    counted: dict[tuple[str, str], set[str]] = {}
    for e in edges:
        key = (rep[e.src], rep[e.dst])
        if key[0] == key[1]:
            continue
        m = merged.get(key)
        if m is None:
            merged[key] = PEdge(src=key[0], dst=key[1], shape=e.shape, cut=e.cut,
                                fp32_bytes=e.fp32_bytes, bytes=e.bytes, transfer=e.transfer)
            counted[key] = {e.src}
            continue
        if e.shape != m.shape:
            m.shape = ""  # several shapes: the details say which
        if e.cut and e.src not in counted[key]:
            counted[key].add(e.src)
            m.cut = True
            m.fp32_bytes = (m.fp32_bytes or 0) + (e.fp32_bytes or 0)
            m.bytes = (m.bytes or 0) + (e.bytes or 0)
            m.transfer = m.transfer or e.transfer
    return list(merged.values())

