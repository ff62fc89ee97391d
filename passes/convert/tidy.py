"""``tidy``: the converted graph's final state: qparams as state, nothing unread, names.

A kernel that takes its output qparams as arguments (``quantized::add``) reads them from
the ``ActivationQParams`` of the quantizer it replaced (``add_quantized``), so every
activation scale and zero point of a converted graph is in its state dict (kernel modules
such as ``QuantizedLinear`` keep theirs as their own state).

Dead nodes go, then every parameter and buffer no node reads (the float weights that
kernels and ``IntWeight`` replaced, BatchNorm statistics) and every module left unused.
Kernel modules added as ``_qc_<k>_<layer>`` take the name ``<layer>`` (``fc`` becomes
the ``QuantizedLinear``) and ``IntWeight`` modules take ``<layer>.weight`` where the name
is free now, so state dicts read like the model's; the nodes are renamed likewise.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = qc.qcompile(m, "int8-static", example_inputs=(torch.randn(2, 8),))
    >>> gm = qc.calibrate(gm, [(torch.randn(16, 8),) for _ in range(2)], progress=False)
    >>> int8 = qc.convert(gm)
    >>> sorted(int8.state_dict())  # 0 and 2: QuantizedLinear, then the input's qparams
    ['0._packed_params._packed_params', '0._packed_params.dtype', '0.scale', '0.zero_point',
     '2._packed_params._packed_params', '2._packed_params.dtype', '2.scale', '2.zero_point',
     'input_input_fake_quant.scale', 'input_input_fake_quant.zero_point']

    With the input left in float (``quant.inputs: null``) the first layer keeps a float op
    on an ``IntWeight``, named after its weight:

    >>> spec = qc.load_spec("int8-static")
    >>> spec = spec.model_copy(update={"quant": spec.quant.model_copy(update={"inputs": None})})
    >>> gm = qc.qcompile(m, spec, example_inputs=(torch.randn(2, 8),))
    >>> gm = qc.calibrate(gm, [(torch.randn(16, 8),) for _ in range(2)], progress=False)
    >>> sorted(k for k in qc.convert(gm).state_dict() if k.startswith("0."))
    ['0.bias', '0.output_fake_quant.scale', '0.output_fake_quant.zero_point',
     '0.weight.packed', '0.weight.scale', '0.weight.zero_point']
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.meta import FINAL_NAME_KEY
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import Conversion, state, where
from qcompile.runtime.quantized import ActivationQParams, add_quantized

_QADD = {torch.ops.quantized.add: False, torch.ops.quantized.add_relu: True}


def _owner(gm: GraphModule, conv: Conversion, node: Node, scale: float, zp: int) -> str:
    """The ``ActivationQParams`` holding ``node``'s output qparams: the replaced
    quantizer's (found through the nodes that read its output), else a new one."""
    for user in node.users:
        path = conv.qparams_after.get(user)
        if path is None:
            continue
        held = gm.get_submodule(path)
        if float(held.scale[0]) == scale and int(held.zero_point[0]) == zp:
            return path
    # not reached by qc.convert's own steps; kept so a hand-built pipeline stays correct
    return conv.add_module(gm, where(node), ActivationQParams(torch.tensor([scale]), zp))


def _bind_qparams(gm: GraphModule, conv: Conversion) -> int:
    """``quantized::add(a, b, <scale>, <zero point>)`` -> ``add_quantized(a, b, scale,
    zero_point)`` reading buffers; how many."""
    g = gm.graph
    bound = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in _QADD or len(node.args) != 4:
            continue
        a, b, scale, zp = node.args
        if isinstance(scale, Node) or isinstance(zp, Node):
            continue
        owner = _owner(gm, conv, node, float(scale), int(zp))
        with g.inserting_before(node):
            s_node = g.get_attr(f"{owner}.scale")
            z_node = g.get_attr(f"{owner}.zero_point")
            new = g.call_function(add_quantized, (a, b, s_node, z_node),
                                  {"relu": _QADD[node.target]})
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        for step, entry in enumerate(conv.steps):  # the record follows the node
            if entry[0] is node:
                conv.steps[step] = (new, *entry[1:])
        g.erase_node(node)
        bound += 1
    return bound


def _drop_unread(gm: GraphModule) -> int:
    """Delete parameters and buffers no node reads (nor a called module); how many."""
    used = {str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}

    def needed(path: str) -> bool:  # read by a node, or inside a called module
        parts = path.split(".")
        return path in used or any(".".join(parts[:i]) in called for i in range(1, len(parts)))

    dropped = 0
    for mod_name, module in list(gm.named_modules()):
        for kind in ("_parameters", "_buffers"):
            for leaf in list(getattr(module, kind)):
                path = f"{mod_name}.{leaf}" if mod_name else leaf
                if not needed(path):
                    del getattr(module, kind)[leaf]
                    dropped += 1
    return dropped


@graph_pass(requires=("int_storage",), provides=("converted",))
def tidy(gm: GraphModule, ctx: Context) -> GraphModule:
    g = gm.graph
    bound = _bind_qparams(gm, state(ctx))
    g.eliminate_dead_code()
    dropped = _drop_unread(gm)
    gm.delete_all_unused_submodules()
    # `_qc_<k>_<layer>` -> `<layer>` (fc -> QuantizedLinear) and `<layer>.weight` ->
    # IntWeight, where the name is free now, so state dicts read like the model's
    renamed = 0
    moved: dict[str, str] = {}  # a module called by several nodes (a cell in a loop) moves once
    for node in g.nodes:
        if node.op == "call_module" and str(node.target) in moved:
            node.target = moved[str(node.target)]
            continue
        wanted = node.meta.get(FINAL_NAME_KEY)
        if node.op != "call_module" or not wanted:
            continue
        parent, _, leaf = wanted.rpartition(".")
        try:
            owner = gm.get_submodule(parent) if parent else gm
        except AttributeError:
            owner = None  # the container went away with its last tensor: recreate it
        if owner is not None and hasattr(owner, leaf):
            continue
        module = gm.get_submodule(str(node.target))
        gm.delete_submodule(str(node.target))
        gm.add_submodule(wanted, module)
        moved[str(node.target)] = wanted
        node.target = wanted
        renamed += 1
    for node in g.nodes:  # `_qc_1_fc` -> `fc` in the code, too
        wanted = node.meta.get(FINAL_NAME_KEY)
        if node.op == "call_module" and wanted and node.name.startswith("_qc_"):
            node._rename(wanted.replace(".", "_"))
    ctx.note(f"{dropped} unread parameter(s) / buffer(s) dropped, {renamed} module(s) "
             "renamed after their layers")
    if bound:
        ctx.note(f"{bound} kernel(s) read their output qparams from the state dict")
    return gm
