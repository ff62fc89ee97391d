"""The shared main loop of the two-rank workers (imported by the worker scripts, which
run by path, so this folder is on ``sys.path``).

Each rank joins a gloo group (``QC_DIST_INIT``, ``RANK``, ``WORLD_SIZE`` from the
launcher), runs the named cases in order, and after each one rewrites
``<outdir>/rank<r>.json`` atomically. A crashing case is recorded and the rank exits at
once (no barrier, no destroy: its peer must not wait for it).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def write(path: Path, results: dict[str, Any]) -> None:
    """Replace ``path`` atomically: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def error_of(fn: Callable[[], Any]) -> dict[str, Any]:
    """What calling ``fn`` raised: a ``QCompileError`` with its message and fix, another
    type by name (the test reports which), or nothing."""
    from qcompile.errors import QCompileError

    try:
        fn()
    except QCompileError as e:
        return {"raised": "QCompileError", "message": e.message, "fix": e.fix or ""}
    except Exception as e:  # recorded: the test reports which other type was raised
        return {"raised": type(e).__name__, "message": str(e), "fix": ""}
    return {"raised": None, "message": "", "fix": ""}


def cases_in(namespace: dict[str, Any]) -> dict[str, Callable[[], dict[str, Any]]]:
    """A worker module's ``case_*`` functions by name without the prefix
    (``CASES = cases_in(globals())`` at the end of the module)."""
    return {name.removeprefix("case_"): fn for name, fn in namespace.items()
            if name.startswith("case_") and callable(fn)}


def run_cases(outdir: Path, names: list[str], cases: dict[str, Callable[[], dict[str, Any]]],
              timeout: datetime.timedelta, breaks_pg: Collection[str] = ()) -> int:
    unknown = [c for c in names if c not in cases]
    if unknown:
        print(f"unknown cases {unknown}; known: {sorted(cases)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    init = os.environ.get("QC_DIST_INIT", "env://")
    dist.init_process_group("gloo", init_method=init, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    rank = dist.get_rank()
    path = outdir / f"rank{rank}.json"
    results: dict[str, Any] = {}
    for case in names:
        try:
            results[case] = cases[case]()
        except BaseException:
            results[case] = {"crash": traceback.format_exc()}
            write(path, results)
            print(f"rank {rank}: case {case} crashed\n{results[case]['crash']}",
                  file=sys.stderr, flush=True)
            os._exit(1)  # fail fast: no destroy_process_group, the peer must not wait
        write(path, results)
        if case in breaks_pg:
            os._exit(0)  # the group may be broken: no barrier, no destroy, no more cases
        dist.barrier()  # the next case starts together on every rank
    dist.destroy_process_group()
    return 0
