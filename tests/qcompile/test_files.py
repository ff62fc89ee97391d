"""Atomic writes: the target is the whole new file or untouched; killed writers' temporaries
are cleaned up, a running writer's are not."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from qcompile.files import atomic_path, remove_stale_temporaries, temp_prefix, write_atomically


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "m.onnx"
    write_atomically(target, b"good")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_stale_temporaries_of_the_target_go_young_and_foreign_ones_stay(tmp_path: Path) -> None:
    target = tmp_path / "enc.json"
    old = tmp_path / f"{temp_prefix(target)}abc.tmp"
    young = tmp_path / f"{temp_prefix(target)}def.tmp"
    other = tmp_path / ".notes.txt.ghi.tmp"          # another target's temporary
    plain = tmp_path / "data.tmp"                    # not a hidden temporary: never ours
    for p in (old, young, other, plain):
        p.write_text("x")
    hour_ago = time.time() - 7200
    for p in (old, other, plain):
        os.utime(p, (hour_ago, hour_ago))
    write_atomically(target, "{}")                   # cleans its own target's leftovers only
    assert not old.exists() and young.exists() and other.exists() and plain.exists()
    assert remove_stale_temporaries(tmp_path) == [other]   # any stale `.*.tmp`
    assert plain.exists() and target.read_text() == "{}"
