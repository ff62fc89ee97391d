"""``place``: split the graph into ``stage_0 .. stage_{k-1}`` children on their devices.

Each stage is a GraphModule whose inputs are *all* values alive across the cut before it
and whose outputs are all values alive across the cut after it, so a skip connection that
spans several stages is threaded through the ones in between and every stage only talks to
its neighbours — the contract ``torch.distributed.pipelining.PipelineStage`` needs. The
top-level graph calls the stages in order, moves tensors between devices where
consecutive stages differ, and rebuilds the model's output structure.

Parameters keep their qualified names inside each stage; ``state_dict()`` of the result
reports them under the original names (stage prefixes stripped) and ``load_state_dict``
accepts those names. A parameter used by several stages (tied weights) is the same
Parameter object in each stage when they share a process and a device.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> gm = qc.qcompile(m, {"pipeline": {"stages": 2}}, example_inputs=(torch.randn(3, 4),))
    >>> [name for name, _ in gm.named_children()]
    ['stage_0', 'stage_1']
    >>> sorted(gm.state_dict()) == sorted(m.state_dict())
    True
"""

from __future__ import annotations

import contextlib
import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import TensorMetadata

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.meta import STAGE_KEY, STAGE_NAMES_KEY, TENSOR_META, TIED_KEY, VAL
from qcompile.graph.pipeline import graph_pass
from qcompile.graph.state_layout import keep_persistence
from qcompile.passes.partition import Layout, stage_devices, tensor_bytes
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.transfer import pack, unpack
from qcompile.specs import FP8_MAX


def check_device(device: str, where: str) -> torch.device:
    """The torch.device for a spec string, or a QCompileError if this machine lacks it."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise QCompileError(f"{where}: {device!r} is not a device: {e}",
                            fix="use a device string like 'cpu' or 'cuda:0'") from None
    kind = dev.type
    if kind == "cpu" or kind == "meta":
        return dev
    backend = getattr(torch, kind, None)
    available = bool(backend is not None and hasattr(backend, "is_available")
                     and backend.is_available())
    if kind == "mps":
        available = torch.backends.mps.is_available()
    count = backend.device_count() if available and hasattr(backend, "device_count") else 0
    if not available or (dev.index is not None and dev.index >= count):
        have = f"{count} {kind} device(s)" if available else f"no {kind} devices"
        raise QCompileError(f"{where}: device {device!r} does not exist on this machine "
                            f"({have})", fix="use a device this machine has, e.g. 'cpu'")
    return dev


@dataclass(frozen=True)
class Packed:
    """A boundary value sent as integers: the quantizer that produced it."""

    quantizer: str
    axis: int | None
    quant_min: int
    quant_max: int
    dtype: torch.dtype


def tensor_bytes_per_element(v: Node) -> int:
    tm = v.meta.get(TENSOR_META)
    return torch.empty((), dtype=tm.dtype).element_size() if isinstance(tm, TensorMetadata) else 4


def _packable(gm: GraphModule, v: Node) -> Packed | None:
    if v.op != "call_module":
        return None
    fq = gm.get_submodule(str(v.target))
    if (not isinstance(fq, FakeQuantize) or fq.dynamic or fq.dtype in FP8_MAX
            or fq.granularity not in ("per_tensor", "per_channel")
            or fq.quant_max - fq.quant_min > 255):
        return None
    tm = v.meta.get(TENSOR_META)
    dtype = tm.dtype if isinstance(tm, TensorMetadata) else torch.float32
    return Packed(str(v.target), fq.axis, fq.quant_min, fq.quant_max, dtype)


def _stage_graph(members: list[Node], live_in: list[Node], live_out: list[Node],
                 packed: dict[Node, Packed], last: bool) -> tuple[Graph, int]:
    """The stage's graph; packed values cross as (integers, scale, zero_point). Returns
    the graph and the number of output slots."""
    g = Graph()
    env: dict[Node, Node] = {}
    received: dict[Node, tuple[Node, Node, Node]] = {}
    for v in live_in:
        if v in packed:
            received[v] = (g.placeholder(f"{v.name}_q"), g.placeholder(f"{v.name}_scale"),
                           g.placeholder(f"{v.name}_zero_point"))
            continue
        ph = g.placeholder(v.name)
        ph.meta = {k: v.meta[k] for k in (TENSOR_META, VAL) if k in v.meta}
        env[v] = ph

    def value(node: Node) -> Node:
        if node not in env:
            if node in received:  # dequantize where first used
                p = packed[node]
                env[node] = g.call_function(unpack, (*received[node], p.axis, p.dtype))
            else:  # parameters and what is computed from them alone
                for i in node.all_input_nodes:
                    value(i)
                env[node] = g.node_copy(node, lambda x: env[x])
        return env[node]

    for a in members:
        value(a)
    outs: list[Node] = []
    for v in live_out:
        if v in packed and not last:
            if v in received:  # still packed: pass it on
                outs += received[v]
            else:
                p = packed[v]
                scale = g.get_attr(f"{p.quantizer}.scale")
                zero_point = g.get_attr(f"{p.quantizer}.zero_point")
                flags = g.get_attr(f"{p.quantizer}.mode_flags")
                q = g.call_function(pack, (value(v), scale, zero_point, p.axis, p.quant_min,
                                           p.quant_max, flags))
                outs += [q, scale, zero_point]
        else:
            outs.append(value(v))
    # One value: return it bare, as torch.distributed.pipelining's loss_fn expects it.
    g.output(outs[0] if len(outs) == 1 else tuple(outs))
    return g, len(outs)


def _name_map(gm: GraphModule, stages: dict[str, GraphModule]) -> dict[str, list[str]]:
    """Original state_dict name -> the stage keys holding that very tensor. Matched by
    identity, so a tied weight read under one name keeps all the names it had."""
    holders: dict[int, list[str]] = {}
    for stage_name, stage in stages.items():
        for key, t in stage.state_dict(keep_vars=True).items():
            holders.setdefault(id(t), []).append(f"{stage_name}.{key}")
    return {orig: holders[id(t)] for orig, t in gm.state_dict(keep_vars=True).items()
            if id(t) in holders}


def _tied(gm: GraphModule, stages: dict[str, GraphModule]) -> list[tuple[str, list[str]]]:
    """Parameters held by more than one stage (by identity): (a name, stage keys)."""
    by_id: dict[int, list[str]] = {}
    for stage_name, stage in stages.items():
        seen: set[int] = set()
        for key, p in stage.named_parameters(remove_duplicate=False):
            if id(p) not in seen:  # one key per stage
                seen.add(id(p))
                by_id.setdefault(id(p), []).append(f"{stage_name}.{key}")
    name_of = {id(p): n for n, p in gm.named_parameters()}
    return sorted((name_of.get(i, keys[0].split(".", 1)[1]), keys)
                  for i, keys in by_id.items() if len(keys) > 1)


class OriginalNames:
    """A pipeline graph's state-dict hook: ``state_dict`` under the original qualified
    names (``kind="save"``, a post-hook) and ``load_state_dict`` accepting them
    (``kind="load"``, a pre-hook). An object, not a closure, so ``torch.save(gm)`` can
    pickle the graph with its hooks; it never holds the graph itself."""

    _from_public_api = True  # a state_dict post-hook that returns None, as registered

    def __init__(self, kind: str, names: dict[str, list[str]]) -> None:
        self.kind = kind
        self.names = names

    def __call__(self, *args: Any) -> None:
        if self.kind == "save":  # (module, state_dict, prefix, local_metadata)
            _, state, prefix, _ = args
            stage_values = {k: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
            mapped: set[str] = set()
            for orig, keys in self.names.items():  # the first holder's tensor for tied ones
                if prefix + keys[0] in stage_values:  # (qc.convert replaces some tensors)
                    state[prefix + orig] = stage_values[prefix + keys[0]]
                    mapped.update(prefix + key for key in keys)
            # tensors added after placement (converted weights) keep their stage names
            state.update({k: v for k, v in stage_values.items() if k not in mapped})
            return
        # load pre-hook: (module, state_dict, prefix, ...)
        state, prefix = args[1], args[2]
        for orig, keys in self.names.items():
            if prefix + orig in state:
                value = state.pop(prefix + orig)
                for key in keys:
                    state[prefix + key] = value


class Spread:
    """A module of the original model whose children the stages share out (a
    transformer's ``layers``: layer 0 in ``stage_0``, layer 1 in ``stage_1``): attribute
    lookup finds each child in the stage holding it. Not a module (nothing registers it):
    lookups by original name only, as ``torch.distributed.checkpoint`` resolves a
    state-dict key (``layers.1.fc.weight``) by ``getattr`` along it."""

    def __init__(self, holders: list[nn.Module]) -> None:
        self.holders = holders

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "holders":  # pickling, copying: not ours
            raise AttributeError(name)
        found = [getattr(h, name) for h in self.holders if hasattr(h, name)]
        if not found:
            raise AttributeError(name)
        if len(found) == 1 or not all(isinstance(f, nn.Module) for f in found):
            return found[0]
        return Spread(found)


class StageNames:
    """``_fqn_modifiers`` of a staged graph (the protocol
    ``torch.distributed.checkpoint.state_dict`` reads): the ``stage_<i>`` children (the
    values) are not part of a model state-dict key, whose names resolve by attribute
    (``register_original_names``). The keys are the key components DSD would step through
    a stage for: none (each holds a dot, which no single component does). A parameter name
    (``stage_0.model.norm.weight``, how DSD names the optimizer's state) already names its
    stage; stepping into it again would look for ``stage_0`` inside ``stage_0``."""

    def __init__(self, stages: list[str]) -> None:
        self.stages = stages

    def __call__(self) -> dict[str, str]:
        return {f"{s}.": s for s in self.stages}


def register_original_names(gm: GraphModule, names: dict[str, list[str]]) -> None:
    """state_dict under the original qualified names; load_state_dict accepts them; and
    the original top-level names resolve by attribute (``gm.layers`` finds the layers in
    their stages), so ``torch.distributed.checkpoint``'s ``get_model_state_dict`` maps
    every key to its tensor."""
    gm.register_state_dict_post_hook(OriginalNames("save", names))
    gm.register_load_state_dict_pre_hook(OriginalNames("load", names))
    stages = [n for n, c in gm.named_children() if isinstance(c, GraphModule)]
    tops: dict[str, list[nn.Module]] = {}
    for stage in stages:
        for name, child in gm.get_submodule(stage).named_children():
            tops.setdefault(name, []).append(child)
    for name, holders in tops.items():
        if name not in gm._modules and name not in gm.__dict__ and not hasattr(type(gm), name):
            # plain attributes, not submodules: named_modules, state_dict and FSDP2 see
            # only the stages
            gm.__dict__[name] = holders[0] if len(holders) == 1 else Spread(holders)
    gm.__dict__["_fqn_modifiers"] = StageNames(stages)


@graph_pass(requires=("stages",), provides=("placed",))
def place(gm: GraphModule, ctx: Context) -> GraphModule:
    """Split into stage children on their devices; thread values across stages."""
    k = ctx.spec.pipeline.num_stages
    devices = stage_devices(ctx.spec.pipeline)
    field = "pipeline.stages" if isinstance(ctx.spec.pipeline.stages, list) else "pipeline.devices"
    targets = [check_device(d, f"{field}[{i}]") for i, d in enumerate(devices)]
    layout = Layout(gm, ctx.has_shapes)
    n = len(layout.anchors)
    stage_of = [a.meta[STAGE_KEY] for a in layout.anchors]
    last_index = {s: max(i for i in range(n) if stage_of[i] == s) for s in range(k)}
    holder = nn.Module()
    stage_modules: dict[str, GraphModule] = {}
    boundaries: list[tuple[list[Node], list[Node], int]] = []
    packed: dict[Node, Packed] = {}
    if ctx.spec.pipeline.transfer == "int8":
        for s in range(k - 1):
            for v in layout.crossing(last_index[s]):
                p = _packable(gm, v)
                if p is not None:
                    packed[v] = p
        ctx.note(f"transfer int8: {len(packed)} value(s) cross cuts as integers (as floats "
                 "while their quantizers are off, e.g. during qc.calibrate)")
    for s in range(k):
        live_in = layout.crossing(last_index[s - 1] if s else -1)
        live_out = layout.crossing(last_index[s])
        members = [a for a, st in zip(layout.anchors, stage_of) if st == s]
        graph, slots = _stage_graph(members, live_in, live_out, packed, s == k - 1)
        stage = GraphModule(gm, graph, f"{type(gm).__name__}Stage{s}")
        keep_persistence(stage, gm)
        stage.train(gm.training)
        for name, m in stage.named_modules():  # keep per-module train/eval flags
            if name:
                with contextlib.suppress(AttributeError):
                    m.training = gm.get_submodule(name).training
        # a graph compiled from a meta-device model (a sharded compile_once) stays on meta:
        # its owner allocates it later (to_empty) where the spec says
        on_meta = any(t.is_meta for t in (*stage.parameters(), *stage.buffers()))
        stage_modules[f"stage_{s}"] = stage if on_meta else stage.to(targets[s])
        holder.add_module(f"stage_{s}", stage)
        boundaries.append((live_in, live_out, slots))
    # -- the top-level graph: call the stages in order ---------------------------------
    top = Graph()
    top._codegen = copy.deepcopy(gm.graph._codegen)  # same inputs/outputs (pytree specs)
    env: dict[Node, Node] = {}
    for ph in layout.placeholders:
        env[ph] = top.node_copy(ph)
    slots_of: dict[Node, list[Node]] = {}  # packed values: their three slots
    for s, (live_in, live_out, slots) in enumerate(boundaries):
        args = []
        moves = (s > 0 and targets[s] != targets[s - 1]) or (s == 0 and targets[0].type != "cpu")
        for v in live_in:
            values = slots_of[v] if v in packed and v in slots_of else [env[v]]
            if moves and layout.is_tensor[v]:
                values = [top.call_method("to", (x, targets[s])) for x in values]
            args += values
        call = top.call_module(f"stage_{s}", tuple(args))
        items = [call] if slots == 1 else [top.call_function(operator.getitem, (call, j))
                                           for j in range(slots)]
        j = 0
        for v in live_out:
            if v in packed and s < k - 1:
                slots_of[v] = items[j:j + 3]
                j += 3
            else:
                env[v] = items[j]
                j += 1
    output = next(node for node in gm.graph.nodes if node.op == "output")
    missing = [x.name for x in output.all_input_nodes if x not in env]
    if missing:
        raise QCompileError(f"pipeline: the model returns {missing}, computed from parameters "
                            "alone, which no stage produces", fix="return activations only")
    top.output(map_arg(output.args[0], lambda x: env[x]), type_expr=output.type)
    placed = GraphModule(holder, top, type(gm).__name__)
    placed.train(gm.training)
    placed.meta.update(gm.meta)
    names = _name_map(gm, stage_modules)
    tied = _tied(gm, stage_modules)
    if tied and not ctx.spec.pipeline.allow_tied:
        orig, keys = tied[0]
        held = " and ".join(key.split(".", 1)[0] for key in keys)
        raise QCompileError(f"pipeline.allow_tied is false, but parameter {orig!r} is used by "
                            f"{held}", fix="put the layers sharing it in one stage (explicit "
                            "stages), or set allow_tied: true (its gradients are then summed "
                            "across the stages holding it)")
    for orig, keys in tied:
        ctx.note(f"{orig} is shared by {', '.join(key.split('.', 1)[0] for key in keys)}")
    placed.meta[STAGE_NAMES_KEY] = names
    placed.meta[TIED_KEY] = [keys for _, keys in tied]
    register_original_names(placed, names)
    if packed:  # the report's byte counts: integers where values cross packed
        for s in range(k - 1):
            sent = 0
            for v in boundaries[s][1]:
                if v in packed:
                    fq = gm.get_submodule(packed[v].quantizer)
                    sent += tensor_bytes(v) // max(tensor_bytes_per_element(v), 1) + (
                        fq.scale.numel() * 4 + fq.zero_point.numel() * 4)
                else:
                    sent += tensor_bytes(v)
            if s < len(ctx.stages) - 1:
                ctx.stages[s].bytes_out = ctx.stages[s + 1].bytes_in = sent
    ctx.note(f"{k} stage(s) on {', '.join(devices)}")
    m = ctx.spec.pipeline.microbatches
    if m > 1:  # the schedules' setting: say what one process does with it
        ctx.note(f"pipeline.microbatches: {m} applies to qc.distributed.pipeline's schedules; "
                 "called in one process, this graph runs each stage on the whole batch (to "
                 f"bound activation memory, call it on torch.tensor_split(x, {m}) chunks)")
    return placed
