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

import contextlib
import ctypes
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.errors import QCompileError
from qcompile.runtime import kernels, sharded
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.observers import MovingAverageObserver


@dataclass(frozen=True)
class GraphInput:
    """One input of a compiled graph, as its example input was: for error messages."""

    name: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    variadic: bool = False  # *args: any number of values
    # (module, num_embeddings) of each embedding this input indexes: for out-of-range ids
    indexes: tuple[tuple[str, int], ...] = ()

    def __str__(self) -> str:
        if self.shape is None or self.dtype is None:
            return self.name
        return f"{self.name}: {str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def quantizers(gm: nn.Module) -> dict[str, FakeQuantize]:
    """Every ``FakeQuantize`` in ``gm`` by qualified name."""
    if not isinstance(gm, nn.Module):
        raise QCompileError(f"quantizers takes the graph qc.qcompile returned, got "
                            f"{type(gm).__name__}", fix="pass gm = qc.qcompile(model, spec, ...)")
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
    if sharded.on_tp_mesh(gm):
        # tensor parallel: each weight's whole range from the shards (a reduction across
        # tp; every rank freezes), under FSDP2 each block's while it is gathered over dp
        sharded.observe_whole_weights(gm, lambda m: [
            (fq, w) for fq, w in [*weight_quantizers(m, sharded.on_one_mesh_dim),
                                  *sharded.sharded_weights(m)]
            if fq.observe and fq.observer is not None and w.device.type != "meta"])
        for q in quantizers(gm).values():
            q.observe = False
        return gm
    observed = [(fq, weight) for fq, weight in weight_quantizers(gm)
                if fq.observe and weight.device.type != "meta"]
    # by identity (a transposed view by its base): reading a data pointer would make a
    # copy-on-write weight copy itself
    ids = {id(w if w._base is None else w._base) for _, w in observed}
    refuse_nonfinite({n: p for n, p in gm.named_parameters() if id(p) in ids}, "freeze")
    with torch.no_grad():
        for fq, weight in observed:
            fq.observe_tensor(weight)
    for q in quantizers(gm).values():
        q.observe = False
    return gm


# The views a weight quantizer may read its weight through (``insert_quant`` puts them
# there): ``torch.t`` of an [in, out] weight quantized per group; transpose + reshape
# making a 3-D expert weight [experts * out, in] rows.
_WEIGHT_VIEWS = (torch.t, torch.transpose, torch.reshape)

ViewSteps = tuple[tuple[Any, tuple[Any, ...]], ...]


def weight_view(src: torch.fx.Node) -> tuple[torch.fx.Node, ViewSteps] | None:
    """(the ``get_attr`` node, the view steps from it to ``src``, in order) for a value a
    weight quantizer reads: the attribute itself or views of it; None for anything else."""
    steps = []
    while src.op == "call_function" and src.target in _WEIGHT_VIEWS:
        if not src.args or not isinstance(src.args[0], torch.fx.Node):
            return None
        steps.append((src.target, tuple(src.args[1:])))
        src = src.args[0]
    return (src, tuple(reversed(steps))) if src.op == "get_attr" else None


def apply_view(t: torch.Tensor, steps: ViewSteps) -> torch.Tensor:
    """``t`` seen through ``steps`` (see ``weight_view``)."""
    for fn, args in steps:
        t = fn(t, *args)
    return t


def weight_quantizer_sites(gm: nn.Module
                           ) -> list[tuple[GraphModule, str, FakeQuantize, ViewSteps]]:
    """(graph, attribute path in it, quantizer, the views it reads the attribute through)
    for every quantizer in ``gm``'s graph(s) called on a ``get_attr`` or a view of one (a
    weight stored [in, out], e.g. GPT-2's ``Conv1D``, quantized per group along its inputs;
    a 3-D expert weight quantized as rows; see ``weight_view``)."""
    found = []
    for owner in gm.modules():
        if not isinstance(owner, GraphModule):
            continue
        for node in owner.graph.nodes:
            if node.op != "call_module" or not node.args:
                continue
            fq = owner.get_submodule(str(node.target))
            src = node.args[0]
            if not isinstance(fq, FakeQuantize) or not isinstance(src, torch.fx.Node):
                continue
            view = weight_view(src)
            if view is not None:
                found.append((owner, str(view[0].target), fq, view[1]))
    return found


def weight_quantizers(gm: nn.Module, keep: Callable[[torch.Tensor], bool] | None = None
                      ) -> list[tuple[FakeQuantize, torch.Tensor]]:
    """(quantizer, weight) for every weight quantizer in ``gm``'s graph(s): a
    ``FakeQuantize`` called on a ``get_attr`` of a parameter (the parameter itself), or on
    views of one (what the quantizer sees; see ``weight_quantizer_sites``). ``keep``: only
    the parameters it accepts, asked before any view (a view of a weight FSDP2 holds
    sharded over dp may not exist until the weight is gathered)."""
    found = []
    for owner, path, fq, steps in weight_quantizer_sites(gm):
        parent, _, leaf = path.rpartition(".")
        value = getattr(owner.get_submodule(parent) if parent else owner, leaf)
        if isinstance(value, nn.Parameter) and (keep is None or keep(value)):
            found.append((fq, apply_view(value, steps)))
    return found


def nonfinite_count(t: torch.Tensor) -> tuple[int, int]:
    """``(NaN values, infinite values)`` in ``t`` (0, 0 for meta and non-float tensors; a
    sharded DTensor counts its local shard: no collective)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if t.device.type == "meta" or not (t.is_floating_point() or t.is_complex()):
        return 0, 0
    t = t.detach()
    if t.numel() == 0:
        return 0, 0
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        # the common case: one pass and no temporary (isfinite would make a mask of
        # numel bytes: a quarter of the largest weight, freed memory the allocator keeps);
        # NaN propagates through min and max, and an infinity is one of them (aminmax has
        # no float8 kernel)
        low, high = torch.aminmax(t)
        if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
            return 0, 0
    elif bool(torch.isfinite(t).all()):
        return 0, 0
    nan = int(t.isnan().sum())
    return nan, int((~torch.isfinite(t)).sum()) - nan


def _counted(nan: int, inf: int) -> str:
    return " and ".join(f"{n} {what} value{'s' if n != 1 else ''}"
                        for n, what in ((nan, "NaN"), (inf, "infinite")) if n)


def refuse_nonfinite(tensors: dict[str, torch.Tensor], action: str) -> None:
    """Raise a ``QCompileError`` naming the first of ``tensors`` (weights, by qualified
    name) holding NaN or infinite values: their quantizer ranges would be NaN, and every
    output after them. ``action`` is what refuses (``calibrate``, ``freeze``, ...).

    Example:
        >>> import torch
        >>> from qcompile.runtime.calibration import refuse_nonfinite
        >>> w = torch.ones(2, 2)
        >>> w[0, 0] = float("nan")
        >>> refuse_nonfinite({"fc1.weight": w}, "calibrate")
        Traceback (most recent call last):
        ...
        qcompile.errors.QCompileError: calibrate: fc1.weight has 1 NaN value ...
    """
    for name, t in tensors.items():
        nan, inf = nonfinite_count(t)
        if nan or inf:
            raise QCompileError(
                f"{action}: {name} has {_counted(nan, inf)} (of {t.numel()}): the model's "
                "weights are not finite, so no quantization range can be computed for it",
                fix="the checkpoint, or the training that produced it, diverged: load a "
                    "checkpoint whose weights are finite (torch.isfinite(p).all() for every "
                    "parameter) or retrain with a lower learning rate / gradient clipping; "
                    "calibration data cannot repair a weight")


def model_weights(gm: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``gm`` outside its quantizers (an LSQ scale is the quantizer's
    own business), by qualified name: what ``refuse_nonfinite`` checks before observing.
    Buffers are left out: a causal mask of ``-inf`` is a legitimate buffer."""
    inside = tuple(f"{n}." for n, m in gm.named_modules() if isinstance(m, FakeQuantize))
    return {n: p for n, p in gm.named_parameters() if not n.startswith(inside)}


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


def _is_weight(q: FakeQuantize) -> bool:
    # ``per_example`` too: graphs pickled before ``weight`` existed read its default
    return q.weight or not q.per_example


def _combined(q: FakeQuantize) -> str | None:
    """How calibration across ranks (``RankCombine``) combines ``q``'s statistics:
    ``"histogram"`` (in its observer's ``observe``), ``"now"`` (an enabled min-max or
    moving-average quantizer: its batch range reduced before it quantizes, in the
    forward), ``"defer"`` (a disabled moving average: its batch ranges reduced after the
    forward, then folded in order), or None (weights, which every rank holds alike;
    running min / max, which the reduction at the end combines exactly)."""
    if (q.observer is None or q.learnable or q.dynamic or q.granularity == "per_token"
            or _is_weight(q)):
        return None
    if getattr(q.observer, "needs_data", False):
        return "histogram"
    if q.enabled:
        return "now"
    return "defer" if isinstance(q.observer, MovingAverageObserver) else None


class RankCombine:
    """Calibration across data-parallel ranks that ends with the statistics one process
    observing the global batches would have (every rank on its slice of each batch).

    A running minimum / maximum needs nothing more than the reduction at the end (min of
    minima, max of maxima). What depends on each batch's global values is combined as
    the batches are observed, through ``across`` (``RankReduction``):

    - histogram-based observers agree on each batch's range and sum its histograms in
      ``observe`` (two collectives per quantizer and batch: collectives inside the
      forward);
    - a moving average folds each batch's global minimum / maximum once, in batch order:
      its observer is paused while the batches run (``observe`` off; a forward pre-hook
      records the batch's range), and ``fold`` reduces every recorded range in one
      collective and folds them. A quantizer that is enabled (its output depends on its
      qparams, e.g. calibrating a second time), min-max ones included, reduces its
      range in the pre-hook instead, before it quantizes.

    ``in_forward(gm)``: whether the forwards run collectives (then every rank must run
    the same batches, agreed beforehand; ``fold`` runs after each batch). Otherwise the
    recorded ranges wait for ``fold`` after the last batch, outside the forwards.
    ``quantizers``: those whose statistics are global already (the reduction at the end
    leaves them out).

    Example (one process, whose reduction is the identity: the same as without it):
        >>> import copy, torch, qcompile as qc
        >>> class Alone:
        ...     def extremes(self, mn, mx, count=0): return mn, mx, count
        ...     def total(self, counts, largest): return counts
        >>> gm = qc.qcompile(torch.nn.Linear(4, 4), {"quant": {"mode": "static", "rules": [
        ...     {"match": {"module": "Linear"}, "weight": {"dtype": "int8"}, "activation": {
        ...      "dtype": "uint8", "observer": "moving_average"}}]}},
        ...     example_inputs=(torch.randn(2, 4),))
        >>> batches = [torch.randn(2, 4) for _ in range(3)]
        >>> ref = collect_statistics(copy.deepcopy(gm), batches)
        >>> combine = RankCombine(Alone())
        >>> _ = collect_statistics(gm, batches, combine=combine)
        >>> combine.fold()
        >>> [n for n, q in quantizers(gm).items() if q in combine.quantizers]
        ['linear_fake_quant']
        >>> all(torch.equal(q.scale, quantizers(ref)[n].scale)
        ...     for n, q in quantizers(gm).items())
        True
    """

    def __init__(self, across: Any) -> None:
        self.across = across
        self.quantizers: list[FakeQuantize] = []
        self._records: list[tuple[FakeQuantize, torch.Tensor, torch.Tensor]] = []
        self._seen: set[int] = set()
        self._undo: list[Callable[[], None]] = []
        self.per_batch = False

    @staticmethod
    def in_forward(gm: nn.Module) -> bool:
        """Whether calibrating ``gm`` this way runs collectives inside its forwards."""
        return any(_combined(q) in ("histogram", "now") for q in quantizers(gm).values())

    def start(self, qs: dict[str, FakeQuantize], observing: Sequence[str]) -> None:
        """Set up the quantizers named in ``observing`` (undone by ``stop``)."""
        kinds = {n: _combined(qs[n]) for n in observing}
        self.per_batch = any(k in ("histogram", "now") for k in kinds.values())
        for n, kind in kinds.items():
            q = qs[n]
            if kind is None:
                continue
            self.quantizers.append(q)
            if kind == "histogram":
                obs, before = q.observer, q.observer.__dict__.get("across")
                obs.across = self.across
                self._undo.append(lambda o=obs, b=before: setattr(o, "across", b)
                                  if b is not None else o.__dict__.pop("across", None))
                continue
            q.observe = False  # the pre-hook observes (collect_statistics restores it)
            handle = q.register_forward_pre_hook(self._range_of)
            self._undo.append(handle.remove)

    def _range_of(self, q: FakeQuantize, args: tuple) -> None:
        x = args[0] if args else None
        # what FakeQuantize observes: floating-point tensors with values
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return
        mn, mx = q._minmax(x.detach().float())
        self._seen.add(id(q))
        if q.enabled:  # before it quantizes with them, as one process would
            mn, mx, _ = self.across.extremes(mn, mx)
            q.observe_range(mn, mx)
        else:
            self._records.append((q, mn, mx))

    def saw(self, q: FakeQuantize) -> bool:
        """Whether ``q`` recorded a range (its observer may still wait for ``fold``)."""
        return id(q) in self._seen

    def nonfinite(self) -> FakeQuantize | None:
        """The first quantizer whose range recorded since the last ``fold`` is NaN or
        infinite (what an observer would hold after such a batch)."""
        for q, mn, mx in self._records:
            if not _finite_stats(mn, mx):
                return q
        return None

    @torch.no_grad()
    def fold(self) -> None:
        """Reduce every recorded range across the ranks (one collective) and fold them
        into their observers in the order they were recorded; then the qparams."""
        records, self._records = self._records, []
        if not records:
            return
        mn = torch.cat([r[1].reshape(-1) for r in records])
        mx = torch.cat([r[2].reshape(-1) for r in records])
        mn, mx, _ = self.across.extremes(mn, mx)
        last = {id(q): i for i, (q, _, _) in enumerate(records)}
        offset = 0
        for i, (q, a, _) in enumerate(records):
            n = a.numel()
            device = q.observer.min_val.device
            lo = mn[offset:offset + n].view_as(a).to(device)
            hi = mx[offset:offset + n].view_as(a).to(device)
            offset += n
            if last[id(q)] == i:  # its last range: the observer, then the qparams
                q.observe_range(lo, hi)
            else:
                q.observer.update(lo, hi)

    def stop(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []


def collect_statistics(gm: nn.Module, batches: Iterable[Any], *,
                       sync: Callable[[nn.Module], Any] | None = None,
                       progress: bool = True,
                       inputs: Callable[[Any], Any] | None = None,
                       signature: Sequence[GraphInput] = (),
                       fixed: Iterable[str] = (),
                       combine: RankCombine | None = None) -> nn.Module:
    """What ``qc.calibrate`` does, for any mode: observe ``batches``, then ``sync(gm)``
    (when given), then freeze. (The inspect tool's per-layer error uses it to give QAT
    graphs data-derived ranges.)

    A batch is a tuple or list of positional inputs, a dict of keyword inputs, or one
    tensor; ``inputs`` maps each batch to one of those first (``lambda b: b[0]`` for a
    DataLoader of ``(x, y)`` pairs). A batch that does not fit the graph, that has 0 rows,
    or that puts NaN into an observer, a weight that is not finite, or a quantizer that
    observed no data, is a ``QCompileError`` and every quantizer is restored to its state
    before the call: a refused calibration changes nothing. ``signature`` (the graph's
    inputs, ``qcompile.graph.signature.graph_inputs``) lets errors say what the graph
    takes. The quantizers named in ``fixed`` keep their qparams (weights an algorithm put
    on their grid)."""
    refuse_batches_misuse(batches, inputs, "calibrate")
    qs = quantizers(gm)
    if not qs:
        raise QCompileError("calibrate: the graph has no quantizers",
                            fix="compile with a spec whose quant.mode is static")
    # a NaN weight would put NaN into every observer after it: say so, not "the data"
    refuse_nonfinite(model_weights(gm), "calibrate")
    was_training = gm.training
    saved = {n: ({k: v.clone() for k, v in q.state_dict().items()}, q.enabled, q.observe)
             for n, q in qs.items()}
    gm.eval()
    keep = set(fixed)
    observing = []
    for n, q in qs.items():
        if q.observer is not None and not q.learnable and n not in keep:
            q.observe = True
            observing.append(n)
    if combine is not None:
        combine.start(qs, observing)
    seen = 0
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        batches = tqdm(batches, desc="calibrate", unit="batch", leave=False)
    try:
        with torch.no_grad(), quiet_fx_trace():
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
                if combine is not None and combine.per_batch:
                    combine.fold()  # (collectives in the forwards: one more per batch)
                deferred = combine.nonfinite() if combine is not None else None
                bad = [n for n, q in qs.items() if q.observer is not None and (
                       q is deferred or not _finite_stats(q.observer.min_val,
                                                          q.observer.max_val))]
                if bad:
                    raise _nonfinite_batch(seen - 1, bad[0], args, kwargs, signature,
                                           across=combine is not None)
        if seen == 0:
            raise QCompileError("calibrate: no batches were given",
                                fix="pass a non-empty iterable")
        empty = [n for n in observing if _never_observed(qs[n])
                 and not (combine is not None and combine.saw(qs[n]))]
        if empty:
            raise QCompileError(
                f"calibrate: {empty[0]} observed no data in {seen} batch(es)"
                + (f" (and {len(empty) - 1} more quantizer(s))" if len(empty) > 1 else "")
                + ": its input was empty in every batch, so it has no range",
                fix="give (more) batches whose data reaches that layer, or keep it in "
                    "float with a rule {match: {name: <its module>}, skip: true}")
    except BaseException:
        if combine is not None:
            combine.stop()
        for n, q in qs.items():  # a refused calibration leaves the graph as it was
            state, q.enabled, q.observe = saved[n]
            q.load_state_dict(state)
        raise
    finally:
        if combine is not None:
            combine.stop()
        gm.train(was_training)
    if sync is not None:
        sync(gm)  # e.g. reduce across data-parallel ranks: every rank ends with the same qparams
    for q in qs.values():
        q.observe = False
        q.enabled = True
    return gm


def refuse_batches_misuse(batches: Any, inputs: Any, what: str) -> None:
    """A tensor given as the batches (iterating it would give its rows, one at a time, as
    inputs of a rank less) and an ``inputs`` that is not a function: refused by name."""
    if isinstance(batches, torch.Tensor):
        raise QCompileError(
            f"{what}: batches is one tensor ({str(batches.dtype).removeprefix('torch.')}"
            f"{list(batches.shape)}); iterating it would feed its rows one by one",
            fix="pass a list of batches, e.g. [x] for one batch or [(x,), ...]")
    if inputs is not None and not callable(inputs):
        raise QCompileError(f"{what}: inputs= is a {type(inputs).__name__}, not a function",
                            fix="pass inputs=lambda batch: batch[0] (batch -> model inputs)")


def return_freed_memory() -> bool:
    """Give the memory this process has freed back to the operating system: the output
    blocks the fake-quant kernels keep for reuse (``qcompile.runtime.kernels.release_cache``)
    and, under glibc (Linux), the free pages of every malloc arena (``malloc_trim(0)``).
    Returns whether glibc released any.

    glibc keeps freed heap memory for later allocations: after the first large free it
    raises its mmap threshold (up to 32 MB), so tensors of that size come from the heap
    and, once freed, stay resident (counted in RSS) until reused, and a heap fragmented by
    small long-lived allocations cannot reuse them for the next size. A loop that frees
    and allocates weight-sized tensors (a sharded calibration gathering one block after
    another) then grows by a block or more per iteration. Trimming changes no allocator
    setting: it only returns pages that are free now. Elsewhere (another C library,
    another OS) only the kernels' blocks are released.

    Example:
        >>> from qcompile.runtime.calibration import return_freed_memory
        >>> return_freed_memory() in (True, False)
        True
    """
    kernels.release_cache()
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the process runs on
    except (AttributeError, OSError):  # not glibc (musl has no malloc_trim)
        return False
    return bool(trim(0))


def _never_observed(q: FakeQuantize) -> bool:
    """Whether ``q``'s observer saw no value at all (it holds +inf / -inf, as new)."""
    obs = q.observer
    return obs is not None and bool((obs.min_val > obs.max_val).all())


def _nonfinite_batch(index: int, quantizer: str, args: tuple, kwargs: dict,
                     signature: Sequence[GraphInput], *, across: bool = False
                     ) -> QCompileError:
    """The error for calibration batch ``index`` putting NaN / Inf into ``quantizer``'s
    observer: blamed on the batch when one of its tensors holds such values, else on the
    model's computation (the weights were checked before: they are finite), or with
    ``across`` (statistics combined across ranks as they are gathered) on another rank's
    batch or computation."""
    names = [i.name for i in signature if not i.variadic]
    given = [(names[i] if i < len(names) else f"input {i}", v) for i, v in enumerate(args)]
    given += list(kwargs.items())
    where = f"calibration batch {index} put NaN or Inf into the observer of {quantizer}"
    for name, v in given:
        if isinstance(v, torch.Tensor):
            nan, inf = nonfinite_count(v)
            if nan or inf:
                return QCompileError(f"{where}: its input {name} has {_counted(nan, inf)}",
                                     fix="remove NaN/Inf values from the calibration data "
                                         f"(torch.isfinite({name}).all() for each batch)")
    if across:
        return QCompileError(
            f"{where}, though this rank's inputs and the model's weights are finite: "
            "another data-parallel rank's batch holds NaN/Inf, or the model computes them "
            "there (the batch's statistics are combined across the ranks)",
            fix="remove NaN/Inf values from the calibration data on every rank "
                "(that rank's error names the input), or find the op that overflows")
    return QCompileError(
        f"{where}, though the batch's inputs and the model's weights are finite: the "
        f"model computes a NaN or infinite value before {quantizer} (an overflow, e.g. in "
        "float16, or a division by zero / log of 0)",
        fix="find the operation before it that overflows (run the float model on this "
            "batch) and compute it in float32 or guard it; NaN/Inf in the calibration "
            "data would be named here")


@contextlib.contextmanager
def quiet_fx_trace() -> Iterator[None]:
    """Run the body with torch.fx's report of a failed generated forward kept off
    ``stderr``.

    A ``GraphModule`` whose ``forward`` raises prints the traceback and the generated code
    around the failing line ("Call using an FX-traced Module, line N ...", ~27 lines) to
    ``sys.stderr`` before re-raising; for a batch that does not fit, that is noise before
    our own error, which names the batch and says the fix. Only that one message is held
    back: everything else written to ``sys.stderr`` meanwhile (warnings, a progress bar,
    the model's own prints) goes through, and ``sys.stderr`` is given back after the body.

    Example:
        >>> import sys
        >>> from qcompile.runtime.calibration import quiet_fx_trace
        >>> stream = sys.stderr
        >>> with quiet_fx_trace():
        ...     sys.stderr is stream
        False
        >>> sys.stderr is stream
        True
    """
    stream = sys.stderr
    if isinstance(stream, _WithoutFxTrace) or stream is None:
        yield
        return
    quiet = _WithoutFxTrace(stream)
    sys.stderr = quiet
    try:
        yield
    finally:
        if sys.stderr is quiet:  # (whoever replaced it meanwhile restores their own)
            sys.stderr = stream


# torch.fx's message (torch/fx/graph_module.py, _WrappedCall): printed with one write, and
# print's newline as a second
_FX_TRACE = "Call using an FX-traced Module, line "


class _WithoutFxTrace:
    """A text stream forwarding to ``stream`` all but torch.fx's failed-forward report."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._skip_newline = False

    def write(self, text: str) -> int:
        skip = _FX_TRACE in text or (self._skip_newline and text == "\n")
        self._skip_newline = _FX_TRACE in text
        return len(text) if skip else self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def misfit(e: BaseException, index: int, args: tuple, kwargs: dict,
           signature: Sequence[GraphInput], *, what: str = "calibration batch",
           fix: str = "give batches shaped like example_inputs (same dtypes, same "
                      "non-batch dimensions), or pass inputs=<batch -> model inputs>"
           ) -> QCompileError:
    """The error for batch ``index`` (``what``: whose batch, e.g. ``qc.sqnr: batch``)
    that made the graph raise ``e``: ids beyond an embedding's ``num_embeddings`` are named
    as such, anything else as a batch that does not fit the graph."""
    names = [i.name for i in signature if not i.variadic]
    if _index_error(e):
        out_of_range = _ids_out_of_range(index, args, kwargs, signature)
        if out_of_range is not None:
            return out_of_range
    return QCompileError(
        f"{what} {index} ({describe(args, kwargs, names)}) does not fit "
        f"the graph, compiled for ({_compiled_for(signature)}): "
        f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}", fix=fix)


def _index_error(e: BaseException) -> bool:
    # torch's embedding kernel: IndexError "index out of range in self" (CPU); a device
    # assert or RuntimeError mentioning the index elsewhere
    text = str(e)
    return isinstance(e, IndexError) or "index out of range" in text or "srcIndex" in text


def _ids_out_of_range(index: int, args: tuple, kwargs: dict,
                      signature: Sequence[GraphInput]) -> QCompileError | None:
    """The error for an input whose ids fall outside an embedding it indexes (per
    ``GraphInput.indexes``), or None when no input's ids do."""
    by_name = {i.name: i for i in signature if not i.variadic}
    given = [(i.name, v) for i, v in zip(signature, args) if not i.variadic]
    given += list(kwargs.items())
    for name, v in given:
        spec = by_name.get(name)
        if (spec is None or not spec.indexes or not isinstance(v, torch.Tensor)
                or v.is_floating_point() or v.numel() == 0):
            continue
        lo, hi = int(v.min()), int(v.max())
        for module, n in spec.indexes:
            if lo >= 0 and hi < n:
                continue
            seen = f"ids up to {hi}" if hi >= n else f"the id {lo}"
            return QCompileError(
                f"calibration batch {index}: input {name} holds {seen}, out of range for "
                f"embedding {module} (num_embeddings {n}: ids must lie in [0, {n - 1}])",
                fix="give ids below num_embeddings: check that the tokenizer / vocabulary "
                    "is the model's, or enlarge the embedding; to feed other inputs, pass "
                    "inputs=<batch -> model inputs>")
    return None


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
    _refuse_empty(index, args, kwargs, signature)
    return args, kwargs


def _refuse_empty(index: int, args: tuple, kwargs: dict,
                  signature: Sequence[GraphInput]) -> None:
    """A tensor input with 0 rows (dim 0 of size 0) observes nothing: the quantizers would
    keep their placeholder ranges, unsaid. (An input compiled with 0 rows may stay so.)"""
    known = {i.name: i for i in signature if not i.variadic}
    named = [(i.name, v) for i, v in zip(signature, args) if not i.variadic]
    named += [(f"input {i}", v) for i, v in enumerate(args[len(named):], len(named))]
    named += list(kwargs.items())
    for name, v in named:
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != 0:
            continue
        compiled = known.get(name)
        if compiled is not None and compiled.shape and compiled.shape[0] == 0:
            continue
        raise QCompileError(
            f"calibration batch {index}: input {name} has 0 rows "
            f"({str(v.dtype).removeprefix('torch.')}{list(v.shape)}), so it shows the "
            "observers nothing", fix="pass non-empty batches (drop empty ones, e.g. with "
            "DataLoader(..., drop_last=True) or a filter)")


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
