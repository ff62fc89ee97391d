"""Quantize once at 1/N memory: a sharded compile from a safetensors checkpoint, then QAT.

    torchrun --standalone --nproc_per_node=2 examples/sharded_compile_once.py          # CPU, gloo
    torchrun --standalone --nproc_per_node=4 examples/sharded_compile_once.py
    torchrun --standalone --nproc_per_node=2 examples/sharded_compile_once.py --cuda   # GPUs

Rank 0 saves the float model as safetensors (standing in for a checkpoint you already
have). Then every rank calls ``compile_once`` with ``data_parallel.kind: fsdp2``: the model
is built on the meta device, compiled, split into one FSDP2 group per block, allocated, and
each rank reads only its rows of every weight from the file. Every rank calibrates nothing
here (QAT learns its ranges) and trains on its own data; each step's observer statistics
are reduced across the ranks once, after the optimizer step. The script prints each
rank's share of the weights and the loss.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import qcompile as qc

DIM, VOCAB, BLOCKS = 64, 96, 4

# the message of FSDP2's warning about a sharded module's view output (see the training loop)
FSDP2_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Token embedding, a stack of residual MLP blocks, a head: the shape of a transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    folder = [tempfile.mkdtemp(prefix="qc-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(folder)  # (one machine: the ranks share /tmp)
    checkpoint = os.path.join(folder[0], "model.safetensors")
    if rank == 0:
        save_file(build().state_dict(), checkpoint)
    dist.barrier()

    spec = qc.load_spec("int8-qat").model_dump()
    spec["quant"]["rules"].insert(0, {"match": {"name": "head"}, "skip": True})  # float head
    spec["data_parallel"] = {"kind": "fsdp2"}
    ids = torch.randint(0, VOCAB, (2, 16))
    gm = qc.distributed.compile_once(build, spec, (ids,), checkpoint=checkpoint)

    full = sum(p.numel() * p.element_size() for p in build().parameters())
    local = sum(p.to_local().numel() * p.element_size() for p in gm.parameters())
    note = next(n for p in qc.report(gm).passes for n in p.notes if "FSDP2 groups" in n)
    print(f"rank {rank}: holds {local / 1024:.0f} kB of the {full / 1024:.0f} kB of weights "
          f"({local / full:.0%}, 1/{world} = {1 / world:.0%}); {note}", flush=True)

    opt = torch.optim.Adam(gm.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for step in range(args.steps):
        # next-token task: the next id is the current one + 1 (mod VOCAB)
        x = torch.randint(0, VOCAB, (8, 16), generator=gen).to(device)
        y = (x + 1) % VOCAB
        with warnings.catch_warnings():
            # FSDP2 warns when a sharded module returns a view ("returned a view tensor"),
            # as torch's nn.Linear does for a 3-D input (the head): an in-place op on it
            # would skip the all-gather. The logits are only read here, out of place.
            warnings.filterwarnings("ignore", FSDP2_VIEW_WARNING, UserWarning)
            logits = gm(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    scales = torch.cat([q.scale.detach().float().reshape(-1).cpu()
                        for q in qc.quantizers(gm).values() if q.observer is not None
                        and not hasattr(q.scale, "to_local")])
    gathered = [torch.zeros_like(scales) for _ in range(world)]
    dist.all_gather(gathered, scales.to(device) if device.type == "cuda" else scales)
    if rank == 0:
        same = all(torch.equal(gathered[0].cpu(), g.cpu()) for g in gathered)
        print(f"final loss {loss.item():.4f}; quantizer scales identical on every rank: {same}")
        os.remove(checkpoint)
        os.rmdir(folder[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
