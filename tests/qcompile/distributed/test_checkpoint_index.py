"""A safetensors index is data from wherever the checkpoint came from: a ``weight_map`` entry
that leaves its folder (an absolute path, ``..``, a link pointing out) is a ``QCompileError``
naming the entry, raised before any shard is opened. Shards inside the folder, links between
them, and the Hugging Face hub cache's snapshot links into its ``blobs/`` are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

import qcompile as qc
from qcompile.distributed.checkpoint import INDEX, Checkpoint

TENSORS = {"a.weight": torch.ones(2, 3), "b.bias": torch.zeros(2)}


def sharded(folder: Path, b_file: str) -> Path:
    """A checkpoint folder: ``a.weight`` in a shard inside it, ``b.bias`` where the index
    says ``b_file`` is."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"a.weight": TENSORS["a.weight"]}, folder / "a.safetensors")
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        "a.weight": "a.safetensors", "b.bias": b_file}}))
    return folder


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files safetensors opens."""
    seen: list[str] = []
    real = safetensors.safe_open

    def spy(path, *args, **kwargs):
        seen.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    return seen


@pytest.mark.parametrize("where", ["dotdot", "absolute", "link", "nested-dotdot", "number"])
def test_an_entry_leaving_the_folder_is_refused_before_any_read(
        tmp_path: Path, where: str, opened: list[str]) -> None:
    outside = tmp_path / "secret.safetensors"  # a readable safetensors file: reading works
    save_file({"b.bias": TENSORS["b.bias"]}, outside)
    folder = tmp_path / "ckpt"
    b_file = {"dotdot": "../secret.safetensors", "absolute": str(outside),
              "link": "b.safetensors", "nested-dotdot": "sub/../../secret.safetensors",
              "number": 7}[where]
    sharded(folder, b_file)
    if where == "link":
        (folder / "b.safetensors").symlink_to(outside)
    with pytest.raises(qc.QCompileError, match=r"weight_map entry 'b.bias'") as e:
        Checkpoint(folder)
    assert str(folder / INDEX) in str(e.value) and "inside its folder" in e.value.fix
    assert opened == []  # not even the good shard was opened


def test_shards_and_links_inside_the_folder_are_read(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "ckpt", "sub/b.safetensors")
    (folder / "sub").mkdir()
    save_file({"b.bias": TENSORS["b.bias"]}, folder / "sub" / "real.safetensors")
    (folder / "sub" / "b.safetensors").symlink_to("real.safetensors")
    ckpt = Checkpoint(folder)
    assert sorted(ckpt.entries) == sorted(TENSORS)
    assert torch.equal(ckpt.read("b.bias"), TENSORS["b.bias"])


def test_a_hugging_face_hub_snapshot_is_read(tmp_path: Path) -> None:
    """``huggingface_hub`` stores ``<repo>/snapshots/<rev>/<file>`` as links to
    ``<repo>/blobs/<hash>``: out of the snapshot folder, but the same repository's."""
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    save_file({"a.weight": TENSORS["a.weight"]}, blobs / "1111")
    save_file({"b.bias": TENSORS["b.bias"]}, blobs / "2222")
    (blobs / "3333").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.bias": "model-00002-of-00002.safetensors"}}))
    for name, blob in (("model-00001-of-00002.safetensors", "1111"),
                       ("model-00002-of-00002.safetensors", "2222"), (INDEX, "3333")):
        (snapshot / name).symlink_to(Path("../../blobs") / blob)
    ckpt = Checkpoint(snapshot)
    assert torch.equal(ckpt.read("a.weight"), TENSORS["a.weight"])
    # another repository's blobs are outside, like any other folder
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    save_file({"b.bias": TENSORS["b.bias"]}, other / "4444")
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    (snapshot / "model-00002-of-00002.safetensors").symlink_to(other / "4444")
    with pytest.raises(qc.QCompileError, match=r"'b.bias'.*outside the checkpoint folder"):
        Checkpoint(snapshot)
