"""``plan_tensor_parallel``: which layers are sharded across the ``tp`` mesh dim, and how.

A ``colwise`` Linear holds a slice of the output features; its output is a slice of the
activation, and every op downstream must keep working on that slice (elementwise ops,
reshapes that split the features into heads, attention per head) until a ``rowwise``
Linear reads it, whose partial sums torch reduces across ``tp``. The pass propagates
that slicing through the graph from every candidate ``colwise`` layer, one dim per value,
and keeps a candidate only where its whole region closes: every op on the way keeps the
sliced dim, every Linear reached reads it as its input features. So ``plan: auto`` finds
attention (q/k/v colwise, output rowwise) and MLP (gate/up colwise, down rowwise) pairs
from the graph's structure, not layer names (Llama, Mistral, Qwen2/3, Gemma2, the
attention of Mixtral, the MLPs of Falcon and GPT-NeoX); the Linear whose output is the
graph's (the LM head) is colwise with its logits gathered; an embedding is sharded by
rows (rowwise), unless its weight is tied to another layer. Parameters read inside a
sliced region (Qwen3's per-head norms) are recorded: each rank's gradient is its heads'
part, summed across tp. A mixture of experts stored as one ``[experts, ...]`` parameter per
grouped matmul (transformers' ``grouped_mm``) is sharded by expert (``ExpertsPlan``) when
the ops between its two matmuls act on each routed row alone. Matrices no linear or
embedding op reads (Conv1D weights, experts kept whole) are reported kept whole, with
the reason. The plan, per layer with its
reason, is in the report (``report.tensor_parallel``) and in ``gm.meta`` for
``qc.distributed.wrap``, which applies it with torch's ``parallelize_module``.

Norm modules an explicit plan names ``sequence`` run on each rank's tokens
(``SequencePlan``): the pass follows each rowwise layer's and the embedding's output
through ops acting on each token alone (elementwise ops, reductions and layer norms over
the features, quantizers) to the colwise layers reading it, and refuses anything else
by node. A plan naming only norms plans the layers as ``auto`` does.

Shapes written into the graph (``view(2, 8, 4, 16)`` as ``torch.export`` records it)
count whole heads; the pass records where a region's shape argument counts the sliced
dim, and ``shard_tensor_parallel`` divides it by the tp size at wrap time.

What cannot hold is an error naming the layer and the fix: a head count, feature count
or vocabulary not divisible by ``size``, a quantizer group or block that would straddle
a shard, an activation quantizer inside a region whose statistics cannot be combined
across ranks, an explicit plan whose regions do not close.

Example:
    >>> import torch, qcompile as qc
    >>> class MLP(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
    ...     def forward(self, x):
    ...         return x + self.down(torch.relu(self.up(x)))
    >>> spec = {"quant": {"mode": "none"}, "tensor_parallel": {"size": 2}}
    >>> gm = qc.qcompile(MLP(), spec, example_inputs=(torch.randn(2, 8),))
    >>> [(r.layer, r.style) for r in qc.report(gm).tensor_parallel]
    [('up', 'colwise'), ('down', 'rowwise')]
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import TensorMetadata

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.meta import ADAPTERS_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.frozen import FrozenWeight

TP_PLAN_KEY = "qcompile.tp_plan"

# ops that act on each element (with broadcasting): the sliced dim passes through
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp",
    "to", "_to_copy", "type_as", "contiguous", "clone", "dropout", "alias", "pow", "where",
    "masked_fill", "erf", "softplus", "float", "half", "bfloat16", "abs", "square", "sqrt",
    "rsqrt", "mul_", "add_", "clamp", "detach", "native_dropout", "gelu_tanh", "log",
    "sin", "cos", "reciprocal", "true_divide", "truediv", "scalar_tensor", "identity",
    "_assert_tensor_metadata", "lift_fresh_copy", "clamp_min", "clamp_max", "hardtanh",
})
# modules that act on each element: the sliced dim passes through
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Dropout, nn.Identity, nn.Tanh,
                        nn.Sigmoid, nn.LeakyReLU, nn.Softplus, nn.Mish, nn.Hardtanh, nn.ReLU6)
_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "expand"})
_LINEAR = frozenset({"linear"})
# ops returning a tuple of pieces of their input along one dim (then read by getitem)
_SPLITS = frozenset({"chunk", "split", "split_with_sizes", "unbind", "tensor_split"})
_EMBEDDING = frozenset({"embedding"})


@dataclass(frozen=True)
class LayerPlan:
    """One layer's placement: ``style`` is colwise | rowwise | replicate; ``gather``:
    a colwise layer whose output is gathered (the LM head); ``kind``: linear | embedding."""

    layer: str
    kind: str
    style: str
    reason: str
    gather: bool = False


@dataclass(frozen=True)
class TensorParallelPlan:
    """The plan ``wrap`` applies: layers by name, and the shape arguments inside sharded
    regions that count the sliced dim (node name, argument path, global size)."""

    size: int
    layers: tuple[LayerPlan, ...]
    shape_args: tuple[tuple[str, tuple[int, ...], int], ...]
    region_quantizers: tuple[str, ...]
    # parameters read inside sharded regions, and the nodes there reading them
    region_params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # every node whose value is a slice on each rank (a pipeline cut must not cross one)
    region_nodes: frozenset[str] = frozenset()
    # activation quantizers computing per forward on a value sliced along its last dim
    # (per token, dynamic, blocks), with that dim counted from the end: ``wrap`` hands them
    # the slice as a DTensor, so that a range over the features is reduced across tp
    sliced_quantizers: tuple[tuple[str, int], ...] = ()
    # mixtures of experts sharded by expert (``ExpertsPlan``)
    experts: tuple[ExpertsPlan, ...] = ()
    # sequence parallelism between the blocks (``SequencePlan``), where the plan names norms
    sequence: SequencePlan | None = None

    def sharded(self) -> dict[str, LayerPlan]:
        """The Linear and embedding layers torch's styles shard, by name."""
        return {p.layer: p for p in self.layers if p.style in ("colwise", "rowwise")}


@dataclass(frozen=True)
class ExpertsPlan:
    """A mixture of experts whose weights are one ``[experts, ...]`` parameter per matmul
    (transformers' ``grouped_mm``), sharded across tp.

    By expert (``split == 0``): each rank holds ``experts / size`` of them (``Shard(0)``).
    ``first`` (the gate/up matmul) reads every token and computes the rows routed to this
    rank's experts; ``second`` (down) computes those rows' outputs, put back among the
    others' zeros and summed across tp. ``region``: the quantizers between them, which see
    this rank's rows (their ranges reduced across tp).

    Within each expert (``split >= 1``): every rank holds every expert's slice of the
    intermediate features, as a colwise / rowwise MLP pair: ``first``'s ``[experts, out,
    in]`` weight by its output rows (``_StridedShard(1, split)``: the first ``1/split`` of
    the rows (gate) and each next one (up) sliced alike, so ``chunk(split)`` of the
    product still cuts gate from up), ``second``'s by its input features (``Shard(2)``).
    Every rank computes every routed row on its features; the down products are partial
    sums, summed across tp. ``region``: quantizers on the sliced features (their ranges
    over the features reduced across tp). ``reshapes``: the gate/up weight's reshape
    after its quantizer, which reads this rank's rows (node, argument path, global
    size), as a ``shape_args`` entry."""

    params: tuple[str, str]
    first: str
    second: str
    experts: int
    region: tuple[str, ...] = ()
    # the nodes holding this rank's rows only (a pipeline cut must not cross one)
    rows: tuple[str, ...] = ()
    split: int = 0
    reshapes: tuple[tuple[str, tuple[int, ...], int], ...] = ()

    @property
    def within(self) -> bool:
        return self.split > 0


@dataclass(frozen=True)
class SequencePlan:
    """Sequence parallelism, torchtitan's ``SequenceParallel`` on a graph whose norms are
    ops: between the blocks, the activations (the residual stream and the norms the plan
    names ``sequence``) hold each rank's tokens, ``Shard(dim)`` along the sequence. The
    layers in ``enter`` (rowwise, and the embedding) hand their partial sums over
    reduce-scattered to each rank's tokens instead of all-reduced (torch's styles'
    ``output_layouts``); the colwise layers in ``leave`` read them all-gathered, once per
    value (torch's ``PrepareModuleInput``). The same bytes cross as without it; the norms,
    the residual adds and what autograd keeps of them are a rank's share."""

    dim: int
    norms: tuple[str, ...]
    enter: tuple[str, ...]
    leave: tuple[str, ...]
    nodes: frozenset[str] = frozenset()
    # values whole on every rank that a named norm reads first (a tied embedding kept
    # whole): each rank's tokens are cut from them (no communication)
    scatter: tuple[str, ...] = ()
    # layers kept whole that read each rank's tokens (a tied LM head): they read them
    # all-gathered, and compute on every rank as one process does
    whole_readers: tuple[str, ...] = ()
    # values computed from parameters (Gemma's ``1 + weight``) that ops on each rank's
    # tokens read, with those ops: their gradients are summed across tp
    summed: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass
class _Layer:
    name: str
    kind: str
    node: Node
    weight: str  # qualified parameter name
    out_features: int
    in_features: int
    quantizers: dict[str, str] = field(default_factory=dict)  # role -> quantizer name
    # a base held quantized (``FrozenWeight``, QLoRA): ``weight`` names its storage module
    frozen: bool = False
    # an adapter's lora_A / lora_B: the adapted layer whose placement it follows
    follows: str | None = None


@dataclass
class _Fail(Exception):
    node: str
    why: str
    hard: bool = False  # a size that does not divide: an error, never a silent replicate
    sources: frozenset[str] = frozenset()  # the colwise candidates whose slice got there


def _op(n: Node) -> str:
    t = n.target
    if n.op == "call_method":
        return str(t)
    if n.op != "call_function":
        return ""
    packet = getattr(t, "overloadpacket", None)
    name = getattr(packet or t, "__name__", str(t))
    return name.lstrip("_") if name in ("__and__", "__or__") else name


def _shape(n: Any) -> tuple[int, ...] | None:
    if not isinstance(n, Node):
        return None
    tm = n.meta.get(TENSOR_META)
    return tuple(int(s) for s in tm.shape) if isinstance(tm, TensorMetadata) else None


def _param_of(gm: GraphModule, n: Any) -> tuple[str, str | None] | None:
    """``(parameter name, its weight quantizer)`` where ``n`` reads a parameter directly or
    through its own quantizer (``L.weight_fake_quant(L.weight)``)."""
    fq = None
    if isinstance(n, Node) and n.op == "call_module" and isinstance(
            gm.get_submodule(str(n.target)), FakeQuantize) and n.args:
        fq, n = str(n.target), n.args[0]
    if isinstance(n, Node) and n.op == "get_attr":
        return str(n.target), fq
    return None


def find_layers(gm: GraphModule) -> dict[Node, _Layer]:
    """The Linear and embedding layers of ``gm`` that tensor parallelism can shard: a
    ``linear`` or ``embedding`` op reading a parameter of its own (possibly through its
    weight quantizer) or a frozen base's storage (``<layer>.weight_frozen()``), or a call
    of an ``nn.Linear`` / ``nn.Embedding`` (an adapter's ``lora_A`` / ``lora_B`` follow
    their layer)."""
    adapted = set(gm.meta.get(ADAPTERS_KEY) or {})
    found: dict[Node, _Layer] = {}
    for n in gm.graph.nodes:
        op = _op(n)
        if n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            if type(m) in (nn.Linear, nn.Embedding):
                kind = "linear" if isinstance(m, nn.Linear) else "embedding"
                w = m.weight  # an embedding's "input features" are its vocabulary rows
                rows, cols = (w.shape[0], w.shape[1]) if kind == "linear" else (w.shape[1],
                                                                                 w.shape[0])
                owner, _, part = str(n.target).rpartition(".")
                follows = owner if part in ("lora_A", "lora_B") and owner in adapted else None
                found[n] = _Layer(str(n.target), kind, n, f"{n.target}.weight", rows, cols,
                                  follows=follows)
            continue
        if op in _LINEAR and len(n.args) >= 2:
            w_node = n.args[1]
            if isinstance(w_node, Node) and w_node.op == "call_module" and str(
                    w_node.target).endswith(".weight_frozen") and isinstance(
                    fw := gm.get_submodule(str(w_node.target)), FrozenWeight):
                found[n] = _Layer(str(w_node.target)[: -len(".weight_frozen")], "linear", n,
                                  str(w_node.target), fw.rows, fw.cols, frozen=True)
                continue
            read = _param_of(gm, n.args[1])
            if read is None or not read[0].endswith(".weight"):
                continue
            w = gm.get_parameter(read[0]) if _is_param(gm, read[0]) else None
            if w is None or w.dim() != 2:
                continue
            layer = _Layer(read[0][: -len(".weight")], "linear", n, read[0], w.shape[0],
                           w.shape[1])
            if read[1]:
                layer.quantizers["weight"] = read[1]
            x = n.args[0]
            if isinstance(x, Node) and x.op == "call_module" and str(x.target) == (
                    f"{layer.name}.input_fake_quant") and len(x.users) == 1:
                layer.quantizers["input"] = str(x.target)
            found[n] = layer
        elif op in _EMBEDDING and len(n.args) >= 2:
            # aten.embedding(weight, ids) / F.embedding(ids, weight)
            idx = 0 if n.op == "call_function" and "aten" in str(n.target) else 1
            read = _param_of(gm, n.args[idx])
            if read is None or read[1] is not None or not _is_param(gm, read[0]):
                continue
            w = gm.get_parameter(read[0])
            if w.dim() == 2 and read[0].endswith(".weight"):
                found[n] = _Layer(read[0][: -len(".weight")], "embedding", n, read[0],
                                  w.shape[1], w.shape[0])
    return found


def _is_param(gm: GraphModule, name: str) -> bool:
    try:
        gm.get_parameter(name)
        return True
    except AttributeError:
        return False


# -- propagation ------------------------------------------------------------------------
@dataclass
class _State:
    dim: int
    sources: frozenset[str]


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _view_dim(src: tuple[int, ...], dst: tuple[int, ...], d: int, size: int,
              where: str) -> int:
    """The dim of ``dst`` holding the slice of ``src``'s dim ``d`` after a reshape: the
    leading dim (of size > 1) of the group ``d`` falls in; ``d`` must lead its group."""
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        while a != b:
            if a < b:
                i += 1
                gi.append(i)
                a *= src[i] if i < len(src) else 1
            else:
                j += 1
                gj.append(j)
                b *= dst[j] if j < len(dst) else 1
        if d in gi:
            lead_src = [k for k in gi if k < len(src) and src[k] > 1]
            lead_dst = [k for k in gj if k < len(dst) and dst[k] > 1]
            if not lead_src or lead_src[0] != d or not lead_dst:
                raise _Fail(where, "a reshape merges the sliced dim behind another")
            out = lead_dst[0]
            if dst[out] % size:
                raise _Fail(where, f"a reshape splits the sliced dim into {dst[out]} (heads "
                            f"or groups), not divisible by tensor_parallel.size {size}",
                            hard=True)
            return out
        i, j = gi[-1] + 1, gj[-1] + 1
    raise _Fail(where, "a reshape loses the sliced dim")


class _Propagation:
    def __init__(self, gm: GraphModule, layers: dict[Node, _Layer], colwise: set[str],
                 size: int, gathered: set[str]) -> None:
        self.gm, self.layers, self.colwise, self.size = gm, layers, colwise, size
        self.gathered = gathered  # colwise layers whose output is gathered whole
        self.state: dict[Node, _State] = {}
        self.rowwise: dict[str, frozenset[str]] = {}
        self.shape_args: list[tuple[str, tuple[int, ...], int]] = []
        self.quantizers: set[str] = set()
        # each one's input: (sliced dim counted from the end, that dim's size)
        self.quantizer_dims: dict[str, tuple[int, int]] = {}
        self.outputs: set[str] = set()  # colwise layers whose slice reaches the output
        # parameters read inside sharded regions (per-head norms' weights), with the region
        # nodes reading them: each rank's gradient is its heads' part, summed across tp
        self.region_params: dict[str, set[str]] = {}
        self.layer_inputs = {q for layer in layers.values()
                             if (q := layer.quantizers.get("input")) is not None}

    def run(self) -> list[_Fail]:
        """One pass over the graph; every place a slice cannot go (the value is then taken
        as whole, so that one pass finds them all)."""
        failures: list[_Fail] = []
        for n in self.gm.graph.nodes:
            sharded = [(a, self.state[a]) for a in _tensor_args(n) if a in self.state]
            sources = frozenset().union(*(s.sources for _, s in sharded))
            try:
                layer = self.layers.get(n)
                if layer is not None and layer.kind == "linear":
                    self._linear(n, layer)
                    continue
                if not sharded:
                    continue
                if n.op == "output":
                    if len(sources) != 1:
                        raise _Fail(n.name, "the sliced activation is an output of the graph")
                    self.outputs |= sources  # the LM head: its logits are gathered
                    continue
                for a in _tensor_args(n):
                    if a.op == "get_attr" and a not in self.state and _is_param(
                            self.gm, str(a.target)):
                        self.region_params.setdefault(str(a.target), set()).add(n.name)
                self.state[n] = self._through(n, sharded)
            except _Fail as f:
                failures.append(_Fail(f.node, f.why, f.hard, f.sources or sources))
        return failures

    def _linear(self, n: Node, layer: _Layer) -> None:
        x = n.args[0]
        st = self.state.get(x) if isinstance(x, Node) else None
        if layer.follows is not None and layer.name.endswith(".lora_B"):
            # B reads A's rank-r output (whole on every rank); its output joins its layer's:
            # sliced as the layer's when that one is colwise (B colwise with it)
            if st is not None:
                raise _Fail(n.name, f"{layer.name} reads a sliced value", sources=st.sources)
            if layer.follows in self.colwise and layer.follows not in self.gathered:
                out = _shape(n)
                if out is not None:
                    self.state[n] = _State(len(out) - 1, frozenset({layer.follows}))
            return
        if st is not None:
            rank = len(_shape(x) or ())
            if st.dim != rank - 1:
                raise _Fail(n.name, f"{layer.name} reads the sliced activation along "
                            "another dim than its input features", sources=st.sources)
            self.rowwise[layer.name] = st.sources
            return
        if layer.name in self.colwise and layer.name not in self.gathered:
            out = _shape(n)
            if out is not None:
                self.state[n] = _State(len(out) - 1, frozenset({layer.name}))

    def _through(self, n: Node, sharded: list) -> _State:
        op = _op(n)
        out = _shape(n)
        where = f"{n.name} ({op or n.target})"
        if n.op == "call_module":
            m = self.gm.get_submodule(str(n.target))
            if isinstance(m, FakeQuantize):
                if str(n.target) not in self.layer_inputs:  # those run inside their layer
                    self.quantizers.add(str(n.target))
                    a, st = sharded[0]
                    shape = _shape(a) or ()
                    if shape:
                        self.quantizer_dims[str(n.target)] = (st.dim - len(shape),
                                                              shape[st.dim])
                return sharded[0][1]
            if isinstance(m, _ELEMENTWISE_MODULES):
                return sharded[0][1]
            raise _Fail(where, f"module {type(m).__name__} is not known to keep the slice")
        if op in _SPLITS:  # a tuple of pieces along one dim (q, k and v of a fused layer)
            a0, s0 = sharded[0]
            rank = len(_shape(a0) or ())
            dim = n.args[1 if op == "unbind" else 2] if len(n.args) > (
                1 if op == "unbind" else 2) else n.kwargs.get("dim", 0)
            dim = _norm(int(dim), rank)
            if dim == s0.dim:
                raise _Fail(where, f"{op} along the sliced dim")
            return _State(s0.dim - (op == "unbind" and dim < s0.dim), s0.sources)
        if op == "getitem" and isinstance(n.args[0], Node) and _op(n.args[0]) in _SPLITS:
            return sharded[0][1]  # one piece: sliced as the tuple's
        if out is None:
            if op in ("_assert_tensor_metadata",):
                return sharded[0][1]
            raise _Fail(where, "no shape recorded")
        rank = len(out)
        sources = frozenset().union(*(s.sources for _, s in sharded))
        a0, s0 = sharded[0]
        src = _shape(a0) or ()
        if op in _ELEMENTWISE:
            dim = rank - (len(src) - s0.dim)
            for a in _tensor_args(n):
                shp = _shape(a)
                if shp is None:
                    continue
                k = len(shp) - (rank - dim)
                st = self.state.get(a)
                if st is not None:
                    if st.dim != k:
                        raise _Fail(where, "two sliced values meet along different dims")
                elif k >= 0 and shp[k] != 1:
                    raise _Fail(where, "a sliced value meets a whole one of the same size")
            return _State(dim, sources)
        args = n.args
        if op in ("transpose", "swapaxes"):
            i, j = (_norm(int(v), len(src)) for v in args[1:3])
            d = j if s0.dim == i else i if s0.dim == j else s0.dim
            return _State(d, sources)
        if op == "permute":
            perm = args[1] if isinstance(args[1], (list, tuple)) else args[1:]
            perm = [_norm(int(p), len(src)) for p in perm]
            return _State(perm.index(s0.dim), sources)
        if op == "unsqueeze":
            k = _norm(int(args[1]), rank)
            return _State(s0.dim + (k <= s0.dim), sources)
        if op in _VIEWS:
            if op == "expand":
                d = s0.dim + rank - len(src)
            else:
                d = _view_dim(tuple(src), tuple(out), s0.dim, self.size, where)
            sizes = args[1] if isinstance(args[1], (list, tuple)) else args[1:]
            path = (1, d) if isinstance(args[1], (list, tuple)) else (1 + d,)
            v = sizes[d] if d < len(sizes) else -1
            if isinstance(v, int) and v != -1:
                self.shape_args.append((n.name, path, out[d]))
            elif not isinstance(v, int):
                raise _Fail(where, "a symbolic size along the sliced dim")
            return _State(d, sources)
        if op in ("slice", "narrow", "select", "softmax", "_softmax", "log_softmax", "cat",
                  "sum", "mean", "amax", "amin"):
            d = args[1] if len(args) > 1 else n.kwargs.get("dim", 0)
            if op == "cat":
                d = args[1] if len(args) > 1 else n.kwargs.get("dim", 0)
                if any(a not in self.state for a in args[0]):
                    raise _Fail(where, "a sliced value is joined with a whole one")
            dims = [d] if isinstance(d, int) else list(d or [])
            if not dims and op in ("sum", "mean", "amax", "amin"):
                raise _Fail(where, "a reduction over every dim")
            dims = [_norm(int(k), len(src)) for k in dims]
            if s0.dim in dims:
                raise _Fail(where, f"{op} along the sliced dim")
            if op in ("select",) or (op in ("sum", "mean", "amax", "amin")
                                     and not _keepdim(n)):
                return _State(s0.dim - sum(k < s0.dim for k in dims), sources)
            return _State(s0.dim, sources)
        if op in ("scaled_dot_product_attention", "matmul", "bmm"):
            batch = rank - 2
            if s0.dim - (len(src) - rank) >= batch:
                raise _Fail(where, "attention or matmul along the sliced dim")
            dim = s0.dim + rank - len(src)
            for a in _tensor_args(n):
                shp = _shape(a)
                if shp is None:
                    continue
                k = dim - (rank - len(shp))
                st = self.state.get(a)
                if st is not None and st.dim != k:
                    raise _Fail(where, "sliced inputs along different dims")
                if st is None and k >= 0 and shp[k] != 1:
                    raise _Fail(where, "a sliced value meets a whole one of the same size")
            return _State(dim, sources)
        raise _Fail(where, "this op is not known to keep the slice")


def _keepdim(n: Node) -> bool:
    return bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))


def _tensor_args(n: Node) -> list[Node]:
    out: list[Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                visit(b)
        elif isinstance(a, dict):
            for b in a.values():
                visit(b)

    visit(n.args)
    visit(n.kwargs)
    return out


# -- the plan -----------------------------------------------------------------------------
def _explicit(spec_plan: dict[str, str], name: str) -> str | None:
    for glob, style in spec_plan.items():
        if fnmatch.fnmatchcase(name, glob):
            return style
    return None


def _tied(gm: GraphModule, layers: dict[Node, _Layer]) -> set[str]:
    """Layers whose weight another layer reads too (tied embeddings: one tensor under two
    names, or one name read by both)."""
    readers: dict[int, set[str]] = {}
    counts: dict[int, int] = {}
    for layer in layers.values():
        if layer.frozen:  # its own storage, never shared
            continue
        key = id(gm.get_parameter(layer.weight))
        readers.setdefault(key, set()).add(layer.name)
        counts[key] = counts.get(key, 0) + 1
    return {n for key, names in readers.items() if counts[key] > 1 for n in names}


def build_plan(gm: GraphModule, size: int, plan: Any) -> TensorParallelPlan:
    """The plan for ``gm`` under ``tensor_parallel: {size, plan}`` (a ``QCompileError``
    naming the layer and the fix where it cannot hold)."""
    layers = find_layers(gm)
    by_name = {layer.name: layer for layer in layers.values()}
    explicit = plan if isinstance(plan, dict) else None
    tied = _tied(gm, layers)
    reasons: dict[str, str] = {}
    sequence_globs = [g for g, style in (explicit or {}).items() if style == "sequence"]
    if explicit is not None and len(sequence_globs) == len(explicit):
        explicit = None  # only norms named: the layers planned as auto plans them
    if explicit is not None:
        for name in by_name:
            if by_name[name].follows is not None:
                continue  # an adapter is placed with its layer, whatever the globs say
            style = _explicit(explicit, name)
            if style == "sequence":
                raise QCompileError(
                    f"tensor_parallel.plan: {name} is a {by_name[name].kind} layer, planned "
                    "sequence; sequence names the norms between the blocks",
                    fix="give sequence to the norms' module names (e.g. "
                    "'*.input_layernorm', '*.post_attention_layernorm', 'model.norm') and "
                    "colwise, rowwise or replicate to layers")
        experts = _expert_params(gm)
        unknown = [g for g in explicit if explicit[g] != "sequence"
                   and not any(fnmatch.fnmatchcase(n, g) for n in by_name
                               if by_name[n].follows is None)
                   and not any(fnmatch.fnmatchcase(n, g) for n in experts)]
        if unknown:
            raise QCompileError(
                f"tensor_parallel.plan: {unknown[0]!r} matches no Linear or embedding layer "
                f"of the graph (layers: {', '.join(sorted(by_name)[:8])}...)",
                fix="give a glob matching layer names, e.g. '*.q_proj'")
        colwise = {n for n in by_name if _explicit(explicit, n) == "colwise"
                   and by_name[n].kind == "linear" and by_name[n].follows is None}
    else:
        colwise = {n for n, layer in by_name.items()
                   if layer.kind == "linear" and n not in tied and layer.follows is None}
    # drop candidates whose regions do not close, until every one does (each pass finds
    # every failure: a few passes, each linear in the graph)
    gathered: set[str] = set()
    for _ in range(2 * len(by_name) + 2):
        prop = _Propagation(gm, layers, colwise, size, gathered)
        failures = prop.run()
        for f in failures:
            if f.hard or explicit is not None or not f.sources:
                name = sorted(f.sources)[0] if f.sources else "?"
                raise QCompileError(
                    f"tensor_parallel: {name} cannot be sharded {size} ways: at node "
                    f"{f.node}, {f.why}",
                    fix=(f"use a tensor_parallel.size that divides it, or plan: "
                         f"{{{name!r}: replicate}}") if f.hard else
                    "plan the layers whose slices meet together, colwise, with the rowwise "
                    "layers reading them (q/k/v with o_proj, gate/up with down_proj); or "
                    f"{{{name!r}: replicate}}; or plan: auto")
        if failures:
            for f in failures:
                for name in f.sources:
                    reasons.setdefault(name, f"replicated: its slice cannot pass {f.node} "
                                       f"({f.why})")
            colwise -= set().union(*(f.sources for f in failures))
            continue
        if prop.outputs <= gathered:
            break
        # an output layer's logits are gathered whole: what follows it is not sliced
        gathered |= prop.outputs
    rowwise = prop.rowwise
    used = set().union(*rowwise.values()) if rowwise else set()
    out: list[LayerPlan] = []
    styles: dict[str, LayerPlan] = {}
    followers = []
    for layer in by_name.values():  # graph order
        name = layer.name
        if layer.follows is not None:
            followers.append(layer)
            continue
        if name in rowwise:
            style, why = "rowwise", ("reads the slices of " + ", ".join(sorted(rowwise[name]))
                                     + "; partial sums reduced across tp")
        elif name in colwise and name in gathered:
            style, why = "colwise", "its output is the graph's: output features sliced, gathered"
        elif name in colwise and name in used:
            partners = sorted(r for r, s in rowwise.items() if name in s)
            style, why = "colwise", "output features sliced up to " + ", ".join(partners)
        elif layer.kind == "embedding" and name not in tied and (
                explicit is None or _explicit(explicit, name) == "rowwise"):
            style = "rowwise"
            why = "embedding rows (vocabulary or positions) sliced; outputs reduced"
        else:
            style = "replicate"
            why = ("tied to another layer's weight" if name in tied
                   else reasons.get(name, "planned replicate" if explicit
                                    else "no rowwise layer reads its output"))
        if explicit is not None:
            want = _explicit(explicit, name) or "replicate"
            if want != style:
                raise QCompileError(
                    f"tensor_parallel.plan: {name} is planned {want}, but the graph makes it "
                    f"{style} ({why})",
                    fix="plan each colwise layer together with the rowwise layers reading "
                    "its output (e.g. q/k/v colwise with o_proj rowwise), or plan: auto")
        if style != "replicate":
            _check_sizes(gm, layer, style, size)
        styles[name] = LayerPlan(name, layer.kind, style, why,
                                 gather=style == "colwise" and name in gathered)
        out.append(styles[name])
    for layer in followers:  # peft's and torchtitan's layout: A rowwise, or B colwise
        base = styles[layer.follows]
        part = layer.name.rpartition(".")[2]
        if part == "lora_A" and layer.name in rowwise:
            style, why = "rowwise", (f"reads {layer.follows}'s input slice; its rank-r "
                                     "output reduced across tp")
        elif part == "lora_B" and base.style == "colwise":
            style, why = "colwise", f"output features sliced as {layer.follows}'s"
        else:
            style, why = "replicate", (f"whole on every rank ({layer.follows} is "
                                       f"{base.style})")
        if style != "replicate":
            _check_sizes(gm, layer, style, size)
        at = max(i for i, q in enumerate(out)
                 if q.layer == layer.follows or q.layer.startswith(f"{layer.follows}."))
        out.insert(at + 1, LayerPlan(layer.name, layer.kind, style, why,  # after its layer
                                     gather=style == "colwise" and base.gather))
    experts, kept = _experts(gm, size, explicit)
    for e in experts:
        for i, param in enumerate(e.params):
            out.append(LayerPlan(param, "experts", "experts", _experts_reason(e, i, size)))
    planned = {layer.weight for layer in layers.values()} | {
        p for e in experts for p in e.params}
    out += _other_weights(gm, planned, kept)
    sliced = []
    for q in sorted(prop.quantizers):
        if _sliced_quantizer(gm, q, prop.quantizer_dims.get(q), size):
            sliced.append((q, prop.quantizer_dims[q][0]))
        else:
            _check_region_quantizer(gm, q)
    # an expert region's quantizers read this rank's rows: as Shard of the rows, their
    # ranges reduced across tp (per-token ones stay each row's own)
    # (within each expert: a slice of the features, their ranges over them reduced)
    sliced += [(q, -1 if e.within else -2) for e in experts for q in e.region]
    quantizers = set(prop.quantizers)
    params = {k: set(v) for k, v in prop.region_params.items()}
    sequence = None
    if sequence_globs:
        seq = _Sequence(gm, layers, styles, size, set(prop.state))
        sequence = seq.plan(sequence_globs)
        out = [_sequence_reason(p, sequence) for p in out] + [
            LayerPlan(norm, "norm", "sequence", f"runs on each rank's tokens (Shard("
                      f"{sequence.dim}) of the sequence); its weight's gradient summed "
                      "across tp") for norm in sequence.norms]
        for q, how in seq.quantizers.items():
            if how == "step":
                _check_region_quantizer(gm, q)
                quantizers.add(q)
            elif isinstance(how, int):
                sliced.append((q, how))
        for k, v in seq.params.items():
            params.setdefault(k, set()).update(v)
    shape_args = (*prop.shape_args, *(r for e in experts for r in e.reshapes))
    return TensorParallelPlan(size, tuple(out), shape_args,
                              tuple(q for q in sorted(quantizers) if q not in dict(sliced)),
                              tuple((k, tuple(sorted(v))) for k, v in sorted(params.items())),
                              frozenset(n.name for n in prop.state).union(
                                  *(e.rows for e in experts),
                                  sequence.nodes if sequence else ()),
                              tuple(sliced), tuple(experts), sequence)


def _experts_reason(e: ExpertsPlan, i: int, size: int) -> str:
    if not e.within:
        return (f"{e.experts} experts, {e.experts // size} per rank (Shard(0)); each rank "
                "computes the tokens routed to its experts, outputs summed across tp")
    if i == 0:
        pieces = f", each of its {e.split} pieces (gate, up)" if e.split > 1 else ""
        return (f"within each of {e.experts} experts: output rows sliced{pieces} "
                f"(_StridedShard(1, split_factor={e.split}))" if e.split > 1 else
                f"within each of {e.experts} experts: output rows sliced (Shard(1))")
    return (f"within each of {e.experts} experts: input features sliced (Shard(2)); every "
            "rank computes every routed token, partial sums reduced across tp")


# -- sequence parallelism: the activations between the blocks, by tokens --------------------
# reductions over the features (a norm's mean of squares) keep each token's values whole
_TOKEN_REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "var", "var_mean"})
_TOKEN_NORMS = frozenset({"layer_norm", "rms_norm"})  # normalised over the last dims


def _sequence_reason(p: LayerPlan, seq: SequencePlan) -> LayerPlan:
    if p.layer in seq.enter:
        why = f"{p.reason}; output reduce-scattered to each rank's tokens"
    elif p.layer in seq.leave:
        why = f"{p.reason}; input all-gathered from each rank's tokens"
    else:
        return p
    return LayerPlan(p.layer, p.kind, p.style, why, p.gather)


class _Sequence:
    """Which values hold each rank's tokens under sequence parallelism: from the rowwise
    layers' and the embedding's outputs, through ops acting on each token alone, up to the
    colwise layers reading them. Anything else reading them is an error naming the node."""

    def __init__(self, gm: GraphModule, layers: dict[Node, _Layer],
                 styles: dict[str, LayerPlan], size: int, sliced: set[Node]) -> None:
        self.gm, self.layers, self.styles, self.size = gm, layers, styles, size
        self.sliced = sliced  # values of the colwise regions: each rank's features
        self.state: dict[Node, int] = {}  # value -> its sequence dim
        # activation quantizers on those values, and how (``_quantizer_dim``)
        self.quantizers: dict[str, int | str] = {}
        self.params: dict[str, set[str]] = {}  # the norms' weights, with their readers
        self.whole_readers: list[str] = []  # replicated layers' nodes reading the tokens
        self.summed: dict[str, set[str]] = {}  # see SequencePlan.summed

    def _style(self, layer: _Layer) -> str:
        p = self.styles.get(layer.name)
        return p.style if p is not None else "replicate"

    def _fail(self, n: Node, why: str, fix: str | None = None) -> QCompileError:
        return QCompileError(
            f"tensor_parallel.plan: sequence parallelism cannot hold at node {n.name} "
            f"({_op(n) or n.target}): {why}",
            fix=fix or "leave sequence out of the plan (the norms then run whole on every "
            "rank), or plan the layers around that node replicate")

    def plan(self, globs: list[str]) -> SequencePlan:
        if any(layer.follows is not None for layer in self.layers.values()):
            raise QCompileError("tensor_parallel.plan: sequence parallelism with adapters "
                                "(a rowwise layer's LoRA output is whole on every rank)",
                                fix="leave sequence out of the plan")
        enter = [layer for layer in self.layers.values() if self._style(layer) == "rowwise"]
        if not enter:
            raise QCompileError("tensor_parallel.plan: sequence without a rowwise layer or "
                                "embedding: nothing hands over each rank's tokens",
                                fix="plan the blocks' output layers rowwise (o_proj, "
                                "down_proj) and the embedding rowwise")
        for layer in enter:
            shape = _shape(layer.node)
            if shape is None or len(shape) < 2:
                raise self._fail(layer.node, f"{layer.name}'s output has no sequence dim")
            dim = len(shape) - 2
            self._divisible(layer.name, shape[dim])
            self.state[layer.node] = dim
        dims = set(self.state.values())
        if len(dims) != 1:
            a, b = (next(e for e in enter if self.state[e.node] == d) for d in sorted(dims)[:2])
            raise self._fail(b.node, f"{b.name}'s output is {list(_shape(b.node) or ())}, "
                             f"{a.name}'s {list(_shape(a.node) or ())}: the tokens lie along "
                             "different dims (a mixture's experts merge the batch and the "
                             "tokens)")
        dim = dims.pop()
        leave, scatter = self._propagate(globs, dim)
        norms = self._norms(globs, dim)
        return SequencePlan(dim, tuple(norms), tuple(sorted(e.name for e in enter)),
                            tuple(sorted(leave)), frozenset(n.name for n in self.state),
                            tuple(scatter), tuple(self.whole_readers),
                            tuple((k, tuple(sorted(v))) for k, v in self.summed.items()))

    def _propagate(self, globs: list[str], dim: int) -> tuple[set[str], list[str]]:
        leave: set[str] = set()
        scatter: list[str] = []
        for n in self.gm.graph.nodes:
            if n in self.state:
                continue
            ins = [a for a in _tensor_args(n) if a in self.state]
            if not ins:
                whole = self._entering(n, globs, dim)
                if whole is None:
                    continue
                self.state[whole] = dim  # cut to this rank's tokens where it is read
                scatter.append(whole.name)
                ins = [whole]
            layer = self.layers.get(n)
            if layer is not None:
                if self._style(layer) == "colwise" and n.args[0] in self.state:
                    leave.add(layer.name)
                    continue
                if self._style(layer) == "replicate" and layer.kind == "linear" and \
                        layer.follows is None and n.args[0] in self.state and not any(
                            a in self.state for a in _tensor_args(n)[1:]):
                    self.whole_readers.append(n.name)  # reads them all-gathered
                    continue
                raise self._fail(n, f"{layer.name} ({self._style(layer)}) reads each rank's "
                                 "tokens; only colwise layers and layers kept whole gather "
                                 "them back")
            if n.op == "output":
                raise self._fail(n, "each rank's tokens are an output of the graph")
            if n.op == "call_module" and isinstance(self.gm.get_submodule(str(n.target)),
                                                    _ELEMENTWISE_MODULES):
                self.state[n] = self.state[ins[0]]  # dropout, activations: each element
                continue
            if n.op == "call_module" and isinstance(
                    fq := self.gm.get_submodule(str(n.target)), FakeQuantize):
                own = self._own_input_quantizer(n)
                if own is not None:  # run inside its colwise layer, on the gathered input
                    leave.add(own)
                    continue
                self.quantizers[str(n.target)] = self._quantizer_dim(n, fq, ins[0])
                self.state[n] = self.state[ins[0]]
                continue
            self.state[n] = self._through(n, ins)
        return leave, scatter

    def _from_param(self, a: Node, depth: int = 8) -> bool:
        """Whether ``a`` (a value whole on every rank) is computed from a parameter within
        a few ops: its gradient from this rank's tokens is then a part."""
        todo, seen = [(a, 0)], set()
        while todo:
            n, d = todo.pop()
            if n in seen or d > depth:
                continue
            seen.add(n)
            if n.op == "get_attr" and _is_param(self.gm, str(n.target)):
                return True
            todo += [(b, d + 1) for b in _tensor_args(n)]
        return False

    def _entering(self, n: Node, globs: list[str], dim: int) -> Node | None:
        """The value whole on every rank that ``n``, an op of a norm the plan names, reads
        first (Gemma2's embedding, tied to its LM head and kept whole), or None."""
        stack = n.meta.get("nn_module_stack")
        x = n.args[0] if n.op == "call_function" and n.args else None
        if not stack or not isinstance(x, Node) or x.op == "get_attr" or x in self.sliced:
            return None
        path = str(list(stack.values())[-1][0])
        shape = _shape(x)
        if not any(fnmatch.fnmatchcase(path, g) for g in globs) or shape is None or \
                len(shape) != dim + 2:
            return None
        self._divisible(path, shape[dim])
        return x

    def _divisible(self, where: str, tokens: int) -> None:
        if tokens % self.size:
            raise QCompileError(
                f"tensor_parallel.plan: sequence parallelism splits {where}'s {tokens} "
                f"tokens {self.size} ways: not divisible",
                fix=f"example inputs (and batches) with a multiple of {self.size} tokens, or "
                "leave sequence out of the plan")

    def _own_input_quantizer(self, n: Node) -> str | None:
        users = list(n.users)
        layer = self.layers.get(users[0]) if len(users) == 1 else None
        if layer is None or str(n.target) != f"{layer.name}.input_fake_quant" or \
                self._style(layer) != "colwise" or users[0].args[0] is not n:
            return None
        return layer.name

    def _quantizer_dim(self, n: Node, fq: Any, x: Node) -> int | str:
        """How an activation quantizer on each rank's tokens gets one process's qparams:
        ``local`` (a range per token, blocks along the features: each token's own),
        ``step`` (per-tensor statistics, combined across the ranks once a step as data
        parallelism combines them), or the sequence dim counted from the end (a range
        computed in each forward, NVFP4's tensor scale: read as ``Shard`` of the tokens
        and reduced across tp)."""
        if fq.learnable:
            raise self._fail(n, f"{n.target} has a learnable scale on each rank's tokens",
                             fix="learnable: false for that activation, or leave sequence "
                             "out of the plan")
        if fq.granularity == "per_token" or (fq.block_format is not None
                                             and fq.block_format != "nvfp4"):
            return "local"
        if fq.dynamic or fq.block_format == "nvfp4":
            return self.state[x] - len(_shape(x) or ())
        return "step"

    def _through(self, n: Node, ins: list[Node]) -> int:
        op = _op(n)
        out = _shape(n)
        a0 = ins[0]
        src = _shape(a0) or ()
        if op == "_assert_tensor_metadata":
            return self.state[a0]
        if out is None:
            raise self._fail(n, "no shape recorded")
        rank = len(out)
        if op in _ELEMENTWISE:
            dim = rank - (len(src) - self.state[a0])
            for a in _tensor_args(n):
                shp = _shape(a)
                if shp is None:
                    continue
                k = len(shp) - (rank - dim)
                if a in self.state:
                    if self.state[a] != k:
                        raise self._fail(n, "two token-sharded values meet along different "
                                         "dims")
                elif k >= 0 and shp[k] != 1:
                    raise self._fail(n, f"each rank's tokens meet {a.name}, whole on every "
                                     "rank")
                elif a.op == "get_attr" and _is_param(self.gm, str(a.target)):
                    self.params.setdefault(str(a.target), set()).add(n.name)
                elif self._from_param(a):
                    self.summed.setdefault(a.name, set()).add(n.name)
            return dim
        dim = self.state[a0]
        args = n.args
        if op in _TOKEN_NORMS and a0 is args[0]:  # over the last dims: each token alone
            shape = args[1] if len(args) > 1 else n.kwargs.get("normalized_shape", ())
            if dim >= len(src) - len(shape):
                raise self._fail(n, f"{op} across the tokens")
            for a in _tensor_args(n)[1:]:  # its weight and bias: read by every rank
                if a in self.state:
                    raise self._fail(n, f"{op}'s weight is each rank's tokens")
                if a.op == "get_attr" and _is_param(self.gm, str(a.target)):
                    self.params.setdefault(str(a.target), set()).add(n.name)
            return dim
        if op in _TOKEN_REDUCTIONS:
            d = args[1] if len(args) > 1 else n.kwargs.get("dim")
            dims = [d] if isinstance(d, int) else list(d or [])
            dims = [_norm(int(k), len(src)) for k in dims]
            if not dims or dim in dims:
                raise self._fail(n, f"{op} across the tokens")
            return dim if _keepdim(n) else dim - sum(k < dim for k in dims)
        if op == "slice":
            d = _norm(int(args[1] if len(args) > 1 else 0), len(src))
            start = args[2] if len(args) > 2 else 0
            end = args[3] if len(args) > 3 else None
            step = args[4] if len(args) > 4 else 1
            whole = start in (0, None) and (end is None or end >= src[d]) and step == 1
            if d == dim and not whole:
                raise self._fail(n, "a slice of the tokens")
            return dim
        raise self._fail(n, "this op is not known to act on each token alone")

    def _norms(self, globs: list[str], dim: int) -> list[str]:
        """The modules the globs name (from the ops' module stacks); each one's ops on
        activations (``[..., tokens, features]``) must act on each rank's tokens (ops on its
        weight alone, Gemma's ``1 + weight``, are the same on every rank)."""
        found: dict[str, list[Node]] = {}
        for n in self.gm.graph.nodes:
            stack = n.meta.get("nn_module_stack")
            if n.op != "call_function" or not stack or _op(n) == "getattr":
                continue
            path = str(list(stack.values())[-1][0])
            if any(fnmatch.fnmatchcase(path, g) for g in globs):
                found.setdefault(path, []).append(n)
        missing = [g for g in globs if not any(fnmatch.fnmatchcase(p, g) for p in found)]
        if missing:
            raise QCompileError(
                f"tensor_parallel.plan: {missing[0]!r} (sequence) matches no module whose ops "
                "the graph runs", fix="name the norms between the blocks, e.g. "
                "'*.input_layernorm', '*.post_attention_layernorm', 'model.norm'")
        for path, nodes in found.items():
            whole = next((n for n in nodes if n not in self.state and any(
                len(_shape(a) or ()) >= dim + 2 for a in _tensor_args(n))), None)
            if whole is not None:
                raise self._fail(whole, f"the norm {path} computes on values whole on every "
                                 "rank (not between a rowwise and a colwise layer)",
                                 fix="plan sequence only for the norms between the blocks")
        return sorted(found)


# -- mixtures of experts: sharded by expert ------------------------------------------------
_GROUPED_MM = frozenset({"grouped_mm", "_grouped_mm", "grouped_mm_fallback"})
# how a grouped matmul reads its [experts, ...] weight: views, a transpose, a dtype cast
_WEIGHT_PATH = frozenset({"reshape", "view", "_unsafe_view", "transpose", "t", "permute",
                          "contiguous", "to", "_to_copy", "alias"})
# ops on the rows routed to the experts, between the two matmuls: each row on its own
_ROW_OPS = (_ELEMENTWISE - {"where", "masked_fill"}) | {"getitem", "chunk", "split"}


def _expert_weight(gm: GraphModule, n: Any) -> tuple[str, str | None, list[Node]] | None:
    """``(parameter, its quantizer, the path's ops from the parameter on)`` where ``n`` (a
    grouped matmul's weight) reads one ``[experts, ...]`` parameter through views and its
    own quantizer, nothing else."""
    fq, path = None, []
    while isinstance(n, Node) and len(n.users) == 1:
        if n.op == "get_attr":
            name = str(n.target)
            if _is_param(gm, name) and gm.get_parameter(name).dim() == 3:
                return name, fq, path[::-1]
            return None
        if n.op == "call_module" and fq is None and isinstance(
                gm.get_submodule(str(n.target)), FakeQuantize):
            fq = str(n.target)
        elif _op(n) not in _WEIGHT_PATH:
            return None
        else:
            path.append(n)
        n = n.args[0] if n.args else None
    return None


def _read_transposed(gm: GraphModule, param: str, path: list[Node], first: bool
                     ) -> list[tuple[str, tuple[int, ...], int]] | None:
    """Whether ``param`` (``[experts, a, b]``) reaches its grouped matmul as transformers
    has it read: reshaped to ``[experts * a, b]`` for its quantizer and back, then
    ``transpose(-2, -1)`` (the matmul reads ``[experts, b, a]``), or transposed alone.
    Returns, for the gate/up weight (``first``; sliced along ``a``), the shape argument of
    the reshape back, which ``wrap`` counts in this rank's rows (that reshape reads the
    local rows: torch's DTensor cannot reshape the strided rows back); None for any other
    way."""
    e, a, b = gm.get_parameter(param).shape
    flat, transposed, out = False, False, []
    for n in path:
        op = _op(n)
        if op in ("to", "_to_copy", "contiguous", "alias"):
            continue
        if op == "transpose" and not transposed and not flat:
            dims = {d % 3 for d in n.args[1:3] if isinstance(d, int)}
            if dims != {1, 2}:
                return None
            transposed = True
            continue
        if op not in ("reshape", "view", "_unsafe_view") or transposed:
            return None
        packed = isinstance(n.args[1], (list, tuple))
        shape = tuple(n.args[1] if packed else n.args[1:])
        if shape == (e * a, b) and not flat:
            flat = True
        elif shape == (e, a, b) and flat:
            flat = False
            if first:
                out.append((n.name, (1, 1) if packed else (2,), a))
        else:
            return None
    return out if transposed and not flat else None


def _expert_params(gm: GraphModule) -> list[str]:
    """The ``[experts, ...]`` parameters grouped matmuls read (names an explicit plan may
    give colwise / rowwise)."""
    return [w[0] for n in gm.graph.nodes if _op(n) in _GROUPED_MM and len(n.args) >= 3
            for w in [_expert_weight(gm, n.args[1])] if w is not None]


def _row_region(gm: GraphModule, first: Node, second: Node) -> list[Node] | None:
    """The nodes from ``first``'s output to ``second``'s input, when each acts on every
    row alone (chunks along the features, elementwise ops of region values and scalars,
    activation quantizers) and nothing outside reads them; else None."""
    region: list[Node] = []
    todo, seen = [first], {first}
    while todo:  # everything downstream of first, up to second
        n = todo.pop()
        for user in n.users:
            if user is second or user in seen:
                continue
            quantizer = user.op == "call_module" and isinstance(
                gm.get_submodule(str(user.target)), FakeQuantize)
            op = _op(user)
            if not quantizer and op not in _ROW_OPS:
                return None
            if op in ("chunk", "split"):  # along the features, never the rows
                dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
                rank = len(_shape(n) or _shape(first) or ())
                if not isinstance(dim, int) or not (dim == -1 or (rank and dim % rank)):
                    return None
            seen.add(user)
            region.append(user)
            todo.append(user)
    for n in region:  # every tensor a region op reads is a region value (its rows)
        if any(isinstance(a, Node) and a not in seen for a in (*n.args, *n.kwargs.values())):
            return None
    if second.args[0] not in seen or any(isinstance(a, Node) and a in seen
                                         for a in second.args[1:]):
        return None
    return sorted(region, key=_position(first.graph))


def _position(graph: Any) -> Any:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _experts(gm: GraphModule, size: int, explicit: dict[str, str] | None = None
             ) -> tuple[list[ExpertsPlan], dict[str, str]]:
    """The mixtures of experts sharded, and why others stay whole (by param). ``plan:
    auto`` shards by expert where ``size`` divides the experts, else within each expert;
    an explicit plan shards within each expert the mixtures whose gate/up weight it names
    colwise and down weight rowwise."""
    mms = {}
    for n in gm.graph.nodes:
        if _op(n) in _GROUPED_MM and len(n.args) >= 3:
            w = _expert_weight(gm, n.args[1])
            if w is not None:
                mms[n] = w
    plans, why = [], {}
    for second, (p2, q2, path2) in mms.items():
        x = second.args[0]
        first = _upstream(x, mms, second.args[2])
        if first is None:
            continue
        p1, q1, path1 = mms[first]
        e = gm.get_parameter(p1).shape[0]
        region = _row_region(gm, first, second)
        wanted = None if explicit is None else (_explicit(explicit, p1),
                                                _explicit(explicit, p2))
        if wanted is not None and wanted == (None, None):
            why[p1] = why[p2] = "planned replicate"
            continue
        if wanted is not None and wanted != ("colwise", "rowwise"):
            raise QCompileError(
                f"tensor_parallel.plan: the experts {p1} and {p2} are planned {wanted[0]} and "
                f"{wanted[1]}", fix=f"plan {p1!r} colwise and {p2!r} rowwise (each expert "
                "sliced as an MLP pair), or leave both out (kept whole)")
        reason = None
        if region is None:
            reason = ("the ops between its two grouped matmuls do not act on each routed "
                      "row alone")
        elif gm.get_parameter(p2).shape[0] != e:
            reason = "its two matmuls hold different numbers of experts"
        quantizers = [str(n.target) for n in region or () if n.op == "call_module"]
        for q in [q for q in (q1, q2, *quantizers) if q is not None]:
            fq = gm.get_submodule(q)
            if reason is None and (fq.learnable or getattr(fq.observer, "needs_data", False)):
                reason = (f"{q} has a learnable scale or an observer reading whole tensors; "
                          "a sharded expert's quantizers combine min / max ranges")
        for q in quantizers:  # on this rank's rows: a range over all of them, or per row
            fq = gm.get_submodule(q)
            if reason is None and fq.block_format is None and fq.granularity not in (
                    "per_tensor", "per_token"):
                reason = (f"{q} quantizes {fq.granularity} between the two matmuls, where "
                          "each rank holds part of the routed rows' values: per tensor or "
                          "per token only")
        rows = (first.name, *(n.name for n in region or ()))
        if reason is None and e % size == 0 and wanted is None:
            plans.append(ExpertsPlan((p1, p2), first.name, second.name, e, tuple(quantizers),
                                     rows))
            continue
        if reason is None:
            within = _within(gm, (p1, p2), (path1, path2), (q1, q2), first, region or [],
                             size)
            if isinstance(within, str):
                reason = (f"{e} experts, not divisible by tensor_parallel.size {size}, and "
                          f"not sliced within each expert: {within}") if wanted is None \
                    else within
            else:
                split, reshapes = within
                plans.append(ExpertsPlan((p1, p2), first.name, second.name, e,
                                         tuple(quantizers), rows, split, tuple(reshapes)))
                continue
        if wanted is not None:
            raise QCompileError(f"tensor_parallel.plan: the experts {p1} and {p2} cannot be "
                                f"sliced within each expert: {reason}",
                                fix=f"leave {p1!r} and {p2!r} out of the plan (kept whole)")
        why[p1] = why[p2] = reason
    return plans, why


def _within(gm: GraphModule, params: tuple[str, str], paths: tuple[list[Node], list[Node]],
            quantizers: tuple[str | None, str | None], first: Node, region: list[Node],
            size: int) -> tuple[int, list] | str:
    """``(split, shape arguments)`` where a mixture can be sliced within each expert (its
    gate/up weight's output rows, its down weight's input features), else why not."""
    reshapes = []
    for param, path, is_first in zip(params, paths, (True, False)):
        found = _read_transposed(gm, param, path, is_first)
        if found is None:
            return (f"{param} reaches its grouped matmul other than as transformers' "
                    "[experts, out, in] weight read transposed")
        reshapes += found
    chunks = [n for n in region if _op(n) in ("chunk", "split")]
    split = 1
    for n in chunks:
        k = n.args[1]
        up = n.args[0]
        while up is not first and isinstance(up, Node) and up in region:
            if _op(up) in ("chunk", "split", "getitem"):
                return "its gate/up product is cut more than once"
            up = up.args[0]
        if _op(n) != "chunk" or not isinstance(k, int) or (split != 1 and k != split):
            return "its gate/up product is cut into pieces of other sizes than equal chunks"
        split = k
    out = gm.get_parameter(params[0]).shape[1]
    inner = gm.get_parameter(params[1]).shape[2]
    if out % (split * size) or inner % size:
        return (f"its {out // split} intermediate features do not split into "
                f"tensor_parallel.size {size} equal parts")
    for q, across in zip(quantizers, (None, inner)):
        fq = gm.get_submodule(q) if q else None
        block = fq and (fq.group_size if fq.block_format is not None or
                        fq.granularity == "per_group" else None)
        if across and block and (across // size) % block:
            return (f"{q} quantizes in groups of {block} along {across} features, "
                    f"{across // size} per rank: a group would straddle two shards")
    for n in region:
        fq = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        if fq is not None and fq.block_format is not None and (
                out // split // size) % fq.group_size:
            return (f"{n.target} quantizes in blocks of {fq.group_size}, and each rank holds "
                    f"{out // split // size} features: a block would straddle two shards")
    return split, reshapes


def _upstream(n: Any, mms: dict[Node, Any], offs: Any, limit: int = 64) -> Node | None:
    """The grouped matmul of ``mms`` with routing offsets ``offs`` that feeds ``n`` through
    first arguments (a few dozen steps up: linear in the graph), or None."""
    for _ in range(limit):
        if not isinstance(n, Node):
            return None
        if n in mms and n.args[2] is offs:
            return n
        if not n.args:
            return None
        n = n.args[0]
    return None


def _other_weights(gm: GraphModule, planned: set[str], why: dict[str, str] | None = None
                   ) -> list[LayerPlan]:
    """Matrices the graph reads that are not Linear or embedding layers nor sharded
    experts (Conv1D's [in, out] weights; experts ``_experts`` keeps whole, with ``why``):
    kept whole, said so."""
    out, seen = [], set(planned)
    for n in gm.graph.nodes:
        name = str(n.target)
        if n.op != "get_attr" or name in seen or not _is_param(gm, name):
            continue
        seen.add(name)
        if gm.get_parameter(name).dim() < 2:
            continue
        user = next(iter(n.users), None)
        op = (_op(user) or str(user.target)) if user is not None else "nothing"
        if why and name in why:
            out.append(LayerPlan(name, "weight", "replicate", f"experts kept whole on every "
                                 f"rank: {why[name]}"))
            continue
        out.append(LayerPlan(name, "weight", "replicate",
                             f"read by {op}, not by a linear or embedding op: kept whole on "
                             "every rank (tensor parallelism shards Linear and embedding "
                             "layers, and experts under plan: auto)"))
    return out


def _check_sizes(gm: GraphModule, layer: _Layer, style: str, size: int) -> None:
    sliced = layer.out_features if style == "colwise" else layer.in_features
    what = "output features" if style == "colwise" else "input features"
    if layer.kind == "embedding":
        sliced, what = layer.in_features, "vocabulary rows"
    if sliced % size:
        raise QCompileError(
            f"tensor_parallel: {layer.name} ({style}) has {sliced} {what}, not divisible by "
            f"tensor_parallel.size {size}",
            fix=f"use a size dividing {sliced}, or plan: {{{layer.name!r}: replicate}}")
    if layer.frozen and style == "rowwise":  # storage split along its columns
        fw = gm.get_submodule(layer.weight)
        local = layer.in_features // size
        codes = fw.codes.shape[1]
        if (fw.block and local % fw.block) or codes % size:
            raise QCompileError(
                f"tensor_parallel: {layer.name}'s frozen base stores blocks of "
                f"{fw.block or 1} along its {layer.in_features} input features, "
                f"{local} per rank at size {size}: a block would straddle two shards",
                fix=f"a size leaving a multiple of {fw.block or 2} input features per rank, "
                f"or plan: {{{layer.name!r}: replicate}}")
    for role, q in layer.quantizers.items():
        fq = gm.get_submodule(q)
        if fq.learnable:
            raise QCompileError(
                f"tensor_parallel: {q} has a learnable scale; sharded layers take observed "
                "scales", fix=f"learnable: false for {layer.name}, or plan: "
                f"{{{layer.name!r}: replicate}}")
        if getattr(fq.observer, "needs_data", False):
            raise QCompileError(
                f"tensor_parallel: {q} has a {type(fq.observer).__name__} (it reads whole "
                "tensors); a sharded layer's quantizers combine min / max ranges across "
                "ranks", fix=f"observer: minmax or moving_average for {layer.name}, or "
                f"plan: {{{layer.name!r}: replicate}}")
        block = fq.group_size
        if block is None:
            continue
        local = layer.in_features // size
        if (style == "rowwise" or role == "input") and local % block:
            raise QCompileError(
                f"tensor_parallel: {q} quantizes in blocks of {block} along the input "
                f"features, and {layer.name}'s {layer.in_features} split {size} ways are "
                f"{local} per rank: a block would straddle two shards",
                fix=f"a size leaving a multiple of {block} per rank, or plan: "
                f"{{{layer.name!r}: replicate}}")


def _sliced_quantizer(gm: GraphModule, name: str, dim: tuple[int, int] | None,
                     size: int) -> bool:
    """Whether activation quantizer ``name`` computes its qparams in each forward from a
    value sliced along its last dim (a LoRA layer's input, read by the rowwise base and
    its ``lora_A``): per token or dynamic, with a range over the features reduced across
    tp; blocks along the features (whole on each rank, NVFP4's tensor scale reduced).
    A block straddling two shards is refused by name."""
    fq = gm.get_submodule(name)
    if dim is None or dim[0] != -1 or fq.learnable:
        return False
    if fq.block_format is None and not (fq.dynamic or fq.granularity == "per_token"):
        return False
    block = fq.group_size if fq.block_format is not None else None
    if block and (dim[1] // size) % block:
        raise QCompileError(
            f"tensor_parallel: {name} quantizes in blocks of {block} along {dim[1]} "
            f"features, {dim[1] // size} per rank at size {size}: a block would straddle "
            "two shards", fix=f"a size leaving a multiple of {block} per rank, or plan the "
            "layers around it replicate")
    return True


def _check_region_quantizer(gm: GraphModule, name: str) -> None:
    """An activation quantizer reading a slice: its statistics must combine across tp
    ranks as the data-parallel step reduction does (a per-tensor min / max, applied once per
    optimizer step)."""
    fq = gm.get_submodule(name)
    ok = (fq.granularity == "per_tensor" and not fq.dynamic and fq.block_format is None
          and (not fq.observe or fq.deferred()) and not fq.learnable)
    if not ok:
        raise QCompileError(
            f"tensor_parallel: activation quantizer {name} reads a sharded activation, and "
            f"its {fq.granularity} {'dynamic ' if fq.dynamic else ''}scales would differ per "
            "rank", fix="quantize that activation per tensor with observer_update: step, or "
            "plan the layers around it replicate")


@graph_pass(provides=("tp_plan",))
def plan_tensor_parallel(gm: GraphModule, ctx: Context) -> GraphModule:
    """Plan the ``tp`` sharding of every Linear and embedding (``gm.meta``, the report)."""
    tp = ctx.spec.tensor_parallel
    if not ctx.has_shapes:
        raise QCompileError("tensor_parallel plans from the graph's shapes, and it was "
                            "compiled without example inputs",
                            fix="pass example_inputs (or example_kwargs) to qc.qcompile")
    plan = build_plan(gm, tp.size, tp.plan)
    gm.meta[TP_PLAN_KEY] = plan
    ctx.tensor_parallel = list(plan.layers)
    sharded = sum(p.style != "replicate" for p in plan.layers)
    ctx.note(f"tensor parallel {tp.size} ways: {sharded} of {len(plan.layers)} layers "
             f"sharded, {len(plan.shape_args)} shape argument(s) counted per rank")
    return gm


__all__ = ["TP_PLAN_KEY", "ExpertsPlan", "LayerPlan", "SequencePlan", "TensorParallelPlan",
           "build_plan",
           "find_layers", "plan_tensor_parallel"]
