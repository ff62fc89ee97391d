"""QLoRA on many ranks: a frozen NF4 base built at 1/N per rank, LoRA adapters trained,
saved as a peft adapter and reloaded with peft.

    torchrun --standalone --nproc_per_node=2 examples/qlora_train.py          # CPU, gloo
    torchrun --standalone --nproc_per_node=2 examples/qlora_train.py --cuda   # GPUs

Rank 0 saves the float model as safetensors (standing in for a checkpoint you already
have). Every rank then calls ``compile_once`` with the ``qlora-nf4`` preset and
``data_parallel.kind: fsdp2``: the model is built on the meta device, every Linear but the
head gets a LoRA adapter, and each rank reads only its rows of each of their weights from
the file and stores them as NF4 codes and scales: no rank ever holds a float copy of the
base. The model's own parameters are frozen in ``build()``, so only the adapters train,
each rank on its own data. ``qc.save_adapters`` writes them in peft's format; rank 0 loads
them with ``peft.PeftModel.from_pretrained`` onto the float model (its adapted weights set
to the NF4 values the ranks trained against) and compares the outputs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import qcompile as qc
from qcompile.graph.meta import ADAPTERS_KEY

DIM, VOCAB, BLOCKS = 128, 96, 4

# the message of FSDP2's warning about a sharded module's view output (see the training loop)
FSDP2_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.q_proj = nn.Linear(DIM, DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.q_proj(h)
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Token embedding, a stack of residual blocks, a head: the shape of a transformer."""

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


def build(frozen: bool = True) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    return model.requires_grad_(not frozen)  # the base does not train: only the adapters


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
    rank = dist.get_rank()

    folder = [tempfile.mkdtemp(prefix="qc-qlora-") if rank == 0 else None]
    dist.broadcast_object_list(folder)  # (one machine: the ranks share /tmp)
    checkpoint = os.path.join(folder[0], "model.safetensors")
    adapter_dir = os.path.join(folder[0], "adapter")
    if rank == 0:
        save_file(build().state_dict(), checkpoint)
    dist.barrier()

    spec = qc.load_spec("qlora-nf4").model_dump()
    spec["data_parallel"] = {"kind": "fsdp2"}
    ids = torch.randint(0, VOCAB, (2, 16))
    gm = qc.distributed.compile_once(build, spec, (ids,), checkpoint=checkpoint)

    rep = qc.report(gm)
    base = sum(a.base_bytes_before for a in rep.adapters)
    stored = sum(p.to_local().numel() * p.element_size() for n, p in gm.named_parameters()
                 if "weight_frozen" in n)
    print(f"rank {rank}: {len(rep.adapters)} adapted layers; their float weights are "
          f"{base / 1024:.0f} kB, this rank stores {stored / 1024:.0f} kB of NF4 codes and "
          f"scales ({stored / base:.1%}); trainable parameters "
          f"{rep.trainable_parameters} of {rep.parameters}", flush=True)

    trainable = [p for p in gm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
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

    qc.save_adapters(gm, adapter_dir)  # every rank gathers; rank 0 writes
    gm.eval()
    probe = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = gm(probe.to(device)).cpu()  # every rank: each forward is a collective
    if rank == 0:
        print(f"final loss {loss.item():.4f}; peft adapter: "
              f"{sorted(os.listdir(adapter_dir))}", flush=True)
        compare_with_peft(spec, adapter_dir, probe, ours)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])
    dist.destroy_process_group()


def compare_with_peft(spec: dict, adapter_dir: str, probe: torch.Tensor,
                      ours: torch.Tensor) -> None:
    """peft's model on the float weights the ranks trained against (the NF4 values, from a
    one-process compile of the same checkpoint: the same codes) gives the ranks' output."""
    try:
        from peft import PeftModel
    except ImportError:
        print("peft is not installed: pip install peft to compare (the adapter is saved)")
        return
    one = dict(spec, data_parallel={"kind": "none"})
    local = qc.qcompile(build(), one, (probe,))
    model = build()
    with torch.no_grad():
        for layer in local.meta[ADAPTERS_KEY]:
            model.get_submodule(layer).weight.copy_(
                local.get_submodule(f"{layer}.weight_frozen")())
    peft_model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        theirs = peft_model(probe)
        plain = build()(probe)
    print(f"peft on the NF4 base: max |peft - qcompile| = "
          f"{(theirs - ours).abs().max().item():.2e} (outputs up to "
          f"{ours.abs().max().item():.1f}); the adapters moved the output by "
          f"{(ours - plain).abs().max().item():.2f} from the float model's")


if __name__ == "__main__":
    main()
