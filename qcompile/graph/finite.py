"""The first training steps check every quantizer's input for NaN and infinity
(``train.check_finite``): a non-finite value is an error naming the quantizer, the node it
reads and the op upstream that most likely made it, not a NaN loss a hundred steps later.

``install(gm, steps)`` (``compile_model`` calls it for every quantizing spec) puts a forward
pre-hook on the graph. While the graph has budget left, a training forward (training mode,
gradients on) switches the check on in every ``FakeQuantize`` of the graph (its
``check_finite`` attribute holds what the error says about it: the quantizer, its node and
the nearest division, root, ``exp`` / ``log`` or softmax upstream) and an evaluation
forward switches it off; each optimizer step since the previous forward
(``weight_cache.optimizer_steps``) spends one step of the budget, and when it is spent the
checks go and the hook removes itself: one comparison per forward remains until then, and
nothing after. Under ``torch.compile`` the hook and the checks stand aside (the check reads
a value, which would break the graph).

A check costs one pass over the tensor per quantizer call, in the first steps only: its
float32 sum, finite unless a NaN or an infinity is in it (``torch.isfinite(x).all()`` only
when a finite tensor's sum overflows).

Example:
    >>> import torch, qcompile as qc
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> gm = qc.qcompile(model, "int8-qat", example_inputs=(torch.randn(2, 4),))
    >>> try:
    ...     gm(torch.full((2, 4), float("nan")))
    ... except qc.QCompileError as e:
    ...     print(e.message.split(":")[0])
    training forward
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.graph.matching import layer_of, op_name
from qcompile.graph.meta import CHECK_FINITE_KEY
from qcompile.runtime import weight_cache
from qcompile.runtime.fake_quant import FakeQuantize

# gm.meta (deep copies and torch.save keep it): [steps left, optimizer steps seen, checks on]
_STATE = CHECK_FINITE_KEY
# ops after which a value rounded to 0 (or a huge one) is an infinity or a NaN
_RISKY = {"rsqrt", "sqrt", "reciprocal", "div", "exp", "exp2", "expm1", "log", "log2",
          "log10", "log1p", "pow", "softmax", "log_softmax"}


def install(gm: GraphModule, steps: int) -> GraphModule:
    """Check quantizer inputs in ``gm``'s first ``steps`` training steps (0: never)."""
    if steps <= 0 or not any(isinstance(m, FakeQuantize) for m in gm.modules()):
        return gm
    gm.meta[_STATE] = [steps, None, False]
    if _watch not in gm._forward_pre_hooks.values():
        gm.register_forward_pre_hook(_watch)
    hooks = getattr(gm, "_deepcopy_hooks", None)
    if isinstance(hooks, list) and _reinstall not in hooks:
        hooks.append(_reinstall)  # GraphModule's deepcopy keeps no forward hooks
    return gm


def _state(gm: nn.Module) -> list | None:
    meta = getattr(gm, "meta", None)
    return meta.get(_STATE) if isinstance(meta, dict) else None


def _reinstall(gm: nn.Module) -> None:
    state = _state(gm)
    if state is not None and state[0] > 0 and _watch not in gm._forward_pre_hooks.values():
        gm.register_forward_pre_hook(_watch)


def _watch(gm: nn.Module, args: Any) -> None:
    """Forward pre-hook: spend the budget on optimizer steps, switch the checks."""
    if torch.compiler.is_compiling():
        return
    state = _state(gm)
    if state is None:
        return
    _, count = weight_cache.optimizer_steps()
    if state[1] is not None and count != state[1]:
        state[0] -= max(count - state[1], 1) if count > state[1] else 1
    state[1] = count
    want = state[0] > 0 and gm.training and torch.is_grad_enabled()
    if want != state[2]:
        _switch(gm, want)
        state[2] = want
    if state[0] <= 0:
        for key, hook in list(gm._forward_pre_hooks.items()):
            if hook is _watch:
                del gm._forward_pre_hooks[key]


def _switch(gm: nn.Module, on: bool) -> None:
    """Every quantizer's ``check_finite``: what its error says (on), or None (off)."""
    graphs = [m for m in gm.modules() if isinstance(m, GraphModule)]
    where = _descriptions(graphs) if on else {}
    for name, m in gm.named_modules():
        if isinstance(m, FakeQuantize):
            m.__dict__["check_finite"] = (where.get(id(m)) or f"quantizer {name!r}") if on \
                else None


def _descriptions(graphs: list[GraphModule]) -> dict[int, str]:
    """For each quantizer a graph calls: its name, the node it reads and the nearest risky
    op upstream (one pass over each graph, forwards)."""
    out: dict[int, str] = {}
    for g in graphs:
        nearest: dict[Node, Node | None] = {}
        for node in g.graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                nearest[node] = None
                continue
            if op_name(node) in _RISKY:
                nearest[node] = node
                continue
            ups = [nearest.get(a) for a in node.all_input_nodes]
            nearest[node] = next((u for u in ups if u is not None), None)
            if node.op != "call_module":
                continue
            fq = g.get_submodule(str(node.target))
            if not isinstance(fq, FakeQuantize) or not node.args:
                continue
            src = node.args[0]
            text = f"quantizer {node.target!r} (node {node.name!r}"
            if isinstance(src, Node):
                text += f", reading {src.name!r}"
                if src.op == "get_attr":
                    text += f": the weight {src.target!r}"
                elif src.op == "placeholder":
                    text += ": a model input"
            text += ")"
            risky = nearest.get(src) if isinstance(src, Node) else None
            if risky is not None:
                layer = layer_of(risky)
                text += (f"; nearest op upstream that turns a value rounded to 0 (or a huge "
                         f"one) into an infinity: {op_name(risky)} (node {risky.name!r}"
                         + (f", in {layer}" if layer else "") + ")")
                feeding = [a for a in risky.all_input_nodes if a.op == "call_module"
                           and isinstance(g.get_submodule(str(a.target)), FakeQuantize)]
                if feeding:
                    text += f", which reads quantizer {feeding[0].target!r}"
            out[id(fq)] = text
    return out
