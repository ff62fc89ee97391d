"""Lazy reads of a safetensors checkpoint: one file, or a folder of shards with an index
(the Hugging Face layout, ``model.safetensors.index.json``'s ``weight_map``).

Nothing is read until asked for, and then only the rows asked for (``safe_open`` /
``get_slice``: the file is memory-mapped, a rank reading its shard of a tensor touches
only those bytes). ``check`` compares the headers with the model's state dict: every
rank reads the same headers, so every rank refuses a bad checkpoint with the same
``QCompileError`` before any collective could hang.

Example:
    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> from qcompile.distributed.checkpoint import Checkpoint
    >>> path = tempfile.mkdtemp() + "/model.safetensors"
    >>> model = torch.nn.Linear(4, 6)
    >>> save_file(dict(model.state_dict()), path)
    >>> ckpt = Checkpoint(path)
    >>> ckpt.check(model)
    >>> ckpt.read("weight", slice(0, 3)).shape
    torch.Size([3, 4])
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qcompile.errors import QCompileError

INDEX = "model.safetensors.index.json"
# safetensors' dtype names (the header's), as torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# bytes of one piece of a box read (``read_box_into``): rows at a time, never a whole tensor
CHUNK_BYTES = 1 << 20
_FIX_CKPT = ("save the model's state_dict with safetensors.torch.save_file (or "
             "save_pretrained), from the same model class and configuration")


def _hub_blob(folder: Path, real: Path) -> bool:
    """Whether ``real`` is a blob of the Hugging Face hub cache repository whose snapshot
    ``folder`` is, or is in (``<repo>/snapshots/<revision>/`` links its files to
    ``<repo>/blobs/``)."""
    for snapshot in (folder, *folder.parents):
        if snapshot.parent.name == "snapshots":
            return real.parent == snapshot.parent.parent / "blobs"
    return False


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Checkpoint:
    """A safetensors checkpoint: ``path`` is a ``.safetensors`` file or a folder holding
    one, or shards plus ``model.safetensors.index.json``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.files = self._files()
        self._open: dict[Path, Any] = {}
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}
        self._stack = contextlib.ExitStack()
        self.entries: dict[str, tuple[tuple[int, ...], torch.dtype, Path]] = {}
        self.aliases: dict[str, str] = {}  # a tied name -> the name it is saved under
        for file, names in self.files.items():
            handle = self._handle(file)
            held = set(handle.keys())
            for name in names if names is not None else sorted(held):
                if name not in held:
                    raise QCompileError(f"checkpoint {str(self.path)!r}: the index maps "
                                        f"tensor {name!r} to {file.name}, which lacks it",
                                        fix="rewrite the index, or save the checkpoint again")
                piece = handle.get_slice(name)
                kind = piece.get_dtype()
                if kind not in _DTYPES:
                    raise QCompileError(f"checkpoint tensor {name!r} has dtype {kind}, which "
                                        "qcompile does not read", fix=_FIX_CKPT)
                self.entries[name] = (tuple(piece.get_shape()), _DTYPES[kind], file)

    def _files(self) -> dict[Path, list[str] | None]:
        """Each file and the tensors the index says it holds (None: all of them)."""
        if self.path.is_file():
            return {self.path: None}
        if not self.path.is_dir():
            raise QCompileError(f"checkpoint {str(self.path)!r} does not exist",
                                fix="give a .safetensors file or a folder of shards with "
                                    f"{INDEX}")
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (ValueError, KeyError, TypeError) as e:
                raise QCompileError(f"checkpoint index {str(index)!r} is not a safetensors "
                                    f"index ({type(e).__name__}: {e})",
                                    fix=f"{INDEX} needs a 'weight_map' of tensor -> file"
                                    ) from None
            files: dict[Path, list[str] | None] = {}
            for name, file in sorted(weight_map.items()):  # every entry, before any is read
                files.setdefault(self._inside(index, name, file), []).append(name)  # type: ignore[union-attr]
            return files
        found = sorted(self.path.glob("*.safetensors"))
        if len(found) != 1:
            raise QCompileError(f"checkpoint folder {str(self.path)!r} has "
                                f"{len(found)} .safetensors files and no {INDEX}",
                                fix=f"give one file, or shards with {INDEX}")
        return {found[0]: None}

    def _inside(self, index: Path, name: str, file: object) -> Path:
        """The shard ``file`` the index names for tensor ``name``, refused unless it is a
        file name inside the checkpoint folder: an index is data from wherever the
        checkpoint came from, and must not make qcompile read other files (an absolute
        path, ``..``, a symlink pointing out of the folder). One exception: the Hugging Face
        hub cache, whose ``snapshots/<revision>/`` links point into the same repository's
        ``blobs/``."""
        def refuse(why: str) -> QCompileError:
            return QCompileError(f"checkpoint index {str(index)!r}: weight_map entry "
                                 f"{name!r} -> {file!r} {why}",
                                 fix="the index must name shard files inside its folder "
                                     "(e.g. 'model-00001-of-00002.safetensors'); rewrite it, "
                                     "or save the checkpoint again")
        if not isinstance(file, str) or not file.strip():
            raise refuse("is not a file name")
        relative = Path(file)
        if relative.is_absolute() or relative.drive or relative.root:
            raise refuse("is an absolute path, outside the checkpoint folder")
        if ".." in relative.parts:
            raise refuse("climbs out of the checkpoint folder ('..')")
        folder = self.path.resolve()
        real = (self.path / relative).resolve()
        if not real.is_relative_to(folder) and not _hub_blob(folder, real):
            raise refuse(f"is a link to {str(real)!r}, outside the checkpoint folder")
        return self.path / relative

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            from safetensors import safe_open

            try:
                self._open[file] = self._stack.enter_context(
                    safe_open(str(file), framework="pt", device="cpu"))
            except Exception as e:  # truncated, not safetensors, unreadable
                first = (str(e).strip().splitlines() or [""])[0]
                raise QCompileError(f"checkpoint file {str(file)!r} cannot be read "
                                    f"({type(e).__name__}: {first})",
                                    fix="the file is truncated or not safetensors: copy or "
                                        "save it again") from None
        return self._open[file]

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def check(self, model: nn.Module) -> None:
        """Refuse a checkpoint that does not fit ``model`` (built on the meta device is
        fine): a missing, extra, misshaped or retyped tensor, named. A tensor the model
        holds under several names (tied input and output embeddings) may be saved under
        any one of them, as ``save_pretrained`` and ``safetensors.torch.save_model`` save
        it; reading the others reads that one."""
        want = model.state_dict(keep_vars=True)
        names: dict[int, list[str]] = {}
        for name, t in want.items():
            names.setdefault(id(t), []).append(name)
        for tied in names.values():
            saved = [n for n in tied if n in self.entries]
            if saved:
                self.aliases.update({n: saved[0] for n in tied if n not in self.entries})
        missing = sorted(set(want) - set(self.entries) - set(self.aliases))
        extra = sorted(set(self.entries) - set(want))
        if missing:
            raise QCompileError(f"checkpoint {str(self.path)!r} lacks tensor {missing[0]!r} "
                                f"({len(missing)} missing) that {type(model).__name__} has",
                                fix=_FIX_CKPT)
        if extra:
            raise QCompileError(f"checkpoint {str(self.path)!r} has tensor {extra[0]!r} "
                                f"({len(extra)} extra) that {type(model).__name__} does not",
                                fix=_FIX_CKPT + "; or remove the extra tensors")
        for name, t in want.items():
            shape, dtype, _ = self.entries[self.aliases.get(name, name)]
            if shape != tuple(t.shape):
                raise QCompileError(f"checkpoint tensor {name!r} has shape {list(shape)}, the "
                                    f"model's is {list(t.shape)}", fix=_FIX_CKPT)
            if dtype != t.dtype:
                raise QCompileError(f"checkpoint tensor {name!r} is {_short(dtype)}, the "
                                    f"model's is {_short(t.dtype)}",
                                    fix=_FIX_CKPT + "; or build the model in the checkpoint's "
                                    "dtype")

    def _offsets(self, file: Path) -> tuple[int, dict[str, Any]]:
        """(where the data starts, the header) of ``file``: the safetensors layout is an
        8-byte little-endian header length, a JSON header (dtype, shape and byte offsets
        per tensor), then the data. ``safe_open`` validated it when the file was opened."""
        if file not in self._headers:
            with open(file, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + length, json.loads(f.read(length)))
        return self._headers[file]

    def read_into(self, name: str, rows: slice | None, out: torch.Tensor) -> bool:
        """Read tensor ``name`` (rows ``rows`` of dim 0) straight into ``out``, a contiguous
        CPU tensor of the entry's dtype and the rows' shape: one ``readinto`` of one byte
        range, no memory map and no temporary (a rank's resident memory is its shard, not
        also the file's pages). False when ``out`` does not qualify: use ``read``."""
        name = self.aliases.get(name, name)
        shape, dtype, file = self.entries[name]
        if (out.device.type != "cpu" or out.dtype != dtype or not out.is_contiguous()
                or out.numel() == 0 or not shape):
            return out.numel() == 0 and bool(shape)  # nothing to read for an empty shard
        start, header = self._offsets(file)
        begin, end = header[name]["data_offsets"]
        row = (end - begin) // shape[0] if shape[0] else 0
        first = rows.start if rows is not None else 0
        want = out.numel() * out.element_size()
        if want != row * ((rows.stop - rows.start) if rows is not None else shape[0]):
            return False
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        with open(file, "rb", buffering=0) as f:
            f.seek(start + begin + first * row)
            got = 0
            while got < want:  # readinto may return fewer bytes than asked
                n = f.readinto(view[got:])
                if not n:
                    raise QCompileError(f"checkpoint file {str(file)!r} ends inside tensor "
                                        f"{name!r}", fix="the file is truncated: copy or save "
                                        "it again")
                got += n
        return True

    def read_box_into(self, name: str, box: tuple[slice, ...], out: torch.Tensor) -> bool:
        """Read the box ``box`` of tensor ``name`` (one slice per dim, steps of 1: a
        rowwise tensor-parallel shard's columns of its rows) into ``out``, a contiguous CPU
        tensor of the box's shape (of another dtype: converted as ``copy_`` does). The
        box's rows are read a few at a time, into one buffer of about ``CHUNK_BYTES`` (one
        row when a row is larger): never the whole tensor, whose freed pages the allocator
        may keep. False when ``out`` does not qualify: use ``read``."""
        name = self.aliases.get(name, name)
        shape, dtype, _ = self.entries[name]
        if (out.device.type != "cpu" or not out.is_contiguous()
                or len(box) != len(shape) or not shape
                or any(b.step not in (None, 1) for b in box)):
            return False
        sizes = [len(range(*b.indices(n))) for b, n in zip(box, shape)]
        if list(out.shape) != sizes:
            return False
        if out.numel() == 0:
            return True
        rows = range(*box[0].indices(shape[0]))
        within = (slice(None), *box[1:])
        row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
        step = max(1, CHUNK_BYTES // row_bytes)
        buffer = torch.empty((min(step, len(rows)), *shape[1:]), dtype=dtype)
        for i in range(0, len(rows), step):
            n = min(step, len(rows) - i)
            if not self.read_into(name, slice(rows.start + i, rows.start + i + n), buffer[:n]):
                return False
            out[i:i + n].copy_(buffer[:n][within])
        return True

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name`` (rows ``rows`` of its first dimension only, when given), in a
        new tensor of this process's own memory (``read_into``): the file's pages are
        never mapped, so what a rank read does not stay resident as the file's until
        ``close``, on top of what it made of it (a frozen base's codes)."""
        name = self.aliases.get(name, name)
        shape, dtype, file = self.entries[name]
        if shape:
            n = shape[0] if rows is None else len(range(*rows.indices(shape[0])))
            out = torch.empty((n, *shape[1:]), dtype=dtype)
            whole = rows if rows is None else slice(*rows.indices(shape[0])[:2])
            if (rows is None or rows.step in (None, 1)) and self.read_into(name, whole, out):
                return out
            del out
        piece = self._handle(file).get_slice(name)  # a scalar, or rows with a step
        if rows is None or not shape:
            return piece[:].clone() if shape else self._handle(file).get_tensor(name).clone()
        return piece[rows].clone()

    def content_hash(self) -> str:
        """SHA-256 over every file's bytes (in name order): what a cache entry is keyed on."""
        h = hashlib.sha256()
        for file in sorted(self.files):
            h.update(file.name.encode())
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
        return h.hexdigest()
