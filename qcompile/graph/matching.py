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
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.graph.meta import MODULE_KEY, NN_MODULE_STACK, ROOT_CLASS_KEY, TENSOR_META
from qcompile.specs import Match, Rule, Scheme

# Operator spellings that mean the same op for matching (`x + y`, `x += y`, `torch.add`).
_ALIASES = {
    "iadd": "add", "radd": "add", "imul": "mul", "rmul": "mul", "isub": "sub", "rsub": "sub",
    "truediv": "div", "itruediv": "div", "rtruediv": "div", "imatmul": "matmul",
    "rmatmul": "matmul", "concat": "cat", "concatenate": "cat",
    # torch's grouped GEMM under its names, and Hugging Face's CPU fallback for it
    "_grouped_mm": "grouped_mm", "grouped_mm_fallback": "grouped_mm",
}

# Module types whose weight qcompile fake-quantizes (their forward is re-expressed with the
# functional op, so the graph shows weight -> quantizer -> op explicitly).
WEIGHTED_MODULES: dict[type[nn.Module], str] = {
    nn.Linear: "linear", nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d",
    nn.ConvTranspose1d: "conv_transpose1d", nn.ConvTranspose2d: "conv_transpose2d",
    nn.ConvTranspose3d: "conv_transpose3d", nn.Embedding: "embedding",
    nn.EmbeddingBag: "embedding_bag",
}
aten = torch.ops.aten
# Ops that consume a weight, torch-level (symbolic graphs) and aten-level (export graphs):
# target -> (index of the weight argument, the output-channel dim of the weight as the op
# reads it). Linear/conv/embedding weights are [out, ...], a transposed conv's
# [in, out / groups, ...]; `x @ W`, mm, addmm, bmm and grouped_mm take W as [..., in, out].
_WEIGHTED: dict[object, tuple[int, int]] = {
    F.linear: (1, 0), F.conv1d: (1, 0), F.conv2d: (1, 0), F.conv3d: (1, 0),
    torch.conv1d: (1, 0), torch.conv2d: (1, 0), torch.conv3d: (1, 0), F.embedding: (1, 0),
    F.conv_transpose1d: (1, 1), F.conv_transpose2d: (1, 1), F.conv_transpose3d: (1, 1),
    F.embedding_bag: (1, 0),
    aten.linear.default: (1, 0), aten.conv1d.default: (1, 0), aten.conv2d.default: (1, 0),
    aten.conv3d.default: (1, 0), aten.embedding.default: (0, 0),
    aten.conv1d.padding: (1, 0), aten.conv2d.padding: (1, 0), aten.conv3d.padding: (1, 0),
    aten.conv_transpose1d.default: (1, 1), aten.conv_transpose2d.input: (1, 1),
    aten.conv_transpose3d.input: (1, 1), aten.embedding_bag.default: (0, 0),
    aten.embedding_bag.padding_idx: (0, 0), aten._embedding_bag.default: (0, 0),
    torch.matmul: (1, -1), operator.matmul: (1, -1), torch.mm: (1, 1), torch.addmm: (2, 1),
    aten.matmul.default: (1, -1), aten.mm.default: (1, 1), aten.addmm.default: (2, 1),
    torch.bmm: (1, -1), aten.bmm.default: (1, -1),
    torch._grouped_mm: (1, -1), aten._grouped_mm.default: (1, -1),
}
if hasattr(F, "grouped_mm"):  # torch >= 2.9
    _WEIGHTED[F.grouped_mm] = (1, -1)
# Matrix products whose weight may be either operand (`W @ x` reads W's rows as outputs),
# and the rank of the weight each reads (None: any).
_PRODUCTS = {"matmul": None, "mm": 2, "bmm": 3, "grouped_mm": None}
# Ops whose weight may be one expert of a 3-D expert parameter ([experts, out, in]):
# products, and linear on ``W[e]``.
_EXPERT_OPS = {"linear", "matmul", "mm", "addmm", "bmm", "grouped_mm", "einsum"}
INTERNAL_MODULES = ("_guards_fn",)  # export's input guard: never a quantization target


@dataclass(frozen=True)
class WeightUse:
    """Where a weighted op takes its parameter from."""

    param: Node  # the get_attr node of the parameter
    consumer: Node  # the node reading ``param``: the op, or a view feeding it
    axis: int  # the parameter's output-channel axis
    experts: bool = False  # a 3-D [experts, ...] parameter: axis 1 or 2, experts on dim 0


@dataclass(frozen=True)
class Owner:
    """A module owning a node: its qualified name and class; ``bases`` are the names and
    dotted paths of the classes it derives from (``FalconLinear`` -> ``Linear``,
    ``torch.nn.modules.linear.Linear``), so ``module: Linear`` selects subclasses too."""

    name: str
    cls_name: str
    cls_path: str
    bases: tuple[str, ...] = ()


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


def owner_of(name: str, cls: object) -> Owner:
    """The ``Owner`` of module ``name`` of class ``cls`` (a class, or the dotted path
    torch.export records)."""
    if isinstance(cls, type):
        return Owner(name, cls.__name__, f"{cls.__module__}.{cls.__qualname__}",
                     base_names(cls))
    path = str(cls)  # torch.export records the class as a dotted string
    return Owner(name, path.rsplit(".", 1)[-1], path, _bases_of_path(path))


def base_names(cls: type) -> tuple[str, ...]:
    """Names and dotted paths of the ``nn.Module`` subclasses ``cls`` derives from (itself
    and ``nn.Module`` left out)."""
    out: list[str] = []
    for base in cls.__mro__[1:]:
        if base is nn.Module or not (isinstance(base, type) and issubclass(base, nn.Module)):
            continue
        out += [base.__name__, f"{base.__module__}.{base.__qualname__}"]
        if base.__module__.startswith("torch.nn.modules."):  # also as torch.nn.<name>
            out.append(f"torch.nn.{base.__name__}")
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _bases_of_path(path: str) -> tuple[str, ...]:
    """``base_names`` of the class at dotted ``path`` when its module is imported already
    (export records classes by path; nothing is imported for a spec), else none."""
    module, _, qualname = path.rpartition(".")
    obj: object = sys.modules.get(module)
    if obj is None:
        return ()
    obj = getattr(obj, qualname, None)
    return base_names(obj) if isinstance(obj, type) and issubclass(obj, nn.Module) else ()




def owners(node: Node, gm: GraphModule) -> tuple[Owner, ...]:
    """Modules owning ``node``, innermost first; the root model (name ``""``) last."""
    stack = node.meta.get(NN_MODULE_STACK) or {}
    found = [owner_of(name, cls) for name, cls in stack.values() if name]
    if node.op == "call_module" and not any(o.name == node.target for o in found):
        found.append(owner_of(str(node.target), type(gm.get_submodule(str(node.target)))))
    root = gm.meta.get(ROOT_CLASS_KEY)
    if root is not None:
        found.insert(0, owner_of("", root))
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


# Layout views a weight may reach its op through (see ``_view_step``): transposes and
# permutations (``W.t()``, ``W.T``, ``W.mT``, ``transpose``, ``swapaxes``, ``permute``),
# reshapes that keep the input dimension (``view`` / ``reshape``; ``_reshape_step``),
# copies, aliases and dtype casts that keep the layout, and picking experts along dim 0.
_VIEW_TARGETS = {aten.t.default, aten.transpose.int, aten.permute.default, torch.t,
                 torch.transpose, torch.permute, aten.select.int, aten.index.Tensor,
                 operator.getitem, torch.select, aten.numpy_T.default, aten.mT.default,
                 aten.adjoint.default, aten.swapaxes.default,
                 aten.swapdims.default, torch.swapaxes, torch.swapdims, aten.alias.default,
                 aten.detach.default, aten.contiguous.default, aten.clone.default,
                 aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 torch.reshape, getattr, aten._to_copy.default, aten.to.dtype,
                 aten.to.dtype_layout, aten.type_as.default}
_TRANSPOSE_ATTRS = {"T", "mT"}  # ``W.T`` in a symbolic graph: getattr(W, "T")
_RESHAPES = {"view", "reshape", "_unsafe_view"}
# the same layout: copies, aliases and casts (``W.float()``, ``W.to(torch.float32)``)
_SAME_LAYOUT = {"contiguous", "detach", "alias", "clone", "to", "float", "type", "type_as",
                "half", "bfloat16", "double"}


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _view_step(node: Node, ndim: int) -> list[int] | None:
    """For a layout view of one ``ndim``-dim tensor (transpose, permute, picking experts
    along dim 0): which input dim each output dim is. Anything else: None."""
    if (node.op not in ("call_function", "call_method") or not node.args
            or not isinstance(node.args[0], Node)):
        return None
    target, args = node.target, node.args
    name = target if node.op == "call_method" else None
    if node.op == "call_function":
        try:
            if target not in _VIEW_TARGETS:
                return None
        except TypeError:
            return None
    dims = list(range(ndim))
    if target is getattr:  # W.T / W.mT in a symbolic graph
        attr = args[1] if len(args) > 1 else None
        if attr not in _TRANSPOSE_ATTRS:
            return None
        name = attr
    transposes = (torch.transpose, aten.transpose.int, torch.swapaxes, torch.swapdims,
                  aten.swapaxes.default, aten.swapdims.default)
    if name == "mT" or target in (aten.mT.default, aten.adjoint.default):
        name, args = "transpose", (args[0], -2, -1)
    if name in ("t", "T") or target in (torch.t, aten.t.default, aten.numpy_T.default):
        return dims[::-1] if ndim == 2 else None
    if name in _SAME_LAYOUT or target in (aten.contiguous.default, aten.detach.default,
                                          aten.alias.default, aten.clone.default,
                                          aten._to_copy.default, aten.to.dtype,
                                          aten.to.dtype_layout, aten.type_as.default):
        return dims
    if name in _RESHAPES or target in (aten.view.default, aten.reshape.default,
                                       aten._unsafe_view.default, torch.reshape):
        return _reshape_step(node, ndim)
    if name in ("transpose", "swapaxes", "swapdims") or target in transposes:
        a, b = (_int(v) for v in args[1:3]) if len(args) >= 3 else (None, None)
        if a is None or b is None:
            return None
        dims[a % ndim], dims[b % ndim] = dims[b % ndim], dims[a % ndim]
        return dims
    if name == "permute" or target in (torch.permute, aten.permute.default):
        perm = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if len(perm) != ndim or any(_int(p) is None for p in perm):
            return None
        return [dims[p % ndim] for p in perm]
    # experts picked along dim 0: W[e] (one, the dim goes) or W[ids] (several, it stays)
    if name == "select" or target in (torch.select, aten.select.int):
        if len(args) < 3 or _int(args[1]) != 0:
            return None
        return dims[1:]
    if target is operator.getitem or target is aten.index.Tensor:
        index = args[1] if len(args) > 1 else None
        if target is aten.index.Tensor:
            if not isinstance(index, (list, tuple)) or len(index) != 1:
                return None
            index = index[0]
        if _int(index) is not None:
            return dims[1:]
        if isinstance(index, Node):  # a tensor of expert ids
            return dims
    return None


def _shape_of(node: object) -> tuple[int, ...] | None:
    """The recorded shape of a node's value (either front end), or None."""
    if not isinstance(node, Node):
        return None
    shape = getattr(node.meta.get(TENSOR_META), "shape", None)
    if shape is None:
        shape = getattr(node.meta.get("val"), "shape", None)
    try:
        return tuple(int(d) for d in shape) if shape is not None else None
    except TypeError:  # a symbolic size
        return None


def _reshape_step(node: Node, ndim: int) -> list[int] | None:
    """A reshape of a weight (``W.view(...)``, ``reshape``) that keeps its last dimension:
    every leading output dim comes from the leading input dims. The same shape is the
    identity. Needs the recorded shapes (None without them, or for any other reshape)."""
    before, after = _shape_of(node.args[0]), _shape_of(node)
    if before is None or after is None or len(before) != ndim:
        return None
    if before == after:
        return list(range(ndim))
    if not before or not after or before[-1] != after[-1] or ndim != 2:
        return None  # only a 2-D weight's rows split or merged: its input dim kept
    return [0] * (len(after) - 1) + [1]


def _operand(node: Node, index: int) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get("weight" if index else "input",
                           node.kwargs.get("mat2" if index else "self"))


def _einsum_use(node: Node) -> tuple[object, int] | None:
    """``einsum(eq, a, w)`` (or ``einsum(eq, [a, w])``): (the weight operand, its output
    dim): the operand with exactly one letter found only in it and the result (its output
    channel)."""
    eq = node.args[0] if node.args else None
    ops = node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if not isinstance(eq, str) or "->" not in eq or "." in eq or len(ops) != 2:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    for k in (1, 0):
        other = terms[1 - k]
        own = [c for c in terms[k] if c in out and c not in other]
        if len(own) == 1 and isinstance(ops[k], Node):
            return ops[k], terms[k].index(own[0])
    return None


def _operand_rank(node: Node, op: str | None) -> int | None:
    """The rank an op's weight operand has, where the op fixes it."""
    return {"linear": 2, "mm": 2, "addmm": 2, "bmm": 3, "embedding": 2,
            "embedding_bag": 2}.get(op or "")


def _candidates(node: Node) -> list[tuple[object, int]]:
    """(operand, output dim) of each operand that may be the op's weight."""
    op = op_name(node)
    if op == "einsum":
        found = _einsum_use(node)
        return [] if found is None else [found]
    try:
        spec = _WEIGHTED.get(node.target)
    except TypeError:  # unhashable target
        spec = None
    if spec is None and op == "grouped_mm" and node.op == "call_function":
        spec = (1, -1)  # a library's own grouped GEMM op (Hugging Face's CPU fallback)
    if spec is None:
        return []
    found = [(_operand(node, spec[0]), spec[1])]
    if op in _PRODUCTS:  # `W @ x`: the weight on the left reads its rows as outputs
        found.append((_operand(node, 0), -2 if op != "mm" else 0))
    return found


def weight_use(node: Node) -> WeightUse | None:
    """For a call consuming a graph attribute as its weight (linear, conv, transposed conv,
    embedding(-bag), a side of matmul / mm / addmm / bmm / grouped_mm / einsum): the
    attribute's node, the node reading it, and its output-channel axis as stored.

    The weight may reach the op through layout views (``W.t()``, ``transpose``,
    ``permute``) and, for a 3-D expert parameter ``[experts, out, in]`` (or
    ``[experts, in, out]``), through picking experts along dim 0 (``W[e]``, ``W[ids]``,
    ``select``); the axis is then 1 or 2 (``WeightUse.experts``)."""
    if node.op != "call_function":
        return None
    op = op_name(node)
    for w, out_dim in _candidates(node):
        if not isinstance(w, Node):
            continue
        use = _trace_back(node, w, op, out_dim)
        if use is not None:
            return use
    return None


def _trace_back(node: Node, w: Node, op: str | None, out_dim: int) -> WeightUse | None:
    """Follow ``w`` back through layout views to a ``get_attr``; the parameter's output
    axis from the op's ``out_dim`` (see ``weight_use``)."""
    chain: list[Node] = []
    while w.op != "get_attr":
        chain.append(w)
        if len(chain) > 6 or not w.args or not isinstance(w.args[0], Node):
            return None
        w = w.args[0]
    chain.reverse()
    rank = _param_rank(w)
    if rank is None:  # no shapes: the op's own rank, plus one per expert dropped
        base = _operand_rank(node, op) or (3 if op in ("bmm", "einsum") else 2)
        rank = base + sum(1 for c in chain if _drops_dim(c))
    experts = rank == 3 and op in _EXPERT_OPS
    if chain and rank != 2 and not experts:
        return None  # a conv weight (or any other) is read as it is stored
    dims = list(range(rank))  # which parameter dim each dim of the current value is
    for c in chain:
        order = _view_step(c, len(dims))
        if order is None:
            return None
        if len(order) < len(dims) and (not experts or dims[0] != 0):
            return None  # only experts (dim 0 of a 3-D parameter) are picked
        dims = [dims[i] for i in order]
    axis = dims[out_dim % len(dims)]
    if experts and (axis == 0 or (len(dims) == 3 and dims[0] != 0)):
        return None  # the experts stay on dim 0, the output channel is not it
    return WeightUse(w, chain[0] if chain else node, axis, experts)


def _drops_dim(node: Node) -> bool:
    """Whether a view picks one expert (its result has one dim fewer)."""
    if node.op == "call_method":
        return node.target == "select"
    if node.target in (torch.select, aten.select.int):
        return True
    if node.target is operator.getitem:
        return _int(node.args[1] if len(node.args) > 1 else None) is not None
    return False


def _param_rank(node: Node) -> int | None:
    """The rank of a ``get_attr``'s value from the recorded shapes (None without them)."""
    tm = node.meta.get(TENSOR_META)
    shape = getattr(tm, "shape", None)
    if shape is None:
        val = node.meta.get("val")
        shape = getattr(val, "shape", None)
    return len(shape) if shape is not None else None


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
    if match.reads_weight and not is_weighted_call(node):
        return None
    if match.op is not None:
        op = op_name(node)
        if op is None or op not in match.op:
            return None
        if match.module is None and match.name is None:
            return op
    for o in node_owners:
        if match.module is not None and not _glob_any(match.module, o.cls_name, o.cls_path,
                                                      *o.bases):
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


# -- values an op rule leaves in float: what feeds a numerically sensitive op -------------
# The op, and which of its arguments it is sensitive in (None: the first): a small error
# (or a value rounded to 0) there becomes an infinity or a large error after it.
_SENSITIVE = {"rsqrt": None, "sqrt": None, "reciprocal": None, "exp": None, "exp2": None,
              "expm1": None, "log": None, "log2": None, "log10": None, "log1p": None,
              "softmax": None, "log_softmax": None, "safe_softmax": None, "div": 1,
              "var": None, "std": None, "var_mean": None, "std_mean": None}
# ops that hand a value on as it is (a cast, a view): what feeds them feeds their user
_ALONG = {"to", "to_copy", "type", "type_as", "float", "half", "bfloat16", "double",
          "view", "reshape", "unsafe_view", "expand", "contiguous", "clone", "alias",
          "detach", "unsqueeze", "squeeze", "flatten"}


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sensitive_use(node: Node, user: Node) -> str | None:
    """The op ``user`` is, when ``node`` is an argument it is sensitive in."""
    op = op_name(user)
    if op is None:
        return None
    if op == "pow":  # x ** -0.5, x ** 0.5: a root or an inverse
        e = user.args[1] if len(user.args) > 1 else user.kwargs.get("exponent")
        if user.args and user.args[0] is node and _number(e) and (e < 0 or e != int(e)):
            return f"pow {e}"
        return None
    if op not in _SENSITIVE:
        return None
    pos = _SENSITIVE[op]
    args = user.args
    if pos is None:
        return op if args and args[0] is node else None
    return op if len(args) > pos and args[pos] is node else None


def _passes_along(node: Node, user: Node) -> bool:
    """``user`` hands ``node``'s value on as it is: a cast or a view. (Arithmetic does not:
    in ``log(|h| + 1)`` the ``+ 1`` feeds the log, ``h`` is quantized as usual.)"""
    return op_name(user) in _ALONG and bool(user.args) and user.args[0] is node


def sensitive_values(gm: GraphModule) -> dict[Node, str]:
    """Nodes whose value reaches a numerically sensitive op — the divisor of a division,
    ``rsqrt`` / ``sqrt`` / ``reciprocal`` / a negative or fractional power (a
    normalisation's statistics), ``exp`` / ``log``, a softmax's input, ``var`` / ``std`` —
    directly or through casts and views, each with that op's name. An op rule
    (``match.op`` without a module or name) does not quantize their outputs: RMSNorm's
    ``variance + eps`` rounded to 0 is an infinity after ``rsqrt``. One pass over the
    graph, in reverse."""
    found: dict[Node, str] = {}
    for node in reversed(gm.graph.nodes):
        for user in node.users:
            why = _sensitive_use(node, user)
            if why is None and user in found and _passes_along(node, user):
                why = found[user]
            if why is not None:
                found[node] = why
                break
    return found


# -- which parameters the products of a graph read as weights -----------------------------
_PRODUCT_OPS = {"linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "einsum", "grouped_mm"}


def product_weights(gm: GraphModule, *, through: tuple[type, ...] = ()) -> dict[str, Node]:
    """Every tensor attribute of ``gm`` (2-D and up, floating point) that a linear op or a
    matrix product (linear, matmul, mm, addmm, bmm, baddbmm, einsum, grouped_mm) reads as an
    operand, directly or through up to six single-input steps (views, casts, picking
    experts; a ``call_module`` of a class in ``through``, e.g. a quantizer): its target ->
    the product reading it. The weights a spec may mean to quantize, whether or not
    ``weight_use`` recognises how they are read."""
    found: dict[str, Node] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or op_name(node) not in _PRODUCT_OPS:
            continue
        for arg in node.all_input_nodes:
            cur, steps = arg, 0
            while cur.op != "get_attr" and steps < 6:
                inputs = cur.all_input_nodes
                if len(inputs) != 1 or cur.op == "placeholder" or (
                        cur.op == "call_module"
                        and not isinstance(gm.get_submodule(str(cur.target)), through)):
                    break
                cur, steps = inputs[0], steps + 1
            if cur.op != "get_attr":
                continue
            value = _attr_value(gm, str(cur.target))
            if (isinstance(value, torch.Tensor) and value.dim() >= 2
                    and value.is_floating_point()):
                found.setdefault(str(cur.target), node)
    return found


def _attr_value(gm: GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
