"""``qc.search`` on 2 ranks (gloo, CPU): each rank scores its own batches, the score sums
are reduced before the choice, so both ranks return the same spec, and it equals the spec
one process scoring every batch returns (scores within float tolerance).

One supervised launch of ``_search_worker.py`` runs the selected cases (one per metric).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dist_cases import wanted_cases

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_search_worker.py")
LAUNCH_DEADLINE = 90.0  # seconds for every case together (about 10 s normally)
ORDER = ["sqnr", "fisher", "loss"]
RTOL = 1e-5  # float32 gradient squares summed in another order (fisher)


@pytest.fixture(scope="module")
def dist_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             dist_launcher: Any) -> Any:
    cases = wanted_cases(request, ORDER)
    return dist_launcher(WORKER, cases, tmp_path_factory.mktemp("search"), LAUNCH_DEADLINE)


@pytest.mark.parametrize("case", ORDER)
def test_ranks_return_the_single_process_spec(dist_run: Any, case: str) -> None:
    r0, r1 = dist_run.case(case)
    assert r0["spec"] == r1["spec"]
    assert r0["spec"] == r0["ref_spec"] == r1["ref_spec"]
    assert r0["chosen"]["fc2"] == 1, r0["chosen"]  # the sensitive layer keeps int8
    assert (r0["batches"], r0["ranks"]) == (r1["batches"], r1["ranks"]) == (4, 2)
    assert (r0["ref_batches"], r0["ref_ranks"]) == (4, 1)
    for r in (r0, r1):
        for got, want in zip(r["scores"], r["ref_scores"], strict=True):
            assert got == pytest.approx(want, rel=RTOL, abs=1e-12)
    assert r0["scores"] == r1["scores"]  # reduced once: the same numbers on every rank
