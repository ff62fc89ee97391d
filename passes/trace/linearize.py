"""Products of an input and a transposed 2-D parameter become ``linear`` calls.

Models written with ``x @ self.weight.T`` (Falcon's ``FalconLinear``, many hand-written
layers), ``torch.matmul(x, W.t())``, ``x @ W.transpose(0, 1)`` or ``W.permute(1, 0)`` compute
exactly ``F.linear(x, W)``: the parameter is stored ``[out, in]`` and read transposed. The
``trace`` pass rewrites each such product into the ``linear`` op of its front end
(``F.linear`` on symbolic graphs, ``aten.linear`` on export graphs) before any rule is
matched, so the layer is one every later step knows: a per-output-channel weight quantizer,
LoRA adapters and frozen bases, integer kernels, GPTQ, ONNX. The result is bit-identical
(torch computes ``linear`` without a bias as that same product; checked for float32 and
bfloat16 in the tests).

Only the right operand is rewritten, only when it is a 2-D parameter or buffer reached
through one transpose-like view, and the view goes when nothing else reads it. A product
whose weight is not stored ``[out, in]`` (``x @ W`` with ``W`` ``[in, out]``), a batched
``bmm``, or an ``einsum`` stays as it is: the weight rules still quantize those through
``qcompile.graph.matching.weight_use``.

Example:
    >>> import torch
    >>> from qcompile.passes.trace.linearize import linearize
    >>> class M(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.randn(3, 4))
    ...     def forward(self, x):
    ...         return x @ self.weight.T
    >>> gm = torch.fx.symbolic_trace(M())
    >>> linearize(gm)
    ['matmul']
    >>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"][0].split()[2]
    'linear>'
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

aten = torch.ops.aten

# the products that read ``x @ W`` (right operand the weight) and the linear op that
# replaces them, per front end
_PRODUCTS = {operator.matmul: F.linear, torch.matmul: F.linear, torch.mm: F.linear,
             aten.matmul.default: aten.linear.default, aten.mm.default: aten.linear.default}
_TRANSPOSES = {torch.t, aten.t.default, aten.numpy_T.default, aten.mT.default,
               aten.adjoint.default}


def _transposed_2d(view: Node) -> Node | None:
    """The ``get_attr`` a view reads when the view is a transpose of a 2-D tensor."""
    if view.op not in ("call_function", "call_method") or not view.args:
        return None
    src = view.args[0]
    if not isinstance(src, Node) or src.op != "get_attr":
        return None
    target, args = view.target, view.args
    if view.op == "call_method":
        ok = target in ("t", "mT") or (target == "transpose" and _dims(args[1:]) == {0, 1}) \
            or (target == "permute" and _perm(args[1:]) == [1, 0])
    elif target is getattr:
        ok = len(args) > 1 and args[1] in ("T", "mT")
    elif target in _TRANSPOSES:
        ok = True
    elif target in (torch.transpose, aten.transpose.int):
        ok = _dims(args[1:]) in ({0, 1}, {0, -1}, {-2, 1}, {-2, -1})
    elif target in (torch.permute, aten.permute.default):
        ok = _perm(args[1:]) == [1, 0]
    else:
        ok = False
    return src if ok else None


def _dims(args: tuple) -> set | None:
    return set(args[:2]) if len(args) >= 2 and all(isinstance(a, int) for a in args[:2]) \
        else None


def _perm(args: tuple) -> list | None:
    perm = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return [p % 2 if isinstance(p, int) else p for p in perm]


def _rank(gm: GraphModule, node: Node) -> int | None:
    obj = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj.dim() if isinstance(obj, torch.Tensor) else None


def linearize(gm: GraphModule) -> list[str]:
    """Rewrite ``x @ W.T``-style products of ``gm`` in place into ``linear(x, W)``; returns
    the names of the products rewritten (the graph is not recompiled here)."""
    done: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or len(node.args) != 2 or node.kwargs:
            continue
        try:
            op = _PRODUCTS.get(node.target)
        except TypeError:  # an unhashable target
            continue
        x, view = node.args
        if op is None or not isinstance(view, Node) or not isinstance(x, Node):
            continue
        weight = _transposed_2d(view)
        if weight is None or _rank(gm, weight) != 2:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, (x, weight))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        if not view.users:
            gm.graph.erase_node(view)
        done.append(node.name)
    return done
