"""Measuring a compiled graph against its float model: per-layer SQNR (``qc.sqnr``).

Each quantized activation is compared with the float model's value at the same place:
a layer's output after its whole fusion group (conv + BatchNorm (+ ReLU), linear + ReLU,
...), so a static graph whose BatchNorm was folded into the conv is compared with the
float model's BatchNorm output, not with its conv's pre-BatchNorm output.

SQNR (dB) is ``10 * log10(sum(ref ** 2) / sum((ref - q) ** 2))`` over every element of
every batch together (float64): ``inf`` where the quantized value equals the reference
exactly (no error), ``-inf`` where the reference is all zeros but the quantized value is
not (no signal, only noise).

Measuring never changes what it measures: ``qcompile.graph.running.untouched`` runs the
graph in eval mode with every observer off and afterwards puts back each module's
training flag, each quantizer's ``enabled`` / ``observe`` flags and every buffer
(observer statistics, BatchNorm running statistics), so the state_dict is bit-identical
and an uncalibrated graph is not calibrated by the batches it was measured on.

Example:
    >>> import torch, qcompile as qc
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> batches = [torch.randn(4, 8) for _ in range(2)]
    >>> gm = qc.calibrate(qc.qcompile(model, "int8-static", example_inputs=(batches[0],)), batches)
    >>> [r["sqnr_db"] > 20 for r in qc.sqnr(gm, model, batches)]  # the ReLU's output, the input
    [True, True]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

from qcompile.compile import qcompile
from qcompile.errors import QCompileError
from qcompile.graph.layerwise import positional
from qcompile.graph.matching import innermost_owner, layer_of, module_output
from qcompile.graph.meta import FOLDS_KEY, MODULE_KEY, SPEC_KEY
from qcompile.graph.running import untouched
from qcompile.graph.signature import graph_inputs
from qcompile.runtime.calibration import call_args, misfit, refuse_batches_misuse
from qcompile.runtime.fake_quant import FakeQuantize


def sqnr_db(signal: float, noise: float) -> float:
    """``10 * log10(signal / noise)`` for sums of squares: ``inf`` without noise (the
    reference reproduced exactly, zeros included), ``-inf`` for noise without signal.

    Example:
        >>> sqnr_db(100.0, 1.0), sqnr_db(0.0, 0.0), sqnr_db(0.0, 1.0)
        (20.0, inf, -inf)
    """
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def power(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """(``sum(ref ** 2)``, ``sum((ref - out) ** 2)``) in float64."""
    ref, out = ref.detach().double(), out.detach().double()
    return ref.pow(2).sum().item(), (ref - out).pow(2).sum().item()


class _Record(Interpreter):
    """Runs a graph, keeping every node's value."""

    def __init__(self, g: GraphModule) -> None:
        super().__init__(g)
        self.values: dict[str, Any] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        # every value is kept: a quantizer must not write over its input
        # (passes.overwrite_inputs), whatever mode the graph runs in
        kwargs = {k: v for k, v in kwargs.items() if k != "overwrite"}
        return super().call_module(target, args, kwargs)


def _module_outputs(g: GraphModule) -> dict[str, str]:
    """Module name -> the node holding what its (first) call returns, under either front
    end (a ``call_module`` node, or the last op of the module's region on export graphs)."""
    out: dict[str, str] = {}
    for n in g.graph.nodes:
        if n.op == "call_module":
            out.setdefault(str(n.target), n.name)
        elif module_output(n):
            owner = innermost_owner(n)
            if owner:
                out.setdefault(owner, n.name)
    return out


_SQNR_FIX = ("give batches like the example inputs the graph was compiled with (same names, "
             "dtypes and non-batch dimensions)")


def _graph(gm: nn.Module) -> GraphModule:
    inner = getattr(gm, "module", None)  # a DDP / DataParallel wrapper: measure its graph
    if not isinstance(gm, GraphModule) and isinstance(inner, GraphModule):
        gm = inner
    if not isinstance(gm, GraphModule) or SPEC_KEY not in gm.meta:
        raise QCompileError(
            f"qc.sqnr measures a graph returned by qc.qcompile, got {type(gm).__name__}",
            fix="pass qc.qcompile(model, spec, ...) (calibrated or trained) as the first "
                "argument and the float model as the second")
    return gm


def _refuse_nonfinite(index: int, args: tuple, kwargs: dict, names: list[str]) -> None:
    """A NaN or inf in a batch would make every SQNR after it -inf or NaN: say where."""
    named = [(names[i] if i < len(names) else f"input {i}", v) for i, v in enumerate(args)]
    for name, v in [*named, *kwargs.items()]:
        if (isinstance(v, torch.Tensor) and v.is_floating_point()
                and not bool(torch.isfinite(v).all())):
            nan = int(torch.isnan(v).sum())
            raise QCompileError(
                f"qc.sqnr: batch {index}: input {name} has {nan} NaN and "
                f"{v.numel() - nan - int(torch.isfinite(v).sum())} infinite values",
                fix="measure on finite data (drop or clean the batch)")


def sqnr(gm: nn.Module, reference_model: nn.Module, batches: Iterable[Any], *,
         inputs: Callable[[Any], Any] | None = None) -> list[dict[str, Any]]:
    """Per quantized activation, SQNR (dB) of the node's output against the float
    model's output at the same place (after the layer's whole fusion group: a folded
    BatchNorm's output, not the conv's), over all ``batches`` together, worst first:
    ``[{"node": ..., "sqnr_db": ...}]`` (``inf``: no error; ``-inf``: a reference of
    zeros, see the module docstring).

    ``batches`` take the forms ``qc.calibrate`` takes: tuples of positional inputs, dicts
    of keyword inputs, or single tensors; ``inputs`` maps each batch to those first
    (``inputs=lambda b: b[0]`` for a DataLoader of ``(x, y)`` pairs). ``gm`` is used as
    it is (qparams as they are; freeze or calibrate it first), in eval mode with its
    observers off; afterwards it (and ``reference_model``, which is only copied) is
    exactly as before: measuring never calibrates or trains anything.

    Example:
        >>> import torch, qcompile as qc
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> xs = [{"input": torch.randn(4, 8)} for _ in range(2)]
        >>> gm = qc.qcompile(model, "int8-static", example_kwargs=xs[0])
        >>> gm = qc.calibrate(gm, xs, progress=False)
        >>> rows = qc.sqnr(gm, model, xs)  # worst first
        >>> sorted(row["node"] for row in rows), rows[0]["sqnr_db"] <= rows[1]["sqnr_db"]
        (['_1', 'input_1'], True)
    """
    gm = _graph(gm)
    if not isinstance(reference_model, nn.Module):
        raise QCompileError(f"qc.sqnr: reference_model is a {type(reference_model).__name__}, "
                            "not the float model", fix="pass the float nn.Module the graph "
                            "was compiled from: qc.sqnr(gm, model, batches)")
    if any(name.startswith("stage_") for name, _ in gm.named_children()):
        raise QCompileError("qc.sqnr measures unsplit graphs",
                            fix="compile without the pipeline section for the error report")
    signature = graph_inputs(gm)
    refuse_batches_misuse(batches, inputs, "qc.sqnr")
    try:
        calls = call_args(batches, inputs, signature)
    except QCompileError as e:  # worded for qc.calibrate: say qc.sqnr
        raise QCompileError(e.message.replace("calibration batch", "qc.sqnr: batch"),
                            fix=(e.fix or "").replace("qc.calibrate", "qc.sqnr")) from None
    if not calls:
        raise QCompileError("qc.sqnr: no batches were given", fix="pass a non-empty iterable")
    for index, (args, kwargs) in enumerate(calls):  # names and counts, before any work
        try:
            positional(gm, args, kwargs)
        except TypeError as e:
            raise misfit(e, index, args, kwargs, signature, what="qc.sqnr: batch",
                         fix=_SQNR_FIX) from None
        _refuse_nonfinite(index, args, kwargs, [i.name for i in signature])
    spec = gm.meta.get(SPEC_KEY)
    trace = spec.trace.model_dump() if spec is not None else {}
    args0, kwargs0 = calls[0]
    float_gm = qcompile(reference_model, {"quant": {"mode": "none"}, "trace": trace},
                        args0 or None, example_kwargs=kwargs0 or None).eval()
    float_names = {n.name for n in float_gm.graph.nodes}
    by_module = {str(n.target): n.name for n in float_gm.graph.nodes if n.op == "call_module"}
    outputs = _module_outputs(float_gm)
    # a BatchNorm folded into a layer (static / dynamic graphs): the layer's output is the
    # BatchNorm's, so the reference is the float model's BatchNorm output
    folded_into = {fold.weight.rpartition(".")[0]: fold.bn
                   for fold in (gm.meta.get(FOLDS_KEY) or {}).values()}

    def pairing(src: Node) -> tuple[str, str] | None:
        """(the row's name, the float node holding the reference value) for ``src``."""
        module = src.meta.get(MODULE_KEY)
        # re-expressed Linear/Conv calls are renamed: match them by their module
        if module is not None and module in by_module:
            name = by_module[module]
        elif src.name in float_names:
            name = src.name
        else:
            return None
        bn = folded_into.get(layer_of(src) or "")
        if bn is not None:
            return (name, outputs[bn]) if bn in outputs else None
        return name, name

    measured: list[tuple[str, str, str]] = []  # (row, float node, quantizer node)
    for n in gm.graph.nodes:
        if n.op != "call_module" or not isinstance(gm.get_submodule(str(n.target)),
                                                   FakeQuantize):
            continue
        src = n.args[0]
        pair = pairing(src) if isinstance(src, Node) and src.op != "get_attr" else None
        if pair is not None:
            measured.append((*pair, n.name))

    if not measured and any(not q.weight for q in gm.modules() if isinstance(q, FakeQuantize)):
        # nothing of the graph has a counterpart in the reference: not the model compiled
        raise QCompileError(
            f"qc.sqnr: the reference model ({type(reference_model).__name__}) has none of the "
            "graph's quantized layers, so nothing can be compared",
            fix="pass the float model the graph was compiled from as the second argument")
    sums: dict[str, list[float]] = {}
    with untouched(gm):
        for index, (args, kwargs) in enumerate(calls):
            q, f = _Record(gm), _Record(float_gm)
            try:
                q.run(*positional(gm, args, kwargs))
                f.run(*positional(float_gm, args, kwargs))
            except QCompileError:
                raise
            except Exception as e:
                raise misfit(e, index, args, kwargs, signature, what="qc.sqnr: batch",
                             fix=_SQNR_FIX) from None
            for row, ref_name, q_name in measured:
                a, b = f.values.get(ref_name), q.values[q_name]
                if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
                        a.shape == b.shape):
                    total = sums.setdefault(row, [0.0, 0.0])
                    signal, noise = power(a, b)
                    total[0] += signal
                    total[1] += noise
    return sorted(({"node": k, "sqnr_db": sqnr_db(*v)} for k, v in sums.items()),
                  key=lambda r: r["sqnr_db"])
