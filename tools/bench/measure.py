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


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (MB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
