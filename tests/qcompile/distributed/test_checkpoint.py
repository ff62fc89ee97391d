"""``Checkpoint``'s reads against safetensors' own loader: any box of a tensor (a rowwise
tensor-parallel shard's columns of a FSDP2 shard's rows), read a few rows at a time
through a buffer smaller than one row or than the box, into the file's dtype or another,
gives the bytes ``safetensors.torch.load_file`` gives for that box."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from qcompile.distributed import checkpoint
from qcompile.distributed.checkpoint import Checkpoint

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


@st.composite
def boxes(draw: st.DrawFn) -> tuple[list[int], tuple[slice, ...]]:
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    box = []
    for n in shape:
        start = draw(st.integers(0, n))
        box.append(slice(start, draw(st.integers(start, n))))
    return shape, tuple(box)


@given(boxes(), st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.integers(1, 64),
       st.integers(0, 2 ** 16))
def test_a_box_reads_what_safetensors_loads(shape_box: tuple[list[int], tuple[slice, ...]],
                                            stored: torch.dtype, wanted: torch.dtype,
                                            chunk: int, seed: int) -> None:
    shape, box = shape_box
    g = torch.Generator().manual_seed(seed)
    value = (torch.randn(shape, generator=g) * 50).to(stored)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        save_file({"w": value}, path)
        want = load_file(path)["w"][box].to(wanted)
        out = torch.full(want.shape, 7, dtype=wanted)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(checkpoint, "CHUNK_BYTES", chunk)  # rows one by one, or several
            ckpt = Checkpoint(path)
            try:
                assert ckpt.read_box_into("w", box, out)
            finally:
                ckpt.close()
    assert torch.equal(out, want)


def test_a_box_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    """Not the box's shape, not contiguous, a step: False, ``out`` untouched."""
    save_file({"w": torch.arange(12.0).view(3, 4)}, tmp_path / "m.safetensors")
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    box = (slice(0, 3), slice(1, 3))
    try:
        for out in (torch.zeros(3, 3), torch.zeros(2, 3).t(), torch.zeros(3, 2, 1)):
            before = out.clone()
            assert not ckpt.read_box_into("w", box, out)
            assert torch.equal(out, before)
        assert not ckpt.read_box_into("w", (slice(0, 3, 2), slice(1, 3)), torch.zeros(2, 2))
        out = torch.zeros(3, 2)
        assert ckpt.read_box_into("w", box, out)
        assert torch.equal(out, torch.arange(12.0).view(3, 4)[:, 1:3])
    finally:
        ckpt.close()
