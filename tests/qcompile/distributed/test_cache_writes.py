"""The compile cache's writes: an entry folder and its files get the modes the umask gives
new folders and files (not mkdtemp's 0700); a store killed inside ``torch.save`` leaves the
previous entry, and its temporary folder goes the next time the cache is opened, at once
(its writer's lock is free), not after the 15 minutes a lock-less temporary waits."""

from __future__ import annotations

import stat
from pathlib import Path

import torch
from killed_writer import kill_mid_write

from qcompile.distributed.cache import MANIFEST, STATE, CompileCache

KEY = "ab" * 32  # hex, like every real key
OLD = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(3)}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_entries_get_the_umask_modes(tmp_path: Path, umask: int) -> None:
    CompileCache(tmp_path).store(KEY, OLD)
    entry = tmp_path / KEY
    folder, file = {0o022: (0o755, 0o644), 0o077: (0o700, 0o600)}[umask]
    assert mode(entry) == folder
    assert {p.name: mode(p) for p in entry.iterdir()} == {MANIFEST: file, STATE: file}
    assert [p.name for p in tmp_path.iterdir()] == [KEY]


def test_a_store_killed_mid_write_leaves_the_previous_entry(tmp_path: Path) -> None:
    CompileCache(tmp_path).store(KEY, OLD)
    kill_mid_write(f"""
        import io, torch
        real = torch.save
        def half_then_block(obj, f, *args, **kwargs):
            buf = io.BytesIO()
            real(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            block()
        torch.save = half_then_block
        from qcompile.distributed.cache import CompileCache
        CompileCache({str(tmp_path)!r}).store({KEY!r}, {{"w": torch.zeros(2, 3)}})
        """, tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != KEY)
    assert len(left) == 1 and left[0].startswith(f".{KEY[:12]}-")  # the killed writer's
    cache = CompileCache(tmp_path)  # opening it removes that, young as it is
    assert [p.name for p in tmp_path.iterdir()] == [KEY]
    state, why = cache.load(KEY)
    assert why == "hit" and state.keys() == OLD.keys()
    assert all(torch.equal(state[k], v) for k, v in OLD.items())
