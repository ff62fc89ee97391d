"""Which integer kernels compute what a ``quant.target`` simulated, on this CPU.

torch's quantized kernels come from engines (``torch.backends.quantized.engine``):
``x86`` / ``fbgemm`` / ``onednn`` multiply uint8 activations by int8 weights and, on CPUs
without VNNI (AVX2-only x86), add adjacent products into int16 *with saturation*
(``vpmaddubsw``): full-range uint8 activations then give wrong sums, which is why the
``x86`` target keeps activations in 7 bits (127 * 128 * 2 = 32512 fits int16). ``qnnpack``
accumulates in int32 on every CPU. A target is honoured by packing the weights with the
engine that computes exactly what the graph simulated:

============  ==================  ====================================================
target        activation range    engine used by ``qc.convert``
============  ==================  ====================================================
x86           7-bit (reduced)     ``x86`` (fbgemm / onednn): exact on every x86 CPU
onednn_vnni   8-bit               ``x86``, only on a CPU with VNNI (else refused)
qnnpack       8-bit               ``qnnpack`` (int32 accumulation)
generic       8-bit               ``qnnpack`` where available, else ``x86`` with VNNI
============  ==================  ====================================================

Packed weights keep the engine they were packed with (running them does not consult the
global setting), so ``use_engine`` sets the engine only while a converted graph is built.

Example:
    >>> import torch
    >>> from qcompile.runtime.engines import engine_for, use_engine
    >>> engine_for("qnnpack") in (None, "qnnpack")
    True
    >>> before = torch.backends.quantized.engine
    >>> with use_engine("qnnpack" if "qnnpack" in torch.backends.quantized.supported_engines
    ...                 else before):
    ...     pass
    >>> torch.backends.quantized.engine == before
    True
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from qcompile.errors import QCompileError

# For tests and benchmarks: pretend the CPU lacks VNNI (as AVX2-only CPUs do), so the
# refusals and engine choices of those CPUs can be exercised on any machine.
_NO_VNNI_ENV = "QCOMPILE_ASSUME_NO_VNNI"


def has_vnni() -> bool:
    """Whether the CPU has AVX-512 VNNI (fbgemm's int8 kernels then accumulate in int32)."""
    if os.environ.get(_NO_VNNI_ENV) == "1":
        return False
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(probe()) if probe is not None else False


def _available(engine: str) -> bool:
    return engine in torch.backends.quantized.supported_engines


def engine_for(target: str) -> str | None:
    """The engine whose kernels compute what ``target`` simulated on this CPU, or None."""
    if target == "x86":
        return "x86" if _available("x86") else ("fbgemm" if _available("fbgemm") else None)
    if target == "onednn_vnni":
        return "x86" if _available("x86") and has_vnni() else None
    if target == "qnnpack":
        return "qnnpack" if _available("qnnpack") else None
    if target == "generic":
        if _available("qnnpack"):
            return "qnnpack"
        return "x86" if _available("x86") and has_vnni() else None
    raise ValueError(f"unknown quant.target {target!r}")


def require_engine(target: str) -> str:
    """``engine_for(target)``, or a ``QCompileError`` naming the target to choose."""
    engine = engine_for(target)
    if engine is not None:
        return engine
    engines = ", ".join(torch.backends.quantized.supported_engines)
    if target == "onednn_vnni":
        why = "this CPU has no AVX-512 VNNI: its int8 kernels add pairs of products in int16 " \
              "with saturation, so full-range 8-bit activations would compute something else"
        fix = "compile with quant.target: x86 (7-bit activations, exact on every x86 CPU), " \
              "or quant.target: qnnpack"
    elif target == "x86":
        why = f"this build of torch has no x86/fbgemm quantized engine (it has: {engines})"
        fix = "compile with quant.target: qnnpack (ARM / mobile kernels)"
    else:
        why = f"no quantized engine here computes it exactly (engines: {engines})"
        fix = "compile with quant.target: x86 on x86 CPUs or qnnpack on ARM"
    raise QCompileError(f"convert: quant.target {target!r} cannot run on this machine: {why}",
                        fix=fix)


@contextlib.contextmanager
def use_engine(engine: str) -> Iterator[None]:
    """Set ``torch.backends.quantized.engine`` for the block, restoring it afterwards."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before
