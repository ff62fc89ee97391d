"""What the exporters (``qc.export_gguf``, ``qc.save_pretrained``) share: the checks that
a compiled graph is one whole model whose weights they can read, and which op reads each
parameter, through which view ops and which quantizer.

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

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.deploy.adapters import refuse_adapters, unwrap
from qcompile.errors import QCompileError
from qcompile.graph.algorithms import refuse_pending
from qcompile.graph.meta import REPORT_KEY, STAGE_NAMES_KEY
from qcompile.runtime.fake_quant import FakeQuantize

__all__ = ["VIEWS", "WeightRead", "call_name", "describe_scheme", "is_dtensor", "view_paths",
           "weight_reads", "whole_graph"]

#: ops that only reshape or relabel a tensor (a weight read through them is still the weight)
VIEWS = frozenset({"reshape", "view", "_unsafe_view", "t", "transpose", "permute",
                   "contiguous", "alias", "to"})


def whole_graph(gm: nn.Module, where: str, *, holds: str, preset: str,
                verb: str) -> GraphModule:
    """The compiled graph of ``gm`` (inside a DDP wrapper too), refused for ``where`` (the
    caller's name) where ``holds`` (what it writes: "a GGUF file") cannot hold what it
    computes: a model qcompile did not compile (the fix names ``preset``), pipeline stages,
    adapters, pending algorithms, sharded or meta-device weights; ``verb`` is what the
    fixes tell the user to do with the gathered model ("export")."""
    inner = unwrap(gm)
    meta = getattr(inner, "meta", None)
    if not isinstance(inner, GraphModule) or not isinstance(meta, dict) or REPORT_KEY not in meta:
        raise QCompileError(f"{where}: the model ({type(gm).__name__}) was not compiled by "
                            "qcompile", fix="pass the graph qc.qcompile returned for the "
                            f"Hugging Face model (e.g. with the {preset} preset)")
    stages = [n for n, c in inner.named_children()
              if n.startswith("stage_") and isinstance(c, GraphModule)]
    if stages or meta.get(STAGE_NAMES_KEY):
        raise QCompileError(f"{where}: the graph is split into pipeline stages "
                            f"({', '.join(stages) or 'placed'}); {holds} holds one whole "
                            "model", fix="compile the model without a pipeline section (same "
                            f"spec otherwise), load the trained weights into it and {verb} "
                            "that")
    refuse_adapters(inner, f"qc.{where}")
    refuse_pending(inner, where)
    for name, t in (*inner.named_parameters(), *inner.named_buffers()):
        if is_dtensor(t):
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


def view_paths(node: Node) -> Iterator[tuple[list[Node], Node]]:
    """Each path from ``node`` through view ops to the first node that is not one: (the
    views, that node)."""
    for user in node.users:
        if call_name(user) in VIEWS and user.args and user.args[0] is node:
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
    module call (a leaf module of a symbolic trace) gets no entry: it is read as is."""
    out: dict[int, list[WeightRead]] = {}
    for node in gm.graph.nodes:
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


def describe_scheme(fq: FakeQuantize, *, brief: bool = False) -> str:
    """A quantizer's scheme in a refusal: ``int4 symmetric per_group of 32``, ``nvfp4 in
    blocks of 16``; ``brief``: dtype and granularity only (``int4 per_group of 32``)."""
    if fq.block_format is not None:
        return f"{fq.block_format} in blocks of {fq.group_size}"
    detail = {"per_group": f" of {fq.group_size}", "per_channel": f" (axis {fq.axis})"}
    how = "" if brief else (f" {'symmetric' if fq.symmetric else 'asymmetric'}"
                            + (" dynamic" if fq.dynamic else ""))
    return f"{fq.dtype}{how} {fq.granularity}{detail.get(fq.granularity, '')}"
