"""Files written whole or not at all, with the user's permissions.

Every file qcompile writes for a user (specs, encodings, ONNX models, adapters, compile-cache
entries, inspect pictures, graph dumps) goes through here. The bytes land in a private
temporary folder beside the target (``.<name>.<random>.tmp/``: the same filesystem, so the
final ``os.replace`` is atomic), are fsynced, get the mode a plain ``open(path, "w")``
would give them (``0o666 & ~umask``), and are moved into place; the folder is fsynced
after the rename where the platform allows. Whatever a third-party writer puts beside the
path it was given (safetensors' own ``.tmpXXXXXX``, ONNX external data, Graphviz output)
lands inside the private folder too, so one clean-up removes it all.

A crash or a kill at any point leaves the previous file or the new one, never a torn one.
An exception (``KeyboardInterrupt`` included) removes the temporary folder at once. A
``SIGKILL`` cannot be caught: the folder stays, marked by a lock file its writer holds
(``flock``) while it lives, and the next write of the same target, or
``remove_stale_temporaries``, removes it as soon as that lock is free (the kernel frees it
when the writer dies). Where no lock can be taken (no ``fcntl``, a filesystem without
locks) a temporary is removed once untouched for an hour.

The mode comes from the kernel, not from reading the umask: the temporary file is created
with ``os.open(..., 0o666)``, which applies the umask (or a folder's default ACL) exactly as
for any file the user creates. ``os.umask`` is never called (it is process-wide: changing
it, even to read it, races with every other thread creating files).

This module is a base layer like ``qcompile.errors``: it imports nothing of qcompile's and
no torch, so ``qcompile.specs`` may use it.

Example:
    >>> import os, tempfile
    >>> from qcompile.files import write_atomically, atomic_path
    >>> d = tempfile.mkdtemp()
    >>> write_atomically(os.path.join(d, "a.txt"), "hello")
    >>> with atomic_path(os.path.join(d, "b.bin")) as tmp:
    ...     _ = open(tmp, "wb").write(b"\\x00\\x01")
    >>> sorted(os.listdir(d))  # nothing else: the temporaries are gone
    ['a.txt', 'b.bin']
    >>> open(os.path.join(d, "plain.txt"), "w").close()  # the mode any new file gets
    >>> os.stat(os.path.join(d, "a.txt")).st_mode == os.stat(os.path.join(d, "plain.txt")).st_mode
    True
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; temporaries age out instead
    fcntl = None  # type: ignore[assignment]

TMP_SUFFIX = ".tmp"
# The lock file inside a temporary folder: it marks the folder as a qcompile writer's and
# its writer holds an exclusive flock on it while alive.
LOCK_NAME = ".qcompile-writer"
STALE_AFTER_S = 3600.0  # a temporary no lock vouches for, untouched this long, is a leftover
# what fsync / chmod answer where a filesystem cannot (vfat, some FUSE and network mounts):
# the write goes on without, as any plain open(path, "w") would
_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.ENOSYS,
                errno.EPERM}


def temp_prefix(path: str | os.PathLike[str]) -> str:
    """The prefix of the temporaries written for ``path``: ``.<name>.``."""
    return f".{Path(path).name}."


def _owner() -> str:
    """What a writer records in its lock file: host and process."""
    return f"{socket.gethostname()} {os.getpid()}"


def _hold_lock(folder: Path) -> int:
    """Create ``folder/LOCK_NAME`` and lock it for as long as the returned descriptor is
    open. The owner is written only once the lock is held: a lock file without an owner
    (no locks on this platform or filesystem) vouches for nothing, and its folder ages out."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    if fcntl is None:
        return fd
    for _ in range(100):  # a cleaner probing the lock holds it for microseconds
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, _owner().encode())
            return fd
        except BlockingIOError:
            time.sleep(0.001)
        except OSError:
            break  # no locks on this filesystem: the folder ages out instead
    return fd


def writer_alive(folder: str | os.PathLike[str]) -> bool | None:
    """Whether the writer of a temporary folder still runs: True (its lock is held, or it
    is this process), False (its lock is free: the writer died), None (no lock to tell:
    not a locked qcompile temporary, or no locks on this platform or filesystem)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        owner = os.read(fd, 4096).decode(errors="replace")
        if not owner:
            return None  # its writer had not locked it yet (or could not): unknown
        # on filesystems that emulate flock with per-process POSIX locks (NFS) this
        # process can take its own lock: never call ourselves dead
        return owner == _owner()
    finally:
        os.close(fd)


@contextlib.contextmanager
def temporary_folder(parent: str | os.PathLike[str], prefix: str, suffix: str = TMP_SUFFIX,
                     *, mode: int = 0o700) -> Iterator[Path]:
    """A fresh folder ``<parent>/<prefix><random><suffix>`` (created with ``mode``, which the
    umask then narrows), marked as a living writer's (``LOCK_NAME``, locked) for as long as
    the block runs, and removed with everything left in it when the block ends, however it
    ends. A caller that renames the folder into place calls ``unmark`` on it first."""
    parent = Path(parent)
    while True:
        folder = parent / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            os.mkdir(folder, mode)
            break
        except FileExistsError:
            continue
    fd: int | None = None
    try:
        fd = _hold_lock(folder)
        yield folder
    finally:
        # removed while still locked: a cleaner never sees it unlocked and half-removed
        shutil.rmtree(folder, ignore_errors=True)
        if fd is not None:
            os.close(fd)


def unmark(folder: str | os.PathLike[str]) -> None:
    """Remove a temporary folder's lock file (before renaming the folder into place); the
    lock stays held until the folder's ``temporary_folder`` block ends."""
    (Path(folder) / LOCK_NAME).unlink(missing_ok=True)


def sync_file(path: str | os.PathLike[str]) -> None:
    """fsync ``path``'s data to disk (a no-op where the filesystem cannot)."""
    _fsync_and_close(os.open(path, os.O_RDONLY if os.name == "posix" else os.O_RDWR))


def _fsync_and_close(fd: int) -> None:
    """fsync ``fd`` (skipped where the filesystem cannot), then close it."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _chmod(path: str | os.PathLike[str] | int, mode: int) -> None:
    """chmod (or fchmod, given a descriptor), skipped where the filesystem has no modes."""
    try:
        if isinstance(path, int):
            os.fchmod(path, mode)
        else:
            os.chmod(path, mode)
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise


def sync_folder(path: str | os.PathLike[str]) -> None:
    """fsync a folder, so that a rename into it survives a power cut. A no-op where the
    platform or filesystem cannot (Windows, some network filesystems)."""
    if os.name != "posix":
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    _fsync_and_close(fd)


def write_synced(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write a new file ``path`` (text as UTF-8) and fsync it: for files inside a temporary
    folder that is itself moved into place (the compile cache)."""
    with open(path, "xb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def _create(path: Path) -> int:
    """Create the empty ``path`` as ``open(path, "w")`` would (mode ``0o666`` less the
    umask, or as a default ACL says) and return that mode. While writers write, the owner
    may read and write it whatever the umask; ``_finish`` puts the mode back."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o7777
        if mode & 0o600 != 0o600 and hasattr(os, "fchmod"):
            _chmod(fd, mode | 0o600)
    finally:
        os.close(fd)
    return mode


def _finish(path: Path, mode: int) -> None:
    """fsync what a writer left at ``path`` and give it ``mode``. A writer that renamed its
    own temporary onto ``path`` (safetensors: mode 0600) is put right here."""
    if not path.is_file():
        raise FileNotFoundError(errno.ENOENT, "the writer left no file", str(path))
    sync_file(path)
    if path.stat().st_mode & 0o7777 != mode:
        _chmod(path, mode)


@contextlib.contextmanager
def atomic_paths(*paths: str | os.PathLike[str]) -> Iterator[tuple[Path, ...]]:
    """Yield one temporary path per target (all targets in one folder); on a clean exit
    fsync each file, give it the user's mode and move it onto its target, in the order
    given (companions first: ONNX external data before the model that names it).

    The temporaries are fresh empty files named like their targets inside a private
    folder, so a writer that derives names from the path (``<name>.data``, its own
    ``.tmpXXXXXX``) writes there too. On an exception nothing is moved and the folder is
    removed; a kill leaves it for the next write of the same target (see the module).
    Between two moves a crash leaves the first target new and the rest old.
    """
    targets = [Path(p) for p in paths]
    if not targets:
        raise ValueError("atomic_paths needs at least one path")
    folder = targets[0].parent
    if any(t.parent != folder for t in targets) or len({t.name for t in targets}) != len(targets):
        raise ValueError(f"atomic_paths: targets must be distinct files of one folder: {paths}")
    main = targets[-1]
    remove_stale_temporaries(folder, prefix=temp_prefix(main))
    with temporary_folder(folder, temp_prefix(main)) as tmp_folder:
        tmps = tuple(tmp_folder / t.name for t in targets)
        modes = [_create(t) for t in tmps]
        yield tmps
        for tmp, mode in zip(tmps, modes, strict=True):
            _finish(tmp, mode)
        for tmp, target in zip(tmps, targets, strict=True):
            os.replace(tmp, target)
        sync_folder(folder)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path for ``path``; on a clean exit move it onto ``path`` (fsynced,
    with the user's mode). For writers that want a path rather than bytes (``ir.save``,
    safetensors, Graphviz, matplotlib). On an exception ``path`` is untouched and nothing
    is left behind."""
    with atomic_paths(path) as (tmp,):
        yield tmp


def write_atomically(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` so it is either the whole new file or
    untouched."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)


def _newest_change(folder: Path) -> float:
    """The latest modification time of ``folder`` and of anything directly in it: a writer
    still writing a file keeps it recent."""
    newest = folder.stat().st_mtime
    for entry in folder.iterdir():
        with contextlib.suppress(OSError):
            newest = max(newest, entry.stat().st_mtime)
    return newest


def is_leftover(folder: str | os.PathLike[str], older_than_s: float) -> bool:
    """Whether a temporary folder is a dead writer's: its lock is free, or (no lock to
    tell) nothing in it changed for ``older_than_s`` seconds."""
    alive = writer_alive(folder)
    if alive is not None:
        return not alive
    return _newest_change(Path(folder)) < time.time() - older_than_s


def remove_stale_temporaries(folder: str | os.PathLike[str],
                             older_than_s: float = STALE_AFTER_S, *, prefix: str = "."
                             ) -> list[Path]:
    """Remove the temporaries killed writers left in ``folder``: entries named
    ``<prefix>*.tmp`` (by default any ``.*.tmp``; ``temp_prefix(path)`` for one target's).
    A temporary folder goes as soon as its writer is dead (its lock is free), or, where no
    lock tells, once untouched for ``older_than_s`` seconds; a folder that is not a
    qcompile writer's (no lock file) is removed only if empty. A temporary file (older
    qcompile versions wrote those) goes once untouched for ``older_than_s`` seconds. A
    living writer's temporaries are kept. Returns what was removed."""
    removed: list[Path] = []
    cutoff = time.time() - older_than_s
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.startswith(".")
                and entry.name.endswith(TMP_SUFFIX)):
            continue
        try:
            if entry.is_symlink():
                continue
            if entry.is_dir():
                if (entry / LOCK_NAME).exists():
                    if is_leftover(entry, older_than_s):
                        shutil.rmtree(entry)
                        removed.append(entry)
                elif entry.stat().st_mtime < cutoff:
                    entry.rmdir()  # an empty folder only: never a user's files
                    removed.append(entry)
            elif entry.is_file() and entry.stat().st_mtime < cutoff:
                entry.unlink()
                removed.append(entry)
        except OSError:
            continue  # another process removed or replaced it first, or it is not empty
    return removed
