"""What ``insert_quant`` and its layer-kind helpers share: building a quantizer from a
scheme, naming and adding it, and splicing its call into the graph.

Example:
    >>> import torch
    >>> from qcompile.passes.insert_quant.common import free_name
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> free_name(gm, "0.weight")  # taken by the parameter
    '0.weight_1'
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.matching import is_size_like
from qcompile.graph.meta import NN_MODULE_STACK, TENSOR_META
from qcompile.graph.records import QuantizerRecord
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.specs import Scheme


def model_device(gm: GraphModule) -> torch.device:
    """Where the model's tensors live (activation quantizers go there too). Looks at the
    first tensor only: called once per pass, never per node."""
    first = next(iter(gm.parameters()), None)
    if first is None:
        first = next(iter(gm.buffers()), None)
    return first.device if first is not None else torch.device("cpu")



def free_name(gm: GraphModule, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... whichever names no existing attribute."""
    parent, _, leaf = base.rpartition(".")
    try:
        owner = gm.get_submodule(parent) if parent else gm
    except AttributeError:  # the owner holds no parameters, so the graph never copied it
        return base  # add_submodule creates the containers
    name, k = leaf, 0
    while hasattr(owner, name):
        k += 1
        name = f"{leaf}_{k}"
    return f"{parent}.{name}" if parent else name



def move_to(fq: FakeQuantize, device: torch.device) -> None:
    """``fq.to(device)``; a quantizer is built on the CPU, where ``Module.to`` would only
    walk its tensors to find nothing to move."""
    if device.type != "cpu":
        fq.to(device)



def add_quantizer(gm: GraphModule, base: str, fq: FakeQuantize) -> str:
    name = free_name(gm, base)
    gm.add_submodule(name, fq)
    return name



def attr(gm: GraphModule, target: str) -> Any:
    parent, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(parent) if parent else gm, leaf)



def quantizer_call(gm: GraphModule, name: str, x: Node) -> Node:
    """``gm.graph.call_module(name, (x,))`` for a quantizer this pass just added: the node
    it makes, without its look-up of the module (which it only warns about when absent)."""
    return gm.graph.create_node("call_module", name, (x,))



def param_attr(g: torch.fx.Graph, m: nn.Module, target: str, name: str) -> Node:
    """``g.get_attr("<target>.<name>")``; for a parameter of the module (what Linear / Conv
    / Embedding hold), the node without ``get_attr``'s look-up, which only warns about an
    attribute that is missing or not a parameter, buffer or module."""
    if isinstance(m._parameters.get(name), nn.Parameter):
        return g.create_node("get_attr", f"{target}.{name}")
    return g.get_attr(f"{target}.{name}")



def build(scheme: Scheme, ctx: Context, *, role: str, shape: tuple[int, ...] | None,
           dynamic: bool, where: str, field: str,
           channel_axis: int | None = None) -> FakeQuantize:
    try:
        return FakeQuantize.from_scheme(scheme, role=role, shape=shape, dynamic=dynamic,
                                        channel_axis=channel_axis,
                                        target=ctx.spec.quant.target,
                                        update=ctx.spec.quant.observer_update)
    except ValueError as e:
        raise QCompileError(f"{where}: {field}: {e}",
                            fix=f"change {field} in the spec, or exclude {where} with a "
                            "skip rule") from None
    except QCompileError as e:  # an observer this version does not provide
        raise QCompileError(f"{where}: {field}.observer: {e.message}", fix=e.fix) from None



def quantizer_record(name: str, fq: FakeQuantize, role: str, node: str,
                     rule: int | None) -> QuantizerRecord:
    return QuantizerRecord(name=name, role=role, node=node, rule=rule, dtype=fq.dtype,
                           granularity=fq.granularity, symmetric=fq.symmetric,
                           scales=fq.scale.numel(), learnable=fq.learnable, dynamic=fq.dynamic)



def set_flag(fq: FakeQuantize, name: str, value: bool) -> None:
    """``fq.<name> = value`` where it changes anything: setting a switch mirrors it into the
    quantizer's flag buffer (a tensor write) and drops its weight cache, ~20 us each, and a
    new quantizer already has ``enabled`` and ``observe`` on."""
    if getattr(fq, name) is not value:
        setattr(fq, name, value)



def set_activation_mode(fq: FakeQuantize, mode: str) -> None:
    if mode == "static":
        set_flag(fq, "enabled", False)  # observe float activations until qc.calibrate
    set_flag(fq, "observe", True)



def insert_after(gm: GraphModule, node: Node, name: str) -> Node:
    with gm.graph.inserting_after(node):
        q = quantizer_call(gm, name, node)
    node.replace_all_uses_with(q, delete_user_cb=lambda u: u is not q)
    q.meta[TENSOR_META] = node.meta.get(TENSOR_META)
    if NN_MODULE_STACK in node.meta:
        q.meta[NN_MODULE_STACK] = node.meta[NN_MODULE_STACK]
    return q



def tensor_shape(node: Node, ctx: Context) -> tuple[bool, tuple[int, ...] | None]:
    """(is a floating-point tensor, shape) from ShapeProp; a guess without shapes."""
    tm = node.meta.get(TENSOR_META)
    if not isinstance(tm, TensorMetadata):
        return not ctx.has_shapes and not is_size_like(node), None
    return tm.dtype.is_floating_point, tuple(tm.shape)
