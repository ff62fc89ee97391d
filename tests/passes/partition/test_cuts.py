"""The exact contiguous-partition solver (``qcompile.passes.partition.cuts``) against brute force.

``balanced_cuts`` must minimise the largest stage cost exactly and, among the optimal
partitions, the bytes crossing the cuts; both are checked against an enumeration of every
combination of allowed cuts on small instances.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import qcompile as qc
from qcompile.passes.partition.cuts import balanced_cuts, min_bottleneck

# -- brute force ----------------------------------------------------------------------


def stage_costs(costs: list[float], cuts: list[int]) -> list[float]:
    """Exact (fsum) cost of each stage for cuts "after index i"."""
    bounds = [-1, *sorted(cuts), len(costs) - 1]
    return [math.fsum(costs[a + 1:b + 1]) for a, b in itertools.pairwise(bounds)]


def brute_force(costs: list[float], k: int, allowed: list[int],
                cut_bytes: list[float]) -> tuple[float, float]:
    """(optimal bottleneck, least crossing bytes among the optimal partitions)."""
    n = len(costs)
    positions = sorted({a for a in allowed if 0 <= a < n - 1})
    options = [(max(stage_costs(costs, list(c))), math.fsum(cut_bytes[i] for i in c))
               for c in itertools.combinations(positions, k - 1)]
    best = min(b for b, _ in options)
    tol = 1e-9 * max(1.0, best)
    return best, min(by for b, by in options if b <= best + tol)


# Costs: zeros, small integers (ties) and arbitrary floats.
cost_value = st.one_of(
    st.just(0.0),
    st.integers(0, 4).map(float),
    st.floats(0.0, 100.0, allow_nan=False, allow_infinity=False),
)


@st.composite
def instances(draw):
    n = draw(st.integers(1, 9))
    costs = draw(st.lists(cost_value, min_size=n, max_size=n))
    k = draw(st.integers(1, 4))
    allowed = draw(st.lists(st.integers(0, max(n - 2, 0)), unique=True, max_size=max(n - 1, 0)))
    allowed = [a for a in allowed if a < n - 1]
    cut_bytes = draw(st.lists(st.one_of(st.integers(0, 3).map(float),
                                        st.floats(0.0, 1e6, allow_nan=False)),
                              min_size=n, max_size=n))
    return costs, k, allowed, cut_bytes


# -- properties -----------------------------------------------------------------------


@given(instances())
def test_balanced_cuts_matches_brute_force(inst):
    costs, k, allowed, cut_bytes = inst
    assume(len(allowed) >= k - 1)
    cuts, bottleneck = balanced_cuts(costs, k, allowed=allowed, cut_bytes=cut_bytes)
    assert len(cuts) == k - 1
    assert len(set(cuts)) == k - 1
    assert set(cuts) <= set(allowed)
    assert cuts == sorted(cuts)
    best, best_bytes = brute_force(costs, k, allowed, cut_bytes)
    got = max(stage_costs(costs, cuts))
    assert got == pytest.approx(best, abs=1e-9 * max(1.0, best), rel=0)
    assert bottleneck == pytest.approx(best, abs=1e-9 * max(1.0, best), rel=0)
    got_bytes = math.fsum(cut_bytes[i] for i in cuts)
    assert got_bytes == pytest.approx(best_bytes, abs=1e-9 * max(1.0, best_bytes), rel=0)


@given(instances())
def test_min_bottleneck_matches_brute_force(inst):
    costs, k, allowed, cut_bytes = inst
    assume(len(allowed) >= k - 1)
    best, _ = brute_force(costs, k, allowed, cut_bytes)
    assert min_bottleneck(costs, k, allowed) == pytest.approx(
        best, abs=1e-9 * max(1.0, best), rel=0)


@given(instances())
def test_too_few_cut_positions_is_a_qcompile_error(inst):
    costs, k, allowed, cut_bytes = inst
    assume(len(allowed) < k - 1)
    with pytest.raises(qc.QCompileError, match=r"pipeline\.stages") as err:
        balanced_cuts(costs, k, allowed=allowed, cut_bytes=cut_bytes)
    assert f"at most {len(allowed) + 1} stages" in str(err.value)


# -- examples -------------------------------------------------------------------------


def test_docstring_example_prefers_the_cheap_cut():
    assert balanced_cuts([1, 1, 1, 1], 2, allowed=[0, 1, 2], cut_bytes=[5, 1, 5]) == ([1], 2.0)


def test_bytes_break_ties_between_equal_bottlenecks():
    # Cutting after 0 or after 2 both give a bottleneck of 3; after 2 sends fewer bytes.
    costs = [1.0, 1.0, 1.0, 1.0]
    assert balanced_cuts(costs, 2, allowed=[0, 2], cut_bytes=[9.0, 0.0, 1.0]) == ([2], 3.0)
    assert balanced_cuts(costs, 2, allowed=[0, 2], cut_bytes=[1.0, 0.0, 9.0]) == ([0], 3.0)


def test_restricted_cuts_raise_the_bottleneck():
    costs = [1.0, 1.0, 1.0, 1.0]
    assert balanced_cuts(costs, 2, allowed=[0], cut_bytes=[0.0] * 4) == ([0], 3.0)
    assert min_bottleneck(costs, 2, [0, 1, 2]) == 2.0


def test_one_stage_needs_no_cut():
    assert balanced_cuts([3.0, 4.0], 1, allowed=[], cut_bytes=[0.0, 0.0]) == ([], 7.0)
    assert balanced_cuts([3.0, 4.0], 1, allowed=[0], cut_bytes=[1.0, 0.0]) == ([], 7.0)


def test_zero_stages_is_refused():
    with pytest.raises(qc.QCompileError, match=r"pipeline\.stages must be at least 1"):
        balanced_cuts([1.0], 0, allowed=[], cut_bytes=[0.0])


def test_allowed_positions_outside_the_sequence_are_ignored():
    # 3 (after the last item) and -1 are not cut positions: only 0 remains.
    with pytest.raises(qc.QCompileError, match=r"only 1 place\(s\)"):
        balanced_cuts([1.0, 1.0, 1.0], 3, allowed=[-1, 0, 2, 5], cut_bytes=[0.0] * 3)


def test_ten_thousand_items():
    rng = random.Random(0)
    n = 10_000
    costs = [rng.choice([0.0, rng.random() * 100]) for _ in range(n)]
    cut_bytes = [float(rng.randrange(1000)) for _ in range(n)]
    allowed = [i for i in range(n - 1) if rng.random() < 0.7]
    cuts, bottleneck = balanced_cuts(costs, 8, allowed=allowed, cut_bytes=cut_bytes)
    assert len(cuts) == 7 and set(cuts) <= set(allowed)
    assert max(stage_costs(costs, cuts)) == pytest.approx(bottleneck, rel=1e-9)
    # a lower bound no partition can beat
    assert bottleneck >= math.fsum(costs) / 8 - 1e-6
