"""Train a quantized model as a 2-stage pipeline, one stage per process.

    torchrun --standalone --nproc_per_node=2 examples/pipeline_train.py            # CPU, gloo
    torchrun --standalone --nproc_per_node=2 examples/pipeline_train.py --cuda     # GPUs, nccl

Every rank compiles the same model with the same spec (same seed), keeps its own stage
and drives torch.distributed.pipelining's schedule; qcompile sums the gradients of
parameters shared between stages on different ranks. The int8-qat observers stay live
(QAT): torch's first-step shape inference (a forward on torch.empty) reaches none of them.
For pipeline x data parallel see examples/hybrid_train.py.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import qcompile as qc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    devices = [f"cuda:{r}" for r in range(world)] if args.cuda else ["cpu"] * world
    if args.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))

    torch.manual_seed(0)  # every rank builds the same model and data
    model = nn.Sequential()
    for i in range(8):
        model.add_module(f"layer{i}", nn.Sequential(nn.Linear(64, 64), nn.ReLU()))
    model.add_module("head", nn.Linear(64, 1))
    x = torch.randn(64, 64)
    y = x.sum(1, keepdim=True) / 8
    spec = qc.load_spec("int8-qat").model_dump()
    # The regression head stays in float: a quantized output whose range lags training
    # clamps, and clamped values get no gradient.
    spec["quant"]["rules"].insert(0, {"match": {"name": "head"}, "skip": True})
    spec["pipeline"] = {"stages": world, "devices": devices, "microbatches": 4,
                        "schedule": "1f1b"}
    gm = qc.qcompile(model, spec, example_inputs=(x[:16],))
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.Adam(stage.submod.parameters(), lr=3e-3)
    device = torch.device(devices[rank])
    for step in range(args.steps):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x.to(device))
        elif rank == world - 1:
            schedule.step(target=y.to(device), losses=losses)
        else:
            schedule.step()
        opt.step()
        if rank == world - 1 and step % 5 == 0:
            print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}", flush=True)
    if rank == 0:
        print(qc.report(gm).text().split("stages:")[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
