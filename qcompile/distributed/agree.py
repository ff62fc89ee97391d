"""No rank left hanging: ranks agree before a collective phase, and fail together in it.

A user mistake made on one rank only (a different spec, model, ``cache_dir``, schedule or
batch shape on one rank, a call under ``if rank == 0:``) would leave the other ranks
waiting in a collective until the process group timed out, or abort on a collective whose
sizes differ. Two tools turn those into the same clear ``QCompileError`` on every rank:

- ``agree(what, fingerprint, group)``: before the first collective of a call, every rank
  says which call it is in (``what``) and shares a small dict of what must match (the
  spec, the model, the schedule, the cache folder, batch counts and shapes). The meeting
  goes through the process group's own key-value store (``ProcessGroup.get_group_store``:
  ``append``, ``add`` and ``wait`` with a timeout of seconds), not through a collective,
  so a rank that is somewhere else cannot block it: within ``QCOMPILE_AGREE_TIMEOUT``
  seconds (default 60) every rank raises, naming the ranks that differ and what differs
  (the call, a fingerprint field) or the ranks that never came.
- ``collective_phase(what, group)``: around the *local* part of a phase (running the
  calibration batches, building the model). On the way out every rank shares whether it
  failed, in one ``all_gather_object``; if one did, every rank raises: the failing rank
  its own error, the others ``rank <r> failed in <what>: <its message>``.

How a meeting works: each rank counts its own meetings (``store.add``), so the k-th
meeting of every rank is the same slot. A rank appends its record (rank, call,
fingerprint) to the slot's log and counts itself in; the last one in reads the log,
decides (every call and fingerprint equal, or the first difference) and publishes the
verdict, which the others wait for. A rank that waited ``QCOMPILE_AGREE_TIMEOUT`` seconds
appends a *close* record: the log is append-only, so every rank reading it sees the same
ranks before the first close (those that came in time) and draws the same conclusion. A
rank arriving after the close in the same call raises too (it came too late); one arriving
in another call skips the slot (the others made a call it never made, and raised), so
the slots stay aligned and the group stays usable. The last rank into a meeting deletes
the keys of the one before (every rank is past it).

Cost: a handful of store round trips per meeting (about 0.1-0.5 ms on torchrun's
TCPStore, no device synchronisation); ``collective_phase`` one small collective per
phase, never one per batch. Nothing without a process group of two or more ranks.

Example:
    >>> from qcompile.distributed.agree import agree, collective_phase, differences, verdict
    >>> agree("calibrate", {"spec": {"quant": {"mode": "static"}}})  # no process group
    >>> differences([{"spec": {"quant": {"mode": "static"}}},
    ...              {"spec": {"quant": {"mode": "qat"}}}])
    [('spec.quant.mode', ['static', 'qat'])]
    >>> verdict([{"rank": 0, "call": "save_adapters", "fingerprint": {}},
    ...          {"rank": 1, "call": "qc.distributed.train_step", "fingerprint": {}}],
    ...         "save_adapters")["message"][:44]
    'the ranks are in different qcompile calls: r'
    >>> with collective_phase("calibrate"):
    ...     pass
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qcompile.distributed.guards import data_parallel_inner
from qcompile.errors import QCompileError
from qcompile.graph.meta import SPEC_KEY
from qcompile.runtime.calibration import quantizers

SHOWN = 60  # characters of a value shown in an error
TIMEOUT_ENV = "QCOMPILE_AGREE_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0  # long enough for ordinary skew between ranks, far below 30 min
_KEYS = "qcompile/agree/"  # the store keys of the meetings, inside the group's own prefix
_CLOSED = b"closed"  # a slot's verdict when a rank gave up waiting for the others
_TIMEOUT_FIX = (
    "call {what} on every rank of the group (not under `if rank == 0:`: it communicates); "
    "if the other ranks only get there later (evaluation or checkpointing on one rank), "
    "set {env} to more seconds (now {limit:g})")
_CALLS_FIX = ("make the same qcompile calls on every rank, in the same order: a call under "
              "`if rank == 0:` that communicates (train_step, save_adapters of a sharded "
              "graph, calibrate, search, ...) is made by one rank only")


def _active(group: Any) -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group) > 1)


def digest(text: str) -> str:
    """A short SHA-256 of ``text``: how long values (a graph's code) enter a fingerprint."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        if not value:
            out[path] = "{}"
        for k, v in value.items():
            _flatten(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, (list, tuple)):
        out[f"{path}#len"] = len(value)
        for i, v in enumerate(value):
            _flatten(v, f"{path}[{i}]", out)
    else:
        out[path] = value


def differences(gathered: list[Mapping[str, Any]]) -> list[tuple[str, list[Any]]]:
    """The fields (dotted paths into nested dicts and lists) whose values differ between
    the ranks' fingerprints, each with every rank's value (None where it lacks the field),
    in the first rank's order."""
    flat = []
    for g in gathered:
        f: dict[str, Any] = {}
        _flatten(g, "", f)
        flat.append(f)
    fields = list(dict.fromkeys(k for f in flat for k in f))
    out = []
    for field in fields:
        values = [f.get(field) for f in flat]
        if any(v != values[0] for v in values[1:]):
            # a list of another length: say so once, not for every element after it
            if field.endswith("#len"):
                out.append((field.removesuffix("#len"), [f"{v} entries" if v is not None
                                                         else None for v in values]))
                break
            out.append((field, values))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    """``rank 1`` / ``ranks 0, 2``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _by_value(values: list[Any], ranks: list[int]) -> str:
    """``rank 0: 'a'; ranks 1, 2: 'b'``: the ranks grouped by their value."""
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(_short(v), []).append(r)
    return "; ".join(f"{_ranks(rs)}: {v}" for v, rs in groups.items())


def verdict(records: list[Mapping[str, Any]], what: str,
            fixes: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What one meeting decides from every rank's record (``rank``, ``call``,
    ``fingerprint``): ``{"ok": True}``, or the error every rank raises (``message``,
    ``fix``): the ranks in different calls first, else the first differing field. ``what``
    and ``fixes`` are the deciding rank's (the same call on every rank by then)."""
    ranks = [int(r["rank"]) for r in records]
    calls = [r["call"] for r in records]
    if any(c != calls[0] for c in calls[1:]):
        return {"message": "the ranks are in different qcompile calls: "
                           f"{_by_value(calls, ranks)}; each call that communicates must be "
                           "made by every rank, in the same order, or the ranks would wait "
                           "in mismatched collectives until the process group times out",
                "fix": _CALLS_FIX}
    diffs = differences([r["fingerprint"] for r in records])
    if not diffs:
        return {"ok": True}
    field, values = diffs[0]
    top = field.split(".", 1)[0].split("[", 1)[0]
    more = f" (and {len(diffs) - 1} more field(s))" if len(diffs) > 1 else ""
    fix = (fixes or {}).get(top) or (
        f"give every rank the same {top} (e.g. load the spec from one file and pass the "
        "same arguments on every rank), then launch again")
    return {"message": f"{what}: the ranks disagree on {field}{more}: "
                       f"{_by_value(values, ranks)}; every rank must agree before the first "
                       "collective, or they would wait for each other until the process "
                       "group times out", "fix": fix}


def timeout_s() -> float:
    """Seconds a rank waits in ``agree`` for the others: ``QCOMPILE_AGREE_TIMEOUT``, else
    ``DEFAULT_TIMEOUT_S``."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise QCompileError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds",
                            fix=f"set {TIMEOUT_ENV} to seconds, e.g. 60, or unset it")
    return value


def _group_store(group: Any) -> Any:
    """The process group's own store (torch's ``ProcessGroup.get_group_store``: its keys
    live under the group's prefix), or None where the group has none."""
    pg = group if group is not None else torch.distributed.group.WORLD
    try:
        return pg.get_group_store()
    except (AttributeError, RuntimeError):
        return None


def _log(store: Any, slot: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in store.get(slot + "log").split(b"\n") if line]


def _in_time(log: list[dict[str, Any]], world: int) -> tuple[list[dict[str, Any]], bool]:
    """The ranks' records before the first close record, in rank order, and whether every
    rank is among them (the meeting took place). The log only grows, so every rank that
    reads it finds the same."""
    seen: dict[int, dict[str, Any]] = {}
    for record in log:
        if "closed_by" in record:
            break
        seen.setdefault(int(record["rank"]), record)
    return [seen[r] for r in sorted(seen)], len(seen) == world


@dataclass(frozen=True)
class _Closed:
    """A meeting some rank gave up on: the records of the ranks that came in time."""

    present: list[dict[str, Any]]


def _forget(store: Any, slot: str) -> None:
    """Delete the keys of the meeting before one that took place: every rank came to this
    one, so every rank is done with that one (read its verdict, or skipped it closed)."""
    for key in ("log", "arrived", "verdict"):
        store.delete_key(slot + key)


def _meet(store: Any, record: bytes, me: int, world: int, limit: float, what: str,
          fixes: Mapping[str, str] | None) -> dict[str, Any] | _Closed:
    """One meeting in this rank's next slot: the verdict, or how the meeting closed."""
    wait = datetime.timedelta(seconds=limit)
    k = store.add(f"{_KEYS}calls/{me}", 1)
    slot = f"{_KEYS}{k}/"
    store.append(slot + "log", record + b"\n")
    if store.add(slot + "arrived", 1) == world:  # the last one in decides
        present, met = _in_time(_log(store, slot), world)
        if not met:
            return _Closed(present)  # it came after someone gave up
        decided = verdict(present, what, fixes)
        store.set(slot + "verdict", json.dumps(decided))
        if k > 1:
            _forget(store, f"{_KEYS}{k - 1}/")
        return decided
    try:
        store.wait([slot + "verdict"], wait)
    except RuntimeError as e:  # nobody decided in time (a store's timeout error): give up
        if isinstance(e, torch.distributed.DistNetworkError):
            raise
        store.append(slot + "log", json.dumps({"closed_by": me}).encode() + b"\n")
        present, met = _in_time(_log(store, slot), world)
        if not met:
            store.compare_set(slot + "verdict", "", _CLOSED.decode())  # wakes the others
            return _Closed(present)
        store.wait([slot + "verdict"], wait)  # the last rank came as this one gave up
    value = store.get(slot + "verdict")
    if value == _CLOSED:
        return _Closed(_in_time(_log(store, slot), world)[0])
    return json.loads(value)


def _meeting(store: Any, record: bytes, me: int, world: int, limit: float, what: str,
             fixes: Mapping[str, str] | None) -> dict[str, Any] | _Closed:
    """``_meet``, where a store that stopped answering is a ``QCompileError``."""
    try:
        return _meet(store, record, me, world, limit, what, fixes)
    except torch.distributed.DistNetworkError as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise QCompileError(
            f"{what}: the process group's store does not answer ({first}): the rank that "
            "holds it (rank 0 under torchrun) has probably stopped", fix="fix the error that "
            "rank reports (it is in its log), then launch again") from None


def _gathered(what: str, fingerprint: dict[str, Any], group: Any,
              fixes: Mapping[str, str] | None) -> dict[str, Any]:
    """The verdict through one ``all_gather_object`` (a group without a store: no timeout)."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    mine = {"rank": torch.distributed.get_rank(group), "call": what,
            "fingerprint": fingerprint}
    torch.distributed.all_gather_object(gathered, mine, group=group)
    return verdict(gathered, what, fixes)


def agree(what: str, fingerprint: Mapping[str, Any], group: Any = None, *,
          fixes: Mapping[str, str] | None = None) -> None:
    """Every rank of ``group`` (the world by default) must be in the same call ``what``
    with an equal ``fingerprint`` (a dict of JSON-like values; nested dicts such as a spec
    are compared field by field), else every rank raises the same ``QCompileError`` naming
    the ranks and what differs: their calls, or the first differing field and the ranks'
    values. A rank not in the meeting within ``timeout_s()`` seconds is named in the error
    the others raise. ``fixes`` maps a top-level field to its fix. Call it on every rank
    before the call's first collective. Without a process group of two or more ranks it
    does nothing."""
    if not _active(group):
        return
    fingerprint = json.loads(json.dumps(dict(fingerprint), default=str))  # as others see it
    store = _group_store(group)
    if store is None:
        decided: dict[str, Any] | _Closed = _gathered(what, fingerprint, group, fixes)
    else:
        me, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        limit = timeout_s()
        record = json.dumps({"rank": me, "call": what, "fingerprint": fingerprint},
                            sort_keys=True).encode()
        fix = _TIMEOUT_FIX.format(what=what, env=TIMEOUT_ENV, limit=limit)
        while isinstance(decided := _meeting(store, record, me, world, limit, what, fixes),
                         _Closed):
            came = [int(r["rank"]) for r in decided.present]
            if me in came:
                gone = [r for r in range(world) if r not in came]
                raise QCompileError(
                    f"{what}: {_ranks(gone)} did not reach {what} within {limit:g} s "
                    f"({_ranks(came)} did): a call that communicates must be made by every "
                    "rank, or the others would wait in its collectives until the process "
                    "group times out", fix=fix)
            theirs = decided.present[0]["call"] if decided.present else what
            if theirs == what:
                raise QCompileError(f"{what}: {_ranks(came)} waited {limit:g} s for this rank "
                                    f"(rank {me}) in {what} and gave up: it came too late",
                                    fix=fix)
            # they made a call this rank never made (and raised): its meeting is the next
            warnings.warn(f"qcompile: {_ranks(came)} called {theirs} without this rank "
                          f"(rank {me}) and stopped with an error; this rank goes on with "
                          f"{what}", UserWarning, stacklevel=2)
    if not decided.get("ok"):
        raise QCompileError(decided["message"], fix=decided["fix"])


def _told(e: BaseException) -> tuple[str, str | None]:
    """(message, fix) of ``e`` as the other ranks will show it (short)."""
    if isinstance(e, QCompileError):
        return e.message[:500], (e.fix or None) and e.fix[:500]
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:500], None


@contextlib.contextmanager
def collective_phase(what: str, group: Any = None, *, fix: str | None = None,
                     enabled: bool = True) -> Iterator[None]:
    """Run the local part of a collective phase; on the way out every rank learns whether
    any rank failed in it (one ``all_gather_object``), and if one did, every rank raises:
    the failing rank its own error, the others a ``QCompileError`` naming the rank, the
    phase and the failing rank's message (and ``fix``, or that rank's fix). The block must
    run no collective itself (a rank that fails would leave its peers in it). Without a
    process group of two or more ranks (or with ``enabled=False``) it is a no-op."""
    if not enabled or not _active(group):
        yield
        return
    world = torch.distributed.get_world_size(group)
    try:
        yield
    except Exception as e:
        gathered: list[Any] = [None] * world
        with contextlib.suppress(Exception):  # a peer already gone: our own error is what counts
            torch.distributed.all_gather_object(gathered, (False, *_told(e)), group=group)
        raise
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, (True, "", None), group=group)
    failed = [(r, msg, their_fix) for r, (ok, msg, their_fix) in enumerate(gathered)
              if not ok]
    if failed:
        r, msg, their_fix = failed[0]
        others = f" (and rank(s) {', '.join(str(x[0]) for x in failed[1:])})" if (
            len(failed) > 1) else ""
        raise QCompileError(f"rank {r}{others} failed in {what}: {msg}",
                            fix=fix or their_fix or f"fix what rank {r} reports (its own "
                            "error names the cause), then launch again; the other ranks "
                            "stopped with it instead of waiting for it")


def _codes(gm: nn.Module) -> str:
    """The generated code of a graph and of its ``stage_<i>`` children."""
    parts = [str(getattr(gm, "code", ""))]
    parts += [str(getattr(c, "code", "")) for n, c in gm.named_children()
              if n.startswith("stage_")]
    return "\n".join(parts)


def _dtype_shape(t: torch.Tensor, rows: bool = True) -> str:
    """``float32[6, 8]``; without ``rows``, ``float32[*, 8]`` (the batch dimension free)."""
    shape: list[Any] = list(t.shape)
    if not rows and shape:
        shape[0] = "*"
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"


def shapes_of(batch: Any, rows: bool = True) -> list[str]:
    """Every tensor of ``batch`` (a tensor, or nested tuples, lists and dicts of them) as
    ``_dtype_shape`` writes it."""
    return [_dtype_shape(t, rows) for t in torch.utils._pytree.tree_leaves(batch)
            if isinstance(t, torch.Tensor)]


def batch_shapes(batch: Any) -> list[str]:
    """Every tensor of ``batch`` as ``dtype[*, d1, ...]``: what ranks stepping together
    must share (the batch dimension may differ: DDP and FSDP2 take batches of different
    sizes on different ranks)."""
    return shapes_of(batch, rows=False)


def tensors_of(model: nn.Module) -> dict[str, str]:
    """Every parameter and buffer of ``model`` (the graph inside a data-parallel wrapper)
    as name -> ``dtype[shape]`` (a sharded DTensor's whole shape, the same on every rank)."""
    inner = data_parallel_inner(model)
    return {n: _dtype_shape(t) for n, t in (*inner.named_parameters(),
                                            *inner.named_buffers())}


def _checksum(model: nn.Module) -> str:
    """A digest of the values of ``model``'s parameters and buffers: per tensor, the
    integer sum of its bytes read as int32 (exact, so the same on every CPU and GPU); a
    sharded or meta tensor counts by name only (its values are not all here)."""
    inner = data_parallel_inner(model)
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in sorted((*inner.named_parameters(), *inner.named_buffers()),
                              key=lambda kv: kv[0]):
            if t.device.type == "meta" or hasattr(t, "placements"):
                h.update(f"{name}:-;".encode())
                continue
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            ints = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
            h.update(f"{name}:{int(ints.sum(dtype=torch.int64))};".encode())
    return "sha256:" + h.hexdigest()[:16]


def _spec_of(model: nn.Module) -> Any:
    meta = getattr(data_parallel_inner(model), "meta", None)
    spec = meta.get(SPEC_KEY) if isinstance(meta, dict) else None
    return spec.model_dump(mode="json", exclude={"cache_dir"}) if spec is not None else None


# The attribute of a compiled graph holding its small fingerprint and the generated code it
# was computed for (a recompiled graph computes it again).
_FINGERPRINT = "_qc_fingerprint"


def model_fingerprint(model: nn.Module, *, detailed: bool = False,
                      weights: bool = False) -> dict[str, Any]:
    """What tells ranks holding different models apart: the spec the graph was compiled
    with (``cache_dir`` aside; None for a model qcompile did not compile), the generated
    code of its graph(s) and the names, dtypes and shapes of its parameters and buffers;
    with ``weights``, a checksum of their values too. ``detailed``: the spec and tensors
    as they are, so that an error names the field or tensor that differs; else digests
    (what a check at every step sends), which a compiled graph computes once per
    generated code.

    Example:
        >>> import torch
        >>> a = model_fingerprint(torch.nn.Linear(2, 3), detailed=True)
        >>> a["tensors"]
        {'weight': 'float32[3, 2]', 'bias': 'float32[3]'}
        >>> b = model_fingerprint(torch.nn.Linear(2, 4))
        >>> b["tensors"] == model_fingerprint(torch.nn.Linear(2, 3))["tensors"]
        False
    """
    inner = data_parallel_inner(model)
    if detailed or weights:
        spec, tensors = _spec_of(inner), tensors_of(inner)
        out = {"spec": spec if detailed else digest(json.dumps(spec, sort_keys=True)),
               "graph": digest(_codes(inner)),
               "tensors": tensors if detailed else digest(json.dumps(tensors))}
        if weights:
            out["weights"] = _checksum(inner)
        return out
    codes = (getattr(inner, "_code", None),
             *(getattr(c, "_code", None) for n, c in inner.named_children()
               if n.startswith("stage_")))
    cached = inner.__dict__.get(_FINGERPRINT)
    if cached is not None and len(cached[0]) == len(codes) and all(
            a is b for a, b in zip(cached[0], codes)):
        return dict(cached[1])
    out = model_fingerprint(inner, detailed=True)
    out = {"spec": digest(json.dumps(out["spec"], sort_keys=True)), "graph": out["graph"],
           "tensors": digest(json.dumps(out["tensors"]))}
    meta = getattr(inner, "meta", None)
    if codes[0] is not None and isinstance(meta, dict) and SPEC_KEY in meta:
        inner.__dict__[_FINGERPRINT] = (codes, out)  # a graph qcompile made, never the user's
    return dict(out)


MODEL_FIX = ("give every rank the same model and spec (built, loaded and compiled the same "
             "way), then launch again")


def _forgotten() -> None:
    return None


@dataclass(frozen=True, eq=False)
class GroupCheck:
    """A graph's data-parallel group, kept in its ``meta[COLLECTIVES_KEY]`` by
    ``qc.distributed.wrap`` and ``compile_once``. ``check(what, gm)`` has every rank of
    that group agree (``agree``) on the call and ``gm``'s model fingerprint: how
    ``save_adapters`` (in ``qcompile.deploy``, which does not import this package) checks
    before gathering a sharded graph. Copies of the graph share it; a pickled graph
    forgets it (a process group does not pickle)."""

    group: Any

    def __call__(self, what: str, gm: nn.Module,
                 fingerprint: Mapping[str, Any] | None = None) -> None:
        agree(what, {"model": model_fingerprint(gm), **(fingerprint or {})}, self.group,
              fixes={"model": MODEL_FIX})

    def __deepcopy__(self, memo: dict) -> GroupCheck:
        return self

    def __reduce__(self) -> tuple:
        return (_forgotten, ())


def calibration_fingerprint(gm: nn.Module, batches: Any, *, sharded: bool
                            ) -> tuple[dict[str, Any], Any]:
    """What the ranks calibrating ``gm`` together must share: the spec (its ``cache_dir``
    aside), the graph's code, its tensors' names, dtypes and shapes and, for a sharded
    graph (every forward is a collective), the number of batches and each batch's shapes.
    Returns ``(fingerprint, batches)``: a sharded graph's batches come back as a list
    (they were counted)."""
    fingerprint: dict[str, Any] = {
        "spec": _spec_of(gm),
        "graph": digest(_codes(gm)),
        "tensors": tensors_of(gm),
    }
    if sharded:
        batches = list(batches)
        fingerprint["batches"] = {"count": len(batches),
                                  "shapes": [" ".join(shapes_of(b)) for b in batches]}
    return fingerprint, batches


@contextlib.contextmanager
def unchanged_on_failure(gm: nn.Module) -> Iterator[None]:
    """Every quantizer of ``gm`` (state and on/off flags) is put back as it was when the
    block raises: a calibration refused on any rank changes nothing on any rank."""
    qs = quantizers(gm)
    saved = {n: ({k: v.detach().clone() for k, v in q.state_dict().items()}, q.enabled,
                 q.observe) for n, q in qs.items()}
    try:
        yield
    except BaseException:
        for n, q in qs.items():
            state, q.enabled, q.observe = saved[n]
            q.load_state_dict(state)
        raise
