"""Measuring helpers shared by the suites and the worker processes.

Example:
    >>> from qcompile.tools.bench.measure import median_seconds, peak_rss_mb
    >>> median_seconds(lambda: None, 3) >= 0.0
    True
    >>> peak_rss_mb() > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of ``repeat`` calls of ``fn``."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def spawn_ranks(fn: Callable[..., Any], args: tuple[Any, ...], world: int, out: str,
                threshold: int | None = None) -> list[dict[str, Any]]:
    """``torch.multiprocessing.spawn(fn, args, world)`` with glibc's
    ``MALLOC_MMAP_THRESHOLD_`` at ``threshold`` bytes in the ranks (None: glibc's default;
    the spawned ranks' glibc reads it at start), then each rank's ``out/rank<r>.json``."""
    spawn(fn, args, world, threshold)
    return read_ranks(out, world)


def spawn(fn: Callable[..., Any], args: tuple[Any, ...], world: int,
          threshold: int | None = None) -> None:
    """``torch.multiprocessing.spawn(fn, args, world)`` with ``MALLOC_MMAP_THRESHOLD_`` at
    ``threshold`` bytes in the ranks (see ``spawn_ranks``)."""
    import os

    import torch

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    try:
        torch.multiprocessing.spawn(fn, args=args, nprocs=world, join=True)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def read_ranks(out: str, world: int) -> list[dict[str, Any]]:
    """Each of ``world`` ranks' ``out/rank<r>.json``."""
    import json
    import os

    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (MB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
