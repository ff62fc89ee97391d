"""``qc.search(model, spec, batches)``: mixed precision under a budget.

The spec's ``quant.rules`` say which layers are quantized and with which activation
scheme; ``quant.search`` lists candidate weight schemes, a budget and a metric. The search
measures every searched layer's sensitivity to every candidate, chooses the assignment
with the least total predicted error within the budget, and returns a concrete spec:
``search`` removed, one rule per chosen group prepended to the original rules.

Steps:

1. *Which layers.* The model is compiled once with the spec minus ``search`` (the mode as
   given); the searched layers are those that got a weight quantizer there (the Report's
   quantizers of role ``weight``), so exactly what ``qc.qcompile`` would quantize, tied
   weights, skip rules and functional weights (``F.linear(x, self.w)``, experts) included.
   At that compile, right after ``annotate``, the rules the search will write are checked
   with the compiler's own rule assignment: every node keeps its schemes except the
   searched weights, or the search stops and names the node.
2. *Scores*, on a copy of the model (the model itself is never touched), in float:

   - ``sqnr``: a hook on each searched layer computes, from the float input the layer
     received, its output with each candidate's quantized weight; ``noise / signal`` energy
     of that output against the float one. All layers and candidates in one forward per
     batch (about ``1 + candidates`` forwards' work per batch).
   - ``fisher``: one forward and backward per batch accumulates each weight's squared
     gradient ``g2``; a candidate's score is ``0.5 * sum(mean g2 * (Wq - W) ** 2)``, the
     loss increase the diagonal Fisher predicts (HAWQ / AutoQuantize-style).
   - ``loss``: the mean loss with one layer's weight quantized, minus the float loss
     (``layers x candidates`` forwards per batch).

   Weights are quantized as the compiled graph would (``FakeQuantize.from_scheme``, the
   layout ``insert_quant`` gives the weight: GPT-2 Conv1D's groups along its inputs), from
   the model's own weights (a BatchNorm that PTQ folds into a conv is not folded here).
   A candidate that does not fit a layer (a group size not dividing its rows) scores
   ``inf`` there and is never chosen for it.
3. *Across ranks*: each rank scores its own batches; the score sums and batch counts are
   summed over ``group`` (``qcompile.distributed.search_sync``) before the choice, so every
   rank returns the same spec, equal to one process scoring all the batches. First of all
   the ranks agree on the spec and the model (its tensors and a checksum of their values):
   another model on one rank, or a search on some ranks only, is the same
   ``QCompileError`` on every rank.
4. *The choice*: a multiple-choice knapsack solved by dynamic programming over the Pareto
   frontier of (cost, predicted error) of the groups so far (``solve``). Exact unless the
   frontier exceeds ``cap`` states: then states whose costs fall in one bucket of width
   ``delta`` are merged, and the result is still within the budget with a predicted error
   at most the exact optimum for the budget lowered by ``merges * delta``.

Budgets: ``avg_weight_bits`` counts element bits weighted by parameter count (the integer
dtype's bits: int4 4, int8 8; fp8 8; block formats their bits per element with their
shared scales: mxfp4 4.25, nvfp4 4.5, nf4 4.5). ``weight_bytes`` counts the searched
weights as ``qc.convert`` stores them: elements (``ceil(n / 2)`` bytes at 2-4 bits, ``n``
at 5-8 bits and fp8, ``2n`` at 9-16 bits; block formats ``ceil(n * bits_per_element / 8)``,
nvfp4 plus its 4-byte tensor scale), plus scales (4 bytes each; 2 for the per-group scales
of 2-4 bit weights, stored as float16) and zero points (one int32 for a symmetric scheme,
one per scale otherwise). ``max_loss_increase`` chooses the fewest bits whose predicted
loss increase is at most the value.

Example:
    >>> import torch, qcompile as qc
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
    ...                             torch.nn.Linear(64, 32))
    >>> spec = qc.CompileSpec.model_validate({"quant": {
    ...     "mode": "static", "rules": [{"match": {"module": "Linear"},
    ...                                  "weight": {"dtype": "int8"}}],
    ...     "search": {"candidates": [
    ...         {"weight": {"dtype": "int4", "granularity": "per_group", "group_size": 32}},
    ...         {"weight": {"dtype": "int8", "granularity": "per_channel"}}],
    ...         "budget": {"avg_weight_bits": 6.0}}}})
    >>> batches = [torch.randn(8, 32) for _ in range(2)]
    >>> found, info = qc.search(model, spec, batches, details=True)
    >>> found.quant.search is None, len(found.quant.rules)  # two searched layers, one rule
    (True, 3)
    >>> info.avg_weight_bits <= 6.0
    True
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.fx import GraphModule, Node

from qcompile.compile import qcompile
from qcompile.distributed.once import blocks
from qcompile.distributed.search_sync import (
    agree_to_search,
    reduce_scores,
    scoring,
    world_size,
)
from qcompile.errors import QCompileError
from qcompile.graph.matching import layer_of, weight_use, weighted_module_op
from qcompile.graph.meta import QSCHEME_KEY
from qcompile.graph.records import PassRecord, Report, report
from qcompile.passes.annotate import assign_rules
from qcompile.passes.insert_quant import weight_layout
from qcompile.runtime.block_formats import bits_per_element
from qcompile.runtime.fake_quant import FakeQuantize, scale_count
from qcompile.specs import CompileSpec, Rule, Scheme, as_spec
from qcompile.specs.quant import SearchSpec


# -- the result --------------------------------------------------------------------------
class SearchGroup(BaseModel):
    """One group the search assigns a weight scheme to: a layer, or a repeated block."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    name: str = Field(description="the layer's qualified name, or the block's")
    layers: list[str] = Field(description="the searched layers in the group")
    parameters: int = Field(description="weight elements of the group's layers")
    scores: list[float] = Field(
        description="predicted error per candidate (lower is better) in the metric's unit: "
        "sqnr: noise / signal energy of the layers' outputs, summed over the group's layers; "
        "loss and fisher: loss increase. inf: the candidate does not fit a layer")
    sqnr_db: list[float] | None = Field(
        None, description="sqnr: the group's output SQNR per candidate in dB (None for the "
        "other metrics)")


class ParetoPoint(BaseModel):
    """The solver's optimum at one budget between all-cheapest and all-largest."""

    model_config = ConfigDict(extra="forbid")

    avg_weight_bits: float
    weight_bytes: int
    predicted_error: float
    chosen: dict[str, int] = Field(description="group name -> candidate index")


class SearchDetails(BaseModel):
    """What ``qc.search(..., details=True)`` measured and chose, for reports and plots."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    metric: str = Field(description="sqnr | loss | fisher")
    granularity: str = Field(description="layer | block")
    budget: dict = Field(description="the spec's budget, e.g. {'avg_weight_bits': 4.5}")
    candidates: list[str] = Field(description="a short label per candidate, "
                                  "e.g. 'int4/per_group32'")
    bits: list[float] = Field(description="bits per weight element of each candidate")
    groups: list[SearchGroup]
    chosen: dict[str, int] = Field(description="group name -> chosen candidate index")
    predicted_error: float = Field(description="sum of the chosen candidates' scores")
    avg_weight_bits: float = Field(description="of the searched layers, weighted by "
                                   "parameter count")
    weight_bytes: int = Field(description="the searched layers' weights as stored (elements "
                              "plus scales and zero points)")
    pareto: list[ParetoPoint] = Field(description="the optimum at budgets from all-cheapest "
                                      "to all-largest")
    seconds: dict[str, float] = Field(description="scoring, solving (and discovery: the "
                                      "compile finding the searched layers)")
    batches: int = Field(description="batches scored, over all ranks")
    ranks: int = Field(description="data-parallel ranks that scored")


# -- costs ---------------------------------------------------------------------------------
def scheme_bits(scheme: Scheme) -> float:
    """Bits per element ``avg_weight_bits`` counts for a weight scheme.

    >>> scheme_bits(Scheme(dtype="int4", granularity="per_group", group_size=32))
    4.0
    >>> scheme_bits(Scheme(dtype="mxfp4")), scheme_bits(Scheme(dtype="fp8_e4m3"))
    (4.25, 8.0)
    """
    if scheme.is_block:
        return float(bits_per_element(scheme.dtype, scheme.group_size))
    if scheme.is_float:
        return 8.0
    return float(int(scheme.dtype.removeprefix("u").removeprefix("int")))


def stored_bytes(scheme: Scheme, shape: tuple[int, ...]) -> int:
    """Bytes of a weight of ``shape`` (as its quantizer sees it) stored under ``scheme``
    (the formula in the module docstring).

    >>> stored_bytes(Scheme(dtype="int8", granularity="per_channel"), (64, 32))
    2308
    >>> stored_bytes(Scheme(dtype="int4", granularity="per_group", group_size=32), (64, 32))
    1156
    """
    n = math.prod(shape)
    if scheme.is_block:
        extra = 4 if scheme.dtype == "nvfp4" else 0
        return math.ceil(n * bits_per_element(scheme.dtype, scheme.group_size) / 8) + extra
    scales = scale_count(scheme, shape, role="weight")
    bits = scheme_bits(scheme)
    elements = math.ceil(n / 2) if bits <= 4 else n if bits <= 8 else 2 * n
    scale_bytes = 2 if bits <= 4 and scheme.granularity == "per_group" else 4
    zero_points = 4 if scheme.symmetric or scheme.is_float else 4 * scales
    return elements + scales * scale_bytes + zero_points


# -- the solver ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Frontier:
    """Every Pareto-optimal (cost, error) total of a multiple-choice knapsack, with the
    choice per group of each (``choice(i)``). ``merges * delta`` bounds how much budget the
    merging of states may have cost (0: exact)."""

    costs: np.ndarray  # ascending
    errors: np.ndarray  # strictly descending
    backs: list[tuple[np.ndarray, np.ndarray]]  # per group: (parent state, option)
    merges: int
    delta: float

    def choice(self, i: int) -> list[int]:
        out = [0] * len(self.backs)
        for g in range(len(self.backs) - 1, -1, -1):
            parent, option = self.backs[g]
            out[g] = int(option[i])
            i = int(parent[i])
        return out

    def within(self, budget: float) -> int | None:
        """The state with the least error whose cost is at most ``budget``."""
        tol = 1e-9 * max(1.0, abs(budget))
        k = int(np.searchsorted(self.costs, budget + tol, side="right")) - 1
        return k if k >= 0 else None

    def cheapest_under(self, error: float) -> int | None:
        """The cheapest state whose error is at most ``error``."""
        tol = 1e-12 * max(1.0, abs(error))
        ok = np.nonzero(self.errors <= error + tol)[0]
        return int(ok[0]) if ok.size else None


def solve(costs: list[list[float]], errors: list[list[float]], *,
          cap: int = 50_000) -> Frontier:
    """The Pareto frontier of ``sum(costs[g][c_g])`` vs ``sum(errors[g][c_g])`` over every
    choice of one option ``c_g`` per group (options with infinite error are never taken).

    Dynamic programming group by group over the frontier of the groups so far: each
    state extended by each option, then only the states no other state beats on both
    cost and error are kept. Exact while at most ``cap`` states survive a step; beyond
    that, states are merged into buckets of width ``delta = span / cap`` of cost (``span``:
    the sum of each group's largest minus smallest cost), keeping each bucket's least
    error (and the cheapest state). Every state kept has its true cost, so a choice
    ``within(budget)`` is always within the budget, and one exists for every budget some
    assignment fits; a merge moves a state's cost by less than ``delta``, so its error is
    at most that of the exact optimum for ``budget - merges * delta``.

    >>> f = solve([[4, 8], [4, 8]], [[1.0, 0.1], [5.0, 0.2]])
    >>> f.costs.tolist(), f.errors.tolist(), f.choice(f.within(12))
    ([8.0, 12.0, 16.0], [6.0, 1.2, 0.30000000000000004], [0, 1])
    """
    cost = np.zeros(1)
    error = np.zeros(1)
    backs: list[tuple[np.ndarray, np.ndarray]] = []
    finite = [[c for c, e in zip(cs, es) if math.isfinite(e)] or [0.0]
              for cs, es in zip(costs, errors)]
    span = sum(max(c) - min(c) for c in finite)
    delta = span / cap if span > 0 else 0.0
    merges = 0
    for g, (cs, es) in enumerate(zip(costs, errors)):
        options = [c for c in range(len(cs)) if math.isfinite(es[c])]
        if not options:
            raise ValueError(f"group {g} has no option with a finite error")
        n = cost.size
        nc = np.concatenate([cost + cs[c] for c in options])
        ne = np.concatenate([error + es[c] for c in options])
        parent = np.tile(np.arange(n, dtype=np.int64), len(options))
        option = np.repeat(np.asarray(options, dtype=np.int64), n)
        order = np.lexsort((ne, nc))  # by cost, then error
        nc, ne, parent, option = nc[order], ne[order], parent[order], option[order]
        best = np.minimum.accumulate(ne)
        keep = np.ones(nc.size, dtype=bool)
        keep[1:] = ne[1:] < best[:-1]  # strictly better than every cheaper state
        nc, ne, parent, option = nc[keep], ne[keep], parent[keep], option[keep]
        if nc.size > cap and delta > 0:
            bucket = np.floor((nc - nc[0]) / delta).astype(np.int64)
            last = np.ones(nc.size, dtype=bool)  # the last of a bucket has its least error
            last[:-1] = bucket[1:] != bucket[:-1]
            last[0] = True  # and the cheapest state stays: every budget it fits stays feasible
            nc, ne, parent, option = nc[last], ne[last], parent[last], option[last]
            merges += 1
        cost, error = nc, ne
        backs.append((parent.astype(np.int32), option.astype(np.int8)))
    return Frontier(cost, error, backs, merges, delta)


# -- finding the searched layers ------------------------------------------------------------
@dataclass
class _Weight:
    target: str  # the tensor's qualified name (a parameter or buffer)
    axis: int  # its output-channel axis as stored
    experts: bool
    node: str  # the graph node reading it (for messages)


@dataclass
class _Layer:
    name: str  # the module computing with the weights
    rule: int  # the rule of quant.rules that quantized it
    weights: list[_Weight] = field(default_factory=list)


@dataclass
class _Group:
    name: str
    layers: list[_Layer]


def _weighted_nodes(gm: GraphModule) -> list[tuple[Node, _Weight, str | None, int]]:
    """(node, weight, layer, rule) of every node whose rule gives a weight scheme and that
    reads a floating-point weight, as ``insert_quant`` finds them."""
    found = []
    for node in gm.graph.nodes:
        qs = node.meta.get(QSCHEME_KEY)
        if qs is None or qs.skip or qs.weight is None:
            continue
        op = weighted_module_op(gm, node)
        if op is not None:
            target = f"{node.target}.weight"
            w = _Weight(target, 1 if op.startswith("conv_transpose") else 0, False, node.name)
        else:
            use = weight_use(node)
            if use is None:
                continue
            w = _Weight(str(use.param.target), use.axis, use.experts, node.name)
        found.append((node, w, layer_of(node), qs.rule))
    return found


def _group_names(layers: list[str], granularity: str, model: nn.Module) -> dict[str, str]:
    """Layer -> its group: itself, or the repeated block (``blocks(model)``) holding it."""
    if granularity == "layer":
        return {name: name for name in layers}
    found = blocks(model)
    out = {}
    for name in layers:
        out[name] = next((b for b in found if name == b or name.startswith(b + ".")), name)
    return out


def _depth(name: str) -> int:
    return name.count(".") + 1


class _Discovery:
    """Instrument for the one compile of the spec minus ``search``: right after
    ``annotate``, the searched layers and their groups, and the check that the rules the
    search will write keep every other node's schemes."""

    def __init__(self, search: SearchSpec, model: nn.Module) -> None:
        self.search = search
        self.model = model
        self.layers: list[_Layer] = []
        self.groups: list[_Group] = []
        self.by_glob: bool = True  # block rules match "block.*" (else the layers' names)
        self.unused: list[int] = []  # original rules that win no node any more

    def after_pass(self, index: int, record: PassRecord, gm: GraphModule, ctx: Any) -> None:
        if record.name != "annotate":
            return
        spec_rules = list(ctx.spec.quant.rules)
        nodes = _weighted_nodes(gm)
        layers: dict[str, _Layer] = {}
        seen: set[str] = set()
        searched: dict[str, str] = {}  # node name -> layer
        for node, w, layer, rule in nodes:
            if layer is None:
                raise QCompileError(
                    f"qc.search: node {node.name!r} reads weight {w.target!r} in the model's "
                    "own forward, not in a submodule: the search chooses schemes per module",
                    fix=f"move that computation into a submodule, or exclude {w.target} "
                    "from the searched rules")
            searched[node.name] = layer
            if w.target in seen:
                continue  # a tied weight: one quantizer, the first reader's scheme
            seen.add(w.target)
            entry = layers.setdefault(layer, _Layer(layer, rule))
            entry.weights.append(w)
        self.layers = list(layers.values())
        group_of = _group_names(list(layers), self.search.granularity, self.model)
        groups: dict[str, _Group] = {}
        for layer in self.layers:
            groups.setdefault(group_of[layer.name], _Group(group_of[layer.name], [])
                              ).layers.append(layer)
        self.groups = list(groups.values())
        placeholder = self.search.candidates[0].weight
        problems = self._check(gm, spec_rules, searched, group_of, placeholder)
        if problems and self.search.granularity == "block":
            self.by_glob = False
            problems = self._check(gm, spec_rules, searched, group_of, placeholder)
        if problems:
            node, layer = problems[0]
            raise QCompileError(
                f"qc.search: the rules for the searched layers would also change node "
                f"{node!r} ({layer or 'the model'}), which the spec quantizes otherwise "
                f"({len(problems)} node(s) in all)",
                fix=f"exclude the module enclosing {node!r} from the searched rules (a "
                "skip rule, or a narrower match), or use granularity: layer")

    def finish(self, rep: Report, gm: GraphModule) -> None:
        pass

    def rules(self, spec_rules: list[Rule], chosen: dict[str, Scheme],
              notes: dict[str, str]) -> list[Rule]:
        """One rule per (group, original rule), deepest groups first, each giving the
        group's chosen weight scheme and the original rule's activation scheme."""
        out = []
        order = sorted(range(len(self.groups)), key=lambda i: -_depth(self.groups[i].name))
        for i in order:
            g = self.groups[i]
            by_rule: dict[int, list[str]] = {}
            for layer in g.layers:
                by_rule.setdefault(layer.rule, []).append(layer.name)
            for r, names in by_rule.items():
                orig = spec_rules[r]
                block = g.name not in names
                if block and self.by_glob:
                    name: str | list[str] = f"{g.name}.*"
                else:
                    name = names[0] if len(names) == 1 else names
                match = {"name": name}
                for key in ("module", "op"):
                    if getattr(orig.match, key) is not None:
                        match[key] = getattr(orig.match, key)
                if orig.match.reads_weight:
                    match["reads_weight"] = True
                data: dict[str, Any] = {"match": match, "weight": chosen[g.name]}
                if orig.activation is not None:
                    data["activation"] = orig.activation
                    data["activation_at"] = orig.activation_at
                if notes.get(g.name):
                    data["note"] = notes[g.name]
                out.append(Rule.model_validate(data))
        return out

    def _check(self, gm: GraphModule, spec_rules: list[Rule], searched: dict[str, str],
               group_of: dict[str, str], placeholder: Scheme
               ) -> list[tuple[str, str | None]]:
        """Nodes whose schemes the new rules would change (besides the searched weights):
        the compiler's own rule assignment run with them, then the annotations put back."""
        new = self.rules(spec_rules, {g.name: placeholder for g in self.groups}, {})
        saved = {n: n.meta.get(QSCHEME_KEY) for n in gm.graph.nodes}
        try:
            result = assign_rules(gm, new + spec_rules)
            after = {n: n.meta.get(QSCHEME_KEY) for n in gm.graph.nodes}
        finally:
            for n, qs in saved.items():
                if qs is None:
                    n.meta.pop(QSCHEME_KEY, None)
                else:
                    n.meta[QSCHEME_KEY] = qs
        k = len(new)
        rule_group = {}
        for i, rule in enumerate(new):
            names = rule.match.name or []
            rule_group[i] = next((group_of[layer] for layer in searched.values()
                                  if any(n == layer or (n.endswith(".*") and
                                         layer.startswith(n[:-1])) for n in names)), None)
        problems = []
        for n, old in saved.items():
            now = after[n]
            layer = searched.get(n.name)
            if layer is not None:
                ok = (now is not None and now.rule < k and rule_group[now.rule]
                      == group_of[layer] and now.activation == old.activation)
            elif old is None or now is None:
                ok = old is None and now is None
            else:
                weighted = weighted_module_op(gm, n) is not None or weight_use(n) is not None
                ok = (old.skip == now.skip and old.activation == now.activation
                      and (not weighted or old.weight == now.weight))
            if not ok:
                problems.append((n.name, layer_of(n)))
        self.unused = [i for i in range(len(spec_rules)) if not result.won[i + k]]
        return problems


# -- scoring -------------------------------------------------------------------------------
def _as_call(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _refuse_nonfinite(batches: list[Any]) -> None:
    """A NaN or infinite input would make every score NaN (no candidate comparable to
    another, nothing to choose): refused, naming the batch and the input."""
    for index, batch in enumerate(batches):
        args, kwargs = _as_call(batch)
        named = [*((f"input {i}", v) for i, v in enumerate(args)), *kwargs.items()]
        for name, v in named:
            if (isinstance(v, torch.Tensor) and v.is_floating_point()
                    and not bool(torch.isfinite(v).all())):
                nan = int(torch.isnan(v).sum())
                inf = v.numel() - nan - int(torch.isfinite(v).sum())
                raise QCompileError(
                    f"qc.search: batch {index}: {name} has {nan} NaN and {inf} infinite "
                    f"value(s) of {v.numel()}: every layer's score would be NaN",
                    fix="search on finite data (drop or clean the batch: "
                        "torch.isfinite(x).all() for each input)")


def _tensor_of(model: nn.Module, target: str) -> torch.Tensor:
    owner, _, leaf = target.rpartition(".")
    m = model.get_submodule(owner) if owner else model
    t = getattr(m, leaf, None)
    if not isinstance(t, torch.Tensor):
        raise QCompileError(f"qc.search: weight {target!r} of the compiled graph is not a "
                            "tensor of the model", fix="use trace.method: symbolic in the spec")
    return t


@dataclass
class _Swap:
    """Puts tensors in place of a model's weights (a parameter or buffer slot) and back."""

    model: nn.Module
    saved: list[tuple[nn.Module, str, str, Any]] = field(default_factory=list)

    def put(self, target: str, value: torch.Tensor) -> None:
        owner, _, leaf = target.rpartition(".")
        m = self.model.get_submodule(owner) if owner else self.model
        for table in ("_parameters", "_buffers"):
            slots = getattr(m, table)
            if leaf in slots:
                self.saved.append((m, table, leaf, slots[leaf]))
                slots[leaf] = value
                return
        self.saved.append((m, "__dict__", leaf, m.__dict__[leaf]))
        m.__dict__[leaf] = value

    def restore(self) -> None:
        for m, table, leaf, old in reversed(self.saved):
            (m.__dict__ if table == "__dict__" else getattr(m, table))[leaf] = old
        self.saved.clear()


@contextlib.contextmanager
def _swapped(model: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """``model`` with ``values`` in place of its weights (by target) inside the block."""
    swap = _Swap(model)
    try:
        for target, q in values.items():
            swap.put(target, q)
        yield
    finally:
        swap.restore()


def _quantized(w: torch.Tensor, info: _Weight, scheme: Scheme, target: str
               ) -> tuple[torch.Tensor | None, str | None, tuple[int, ...] | None]:
    """(the fake-quantized weight, None, rows shape) or (None, why it does not fit, None)."""
    use = types.SimpleNamespace(axis=info.axis, experts=info.experts)
    node = types.SimpleNamespace(name=info.node)
    try:
        layout = weight_layout(w, use, scheme, info.target, "weight", node)
        rows = layout.apply(w.detach().float())
        fq = FakeQuantize.from_scheme(scheme, role="weight", shape=tuple(rows.shape),
                                      channel_axis=layout.axis, target=target).to(w.device)
        fq.observe_tensor(rows)
        fq.observe = False
        q = fq(rows)
    except (ValueError, QCompileError) as e:
        return None, getattr(e, "message", str(e)), None
    for fn, args in layout.back:
        q = fn(q, *args)
    return q.detach().to(w.dtype).reshape(w.shape), None, tuple(rows.shape)


def _loss(out: Any, batch: Any, loss_fn: Callable[[Any, Any], Any] | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(out, batch)
    else:
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if loss is None:
            raise QCompileError(
                "qc.search: metrics loss and fisher need a loss, and the model's output has "
                "no .loss", fix="pass loss_fn=lambda output, batch: <scalar loss tensor>")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise QCompileError(f"qc.search: loss_fn must return a scalar tensor, got "
                            f"{type(loss).__name__}"
                            + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor)
                               else ""), fix="return e.g. F.cross_entropy(output, batch[1])")
    return loss.reshape(())


def _outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Scorer:
    """One rank's score sums over its batches, on a copy of the model."""

    def __init__(self, model: nn.Module, layers: list[_Layer], candidates: list[Scheme],
                 target: str, metric: str, loss_fn: Any) -> None:
        self.model = copy.deepcopy(model).eval()
        self.layers = layers
        self.candidates = candidates
        self.metric = metric
        self.loss_fn = loss_fn
        self.weights = {w.target: _tensor_of(self.model, w.target)
                        for layer in layers for w in layer.weights}
        # per layer and candidate: {target: quantized weight}, or the reason it does not fit
        self.quantized: list[list[dict[str, torch.Tensor] | str]] = []
        self.shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        for layer in layers:
            row: list[dict[str, torch.Tensor] | str] = []
            for c, scheme in enumerate(candidates):
                qs: dict[str, torch.Tensor] | str = {}
                for w in layer.weights:
                    q, why, shape = _quantized(self.weights[w.target], w, scheme, target)
                    if q is None:
                        qs = f"{w.target}: {why}"
                        break
                    assert isinstance(qs, dict) and shape is not None
                    qs[w.target] = q
                    self.shapes[(w.target, c)] = shape
                row.append(qs)
            self.quantized.append(row)
        self.forwards = 0
        self.backwards = 0

    def fits(self, i: int, c: int) -> bool:
        return isinstance(self.quantized[i][c], dict)

    def run(self, batches: list[Any]) -> np.ndarray:
        """Sums, flat: [per layer and candidate] + [per layer] (sqnr: signal) + [count]."""
        fn = {"sqnr": self._sqnr, "fisher": self._fisher, "loss": self._loss}[self.metric]
        return fn(batches)

    def _forward(self, batch: Any) -> Any:
        args, kwargs = _as_call(batch)
        self.forwards += 1
        return self.model(*args, **kwargs)

    def _device(self) -> torch.device:
        first = next(iter(self.weights.values()))
        return first.device

    def _sqnr(self, batches: list[Any]) -> np.ndarray:
        n_l, n_c = len(self.layers), len(self.candidates)
        # sums stay on the model's device (no synchronisation per layer on a GPU)
        noise = torch.zeros(n_l, n_c, dtype=torch.float64, device=self._device())
        signal = torch.zeros(n_l, dtype=torch.float64, device=self._device())
        seen = [0] * n_l
        handles = []

        def hook(i: int) -> Callable[..., None]:
            module = self.model.get_submodule(self.layers[i].name)

            def fn(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                ref = [r.double() for r in _outputs(output)]
                seen[i] += 1
                for r in ref:
                    signal[i] += r.square().sum()
                for c in range(n_c):
                    qs = self.quantized[i][c]
                    if not isinstance(qs, dict):
                        continue
                    with _swapped(self.model, qs):
                        out = _outputs(module.forward(*args, **kwargs))
                    for o, r in zip(out, ref):
                        noise[i, c] += (o.double() - r).square().sum()
            return fn

        for i, layer in enumerate(self.layers):
            module = self.model.get_submodule(layer.name)
            # first: the output as the layer's forward computed it, before other hooks
            handles.append(module.register_forward_hook(hook(i), with_kwargs=True,
                                                        prepend=True))
        try:
            with torch.no_grad():
                for batch in batches:
                    self._forward(batch)
        finally:
            for h in handles:
                h.remove()
        never = [self.layers[i].name for i in range(n_l) if not seen[i]] if batches else []
        if never:
            raise QCompileError(
                f"qc.search: layer {never[0]!r} was never called as a module in the batches' "
                "forwards, so metric sqnr cannot see its output"
                + (f" ({len(never)} such layers)" if len(never) > 1 else ""),
                fix="use metric fisher or loss (they need loss_fn), or check the batches")
        return np.concatenate([noise.reshape(-1).cpu().numpy(), signal.cpu().numpy(),
                               [len(batches)]])

    def _fisher(self, batches: list[Any]) -> np.ndarray:
        for p in self.model.parameters():
            p.requires_grad_(False)
        for t in self.weights.values():
            t.requires_grad_(True)
        g2 = {k: torch.zeros_like(t, dtype=torch.float32) for k, t in self.weights.items()}
        for batch in batches:
            for t in self.weights.values():
                t.grad = None
            loss = _loss(self._forward(batch), batch, self.loss_fn)
            loss.backward()
            self.backwards += 1
            for k, t in self.weights.items():
                if t.grad is not None:
                    g2[k] += t.grad.float().square()
        n_l, n_c = len(self.layers), len(self.candidates)
        sums = np.zeros((n_l, n_c))
        with torch.no_grad():
            for i in range(n_l):
                for c in range(n_c):
                    qs = self.quantized[i][c]
                    if isinstance(qs, dict):
                        sums[i, c] = sum(
                            0.5 * float((g2[k].double() * (q.double() - self.weights[k].double())
                                         .square()).sum()) for k, q in qs.items())
        return np.concatenate([sums.reshape(-1), np.zeros(n_l), [len(batches)]])

    def _loss(self, batches: list[Any]) -> np.ndarray:
        n_l, n_c = len(self.layers), len(self.candidates)
        sums = torch.zeros(n_l, n_c, dtype=torch.float64, device=self._device())
        with torch.no_grad():
            for batch in batches:
                float_loss = _loss(self._forward(batch), batch, self.loss_fn).double()
                for i in range(n_l):
                    for c in range(n_c):
                        qs = self.quantized[i][c]
                        if not isinstance(qs, dict):
                            continue
                        with _swapped(self.model, qs):
                            loss = _loss(self._forward(batch), batch, self.loss_fn)
                        sums[i, c] += loss.double() - float_loss
        # the loss increase: each quantized loss minus the float one, summed over batches
        return np.concatenate([sums.reshape(-1).cpu().numpy(), np.zeros(n_l), [len(batches)]])


# -- the search ----------------------------------------------------------------------------
def _without_search(spec: CompileSpec) -> dict[str, Any]:
    """The spec minus ``search`` as the fields it was given (the full dump where those
    would not read back equal)."""
    full = spec.model_dump(mode="json")
    full["quant"].pop("search", None)
    target = CompileSpec.model_validate(full)
    small = spec.model_dump(mode="json", exclude_unset=True)
    small.get("quant", {}).pop("search", None)
    try:
        if CompileSpec.model_validate(small) == target:
            return small
    except ValueError:
        pass
    return full


def _fmt(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.3g}"


def search(model: nn.Module, spec: CompileSpec | dict | str | Path, batches: Iterable[Any],
           *, example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None,
           loss_fn: Callable[[Any, Any], Any] | None = None, group: Any = None,
           details: bool = False) -> CompileSpec | tuple[CompileSpec, SearchDetails]:
    """Choose each searched layer's weight scheme among ``spec.quant.search.candidates``
    within the budget; returns the spec without ``search`` and with one rule per chosen
    group (and, with ``details=True``, ``(spec, SearchDetails)``). See the module
    docstring for the metrics, the budgets and the solver.

    ``batches``: tuples of model inputs, dicts of keyword inputs, or single tensors.
    ``loss_fn(output, batch) -> scalar tensor`` for metrics ``loss`` and ``fisher``
    (default: ``output.loss``, as Hugging Face models return with labels). ``group``: the
    process group whose ranks each score their own batches (default: the world, when
    initialised). ``example_inputs`` / ``example_kwargs``: for the compile that finds the
    searched layers (default: the first batch). The model is never modified.
    """
    t0 = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise QCompileError(f"qc.search takes an nn.Module, got {type(model).__name__}",
                            fix="pass the model instance")
    spec = as_spec(spec)
    # before anything that could differ by rank: another model or spec on one rank, or a
    # search on some ranks only, is the same error on every rank, not a hang or one spec
    agree_to_search(model, spec, group, loss_fn=loss_fn is not None)
    s = spec.quant.search
    if s is None:
        raise QCompileError("qc.search: the spec has no quant.search section",
                            fix="add quant.search: {candidates: [...], budget: {...}} to the "
                            "spec, or compile it directly with qc.qcompile")
    batches = list(batches)
    if not batches and world_size(group) == 1:
        raise QCompileError("qc.search: no batches were given", fix="pass a non-empty list "
                            "of batches (tuples of model inputs, or dicts)")
    if example_inputs is None and example_kwargs is None and batches:
        args, kwargs = _as_call(batches[0])
        example_inputs, example_kwargs = args or None, kwargs or None
    base_data = _without_search(spec)
    base = CompileSpec.model_validate(base_data)
    # which layers: one compile of the spec minus search, in one process, no placement
    find = base.model_copy(update={"pipeline": None, "adapters": [],
                                   "data_parallel": base.data_parallel.model_copy(
                                       update={"kind": "none"})})
    discovery = _Discovery(s, model)
    gm = qcompile(model, find, example_inputs, example_kwargs=example_kwargs,
                  instruments=[discovery])
    quantized = {r.node for r in report(gm).quantizers if r.role == "weight"}
    del gm
    layers = []
    for layer in discovery.layers:
        layer.weights = [w for w in layer.weights if w.target in quantized]
        if layer.weights:
            layers.append(layer)
    kept = {layer.name for layer in layers}
    groups = [_Group(g.name, [la for la in g.layers if la.name in kept])
              for g in discovery.groups]
    groups = [g for g in groups if g.layers]
    discovery.groups = groups
    if not layers:
        raise QCompileError("qc.search: no layer gets a weight quantizer under quant.rules, "
                            "so there is nothing to search",
                            fix="give the layers to search a rule with a weight scheme")
    t1 = time.perf_counter()

    candidates = [c.weight for c in s.candidates]
    labels = [c.label() for c in s.candidates]
    with scoring(group):  # (a refused batch on one rank: the same error on every rank)
        _refuse_nonfinite(batches)
        scorer = _Scorer(model, layers, candidates, spec.quant.target, s.metric, loss_fn)
        local = scorer.run(batches)
    fingerprint = {"metric": s.metric, "candidates": labels,
                   "groups": [g.name for g in groups], "layers": [la.name for la in layers]}
    total = reduce_scores(torch.from_numpy(local), fingerprint, group).numpy()
    n_l, n_c = len(layers), len(candidates)
    count = round(float(total[-1]))
    per = total[:n_l * n_c].reshape(n_l, n_c) / max(count, 1)
    signal = total[n_l * n_c:n_l * n_c + n_l]
    index = {la.name: i for i, la in enumerate(layers)}
    t2 = time.perf_counter()

    # per group: scores, costs (bits x elements, bytes), SQNR
    scores, bit_costs, byte_costs, params, sqnrs = [], [], [], [], []
    for g in groups:
        rows = [index[la.name] for la in g.layers]
        numel = sum(math.prod(scorer.weights[w.target].shape) for la in g.layers
                    for w in la.weights)
        gs, gb, gy, gq = [], [], [], []
        for c, scheme in enumerate(candidates):
            fits = all(scorer.fits(i, c) for i in rows)
            if s.metric == "sqnr":
                rel = sum(per[i, c] / signal[i] * count if signal[i] > 0 else
                          (0.0 if per[i, c] == 0 else math.inf) for i in rows)
                noise = sum(per[i, c] * count for i in rows)
                sig = sum(signal[i] for i in rows)
                gq.append(math.inf if noise == 0 else
                          10 * math.log10(sig / noise) if sig > 0 else -math.inf)
            else:
                rel = float(sum(per[i, c] for i in rows))
            gs.append(float(rel) if fits else math.inf)
            gb.append(numel * scheme_bits(scheme))
            gy.append(sum(stored_bytes(scheme, scorer.shapes[(w.target, c)])
                          for la in g.layers for w in la.weights) if fits else 0)
        if not any(math.isfinite(v) for v in gs):
            why = next((scorer.quantized[i][c] for i in rows for c in range(n_c)
                        if not scorer.fits(i, c)), None)
            if why is None:  # every candidate fits, and none scored a finite number
                raise QCompileError(
                    f"qc.search: every candidate scores {gs[0]} for group {g.name!r}: the "
                    "model computes NaN or infinite values there on these batches",
                    fix="run the float model on the batches and find the op that overflows "
                        "(or the NaN it reads); search on batches it computes finitely")
            raise QCompileError(f"qc.search: no candidate fits group {g.name!r}: {why}",
                                fix="add a candidate that fits it (e.g. per_channel), or "
                                "exclude it from the searched rules with a skip rule")
        scores.append(gs)
        bit_costs.append(gb)
        byte_costs.append(gy)
        params.append(numel)
        sqnrs.append(gq if s.metric == "sqnr" else None)
    total_params = sum(params)

    # the choice
    kind, value = s.budget.kind, float(s.budget.value)
    costs = byte_costs if kind == "weight_bytes" else bit_costs
    frontier = solve(costs, scores)

    def summary(choice: list[int]) -> tuple[float, int, float]:
        bits = sum(bit_costs[g][c] for g, c in enumerate(choice)) / total_params
        nbytes = sum(byte_costs[g][c] for g, c in enumerate(choice))
        return bits, int(nbytes), float(sum(scores[g][c] for g, c in enumerate(choice)))

    if kind == "max_loss_increase":
        k = frontier.cheapest_under(value)
        if k is None:
            raise QCompileError(
                f"quant.search.budget.max_loss_increase {value:g} is below the least predicted "
                f"loss increase of any assignment ({_fmt(float(frontier.errors[-1]))})",
                fix=f"raise max_loss_increase to at least {_fmt(float(frontier.errors[-1]))}, "
                "or add a candidate with more bits")
    else:
        limit = value * total_params if kind == "avg_weight_bits" else value
        k = frontier.within(limit)
        if k is None:
            least = float(frontier.costs[0])
            least_shown = (f"{least / total_params:.4g} bits" if kind == "avg_weight_bits"
                           else f"{int(least)} bytes")
            need = least / total_params if kind == "avg_weight_bits" else int(least)
            raise QCompileError(
                f"quant.search.budget.{kind} {value:g} is below the cheapest assignment of the "
                f"searched layers ({least_shown}, every group at its cheapest candidate)",
                fix=f"raise quant.search.budget.{kind} to at least {need:.4g}, or add a "
                "cheaper candidate")
    choice = frontier.choice(k)
    # the curve: the optimum at budgets from all-cheapest to all-largest
    lo, hi = float(frontier.costs[0]), float(frontier.costs[-1])
    pareto, seen_k = [], set()
    for b in np.linspace(lo, hi, 16):
        j = frontier.within(float(b))
        if j is None or j in seen_k:
            continue
        seen_k.add(j)
        ch = frontier.choice(j)
        bits, nbytes, err = summary(ch)
        pareto.append(ParetoPoint(avg_weight_bits=bits, weight_bytes=nbytes,
                                  predicted_error=err,
                                  chosen={g.name: c for g, c in zip(groups, ch)}))
    t3 = time.perf_counter()

    # the spec it returns
    ranks = world_size(group)
    notes = {}
    for gi, g in enumerate(groups):
        parts = []
        for c in range(n_c):
            extra = (f" ({_fmt(sqnrs[gi][c])} dB)" if sqnrs[gi] is not None
                     and math.isfinite(scores[gi][c]) else "")
            parts.append(f"{labels[c]} {_fmt(scores[gi][c])}{extra}")
        notes[g.name] = (f"qc.search, metric {s.metric} over {count} batches: "
                         + ", ".join(parts) + f"; chosen {labels[choice[gi]]}")
    chosen_schemes = {g.name: candidates[c] for g, c in zip(groups, choice)}
    spec_rules = list(base.quant.rules)
    new_rules = discovery.rules(spec_rules, chosen_schemes, notes)
    data = copy.deepcopy(base_data)
    old = [r.model_dump(mode="json", exclude_unset=True) for r in spec_rules]
    for i in discovery.unused:
        old[i]["optional"] = True  # every layer it matched has a rule above it now
    data.setdefault("quant", {})["rules"] = (
        [r.model_dump(mode="json", exclude_unset=True) for r in new_rules] + old)
    found = CompileSpec.model_validate(data)
    if not details:
        return found
    bits, nbytes, err = summary(choice)
    info = SearchDetails(
        metric=s.metric, granularity=s.granularity, budget={kind: s.budget.value},
        candidates=labels, bits=[scheme_bits(c) for c in candidates],
        groups=[SearchGroup(name=g.name, layers=[la.name for la in g.layers],
                            parameters=params[gi], scores=scores[gi], sqnr_db=sqnrs[gi])
                for gi, g in enumerate(groups)],
        chosen={g.name: c for g, c in zip(groups, choice)}, predicted_error=err,
        avg_weight_bits=bits, weight_bytes=nbytes, pareto=pareto,
        seconds={"discovery": t1 - t0, "scoring": t2 - t1, "solving": t3 - t2},
        batches=count, ranks=ranks)
    return found, info
