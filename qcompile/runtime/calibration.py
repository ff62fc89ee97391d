"""Driving a graph's quantizers: find them, observe data (calibration), freeze them.

These work on any module holding ``FakeQuantize`` children; the public wrappers with
their mode checks and cross-rank sync are ``qc.calibrate`` / ``qc.freeze``.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.runtime.calibration import collect_statistics, quantizers
    >>> gm = qc.qcompile(torch.nn.Linear(4, 4), "int8-static", example_inputs=(torch.randn(2, 4),))
    >>> gm = collect_statistics(gm, [torch.randn(2, 4) for _ in range(3)])
    >>> all(q.enabled and not q.observe for q in quantizers(gm).values())
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.errors import QCompileError
from qcompile.runtime.fake_quant import FakeQuantize


@dataclass(frozen=True)
class GraphInput:
    """One input of a compiled graph, as its example input was: for error messages."""

    name: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    variadic: bool = False  # *args: any number of values

    def __str__(self) -> str:
        if self.shape is None or self.dtype is None:
            return self.name
        return f"{self.name}: {str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def quantizers(gm: nn.Module) -> dict[str, FakeQuantize]:
    """Every ``FakeQuantize`` in ``gm`` by qualified name."""
    return {name: m for name, m in gm.named_modules() if isinstance(m, FakeQuantize)}


def uncalibrated(gm: nn.Module, mode: str | None) -> list[str]:
    """Activation quantizers whose observer never saw data (their qparams are defaults),
    or, in a static graph, were never switched on by calibration: what ``qc.convert``
    and ``qc.export_encodings`` refuse."""
    out = []
    for name, q in quantizers(gm).items():
        if q.dynamic or q.observer is None or q.granularity == "per_token":
            continue
        if not q.per_example:  # a weight quantizer: observed its weight at compile time
            continue
        never = bool((q.observer.min_val > q.observer.max_val).all())
        if never or (mode == "static" and not q.enabled):
            out.append(name)
    return out


def freeze(gm: nn.Module) -> nn.Module:
    """Stop observers: qparams stay as they are (``observe=False`` on every quantizer).

    Weight quantizers that were still tracking their weights (QAT) first take the
    current weights' ranges, as their next forward would: after the last optimizer step
    the weights have moved since they were last observed (torch.ao's convert likewise
    observes the final weights)."""
    with torch.no_grad():
        for fq, weight in weight_quantizers(gm):
            if fq.observe and weight.device.type != "meta":
                fq.observe_tensor(weight)
    for q in quantizers(gm).values():
        q.observe = False
    return gm


def weight_quantizers(gm: nn.Module) -> list[tuple[FakeQuantize, torch.Tensor]]:
    """(quantizer, parameter) for every weight quantizer in ``gm``'s graph(s): a
    ``FakeQuantize`` called on a ``get_attr`` of a parameter."""
    found = []
    for owner in gm.modules():
        if not isinstance(owner, GraphModule):
            continue
        for node in owner.graph.nodes:
            if node.op != "call_module" or not node.args:
                continue
            fq = owner.get_submodule(str(node.target))
            src = node.args[0]
            if not isinstance(fq, FakeQuantize) or getattr(src, "op", None) != "get_attr":
                continue
            parent, _, leaf = str(src.target).rpartition(".")
            value = getattr(owner.get_submodule(parent) if parent else owner, leaf)
            if isinstance(value, nn.Parameter):
                found.append((fq, value))
    return found


def _finite_stats(min_val: torch.Tensor, max_val: torch.Tensor) -> bool:
    # Unobserved entries are min=+inf, max=-inf; anything else non-finite came from data.
    bad = min_val.isnan() | max_val.isnan() | (min_val == float("-inf")) | (
        max_val == float("inf"))
    return not bool(bad.any())


def check_calibratable(mode: str | None) -> None:
    """Refuse to calibrate a graph compiled with ``quant.mode`` qat or dynamic: QAT graphs
    learn their ranges while training and dynamic graphs compute activation qparams from
    every batch."""
    if mode in ("qat", "dynamic"):
        fix = ("train it (observers follow the data), then qc.freeze(gm) or qc.convert(gm)"
               if mode == "qat" else "run it as is, or qc.convert(gm): nothing to calibrate")
        raise QCompileError(f"calibrate: this graph was compiled with quant.mode {mode!r}; "
                            "calibration is for quant.mode 'static'",
                            fix=fix + "; to calibrate, compile with quant.mode: static")


def collect_statistics(gm: nn.Module, batches: Iterable[Any], *,
                       sync: Callable[[nn.Module], Any] | None = None,
                       progress: bool = True,
                       inputs: Callable[[Any], Any] | None = None,
                       signature: Sequence[GraphInput] = (),
                       fixed: Iterable[str] = ()) -> nn.Module:
    """What ``qc.calibrate`` does, for any mode: observe ``batches``, then ``sync(gm)``
    (when given), then freeze. (The inspect tool's per-layer error uses it to give QAT
    graphs data-derived ranges.)

    A batch is a tuple or list of positional inputs, a dict of keyword inputs, or one
    tensor; ``inputs`` maps each batch to one of those first (``lambda b: b[0]`` for a
    DataLoader of ``(x, y)`` pairs). A batch that does not fit the graph, or that puts NaN
    into an observer, is a ``QCompileError`` and every quantizer is restored to its state
    before the call: a refused calibration changes nothing. ``signature`` (the graph's
    inputs, ``qcompile.graph.signature.graph_inputs``) lets errors say what the graph
    takes. The quantizers named in ``fixed`` keep their qparams (weights an algorithm put
    on their grid)."""
    qs = quantizers(gm)
    if not qs:
        raise QCompileError("calibrate: the graph has no quantizers",
                            fix="compile with a spec whose quant.mode is static")
    was_training = gm.training
    saved = {n: ({k: v.clone() for k, v in q.state_dict().items()}, q.enabled, q.observe)
             for n, q in qs.items()}
    gm.eval()
    keep = set(fixed)
    for n, q in qs.items():
        if q.observer is not None and not q.learnable and n not in keep:
            q.observe = True
    seen = 0
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        batches = tqdm(batches, desc="calibrate", unit="batch", leave=False)
    try:
        with torch.no_grad():
            for batch in batches:
                args, kwargs = _call_args(inputs(batch) if inputs is not None else batch,
                                          seen, signature, selected=inputs is not None)
                try:
                    gm(*args, **kwargs)
                except QCompileError:
                    raise
                except Exception as e:  # a user's data, not a bug of ours: say what misfit
                    if distributed_failure(e):
                        raise  # a peer or the network failed, not this batch
                    raise misfit(e, seen, args, kwargs, signature) from e
                seen += 1
                bad = [n for n, q in qs.items() if q.observer is not None
                       and not _finite_stats(q.observer.min_val, q.observer.max_val)]
                if bad:
                    raise QCompileError(f"calibration batch {seen - 1} put NaN or Inf into "
                                        f"the observer of {bad[0]}",
                                        fix="remove NaN/Inf values from the calibration data")
        if seen == 0:
            raise QCompileError("calibrate: no batches were given",
                                fix="pass a non-empty iterable")
    except BaseException:
        for n, q in qs.items():  # a refused calibration leaves the graph as it was
            state, q.enabled, q.observe = saved[n]
            q.load_state_dict(state)
        raise
    finally:
        gm.train(was_training)
    if sync is not None:
        sync(gm)  # e.g. reduce across data-parallel ranks: every rank ends with the same qparams
    for q in qs.values():
        q.observe = False
        q.enabled = True
    return gm


def misfit(e: BaseException, index: int, args: tuple, kwargs: dict,
           signature: Sequence[GraphInput]) -> QCompileError:
    """The error for calibration batch ``index`` that made the graph raise ``e``."""
    names = [i.name for i in signature if not i.variadic]
    return QCompileError(
        f"calibration batch {index} ({describe(args, kwargs, names)}) does not fit "
        f"the graph, compiled for ({_compiled_for(signature)}): "
        f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}",
        fix="give batches shaped like example_inputs (same dtypes, same "
            "non-batch dimensions), or pass inputs=<batch -> model inputs>")


def call_args(batches: Iterable[Any], inputs: Callable[[Any], Any] | None,
              signature: Sequence[GraphInput]) -> list[tuple[tuple, dict]]:
    """Every batch as ``(args, kwargs)`` (``inputs`` applied first), refusing one with
    more values than the graph has inputs: what ``collect_statistics`` calls the graph
    with, for the algorithms that go over the batches several times."""
    return [_call_args(inputs(b) if inputs is not None else b, i, signature,
                       selected=inputs is not None) for i, b in enumerate(batches)]


def distributed_failure(e: BaseException) -> bool:
    """A collective failed inside the forward (FSDP2's all-gather, a timeout, a lost peer):
    torch's distributed error types, or gloo / NCCL in the message. (This layer does not
    import torch.distributed; its errors derive from ``torch._C._DistError``.)"""
    dist_error = getattr(torch._C, "_DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e)
    return any(word in text for word in ("gloo", "NCCL", "nccl", "ProcessGroup"))


def _call_args(batch: Any, index: int, signature: Sequence[GraphInput],
               selected: bool) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for one batch; refuses a batch with more values than the graph
    has inputs (the commonest mistake: a DataLoader of ``(input, target)`` pairs)."""
    if isinstance(batch, dict):
        args, kwargs = (), dict(batch)
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        args, kwargs = (batch,), {}
    if signature and not any(i.variadic for i in signature) and len(args) > len(signature):
        names = ", ".join(i.name for i in signature)
        where = "inputs=... returned" if selected else "is a"
        fix = ("return only the model's inputs from inputs=..." if selected else
               "pass inputs=lambda batch: batch[0] to qc.calibrate to select the model's "
               "inputs (e.g. from a DataLoader of (input, target) pairs)")
        raise QCompileError(f"calibration batch {index} {where} tuple of {len(args)} values, "
                            f"but the graph takes {len(signature)} input(s): {names}", fix=fix)
    return args, kwargs


def describe(args: tuple, kwargs: dict, names: Sequence[str] = ()) -> str:
    """``x: float32[4, 8], mask: int64[4]``: ``args`` (named by ``names`` where given) and
    ``kwargs``."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
        return type(v).__name__
    parts = [f"{names[i]}: {one(a)}" if i < len(names) else one(a) for i, a in enumerate(args)]
    parts += [f"{k}: {one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts) or "no inputs"


def _compiled_for(signature: Sequence[GraphInput]) -> str:
    return ", ".join(str(i) for i in signature) or "inputs it was compiled for"
