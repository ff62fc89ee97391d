"""Any model size on one screen: collapse a ``PictureGraph`` by module hierarchy.

At ``depth`` d every node owned by a module is drawn inside the box of the first d parts
of that module's path (``layers.3.mlp.up_proj`` at depth 2 is in ``layers.3``, ``norm`` in
``norm``); nodes the root owns (functional ops of the top-level forward) stay as they are,
and a box holding a single node is drawn as that node. A module box is split into calls:
a module called twice (a ResNet block's ``relu``) is drawn once per call, and no box takes
in a value that left it (the boxes form a DAG, drawn top to bottom). A box
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
    """How many boxes ``collapse(pg, depth, focus)`` draws (a module called twice: two)."""
    if depth is None and focus is None:
        return len(pg.nodes)
    order, preds = _topological(pg)
    return len(_calls(order, preds, _box_keys(pg, depth, focus))[1])


def auto_depth(pg: PictureGraph, budget: int = DEFAULT_BUDGET) -> int | None:
    """The most detailed depth whose picture has at most ``budget`` boxes (None: every
    node fits); depth 1 when even that is over the budget."""
    if count_boxes(pg, None) <= budget:
        return None
    for depth in range(max_depth(pg), 0, -1):
        if count_boxes(pg, depth) <= budget:
            return depth
    return 1


def _topological(pg: PictureGraph) -> tuple[list[PNode], dict[str, list[str]]]:
    """The nodes in a topological order (ties: the given order) and each node's inputs."""
    import heapq

    index = {n.id: i for i, n in enumerate(pg.nodes)}
    preds: dict[str, list[str]] = {n.id: [] for n in pg.nodes}
    succs: dict[str, list[str]] = {n.id: [] for n in pg.nodes}
    for e in pg.edges:
        if e.src != e.dst and e.src in index and e.dst in index:
            preds[e.dst].append(e.src)
            succs[e.src].append(e.dst)
    waiting = {n: len(p) for n, p in preds.items()}
    ready = [index[n] for n, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    order: list[PNode] = []
    while ready:
        n = pg.nodes[heapq.heappop(ready)]
        order.append(n)
        for d in succs[n.id]:
            waiting[d] -= 1
            if waiting[d] == 0:
                heapq.heappush(ready, index[d])
    if len(order) < len(pg.nodes):  # a cycle (not from fx): the rest in the given order
        done = {n.id for n in order}
        order += [n for n in pg.nodes if n.id not in done]
    return order, preds


def _box_keys(pg: PictureGraph, depth: int | None, focus: str | None
              ) -> dict[str, tuple[int | None, str] | None]:
    """Node id -> the (stage, module path) box it is drawn in, None: drawn itself."""
    keys: dict[str, tuple[int | None, str] | None] = {}
    for n in pg.nodes:
        b = box_path(n.module, depth, focus)
        keys[n.id] = None if b is None else (n.stage, b)
    return keys


def _calls(order: list[PNode], preds: dict[str, list[str]],
           keys: dict[str, tuple[int | None, str] | None]
           ) -> tuple[dict[str, int], list[tuple[int | None, str] | None]]:
    """Split each module box into calls: node id -> call index, and each call's box key.

    A node joins the latest call of its box unless that would close a cycle between
    boxes (a value leaving the box and coming back: the module's second call, or the
    relu after a residual add), so every call is drawn once, as its own box, and the
    boxes form a DAG (no back edges)."""
    call: dict[str, int] = {}
    box_of: list[tuple[int | None, str] | None] = []
    above: list[int] = []  # call -> bit set of the calls it is reached from (itself too)
    calls_of: dict[tuple[int | None, str], list[int]] = {}
    for n in order:
        key = keys[n.id]
        inputs = [call[p] for p in preds[n.id] if p in call]
        chosen = None
        for c in reversed(calls_of.get(key, []) if key is not None else []):
            # joining c adds the edges input -> c: a cycle when c already reaches an input
            if not any(i != c and above[i] >> c & 1 for i in inputs):
                chosen = c
                break
        reached = 0
        for i in inputs:
            reached |= above[i]
        if chosen is None:
            chosen = len(box_of)
            box_of.append(key)
            above.append(1 << chosen | reached)  # a new call: nothing is below it yet
            if key is not None:
                calls_of.setdefault(key, []).append(chosen)
        elif reached & ~above[chosen]:  # new ancestors reach every call below this one
            new, bit = reached & ~above[chosen], 1 << chosen
            for c in range(len(above)):
                if above[c] & bit:
                    above[c] |= new
        call[n.id] = chosen
    return call, box_of


def collapse(pg: PictureGraph, depth: int | None, focus: str | None = None,
             classes: dict[str, str] | None = None) -> PictureGraph:
    """A new ``PictureGraph`` with module boxes, in a topological order; ``pg`` is not
    changed. ``classes`` maps module paths to class names, shown on the boxes. A module
    called twice is two boxes (ids ``mod:<path>`` and ``mod:<path>#2``, details ``call``:
    ``"2 of 2"``); a module's own ops on both sides of its submodules' boxes are parts
    (details ``part``)."""
    if depth is not None and depth < 1:
        raise QCompileError(f"--depth {depth} is not a module depth",
                            fix="use --depth 1 or more (1: top-level modules), --depth full "
                            "or --depth auto")
    if focus is not None:
        check_focus(pg, focus)
    classes = classes or {}
    order, preds = _topological(pg)
    call, box_of = _calls(order, preds, _box_keys(pg, depth, focus))
    number: dict[int, int] = {}  # call -> 1, 2, ... among the calls of its box
    seen: dict[tuple[int | None, str], int] = {}
    for c, key in enumerate(box_of):
        if key is not None:
            seen[key] = number[c] = seen.get(key, 0) + 1
    # a box whose submodules are drawn apart holds the module's own ops (a block's residual
    # adds): its pieces are parts of one call, not calls
    parted = {box_of[call[n.id]] for n in order if box_of[call[n.id]] is not None}
    parted = {key for key in parted if any(
        n.module.startswith(key[1] + ".") and box_of[call[n.id]] != key
        for n in pg.nodes if n.stage == key[0])}
    rep: dict[str, str] = {}
    boxes: dict[str, PNode] = {}
    worst: dict[str, float] = {}
    dtypes: dict[str, dict[str, int]] = {}  # box -> weight dtype -> weighted ops holding it
    out: list[PNode] = []
    for n in order:
        key = box_of[call[n.id]]
        if key is None:
            rep[n.id] = n.id
            out.append(n)
            continue
        stage, b = key
        k = number[call[n.id]]
        bid = f"mod:{'' if stage is None else f's{stage}.'}{b}" + (f"#{k}" if k > 1 else "")
        rep[n.id] = bid
        box = boxes.get(bid)
        if box is None:
            box = boxes[bid] = PNode(id=bid, title=b, sub="", kind="module", module=b,
                                     stage=stage, members=0)
            if seen[key] > 1:
                box.details["part" if key in parted else "call"] = f"{k} of {seen[key]}"
            out.append(box)
        box.members += n.members
        box.quantizers += n.quantizers
        if n.sqnr is not None:
            worst[bid] = min(worst.get(bid, n.sqnr), n.sqnr)
        if n.weight_dtype is not None and n.kind != "quantizer":  # a layer counts once
            held = dtypes.setdefault(bid, {})
            held[n.weight_dtype] = held.get(n.weight_dtype, 0) + 1
        for key_ in ("rule", "scheme"):
            if key_ in n.details:
                values = box.details.setdefault(key_ + "s", "")
                if n.details[key_] not in values.split("; "):
                    box.details[key_ + "s"] = "; ".join(filter(None, [values, n.details[key_]]))
    for bid, box in boxes.items():
        cls = classes.get(box.module)
        again = "".join(f"{w} {box.details[w].split()[0]} · " for w in ("call", "part")
                        if w in box.details)
        box.sub = (f"{cls + ' · ' if cls else ''}{again}{box.members} nodes · "
                   f"{box.quantizers} quant")
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
    collapsed = PictureGraph(nodes=out, edges=_merge_edges(pg.edges, rep), stages=pg.stages,
                             transfer=pg.transfer,
                             groups=[g for g in pg.groups if all(rep[m] == m for m in g.members)])
    collapsed.nodes = _topological(collapsed)[0]  # calls are convex: the boxes form a DAG
    return collapsed


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

