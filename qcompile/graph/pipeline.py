"""Passes and the pipeline that runs them.

A pass is a plain function ``(GraphModule | None, Context) -> GraphModule`` wrapped by
``graph_pass`` with the facts it requires and provides. ``Pipeline`` checks that chain
once when built, runs the passes in order, lints the graph after each pass that changed
it and recompiles it (so every pass, and every instrument, gets a valid graph whose
``forward`` is its code; passes that only rewrite nodes, ``needs_code=False``, share one
code generation after the last of them), records a ``PassRecord`` per pass and calls the
instruments (graph dumps, timing), which live outside the passes.

Example:
    >>> from qcompile.graph.pipeline import graph_pass, Pipeline
    >>> @graph_pass(requires=("graph",), provides=("tidy",))
    ... def tidy(gm, ctx):
    ...     return gm
    >>> Pipeline([tidy])
    Traceback (most recent call last):
    ...
    qcompile.errors.QCompileError: pass 'tidy' requires 'graph', which no earlier pass provides
      fix: put a pass providing 'graph' before 'tidy'
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch.fx

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.records import PassRecord, Report

PassFn = Callable[[torch.fx.GraphModule | None, Context], torch.fx.GraphModule]


def code_state(gm: torch.fx.GraphModule) -> tuple:
    """What ``gm.code`` is generated from: the graph, its codegen, and each node's name, op,
    target, arguments and type, in order. Nodes' arguments are immutable (fx replaces the
    tuples on every change), so comparing by identity (``same_code_state``) detects any
    change; a false "changed" only costs a recompile."""
    g = gm.graph
    return (gm, g, g._codegen,
            [(n, n.name, n.op, n.target, n.args, n.kwargs, n.type) for n in g.nodes])


def same_code_state(a: tuple | None, b: tuple) -> bool:
    if a is None or len(a[3]) != len(b[3]) or any(x is not y for x, y in zip(a[:3], b[:3])):
        return False
    return all(x is y for na, nb in zip(a[3], b[3]) for x, y in zip(na, nb))


def mark_compiled(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """Tell the pipeline that ``gm.code`` is current (a pass that just built the
    GraphModule, which compiles it), so it is not recompiled unless changed. The graph is
    linted here, as the pipeline lints only the graphs it sees change."""
    gm.graph.lint()
    ctx.code_state = code_state(gm)


@dataclass(frozen=True)
class Pass:
    """A named graph pass and the facts it requires / provides. ``needs_code``: the pass
    runs the graph or reads its code, so it gets a graph whose code is current; a pass
    that only reads and rewrites nodes says False, and the code of the graph it gets may
    still be that of an earlier graph (the pipeline generates it once for a run of such
    passes, ``Context.code_may_wait``)."""

    name: str
    fn: PassFn
    requires: frozenset[str] = frozenset()
    provides: frozenset[str] = frozenset()
    needs_code: bool = True

    def __call__(self, gm: torch.fx.GraphModule | None, ctx: Context) -> torch.fx.GraphModule:
        return self.fn(gm, ctx)


def graph_pass(
    *, requires: Iterable[str] = (), provides: Iterable[str] = (), needs_code: bool = True
) -> Callable[[PassFn], Pass]:
    """Decorator turning a function into a ``Pass`` named after the function."""

    def wrap(fn: PassFn) -> Pass:
        return Pass(fn.__name__, fn, frozenset(requires), frozenset(provides), needs_code)

    return wrap


class Instrument(Protocol):
    """Observes the pipeline from outside the passes: ``after_pass`` after each pass,
    ``finish`` once with the final Report."""

    def after_pass(
        self, index: int, record: PassRecord, gm: torch.fx.GraphModule, ctx: Context
    ) -> None: ...

    def finish(self, report: Report, gm: torch.fx.GraphModule) -> None: ...


@dataclass(frozen=True)
class Pipeline:
    """An ordered, checked sequence of passes."""

    passes: Sequence[Pass]
    initial_facts: frozenset[str] = frozenset({"model"})

    def __post_init__(self) -> None:
        have = set(self.initial_facts)
        for p in self.passes:
            missing = sorted(p.requires - have)
            if missing:
                raise QCompileError(
                    f"pass {p.name!r} requires {missing[0]!r}, which no earlier pass provides",
                    fix=f"put a pass providing {missing[0]!r} before {p.name!r}",
                )
            have |= p.provides

    def run(
        self,
        ctx: Context,
        gm: torch.fx.GraphModule | None = None,
        instruments: Sequence[Instrument] = (),
    ) -> tuple[torch.fx.GraphModule, list[PassRecord]]:
        records: list[PassRecord] = []
        stale = False  # gm's code is not that of its graph yet
        for i, p in enumerate(self.passes, start=1):
            before = {n.name for n in gm.graph.nodes} if gm is not None else set()
            ctx.notes = []
            # Code generation costs more than most passes: only for a changed graph (a pass
            # that only annotates nodes leaves the code as it was, and the graph as linted),
            # and once for a run of passes that only rewrite nodes, unless instruments look.
            later = self.passes[i] if i < len(self.passes) else None
            ctx.code_may_wait = later is not None and not later.needs_code and not instruments
            t0 = time.perf_counter()
            gm = p(gm, ctx)
            state = code_state(gm)
            if not same_code_state(ctx.code_state, state):
                gm.graph.lint()
                stale = True
            if stale and not ctx.code_may_wait:
                gm.recompile()
                stale = False
            ctx.code_state = state
            seconds = time.perf_counter() - t0
            after = [n.name for n in gm.graph.nodes]
            after_set = set(after)
            record = PassRecord(
                name=p.name,
                seconds=seconds,
                nodes_before=len(before),
                nodes_after=len(after),
                added=[n for n in after if n not in before],
                removed=sorted(before - after_set),
                notes=list(ctx.notes),
            )
            records.append(record)
            for inst in instruments:
                inst.after_pass(i, record, gm, ctx)
        if gm is None:
            raise QCompileError("the pipeline has no passes", fix="include the trace pass")
        return gm, records
