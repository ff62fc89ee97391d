"""One rank of the 2-process adapter tests (``test_adapters_dist.py`` launches two).

Run as a script, never imported from the tests folder::

    python tests/dist/_adapters_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` (or torchrun's ``MASTER_ADDR`` /
``MASTER_PORT``) in the environment. Each rank writes ``OUTDIR/rank<r>.json``
(``{case: result}``) after every case; the test asserts on those.

Every case builds the same float model (seeded), frozen, with LoRA adapters on every
Linear of its two blocks, whose base weights are stored quantized (``base: frozen``), and
trains the adapters with AdamW for a few steps under ``spec.data_parallel`` (DDP or FSDP2),
each rank on its own rows of every step's global batch. The single-process reference is
computed on every rank, without the process group: the same model compiled with
``data_parallel: none`` and trained on the whole global batch (loss = mean over it, which
is what DDP's and FSDP2's gradient averaging computes with equal local batches).

The ``fsdp2_full`` case also trains the head in full (an ``adapters`` entry of ``kind:
full``, peft's ``modules_to_save``), sharded by FSDP2 like the adapters, and writes the
adapter with ``qc.save_adapters`` from every rank (each sharded tensor gathered; rank 0
writes); the reference writes one from the single process.

The ``compile_once_*`` cases build the graph with ``qc.distributed.compile_once`` from a
safetensors checkpoint of the float model instead. An exception in compiling or training
(raised on every rank at the same point) is recorded as ``{"error": ..., "traceback": ...}``
and the launch goes on; the test says which.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _worker_main import cases_in, run_cases
from torch import nn

import qcompile as qc

LOCAL, SEQ, D_IN, WIDTH, D_OUT = 4, 4, 16, 64, 8
STEPS, LR = 3, 1e-2
RTOL, ATOL = 1e-4, 1e-5
PG_TIMEOUT = datetime.timedelta(seconds=30)
OUTDIR = Path(".")
SCHEMES = {"int4": {"dtype": "int4", "granularity": "per_group", "group_size": 32},
           "nf4": {"dtype": "nf4"}}


# -- the model, the spec, the data ---------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, WIDTH)
        self.k_proj = nn.Linear(WIDTH, WIDTH)
        self.v_proj = nn.Linear(WIDTH, WIDTH)
        self.o_proj = nn.Linear(WIDTH, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q_proj(x) @ self.k_proj(x).transpose(-1, -2) / 8.0
        x = x + self.o_proj(torch.softmax(scores, -1) @ self.v_proj(x))
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Model().requires_grad_(False)


LAYERS = sorted(f"blocks.{b}.{n}" for b in range(2)
                for n in ("q_proj", "k_proj", "v_proj", "o_proj", "up", "down"))
EXAMPLE = (torch.randn(2, SEQ, D_IN, generator=torch.Generator().manual_seed(7)),)


def spec_of(kind: str, scheme: str, full: bool = False) -> dict[str, Any]:
    """Adapters on the blocks; ``full``: the head trained in full besides them."""
    entries: list[dict[str, Any]] = [{"match": {"module": "Linear", "name": "blocks.*"},
                                      "rank": 4, "alpha": 8, "base": "frozen"}]
    if full:
        entries.append({"kind": "full", "match": {"name": "head"}})
    return {"quant": {"mode": "qat", "rules": [
                {"match": {"module": "Linear", "name": "blocks.*"}, "weight": SCHEMES[scheme]}]},
            "adapters": entries, "data_parallel": {"kind": kind}}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch (``2 * LOCAL`` rows), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(2 * LOCAL, SEQ, D_IN, generator=g),
            torch.randn(2 * LOCAL, SEQ, D_OUT, generator=g))


def local(t: torch.Tensor) -> torch.Tensor:
    r = dist.get_rank()
    return t[r * LOCAL:(r + 1) * LOCAL]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# -- reading the graphs ----------------------------------------------------------------------
def plain(name: str) -> str:
    """A name without the block child graph it sits in (fsdp2 compiles one per block)."""
    return re.sub(r"^stage_\d+\.", "", name)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a sharded DTensor is gathered: every rank calls this)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def params(gm: nn.Module, part: str) -> dict[str, nn.Parameter]:
    """``gm``'s parameters whose (plain) name contains ``part``, sorted by name."""
    return dict(sorted((plain(n), p) for n, p in gm.named_parameters() if part in n))


def adapters(gm: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in params(gm, ".lora_").items()}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Names (missing / extra / not close at RTOL, ATOL / not bit-identical) and gaps."""
    common = sorted(set(got) & set(want))
    return {"missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)),
            "compared": len(common),
            "not_close": [n for n in common
                          if not torch.allclose(got[n], want[n], rtol=RTOL, atol=ATOL)],
            "not_equal": [n for n in common if not torch.equal(got[n], want[n])],
            "max_gap": max((float((got[n] - want[n]).abs().max()) for n in common),
                           default=0.0),
            # the largest gap as a fraction of what allclose allows (< 1: close)
            "worst": max((float(((got[n] - want[n]).abs() / (ATOL + RTOL * want[n].abs()))
                                .max()) for n in common if got[n].is_floating_point()),
                         default=0.0)}


def sharding(gm: nn.Module) -> dict[str, Any]:
    """Every FrozenWeight parameter: DTensor with (Shard(0),), local and global rows, and
    the stored base's bytes on this rank against the whole."""
    from torch.distributed.tensor import Shard

    out: dict[str, Any] = {}
    mine = whole = 0
    for name, p in params(gm, ".weight_frozen.").items():
        is_dt = hasattr(p, "to_local") and hasattr(p, "placements")
        loc = p.to_local() if is_dt else p
        out[name] = {"dtensor": is_dt,
                     "shard0": is_dt and len(p.placements) == 1
                     and type(p.placements[0]) is Shard and p.placements[0].dim == 0,
                     "rows": int(p.shape[0]), "local_rows": int(loc.shape[0])}
        mine += loc.numel() * loc.element_size()
        whole += p.numel() * p.element_size()
    return {"params": out, "local_bytes": mine, "whole_bytes": whole}


def frozen_checks(gm: nn.Module, before: dict[str, torch.Tensor]) -> dict[str, Any]:
    frozen = params(gm, ".weight_frozen.")
    names = set(params(gm, ""))
    return {"frozen_names": sorted(frozen),
            "frozen_changed": [n for n, p in frozen.items() if not torch.equal(full(p),
                                                                              before[n])],
            "frozen_with_grad": [n for n, p in frozen.items() if p.grad is not None],
            "frozen_requires_grad": [n for n, p in frozen.items() if p.requires_grad],
            "float_weights_left": sorted(f"{layer}.weight" for layer in LAYERS
                                         if f"{layer}.weight" in names),
            "trainable": sorted(n for n, p in params(gm, "").items() if p.requires_grad)}


def reference(scheme: str, steps: int, full: bool = False
              ) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """One process, the whole global batch, no process group involved."""
    ref = qc.qcompile(build(), spec_of("none", scheme, full), example_inputs=EXAMPLE)
    start = adapters(ref)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = mse(ref(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, start, ref


def train(model: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = mse(model(local(x)), local(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# -- cases -----------------------------------------------------------------------------------
def train_case(kind: str, scheme: str) -> dict[str, Any]:
    spec = spec_of(kind, scheme)
    gm = qc.qcompile(build(), spec, example_inputs=EXAMPLE)
    before = {n: full(p) for n, p in params(gm, ".weight_frozen.").items()}
    start = adapters(gm)
    model = qc.distributed.wrap(gm, spec)
    shards = sharding(gm) if kind == "fsdp2" else None
    try:
        losses = train(model, STEPS)
    except Exception as e:  # raised on every rank at the same point: recorded, goes on
        return {"error": f"{type(e).__name__}: {e}".strip()[:600],
                "traceback": traceback.format_exc()[-3000:], "shards": shards}
    got = adapters(gm)
    ref_losses, ref_start, ref = reference(scheme, STEPS)
    want = adapters(ref)
    return {"error": None, "kind": type(model).__name__, "losses": losses,
            "mean_losses": mean_over_ranks(losses), "ref_losses": ref_losses,
            "adapters": sorted(got), "digest": digest(got),
            "start_vs_reference": compare(start, ref_start),
            "vs_reference": compare(got, want),
            "moved": max(float((got[n] - start[n]).abs().max()) for n in got),
            "ref_frozen_vs_before": compare(
                {n: full(p) for n, p in params(ref, ".weight_frozen.").items()}, before),
            "shards": shards, **frozen_checks(gm, before)}


def case_ddp_int4() -> dict[str, Any]:
    return train_case("ddp", "int4")


def case_fsdp2_nf4() -> dict[str, Any]:
    return train_case("fsdp2", "nf4")


def case_fsdp2_int4() -> dict[str, Any]:
    return train_case("fsdp2", "int4")


def case_fsdp2_full() -> dict[str, Any]:
    """Adapters and the head trained in full under FSDP2, saved by qc.save_adapters (every
    rank gathers; rank 0 writes), against the adapter one process saves after training
    on the whole global batch."""
    import json

    from safetensors.torch import load_file

    spec = spec_of("fsdp2", "nf4", full=True)
    gm = qc.qcompile(build(), spec, example_inputs=EXAMPLE)
    model = qc.distributed.wrap(gm, spec)
    head = dict(gm.get_submodule("head").named_parameters())
    sharded = sorted(n for n, p in head.items() if hasattr(p, "full_tensor"))
    start = {n: full(p) for n, p in head.items()}
    try:
        losses = train(model, STEPS)
        folder = qc.save_adapters(model, OUTDIR / "fsdp2_full")
    except Exception as e:  # raised on every rank at the same point: recorded, goes on
        return {"error": f"{type(e).__name__}: {e}".strip()[:600],
                "traceback": traceback.format_exc()[-3000:]}
    dist.barrier()  # rank 0 has written
    ref_losses, _, ref = reference("nf4", STEPS, full=True)
    # every rank trains the same reference; rank 0 writes it (save_adapters' rule)
    ref_folder = qc.save_adapters(ref, OUTDIR / "fsdp2_full_reference")
    dist.barrier()
    saved = load_file(str(folder / "adapter_model.safetensors"))
    want = load_file(str(ref_folder / "adapter_model.safetensors"))
    config, ref_config = (json.loads((f / "adapter_config.json").read_text())
                          for f in (folder, ref_folder))
    return {"error": None, "losses": losses, "mean_losses": mean_over_ranks(losses),
            "ref_losses": ref_losses, "head_sharded": sharded,
            "saved_vs_reference": compare(saved, want),
            "saved_head": sorted(k for k in saved if ".head." in k),
            "config_equal": config == ref_config,
            "modules_to_save": config.get("modules_to_save"),
            "head_moved": max(float((saved[f"base_model.model.head.{n}"] - start[n]).abs()
                                    .max()) for n in start)}


def compile_once_case(scheme: str) -> dict[str, Any]:
    """compile_once from a safetensors checkpoint of the float model (each rank quantizes
    its rows of every frozen base), against one process's qc.qcompile; then one step."""
    from safetensors.torch import save_file

    spec = spec_of("fsdp2", scheme)
    path = OUTDIR / f"float_{scheme}.safetensors"
    if dist.get_rank() == 0:
        save_file({k: v.contiguous().clone() for k, v in build().state_dict().items()},
                  str(path))
    dist.barrier()
    try:
        gm = qc.distributed.compile_once(build, spec, EXAMPLE, checkpoint=str(path))
    except Exception as e:  # raised on every rank (compile_once's contract): recorded
        return {"error": f"compile_once: {type(e).__name__}: {e}".strip()[:600],
                "traceback": traceback.format_exc()[-3000:]}
    ref = qc.qcompile(build(), spec_of("none", scheme), example_inputs=EXAMPLE)
    stored = {n: full(p) for n, p in params(gm, ".weight_frozen.").items()}
    ref_stored = {n: full(p) for n, p in params(ref, ".weight_frozen.").items()}
    got_adapters = adapters(gm)
    out: dict[str, Any] = {
        "error": None, "shards": sharding(gm),
        "stored_vs_reference": compare(stored, ref_stored),
        "adapters_vs_reference": compare(got_adapters, adapters(ref)),
        "b_zero": all(not t.any() for n, t in got_adapters.items() if ".lora_B." in n)}
    try:
        losses = train(qc.distributed.wrap(gm, spec), 1)
    except Exception as e:
        out.update({"error": f"training step: {type(e).__name__}: {e}".strip()[:600],
                    "traceback": traceback.format_exc()[-3000:]})
        return out
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    x, y = global_batch(0)
    mse(ref(x), y).backward()
    ref_opt.step()
    after = adapters(gm)
    out.update({"losses": losses, "step_vs_reference": compare(after, adapters(ref)),
                "moved": max(float((after[n] - got_adapters[n]).abs().max()) for n in after),
                **frozen_checks(gm, stored)})
    return out


class Conv1DBlock(nn.Module):
    """GPT-2's MLP: Hugging Face ``Conv1D`` layers, weights stored [in, out]."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_fc, self.c_proj = Conv1D(2 * WIDTH, WIDTH), Conv1D(WIDTH, 2 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(torch.relu(self.c_fc(x)))


class Conv1DModel(Model):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Conv1DBlock(), Conv1DBlock()])


def build_conv1d() -> nn.Module:
    torch.manual_seed(0)
    return Conv1DModel().requires_grad_(False)


def case_compile_once_conv1d() -> dict[str, Any]:
    """compile_once of Conv1D layers (NF4 bases stored by output rows: each rank reads its
    columns of the checkpoint's [in, out] weights) against one process's qc.qcompile."""
    from safetensors.torch import save_file

    def spec(kind: str) -> dict[str, Any]:
        return {"quant": {"mode": "qat", "rules": [
                    {"match": {"module": "Conv1D"}, "weight": SCHEMES["nf4"]}]},
                "adapters": [{"match": {"module": "Conv1D"}, "rank": 4, "alpha": 8}],
                "data_parallel": {"kind": kind}}

    path = OUTDIR / "float_conv1d.safetensors"
    if dist.get_rank() == 0:
        save_file({k: v.contiguous().clone() for k, v in build_conv1d().state_dict().items()},
                  str(path))
    dist.barrier()
    try:
        gm = qc.distributed.compile_once(build_conv1d, spec("fsdp2"), EXAMPLE,
                                         checkpoint=str(path))
        losses = train(qc.distributed.wrap(gm, spec("fsdp2")), 1)
    except Exception as e:  # raised on every rank (compile_once's contract): recorded
        return {"error": f"{type(e).__name__}: {e}".strip()[:600],
                "traceback": traceback.format_exc()[-3000:]}
    ref = qc.qcompile(build_conv1d(), spec("none"), example_inputs=EXAMPLE)
    stored = {n: full(p) for n, p in params(gm, ".weight_frozen.").items()}
    ref_stored = {n: full(p) for n, p in params(ref, ".weight_frozen.").items()}
    return {"error": None, "losses": losses, "shards": sharding(gm),
            "stored_vs_reference": compare(stored, ref_stored)}


def case_compile_once_int4() -> dict[str, Any]:
    return compile_once_case("int4")


def case_compile_once_nf4() -> dict[str, Any]:
    return compile_once_case("nf4")



CASES = cases_in(globals())


# -- main ------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
