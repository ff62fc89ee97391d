"""Files written whole or not at all.

Every file qcompile writes for a user (ONNX models, encodings, cache entries, saved specs,
inspect outputs) goes through here: the bytes land in a temporary file beside the target
(same folder, so the same filesystem) and ``os.replace`` moves it into place. A crash or a
kill at any point leaves either the previous file or the new one, never a torn one; the
temporary is named ``.<name>.<random>.tmp`` so a later run can recognise and remove it.

This module is a base layer: it imports nothing of qcompile's and no torch.

Example:
    >>> import os, tempfile
    >>> from qcompile.files import write_atomically, atomic_path
    >>> d = tempfile.mkdtemp()
    >>> write_atomically(os.path.join(d, "a.txt"), "hello")
    >>> with atomic_path(os.path.join(d, "b.bin")) as tmp:
    ...     _ = open(tmp, "wb").write(b"\\x00\\x01")
    >>> sorted(os.listdir(d))
    ['a.txt', 'b.bin']
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

TMP_SUFFIX = ".tmp"


def temp_prefix(path: str | os.PathLike[str]) -> str:
    """The prefix of the temporaries written for ``path``: ``.<name>.``."""
    return f".{Path(path).name}."


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; on a clean exit move it onto ``path``.

    For writers that want a path rather than a file object (``torch.onnx``, safetensors).
    On an exception the temporary is removed and ``path`` is untouched. Temporaries of the
    same target that a killed writer left (older than an hour) are removed first.
    """
    target = Path(path)
    remove_stale_temporaries(target.parent, prefix=temp_prefix(target))
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target), suffix=TMP_SUFFIX,
                               dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomically(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` so it is either the whole new file or
    untouched."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)


def remove_stale_temporaries(folder: str | os.PathLike[str], older_than_s: float = 3600.0,
                             *, prefix: str = ".") -> list[Path]:
    """Remove files named like this module's temporaries (``<prefix>*.tmp``, by default
    any ``.*.tmp``; ``temp_prefix(path)`` for one target's) in ``folder`` whose last change
    is older than ``older_than_s`` seconds: leftovers of killed writers. Younger ones may
    belong to a writer still running and are kept. Returns what was removed."""
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
            if entry.is_file() and entry.stat().st_mtime < cutoff:
                entry.unlink()
                removed.append(entry)
        except OSError:
            continue  # another process removed or replaced it first
    return removed
