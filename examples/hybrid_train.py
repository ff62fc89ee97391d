"""Train a quantized model with pipeline x data parallel: 2 stages x 2 replicas.

    torchrun --standalone --nproc_per_node=4 examples/hybrid_train.py            # CPU, gloo
    torchrun --standalone --nproc_per_node=4 examples/hybrid_train.py --cuda     # GPUs, nccl

The 4 ranks form the ("pp", "dp") DeviceMesh of qc.distributed.mesh: rank = pp_index * 2 +
dp_index. Each stage is wrapped in DDP over its dp group and driven by the torch 1F1B
schedule; every replica reads its own shard of the data (a DistributedSampler over the dp
dimension); observers are synchronised over the dp group once per step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import qcompile as qc

STAGES = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // STAGES
    pp_index, dp_index = rank // dp, rank % dp
    if args.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    # stage i runs on the GPU of this node the rank uses (rank = pp_index * dp + dp_index)
    devices = ([f"cuda:{torch.cuda.current_device()}"] * STAGES if args.cuda
               else ["cpu"] * STAGES)

    torch.manual_seed(0)  # every rank builds the same model and data
    model = nn.Sequential()
    for i in range(4):
        model.add_module(f"layer{i}", nn.Sequential(nn.Linear(32, 32), nn.ReLU()))
    model.add_module("head", nn.Linear(32, 1))
    x = torch.randn(512, 32)
    y = x.sum(1, keepdim=True) / 4
    spec = qc.load_spec("int8-qat").model_dump()
    spec["quant"]["rules"].insert(0, {"match": {"name": "head"}, "skip": True})
    spec["pipeline"] = {"stages": STAGES, "devices": devices, "microbatches": 4,
                        "schedule": "1f1b"}
    spec["data_parallel"] = {"kind": "ddp"}
    gm = qc.qcompile(model, spec, example_inputs=(x[:8],))
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.Adam(stage.submod.parameters(), lr=3e-3)
    device = torch.device(devices[pp_index])

    # one shard of the data per replica: the sampler splits over the dp dimension only
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=dp, rank=dp_index,
                                 shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, sampler=sampler, drop_last=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # same order on both stages of a replica
        total, count = torch.zeros(1), 0
        for xb, yb in loader:
            opt.zero_grad()
            losses: list[torch.Tensor] = []
            if stage.is_first:
                schedule.step(xb.to(device))
            else:
                schedule.step(target=yb.to(device), losses=losses)
                total += torch.stack(losses).detach().mean().cpu()
                count += 1
            opt.step()
        if stage.is_last:
            dist.all_reduce(total, group=schedule.dp_group)  # mean over the replicas
            if dp_index == 0:
                print(f"epoch {epoch}: loss {total.item() / count / dp:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
