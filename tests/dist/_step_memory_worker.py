"""One rank of the training-step memory tests (``test_step_memory.py`` launches 2).

Run as a script: ``python tests/dist/_step_memory_worker.py OUTDIR CASE [CASE ...]`` with
``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` in the environment (see ``_worker_main``).

What autograd keeps from one training forward is counted exactly, allocator aside: the
bytes of the distinct storages a ``saved_tensors_hooks`` pack hook sees, measured when
the forward has returned (FSDP2 has freed the unsharded parameters' storages by then, as
it does for the float model). The DDP case runs first: FSDP2's ``fully_shard`` turns off
the weight cache for the rest of the process.
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

WIDTH, BLOCKS, BATCH = 128, 4, 4
PG_TIMEOUT = datetime.timedelta(seconds=60)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def model_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in build().parameters())


def batch(step: int) -> torch.Tensor:
    x = torch.randn(BATCH * dist.get_world_size(), WIDTH,
                    generator=torch.Generator().manual_seed(step))
    r = dist.get_rank()
    return x[r * BATCH:(r + 1) * BATCH].requires_grad_(True)


def kept(module: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    return sum(s.nbytes() for s in seen.values()), out


def local_grads(module: nn.Module) -> list[torch.Tensor]:
    return [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
            for p in module.parameters() if p.grad is not None]


def spec(kind: str, recompute: bool = True) -> dict[str, Any]:
    s = qc.load_spec("int8-qat").model_dump()
    s["data_parallel"] = {"kind": kind}
    s["train"] = {"recompute_weights": recompute}
    return s


def two_steps(module: nn.Module) -> dict[str, Any]:
    """One step (activation ranges from it apply at the next), then the measured forward
    and its backward."""
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    module(batch(0)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    nbytes, out = kept(module, batch(1))
    out.square().mean().backward()
    return {"kept": nbytes, "grads": local_grads(module)}


def case_ddp() -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    float_kept = two_steps(DistributedDataParallel(build()))["kept"]
    on = two_steps(qc.distributed.wrap(qc.qcompile(build(), spec("ddp"), (batch(0),)),
                                       spec("ddp")))
    off = two_steps(qc.distributed.wrap(
        qc.qcompile(build(), spec("ddp", False), (batch(0),)), spec("ddp", False)))
    return {"float": float_kept, "on": on["kept"], "off": off["kept"],
            "model": model_bytes(),
            "same_grads": all(torch.equal(a, b) for a, b in zip(on["grads"], off["grads"]))}


def case_fsdp2() -> dict[str, Any]:
    return fsdp2(("wrap", "compile_once"))


def fsdp2(hows: tuple[str, ...]) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = build()
    for block in model.layers:
        fully_shard(block)
    float_kept = two_steps(fully_shard(model))["kept"]
    out: dict[str, Any] = {"float": float_kept, "model": model_bytes()}
    for how in hows:
        runs = {}
        for recompute in (True, False):
            s = spec("fsdp2", recompute)
            if how == "wrap":
                gm = qc.distributed.wrap(qc.qcompile(build(), s, (batch(0),)), s)
            else:
                gm = qc.distributed.compile_once(build, s, (batch(0),))
            runs[recompute] = two_steps(gm)
        out[how] = {"on": runs[True]["kept"], "off": runs[False]["kept"],
                    "same_grads": all(torch.equal(a, b) for a, b in
                                      zip(runs[True]["grads"], runs[False]["grads"]))}
    return out


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    return run_cases(Path(argv[0]), argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
