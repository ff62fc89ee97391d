"""One rank of the 2-process ``qc.convert``-of-a-sharded-graph test
(``test_convert_sharded.py`` launches two; run as a script, never imported)::

    python tests/dist/_convert_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` (or torchrun's variables) set. Each rank
writes ``OUTDIR/rank<r>.json`` (``{case: result}``) after every case.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _worker_main import cases_in, run_cases
from torch import nn

import qcompile as qc

D_IN, WIDTH = 8, 16
PG_TIMEOUT = datetime.timedelta(seconds=30)


def static_spec(kind: str) -> dict[str, Any]:
    spec = qc.load_spec("int8-static").model_dump()
    spec["data_parallel"] = {"kind": kind}
    return spec


def _int_bytes(m: nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, global bytes) of the integer weights' tensors."""
    here = total = 0
    for p in m.parameters():
        if p.dtype.is_floating_point:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        here += local.numel() * local.element_size()
        total += p.numel() * p.element_size()
    return here, total


def _uneven() -> nn.Module:
    """5 output rows: 3 on rank 0, 2 on rank 1 (FSDP2's uneven chunks)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.ReLU(), nn.Linear(WIDTH, 5))


def case_convert_sharded() -> dict[str, Any]:
    """A calibrated graph sharded with fully_shard converts per rank into sharded integer
    storage; its outputs are those of the unsharded convert of the same graph."""
    rank = dist.get_rank()
    example = (torch.randn(2, D_IN),)
    gm = qc.qcompile(_uneven(), static_spec("fsdp2"), example_inputs=example)
    g = torch.Generator().manual_seed(7)  # the same batches on every rank
    qc.calibrate(gm, [(torch.randn(8, D_IN, generator=g),) for _ in range(3)], progress=False)
    x = torch.randn(16, D_IN, generator=torch.Generator().manual_seed(99))
    plain = qc.convert(gm, example_inputs=(x,))  # unsharded, on every rank: the reference
    step = next(float(q.scale[0]) for n, q in qc.quantizers(gm).items()
                if n.endswith("4.output_fake_quant"))  # one output step
    with torch.no_grad():
        want, fake = plain(x), gm(x)
    sharded = qc.distributed.wrap(gm, static_spec("fsdp2"))
    int8 = qc.convert(sharded, example_inputs=(x,))
    with torch.no_grad():
        got = int8(x)
    here, total = _int_bytes(int8)
    local_float = sum(p.to_local().numel() for p in int8.parameters()
                      if p.dtype.is_floating_point)
    return {"rank": rank, "diff_steps": float((got - want).abs().max()) / step,
            "fake_diff_steps": float((got - fake).abs().max()) / step,
            "int_here": here, "int_total": total, "float_local": local_float,
            "dtensors": all(hasattr(p, "to_local") for p in int8.parameters()),
            "max_deviation": dict(qc.report(int8).max_deviation),
            "paths": sorted({c.path for c in qc.report(int8).conversions}),
            "gm_unchanged": float((sharded(x) - fake).abs().max())}


def case_fully_shard_converted() -> dict[str, Any]:
    """fully_shard of a converted (int storage) graph: each rank keeps 1/N of the integer
    weights and computes the same outputs."""
    from torch.distributed.fsdp import fully_shard

    from qcompile.runtime.quantized import IntWeight

    example = (torch.randn(2, D_IN),)
    gm = qc.qcompile(_uneven(), "w8-weight-only", example_inputs=example)
    int8 = qc.convert(gm)
    x = torch.randn(16, D_IN, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        want = int8(x)
    before = _int_bytes(int8)
    for m in int8.modules():  # one group per integer weight (gathered by its own call)
        if isinstance(m, IntWeight):
            fully_shard(m)
    fully_shard(int8)
    with torch.no_grad():
        got = int8(x)
    here, total = _int_bytes(int8)
    return {"diff": float((got - want).abs().max()), "int_here": here, "int_total": total,
            "before": before[0], "int_params": sum(not p.dtype.is_floating_point
                                                    for p in int8.parameters())}


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    return run_cases(Path(argv[0]), argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
