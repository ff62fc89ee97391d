"""One rank of the 2-process ``qc.distributed.compile_once`` tests (``test_compile_once.py``
launches two; run as a script, never imported from the tests folder)::

    python tests/dist/_compile_once_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` (or torchrun's ``MASTER_ADDR`` /
``MASTER_PORT``) in the environment. Each rank writes ``OUTDIR/rank<r>.json``
(``{case: result}``) after every case; the test asserts on those.

Checkpoints are written by rank 0 into ``OUTDIR`` (then a barrier). Calibration: rank ``r``
passes its own batches (``rank_batches(r)``: different data, each rank holding some of the
extremes); the single-process reference compiles the real model with
``sync_observers: false`` and calibrates on the union of every rank's batches. The sharded
result's full state is gathered with ``full_tensor()`` on every rank (the brief's recipe:
``get_model_state_dict`` does not apply, the names are the model's own).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _worker_main import cases_in, error_of, run_cases
from safetensors.torch import save_file
from torch import nn

import qcompile as qc

D_IN, WIDTH, D_OUT, BLOCKS = 8, 16, 5, 3
CNN_IN, CNN_CH, CNN_BLOCKS, CNN_OUT = 3, 8, 3, 4
LOCAL = 4
PG_TIMEOUT = datetime.timedelta(seconds=20)
OUTDIR = Path(".")


# -- models ---------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.ln(x)))


class BlockModel(nn.Module):
    """An input Linear, ``BLOCKS`` identical residual blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D_IN, WIDTH)
        self.layers = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, D_OUT)
        if self.inp.weight.device.type != "meta":
            with torch.no_grad():  # LayerNorm affine off its defaults, so loading shows
                for b in self.layers:
                    b.ln.weight.uniform_(0.5, 1.5)
                    b.ln.bias.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(CNN_CH, CNN_CH, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(CNN_CH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    """A conv stem (Conv+BN), ``CNN_BLOCKS`` Conv2d+BatchNorm2d residual blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.stem = nn.Conv2d(CNN_IN, CNN_CH, 3, padding=1)
        self.stem_bn = nn.BatchNorm2d(CNN_CH)
        self.blocks = nn.ModuleList([ConvBlock() for _ in range(CNN_BLOCKS)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(CNN_CH, CNN_OUT)
        if self.stem.weight.device.type != "meta":
            g = torch.Generator().manual_seed(7)
            with torch.no_grad():  # non-trivial BN statistics, some negative gammas
                for bn in [self.stem_bn, *(b.bn for b in self.blocks)]:
                    n = bn.num_features
                    sign = torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
                    bn.weight.copy_(sign * (0.5 + torch.rand(n, generator=g)))
                    bn.bias.copy_(torch.randn(n, generator=g) * 0.2)
                    bn.running_mean.copy_(torch.randn(n, generator=g) * 0.3)
                    bn.running_var.copy_(0.3 + torch.rand(n, generator=g))
                    bn.num_batches_tracked.fill_(17)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem_bn(self.stem(x)))
        for b in self.blocks:
            x = b(x)
        return self.head(torch.flatten(self.pool(x), 1))


# -- data -----------------------------------------------------------------------------------
def rank_batches(rank: int, shape: tuple[int, ...] = (LOCAL, D_IN)) -> list[torch.Tensor]:
    """Rank ``rank``'s calibration batches: different per rank, shifted apart so each
    rank holds some of the extremes."""
    g = torch.Generator().manual_seed(300 + rank)
    shift = (2.0, -2.0)[rank % 2]
    return [torch.randn(*shape, generator=g) + shift for _ in range(2)]


def union(shape: tuple[int, ...] = (LOCAL, D_IN)) -> list[torch.Tensor]:
    return [b for r in range(dist.get_world_size()) for b in rank_batches(r, shape)]


def fixed_input(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(99))


# -- specs ----------------------------------------------------------------------------------
def spec_of(preset: str, kind: str, sync: bool = True) -> dict[str, Any]:
    spec = qc.load_spec(preset).model_dump()
    spec["data_parallel"] = {"kind": kind}
    spec["quant"]["sync_observers"] = sync
    return spec


def reference(build: Callable[[], nn.Module], preset: str, example: torch.Tensor,
              batches: list[torch.Tensor] | None) -> nn.Module:
    """One process: the real model compiled, calibrated on ``batches`` (no sync)."""
    ref = qc.qcompile(build(), spec_of(preset, "none", sync=False), example_inputs=(example,))
    if batches is not None:
        qc.calibrate(ref, batches, sync=False, progress=False)
    return ref


# -- checkpoints ----------------------------------------------------------------------------
def save_checkpoint(state: dict[str, torch.Tensor], name: str) -> Path:
    """Rank 0 writes ``state`` to ``OUTDIR/name``; every rank returns the path."""
    path = OUTDIR / name
    if dist.get_rank() == 0:
        save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path))
    dist.barrier()
    return path


def save_sharded_folder(state: dict[str, torch.Tensor], name: str) -> Path:
    """Rank 0 writes ``state`` as 2 shards plus ``model.safetensors.index.json``."""
    folder = OUTDIR / name
    if dist.get_rank() == 0:
        folder.mkdir()
        names = sorted(state)
        half = len(names) // 2
        weight_map = {}
        for i, part in enumerate((names[:half], names[half:])):
            file = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({k: state[k].detach().contiguous().clone() for k in part},
                      str(folder / file))
            weight_map.update(dict.fromkeys(part, file))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    dist.barrier()
    return folder


# -- comparing --------------------------------------------------------------------------------
def gathered(gm: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict (every rank calls this: sharded tensors are all-gathered)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in gm.state_dict().items()}


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Key sets, the names not bit-identical, and the largest absolute/relative gaps."""
    common = sorted(set(got) & set(want))
    bad = [k for k in common if got[k].shape != want[k].shape or got[k].dtype != want[k].dtype
           or not torch.equal(got[k], want[k])]
    gaps = {}
    for k in bad:
        if got[k].shape == want[k].shape and got[k].is_floating_point():
            a, b = got[k].double(), want[k].double()
            gaps[k] = {"abs": (a - b).abs().max().item(),
                       "allclose_1e-6": bool(torch.allclose(a, b, rtol=1e-6, atol=0.0))}
    return {"missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)),
            "not_equal": bad, "gaps": gaps, "compared": len(common)}


def differing_from_rank0(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensor differs from rank 0's (union over the ranks)."""
    bad = []
    for name, t in sorted(tensors.items()):
        theirs = t.clone().contiguous()
        dist.broadcast(theirs, src=0)
        if not torch.equal(theirs, t):
            bad.append(name)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad)
    return sorted({n for b in everyone for n in b})


def shards(gm: nn.Module) -> dict[str, dict[str, Any]]:
    """Each parameter: a DTensor?, its placements, global and local rows."""
    out = {}
    for name, p in gm.named_parameters():
        is_dt = hasattr(p, "to_local") and hasattr(p, "placements")
        local = p.to_local() if is_dt else p
        out[name] = {"dtensor": is_dt,
                     "placements": [str(x) for x in p.placements] if is_dt else [],
                     "rows": int(p.shape[0]) if p.dim() else 0,
                     "local_rows": int(local.shape[0]) if local.dim() else 0}
    return out


def plain_name(name: str) -> str:
    """``name`` without the ``stage_<i>.`` prefix of a sharded graph's block child."""
    return re.sub(r"^stage_\d+\.", "", name)


def qparams(gm: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantizer's scale, zero point and observer range, by the model's names."""
    out = {}
    for name, q in qc.quantizers(gm).items():
        n = plain_name(name)
        for k in ("scale", "zero_point"):
            t = getattr(q, k)
            out[f"{n}.{k}"] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
        if q.observer is not None:
            for k in ("min_val", "max_val"):
                out[f"{n}.observer.{k}"] = getattr(q.observer, k).detach().clone()
    return out


def flags(gm: nn.Module) -> dict[str, list[bool]]:
    return {n: [bool(q.enabled), bool(q.observe)] for n, q in qc.quantizers(gm).items()}


def notes(gm: nn.Module) -> list[str]:
    return [str(n) for n in qc.report(gm).passes[-1].notes]


def output_of(gm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return gm(x).detach()


def summary(gm: nn.Module, ref: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """What the sharded/replicated result holds vs the one-process reference."""
    got, want = gathered(gm), gathered(ref)
    out, ref_out = output_of(gm, x), output_of(ref, x)
    return {"vs_reference": compare(got, want),
            "qparams_vs_reference": compare(qparams(gm), qparams(ref)),
            "out_diff": (out - ref_out).abs().max().item(),
            "out_equal": bool(torch.equal(out, ref_out)),
            "out_norm": ref_out.norm().item(),
            "shards": shards(gm), "flags": flags(gm), "notes": notes(gm),
            "children": sorted(n for n, _ in gm.named_children()),
            "quantizers": len(qc.quantizers(gm)),
            "keys": sorted(got)}


def own_only(build: Callable[[], nn.Module], preset: str, example: torch.Tensor,
             shape: tuple[int, ...]) -> list[str]:
    """The qparams that calibrating on this rank's batches alone would get wrong (so the
    union comparison can fail)."""
    alone = qparams(reference(build, preset, example, rank_batches(dist.get_rank(), shape)))
    want = qparams(reference(build, preset, example, union(shape)))
    return sorted(k for k in want if not torch.equal(alone[k], want[k]))


# -- 1 & 2. fsdp2 + static on a block model, from a checkpoint / streamed from rank 0 ----------
def fsdp2_static(checkpoint: bool) -> dict[str, Any]:
    example = torch.randn(2, D_IN)
    ckpt = save_checkpoint(BlockModel().state_dict(), "block.safetensors") if checkpoint \
        else None
    gm = qc.distributed.compile_once(BlockModel, spec_of("int8-static", "fsdp2"), (example,),
                                     calibration=rank_batches(dist.get_rank()),
                                     checkpoint=ckpt)
    ref = reference(BlockModel, "int8-static", example, union())
    out = summary(gm, ref, fixed_input((3, D_IN)))
    out["own_only"] = own_only(BlockModel, "int8-static", example, (LOCAL, D_IN))
    out["blocks"] = qc.distributed.once.blocks(BlockModel())
    return out


def case_fsdp2_static_ckpt() -> dict[str, Any]:
    return fsdp2_static(checkpoint=True)


def case_fsdp2_static_stream() -> dict[str, Any]:
    return fsdp2_static(checkpoint=False)


# -- 3. fsdp2 + QAT from a checkpoint, trained 2 steps --------------------------------------
def case_fsdp2_qat_train() -> dict[str, Any]:
    example = torch.randn(2, D_IN)
    ckpt = save_checkpoint(BlockModel().state_dict(), "block_qat.safetensors")
    gm = qc.distributed.compile_once(BlockModel, spec_of("int8-qat", "fsdp2"), (example,),
                                     checkpoint=ckpt)
    start = gathered(gm)
    q_start = qparams(gm)
    ckpt_state = BlockModel().state_dict()
    loaded = compare({k: start[k] for k in ckpt_state}, ckpt_state)
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(40 + rank)
    data = [(torch.randn(LOCAL, D_IN, generator=g) * (1.0 + 2.0 * rank),  # differs per rank
             torch.randn(LOCAL, D_OUT, generator=g)) for _ in range(2)]
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = ((gm(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    end = gathered(gm)
    weights = {n: end[n] for n in ckpt_state}
    moved = max((end[n] - start[n]).abs().max().item() for n in ckpt_state)
    q = qparams(gm)
    # the same two steps in one process on this rank's data alone (nothing synchronised):
    # its qparams differ between the ranks, so the check above could fail
    alone = qc.qcompile(BlockModel(), spec_of("int8-qat", "none", sync=False),
                        example_inputs=(example,))
    alone.load_state_dict(start)
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.05)
    for x, y in data:
        alone_opt.zero_grad()
        ((alone(x) - y) ** 2).mean().backward()
        alone_opt.step()
    return {"losses": losses, "loaded_vs_checkpoint": loaded, "moved": moved,
            "qparams_differing": differing_from_rank0(q),
            "weights_differing": differing_from_rank0(weights),
            "unsynced_would_differ": differing_from_rank0(qparams(alone)),
            "qparams_changed": sorted(k for k in q if not torch.equal(q[k], q_start[k])),
            "qparam_names": sorted(q), "weights": sorted(weights),
            "flags": flags(gm), "shards": shards(gm), "notes": notes(gm)}


# -- 4. fsdp2 + static on a CNN with Conv2d+BatchNorm2d blocks ---------------------------------
def case_fsdp2_cnn_fold() -> dict[str, Any]:
    """From a checkpoint (each rank recomputes its rows of every fold from the checkpoint's
    conv and BatchNorm tensors) and, for comparison, streamed from rank 0."""
    shape = (2, CNN_IN, 6, 6)
    example = torch.randn(*shape)
    raw = CNN().state_dict()
    ckpt = save_checkpoint(raw, "cnn.safetensors")
    ref = reference(CNN, "int8-static", example, union(shape))
    out: dict[str, Any] = {}
    for how, path in (("checkpoint", ckpt), ("stream", None)):
        gm = qc.distributed.compile_once(CNN, spec_of("int8-static", "fsdp2"), (example,),
                                         calibration=rank_batches(dist.get_rank(), shape),
                                         checkpoint=path)
        got = summary(gm, ref, fixed_input(shape))
        full = gathered(gm)
        convs = ["stem.weight", *(f"blocks.{i}.conv.weight" for i in range(CNN_BLOCKS))]
        got["bn_left"] = sorted(n for n, m in gm.named_modules()
                                if isinstance(m, nn.BatchNorm2d))
        # folding happened: the weights are not the checkpoint's, and a negative gamma
        # flips the sign of its output channel
        got["unfolded"] = [n for n in convs if torch.equal(full[n], raw[n])]
        bn = ["stem_bn", *(f"blocks.{i}.bn" for i in range(CNN_BLOCKS))]
        got["sign_flipped"] = all(
            bool(((full[c].flatten(1) * raw[c].flatten(1)).sum(1) < 0).eq(
                raw[f"{b}.weight"] < 0).all()) for c, b in zip(convs, bn, strict=True))
        out[how] = got
    out["ref_bn_left"] = sorted(n for n, m in ref.named_modules()
                                if isinstance(m, nn.BatchNorm2d))
    out["negative_gammas"] = int(sum((v < 0).sum() for k, v in raw.items()
                                     if k.endswith("bn.weight")))
    return out


# -- 5. ddp + static from a folder of 2 shards + index -----------------------------------------
def case_ddp_static_folder() -> dict[str, Any]:
    example = torch.randn(2, D_IN)
    folder = save_sharded_folder(BlockModel().state_dict(), "block_folder")
    gm = qc.distributed.compile_once(BlockModel, spec_of("int8-static", "ddp"), (example,),
                                     calibration=rank_batches(dist.get_rank()),
                                     checkpoint=folder)
    ref = reference(BlockModel, "int8-static", example, union())
    out = summary(gm, ref, fixed_input((3, D_IN)))
    out["files"] = sorted(p.name for p in folder.iterdir())
    out["plain"] = all(type(t) is torch.Tensor or type(t) is nn.Parameter
                       for t in gm.state_dict().values())
    out["own_only"] = own_only(BlockModel, "int8-static", example, (LOCAL, D_IN))
    return out


# -- 6. a checkpoint that does not fit: refused on every rank, nothing hangs -------------------
def case_errors() -> dict[str, Any]:
    example = torch.randn(2, D_IN)
    good = BlockModel().state_dict()
    bad: dict[str, dict[str, torch.Tensor]] = {
        "missing": {k: v for k, v in good.items() if k != "layers.1.fc.weight"},
        "extra": {**good, "layers.9.fc.weight": torch.zeros(WIDTH, WIDTH)},
        "misshaped": {**good, "head.weight": torch.zeros(D_OUT + 1, WIDTH)},
        "dtype": {**good, "layers.0.ln.bias": good["layers.0.ln.bias"].double()},
    }
    paths = {what: save_checkpoint(state, f"bad_{what}.safetensors")
             for what, state in bad.items()}
    whole = save_checkpoint(good, "whole.safetensors")
    truncated = OUTDIR / "bad_truncated.safetensors"
    if dist.get_rank() == 0:
        data = whole.read_bytes()
        truncated.write_bytes(data[: len(data) - 64])
    dist.barrier()
    paths["truncated"] = truncated
    out: dict[str, Any] = {}
    for kind in ("fsdp2", "ddp"):
        for what, path in paths.items():
            err = error_of(lambda p=path, k=kind: qc.distributed.compile_once(
                BlockModel, spec_of("int8-static", k), (example,),
                calibration=rank_batches(dist.get_rank()), checkpoint=p))
            out[f"{kind}/{what}"] = err
            dist.barrier()  # both ranks got here: nobody is stuck in a collective
    # and the group still works afterwards
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    out["all_reduce_after"] = t.item()
    return out


# -- 7. the compile cache -------------------------------------------------------------------
def case_cache() -> dict[str, Any]:
    example = torch.randn(2, D_IN)
    ckpt = save_checkpoint(BlockModel().state_dict(), "block_cache.safetensors")
    directory = OUTDIR / "cache"
    calls: dict[str, Any] = {}
    states = []
    for call in ("first", "second"):
        gm = qc.distributed.compile_once(BlockModel, spec_of("int8-static", "fsdp2"),
                                         (example,), calibration=rank_batches(dist.get_rank()),
                                         checkpoint=ckpt, cache_dir=str(directory))
        dist.barrier()
        states.append(gathered(gm))
        calls[call] = {"notes": notes(gm), "flags": flags(gm),
                       "out": output_of(gm, fixed_input((3, D_IN))).tolist(),
                       "shards": shards(gm)}
    # only rank 1's calibration data changes: the key covers every rank's, so a miss
    other = rank_batches(dist.get_rank()) if dist.get_rank() == 0 else \
        [b * 1.5 for b in rank_batches(dist.get_rank())]
    gm = qc.distributed.compile_once(BlockModel, spec_of("int8-static", "fsdp2"), (example,),
                                     calibration=other, checkpoint=ckpt,
                                     cache_dir=str(directory))
    calls["rank1_data_changed"] = {"notes": notes(gm)}
    changed = gathered(gm)
    entries = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    stored: dict[str, Any] = {}
    for key in entries:
        path = directory / key / "state.pt"
        if path.exists():
            state = torch.load(path, weights_only=True)
            stored[key] = sorted(state)
    ref = reference(BlockModel, "int8-static", example, union())
    return {"calls": calls, "entries": entries, "stored": stored,
            "weights": sorted(n for n, _ in BlockModel().named_parameters()),
            "second_vs_first": compare(states[1], states[0]),
            "changed_vs_first": compare(changed, states[0]),
            "first_vs_reference": compare(states[0], gathered(ref))}


# -- 8. calibration at 1/N per rank, default allocator ---------------------------------------
# 3 blocks of 2 x Linear(2048), 32 MiB each, 96 MiB in all; a block's all-gather buffer is
# then above glibc's largest mmap threshold (32 MiB): see docs/benchmarks.md on smaller blocks
MEM_BLOCKS, MEM_WIDTH = 3, 2048
MEM_BATCHES = 2  # per rank (the first batch already showed the growth)


class MemBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(MEM_WIDTH, MEM_WIDTH), nn.Linear(MEM_WIDTH, MEM_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


class MemModel(nn.Module):
    """``MEM_BLOCKS`` identical blocks: what ``compile_once`` shards one FSDP2 group each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MemBlock() for _ in range(MEM_BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def rss_mb() -> dict[str, float]:
    """This process's VmRSS (current) and VmHWM (peak), MB, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) / 1024
    return out


def reset_peak() -> bool:
    """VmHWM := VmRSS (Linux >= 4.0); False where /proc/self/clear_refs refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def case_fsdp2_calibration_memory() -> dict[str, Any]:
    """Calibrated sharded compile_once (int8-static, from a checkpoint, ``MEM_BATCHES``
    batches per rank) with glibc's malloc defaults: this rank's peak RSS over the RSS
    before the call. A tiny calibrated sharded compile_once runs first, so that what
    loads once per process (FSDP2's and DTensor's modules, the kernels' library) is in the
    baseline, as the benchmark's is; memory freed before the call is handed back first
    (``return_freed_memory``), so the call cannot hide its growth in it."""
    import gc

    from qcompile.runtime.calibration import return_freed_memory

    warm = qc.distributed.compile_once(BlockModel, spec_of("int8-static", "fsdp2"),
                                       (torch.randn(2, D_IN),),
                                       calibration=rank_batches(dist.get_rank()))
    del warm
    # rank 0 alone builds the real model, to write the checkpoint
    ckpt = save_checkpoint(MemModel().state_dict() if dist.get_rank() == 0 else {},
                           "mem.safetensors")
    g = torch.Generator().manual_seed(500 + dist.get_rank())
    batches = [torch.randn(4, MEM_WIDTH, generator=g) for _ in range(MEM_BATCHES)]
    example = torch.randn(4, MEM_WIDTH)
    gc.collect()
    return_freed_memory()
    dist.barrier()
    measurable = reset_peak()
    before = rss_mb()["VmRSS"]
    gm = qc.distributed.compile_once(MemModel, spec_of("int8-static", "fsdp2"), (example,),
                                     calibration=batches, checkpoint=ckpt)
    peak = rss_mb()["VmHWM"] - before
    model_mb = sum(p.numel() * p.element_size() for p in gm.parameters()) / 2**20  # global
    local_mb = sum(p.to_local().numel() * p.element_size() for p in gm.parameters()) / 2**20
    return {"measurable": measurable, "peak_mb": peak, "model_mb": model_mb,
            "block_mb": model_mb / MEM_BLOCKS, "local_param_mb": local_mb,
            "world": dist.get_world_size(), "flags": flags(gm),
            "children": sorted(n for n, _ in gm.named_children())}


# -- known failure (runs last: it leaves the process group unusable) ---------------------------
SHORT_TIMEOUT = datetime.timedelta(seconds=4)


def case_fsdp2_unequal_batches() -> dict[str, Any]:
    """Sharded calibration where rank 0 has one batch more than rank 1. Every forward of a
    sharded graph is a collective (FSDP2 all-gathers), so rank 0's extra forward meets
    rank 1's observer all-reduce. The group is first re-created with a short timeout so
    a mismatch fails within seconds instead of hanging; what each rank raised is recorded."""
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=(OUTDIR / "store_short").as_uri(),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=SHORT_TIMEOUT)
    rank = dist.get_rank()
    batches = rank_batches(rank) + ([rank_batches(1)[0] * 3.0] if rank == 0 else [])
    err = error_of(lambda: qc.distributed.compile_once(
        BlockModel, spec_of("int8-static", "fsdp2"), (torch.randn(2, D_IN),),
        calibration=batches))
    err["message"] = err["message"][:600]
    return {**err, "batches": len(batches)}


BREAKS_PG = {"fsdp2_unequal_batches"}

CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT, BREAKS_PG)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
