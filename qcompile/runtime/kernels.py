"""Fused CPU fake-quant kernels: a small C++ extension registered as ``torch.ops.qcompile``.

``qcompile/runtime/csrc/fake_quant.cpp`` and ``block_quant.cpp`` are compiled on first use
with torch's own ``torch.utils.cpp_extension`` (JIT, ``-O3``, no fast-math: the results are
bit-identical to the eager formulations in ``qcompile.runtime.quant_math`` and
``qcompile.runtime.block_formats``) into one library in a persistent build directory named
after the sources, the flags and the torch version, so later processes only load it. It
registers these operators (with CPU, Meta and Autograd kernels, so graphs holding them run
under ``torch.compile`` and ``torch.export``):

- ``qcompile::fake_quant(x, scale, zero_point, quant_min, quant_max)``: fixed scale,
  straight-through gradient; the forward saves a 1-bit-per-element mask;
- ``qcompile::fake_quant_lsq(x, scale, zero_point, quant_min, quant_max, grad_factor)``:
  learnable scale (LSQ), gradients for ``x`` and ``scale`` (the backward recomputes from
  ``x``; the scale gradient is summed in float64, in a fixed order);
- the pieces they are made of: ``fake_quant_ste_fwd`` (output and bit mask),
  ``fake_quant_ste_bwd``, ``fake_quant_lsq_bwd``; ``fake_quant_bwd(grad, mask)`` (a bool
  mask of ``grad``'s shape); ``fake_quant_isa()`` (the instruction set in use) and
  ``fake_quant_release_cache()`` (see ``release_cache``);
- ``qcompile::observe_minmax(x, min_val, max_val, scale, zero_point, quant_min, quant_max,
  symmetric, momentum=-1)``: a min-max (``momentum < 0``) or moving-average observer's
  update and the qparams it gives, per row of ``x`` (per-channel along dim 0, or
  per-tensor), in place, in one pass over ``x`` (what ``FakeQuantize.observe_tensor`` runs;
  bit-identical to the Python path);
- ``qcompile::fake_quant_observe(...)`` (the same arguments): ``observe_minmax`` and then
  ``fake_quant`` with the new qparams, in one call, with the straight-through node; a
  weight's rows are read once (each row's min / max, its qparams, then its forward while
  the row is in cache), a mask is kept only when an element was clamped, and an output of
  2 MB and more is written with streaming stores. What an observing quantizer's forward
  runs.
- ``qcompile::fake_quant_minmax(x, scale, zero_point, quant_min, quant_max, min_val,
  max_val)``: ``fake_quant`` (the same bits, the same straight-through node), and ``x``'s
  minimum and maximum per scale (per-tensor or per-channel) folded into ``min_val`` /
  ``max_val`` in place (``torch.minimum`` / ``torch.maximum``, NaN propagating), in one pass
  over ``x`` (float32, bfloat16; float16 through float32): what a training forward with
  step observer updates runs (the step's qparams, its pending statistics).
- ``qcompile::fake_quant_overwrite(x, ...)`` and ``fake_quant_minmax_overwrite(x, ...)``
  (``fake_quant``'s and ``fake_quant_minmax``'s arguments): the same, the output written
  over ``x``'s memory when nothing else holds it (a plain contiguous float32 / bfloat16
  CPU tensor, not a leaf needing a gradient, no other tensor on its storage but, for a
  view, its base, which nothing else holds); the returned tensor then shares ``x``'s
  storage, ``x``'s version moves on and its values are the output. Otherwise a new
  output, as the plain operators. What a marked activation quantizer's training forward
  runs (``passes.overwrite_inputs``): the caller promises that nothing reads ``x`` after.
- ``qcompile::block_fake_quant(x, fmt, block)``: the block-scaled formats' fake-quant (MX,
  NVFP4, NF4; ``fmt`` a name of ``block_formats.FORMATS``) over consecutive ``block``-element
  blocks of the contiguous ``x`` (float32, bfloat16 or float16), with a straight-through
  (identity) gradient; what ``block_formats.fake_quantize_block`` runs on CPU tensors.
- ``qcompile::dequant_lut4(packed, lut, scale, block)`` / ``dequant_lut8(codes, lut, scale,
  block)``: ``lut[code] * scale[block]`` over 4-bit codes packed two per byte or one code
  per byte, float32 ``[rows, cols]``: a frozen base's dequantization
  (``qcompile.runtime.frozen``), about a copy's cost, bit-identical to the torch formula.

The straight-through node keeps no mask when nothing was clamped (a weight under its own
min-max range): its backward then hands the incoming gradient on as is (``grad * 1``, the
same bits) instead of reading it and writing a copy. Otherwise it masks the incoming
gradient where it lies when nothing else holds it (as autograd's gradient accumulation
steals one), else into a new tensor.

With gradients, a call records exactly one autograd node (``FakeQuantSTEBackward`` /
``FakeQuantLSQBackward``, C++ nodes like torch's generated ones: no Python runs in the
forward or the backward). Outputs of 1 MB and more are allocated from a small cache of
freed blocks (at most ``QCOMPILE_FQ_POOL_MB``, default 256, 0 turns it off): a fresh
output's page faults cost more than the kernel writing it, and training frees and
re-allocates the same sizes every step.

Under ``torch.compile`` (dynamo tracing) ``quant_math`` uses the eager formula instead of
these operators, so Inductor fuses the fake-quant into its own kernels (CPU and CUDA);
``torch.export`` records ``qcompile::fake_quant`` itself.

``scale`` and ``zero_point`` broadcast against ``x`` as in the eager formula: one value
(per-tensor), a ``[1, .., C, .., 1]`` view (per-channel), ``[rows, groups, 1]`` against
``x`` viewed as ``[rows, groups, group_size]`` (per-group) or ``[..., 1]`` (per-token).
``qcompile.runtime.quant_math.fake_quantize`` routes CPU tensors here and everything else (CUDA,
meta, fp8) to the eager autograd Functions; so does ``QCOMPILE_NO_EXT=1``, or a failed
build (with one warning). ``python -m qcompile.runtime.kernels`` builds it ahead of time.

Example:
    >>> import torch
    >>> from qcompile.runtime import kernels
    >>> from qcompile.runtime.quant_math import fake_quantize
    >>> x = torch.tensor([-3.0, -0.75, 0.25, 0.75, 9.0])
    >>> s, z = torch.tensor([0.5]), torch.tensor([0], dtype=torch.int32)
    >>> y = fake_quantize(x, s, z, -4, 3)  # ties to even, clamped to [-4, 3] steps
    >>> y
    tensor([-2.0000, -1.0000,  0.0000,  1.0000,  1.5000])
    >>> ops = kernels.load()  # torch.ops.qcompile, or None without a C++ compiler
    >>> ops is None or torch.equal(ops.fake_quant(x, s, z, -4, 3), y)
    True
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

NAME = "qcompile_fake_quant"
SOURCE = Path(__file__).resolve().parent / "csrc" / "fake_quant.cpp"
# the block-scaled formats' fake-quant (``qcompile::block_fake_quant``), in the same library
BLOCK_SOURCE = Path(__file__).resolve().parent / "csrc" / "block_quant.cpp"
# table-lookup dequantization of frozen bases (``qcompile::dequant_lut4`` / ``dequant_lut8``)
DEQUANT_SOURCE = Path(__file__).resolve().parent / "csrc" / "dequant.cpp"
# No fast-math (IEEE division and rounding), no contraction into FMAs: bit-identical to
# the eager formula. OpenMP: at::parallel_for is an inline OpenMP region (torch's libgomp).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math")
LDFLAGS = ("-fopenmp",)


def build_directory() -> Path:
    """Where the extension is built: ``$QCOMPILE_EXT_DIR``, else the user cache, in a
    folder named after the source, the flags, torch and Python (a change rebuilds)."""
    key = hashlib.sha256()
    for source in _sources():
        key.update(source.read_bytes())
    key.update(repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2])).encode())
    root = os.environ.get("QCOMPILE_EXT_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        root = os.path.join(cache, "qcompile", "extensions")
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return Path(root) / f"{NAME}-{tag}-{key.hexdigest()[:16]}"


def _sources() -> tuple[Path, ...]:
    """The extension's C++ sources (read at each call: tests swap ``SOURCE``)."""
    return (SOURCE, BLOCK_SOURCE, DEQUANT_SOURCE)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's builder runs ``ninja`` from PATH; a venv that is not activated has the
    ``ninja`` package's binary elsewhere: put it on PATH for the build only."""
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        yield  # the build reports that ninja is missing
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


@functools.cache
def load() -> Any:
    """The ``torch.ops.qcompile`` namespace with the kernels loaded, building them on the
    first call; None when ``QCOMPILE_NO_EXT=1`` or the build fails (one warning)."""
    if os.environ.get("QCOMPILE_NO_EXT", "") not in ("", "0"):
        return None
    try:
        folder = build_directory()
        library = folder / f"{NAME}.so"
        if library.exists() and not (folder / "lock").exists():  # built: no ninja needed
            torch.ops.load_library(str(library))
        else:
            from torch.utils.cpp_extension import load as build

            folder.mkdir(parents=True, exist_ok=True)
            # torch's file lock in the build folder serialises concurrent builders
            with _ninja_on_path():
                build(name=NAME, sources=[str(s) for s in _sources()], extra_cflags=list(CFLAGS),
                      extra_ldflags=list(LDFLAGS), build_directory=str(folder),
                      is_python_module=False, verbose=False)
        ops = torch.ops.qcompile
        ops.fake_quant.default  # noqa: B018  (raises if the library did not register)
        ops.block_fake_quant.default  # noqa: B018
    except Exception as err:  # no compiler, no ninja, a build error: stay correct, go slow
        first = str(err).strip().splitlines()
        warnings.warn(
            "qcompile: the fast fake-quant kernels could not be built "
            f"({type(err).__name__}: {first[0][:300] if first else ''}); using the eager "
            "implementation (same results, slower). Set QCOMPILE_NO_EXT=1 to silence this.",
            RuntimeWarning, stacklevel=2)
        return None
    return ops


def release_cache() -> int:
    """Free the output blocks the kernels keep for reuse (at most ``QCOMPILE_FQ_POOL_MB``);
    returns the bytes freed (0 without the kernels).

    Example:
        >>> from qcompile.runtime import kernels
        >>> kernels.release_cache() >= 0
        True
    """
    ops = load()
    return int(ops.fake_quant_release_cache()) if ops is not None else 0


def available() -> bool:
    """Whether the kernels are loaded (a constant to ``torch.compile``)."""
    return load() is not None


# What ``torch.compiler.assume_constant_result`` sets (torch._dynamo reads the attribute
# when it traces a call): the decorator itself imports torch._dynamo, seconds of every
# process's start-up, for a program that may never compile.
available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def main() -> int:
    """``python -m qcompile.runtime.kernels``: build (or find) the extension, print how long."""
    t0 = time.perf_counter()
    ops = load()
    dt = time.perf_counter() - t0
    if ops is None:
        print("qcompile kernels: not available (QCOMPILE_NO_EXT set or build failed); "
              "the eager fake-quant is used")
        return 1
    print(f"qcompile kernels: ready in {dt:.1f} s ({ops.fake_quant_isa()}) "
          f"in {build_directory()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
