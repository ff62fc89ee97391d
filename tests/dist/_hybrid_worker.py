"""One rank of the 4-process pipeline x data parallel tests (``test_hybrid.py``).

Run as a script, never imported from the tests folder::

    python tests/dist/_hybrid_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` (4) and ``QC_DIST_INIT`` (or torchrun's variables) in the
environment. The ranks form the ``("pp", "dp")`` mesh 2 x 2: rank = pp_index * 2 +
dp_index; each dp replica trains on its half of the global batch. Each rank writes
``OUTDIR/rank<r>.json`` after every case.
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _worker_main import cases_in, error_of, run_cases
from torch import nn

import qcompile as qc

GLOBAL, MICRO, D = 16, 2, 8
PG_TIMEOUT = datetime.timedelta(seconds=30)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.l:
            x = torch.relu(layer(x))
        return self.head(x)


class TiedNet(nn.Module):
    """The output projection reuses the input projection's weight (``F.linear`` with
    ``inp.weight.t()``): stage 0 and stage 1 each hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)
        self.out_bias = nn.Parameter(torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        x = torch.relu(self.l1(x))
        x = torch.relu(self.l2(x))
        return nn.functional.linear(x, self.inp.weight.t(), self.out_bias)[:, :2]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(GLOBAL, D, generator=torch.Generator().manual_seed(1))
    y = torch.randn(GLOBAL, 2, generator=torch.Generator().manual_seed(2))
    return x, y


def build(cls: type[nn.Module] = Net) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def make_spec(preset: str | None, kind: str, stages: int = 2, accumulate: int = 1
              ) -> dict[str, Any]:
    spec = qc.load_spec(preset).model_dump() if preset else {}
    spec["train"] = {"accumulate": accumulate}
    spec["pipeline"] = {"stages": stages, "microbatches": MICRO, "schedule": "1f1b"}
    spec["data_parallel"] = {"kind": kind}
    return spec


def coords() -> tuple[int, int, int]:
    """(pp_index, dp_index, dp_size) of this rank on the 2 x 2 mesh."""
    dp = dist.get_world_size() // 2
    return dist.get_rank() // dp, dist.get_rank() % dp, dp


def run(spec: dict[str, Any], steps: int, lr: float, sgd: bool = True,
        cls: type[nn.Module] = Net) -> tuple[Any, Any, list[float], list[dict[str, int]]]:
    """Train ``steps`` steps; per step, the global loss (last stage's ranks; mean of the
    micro-batch losses, averaged over the dp group)."""
    x, y = data()
    _, dp_index, dp = coords()
    local = GLOBAL // dp
    xs, ys = x[dp_index * local:(dp_index + 1) * local], y[dp_index * local:(dp_index + 1) * local]
    gm = qc.qcompile(build(cls), spec, example_inputs=(x[:2],))
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=mse)
    params = list(stage.submod.parameters())
    opt = torch.optim.SGD(params, lr=lr) if sgd else torch.optim.Adam(params, lr=lr)
    history, syncs = [], []
    for _ in range(steps):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if stage.is_first:
            schedule.step(xs)
        else:
            schedule.step(target=ys, losses=losses)
        syncs.append(dict(schedule.last_sync))
        opt.step()
        if stage.is_last:
            mean = torch.stack(losses).detach().mean()
            dist.all_reduce(mean, group=schedule.dp_group)
            history.append(mean.item() / dp)
    return stage, schedule, history, syncs


def strip(name: str) -> str:
    return name.removeprefix("module.")


def replica_diff(module: nn.Module, group: Any) -> dict[str, float]:
    """Largest difference of parameters and of buffers (qparams, observer statistics)
    across the dp group."""
    out = {}
    for kind, tensors in (("params", [p.detach() for p in module.parameters()]),
                          ("buffers", [b for b in module.buffers() if b.is_floating_point()])):
        mine = torch.cat([t.reshape(-1).float() for t in tensors])
        mine = mine.nan_to_num(posinf=1e30, neginf=-1e30)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        out[kind] = max((e - mine).abs().max().item() for e in everyone)
    return out


# -- cases ----------------------------------------------------------------------------------
def case_none_ddp(accumulate: int = 1, cls: type[nn.Module] = Net,
                  stages: Any = 2) -> dict[str, Any]:
    """No quantization: 3 SGD steps of the 2 x 2 hybrid against one process on the global
    batch."""
    steps, lr = 3, 0.1
    spec = make_spec(None, "ddp", accumulate=accumulate)
    spec["pipeline"]["stages"] = stages
    stage, _, history, _ = run(spec, steps, lr, cls=cls)
    x, y = data()
    ref = qc.qcompile(build(cls), {}, example_inputs=(x[:2],))
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    ref_history = []
    for _ in range(steps):
        opt.zero_grad()
        loss = mse(ref(x), y)
        loss.backward()
        opt.step()
        ref_history.append(loss.item())
    ref_params = dict(ref.named_parameters())
    diff = max((p.detach() - ref_params[strip(n)].detach()).abs().max().item()
               for n, p in stage.submod.named_parameters())
    names = [strip(n) for n, _ in stage.submod.named_parameters()]
    tied = "inp.weight" in names
    everyone = [None] * dist.get_world_size()
    mine = stage.submod.get_parameter(
        "module.inp.weight").detach() if tied else None
    dist.all_gather_object(everyone, None if mine is None else mine.tolist())
    held = [torch.tensor(w) for w in everyone if w is not None]
    return {"losses": history, "ref_losses": ref_history, "param_diff": diff,
            "wrapped": type(stage.submod).__name__, "pp_dp": list(coords()[:2]),
            "params": names, "tied_holders": len(held),
            "tied_rank_diff": max((w - held[0]).abs().max().item() for w in held)
            if held else None}


def case_none_ddp_accumulate() -> dict[str, Any]:
    """The same with ``train.accumulate: 2``: each step runs two schedule steps."""
    return case_none_ddp(accumulate=2)


def case_none_ddp_tied() -> dict[str, Any]:
    """A weight tied between stage 0 and stage 1: its gradient summed over the pp holders
    (on top of DDP's mean over each dp group)."""
    stages = [{"modules": ["inp", "l1"]}, {"modules": ["l2", "out_bias"]}]
    return case_none_ddp(cls=TiedNet, stages=stages)


def qat_case(kind: str, steps: int) -> dict[str, Any]:
    stage, schedule, history, syncs = run(make_spec("int8-qat", kind), steps, 3e-3, sgd=False)
    if kind == "fsdp2":
        diff = {"buffers": replica_diff_buffers(stage.submod, schedule.dp_group)}
    else:
        diff = replica_diff(stage.submod, schedule.dp_group)
    return {"losses": history, "finite": all(math.isfinite(v) for v in history),
            "replica_diff": diff, "syncs": syncs, "wrapped": type(stage.submod).__name__}


def replica_diff_buffers(module: nn.Module, group: Any) -> float:
    mine = torch.cat([b.reshape(-1).float() for b in module.buffers() if b.is_floating_point()])
    mine = mine.nan_to_num(posinf=1e30, neginf=-1e30)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return max((e - mine).abs().max().item() for e in everyone)


def case_qat_ddp() -> dict[str, Any]:
    return qat_case("ddp", 10)


def case_qat_fsdp2() -> dict[str, Any]:
    return qat_case("fsdp2", 5)


def case_bad_shapes() -> dict[str, Any]:
    """3 stages on 4 ranks; 4 stages on 4 ranks with ddp (a dp group of 1): both refused
    before any communication (a barrier afterwards still pairs up)."""
    x, _ = data()
    out = {}
    for name, stages in (("not_divisible", 3), ("dp_of_one", 4)):
        spec = make_spec(None, "ddp", stages=stages)
        gm = qc.qcompile(build(), spec, example_inputs=(x[:2],))
        out[name] = error_of(lambda gm=gm, spec=spec: qc.distributed.pipeline(gm, spec,
                                                                             loss_fn=mse))
    dist.barrier()
    return out


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    return run_cases(Path(argv[0]), argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
