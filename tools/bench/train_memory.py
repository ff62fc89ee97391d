"""Training-step memory under FSDP2 (``qcompile-bench memory``'s training-step rows).

One fresh process group per (variant, world size), gloo on CPU, one thread per rank,
started by ``torch.multiprocessing.spawn``. Every variant trains ``big_model(blocks,
width)`` (one FSDP2 group per block, then the root, as torchtitan does) with SGD:

- ``float``: the float model, ``fully_shard`` on each block then on the root;
- ``qat``: ``qc.distributed.compile_once(build, spec, example_inputs, checkpoint=...)``
  with int8-qat and ``data_parallel: {kind: fsdp2}`` (it returns the graph already
  sharded, one group per block);
- ``qat_kept``: the same with ``train.recompute_weights: false`` (autograd keeps each
  layer's fake-quantized weight for backward);
- ``naive``: torch.ao ``prepare_qat_fx`` on the float model, then ``fully_shard`` on each
  block's layers (one group per block) and on the root.

Per rank: one warm-up step, then the RSS baseline; the peak RSS (VmHWM, reset to the
baseline) of one more step (forward + backward + ``optimizer.step()``) over that baseline
and over the post-import baseline (the RSS the rank reaches while training: the ratio to
the float step is taken on this one), and the RSS after it; then a third step whose
forward runs under a ``torch.autograd.graph.saved_tensors_hooks`` pack hook: the bytes of
the unique storages autograd keeps, counted when the forward returns (FSDP2 has resized
its unsharded parameter storages to 0 by then), a number no allocator changes.

Example:
    >>> from qcompile.tools.bench.train_memory import TRAIN_VARIANTS, saved_bytes
    >>> list(TRAIN_VARIANTS)
    ['float', 'qat', 'qat_kept', 'naive']
    >>> import torch
    >>> w = torch.randn(64, 64, requires_grad=True)
    >>> out, kept = saved_bytes(lambda: (torch.randn(8, 64) @ w).sum())
    >>> kept  # matmul keeps its input (8 x 64 fp32); the leaf w needs no grad of its own
    2048
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.tools.bench.measure import spawn_ranks
from qcompile.tools.bench.models import big_model
from qcompile.tools.bench.workers import _local_bytes, _reset_peak, _status

TRAIN_VARIANTS = {"float": "float FSDP2", "qat": "qcompile QAT FSDP2",
                  "qat_kept": "qcompile QAT FSDP2, weights kept",
                  "naive": "naive: prepare_qat_fx + FSDP2"}

WITHIN = 1.10  # a QAT step peaks within 10% of the float step


def train_spec(variant: str) -> dict[str, Any]:
    """The spec dict of a qcompile variant: int8-qat, FSDP2, and for ``qat_kept``
    ``train.recompute_weights: false``."""
    spec = qc.load_spec("int8-qat").model_dump()
    spec["data_parallel"] = {"kind": "fsdp2"}
    if variant == "qat_kept":
        spec["train"] = {**spec.get("train", {}), "recompute_weights": False}
    return spec


def kept_weights_option() -> str | None:
    """None when the spec accepts ``train.recompute_weights: false``; else why not (the
    ``qat_kept`` row is left out with this note)."""
    from pydantic import ValidationError

    try:
        qc.CompileSpec.model_validate(train_spec("qat_kept"))
    except ValidationError as e:
        return ("qcompile QAT FSDP2, weights kept: not measured, the spec refuses "
                f"train.recompute_weights ({e.errors()[0]['msg']})")
    return None


def saved_bytes(forward: Callable[[], Any]) -> tuple[Any, int]:
    """``(forward(), bytes)``: the bytes of the unique storages autograd saved for backward
    during ``forward()``, counted when it returns (a storage FSDP2 resized to 0 by then
    counts 0). The storages are let go before returning: counting keeps nothing alive."""
    kept: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        kept.setdefault(s._cdata, s)  # one entry per storage, however many views share it
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    total = sum(s.nbytes() for s in kept.values())
    kept.clear()
    return out, total


def _block_groups(model: nn.Module, blocks: int) -> list[list[nn.Module]]:
    """Per block of a model prepared by torch.ao, its modules owning parameters directly:
    the prepared graph calls the layers, never the block, so the block's FSDP2 group is
    the list of its layers (``fully_shard([fc1, fc2])``)."""
    groups = []
    for i in range(blocks):
        prefix = f"blocks.{i}."
        groups.append([m for n, m in model.named_modules() if n.startswith(prefix)
                       and any(True for _ in m.parameters(recurse=False))])
    return groups


def _setup(variant: str, blocks: int, width: int, x: torch.Tensor, checkpoint: str
           ) -> nn.Module:
    import functools
    import warnings

    from torch.distributed.fsdp import fully_shard

    if variant in ("qat", "qat_kept"):
        return qc.distributed.compile_once(functools.partial(big_model, blocks, width),
                                           train_spec(variant), (x,), checkpoint=checkpoint)
    from safetensors.torch import load_file

    model = big_model(blocks, width)
    model.load_state_dict(load_file(checkpoint))  # the weights the qcompile rows read
    if variant == "naive":
        from torch.ao.quantization import get_default_qat_qconfig_mapping
        from torch.ao.quantization.quantize_fx import prepare_qat_fx

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = prepare_qat_fx(model.train(), get_default_qat_qconfig_mapping("x86"), (x,))
        for group in _block_groups(model, blocks):
            fully_shard(group if len(group) > 1 else group[0])
    else:
        for block in model.blocks:
            fully_shard(block)
    return fully_shard(model)


def train_memory_rank(rank: int, world: int, store: str, variant: str, blocks: int,
                      width: int, batch: int, checkpoint: str, out_dir: str) -> None:
    """One of ``world`` ranks training ``variant`` (see the module docstring); writes
    ``rank{rank}.json`` into ``out_dir``: MB over the post-import baseline after setup
    (``setup_mb``) and after the warm-up step (``warm_mb``), the measured step's peak and
    end over the post-warm-up baseline (``peak_mb``, ``after_mb``) and its peak over the
    post-import baseline (``total_peak_mb``), the MB autograd keeps after a forward
    (``saved_mb``), the local parameter MB. The post-import baseline
    is the RSS after importing torch, qcompile and torch.ao, initialising the process
    group and compiling a tiny model (qcompile's modules load lazily)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import safetensors.torch  # noqa: F401  (the checkpoint reader: in the baseline)
    from torch.ao.quantization.quantize_fx import prepare_qat_fx  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    import qcompile.distributed.once  # noqa: F401
    qc.qcompile(big_model(2, 8), "int8-qat", (torch.randn(2, 8),))  # lazy modules load
    dist.barrier()
    base = _status()["VmRSS"]
    torch.manual_seed(rank)  # each rank its own local batch, as data parallel trains
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    model = _setup(variant, blocks, width, x, checkpoint)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    setup = _status()["VmRSS"] - base

    def step(count_saved: bool = False) -> int:
        opt.zero_grad()
        kept = 0
        if count_saved:
            out, kept = saved_bytes(lambda: model(x))
        else:
            out = model(x)
        nn.functional.mse_loss(out, y).backward()
        opt.step()
        return kept

    step()  # warm-up: lazy initialisation (FSDP2's, observers') happens here
    warm = _status()["VmRSS"] - base
    dist.barrier()
    _reset_peak()
    before = _status()["VmRSS"]
    step()
    now = _status()
    peak, after = now["VmHWM"] - before, now["VmRSS"] - before
    kept = step(count_saved=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"setup_mb": setup, "warm_mb": warm, "peak_mb": peak, "after_mb": after,
                   "total_peak_mb": warm + peak, "saved_mb": kept / 2**20,
                   "local_param_mb": _local_bytes(model) / 2**20}, f)
    dist.barrier()
    dist.destroy_process_group()


def bench_train_memory(blocks: int, width: int, batch: int, worlds: tuple[int, ...],
                       mmap_thresholds: tuple[int | None, ...] = (None,)) -> dict[str, Any]:
    """Per allocator setting, world size and variant, every rank's numbers (see
    ``train_memory_rank``) and, against the float FSDP2 step at the same world size (the
    highest rank against the highest rank): ``vs_float``, the ratio of the step's peak
    over the post-import baseline (what a rank's RSS reaches while training; ``ok``:
    within 10%). The step's peak over the post-warm-up baseline (what the step adds) has
    no ratio: with glibc's defaults the warm-up's freed memory stays in the allocator and
    the measured step reuses it, so it reads only with an mmap threshold (and a kept
    weight that outlives the step is in that baseline). Per ``mmap_thresholds`` entry the
    ranks run with glibc's defaults
    (None) or with ``MALLOC_MMAP_THRESHOLD_`` at that many bytes (freed tensors go back to
    the OS at once: the peak is what was live). ``qat_kept`` is left out, with a note,
    where the spec does not accept ``train.recompute_weights``."""
    from safetensors.torch import save_file

    model = big_model(blocks, width)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    note = kept_weights_option()
    variants = [v for v in TRAIN_VARIANTS if v != "qat_kept" or note is None]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model.safetensors")
        save_file(dict(model.state_dict()), ckpt)
        del model
        for threshold in mmap_thresholds:
            for world in worlds:
                float_row: dict[str, Any] | None = None
                for variant in variants:
                    out = os.path.join(tmp, f"m{threshold}-w{world}-{variant}")
                    os.makedirs(out)
                    ranks = _launch(world, out, variant, blocks, width, batch, ckpt, threshold)
                    row = {"mmap_threshold": threshold, "world": world, "variant": variant,
                           **{k: [r[k] for r in ranks] for k in ranks[0]}}
                    if variant == "float":
                        float_row = row
                    if float_row is not None:
                        row["vs_float"] = (max(row["total_peak_mb"])
                                           / max(float_row["total_peak_mb"]))
                        row["ok"] = row["vs_float"] <= WITHIN
                    rows.append(row)
    result: dict[str, Any] = {"model_mb": model_mb, "blocks": blocks, "width": width,
                              "batch": batch, "rows": rows}
    if note is not None:
        result["note"] = note
    return result


def _launch(world: int, out: str, variant: str, blocks: int, width: int, batch: int,
            ckpt: str, threshold: int | None) -> list[dict[str, Any]]:
    return spawn_ranks(train_memory_rank, (world, os.path.join(out, "store"), variant, blocks,
                                           width, batch, ckpt, out), world, out, threshold)


def train_memory_text(r: dict[str, Any]) -> str:
    """The table: per allocator setting, world size and variant, each rank's step peak
    over its post-import baseline (sharded model, gradients and all), the ratio to the
    float FSDP2 step (highest rank against highest rank; ``ok``: within 10%), then the
    most any rank's step added over its post-warm-up baseline (``step``) and held after
    it (``after``), and the most bytes a rank's autograd kept after a forward (``kept``).

    >>> print(train_memory_text({"model_mb": 256.0, "blocks": 8, "width": 2048, "batch": 8,
    ...     "rows": [{"world": 2, "variant": "float", "peak_mb": [100.0, -0.2],
    ...               "after_mb": [0.0, 1.0], "saved_mb": [0.5, 0.5],
    ...               "total_peak_mb": [400.0, 390.0], "vs_float": 1.0, "ok": True}]}))
    ... # doctest: +NORMALIZE_WHITESPACE
    training step under FSDP2 (SGD; one warm-up step first): per-rank MB, 256 MB model of
    8 blocks (32 MB each), batch 8; a QAT step within 10% of the float step
    glibc malloc defaults:
     N  variant                           peak per rank              vs float  ok   step  after
       kept
     2  float FSDP2                       400 / 390                      1.00  yes   100      1
         0
    """
    lines = [f"training step under FSDP2 (SGD; one warm-up step first): per-rank MB, "
             f"{r['model_mb']:.3g} MB model of {r['blocks']} blocks "
             f"({r['model_mb'] / r['blocks']:.3g} MB each), batch {r['batch']}; a QAT step "
             f"within 10% of the float step"]
    section: Any = ()

    def mb(value: float) -> str:
        return f"{round(value):d}"  # round(-0.2) is 0: RSS counters are exact to ~0.5 MB

    for row in r["rows"]:
        threshold = row.get("mmap_threshold")
        if threshold != section:
            section = threshold
            lines += ["glibc malloc defaults:" if threshold is None else
                      f"MALLOC_MMAP_THRESHOLD_={threshold} (freed tensors return to the OS: "
                      "the peak is what was live):",
                      f"{'N':>2}  {'variant':<32}  {'peak per rank':<25}  {'vs float':>8}  ok  "
                      f"{'step':>5}  {'after':>5}  {'kept':>4}"]
        ratio = row.get("vs_float")
        ok = "" if ratio is None else ("yes" if row["ok"] else "no")
        peaks = " / ".join(mb(v) for v in row["total_peak_mb"])
        lines.append(f"{row['world']:>2}  {TRAIN_VARIANTS[row['variant']]:<32}  {peaks:<25}  "
                     f"{'' if ratio is None else f'{ratio:.2f}':>8}  {ok:<3} "
                     f"{mb(max(row['peak_mb'])):>5}  {mb(max(row['after_mb'])):>5}  "
                     f"{mb(max(row['saved_mb'])):>4}")
    if r.get("note"):
        lines.append(r["note"])
    return "\n".join(lines)
