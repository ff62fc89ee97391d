"""``shard_tensor_parallel``: rewrite a planned graph to run on one ``tp`` rank's shards.

``plan_tensor_parallel`` chose the layers at compile time; ``qc.distributed.wrap`` runs
this rewrite (in place, on the graph ``qcompile`` returned) and then torch's
``parallelize_module``, which shards the parameters and hooks the layers:

- each sharded Linear read as ``linear(input_fq(x), weight_fq(L.weight), L.bias)``
  becomes a call of ``L``, a ``ShardedLinear`` holding the same parameters and quantizers
  (torch's ``ColwiseParallel`` / ``RowwiseParallel`` shard ``nn.Linear`` modules and hook
  their calls); each sharded embedding a call of a ``ShardedEmbedding``;
- shape arguments inside sharded regions that count heads or features (``view(2, 8, 4,
  16)``) count this rank's (``view(2, 8, 2, 16)`` at size 2);
- under sequence parallelism, each value of each rank's tokens that colwise layers read
  goes through one ``tp_gather_tokens_<i>`` identity, which ``wrap`` gives torch's
  ``PrepareModuleInput``; each helper (gradient sums, gathers, expert matmuls) is its
  own module per call site.

State names do not change: a ``state_dict`` of the rewritten graph has the keys of the
compiled one.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.passes.plan_tensor_parallel import TP_PLAN_KEY
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    >>> spec = {"quant": {"mode": "none"}, "tensor_parallel": {"size": 2}}
    >>> gm = qc.qcompile(m, spec, example_inputs=(torch.randn(2, 8),))
    >>> sorted(shard_tensor_parallel(gm, gm.meta[TP_PLAN_KEY]))
    ['0', '2']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.errors import QCompileError
from qcompile.passes.plan_tensor_parallel import (
    ExpertsPlan,
    LayerPlan,
    TensorParallelPlan,
    find_layers,
)
from qcompile.runtime.sharded import (
    AsShard,
    LocalExperts,
    ShardedEmbedding,
    ShardedFrozenLinear,
    ShardedLinear,
    SumPartial,
)


def _set(gm: GraphModule, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, leaf, module)


def _drop(gm: GraphModule, *nodes: object) -> None:
    for n in nodes:
        if isinstance(n, Node) and not n.users:
            gm.graph.erase_node(n)


def shard_tensor_parallel(gm: GraphModule, plan: TensorParallelPlan,
                          reduce_gradients: nn.Module | None = None, *,
                          within: str | None = None) -> dict[str, LayerPlan]:
    """Rewrite ``gm`` (in place; its child graphs too: the blocks FSDP2 shards) for one
    rank's shards. Returns the sharded layers by qualified name within ``gm``.

    ``reduce_gradients`` (``qcompile.runtime.sharded.SumGradients`` on the tp mesh) is
    put between each parameter read inside a sharded region and the ops there reading it:
    a per-head norm's weight gets the gradient of this rank's heads, summed across tp.
    ``within``: only that child graph (this rank's pipeline stage; the other stages' layers
    are other ranks')."""
    sharded = plan.sharded()
    graphs = [(name, g) for name, g in gm.named_modules() if isinstance(g, GraphModule)
              and (within is None or name == within)]
    done: dict[str, LayerPlan] = {}
    found: set[str] = set()
    for prefix, g in graphs:
        layers = {layer.name: layer for layer in find_layers(g).values()}
        for name, layer in layers.items():
            if name in sharded:
                _shard_layer(g, layer, sharded[name])
                found.add(name)
                done[f"{prefix}.{name}" if prefix else name] = sharded[name]
    missing = sorted(set(sharded) - found)
    if missing and within is None:
        raise QCompileError(f"tensor parallel: the plan's layer {missing[0]} is not in this "
                            "graph (changed after qcompile)",
                            fix="wrap the graph qc.qcompile returned, as it returned it")
    for prefix, g in graphs:
        _shape_args(g, plan)
        for name in _gather_tokens(g, plan.sequence.leave) if plan.sequence else ():
            done[f"{prefix}.{name}" if prefix else name] = LayerPlan(
                name, "tokens", "gather", "each rank's tokens gathered for the colwise "
                "layers reading them")
        for name in _gather_whole(g, plan.sequence) if plan.sequence else ():
            done[f"{prefix}.{name}" if prefix else name] = LayerPlan(
                name, "tokens", "gather_whole", "each rank's tokens gathered for a layer "
                "kept whole")
        for name in _scatter_tokens(g, plan.sequence) if plan.sequence else ():
            done[f"{prefix}.{name}" if prefix else name] = LayerPlan(
                name, "tokens", "scatter", "each rank's tokens cut from a value whole on "
                "every rank")
        if reduce_gradients is not None:
            _sum_gradients(g, plan, reduce_gradients)
            if plan.sequence is not None:
                _sum_computed(g, plan.sequence.summed, reduce_gradients)
            for e in _shard_experts(g, plan, reduce_gradients):
                for param in e.params:
                    done[f"{prefix}.{param}" if prefix else param] = LayerPlan(
                        param, "experts", "experts", f"{e.experts} experts sharded")
            _sliced_quantizers(g, plan, reduce_gradients.mesh)
        g.graph.lint()
        g.recompile()
    return done


_SUM = "tp_sum_gradients"
_GATHER = "tp_gather_tokens"


def _call_site(g: GraphModule, base: str, module: nn.Module) -> str:
    """``module`` added to ``g`` as ``<base>_<i>`` (the next free index), for one call
    site: torch's module trackers (``CommDebugMode``) hook a module once per call, and
    unwind wrongly when one module runs at several places of a forward."""
    i = 0
    while hasattr(g, f"{base}_{i}"):
        i += 1
    g.add_module(f"{base}_{i}", module)
    return f"{base}_{i}"


def _gather_tokens(g: GraphModule, leave: tuple[str, ...]) -> list[str]:
    """Under sequence parallelism, each value holding this rank's tokens that colwise
    layers read goes through a ``tp_gather_tokens_<i>`` call before them: an identity
    that ``wrap`` gives torch's ``PrepareModuleInput``, so the tokens are all-gathered
    once and handed on as a DTensor whose gradient the layers' partial sums accumulate
    into, reduce-scattered once (as torchtitan prepares an attention block's input for
    q, k and v). Returns the identities added to ``g``."""
    readers: dict[Node, list[Node]] = {}
    for n in g.graph.nodes:
        if n.op == "call_module" and str(n.target) in leave and n.args:
            readers.setdefault(n.args[0], []).append(n)
    return [_identity_before(g, _GATHER, x, users) for x, users in readers.items()]


def _identity_before(g: GraphModule, base: str, x: Node, users: list[Node]) -> str:
    """A new identity module (``<base>_<i>``, its style set by ``wrap``) called on ``x``
    right after it, read by ``users`` in ``x``'s place; returns its name."""
    name = _call_site(g, base, nn.Identity())
    with g.graph.inserting_after(x):
        call = g.graph.call_module(name, (x,))
    call.meta = dict(x.meta)
    for user in users:
        user.replace_input_with(x, call)
    return name


def _gather_whole(g: GraphModule, seq: Any) -> list[str]:
    """Each layer kept whole that reads each rank's tokens (a tied LM head) reads them
    through a ``tp_gather_tokens_<i>`` identity that ``wrap`` gives torch's
    ``PrepareModuleInput`` with local output: all-gathered, its input's gradient (the same
    on every rank) cut back to this rank's tokens. Returns the identities added."""
    return [_identity_before(g, _GATHER, n.args[0], [n])
            for n in [n for n in g.graph.nodes if n.name in seq.whole_readers]]


def _scatter_tokens(g: GraphModule, seq: Any) -> list[str]:
    """Each value whole on every rank that a sequence-parallel norm reads first goes, for
    the ops reading it there, through a ``tp_scatter_tokens_<i>`` identity that ``wrap``
    gives torch's ``PrepareModuleInput`` from ``Replicate`` to ``Shard`` of the tokens:
    each rank's tokens cut from it (its gradient all-gathered back). Returns the
    identities added to ``g``."""
    nodes = {n.name: n for n in g.graph.nodes}
    names = []
    for x in (nodes[name] for name in seq.scatter if name in nodes):
        users = [u for u in x.users if u.name in seq.nodes]
        if users:
            names.append(_identity_before(g, "tp_scatter_tokens", x, users))
    return names


def _sum_gradients(g: GraphModule, plan: TensorParallelPlan, module: nn.Module) -> None:
    readers = dict(plan.region_params)
    nodes = {n.name: n for n in g.graph.nodes}
    for n in list(g.graph.nodes):
        if n.op != "get_attr" or str(n.target) not in readers:
            continue
        inside = [nodes[r] for r in readers[str(n.target)] if r in nodes]
        if not inside:
            continue
        with g.graph.inserting_after(n):
            summed = g.graph.call_module(_call_site(g, _SUM, type(module)(module.mesh)), (n,))
        for user in inside:
            user.replace_input_with(n, summed)


def _sum_computed(g: GraphModule, summed: Any, module: nn.Module) -> None:
    """A value computed from parameters that ops on each rank's tokens read (Gemma's
    ``1 + weight``) reaches them through a ``tp_sum_gradients_<i>`` call: its gradient,
    each rank's tokens' part, summed across tp."""
    nodes = {n.name: n for n in g.graph.nodes}
    for name, readers in summed:
        x = nodes.get(name)
        inside = [nodes[r] for r in readers if r in nodes]
        if x is None or not inside:
            continue
        with g.graph.inserting_after(x):
            total = g.graph.call_module(_call_site(g, _SUM, type(module)(module.mesh)), (x,))
        for user in inside:
            user.replace_input_with(x, total)


def _shard_experts(g: GraphModule, plan: TensorParallelPlan, sum_gradients: nn.Module
                   ) -> list[ExpertsPlan]:
    """Each planned mixture of experts of ``g`` runs on this rank's experts: its weights
    (``Shard(0)`` DTensors once ``wrap`` distributes them) read as the local experts
    (``to_local``, after their quantizers, which see the DTensor), its two grouped matmuls
    as ``LocalExperts`` calls, the gate/up input's gradient summed across tp, the down
    output's parts summed (``SumPartial``). Returns the mixtures rewritten."""
    nodes = {n.name: n for n in g.graph.nodes}
    mesh = sum_gradients.mesh
    done = []
    for e in plan.experts:
        first, second = nodes.get(e.first), nodes.get(e.second)
        if first is None or second is None:
            continue  # another graph's (an FSDP2 block, a pipeline stage)
        if e.within:
            _shard_within(g, e, first, second, sum_gradients)
            done.append(e)
            continue
        experts = f"tp_local_experts_{_op_name(first)}"
        x, offs = first.args[0], first.args[2]
        with g.graph.inserting_before(first):
            summed = g.graph.call_module(_call_site(g, _SUM, type(sum_gradients)(mesh)),
                                         (x,))
            w1 = g.graph.call_method("to_local", (first.args[1],))
            rows = g.graph.call_module(_call_site(g, experts, LocalExperts(mesh, first.target)),
                                       (summed, w1, offs))
        with g.graph.inserting_before(second):
            w2 = g.graph.call_method("to_local", (second.args[1],))
            part = g.graph.call_module(_call_site(g, experts, LocalExperts(mesh, first.target)),
                                       (second.args[0], w2, offs, x))
            whole = g.graph.call_module(_call_site(g, _PARTIAL, SumPartial(mesh)), (part,))
        rows.meta, whole.meta = dict(first.meta), dict(second.meta)
        first.replace_all_uses_with(rows)
        second.replace_all_uses_with(whole)
        g.graph.erase_node(first)
        g.graph.erase_node(second)
        done.append(e)
    return done


_PARTIAL = "tp_sum_partial"


def _shard_within(g: GraphModule, e: ExpertsPlan, first: Node, second: Node,
                  sum_gradients: nn.Module) -> None:
    """A mixture sliced within each expert runs as a colwise / rowwise pair on every
    routed row: the graph's own grouped matmuls on this rank's slices of the weights, the
    gate/up input's gradient summed across tp, the down products (partial sums) summed
    (``SumPartial``).

    Each weight reaches its quantizer as the DTensor it is, through the graph's own views
    (torch's DTensor views: the gate/up rows of every expert as ``_StridedShard`` of
    ``[experts * out, in]``, down's columns as ``Shard(1)``), so every reader of the
    weight path (``freeze``, the exporters) sees it as compiled. A fused gate/up weight
    is first seen as ``[experts, split, out / split, in]`` (its ``_StridedShard`` is then
    a plain ``Shard``, which torch flattens). The gate/up rows come back to the local rows
    before the reshape back to ``[experts, out, in]`` (counted per rank,
    ``_shape_args``), which DTensor cannot do on strided rows; down's just before its
    matmul."""
    mesh = sum_gradients.mesh
    nodes = {n.name: n for n in g.graph.nodes}
    attr = next(n for n in g.graph.nodes
                if n.op == "get_attr" and str(n.target) == e.params[0])
    backs = [nodes[name] for name, *_ in e.reshapes if name in nodes]
    if not backs:  # read transposed alone: the local rows from the start
        with g.graph.inserting_after(attr):
            local = g.graph.call_method("to_local", (attr,))
        attr.replace_all_uses_with(local, delete_user_cb=lambda u: u is not local)
    elif e.split > 1:
        ex, out, inner = g.get_parameter(e.params[0]).shape
        with g.graph.inserting_after(attr):
            pieces = g.graph.call_function(torch.reshape, (attr, (
                ex, e.split, out // e.split, inner)))
        attr.replace_all_uses_with(pieces, delete_user_cb=lambda u: u is not pieces)
    for back in backs:
        with g.graph.inserting_before(back):
            local = g.graph.call_method("to_local", (back.args[0],))
        back.replace_input_with(back.args[0], local)
    w2 = second.args[1]
    with g.graph.inserting_before(second):
        local2 = g.graph.call_method("to_local", (w2,))
    second.replace_input_with(w2, local2)
    x = first.args[0]
    with g.graph.inserting_before(first):
        summed = g.graph.call_module(_call_site(g, _SUM, type(sum_gradients)(mesh)), (x,))
    first.replace_input_with(x, summed)
    with g.graph.inserting_after(second):
        whole = g.graph.call_module(_call_site(g, _PARTIAL, SumPartial(mesh)), (second,))
    second.replace_all_uses_with(whole, delete_user_cb=lambda u: u is not whole)
    whole.meta = dict(second.meta)


def _op_name(n: Node) -> str:
    packet = getattr(n.target, "overloadpacket", None)
    return str(getattr(packet or n.target, "__name__", "op")).strip("_")


def _sliced_quantizers(g: GraphModule, plan: TensorParallelPlan, mesh: Any) -> None:
    """Each planned sliced-activation quantizer reads its slice as a DTensor (``Shard`` of
    that dim on the tp mesh) and returns the local values: its range over the features is
    then reduced across tp (``qcompile.runtime.sharded.fake_quant_dtensor``)."""
    dims = dict(plan.sliced_quantizers)
    for n in list(g.graph.nodes):
        if n.op != "call_module" or str(n.target) not in dims:
            continue
        dim = dims[str(n.target)]
        with g.graph.inserting_before(n):
            wrapped = g.graph.call_module(_call_site(g, f"tp_as_shard{-dim}", AsShard(mesh, dim)),
                                          (n.args[0],))
        n.replace_input_with(n.args[0], wrapped)
        with g.graph.inserting_after(n):
            local = g.graph.call_method("to_local", (n,))
        n.replace_all_uses_with(local, delete_user_cb=lambda u, local=local: u is not local)
        local.meta = dict(n.meta)


def _shape_args(g: GraphModule, plan: TensorParallelPlan) -> None:
    by_name = {n.name: n for n in g.graph.nodes if n.op in ("call_function", "call_method")}
    for node_name, path, size in plan.shape_args:
        node = by_name.get(node_name)
        if node is None:
            continue
        args = list(node.args)
        if len(path) == 2:
            shape = list(args[path[0]])
            shape[path[1]] = size // plan.size
            args[path[0]] = type(node.args[path[0]])(shape)
        else:
            args[path[0]] = size // plan.size
        node.args = tuple(args)


def _shard_layer(gm: GraphModule, layer: Any, p: LayerPlan) -> None:
    node = layer.node
    name = layer.name
    if node.op == "call_module":
        return  # an nn.Linear / nn.Embedding call: torch's styles shard it as it is
    holder = gm.get_submodule(name)
    if p.kind == "embedding":
        aten = "aten" in str(node.target)
        ids = node.args[1] if aten else node.args[0]
        pad = node.args[2] if len(node.args) > 2 else node.kwargs.get(
            "padding_idx", -1 if aten else None)
        _set(gm, name, ShardedEmbedding.adopt(
            holder, None if pad is None or pad < 0 else int(pad)))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (ids,))
        rest: tuple = (node.args[0] if aten else node.args[1],)
    elif layer.frozen:  # linear(x, L.weight_frozen()): L dequantizes its shard itself
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr"
                                     and str(bias.target) == f"{name}.bias"):
            raise QCompileError(f"tensor parallel: {name}'s frozen base adds a bias that is "
                                "not its own", fix=f"plan: {{{name!r}: replicate}}")
        _set(gm, name, ShardedFrozenLinear.adopt(holder, dim=0 if p.style == "colwise"
                                                 else 1))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (x,))
        rest = (w, bias)
    else:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        own = {role: q == f"{name}.{role}_fake_quant" for role, q in layer.quantizers.items()}
        if not all(own.values()):
            raise QCompileError(
                f"tensor parallel: {name}'s quantizer is not its own ({layer.quantizers}); "
                "a sharded layer runs its own quantizers",
                fix=f"plan: {{{name!r}: replicate}}")
        fold = "input" in layer.quantizers and len(x.users) == 1
        x_in = x.args[0] if fold else x
        _set(gm, name, ShardedLinear.adopt(holder, quantize_weight="weight" in own,
                                           quantize_input=fold))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (x_in,))
        rest = (x if fold else None, w,
                w.args[0] if isinstance(w, Node) and w.op == "call_module" else None, bias)
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    _drop(gm, *rest)
    if any(_in_place(u) for u in call.users):
        # torch's styles hand back the output as a view made by an autograd Function
        # (to_local), which autograd forbids modifying in place (Falcon's add_): a copy
        with gm.graph.inserting_after(call):
            copy = gm.graph.call_function(torch.ops.aten.clone.default, (call,))
        call.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
        copy.meta = dict(call.meta)


def _in_place(n: Node) -> bool:
    name = getattr(getattr(n.target, "overloadpacket", None), "__name__", None) or (
        n.target if n.op == "call_method" else getattr(n.target, "__name__", ""))
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_")
