"""Which rule selects which node: module ownership, op names, and the annotation record.

Nodes are matched by *module ownership*, not by node kind: a node is owned by the module
it calls (``call_module`` target) and by every module enclosing it
(``node.meta[NN_MODULE_STACK]``, recorded by both ``symbolic_trace`` and
``torch.export``), so the same rule selects the same layers under either front end.

Example:
    >>> import torch
    >>> from qcompile.graph.matching import op_name
    >>> gm = torch.fx.symbolic_trace(lambda x: torch.cat([x, x]) + x)
    >>> [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]
    ['cat', 'add']
"""

from __future__ import annotations

import fnmatch
import functools
import operator
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.graph.meta import MODULE_KEY, NN_MODULE_STACK, ROOT_CLASS_KEY
from qcompile.specs import Match, Rule, Scheme

# Operator spellings that mean the same op for matching (`x + y`, `x += y`, `torch.add`).
_ALIASES = {
    "iadd": "add", "radd": "add", "imul": "mul", "rmul": "mul", "isub": "sub", "rsub": "sub",
    "truediv": "div", "itruediv": "div", "rtruediv": "div", "imatmul": "matmul",
    "rmatmul": "matmul", "concat": "cat", "concatenate": "cat",
}

# Module types whose weight qcompile fake-quantizes (their forward is re-expressed with the
# functional op, so the graph shows weight -> quantizer -> op explicitly).
WEIGHTED_MODULES: dict[type[nn.Module], str] = {
    nn.Linear: "linear", nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d",
    nn.Embedding: "embedding",
}
aten = torch.ops.aten
# Ops that consume a weight, torch-level (symbolic graphs) and aten-level (export graphs):
# target -> (index of the weight argument, the weight's output-channel axis as stored).
# Linear/conv/embedding weights are [out, ...]; `x @ W`, mm and addmm take W as [in, out].
_WEIGHTED: dict[object, tuple[int, int]] = {
    F.linear: (1, 0), F.conv1d: (1, 0), F.conv2d: (1, 0), F.conv3d: (1, 0),
    torch.conv1d: (1, 0), torch.conv2d: (1, 0), torch.conv3d: (1, 0), F.embedding: (1, 0),
    aten.linear.default: (1, 0), aten.conv1d.default: (1, 0), aten.conv2d.default: (1, 0),
    aten.conv3d.default: (1, 0), aten.embedding.default: (0, 0),
    torch.matmul: (1, -1), operator.matmul: (1, -1), torch.mm: (1, 1), torch.addmm: (2, 1),
    aten.matmul.default: (1, -1), aten.mm.default: (1, 1), aten.addmm.default: (2, 1),
}
# A transposed 2-D parameter (`W.t()`) feeding mm/matmul: quantize W itself, channel axis 0.
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default, torch.t,
               torch.transpose}
INTERNAL_MODULES = ("_guards_fn",)  # export's input guard: never a quantization target


@dataclass(frozen=True)
class WeightUse:
    """Where a weighted op takes its parameter from."""

    param: Node  # the get_attr node of the parameter
    consumer: Node  # the node reading ``param``: the op, or a transpose feeding it
    axis: int  # the parameter's output-channel axis


@dataclass(frozen=True)
class Owner:
    """A module owning a node: its qualified name and class."""

    name: str
    cls_name: str
    cls_path: str


@dataclass(frozen=True)
class NodeQScheme:
    """``node.meta["qcompile.qscheme"]``: the rule that selected a node and its schemes."""

    rule: int
    skip: bool
    weight: Scheme | None
    activation: Scheme | None
    matched: str  # the owner (qualified name) or op that satisfied the rule

    def describe(self) -> str:
        if self.skip:
            return f"rule={self.rule} skip"
        parts = [f"rule={self.rule}"]
        for role, s in (("w", self.weight), ("a", self.activation)):
            if s is not None:
                parts.append(f"{role}={s.dtype}/{s.granularity}/{'sym' if s.symmetric else 'asym'}")
        return " ".join(parts)


def _owner(name: str, cls: object) -> Owner:
    if isinstance(cls, type):
        return Owner(name, cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    path = str(cls)  # torch.export records the class as a dotted string
    return Owner(name, path.rsplit(".", 1)[-1], path)




def owners(node: Node, gm: GraphModule) -> tuple[Owner, ...]:
    """Modules owning ``node``, innermost first; the root model (name ``""``) last."""
    stack = node.meta.get(NN_MODULE_STACK) or {}
    found = [_owner(name, cls) for name, cls in stack.values() if name]
    if node.op == "call_module" and not any(o.name == node.target for o in found):
        found.append(_owner(str(node.target), type(gm.get_submodule(str(node.target)))))
    root = gm.meta.get(ROOT_CLASS_KEY)
    if root is not None:
        found.insert(0, _owner("", root))
    return tuple(reversed(found))


def innermost_owner(node: Node) -> str:
    """The qualified name of the innermost module owning ``node`` ("" for the root)."""
    stack = node.meta.get(NN_MODULE_STACK) or {}
    return next(reversed(stack.values()))[0] if stack else ""


def layer_of(node: Node) -> str | None:
    """The layer a node computes, under either front end: a re-expressed module call
    (``qcompile.module``), a ``call_module`` target, else its innermost owning module;
    None when only the root owns it."""
    module = node.meta.get(MODULE_KEY) or (
        str(node.target) if node.op == "call_module" else None)
    return module or innermost_owner(node) or None


def op_name(node: Node) -> str | None:
    """The normalised op a ``call_function`` / ``call_method`` node performs."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        t = node.target
        packet = getattr(t, "overloadpacket", None)  # aten.add.Tensor -> add
        name = getattr(packet or t, "__name__", str(t)).split(".")[-1]
    else:
        return None
    name = name.strip("_")
    return _ALIASES.get(name, name)


def weighted_module_op(gm: GraphModule, node: Node) -> str | None:
    """For a ``call_module`` node on Linear/Conv/Embedding with the stock forward: the
    functional op it computes, else None."""
    if node.op != "call_module":
        return None
    return module_op(gm.get_submodule(str(node.target)))


def module_op(m: nn.Module) -> str | None:
    """The functional op a Linear/Conv/Embedding with the stock forward computes, else
    None (see ``weighted_module_op``)."""
    for cls, op in WEIGHTED_MODULES.items():
        if type(m).forward is cls.forward and isinstance(m, cls):
            return op
    return None


def _is_transpose(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in ("t", "T")
    if node.op != "call_function" or node.target not in _TRANSPOSES:
        return False
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target in (aten.transpose.int, torch.transpose):
        return sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]
    return True


def weight_use(node: Node) -> WeightUse | None:
    """For a call consuming a parameter as its weight (linear, conv, embedding, or the
    right-hand side of matmul/mm/addmm): the parameter node and its channel axis."""
    if node.op != "call_function":
        return None
    try:
        spec = _WEIGHTED.get(node.target)
    except TypeError:  # unhashable target
        return None
    if spec is None:
        return None
    index, axis = spec
    w = node.args[index] if len(node.args) > index else node.kwargs.get("weight")
    if not isinstance(w, Node):
        return None
    if w.op == "get_attr":
        return WeightUse(w, node, axis)
    if _is_transpose(w) and isinstance(w.args[0], Node) and w.args[0].op == "get_attr":
        return WeightUse(w.args[0], w, 0)
    return None


def is_weighted_call(node: Node) -> bool:
    """A call whose weight is a graph attribute (see ``weight_use``)."""
    return weight_use(node) is not None


def module_output(node: Node) -> bool:
    """Whether ``node`` is a value a (non-root) module returns: it is owned by a module call
    and used outside that call. The same notion under both front ends: a leaf module's
    ``call_module`` node, or the last op of a module's region in an export graph."""
    if node.op == "call_module":
        return str(node.target) not in INTERNAL_MODULES
    if node.op not in ("call_function", "call_method"):
        return False
    stack = node.meta.get(NN_MODULE_STACK) or {}
    key = next(reversed(stack)) if stack else None
    if key is None or not stack[key][0]:  # owned by the root model: what the model returns
        return any(u.op == "output" for u in node.users)
    return any(u.op == "output" or key not in (u.meta.get(NN_MODULE_STACK) or {})
               for u in node.users)


@functools.lru_cache(maxsize=256)
def _globs(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One regex for "any of these fnmatch patterns" (``fnmatch.fnmatchcase`` semantics)."""
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def _glob_any(patterns: list[str], *values: str) -> bool:
    rx = _globs(tuple(patterns))
    return any(rx.match(v) is not None for v in values)


def match_node(match: Match, node: Node, node_owners: tuple[Owner, ...]) -> str | None:
    """What satisfies ``match`` for ``node`` (an owner name or the op), or None.

    ``op`` must hold for the node itself; ``module`` and ``name`` must hold together for
    one owning module.
    """
    if match.op is not None:
        op = op_name(node)
        if op is None or op not in match.op:
            return None
        if match.module is None and match.name is None:
            return op
    for o in node_owners:
        if match.module is not None and not _glob_any(match.module, o.cls_name, o.cls_path):
            continue
        if match.name is not None and not _glob_any(match.name, o.name):
            continue
        return o.name
    return None


def candidate_kinds(node: Node) -> tuple[bool, bool]:
    """(selectable by a rule without ``op``, selectable by a rule with ``op``): without
    ``op``, the values modules return and ops consuming a parameter as weight (a Linear's
    computation under either front end), never shape bookkeeping inside a matched module;
    with ``op``, function and method calls."""
    return (module_output(node) or is_weighted_call(node),
            node.op in ("call_function", "call_method"))


def candidate(gm: GraphModule, node: Node, rule: Rule) -> bool:
    """Whether ``rule`` may select ``node`` (see ``candidate_kinds``)."""
    by_module, by_op = candidate_kinds(node)
    return by_op if rule.match.op is not None else by_module


_SIZE_METHODS = {"size", "dim", "numel", "ndimension", "item", "tolist"}


def is_size_like(node: object) -> bool:
    """Without shapes: values that are certainly Python numbers (``x.size(0) + 1``)."""
    if not isinstance(node, Node):
        return True
    if node.op == "call_method":
        return str(node.target) in _SIZE_METHODS
    if node.op == "call_function":
        if node.target is getattr and node.args[1:] in (("shape",), ("ndim",)):
            return True
        if getattr(node.target, "__module__", None) == "_operator":
            return all(is_size_like(a) for a in (*node.args, *node.kwargs.values()))
    return False
