"""One rank of the two-rank architecture sweep (``test_architectures_dist.py`` launches
two): ``qc.distributed.compile_once`` of a tiny Hugging Face model under FSDP2, from a
safetensors checkpoint, next to one process's ``qc.qcompile`` of the same model.

Run as a script, never imported from the tests folder::

    python tests/dist/_architectures_worker.py OUTDIR CASE [CASE ...]

A case is ``<family>__<preset>`` (``llama__qlora-nf4``); each rank writes
``OUTDIR/rank<r>.json`` after every case (a ``QCompileError``, which compile_once raises on
every rank alike, is the case's ``once_error`` and the next case runs). Rank 0 writes each
family's checkpoint once, before the first case that needs it.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _worker_main import run_cases

from qcompile.errors import QCompileError
from qcompile.tools.bench.suites.architectures import compile_once_case, write_checkpoint

PG_TIMEOUT = datetime.timedelta(seconds=60)


def case(outdir: Path, name: str) -> Any:
    family, preset = name.split("__")

    def run() -> dict[str, Any]:
        ckpt = outdir / f"{family}.safetensors"
        if dist.get_rank() == 0 and not ckpt.exists():
            write_checkpoint(family, str(ckpt))
        dist.barrier()
        try:
            return compile_once_case(family, preset, dist.get_rank(), dist.get_world_size(),
                                     str(ckpt))
        except QCompileError as e:  # every rank raises it (compile_once agrees first)
            return {"once_error": f"{e.message}\n  fix: {e.fix}"}
    return run


if __name__ == "__main__":
    out = Path(sys.argv[1])
    names = sys.argv[2:]
    sys.exit(run_cases(out, names, {n: case(out, n) for n in names}, PG_TIMEOUT))
