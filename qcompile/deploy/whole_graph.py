"""What the exporters (``qc.export_gguf``, ``qc.save_pretrained``) share: the checks that
a compiled graph is one whole model whose weights they can read, and which op reads each
parameter, through which view ops and which quantizer.

A graph compiled with ``data_parallel: fsdp2`` (a child graph per block) is read as one
graph (``qcompile.graph.inline``: the same modules and tensors, the model's order). A
graph ``qc.distributed.wrap`` (or ``compile_once``) sharded, for tensor parallelism, FSDP2
or both, is read as the graph it was compiled as: a ``ShardedLinear`` call is a linear
read of ``<layer>.weight`` through ``<layer>.weight_fake_quant`` (when its
``quantize_weight`` is set) of an input quantized by ``<layer>.input_fake_quant``
(``quantize_input``), a ``ShardedEmbedding`` call an embedding read, a ``SumGradients``
call the value it passes on. Its weights are read whole: ``gathered`` takes each sharded
one whole (``DTensor.full_tensor()``, a collective over tp, dp or both) when the exporter
reaches it, so every rank exports together (``agree_to_gather`` first, then the same reads
in the same order) and rank 0 alone writes (``writes_here``).

A graph split into pipeline stages (``stage_<i>`` children) is read as one graph too. When
``qc.distributed.pipeline`` spread the stages over ranks, each rank trained its own and
holds untrained copies of the others: ``qcompile.deploy.stages.share_stages`` (after
``agree_to_gather``) hands each stage's trained state from the rank that trained it to
every rank, one tensor at a time, into those copies, and the lowest rank of the pipeline
writes.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.deploy.whole_graph import weight_reads, whole_graph
    >>> gm = qc.qcompile(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int8-qat",
    ...                  (torch.randn(2, 4),))
    >>> graph = whole_graph(gm, "export", holds="a file", preset="int8-qat", verb="export")
    >>> [r.fq for r in weight_reads(graph)[id(graph.get_parameter("0.weight"))]]
    ['0.weight_fake_quant']
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.deploy.adapters import refuse_adapters, unwrap
from qcompile.deploy.stages import share_stages, spread
from qcompile.errors import QCompileError
from qcompile.graph.algorithms import refuse_pending
from qcompile.graph.inline import inline_children
from qcompile.graph.meta import (
    BLOCKS_KEY,
    COLLECTIVES_KEY,
    PIPELINE_KEY,
    REPORT_KEY,
    STAGE_NAMES_KEY,
    TP_SHARDED_KEY,
)
from qcompile.runtime.calibration import ViewSteps, weight_quantizer_sites
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.sharded import ShardedEmbedding, ShardedLinear, SumGradients

__all__ = [
    "VIEWS",
    "WeightRead",
    "agree_and_share",
    "agree_to_gather",
    "call_name",
    "config_fingerprint",
    "describe_scheme",
    "gathered",
    "is_dtensor",
    "is_sharded",
    "sharded_linear",
    "view_paths",
    "weight_reads",
    "weight_sites",
    "whole_graph",
    "writes_here",
]

#: ops that only reshape or relabel a tensor (a weight read through them is still the weight)
VIEWS = frozenset({"reshape", "view", "_unsafe_view", "t", "transpose", "permute",
                   "contiguous", "alias", "to", "to_local"})


def whole_graph(gm: nn.Module, where: str, *, holds: str, preset: str,
                verb: str) -> GraphModule:
    """The compiled graph of ``gm`` (inside a DDP wrapper too), refused for ``where`` (the
    caller's name) where ``holds`` (what it writes: "a GGUF file") cannot hold what it
    computes: a model qcompile did not compile (the fix names ``preset``), one pipeline
    stage's graph on its own, adapters, pending algorithms, sharded weights other than
    those of a graph ``qc.distributed.wrap``, ``compile_once`` or ``qc.distributed.pipeline``
    sharded (its shards are gathered as they are read), meta-device weights; ``verb`` is
    what the fixes tell the user to do with the gathered model ("export"). Child graphs
    (FSDP2's blocks, pipeline stages) are read as one graph."""
    inner = unwrap(gm)
    meta = getattr(inner, "meta", None)
    if not isinstance(inner, GraphModule) or not isinstance(meta, dict) or REPORT_KEY not in meta:
        raise QCompileError(f"{where}: the model ({type(gm).__name__}) was not compiled by "
                            "qcompile", fix="pass the graph qc.qcompile returned for the "
                            f"Hugging Face model (e.g. with the {preset} preset)")
    blocks = meta.get(BLOCKS_KEY)
    if blocks:  # data_parallel fsdp2's blocks (a child graph each): read as one graph
        inner = inline_children(inner, blocks, order=list(inner.state_dict(keep_vars=True)))
    stages = [n for n, c in inner.named_children()
              if n.startswith("stage_") and isinstance(c, GraphModule)]
    if stages and not blocks:  # pipeline stages: read as one graph, the model's order
        inner = inline_children(inner, stages, order=list(meta.get(STAGE_NAMES_KEY) or ()))
    elif meta.get(STAGE_NAMES_KEY) and not blocks:
        raise QCompileError(f"{where}: the graph is one pipeline stage; {holds} holds one "
                            "whole model", fix=f"{verb} the graph qc.qcompile returned (its "
                            "stage_<i> children), on every rank of the pipeline")
    refuse_adapters(inner, f"qc.{where}")
    refuse_pending(inner, where)
    for name, t in (*inner.named_parameters(), *inner.named_buffers()):
        if is_dtensor(t) and not _gatherable(meta, t):
            raise QCompileError(f"{where}: {name} is a sharded DTensor ({type(t).__name__}); "
                                f"{holds} holds whole tensors",
                                fix="gather the model first (a full state dict: "
                                "t.full_tensor() for each DTensor, loaded into an "
                                f"unsharded compile of the model) and {verb} that on one rank")
        if t.device.type == "meta":
            raise QCompileError(f"{where}: {name} is on the meta device (it has no values)",
                                fix="allocate and load the weights first (to_empty, a "
                                "checkpoint, or qc.distributed.compile_once)")
    return inner


def is_dtensor(t: torch.Tensor) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def _gatherable(meta: Mapping[str, Any], t: torch.Tensor) -> bool:
    """Whether ``t`` is a shard the ranks can gather together: a DTensor of a graph
    ``qc.distributed.wrap`` (or ``compile_once``) sharded, for tensor parallelism, FSDP2 or
    both, whose ranks agree on each call first (``agree_to_gather``). A graph sharded by
    hand (``fully_shard`` alone) has no such agreement: a rank missing a gather would hang."""
    return (bool(meta.get(TP_SHARDED_KEY)) or meta.get(COLLECTIVES_KEY) is not None
            or meta.get(PIPELINE_KEY) is not None)


def is_sharded(gm: GraphModule) -> bool:
    """Whether ``gm`` holds sharded (DTensor) parameters or stages other ranks trained:
    exporting it is a collective."""
    return spread(gm) is not None or any(is_dtensor(p) for p in gm.parameters())


def gathered(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole and detached: a sharded DTensor gathered (``full_tensor()``, a
    collective every rank makes, in the same order), as a ``Parameter`` when ``t`` is one
    (a quantizer takes the same path on it as on the unsharded parameter); else ``t``."""
    if not is_dtensor(t):
        return t
    whole = t.detach().full_tensor()
    return nn.Parameter(whole, requires_grad=t.requires_grad) if isinstance(
        t, nn.Parameter) else whole


def writes_here(gm: GraphModule) -> bool:
    """Whether this process writes ``gm``'s export: always for a whole graph; for a
    sharded one (every rank exports it together) only the default group's rank 0, and for
    one whose stages ``qc.distributed.pipeline`` spread over ranks the pipeline's lowest
    rank. Read through ``sys.modules``: this layer never imports ``torch.distributed``
    itself."""
    if not is_sharded(gm):
        return True
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return True
    placement = spread(gm)
    return int(dist.get_rank()) == (0 if placement is None else placement.writer)


def config_fingerprint(config: Any) -> Any:
    """What ranks exporting together compare of a ``config`` argument: its dict (a
    transformers config's ``to_dict()``), else its type's name."""
    if config is None or isinstance(config, (str, int, float, bool)):
        return config
    if isinstance(config, Mapping):
        return dict(config)
    if callable(getattr(config, "to_dict", None)):
        return config.to_dict()
    return type(config).__name__


_REFUSAL_FIX = ("fix what that rank's own error reports (it names the cause and the fix), "
                "then call again on every rank")


def agree_to_gather(gm: GraphModule, where: str, fingerprint: Mapping[str, Any],
                    refusal: Exception | None) -> None:
    """Before a sharded graph's first gather: every rank is in the same call ``where``,
    with the same model and the same ``fingerprint`` (the call's arguments), and none
    refused it on its own (``refusal``: what this rank's local checks raised, such as rank
    0's check of the output path), else every rank raises, within seconds and before any
    collective: the refusing rank its own error, the others one naming it. The meetings go
    through the group ``qc.distributed.pipeline`` recorded (``meta[PIPELINE_KEY]``: every
    rank of the pipeline), else the one ``qc.distributed.wrap`` recorded
    (``meta[COLLECTIVES_KEY]``: ``qcompile.distributed.agree``); a graph without either is
    not checked."""
    check = gm.meta.get(PIPELINE_KEY) or gm.meta.get(COLLECTIVES_KEY)
    if check is None:
        if refusal is not None:
            raise refusal
        return
    check(where, gm, dict(fingerprint))
    mine = None if refusal is None else str(getattr(refusal, "message", refusal))
    try:
        check(where, gm, {"refusal": mine and mine.removeprefix(f"{where}: ")})
    except QCompileError as e:
        if refusal is not None:
            raise refusal from None
        # agree's "<where>: the ranks disagree on refusal: rank 0: '...'; rank 1: None;
        # every rank ...": the refusing ranks' (shortened) messages are what this one says
        detail = e.message.split(": the ranks disagree on refusal: ", 1)[-1]
        detail = detail.split("; every rank must agree", 1)[0]
        detail = re.sub(r"(?:^|; )ranks? [\d, ]+: None(?=;|$)", "", detail).removeprefix("; ")
        raise QCompileError(f"{where}: another rank refused the call before any tensor was "
                            f"gathered, so no rank writes anything ({detail})",
                            fix=_REFUSAL_FIX) from None
    if refusal is not None:  # no process group to tell: this rank's own error
        raise refusal


def agree_and_share(graph: GraphModule, stages: nn.Module, where: str,
                    fingerprint: Mapping[str, Any], check: Callable[[], Any]) -> Any:
    """What every rank of a graph written together (sharded, or with stages
    ``qc.distributed.pipeline`` spread over ranks) does before it reads a weight:
    ``check()`` (this rank's checks, the writer's of its target; a ``QCompileError`` it
    raises is this rank's refusal), the agreement on the call (``agree_to_gather``: a
    refusal stops every rank), then the stages' trained state
    (``qcompile.deploy.stages.share_stages`` of ``stages``, the graph holding the
    ``stage_<i>`` children). Returns what ``check`` returned."""
    refusal, result = None, None
    try:
        result = check()
    except QCompileError as e:
        refusal = e
    agree_to_gather(graph, where, fingerprint, refusal)
    share_stages(stages)
    return result


def call_name(node: Node) -> str:
    """The bare name of what a node calls (``aten.view.default`` -> ``view``)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    text = str(node.target)
    if text.startswith("aten."):
        return text.split(".")[1]
    return str(getattr(node.target, "__name__", text)).split(".")[0]


def _called(node: Node) -> nn.Module | None:
    """The module a ``call_module`` node calls (None for other nodes)."""
    gm = node.graph.owning_module
    if node.op != "call_module" or gm is None:
        return None
    try:
        return gm.get_submodule(str(node.target))
    except AttributeError:
        return None


def sharded_linear(node: Node) -> ShardedLinear | None:
    """The ``ShardedLinear`` a node calls (a tensor-parallel layer running its own
    quantizers), or None."""
    m = _called(node)
    return m if isinstance(m, ShardedLinear) else None


def view_paths(node: Node) -> Iterator[tuple[list[Node], Node]]:
    """Each path from ``node`` through view ops to the first node that is not one: (the
    views, that node). A ``SumGradients`` call (tensor parallelism's: the identity
    forward) is passed through, not listed."""
    for user in node.users:
        if user.op == "call_module" and user.args and user.args[0] is node and isinstance(
                _called(user), SumGradients):
            yield from view_paths(user)
        elif call_name(user) in VIEWS and user.args and user.args[0] is node:
            for views, end in view_paths(user):
                yield [user, *views], end
        else:
            yield [], user


@dataclass(frozen=True)
class WeightRead:
    """One way the graph reads a parameter: through quantizer ``fq`` (its qualified name,
    None for the float value) after the view ops ``views``, into ``consumer``."""

    fq: str | None
    views: tuple[Node, ...]
    consumer: Node | None


def weight_reads(gm: GraphModule) -> dict[int, list[WeightRead]]:
    """id(parameter) -> every read of it in the graph. A parameter read only inside a
    module call (a leaf module of a symbolic trace) gets no entry: it is read as is;
    tensor parallelism's layers are read as the ops they stand for (see the module)."""
    out: dict[int, list[WeightRead]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            _module_reads(node, out)
            continue
        if node.op != "get_attr":
            continue
        try:
            value = gm.get_parameter(str(node.target))
        except AttributeError:  # a buffer or a constant
            continue
        for views, end in view_paths(node):
            target = end.op == "call_module" and gm.get_submodule(str(end.target))
            if isinstance(target, FakeQuantize):
                consumers = [c for _, c in view_paths(end)] or [None]
                out.setdefault(id(value), []).extend(
                    WeightRead(str(end.target), tuple(views), c) for c in consumers)
            else:
                out.setdefault(id(value), []).append(WeightRead(None, tuple(views), end))
    return out


def _module_reads(node: Node, out: dict[int, list[WeightRead]]) -> None:
    """The reads of a ``ShardedLinear`` call (its weight through ``weight_fake_quant``
    when it quantizes it, its bias as is) or a ``ShardedEmbedding`` call (its table)."""
    m = _called(node)
    if isinstance(m, ShardedLinear):
        fq = f"{node.target}.weight_fake_quant" if m.quantize_weight else None
        out.setdefault(id(m.weight), []).append(WeightRead(fq, (), node))
        if m.bias is not None:
            out.setdefault(id(m.bias), []).append(WeightRead(None, (), node))
    elif isinstance(m, ShardedEmbedding):
        out.setdefault(id(m.weight), []).append(WeightRead(None, (), node))


def weight_sites(gm: nn.Module) -> list[tuple[GraphModule, str, FakeQuantize, ViewSteps]]:
    """``weight_quantizer_sites`` with tensor parallelism's layers: (graph, ``<layer>.weight``,
    its ``weight_fake_quant``, no views) for each ``ShardedLinear`` call that quantizes its
    weight; then every site in the order of the parameters they read (the order a compiled
    graph's weight quantizers come in: one process's order for the unsharded graph)."""
    found = weight_quantizer_sites(gm)
    extra = []
    for owner in gm.modules():
        if not isinstance(owner, GraphModule):
            continue
        for node in owner.graph.nodes:
            m = sharded_linear(node)
            if m is not None and m.quantize_weight:
                extra.append((owner, f"{node.target}.weight", m.weight_fake_quant, ()))
    if not extra:
        return found
    order: dict[int, int] = {}
    for i, (_, p) in enumerate(gm.named_parameters(remove_duplicate=False)):
        order.setdefault(id(p), i)

    def position(site: tuple[GraphModule, str, FakeQuantize, ViewSteps]) -> int:
        parent, _, leaf = site[1].rpartition(".")
        value = getattr(site[0].get_submodule(parent) if parent else site[0], leaf, None)
        return order.get(id(value), len(order))

    return sorted([*found, *extra], key=position)


def describe_scheme(fq: FakeQuantize, *, brief: bool = False) -> str:
    """A quantizer's scheme in a refusal: ``int4 symmetric per_group of 32``, ``nvfp4 in
    blocks of 16``; ``brief``: dtype and granularity only (``int4 per_group of 32``)."""
    if fq.block_format is not None:
        return f"{fq.block_format} in blocks of {fq.group_size}"
    detail = {"per_group": f" of {fq.group_size}", "per_channel": f" (axis {fq.axis})"}
    how = "" if brief else (f" {'symmetric' if fq.symmetric else 'asymmetric'}"
                            + (" dynamic" if fq.dynamic else ""))
    return f"{fq.dtype}{how} {fq.granularity}{detail.get(fq.granularity, '')}"
