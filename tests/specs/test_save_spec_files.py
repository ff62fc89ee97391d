"""``qc.save_spec`` / ``dump_spec`` write whole files or none: a save killed mid-write leaves
the previous spec (never an empty one) and a temporary the next save removes; the file gets
the mode the umask gives a new file; a missing folder or a folder as the path is refused
before anything is written."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from killed_writer import kill_mid_write

from qcompile.errors import QCompileError
from qcompile.specs import dump_spec, load_spec, save_spec


@pytest.mark.parametrize("name", ["spec.yaml", "spec.json"])
def test_a_killed_save_leaves_the_previous_spec(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    save_spec(load_spec("int8-qat"), path)
    before = path.read_bytes()
    kill_mid_write(f"""
        import pathlib
        pathlib.Path.write_text = torn(pathlib.Path.write_text)
        from qcompile.specs import load_spec, save_spec
        save_spec(load_spec("w8-weight-only"), {str(path)!r})
        """, tmp_path)
    assert path.read_bytes() == before and load_spec(path) == load_spec("int8-qat")
    assert [p.name for p in tmp_path.iterdir() if p != path]  # the killed writer's
    save_spec(load_spec("w8-weight-only"), path)  # the next save removes it
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert load_spec(path) == load_spec("w8-weight-only")


@pytest.mark.parametrize("write", [save_spec, dump_spec])
def test_the_mode_follows_the_umask(tmp_path: Path, umask: int, write) -> None:
    write(load_spec("int8-qat"), tmp_path / "s.yaml")
    assert stat.S_IMODE((tmp_path / "s.yaml").stat().st_mode) == {0o022: 0o644,
                                                                  0o077: 0o600}[umask]


@pytest.mark.parametrize("write", [save_spec, dump_spec])
def test_a_missing_folder_or_a_folder_is_refused(tmp_path: Path, write) -> None:
    name = write.__name__
    with pytest.raises(QCompileError, match=f"{name}: the folder .*missing.* does not exist"
                       ) as e:
        write(load_spec("int8-qat"), tmp_path / "missing" / "s.yaml")
    assert "os.makedirs" in e.value.fix
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(QCompileError, match=f"{name}: .*d.yaml' is a folder"):
        write(load_spec("int8-qat"), tmp_path / "d.yaml")
    assert [p.name for p in tmp_path.iterdir()] == ["d.yaml"]  # nothing written
    assert list((tmp_path / "d.yaml").iterdir()) == []
