"""Running the data-driven entries of ``quant.algorithms`` (``bias_correction``,
``adaround``, ``gptq``) on calibration batches.

Compiling plans them (``plan``: their pass, after ``insert_quant``, checks there are
layers to work on and records the entry as pending in ``gm.meta``); ``qc.calibrate`` runs
them (``run_pending``), in the spec's order, before the observers see the data (so the
activation ranges are those of the final weights). Each algorithm is a function
``(Data, index, entry) -> notes`` from its pass file; its notes land in the report as a
record named ``<pass>.calibrate``. A failure restores every weight and bias it touched.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.graph.algorithms import pending
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "static",
    ...     "algorithms": [{"kind": "gptq"}],
    ...     "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "int4"}}]}})
    >>> gm = qc.qcompile(torch.nn.Linear(8, 4), spec, example_inputs=(torch.randn(2, 8),))
    >>> pending(gm)
    [0]
    >>> gm = qc.calibrate(gm, [torch.randn(16, 8) for _ in range(2)])
    >>> pending(gm), qc.report(gm).passes[-1].name
    ([], 'round_gptq.calibrate')
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.layerwise import (
    QuantLayer,
    Reduce,
    Stats,
    Sweep,
    Walker,
    levels,
    other_weights,
    output_error,
    parameters_as,
    quantized_layers,
    round_to_grid,
    weight_grid,
)
from qcompile.graph.meta import FIXED_GRID_KEY, PENDING_ALGORITHMS_KEY, REPORT_KEY, SPEC_KEY
from qcompile.graph.records import PassRecord
from qcompile.graph.running import untouched
from qcompile.runtime.block_formats import fake_quant_eager
from qcompile.runtime.calibration import quantizers
from qcompile.specs.quant import FP8_MAX


def pending(gm: nn.Module) -> list[int]:
    """Indices into ``quant.algorithms`` of the entries still waiting for data."""
    return list(getattr(gm, "meta", {}).get(PENDING_ALGORITHMS_KEY, []))


def refuse_pending(gm: nn.Module, what: str) -> None:
    """``what`` (convert, an export) needs the algorithms' weights: refuse while a
    data-driven entry of ``quant.algorithms`` has not run."""
    todo = pending(gm)
    if todo:
        kind = gm.meta[SPEC_KEY].quant.algorithms[todo[0]].kind  # type: ignore[union-attr]
        raise QCompileError(f"{what}: {where(todo[0], kind)} has not run yet: it chooses the "
                            "weights from calibration data",
                            fix="run qc.calibrate(gm, batches) first")


def where(index: int, kind: str) -> str:
    return f"quant.algorithms[{index}] ({kind})"


def _shared(layers: Sequence[QuantLayer]) -> set[tuple[str, str]]:
    seen: dict[tuple[str, str], int] = {}
    for layer in layers:
        seen[(layer.owner, layer.weight)] = seen.get((layer.owner, layer.weight), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def usable(gm: nn.Module, *, gram: bool, blocks: bool = True
           ) -> tuple[list[QuantLayer], list[tuple[str, str]]]:
    """The layers an algorithm can work on, and (name, why) for the others: integer weight
    grids (fp8's is not uniform) and, where the algorithm takes them (``blocks``),
    block-scaled weights; one layer per weight; and, for the algorithms that need the
    inputs' Gram matrix (``gram``), linear and ungrouped 1-/2-d convolutions."""
    layers = quantized_layers(gm)
    shared = _shared(layers)
    ok, skipped = [], []
    for layer in layers:
        q = layer.get_quantizer(gm)
        reason = None
        if q.dtype in FP8_MAX:
            reason = f"{q.dtype} weights (not an integer grid)"
        elif q.block_format is not None and not blocks:
            reason = f"{q.dtype} weights (block-scaled: no fixed grid to round onto)"
        elif (layer.owner, layer.weight) in shared or not layer.exclusive:
            reason = "its weight is shared with another layer or op"
        elif gram:
            reason = layer.why_no_gram()
        if reason is None:
            ok.append(layer)
        else:
            skipped.append((layer.name, reason))
    skipped += [(name, "read by an op other than conv/linear (a fused expert weight, bmm, "
                       "einsum ...)") for name in other_weights(gm, layers)]
    return ok, skipped


def plan(gm: GraphModule, ctx: Context, index: int, kind: str, *, gram: bool,
         verb: str, blocks: bool = True) -> GraphModule:
    """The compile-time half of a data-driven algorithm's pass: there must be layers for
    it; the entry is recorded as pending until ``qc.calibrate`` runs it."""
    here = where(index, kind)
    ok, skipped = usable(gm, gram=gram, blocks=blocks)
    if not ok:
        why = "; ".join(f"{name}: {reason}" for name, reason in skipped[:3])
        raise QCompileError(
            f"{here}: no layer to {verb}: it works on conv/linear layers whose weight is "
            "quantized to an integer or block-scaled dtype" + (f" ({why})" if why else
                                               ", and no rule quantizes a weight"),
            fix="add a rule with a weight scheme (e.g. {match: {module: Linear}, weight: "
            f"{{dtype: int4}}}}) for the layers, or remove {kind} from quant.algorithms")
    gm.meta.setdefault(PENDING_ALGORITHMS_KEY, []).append(index)
    names = ", ".join(layer.name for layer in ok[:6]) + (" ..." if len(ok) > 6 else "")
    ctx.note(f"{here}: {len(ok)} layer(s) wait for calibration data (qc.calibrate): {names}")
    for name, reason in skipped:
        ctx.note(f"{here}: {name} left to round-to-nearest: {reason}")
    return gm


@dataclass(frozen=True)
class Data:
    """What a data-driven algorithm works with: the graph, the calibration batches as
    ``(args, kwargs)``, how to sum statistics across ranks (None: one process), the
    parameters' values before any algorithm ran (the float reference) and whether to
    show progress."""

    gm: GraphModule
    batches: Sequence[tuple[tuple, dict]]
    reduce: Reduce | None
    originals: dict[str, torch.Tensor]
    progress: bool

    def by_level(self, layers: Sequence[QuantLayer], *, gram: bool = False,
                 mean: bool = False, desc: str = "") -> Iterator[tuple[list[QuantLayer], Stats]]:
        """Level by level (see ``layerwise.levels``), the statistics of that level's layers
        measured through the graph as the caller has rewritten it so far: quantizers as
        they are (weights fake-quantized; a static graph's activations not yet), no
        observer updated, nothing else changed."""
        level = levels(self.gm, layers)
        groups: dict[int, list[QuantLayer]] = {}
        for layer in layers:
            groups.setdefault(level[layer], []).append(layer)
        steps: Any = [groups[k] for k in sorted(groups)]
        if self.progress and sys.stderr.isatty():
            from tqdm import tqdm

            steps = tqdm(steps, desc=desc, unit="level", leave=False)
        walker = Walker(self.gm, self.batches, reduce=self.reduce) if Walker.fits(
            self.gm) else None
        for group in steps:
            if walker is None:
                yield group, self.sweep(gram=group if gram else (), mean=group if mean else ())
                continue
            with untouched(self.gm):
                stats = walker.sweep(gram=group if gram else (), mean=group if mean else ())
            yield group, stats

    def sweep(self, *, gram: Sequence[QuantLayer] = (), mean: Sequence[QuantLayer] = (),
              float_model: bool = False) -> Stats:
        """One pass over the batches; ``float_model``: with every quantizer off and the
        original parameters (the float reference)."""
        with parameters_as(self.gm, self.originals if float_model else {}), \
                untouched(self.gm):
            if float_model:
                for q in quantizers(self.gm).values():
                    q.enabled = False
            return Sweep(self.gm, self.batches, gram=gram, mean=mean,
                         reduce=self.reduce).run()


Applier = Callable[[Data, int, Any], list[str]]


def set_parameter(gm: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the parameter ``name`` (qualified) by a new one holding ``value`` (never
    writing into the old tensor, which an ``inplace`` compile shares with the user)."""
    parent, _, leaf = name.rpartition(".")
    mod = gm.get_submodule(parent) if parent else gm
    old = mod._parameters[leaf]
    assert old is not None
    mod._parameters[leaf] = nn.Parameter(value.detach().to(old.dtype).reshape(old.shape),
                                         requires_grad=old.requires_grad)


def fix_grid(gm: nn.Module, layer: QuantLayer) -> None:
    """``layer``'s weight now lies on its quantizer's grid: keep that grid (calibration
    must not observe the weight again) and drop the quantizer's cached copy."""
    q = layer.get_quantizer(gm)
    q.clear_weight_cache()
    name = f"{layer.owner}.{layer.quantizer}" if layer.owner else layer.quantizer
    fixed = gm.meta.setdefault(FIXED_GRID_KEY, [])  # type: ignore[union-attr]
    if name not in fixed:
        fixed.append(name)


def run_pending(gm: GraphModule, batches: Sequence[tuple[tuple, dict]],
                appliers: dict[str, tuple[str, Applier]], *, reduce: Reduce | None,
                progress: bool) -> None:
    """Run every pending entry on ``batches`` (``(args, kwargs)`` pairs), in order. On
    any error every parameter is put back (the objects themselves) and nothing is
    recorded: a refused calibration changes no weight."""
    todo = pending(gm)
    if not todo:
        return
    entries = gm.meta[SPEC_KEY].quant.algorithms
    params = dict(gm.named_parameters())
    originals = {n: p.detach() for n, p in params.items()}
    fixed_before = list(gm.meta.get(FIXED_GRID_KEY, []))
    data = Data(gm, batches, reduce, originals, progress)
    records = []
    try:
        for index in todo:
            entry = entries[index]
            name, apply = appliers[entry.kind]
            t0 = time.perf_counter()
            notes = apply(data, index, entry)
            records.append(PassRecord(name=f"{name}.calibrate",
                                      seconds=time.perf_counter() - t0,
                                      nodes_before=len(gm.graph.nodes),
                                      nodes_after=len(gm.graph.nodes), notes=notes))
    except BaseException:
        for n, p in params.items():  # the very objects: optimizers holding them still work
            parent, _, leaf = n.rpartition(".")
            mod = gm.get_submodule(parent) if parent else gm
            mod._parameters[leaf] = p
        with torch.no_grad():  # a bias bias_correction added: back to adding nothing
            for n, p in gm.named_parameters():
                if n not in params:
                    p.zero_()
        for q in quantizers(gm).values():
            q.clear_weight_cache()
        gm.meta[FIXED_GRID_KEY] = fixed_before
        raise
    gm.meta[PENDING_ALGORITHMS_KEY] = []
    report = gm.meta.get(REPORT_KEY)
    if report is not None:
        report.passes.extend(records)


def no_data(here: str, layer: QuantLayer) -> QCompileError:
    return QCompileError(f"{here}: layer {layer.name} saw no calibration data (no batch "
                         "reached it)",
                         fix="give calibration batches that run the whole model, or leave "
                         "the layer unquantized with a rule {skip: true}")


# A rounding solver: (weight [out, k], H = X^T X, rows, scale, zero point, quant_min,
# quant_max) -> (the weight on its grid, what to add to the layer's note).
# solve(w, gram, rows, scale, zero_point, quant_min, quant_max, quantizer) -> (new weight,
# note); scale and zero_point are None for a block-scaled weight (its grid comes from it)
Solver = Callable[[torch.Tensor, torch.Tensor, int, Any, Any, int, int, Any],
                  tuple[torch.Tensor, str]]


def round_layers(data: Data, index: int, kind: str, solve: Solver, *,
                 blocks: bool = False) -> list[str]:
    """Round every usable layer's weight with ``solve``, level by level: write it, keep its
    grid, and note its output error on the data against round-to-nearest's. ``blocks``:
    ``solve`` also takes block-scaled weights (round-to-nearest is then their fake-quant)."""
    gm, here = data.gm, where(index, kind)
    layers, skipped = usable(gm, gram=True, blocks=blocks)
    notes = []
    for group, stats in data.by_level(layers, gram=True, desc=kind):
        for layer in group:
            if not stats.rows.get(layer):
                raise no_data(here, layer)
            q = layer.get_quantizer(gm)
            weight = layer.get_weight(gm)
            w = weight.detach().float().reshape(weight.shape[0], -1)
            gram, rows = stats.gram[layer], stats.rows[layer]
            if q.block_format is not None:
                scale = zero_point = None
                nearest = fake_quant_eager(w, q.block_format, int(q.group_size))
            else:
                scale, zero_point = weight_grid(q, weight)
                nearest = round_to_grid(w, scale, zero_point, q.quant_min, q.quant_max)
            new, extra = solve(w, gram, rows, scale, zero_point, q.quant_min, q.quant_max, q)
            g, w64 = gram.double(), w.double()
            before = output_error(nearest.double() - w64, g, rows)
            after = output_error(new.double() - w64, g, rows)
            name = f"{layer.owner}.{layer.weight}" if layer.owner else layer.weight
            set_parameter(gm, name, new.to(weight.device))
            fix_grid(gm, layer)
            share = f"{100 * after / before:.0f}% of" if before > 0 else "vs"
            notes.append(f"{layer.name} ({'x'.join(map(str, w.shape))}): output error "
                         f"{before:.3g} -> {after:.3g} ({share} round-to-nearest){extra}")
    notes += [f"{name} left to round-to-nearest: {reason}" for name, reason in skipped]
    return notes
