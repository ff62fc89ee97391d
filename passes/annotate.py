"""``annotate``: decide, per node, which spec rule applies.

The first matching rule wins, except that a matching ``skip`` rule always wins for its
nodes. The choice is stored as ``node.meta[QSCHEME_KEY]`` (a ``NodeQScheme``
with the rule index). A rule that selects no node is an error (unless ``optional``),
naming the rule and what the graph does contain. Layers with a weight that no rule selects
(neither quantized nor skipped) are named in a note: nothing stays in float silently.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": [
    ...     {"match": {"module": "Conv2d"}, "weight": {"dtype": "int8"}}]}})
    >>> qc.qcompile(m, spec)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    qcompile.errors.QCompileError: quant.rules[0] (module: Conv2d) matched no node; ...
      fix: correct the match, remove the rule, or set optional: true on it
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import GraphModule, Node

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.matching import (
    NodeQScheme,
    candidate_kinds,
    is_weighted_call,
    layer_of,
    match_node,
    module_output,
    op_name,
    owners,
    sensitive_values,
    weighted_module_op,
)
from qcompile.graph.meta import QSCHEME_KEY
from qcompile.graph.pipeline import graph_pass
from qcompile.specs import Rule


def _describe(rule: Rule) -> str:
    m = rule.match
    fields = [(k, v) for k, v in (("module", m.module), ("name", m.name), ("op", m.op)) if v]
    text = ", ".join(f"{k}: {v[0] if len(v) == 1 else v}" for k, v in fields)
    return text + (", reads_weight: true" if m.reads_weight else "")


def _contents(modules: frozenset[str], ops: frozenset[str]) -> str:
    seen = [f"modules {', '.join(sorted(modules))}" if modules else "",
            f"ops {', '.join(sorted(ops))}" if ops else ""]
    return " and ".join(s for s in seen if s) or "no call nodes"


@dataclass(frozen=True)
class Assignment:
    """What ``assign_rules`` decided: nodes each rule won, how many it matched at all, and
    the module classes / ops the graph contains (for error messages)."""

    won: dict[int, list[str]]
    matched: dict[int, int]
    modules_seen: frozenset[str]
    ops_seen: frozenset[str]
    # op-only rules' nodes left in float because they feed a sensitive op, by that op
    spared: dict[str, list[str]] = field(default_factory=dict)
    spared_by: dict[int, int] = field(default_factory=dict)  # the same, counted per rule


def assign_rules(gm: GraphModule, rules: list[Rule]) -> Assignment:
    """Annotate every call node with its winning rule; never raises (see ``annotate``)."""
    won: dict[int, list[str]] = {i: [] for i in range(len(rules))}
    matched: dict[int, int] = {i: 0 for i in range(len(rules))}
    modules_seen: set[str] = set()
    ops_seen: set[str] = set()
    # (rule, owner) pairs whose module computes its weighted op in a node of its own
    weighted: set[tuple[int, str]] = set()
    # what feeds rsqrt / a division / exp / softmax: op-only rules leave its output float
    sensitive = sensitive_values(gm) if any(_op_only(r) for r in rules) else {}
    spared: dict[str, list[str]] = {}
    spared_by: dict[int, int] = {}  # rule -> nodes it matched but leaves float
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        own = owners(node, gm)
        if own and node.op == "call_module":
            modules_seen.add(own[0].cls_name)
        op = op_name(node)
        if op is not None:
            ops_seen.add(op)
        # What makes a node a candidate does not depend on the rule: decide it once.
        by_module, by_op = candidate_kinds(node)
        hits = [(i, hit) for i, rule in enumerate(rules)
                if (by_op if rule.match.op is not None else by_module)
                and (hit := match_node(rule.match, node, own)) is not None]
        why = sensitive.get(node)
        if why is not None and hits:
            kept = [(i, h) for i, h in hits if not _spares(rules[i], node)]
            if len(kept) < len(hits):
                spared.setdefault(why, []).append(node.name)
                for pair in hits:
                    if pair not in kept:
                        spared_by[pair[0]] = spared_by.get(pair[0], 0) + 1
            hits = kept
        if not hits:
            continue
        for i, _ in hits:
            matched[i] += 1
        i, hit = next(((i, h) for i, h in hits if rules[i].skip), hits[0])
        rule = rules[i]
        activation, weight = rule.activation, rule.weight
        if why is not None and _op_only(rule) and rule.activation_at == "output":
            activation = None  # the weight of a weighted op is quantized, not its output
        if rule.match.op is None and not module_output(node):
            # A module rule quantizes what the module returns; an op inside it that only
            # consumes the weight (GPT-2 Conv1D's addmm, before its view) gets the weight
            # scheme alone, or the module's output would be quantized twice.
            activation = None
        if rule.match.op is None and is_weighted_call(node):
            weighted.add((i, hit))
        elif (i, hit) in weighted:
            weight = None  # the module's weight is its weighted op's (quantized there)
        node.meta[QSCHEME_KEY] = NodeQScheme(
            rule=i, skip=rule.skip, weight=weight, activation=activation, matched=hit
        )
        won[i].append(node.name)
    return Assignment(won, matched, frozenset(modules_seen), frozenset(ops_seen), spared,
                      spared_by)


def _op_only(rule: Rule) -> bool:
    """A rule selecting by op alone (no module, no name): it names no particular value."""
    m = rule.match
    return m.op is not None and m.module is None and m.name is None and not rule.skip


def _spares(rule: Rule, node: Node) -> bool:
    """Whether an op-only rule passes over a sensitive ``node`` altogether: it would only
    quantize the node's output (a rule with a weight scheme still quantizes a weighted
    op's weight, its output stays float)."""
    return (_op_only(rule) and rule.activation_at == "output"
            and (rule.weight is None or not is_weighted_call(node)))


@graph_pass(requires=("graph", "fusion_groups"), provides=("annotations",),
            needs_code=False)
def annotate(gm: GraphModule, ctx: Context) -> GraphModule:
    """Attach the winning rule (if any) to every call node; a rule that selects nothing
    is an error."""
    rules = ctx.spec.quant.rules
    result = assign_rules(gm, rules)
    won, matched = result.won, result.matched
    modules_seen, ops_seen = result.modules_seen, result.ops_seen
    for i, rule in enumerate(rules):
        if won[i] or rule.optional:
            continue
        if result.spared_by.get(i):
            raise QCompileError(
                f"quant.rules[{i}] ({_describe(rule)}) selects nothing: the "
                f"{result.spared_by[i]} node(s) it matches all feed a numerically sensitive "
                "op (rsqrt, a division, exp, log, softmax), which rules selecting by op alone "
                "leave in float",
                fix="name the nodes' module in the rule (match.name) to quantize them "
                    "anyway, set optional: true, or remove the rule")
        if matched[i]:
            raise QCompileError(
                f"quant.rules[{i}] ({_describe(rule)}) selects nothing: the {matched[i]} "
                "node(s) it matches are all taken by earlier rules (first match wins)",
                fix="move the rule before the rules that shadow it, or remove it",
            )
        raise QCompileError(
            f"quant.rules[{i}] ({_describe(rule)}) matched no node; the graph has "
            f"{_contents(modules_seen, ops_seen)}",
            fix="correct the match, remove the rule, or set optional: true on it",
        )
    if rules and ctx.spec.quant.mode != "none" and not any(won.values()):
        # every rule is optional (a preset's are) and none applies
        raise QCompileError(
            f"quant.rules select nothing to quantize in this model; the graph has "
            f"{_contents(modules_seen, ops_seen)}",
            fix="add a rule that matches one of them (match: {module: ...} or {op: ...}), "
                "or use quant.mode: none" + (
                    "; embedding tables are quantized by the w8-weight-only preset"
                    if modules_seen & {"Embedding", "EmbeddingBag"} else ""))
    ctx.rule_matches = {i: names for i, names in won.items() if names}
    for why, names in sorted(result.spared.items()):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        ctx.note(f"{len(names)} node(s) feeding {why} stay in float under op rules (a value "
                 f"rounded there becomes an infinity or a large error): {shown}; a rule "
                 "naming them (match.name) quantizes them")
    for i, names in won.items():
        if rules[i].skip:
            ctx.note(f"rule {i} keeps {len(names)} node(s) in float")
    unselected = unselected_layers(gm)
    if rules and unselected:
        shown = ", ".join(f"{name} ({cls})" for name, cls in unselected[:6])
        more = f" and {len(unselected) - 6} more" if len(unselected) > 6 else ""
        ctx.note(f"{len(unselected)} weighted layer(s) selected by no rule stay in float: "
                 f"{shown}{more}")
    return gm


def unselected_layers(gm: GraphModule) -> list[tuple[str, str]]:
    """(layer, module class) of every layer with a weight (Linear, Conv, Embedding, or an
    op such as GPT-2 Conv1D's ``addmm`` reading a parameter) that no rule selected, skip
    rules included: what the spec leaves in float without saying so."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if QSCHEME_KEY in node.meta:
            continue
        if weighted_module_op(gm, node) is None and not is_weighted_call(node):
            continue
        own = owners(node, gm)
        layer = layer_of(node) or node.name
        found.setdefault(layer, own[0].cls_name if own and own[0].name else "op")
    return sorted(found.items())
