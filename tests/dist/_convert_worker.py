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

D_IN, WIDTH, D_OUT = 8, 16, 4
PG_TIMEOUT = datetime.timedelta(seconds=30)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.ReLU(), nn.Linear(WIDTH, D_OUT))


def static_spec(kind: str) -> dict[str, Any]:
    spec = qc.load_spec("int8-static").model_dump()
    spec["data_parallel"] = {"kind": kind}
    return spec


def case_convert_fsdp2() -> dict[str, Any]:
    """Calibrate, shard with fully_shard, then qc.convert: refused with the recipe; the
    recipe (full state on rank 0, an unsharded compile, convert) gives the integer model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank = dist.get_rank()
    example = (torch.randn(2, D_IN),)
    gm = qc.qcompile(mlp(), static_spec("fsdp2"), example_inputs=example)
    g = torch.Generator().manual_seed(7 + rank)
    qc.calibrate(gm, [(torch.randn(8, D_IN, generator=g),) for _ in range(3)], progress=False)
    x = torch.randn(16, D_IN, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        ref = gm(x)  # the calibrated fake-quant graph, unsharded
    sharded = qc.distributed.wrap(gm, static_spec("fsdp2"))
    try:
        qc.convert(sharded, example_inputs=(x,))
        error = None
    except qc.QCompileError as e:
        error = {"message": e.args[0] if e.args else str(e), "text": str(e)}
    except Exception as e:  # recorded for the test to show
        error = {"raw": f"{type(e).__name__}: {e}"}
    # the recipe of the error's fix line
    sd = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    out: dict[str, Any] = {"error": error, "keys": len(sd)}
    if rank == 0:
        fresh = qc.qcompile(mlp(), static_spec("none"), example_inputs=example)
        fresh.load_state_dict(sd)
        int8 = qc.convert(fresh, example_inputs=(x,))
        with torch.no_grad():
            out["fresh_diff"] = float((fresh(x) - ref).abs().max())
            out["int8_diff"] = float((int8(x) - ref).abs().max())
        out["step"] = float(qc.quantizers(fresh)["4.output_fake_quant"].scale[0]) \
            if "4.output_fake_quant" in qc.quantizers(fresh) else None
        out["max_deviation"] = dict(qc.report(int8).max_deviation)
        out["ops"] = [c.op for c in qc.report(int8).conversions]
    return out


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    return run_cases(Path(argv[0]), argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
