"""``partition``: give every node a pipeline stage (``node.meta["qcompile.stage"]``).

Stages are contiguous ranges of the graph's *anchor* nodes (the computation, in
topological order). Parameters, weight quantizers and other values computed from
parameters alone *float*: they belong to the stage of their first user and are replicated
into every stage that uses them.

- Explicit stages (``pipeline.stages`` as a list of ``{modules: [globs], device}``): a node
  goes to the stage whose globs match one of its owning modules; nodes no stage names
  (root-level ops) follow their inputs. Stages must come in forward order.
- Automatic stages (``pipeline.stages: k``): per-node cost from ``pipeline.balance`` —
  ``params`` (bytes of the parameters a node uses), ``flops`` (estimated from shapes,
  x3 for forward+backward, plus weight fake-quant) or ``time`` (each node timed on the
  example inputs, x3) — and the contiguous partition minimising the slowest stage,
  exactly, with the fewest bytes crossing the cuts among the optima
  (``qcompile.passes.partition.cuts``). A cut never separates an op from its activation quantizer
  (it goes after the quantizer) and never passes a non-tensor value between stages.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> gm = qc.qcompile(m, {"pipeline": {"stages": 2}}, example_inputs=(torch.randn(2, 8),))
    >>> [s.modules for s in qc.report(gm).stages]
    [['0', '1'], ['2', '3']]
"""

from __future__ import annotations

import fnmatch
import itertools
import statistics
import time
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.passes.shape_prop import TensorMetadata

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.matching import INTERNAL_MODULES, is_size_like, op_name, owners, weight_use
from qcompile.graph.meta import FUSION_KEY, STAGE_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass
from qcompile.graph.records import StageRecord
from qcompile.graph.running import fresh, untouched
from qcompile.passes.partition.cuts import balanced_cuts
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.specs import PipelineSpec


def floating_nodes(gm: GraphModule) -> set[Node]:
    """Nodes computed from parameters and constants only (no model input reaches them)."""
    floating: set[Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            floating.add(n)
        elif (n.op in ("call_function", "call_method", "call_module")
              and not (n.op == "call_module" and str(n.target) in INTERNAL_MODULES)
              and all(i in floating for i in n.all_input_nodes)):
            floating.add(n)
    return floating


def tensor_bytes(node: Node) -> int:
    tm = node.meta.get(TENSOR_META)
    if isinstance(tm, TensorMetadata):
        return int(torch.Size(tm.shape).numel()) * torch.empty((), dtype=tm.dtype).element_size()
    return 0


def _is_tensor_value(node: Node, has_shapes: bool) -> bool:
    tm = node.meta.get(TENSOR_META)
    if isinstance(tm, TensorMetadata):
        return True
    if node.op == "placeholder" and not has_shapes:
        return True
    return not has_shapes and not is_size_like(node)


def _attr(gm: GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class Layout:
    """The anchor sequence of a graph, floating nodes, and the live ranges of values."""

    def __init__(self, gm: GraphModule, has_shapes: bool) -> None:
        self.gm = gm
        self.has_shapes = has_shapes
        self.floating = floating_nodes(gm)
        self.anchors = [n for n in gm.graph.nodes
                        if n.op not in ("placeholder", "output") and n not in self.floating]
        self.index = {n: i for i, n in enumerate(self.anchors)}
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        n = len(self.anchors)
        # floating node -> positions of the anchors using it (through floating nodes only)
        self.used_at: dict[Node, set[int]] = {}
        for f in reversed(list(gm.graph.nodes)):
            if f in self.floating:
                at: set[int] = set()
                for u in f.users:  # fx keeps each node's consumers
                    if u in self.index:
                        at.add(self.index[u])
                    elif u in self.floating:
                        at |= self.used_at[u]
                    else:  # the output node
                        at.add(n - 1)
                self.used_at[f] = at
        self.first_use = {f: min(at, default=n - 1) for f, at in self.used_at.items()}
        self.values = [v for v in (*self.placeholders, *self.anchors)
                       if any(u not in self.floating for u in v.users)]
        self.defined = {v: self.index.get(v, -1) for v in self.values}
        self.last_use = {v: max(n if u.op == "output" else self.index[u]
                                for u in v.users if u not in self.floating)
                         for v in self.values}
        self.is_tensor = {v: _is_tensor_value(v, has_shapes) for v in self.values}

    def crossing(self, i: int) -> list[Node]:
        """Values alive across a cut after anchor ``i`` (``i = -1``: the stage-0 inputs)."""
        return [v for v in self.values if self.defined[v] <= i < self.last_use[v]]

    def cut_profile(self) -> tuple[list[float], list[bool]]:
        """Bytes crossing each cut position, and whether a non-tensor value crosses it."""
        n = len(self.anchors)
        size = [0.0] * (n + 1)
        blocked = [0] * (n + 1)
        for v in self.values:
            lo, hi = max(self.defined[v], 0), min(self.last_use[v], n)
            if lo >= hi:
                continue
            size[lo] += tensor_bytes(v)
            size[hi] -= tensor_bytes(v)
            if not self.is_tensor[v]:
                blocked[lo] += 1
                blocked[hi] -= 1
        out_bytes, out_blocked, acc, acc_b = [], [], 0.0, 0
        for i in range(n):
            acc += size[i]
            acc_b += blocked[i]
            out_bytes.append(acc)
            out_blocked.append(acc_b > 0)
        return out_bytes, out_blocked


# -- costs ------------------------------------------------------------------------------
def _numel(node: Node) -> int:
    tm = node.meta.get(TENSOR_META)
    return int(torch.Size(tm.shape).numel()) if isinstance(tm, TensorMetadata) else 0


def _fwd_flops(gm: GraphModule, node: Node) -> float:
    """Forward flops of one node, a multiply-add counting 2, bias and padding ignored.

    A convolution: ``2 * out.numel() * Cin/groups * prod(kernel)`` (every output element
    is one dot product over a ``Cin/groups x kernel`` window; stride, padding and dilation
    only change the output's shape). A transposed convolution scatters every *input*
    element into ``Cout/groups x kernel`` outputs: ``2 * in.numel() * Cout/groups *
    prod(kernel)``. Both are ``weight[0].numel()`` times the numel of the side the weight's
    first axis indexes (the output for a convolution, the input for a transposed one)."""
    out = _numel(node)
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, FakeQuantize):
            return 4.0 * out
        if isinstance(mod, (torch.nn.Linear,)):
            return 2.0 * out * mod.in_features
        if isinstance(mod, torch.nn.modules.conv._ConvTransposeNd):
            x = node.args[0] if node.args else None
            return 2.0 * (_numel(x) if isinstance(x, Node) else 0) * mod.weight[0].numel()
        if isinstance(mod, torch.nn.modules.conv._ConvNd):
            return 2.0 * out * mod.weight[0].numel()
        return float(out) * (2 if any(True for _ in mod.parameters()) else 1)
    use = weight_use(node)
    op = op_name(node)
    if use is not None and op in ("linear", "conv1d", "conv2d", "conv3d"):
        w = _attr(gm, str(use.param.target))
        return 2.0 * out * w[0].numel()
    if op in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d") and len(
            node.args) > 1 and isinstance(node.args[0], Node) and isinstance(
            node.args[1], Node) and node.args[1].op == "get_attr":
        w = _attr(gm, str(node.args[1].target))
        if isinstance(w, torch.Tensor):
            return 2.0 * _numel(node.args[0]) * w[0].numel()
    if op in ("matmul", "mm", "bmm", "addmm", "baddbmm", "linear"):
        a = node.args[1] if op in ("addmm", "baddbmm") else node.args[0]
        k = a.meta.get(TENSOR_META).shape[-1] if isinstance(a, Node) and isinstance(
            a.meta.get(TENSOR_META), TensorMetadata) else 1
        return 2.0 * out * int(k)
    if op == "scaled_dot_product_attention" and isinstance(node.args[1], Node):
        k_meta = node.args[1].meta.get(TENSOR_META)
        s = k_meta.shape[-2] if isinstance(k_meta, TensorMetadata) else 1
        return 4.0 * out * int(s)
    return float(out)


class _Timer(Interpreter):
    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.seconds: dict[Node, list[float]] = {}

    def run_node(self, n: Node) -> Any:
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.seconds.setdefault(n, []).append(time.perf_counter() - t0)
        return out


def _timed(gm: GraphModule, ctx: Context) -> dict[Node, float]:
    from qcompile.passes.trace import example_args

    args = example_args(gm, ctx)
    if args is None:
        raise QCompileError("pipeline.balance: time measures the nodes on the example inputs",
                            fix="pass example_inputs, or use balance: params")
    # Timing must not calibrate (untouched: observers off, every flag and buffer restored,
    # the caller's inputs cloned per run). Weight fake-quant is timed as a training step
    # pays it: the reuse cache would make repeats free.
    quantizers = [m for m in gm.modules() if isinstance(m, FakeQuantize)]
    saved = [q.reuse_weight for q in quantizers]
    timer = _Timer(gm)
    try:
        for q in quantizers:
            q.reuse_weight = False
        with untouched(gm):
            for _ in range(3):
                timer.run(*fresh(args), enable_io_processing=False)
    finally:
        for q, reuse in zip(quantizers, saved):
            q.reuse_weight = reuse
    return {n: statistics.median(ts) for n, ts in timer.seconds.items()}


def anchor_costs(gm: GraphModule, layout: Layout, balance: str, ctx: Context) -> list[float]:
    """Forward+backward cost of each anchor, including what floats into it."""
    if balance in ("flops", "time") and not ctx.has_shapes:
        raise QCompileError(f"pipeline.balance: {balance} needs the shapes of the example "
                            "inputs", fix="pass example_inputs (or trace.inputs), or use "
                            "balance: params")
    n = len(layout.anchors)
    cost = [0.0] * n
    seen_params: set[int] = set()
    timings = _timed(gm, ctx) if balance == "time" else {}

    def param_bytes(tensors: list[torch.Tensor]) -> float:
        total = 0.0
        for t in tensors:
            if id(t) not in seen_params:  # tied parameters count once, where first used
                seen_params.add(id(t))
                total += t.numel() * t.element_size()
        return total

    owner_of = {f: min(layout.first_use[f], n - 1) for f in layout.floating}
    for f in layout.floating:
        i = owner_of[f]
        if n == 0:
            break
        if balance == "params" and f.op == "get_attr":
            t = _attr(gm, str(f.target))
            if isinstance(t, torch.Tensor):
                cost[i] += param_bytes([t])
        elif balance == "flops" and f.op != "get_attr":
            cost[i] += 5.0 * _numel(f)  # weight fake-quant: forward + backward
        elif balance == "time" and f in timings:
            cost[i] += 3 * timings[f]
    for i, a in enumerate(layout.anchors):
        if balance == "params":
            if a.op == "call_module":
                cost[i] += param_bytes(list(gm.get_submodule(str(a.target)).parameters()))
        elif balance == "flops":
            cost[i] += 3.0 * _fwd_flops(gm, a)
        else:
            cost[i] += 3 * timings.get(a, 0.0)
    return cost


# -- stages -----------------------------------------------------------------------------
def _explicit(gm: GraphModule, layout: Layout, ctx: Context) -> list[int]:
    stages = ctx.spec.pipeline.stages
    assert isinstance(stages, list)
    stage_of: dict[Node, int] = {}
    hits = [0] * len(stages)
    for a in layout.anchors:
        chosen = None
        for o in owners(a, gm):
            for s, spec in enumerate(stages):
                if o.name and any(fnmatch.fnmatchcase(o.name, g) for g in spec.modules):
                    chosen = s
                    break
            if chosen is not None:
                break
        inputs = [stage_of[i] for i in a.all_input_nodes if i in stage_of]
        if chosen is None:
            chosen = max(inputs, default=0)
        else:
            hits[chosen] += 1
        for i in a.all_input_nodes:
            if i in stage_of and stage_of[i] > chosen:
                raise QCompileError(
                    f"pipeline.stages: node {a.name!r} is in stage {chosen} but uses "
                    f"{i.name!r} from stage {stage_of[i]}: stages must follow the forward order",
                    fix="list the modules in the order the forward pass runs them")
        stage_of[a] = chosen
    for s, count in enumerate(hits):
        if not count:
            raise QCompileError(f"pipeline.stages[{s}] (modules {stages[s].modules}) matched "
                                "no module of the graph", fix="correct the module globs")
    return [stage_of[a] for a in layout.anchors]


def _make_contiguous(gm: GraphModule, layout: Layout, stage_of: list[int]) -> Layout:
    """Reorder the graph so every stage is one contiguous run of anchors. Valid because
    no edge goes to an earlier stage: sorting by (stage, position) keeps topological
    order. Floating nodes move ahead of all anchors (they read parameters only)."""
    if all(a <= b for a, b in itertools.pairwise(stage_of)):
        return layout
    order = sorted(range(len(stage_of)), key=lambda i: (stage_of[i], i))
    graph = gm.graph
    cursor = layout.placeholders[-1] if layout.placeholders else None
    moved = [n for n in graph.nodes if n in layout.floating] + [layout.anchors[i] for i in order]
    for node in moved:
        if cursor is None:
            next(iter(graph.nodes)).prepend(node)
        else:
            cursor.append(node)
        cursor = node
    graph.lint()
    for i in order:
        layout.anchors[i].meta[STAGE_KEY] = stage_of[i]
    return Layout(gm, layout.has_shapes)


def _quantized_groups(gm: GraphModule, layout: Layout) -> list[bool]:
    """Cut positions between an op (or the head of its fusion group, conv-bn-relu) and
    its activation quantizer: cutting there would send unquantized values."""
    n = len(layout.anchors)
    diff = [0] * (n + 1)
    for q in layout.anchors:
        if q.op != "call_module" or not isinstance(gm.get_submodule(str(q.target)),
                                                   FakeQuantize):
            continue
        inputs = [i for i in q.all_input_nodes if i in layout.index]
        if len(inputs) != 1:
            continue
        head = inputs[0]
        group = head.meta.get(FUSION_KEY)
        while group is not None:
            prev = [i for i in head.all_input_nodes
                    if i in layout.index and i.meta.get(FUSION_KEY) is group]
            if not prev:
                break
            head = prev[0]
        diff[layout.index[head]] += 1
        diff[layout.index[q]] -= 1
    out, acc = [], 0
    for i in range(n):
        acc += diff[i]
        out.append(acc > 0)
    return out


def _from_cuts(n: int, cuts: list[int]) -> list[int]:
    stage, out, cut_set = 0, [], set(cuts)
    for i in range(n):
        out.append(stage)
        if i in cut_set:
            stage += 1
    return out


def stage_devices(p: PipelineSpec) -> list[str]:
    """The device string of each stage (``cpu`` where the spec names none)."""
    if isinstance(p.stages, list):
        return [s.device or (p.devices[i] if p.devices else "cpu")
                for i, s in enumerate(p.stages)]
    return list(p.devices) if p.devices else ["cpu"] * p.num_stages


@graph_pass(requires=("graph",), provides=("stages",))
def partition(gm: GraphModule, ctx: Context) -> GraphModule:
    """Assign ``node.meta["qcompile.stage"]`` to every node."""
    p = ctx.spec.pipeline
    k = p.num_stages
    layout = Layout(gm, ctx.has_shapes)
    n = len(layout.anchors)
    if n == 0:
        raise QCompileError("pipeline: the graph has no operations to place in stages",
                            fix="remove the pipeline section")
    explicit = isinstance(p.stages, list)
    balance = p.balance if not explicit else "params"
    if explicit:
        stage_of = _explicit(gm, layout, ctx)
        before = {a: s for a, s in zip(layout.anchors, stage_of)}
        layout = _make_contiguous(gm, layout, stage_of)
        stage_of = [before[a] for a in layout.anchors]
    cut_bytes, blocked = layout.cut_profile()
    costs = anchor_costs(gm, layout, balance, ctx)
    if explicit:
        for i in range(n - 1):
            if stage_of[i] != stage_of[i + 1] and blocked[i]:
                bad = [v.name for v in layout.crossing(i) if not layout.is_tensor[v]]
                raise QCompileError(
                    f"pipeline.stages: non-tensor value(s) {bad} would cross from stage "
                    f"{stage_of[i]} to {stage_of[i + 1]}",
                    fix="move the stage boundary so that only tensors cross it")
    else:
        inside = _quantized_groups(gm, layout)
        allowed = [i for i in range(n - 1) if not blocked[i] and not inside[i]]
        cuts, _ = balanced_cuts(costs, k, allowed=allowed, cut_bytes=cut_bytes)
        stage_of = _from_cuts(n, cuts)
    for a, s in zip(layout.anchors, stage_of):
        a.meta[STAGE_KEY] = s
    for v in layout.placeholders:
        v.meta[STAGE_KEY] = 0
    for f in layout.floating:
        f.meta[STAGE_KEY] = stage_of[min(layout.first_use[f], n - 1)]
    for node in gm.graph.nodes:
        if node.op == "output":
            node.meta[STAGE_KEY] = k - 1
    # -- report ----------------------------------------------------------------------
    devices = stage_devices(p)
    bounds = [i for i in range(n - 1) if stage_of[i] != stage_of[i + 1]]
    edges_in = [sum(tensor_bytes(v) for v in layout.crossing(-1))] + [cut_bytes[i] for i in bounds]
    out_vals = [v for v in layout.values if layout.last_use[v] == n]
    edges_out = [cut_bytes[i] for i in bounds] + [sum(tensor_bytes(v) for v in out_vals)]
    records = []
    for s in range(k):
        members = [a for a, st in zip(layout.anchors, stage_of) if st == s]
        params: dict[int, torch.Tensor] = {}
        for f in layout.floating:
            if f.op == "get_attr" and any(stage_of[i] == s for i in layout.used_at[f]):
                t = _attr(gm, str(f.target))
                if isinstance(t, torch.nn.Parameter):
                    params[id(t)] = t
        tops: dict[str, None] = {}
        for a in members:
            if a.op == "call_module":
                for t in gm.get_submodule(str(a.target)).parameters():
                    params[id(t)] = t
            if str(a.target) in INTERNAL_MODULES:
                continue
            for o in reversed(owners(a, gm)):
                if o.name:
                    tops.setdefault(o.name.split(".")[0])
                    break
        param_bytes = sum(t.numel() * t.element_size() for t in params.values())
        # GPipe keeps every micro-batch's activations; 1F1B at most (stages - s) of them
        in_flight = p.microbatches if p.schedule == "gpipe" else min(p.microbatches, k - s)
        activations = sum(tensor_bytes(a) for a in members)
        records.append(StageRecord(
            stage=s, device=devices[s], nodes=len(members),
            memory_bytes=int(4 * param_bytes + activations * in_flight),
            parameters=sum(t.numel() for t in params.values()),
            parameter_bytes=sum(t.numel() * t.element_size() for t in params.values()),
            cost=sum(c for c, st in zip(costs, stage_of) if st == s),
            bytes_in=int(edges_in[s]), bytes_out=int(edges_out[s]), modules=list(tops)))
    ctx.stages = records
    ctx.balance = balance
    return gm
