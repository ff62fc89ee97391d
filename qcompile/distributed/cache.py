"""The compile cache: compile (and calibrate) once, reuse across runs and ranks.

An entry is the compiled graph's *state* (every parameter and buffer, quantizer flags
included), keyed by SHA-256 over the traced graph's code, the spec, the model's
parameter and buffer bytes, optional calibration data, and the torch and qcompile
versions. The graph's structure is rebuilt by compiling again (cheap and deterministic);
what the cache saves is the state — calibration above all.

On disk: ``<cache_dir>/<key>/manifest.json`` (versions, file hashes, the Report) and
``state.pt`` (tensors only, read with ``torch.load(weights_only=True)``: no pickled code
runs). Entries are written to a temporary folder (files fsynced, the folder and files with
the user's umask), renamed into place and the cache folder fsynced, so a crash never
leaves a half-written entry and concurrent writers of one key cannot corrupt it. A
killed writer's temporary folder is removed when the cache is next opened (its writer's
lock is free: ``qcompile.files``). A
missing, truncated or tampered entry fails its hash check, is reported, and is rebuilt —
never trusted; so is an entry whose tensors do not fit the graph (``misfit``). The hash
detects corruption, not a hostile writer (who can rewrite the manifest too): trust a
cache folder as you trust a checkpoint folder.

Example:
    >>> import tempfile, torch, qcompile as qc
    >>> from qcompile.distributed.cache import CompileCache
    >>> cache = CompileCache(tempfile.mkdtemp())
    >>> gm = qc.qcompile(torch.nn.Linear(2, 2), "int8-qat")
    >>> cache.store("k" * 64, gm)
    >>> state, why = cache.load("k" * 64)
    >>> sorted(state) == sorted(gm.state_dict()), why
    (True, 'hit')
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qcompile.errors import QCompileError
from qcompile.files import (
    is_leftover,
    remove_stale_temporaries,
    sync_folder,
    temporary_folder,
    unmark,
    write_synced,
)
from qcompile.version import __version__

MANIFEST = "manifest.json"
STATE = "state.pt"
FORMAT = 2  # 2: entries hold what compile + calibrate produced, not the weights
# the folders ``store`` writes before renaming (``.<key[:12]>-<random>``) and ``_place``
# moves an old entry into (``.old-<random>``); left behind only by a killed writer
_TEMPORARY = re.compile(r"^\.([0-9a-f]{12}-|old-)")
STALE_AFTER_S = 15 * 60.0  # a temporary untouched this long has no living writer


def remove_stale(directory: str | os.PathLike[str], older_than_s: float = STALE_AFTER_S
                 ) -> list[Path]:
    """Remove what killed writers left in a cache folder: temporary entry folders
    (``.<key>-*``, ``.old-*``) and temporary files (``.*.tmp``) nothing has touched for
    ``older_than_s`` seconds (younger ones may belong to a writer still running).
    A folder whose writer is known dead (its lock is free) goes at once. Complete entries
    are never touched. Returns what was removed."""
    folder = Path(directory)
    removed = remove_stale_temporaries(folder, older_than_s)
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not _TEMPORARY.match(entry.name):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink() and is_leftover(entry, older_than_s):
                shutil.rmtree(entry)
                removed.append(entry)
        except OSError:
            continue  # another process renamed or removed it first
    return removed


def _hash_tensor(h: Any, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool
                 else t.numpy().tobytes())


def cache_key(graph_code: str, spec_json: str, model: nn.Module | None = None,
              calibration: Iterable[Any] | None = None, extra: Iterable[str] = ()) -> str:
    """SHA-256 over what determines a compiled graph's state: the graph's code, the spec,
    the versions, ``model``'s tensors, ``calibration``'s tensors and the ``extra`` strings
    (e.g. a checkpoint's content hash, each rank's calibration digest)."""
    h = hashlib.sha256()
    for part in (f"qcompile {__version__}", f"torch {torch.__version__}", f"format {FORMAT}",
                 graph_code, spec_json, *extra):
        h.update(part.encode())
        h.update(b"\0")
    for name, t in ([*model.named_parameters(), *model.named_buffers()]
                    if model is not None else []):
        h.update(name.encode())
        _hash_tensor(h, t)
    for batch in calibration or ():
        for t in batch if isinstance(batch, (tuple, list)) else (batch,):
            if isinstance(t, torch.Tensor):
                _hash_tensor(h, t)
    return h.hexdigest()


def misfit(state: dict[str, torch.Tensor], gm: nn.Module,
           names: Iterable[str] | None = None) -> str | None:
    """Why ``state`` cannot be loaded into ``gm`` (a missing, extra, misshaped or retyped
    entry; only the entries ``names`` when given), or None when it fits. A well-formed
    entry can still misfit: written by another qcompile build whose graph differs, or
    rehashed by hand."""
    want = gm.state_dict()
    if names is not None:
        want = {n: want[n] for n in names}
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        name, what = (missing[0], "lacks") if missing else (extra[0], "has an extra")
        return f"does not fit the graph: it {what} entry {name!r}"
    for name, t in want.items():
        got = state[name]
        if tuple(got.shape) != tuple(t.shape) or got.dtype != t.dtype:
            return (f"does not fit the graph: {name!r} is {str(got.dtype).removeprefix('torch.')}"
                    f"{list(got.shape)}, the graph has {str(t.dtype).removeprefix('torch.')}"
                    f"{list(t.shape)}")
    return None


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class CompileCache:
    """A folder of compiled states, one sub-folder per key. Opening a cache (``load``,
    ``store``) removes the temporaries killed writers left behind (``remove_stale``)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        remove_stale(self.directory)

    def load(self, key: str) -> tuple[dict[str, torch.Tensor] | None, str]:
        """(state, "hit") or (None, why not): "miss", or what was wrong with the entry."""
        entry = self.directory / key
        if not entry.exists():
            return None, "miss"
        try:
            manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
            if (not isinstance(manifest, dict) or manifest.get("key") != key
                    or manifest.get("format") != FORMAT
                    or not isinstance(manifest.get("files"), dict)):
                return None, "manifest does not match the key"
            if _file_hash(entry / STATE) != manifest["files"].get(STATE):
                return None, f"{STATE} fails its hash check (truncated or modified)"
            state = torch.load(entry / STATE, weights_only=True, map_location="cpu")
        except Exception as e:  # any unreadable entry is reported and rebuilt, never trusted
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return None, f"unreadable entry ({type(e).__name__}: {first})"
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                                  for v in state.values()):
            return None, f"{STATE} does not hold a state dict of tensors"
        return state, "hit"

    def _place(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final``. An entry already there (stale, broken, or another
        writer's) is moved aside by one atomic rename, never deleted in place, so a reader
        sees the old entry, no entry, or the new one, each complete. Racing writers retry
        until some complete entry is in place."""
        for _ in range(100):
            try:
                os.replace(tmp, final)
                return
            except OSError:
                pass
            with temporary_folder(self.directory, ".old-", suffix="") as trash:
                with contextlib.suppress(FileNotFoundError):
                    os.replace(final, trash / "entry")
                try:
                    os.replace(tmp, final)
                    return
                except OSError:
                    if final.exists():
                        return  # another writer put the key in place first: as good as ours
        raise OSError(f"could not place cache entry {final.name} (concurrent writers)")

    def store(self, key: str, gm: nn.Module | dict[str, torch.Tensor],
              report_json: str | None = None) -> None:
        """Write an entry atomically (temporary folder + rename): ``gm``'s state dict, or
        a state dict itself."""
        with contextlib.ExitStack() as stack:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                # 0o777 less the umask: the entry folder, once renamed into place, has the
                # mode any folder the user creates has (mkdtemp's 0o700 would hide it)
                tmp = stack.enter_context(temporary_folder(self.directory, f".{key[:12]}-",
                                                           suffix="", mode=0o777))
            except OSError as e:
                raise QCompileError(f"cache_dir {str(self.directory)!r} is not writable: {e}",
                                    fix="point cache_dir at a writable folder") from None
            tensors = gm if isinstance(gm, dict) else gm.state_dict()
            state = {k: v.detach().cpu() for k, v in tensors.items()}
            with open(tmp / STATE, "xb") as f:  # open()'s mode: 0o666 less the umask
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            manifest = {"key": key, "format": FORMAT, "qcompile": __version__,
                        "torch": torch.__version__, "files": {STATE: _file_hash(tmp / STATE)},
                        "report": json.loads(report_json) if report_json else None}
            write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
            unmark(tmp)  # the entry holds its two files only; the lock stays held till here
            self._place(tmp, self.directory / key)
            sync_folder(self.directory)
