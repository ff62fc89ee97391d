"""One rank of the 2-process ``qc.search`` test (``test_search_dist.py`` launches two).

Run as a script, never imported from the tests folder::

    python tests/dist/_search_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` (or torchrun's ``MASTER_ADDR`` /
``MASTER_PORT``) in the environment. Each rank writes ``OUTDIR/rank<r>.json``
(``{case: result}``) after every case; the test asserts on those.

Each case (a metric) searches the same model with the same spec on every rank, rank ``r``
scoring batches ``r, r + 2, ...`` of one global list; the reference is the same search in
one process over every batch (on each rank, with a process group of that rank alone, so
nothing is reduced).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _worker_main import cases_in, run_cases
from torch import nn

import qcompile as qc

PG_TIMEOUT = datetime.timedelta(seconds=30)
BATCHES = 4
OUTDIR = Path(".")


class Net(nn.Module):
    """Three 32-wide layers; ``fc2`` is the sensitive one (large weights on dead inputs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = (nn.Linear(32, 32) for _ in range(3))
        with torch.no_grad():
            self.fc1.weight[::16] = 0.0
            self.fc1.bias[::16] = -1.0
            self.fc2.weight[:, ::16] = 5.0

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(output, batch[1])


def spec(metric: str) -> dict[str, Any]:
    return {"quant": {
        "mode": "static",
        "rules": [{"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}],
        "search": {"candidates": [
            {"weight": {"dtype": "int4", "granularity": "per_group", "group_size": 16}},
            {"weight": {"dtype": "int8", "granularity": "per_channel"}}],
            "budget": {"avg_weight_bits": 5.5}, "metric": metric}}}


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, target): the float model's output plus noise."""
    g = torch.Generator().manual_seed(3)
    net, out = Net(), []
    for _ in range(BATCHES):
        x = torch.randn(8, 32, generator=g)
        with torch.no_grad():
            out.append((x, net(x, x) + 0.5 * torch.randn(8, 32, generator=g)))
    return out


def search_case(metric: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    batches = data()
    found, info = qc.search(Net(), spec(metric), batches[rank::world], loss_fn=loss_fn,
                            details=True)
    ref, ref_info = qc.search(Net(), spec(metric), batches, loss_fn=loss_fn, details=True,
                              group=solo[rank])
    return {"spec": found.model_dump(mode="json"), "ref_spec": ref.model_dump(mode="json"),
            "scores": [g.scores for g in info.groups],
            "ref_scores": [g.scores for g in ref_info.groups],
            "chosen": info.chosen, "batches": info.batches, "ranks": info.ranks,
            "ref_batches": ref_info.batches, "ref_ranks": ref_info.ranks}


def case_sqnr() -> dict[str, Any]:
    return search_case("sqnr")


def case_fisher() -> dict[str, Any]:
    return search_case("fisher")


def case_loss() -> dict[str, Any]:
    return search_case("loss")


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
