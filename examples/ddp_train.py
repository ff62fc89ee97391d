"""QAT with data parallelism: compile once, wrap, train with synchronised observers.

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py                 # DDP, CPU
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --fsdp2         # FSDP2, CPU
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --cuda          # GPUs (nccl)

With DDP, rank 0 builds and compiles the model; the others build it on the meta device and
receive the compiled state; with ``--fsdp2`` every rank compiles on the meta device and
holds 1/N of every block (``compile_once`` shards it; ``wrap`` then returns it as is).
The graph is wrapped *after* compiling (DDP or fully_shard),
and each step's activation statistics are reduced across ranks once, after the optimizer
step, so every rank's quantizers stay identical and equal to one process's on the global
batch. (A hand-written ``DistributedDataParallel(gm)`` loop instead calls
``qc.distributed.sync_observers(gm)`` after each ``optimizer.step()``; without it the
scales drift apart and qcompile warns once.) With ``--cuda`` each rank sets its GPU (``LOCAL_RANK``)
before ``init_process_group``; qcompile's collectives run on that device.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import qcompile as qc


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp2", action="store_true")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    # The rank's device first: NCCL's collectives (compile_once's broadcast, the observer
    # sync, DDP's all-reduce) run on the current CUDA device, gloo's on the CPU.
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    spec = qc.load_spec("int8-qat").model_dump()
    spec["quant"]["rules"].insert(0, {"match": {"name": "4"}, "skip": True})  # float head
    spec["data_parallel"] = {"kind": "fsdp2" if args.fsdp2 else "ddp"}
    spec["train"] = {"accumulate": 2}
    # every tensor arrives on CPU (sent over the backend's device), then moves to ours
    gm = qc.distributed.compile_once(build, spec, (torch.randn(2, 32),)).to(device)
    model = qc.distributed.wrap(gm, spec)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(7)) / 4
    for step in range(args.steps):
        x = torch.randn(16, 32, generator=gen)
        loss = qc.distributed.train_step(model, opt, x.to(device), (x @ w).to(device),
                                         nn.functional.mse_loss, spec=spec)
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    # a collective of our own: its tensors live on the rank's device (NCCL: the GPU)
    scales = torch.cat([q.scale.detach().reshape(-1) for q in qc.quantizers(gm).values()])
    scales = scales.to(device)
    gathered = [torch.empty_like(scales) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, scales)
    if rank == 0:
        same = all(torch.equal(g.cpu(), gathered[0].cpu()) for g in gathered)
        print(f"quantizer scales identical on every rank: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
