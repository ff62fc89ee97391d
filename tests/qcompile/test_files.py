"""Atomic writes: the target is the whole new file or untouched, fsynced, with the mode the
umask gives a new file; an interrupted writer leaves nothing (third-party temporaries
included); a killed writer's temporary goes with the next write, a running writer's stays."""

from __future__ import annotations

import ast
import os
import stat
import sys
import time
from pathlib import Path

import pytest
import torch
from killed_writer import kill_mid_write, start_blocked
from safetensors.torch import load_file, save_file

from qcompile import files
from qcompile.files import (
    atomic_path,
    atomic_paths,
    remove_stale_temporaries,
    temp_prefix,
    write_atomically,
    writer_alive,
)


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


# -- what a write leaves: modes, fsync, third-party temporaries -----------------------------
def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_modes_follow_the_umask(tmp_path: Path, umask: int) -> None:
    expected = {0o022: 0o644, 0o077: 0o600}[umask]  # 0o666 & ~umask, written out
    write_atomically(tmp_path / "a.json", "{}")
    with atomic_path(tmp_path / "b.svg") as tmp:
        tmp.write_bytes(b"<svg/>")
    # a writer that makes its own 0600 temporary and renames it onto the path (safetensors)
    save_file({"w": torch.zeros(3)}, str(tmp_path / "c.safetensors"))
    assert mode(tmp_path / "c.safetensors") == 0o600  # what safetensors alone gives
    with atomic_path(tmp_path / "c.safetensors") as tmp:
        save_file({"w": torch.ones(3)}, str(tmp))
    assert {p.name: mode(p) for p in tmp_path.iterdir()} == {
        "a.json": expected, "b.svg": expected, "c.safetensors": expected}
    assert load_file(tmp_path / "c.safetensors")["w"].tolist() == [1.0, 1.0, 1.0]


def test_the_file_and_its_folder_are_fsynced(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name what an fd is")
    synced: list[tuple[str, bool]] = []  # (path, target in place yet)
    target = tmp_path / "enc.json"
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), target.exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    write_atomically(target, "{}")
    file, folder = synced
    assert Path(file[0]).name == "enc.json" and Path(file[0]).parent != tmp_path
    assert not file[1]  # the data reached the disk before the rename
    assert folder == (str(tmp_path), True)  # and the rename after it


def test_an_interrupt_removes_the_writers_own_temporaries(tmp_path: Path) -> None:
    """Whatever a writer puts beside the path it got (safetensors' ``.tmpXXXXXX``, ONNX
    ``.data``) goes with the temporary, on any exception, KeyboardInterrupt included."""
    target = tmp_path / "adapter_model.safetensors"
    write_atomically(target, b"good")
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        (tmp.parent / ".tmpAb12Cd").write_bytes(b"half of a third-party temporary")
        (tmp.parent / f"{tmp.name}.data").write_bytes(b"external data")
        raise KeyboardInterrupt
    assert target.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter_model.safetensors"]


def test_companions_move_first_and_all_get_the_mode(tmp_path: Path, umask: int) -> None:
    model, data = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    with atomic_paths(data, model) as (tmp_data, tmp_model):
        assert tmp_data.parent == tmp_model.parent != tmp_path
        tmp_model.write_bytes(b"model")
        tmp_data.write_bytes(b"data")
    assert model.read_bytes() == b"model" and data.read_bytes() == b"data"
    assert mode(model) == mode(data) == 0o666 & ~umask
    with pytest.raises(ValueError, match="one folder"), \
            atomic_paths(tmp_path / "a", tmp_path / "sub" / "b"):
        pass


# -- killed writers ---------------------------------------------------------------------------
def write_blocked(target: Path) -> str:
    """Child code: write ``target`` atomically, blocked half-way through the data."""
    return f"""
        import pathlib
        pathlib.Path.write_bytes = torn(pathlib.Path.write_bytes)
        from qcompile.files import write_atomically
        write_atomically({str(target)!r}, b"new" * 100_000)
        """


def test_a_killed_write_leaves_the_old_file_and_the_next_write_removes_its_temporary(
        tmp_path: Path) -> None:
    target = tmp_path / "enc.json"
    write_atomically(target, b"old")
    kill_mid_write(write_blocked(target), tmp_path)
    assert target.read_bytes() == b"old"
    (left,) = (p for p in tmp_path.iterdir() if p != target)  # the kill's leftover: ours
    assert left.name.startswith(temp_prefix(target)) and left.is_dir()
    assert writer_alive(left) is False  # the kernel freed the dead writer's lock
    write_atomically(target, b"next")  # young, but dead: removed at once
    assert [p.name for p in tmp_path.iterdir()] == ["enc.json"]
    assert target.read_bytes() == b"next"


def test_a_living_writers_temporary_is_kept_and_goes_once_it_dies(tmp_path: Path) -> None:
    target = tmp_path / "enc.json"
    child = start_blocked(write_blocked(target), tmp_path)
    try:
        (theirs,) = tmp_path.iterdir()
        assert writer_alive(theirs) is True
        old = time.time() - 10 * 3600  # even untouched for hours: its lock says it lives
        os.utime(theirs, (old, old))
        write_atomically(target, b"ours")
        assert remove_stale_temporaries(tmp_path) == []
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([theirs.name, "enc.json"])
    finally:
        child.kill()
        child.communicate()
    assert remove_stale_temporaries(tmp_path) == [theirs]
    assert target.read_bytes() == b"ours"


def test_a_folder_that_is_not_a_writers_is_never_emptied(tmp_path: Path) -> None:
    """A user's own hidden ``.x.tmp`` folder holding files stays, however old; an old empty
    one (a writer killed before it locked its folder) goes."""
    users, empty = tmp_path / ".notes.tmp", tmp_path / ".enc.json.a1b2c3.tmp"
    users.mkdir()
    (users / "mine.txt").write_text("keep")
    empty.mkdir()
    old = time.time() - 10 * 3600
    for p in (users / "mine.txt", users, empty):
        os.utime(p, (old, old))
    assert remove_stale_temporaries(tmp_path) == [empty]
    assert (users / "mine.txt").read_text() == "keep"


def test_files_is_a_base_layer() -> None:
    """qcompile.specs writes through it, and may import nothing but pydantic, yaml and the
    base layer: qcompile.files imports the standard library only."""
    tree = ast.parse(Path(files.__file__).read_text(encoding="utf-8"))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert imported - {"__future__"} <= sys.stdlib_module_names, imported
