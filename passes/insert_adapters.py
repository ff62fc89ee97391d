"""``insert_adapters``: LoRA adapters next to the Linear layers the spec's ``adapters`` select.

For every linear op that reads a 2-D parameter ``<layer>.weight`` (a stock ``nn.Linear``
call, or ``F.linear`` / ``aten.linear`` after ``insert_quant`` re-expressed it), the first
``adapters`` entry whose ``match`` holds decides (``skip: true`` entries keep their layers
as they are). An adapted layer:

- reads its frozen base as the entry's ``base`` says: ``frozen`` replaces the weight and
  its fake-quantizer by a ``FrozenWeight`` (``<layer>.weight_frozen``: the weight stored
  as its scheme's integers or block codes, dequantized on each call; the float parameter
  leaves the graph), or keeps a float weight, frozen, where no rule gave it a weight
  scheme; ``qat`` keeps the weight behind its fake-quantizer, frozen, with the observer
  off (its scale stays what the weight gave) and no cached copy (``reuse_weight`` off);
- gains ``<layer>.lora_A`` (``Linear(in, r)``, no bias), ``<layer>.lora_B``
  (``Linear(r, out)``, zeros) and ``<layer>.lora_dropout``, and computes
  ``base + lora_B(lora_A(dropout(x))) * alpha / r`` where ``x`` is what the base op reads
  (its input quantizer's output, when it has one), before any output quantizer;
- stops training its weight and bias (``requires_grad`` off on the graph's copy);
  parameters outside adapted layers keep the flag the model gave them.

``lora_A`` starts from ``kaiming_uniform_(a=sqrt(5))`` (peft's and ``nn.Linear``'s
default), drawn from a generator seeded by the entry's ``seed`` and the layer's name, so
every rank and every world size starts from the same adapters with no communication;
``lora_B`` starts at zero, so a fresh graph computes what it computed without adapters.
The names are peft's (``q_proj.lora_A.weight``): ``qc.save_adapters`` writes them as a
peft adapter. ``gm.meta[ADAPTERS_KEY]`` holds one ``AdapterLayer`` per adapted layer.

Example:
    >>> import torch, qcompile as qc
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
    ...                             torch.nn.Linear(64, 8))
    >>> spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Linear"},
    ...         "weight": {"dtype": "int4", "granularity": "per_group", "group_size": 32}}]},
    ...         "adapters": [{"match": {"name": "0"}, "rank": 4, "alpha": 8}]}
    >>> gm = qc.qcompile(model, spec, example_inputs=(torch.randn(2, 64),))
    >>> print(gm.code.split("def forward")[1])  # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
    (self, input):
        input_1 = input
        _0_weight_frozen = getattr(self, "0").weight_frozen()
        _0_bias = getattr(self, "0").bias
        linear = torch._C._nn.linear(input_1, _0_weight_frozen, _0_bias); ...
        _0_lora_a = getattr(self, "0").lora_A(input_1);  input_1 = None
        _0_lora_b = getattr(self, "0").lora_B(_0_lora_a);  _0_lora_a = None
        mul = _0_lora_b * 2.0;  _0_lora_b = None
        add = linear + mul;  linear = mul = None
        _1 = getattr(self, "1")(add);  add = None
        ...
    >>> sorted(n for n, p in gm.named_parameters() if p.requires_grad)
    ['0.lora_A.weight', '0.lora_B.weight', '2.bias', '2.weight']
"""

from __future__ import annotations

import math
import operator
import zlib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.matching import Owner, match_node, module_op, owners
from qcompile.graph.meta import ADAPTERS_KEY, NN_MODULE_STACK, QSCHEME_KEY, TENSOR_META
from qcompile.graph.pipeline import graph_pass
from qcompile.graph.records import AdapterRecord
from qcompile.passes.insert_quant.common import attr, set_flag
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.frozen import FrozenWeight, frozen_layout
from qcompile.specs import AdapterSpec

_LINEAR = {F.linear, torch.ops.aten.linear.default}


@dataclass(frozen=True)
class AdapterLayer:
    """One adapted layer, as the graph holds it (``gm.meta[ADAPTERS_KEY][layer]``): the
    entry that chose it, the names of its tensors and modules, and its sizes."""

    layer: str
    entry: int
    rank: int
    alpha: float
    dropout: float
    base: str  # "frozen" | "qat"
    in_features: int
    out_features: int
    weight: str | None  # the float weight's name, None once the graph holds it frozen
    bias: str | None
    storage: str | None  # the FrozenWeight, for a base stored quantized
    quantizer: str | None  # the weight's fake-quantizer (base qat; frozen: the one replaced)
    scheme: object  # the weight's Scheme, None for a float base
    seed: int

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass
class _Layer:
    name: str
    weight: str
    nodes: list[Node]  # the linear ops reading the weight


def _weight_source(gm: GraphModule, node: Node) -> tuple[Node | None, Node | None]:
    """(the get_attr of the weight a linear op reads, its fake-quantizer's call or None)."""
    if node.op == "call_module":
        return None, None
    w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    fq = None
    if isinstance(w, Node) and w.op == "call_module" and isinstance(
            gm.get_submodule(str(w.target)), FakeQuantize):
        fq, w = w, w.args[0]
    if isinstance(w, Node) and w.op == "get_attr":
        return w, fq
    return None, None


def linear_layers(gm: GraphModule) -> dict[str, _Layer]:
    """Layers computed by a linear op on a 2-D parameter ``<layer>.weight``, by name."""
    found: dict[str, _Layer] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            if module_op(gm.get_submodule(str(node.target))) != "linear":
                continue
            name, weight = str(node.target), f"{node.target}.weight"
        elif node.op == "call_function" and node.target in _LINEAR:
            src, _ = _weight_source(gm, node)
            if src is None or not str(src.target).endswith(".weight"):
                continue
            weight = str(src.target)
            name = weight.rpartition(".")[0]
            t = attr(gm, weight)
            if not isinstance(t, nn.Parameter) or t.dim() != 2:
                continue
        else:
            continue
        found.setdefault(name, _Layer(name, weight, [])).nodes.append(node)
    return found


def _owners(gm: GraphModule, layer: _Layer) -> tuple[Owner, ...]:
    node = layer.nodes[0]
    found = owners(node, gm)
    own = next((o for o in found if o.name == layer.name), None)
    if own is None:
        cls = type(gm.get_submodule(layer.name))
        own = Owner(layer.name, cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    return (own, *(o for o in found if o.name != layer.name))


def _describe(a: AdapterSpec) -> str:
    m = a.match
    return ", ".join(f"{k}: {v[0] if len(v) == 1 else v}"
                     for k, v in (("module", m.module), ("name", m.name)) if v)


def choose(gm: GraphModule, entries: list[AdapterSpec], layers: dict[str, _Layer]
           ) -> dict[str, tuple[int, _Layer]]:
    """Layer -> (index of the entry that adapts it, layer), of ``layers``
    (``linear_layers(gm)``); a non-optional entry that matches no layer is an error."""
    chosen: dict[str, tuple[int, _Layer]] = {}
    hits = [0] * len(entries)
    for name, layer in layers.items():
        who = _owners(gm, layer)
        for i, a in enumerate(entries):
            if match_node(a.match, layer.nodes[0], who) is None:
                continue
            hits[i] += 1
            if not a.skip:
                chosen[name] = (i, layer)
            break
    for i, a in enumerate(entries):
        if hits[i] == 0 and not a.optional:
            shown = ", ".join(list(layers)[:8]) + (" ..." if len(layers) > 8 else "")
            raise QCompileError(
                f"adapters[{i}] ({_describe(a)}) matched no Linear layer (an earlier entry may "
                f"have taken them); the graph's linear layers: {shown or 'none'}",
                fix="correct the match (module class names, fnmatch globs on qualified "
                "names), remove the entry, or set optional: true on it")
    return chosen


def init_adapter(a_weight: torch.Tensor, b_weight: torch.Tensor, layer: str, seed: int) -> None:
    """``lora_A`` ~ U(-1/sqrt(in), 1/sqrt(in)) (``kaiming_uniform_(a=sqrt(5))``), drawn from
    a generator seeded by ``seed`` and the layer's name; ``lora_B`` = 0. The same values on
    every rank and device (drawn on the CPU, then copied)."""
    gen = torch.Generator().manual_seed(seed * 0x9E3779B1 + zlib.crc32(layer.encode()))
    bound = 1.0 / math.sqrt(a_weight.shape[1])
    with torch.no_grad():
        a = torch.empty(a_weight.shape, dtype=torch.float32).uniform_(-bound, bound,
                                                                      generator=gen)
        a_weight.copy_(a.to(a_weight.dtype))
        b_weight.zero_()


def _add_lora(gm: GraphModule, layer: _Layer, a: AdapterSpec, weight: torch.Tensor) -> None:
    out_f, in_f = weight.shape
    kw = {"device": weight.device, "dtype": weight.dtype}
    lora_a = nn.Linear(in_f, a.rank, bias=False, **kw)
    lora_b = nn.Linear(a.rank, out_f, bias=False, **kw)
    if weight.device.type != "meta":
        init_adapter(lora_a.weight, lora_b.weight, layer.name, a.seed)
    gm.add_submodule(f"{layer.name}.lora_A", lora_a)
    gm.add_submodule(f"{layer.name}.lora_B", lora_b)
    if a.dropout > 0:
        gm.add_submodule(f"{layer.name}.lora_dropout", nn.Dropout(a.dropout))
    g = gm.graph
    targets = ([f"{layer.name}.lora_dropout"] if a.dropout > 0 else []) + [
        f"{layer.name}.lora_A", f"{layer.name}.lora_B"]
    for node in layer.nodes:
        x = node.args[0] if node.args else node.kwargs["input"]
        stack = {k: v for k, v in node.meta.items() if k == NN_MODULE_STACK}
        cursor, steps = node, []
        for target in targets:  # right after the op: dropout, A, B, then scale and add
            with g.inserting_after(cursor):
                cursor = g.create_node("call_module", target, (cursor if steps else x,))
            steps.append(cursor)
        with g.inserting_after(cursor):
            scaled = g.call_function(operator.mul, (cursor, a.scaling))
        with g.inserting_after(scaled):
            total = g.call_function(operator.add, (node, scaled))
        for n in (*steps, scaled, total):
            n.meta.update(stack)
        if TENSOR_META in node.meta:
            total.meta[TENSOR_META] = node.meta[TENSOR_META]
        node.replace_all_uses_with(total, delete_user_cb=lambda u, t=total: u is not t)


def _freeze_base(gm: GraphModule, ctx: Context, layer: _Layer, a: AdapterSpec, i: int,
                 reads: Counter[str], removed: set[str]
                 ) -> tuple[str | None, str | None, object]:
    """Freeze the layer's weight as ``a.base`` says: (storage name, quantizer name, scheme).
    ``reads`` counts the graph's ``get_attr`` nodes per target (kept up to date here);
    quantizers this removes join ``removed``."""
    weight = attr(gm, layer.weight)
    srcs = [_weight_source(gm, n) for n in layer.nodes]
    fq_node = srcs[0][1]
    fq = gm.get_submodule(str(fq_node.target)) if fq_node is not None else None
    scheme = None
    if fq_node is not None:
        qs = layer.nodes[0].meta.get(QSCHEME_KEY)
        scheme = getattr(qs, "weight", None)
    weight.requires_grad_(False)
    if fq is None:
        if a.base == "qat":
            raise QCompileError(
                f"adapters[{i}]: layer {layer.name!r} has base: qat but no quantization rule "
                "gives it a weight scheme (its weight would stay float)",
                fix="add a rule with a weight scheme for it, or use base: frozen (a float "
                "base, frozen)")
        ctx.note(f"{layer.name}: no weight scheme, its float weight is the frozen base")
        return None, None, None
    set_flag(fq, "observe", False)  # frozen: the scale is what the weight gave
    if a.base == "qat":
        # no cached fake-quantized copy: for a weight that never changes it would stay, one
        # float model more, for good; the forward quantizes it again (and the backward
        # recomputes it), as the float step reads its weight
        fq.reuse_weight = False
        return None, str(fq_node.target), scheme
    why = frozen_layout(fq, tuple(weight.shape))
    if why is not None:
        raise QCompileError(
            f"adapters[{i}]: layer {layer.name!r}: a frozen base cannot store {why}",
            fix="use base: qat for this layer, or give it an integer or block weight scheme")
    name = f"{layer.name}.weight_frozen"
    if weight.device.type == "meta":
        storage = FrozenWeight.empty(fq, tuple(weight.shape), dtype=weight.dtype)
    else:
        storage = FrozenWeight.from_quantizer(fq, weight)
    gm.add_submodule(name, storage)
    g = gm.graph
    with g.inserting_before(fq_node):
        call = g.create_node("call_module", name, ())
    call.meta.update({k: v for k, v in fq_node.meta.items() if k == NN_MODULE_STACK})
    # only this layer's ops read the storage: another op reading the same (tied) weight
    # keeps its float weight and quantizer, and its gradient
    for node, (_, q) in zip(layer.nodes, srcs):
        node.replace_input_with(q, call)
    gone = set()
    for get, q in dict.fromkeys(srcs):  # a layer called twice reads one quantizer
        if q is not None and not q.users:
            g.erase_node(q)
            gone.add(str(q.target))  # one call per quantizer: the module goes too
            if get is not None and not get.users:
                g.erase_node(get)
                reads[str(get.target)] -= 1
    for target in gone:
        parent, _, leaf = target.rpartition(".")
        delattr(gm.get_submodule(parent) if parent else gm, leaf)
    removed |= gone
    if reads[layer.weight] <= 0:
        parent, _, leaf = layer.weight.rpartition(".")
        delattr(gm.get_submodule(parent), leaf)  # the float weight leaves the graph
    else:
        ctx.note(f"{layer.weight} is also read elsewhere in the graph: its float copy stays "
                 f"next to the frozen {name}")
    return name, str(fq_node.target), scheme


@graph_pass(requires=("graph",), provides=("adapters",))
def insert_adapters(gm: GraphModule, ctx: Context) -> GraphModule:
    entries = ctx.spec.adapters
    layers = linear_layers(gm)
    chosen = choose(gm, entries, layers)
    # one scan of the graph for what every layer's clean-up needs (never one per layer)
    reads = Counter(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    removed: set[str] = set()
    records: dict[str, AdapterLayer] = {}
    for name, (i, layer) in chosen.items():
        a = entries[i]
        weight = attr(gm, layer.weight)
        before = weight.numel() * weight.element_size()
        out_f, in_f = weight.shape
        bias_name = f"{name}.bias"
        bias = getattr(gm.get_submodule(name), "bias", None)
        if isinstance(bias, nn.Parameter):
            bias.requires_grad_(False)
        else:
            bias_name = None
        storage, quantizer, scheme = _freeze_base(gm, ctx, layer, a, i, reads, removed)
        _add_lora(gm, layer, a, weight)
        after = (gm.get_submodule(storage).nbytes() if storage is not None else before)
        records[name] = AdapterLayer(
            layer=name, entry=i, rank=a.rank, alpha=a.alpha, dropout=a.dropout, base=a.base,
            in_features=in_f, out_features=out_f,
            weight=layer.weight if hasattr(gm.get_submodule(name), "weight") else None,
            bias=bias_name, storage=storage, quantizer=quantizer, scheme=scheme, seed=a.seed)
        ctx.adapters.append(AdapterRecord(
            layer=name, entry=i, rank=a.rank, alpha=a.alpha, base=a.base,
            stored=getattr(scheme, "dtype", None) if storage is not None else None,
            base_bytes_before=before, base_bytes_after=after,
            adapter_parameters=a.rank * (in_f + out_f)))
    ctx.quantizers[:] = [q for q in ctx.quantizers if q.name not in removed]
    gm.meta[ADAPTERS_KEY] = records
    ctx.note(f"{len(records)} layer(s) adapted (lora) of {len(layers)} linear")
    return gm
