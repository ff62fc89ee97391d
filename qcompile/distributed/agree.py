"""No rank left hanging: ranks agree before a collective phase, and fail together in it.

A user mistake made on one rank only (a different spec, a ``cache_dir`` or a schedule on
one rank, a bad calibration batch) used to leave the other ranks waiting in a collective
until the process group timed out, or abort on a collective whose sizes differ. Two tools
turn those into the same clear ``QCompileError`` on every rank:

- ``agree(what, fingerprint, group)``: before the first collective of a phase, every rank
  shares a small dict of what must match (the spec, the graph's code, the schedule, the
  cache folder, batch counts) in one ``all_gather_object``; on any difference every rank
  raises the same error naming the field, the ranks and their values.
- ``collective_phase(what, group)``: around the *local* part of a phase (running the
  calibration batches, building the model). On the way out every rank shares whether it
  failed, in one ``all_gather_object``; if one did, every rank raises: the failing rank
  its own error, the others ``rank <r> failed in <what>: <its message>``.

Both cost one small collective per phase (never one per batch) and nothing without a
process group of two or more ranks.

Example:
    >>> from qcompile.distributed.agree import agree, collective_phase, differences
    >>> agree("calibrate", {"spec": {"quant": {"mode": "static"}}})  # no process group
    >>> differences([{"spec": {"quant": {"mode": "static"}}},
    ...              {"spec": {"quant": {"mode": "qat"}}}])
    [('spec.quant.mode', ['static', 'qat'])]
    >>> with collective_phase("calibrate"):
    ...     pass
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from qcompile.errors import QCompileError
from qcompile.graph.meta import SPEC_KEY
from qcompile.runtime.calibration import quantizers

SHOWN = 60  # characters of a value shown in an error


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


def agree(what: str, fingerprint: Mapping[str, Any], group: Any = None, *,
          fixes: Mapping[str, str] | None = None) -> None:
    """Every rank of ``group`` (the world by default) must pass an equal ``fingerprint``
    (a dict of JSON-like values; nested dicts such as a spec are compared field by field),
    else every rank raises the same ``QCompileError`` naming the first differing field, the
    ranks and their values. ``fixes`` maps a top-level field to its fix. Call it on every
    rank before the phase's first collective. Without a process group of two or more ranks
    it does nothing."""
    if not _active(group):
        return
    world = torch.distributed.get_world_size(group)
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, dict(fingerprint), group=group)
    diffs = differences(gathered)
    if not diffs:
        return
    field, values = diffs[0]
    top = field.split(".", 1)[0].split("[", 1)[0]
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(_short(v), []).append(r)
    shown = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}"
                      for v, rs in groups.items())
    more = f" (and {len(diffs) - 1} more field(s))" if len(diffs) > 1 else ""
    fix = (fixes or {}).get(top) or (
        f"give every rank the same {top} (e.g. load the spec from one file and pass the "
        "same arguments on every rank), then launch again")
    raise QCompileError(f"{what}: the ranks disagree on {field}{more}: {shown}; every rank "
                        "must agree before the first collective, or they would wait for "
                        "each other until the process group times out", fix=fix)


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


def _shapes(batch: Any) -> list[str]:
    return [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]


def calibration_fingerprint(gm: nn.Module, batches: Any, *, sharded: bool
                            ) -> tuple[dict[str, Any], Any]:
    """What the ranks calibrating ``gm`` together must share: the spec (its ``cache_dir``
    aside), the graph's code and, for a sharded graph (every forward is a collective), the
    number of batches and each batch's shapes. Returns ``(fingerprint, batches)``: a
    sharded graph's batches come back as a list (they were counted)."""
    spec = getattr(gm, "meta", {}).get(SPEC_KEY)
    fingerprint: dict[str, Any] = {
        "spec": spec.model_dump(mode="json", exclude={"cache_dir"}) if spec is not None
        else None,
        "graph": digest(_codes(gm)),
    }
    if sharded:
        batches = list(batches)
        fingerprint["batches"] = {"count": len(batches),
                                  "shapes": [" ".join(_shapes(b)) for b in batches]}
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
