"""``tidy``: drop what no node reads, and give the new modules their layers' names.

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
    >>> sorted(int8.state_dict())  # 2: the QuantizedLinear, 0.weight: an IntWeight
    ['0.bias', '0.weight.packed', '0.weight.scale', '0.weight.zero_point',
     '2._packed_params._packed_params', '2._packed_params.dtype', '2.scale', '2.zero_point']
"""

from __future__ import annotations

from torch.fx import GraphModule

from qcompile.graph.context import Context
from qcompile.graph.meta import FINAL_NAME_KEY
from qcompile.graph.pipeline import graph_pass


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
    g.eliminate_dead_code()
    dropped = _drop_unread(gm)
    gm.delete_all_unused_submodules()
    # `_qc_<k>_<layer>` -> `<layer>` (fc -> QuantizedLinear) and `<layer>.weight` ->
    # IntWeight, where the name is free now, so state dicts read like the model's
    renamed = 0
    for node in g.nodes:
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
        node.target = wanted
        renamed += 1
    for node in g.nodes:  # `_qc_1_fc` -> `fc` in the code, too
        wanted = node.meta.get(FINAL_NAME_KEY)
        if node.op == "call_module" and wanted and node.name.startswith("_qc_"):
            node._rename(wanted.replace(".", "_"))
    ctx.note(f"{dropped} unread parameter(s) / buffer(s) dropped, {renamed} module(s) "
             "renamed after their layers")
    return gm
