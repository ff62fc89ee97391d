"""Optimal contiguous partitioning of a sequence into pipeline stages.

Given per-position costs ``c[0..n-1]`` (non-negative), the positions after which a cut is
allowed, and the bytes crossing each cut, ``balanced_cuts`` returns the ``k - 1`` cuts that

1. minimise the largest stage cost (the pipeline's bottleneck), exactly, and
2. among those, minimise the total bytes crossing the cuts.

(1) is a bisection on the bottleneck with a greedy feasibility test (cutting as late as
the cap allows never needs more stages, also with restricted cut positions); the optimum
is the largest stage of the greedy partition at the converged cap, an actual stage sum.
(2) is a dynamic programme over (stages, position) with a sliding-window minimum, so the
whole solve is O(n log(sum/eps) + k n): fast on 10,000-node graphs.

Example:
    >>> balanced_cuts([1, 1, 1, 1], 2, allowed=[0, 1, 2], cut_bytes=[5, 1, 5])
    ([1], 2.0)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import accumulate

from qcompile.errors import QCompileError


def _greedy_stages(prefix: list[float], allowed: set[int], cap: float) -> tuple[int, float]:
    """Stages needed when every stage stays <= cap (cuts as late as possible), and the
    largest stage cost of that partition; (n + 1, inf) when some single item exceeds cap."""
    n = len(prefix) - 1
    stages, start, worst = 1, 0, 0.0
    last_ok: int | None = None
    i = 0
    while i < n:
        if prefix[i + 1] - prefix[start] <= cap:
            if i in allowed:
                last_ok = i
            i += 1
            continue
        if last_ok is None or last_ok < start:
            return n + 1, float("inf")
        worst = max(worst, prefix[last_ok + 1] - prefix[start])
        start = last_ok + 1
        stages += 1
        last_ok = None
        i = start
    worst = max(worst, prefix[n] - prefix[start])
    return stages, worst


def min_bottleneck(costs: Sequence[float], k: int, allowed: Sequence[int]) -> float:
    """The smallest achievable largest-stage cost with ``k`` contiguous stages."""
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    allowed_set = set(allowed)
    total = prefix[-1]
    lo, hi = max(costs, default=0.0), total
    best = _greedy_stages(prefix, allowed_set, hi)[1]
    if _greedy_stages(prefix, allowed_set, lo)[0] <= k:
        return _greedy_stages(prefix, allowed_set, lo)[1]
    for _ in range(200):
        if hi - lo <= max(abs(hi), 1.0) * 1e-13:
            break
        mid = (lo + hi) / 2
        count, worst = _greedy_stages(prefix, allowed_set, mid)
        if count <= k:
            hi, best = mid, worst
        else:
            lo = mid
    return best


def balanced_cuts(
    costs: Sequence[float],
    k: int,
    *,
    allowed: Sequence[int],
    cut_bytes: Sequence[float],
) -> tuple[list[int], float]:
    """Cut positions (cut after index ``i``) for ``k`` stages, and the bottleneck cost.

    ``cut_bytes[i]`` is the size of the values crossing a cut after ``i``."""
    n = len(costs)
    allowed = sorted(set(a for a in allowed if 0 <= a < n - 1))
    if k < 1:
        raise QCompileError("pipeline.stages must be at least 1", fix="set stages: 1 or more")
    if k == 1:
        return [], float(sum(costs))
    if len(allowed) < k - 1:
        raise QCompileError(
            f"pipeline.stages: {k} stages need {k - 1} cuts, but the graph has only "
            f"{len(allowed)} place(s) where it can be cut",
            fix=f"use at most {len(allowed) + 1} stages")
    bottleneck = min_bottleneck(costs, k, allowed)
    cap = bottleneck * (1 + 1e-12) + 1e-300
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    inf = float("inf")
    allowed_set = set(allowed)
    # dp[i]: least crossing bytes splitting items 0..i into j stages, the j-th ending at i
    dp = [(cut_bytes[i] if i < n - 1 else 0.0) if prefix[i + 1] <= cap and
          (i in allowed_set or i == n - 1) else inf for i in range(n)]
    parents: list[list[int]] = []
    for _ in range(2, k + 1):
        new = [inf] * n
        parent = [-1] * n
        window: deque[int] = deque()  # allowed p, increasing dp
        lo = 0
        nxt = 0  # next allowed index (into `allowed`) to push
        for i in range(n):
            if i != n - 1 and i not in allowed_set:
                continue
            # push every allowed p < i
            while nxt < len(allowed) and allowed[nxt] < i:
                p = allowed[nxt]
                while window and dp[window[-1]] >= dp[p]:
                    window.pop()
                window.append(p)
                nxt += 1
            # stage p+1..i must fit: prefix[i+1] - prefix[p+1] <= cap
            while lo <= i and prefix[i + 1] - prefix[lo] > cap:
                lo += 1
            while window and window[0] + 1 < lo:
                window.popleft()
            if window and dp[window[0]] < inf:
                new[i] = dp[window[0]] + (cut_bytes[i] if i < n - 1 else 0.0)
                parent[i] = window[0]
        parents.append(parent)
        dp = new
    if dp[n - 1] == inf:  # cannot happen when the bottleneck is feasible; be loud if it does
        raise QCompileError(f"pipeline.stages: no partition into {k} stages found",
                            fix="use fewer stages")
    cuts = []
    i = n - 1
    for parent in reversed(parents):
        i = parent[i]
        cuts.append(i)
    return sorted(cuts), bottleneck
