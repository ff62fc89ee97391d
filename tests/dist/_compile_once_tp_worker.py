"""One rank of the tests of ``compile_once`` under tensor parallelism
(``test_compile_once_tp.py``).

Run as a script, never imported from the tests folder::

    python tests/dist/_compile_once_tp_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` (2: tp 2; 4: dp 2 x tp 2) and ``QC_DIST_INIT`` in the
environment. Rank = dp_index * 2 + tp_index; the ranks of one tp group calibrate and train
on their replica's rows of the global batch. Rank 0 writes the checkpoints. Each rank
writes ``OUTDIR/rank<r>.json`` after every case.
"""

from __future__ import annotations

import datetime
import gc
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _tensor_parallel_worker import (
    LR,
    ROWS,
    TP,
    differences,
    digest,
    llama,
    lm_loss,
    mixtral,
    state_of,
    within,
)
from _worker_main import cases_in, error_of, run_cases

import qcompile as qc

PG_TIMEOUT = datetime.timedelta(seconds=60)
STEPS = 3
OUTDIR = Path(".")


def spec_of(preset: str, **extra: Any) -> Any:
    d = qc.load_spec(preset).model_dump()
    d["tensor_parallel"] = {"size": TP}
    d["data_parallel"] = {"kind": "fsdp2" if dist.get_world_size() > TP else "none"}
    d.update(extra)
    return qc.specs.as_spec(d)


def checkpoint(build: Any, name: str) -> Path:
    """``build()``'s state dict as one safetensors file, written by rank 0."""
    from safetensors.torch import save_model

    path = OUTDIR / name
    if dist.get_rank() == 0 and not path.exists():
        save_model(build(), str(path))  # a tied tensor (Gemma's embeddings) saved once
    dist.barrier()
    return path


def replica_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's replica's rows (both tp ranks of a replica hold the same)."""
    r = dist.get_rank() // TP
    return {k: v[r * ROWS:(r + 1) * ROWS] for k, v in batch.items()}


def batches(count: int = 2, batch_of: Any = None) -> list[dict[str, torch.Tensor]]:
    """Global calibration batches (every rank draws the same); ``batch_of(rows, seed)``:
    a family's batches (default: Llama's token ids)."""
    dp = dist.get_world_size() // TP
    if batch_of is not None:
        return [batch_of(ROWS * dp, 7 + i) for i in range(count)]
    g = torch.Generator().manual_seed(7)
    return [{"input_ids": torch.randint(0, 64, (ROWS * dp, 8), generator=g)}
            for _ in range(count)]


def plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """State names without the block children's ``stage_<i>.`` (one process's names)."""
    out = {}
    for k, v in state.items():
        head, _, rest = k.partition(".")
        out[rest if head.startswith("stage_") else k] = v
    return out


def trained(model: Any, batch: dict[str, torch.Tensor], loss_fn: Any = lm_loss,
            steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` SGD steps on ``batch``: the losses (the mean over replicas) and the state."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(**batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.is_initialized() and any(hasattr(p, "placements") for p in model.parameters()):
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / dist.get_world_size())
        else:
            losses.append(float(loss))
    return losses, plain(state_of(model))


def presets(preset: str, build: Any = llama, batch_of: Any = None,
            loss_fn: Any = lm_loss, **extra: Any) -> dict[str, Any]:
    """``compile_once`` from a checkpoint (calibrated on the replica's rows for a static
    preset) against one process (``qc.qcompile`` + ``qc.calibrate`` on the global
    batches): the state as loaded; then three steps on the ranks against three steps of
    the same spec compiled by ``qc.qcompile`` on every rank and wrapped (the same shards,
    so the same bits) and of one process."""
    spec = spec_of(preset, **extra)
    static = "static" in preset
    cal = batches(batch_of=batch_of)
    mine = [replica_rows(b) for b in cal]
    path = checkpoint(build, f"{getattr(build, 'name', build.__name__)}.safetensors")
    gm = qc.distributed.compile_once(build, spec, example_kwargs=mine[0],
                                     calibration=mine if static else None, checkpoint=path)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in gm.parameters())
    one = qc.specs.as_spec({**qc.load_spec(preset).model_dump(), **extra})
    ref = qc.qcompile(build(), one, example_kwargs=cal[0])
    if static:
        qc.calibrate(ref, cal)
    loaded = differences(plain(state_of(gm)), state_of(ref))
    # the same spec the usual way: every rank compiles the real model, wrap shards it
    usual = qc.qcompile(build(), spec, example_kwargs=mine[0])
    if static:  # calibrated like compile_once: every rank's rows, observers synced
        usual = qc.distributed.wrap(usual, spec)
        qc.calibrate(usual, mine)
    else:
        usual = qc.distributed.wrap(usual, spec)
    once_state = plain(state_of(gm))
    model = qc.distributed.wrap(gm, spec)  # compile_once's result as it is
    losses, got = trained(model, mine[0], loss_fn)
    usual_losses, usual_got = trained(usual, mine[0], loss_fn)
    ref_losses, want = trained(ref, cal[0], loss_fn)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(got))
    return {"loaded": max(loaded.values()), "loaded_worst": max(loaded, key=loaded.get),
            "names_equal": sorted(once_state) == sorted(state_of(ref)),
            "same_as_usual": digest(got) == digest(usual_got) and losses == usual_losses,
            "losses": losses, "ref_losses": ref_losses,
            "trained": max(differences(got, want).values()),
            "replicas_equal": len(set(digests)) == 1, "wrap_returns_it": model is gm,
            "local_parameters": local,
            "parameters": sum(p.numel() for p in ref.parameters())}


def case_int8_static() -> dict[str, Any]:
    return presets("int8-static")


def case_8da4w_qat() -> dict[str, Any]:
    return presets("8da4w-qat")


def case_nvfp4_qat() -> dict[str, Any]:
    return presets("nvfp4-qat")


def case_mixtral() -> dict[str, Any]:
    """Attention sharded across tp, the experts whole on every tp rank (FSDP2's rows over
    dp)."""
    return presets("8da4w-qat", mixtral)


def family(name: str) -> dict[str, Any]:
    """A decoder family of the architecture table (tiny config), 8da4w-qat: whatever the
    plan shards (or keeps whole), compile_once reads each rank's part and trains as the
    usual path does."""
    from qcompile.tools.architectures import ARCHITECTURES

    arch = ARCHITECTURES[name]
    # dropout off (GPT-2 drops 10% by default): one process and the ranks draw differently
    off = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if name == "gpt2" else {}

    def build() -> torch.nn.Module:
        return arch.build(seed=0, **off)

    build.name = name  # type: ignore[attr-defined]
    return presets("8da4w-qat", build, lambda rows, seed: arch.batch(seed=seed, batch=rows),
                   arch.loss)


FAMILIES = ("qwen3", "gemma2", "falcon", "gpt2", "olmoe", "phi3", "gpt_neox", "bloom")
for _name in FAMILIES:
    globals()[f"case_family_{_name}"] = lambda _name=_name: family(_name)


def case_qlora_nf4() -> dict[str, Any]:
    """QLoRA from a checkpoint: each rank quantizes only its part of each frozen base (its
    rows, or its block columns) into its shard of the storage; the result trains as
    ``qc.qcompile`` + ``wrap`` of the real model (the same bits)."""
    from _tensor_parallel_worker import llama_wide

    return presets("qlora-nf4", llama_wide)


FROZEN = [{"match": {"name": ["lm_head"]}, "skip": True},
          {"match": {"module": ["Linear"]}, "rank": 8, "alpha": 16}]


def case_frozen_int8() -> dict[str, Any]:
    """int8-qat's per-channel weights as frozen bases: a rowwise shard's rows take their
    range over every rank's columns."""
    from _tensor_parallel_worker import llama_wide

    return presets("int8-qat", llama_wide, adapters=FROZEN)


def case_frozen_nvfp4() -> dict[str, Any]:
    """NVFP4 frozen bases: the tensor scale from the whole weight's range."""
    from _tensor_parallel_worker import llama_wide

    return presets("nvfp4-qat", llama_wide, adapters=FROZEN)


def case_sources() -> dict[str, Any]:
    """int8-static three ways: from the checkpoint, from rank 0's stream (no checkpoint),
    and from the cache a first call filled: the same bits on every rank."""
    spec = spec_of("int8-static")
    mine = [replica_rows(b) for b in batches()]
    path = checkpoint(llama, "llama.safetensors")
    cache = OUTDIR / "cache"

    def state(**kw: Any) -> tuple[str, list[str]]:
        gm = qc.distributed.compile_once(llama, spec, example_kwargs=mine[0],
                                         calibration=mine, **kw)
        return digest(state_of(gm)), qc.report(gm).passes[-1].notes

    from_file, _ = state(checkpoint=path)
    streamed, _ = state()
    first, notes_first = state(checkpoint=path, cache_dir=str(cache))
    second, notes_second = state(checkpoint=path, cache_dir=str(cache))
    return {"stream_equal": streamed == from_file, "cache_equal": first == second == from_file,
            "notes": [n for n in notes_first + notes_second if "cache" in n]}


def case_mistakes() -> dict[str, Any]:
    """Refused on every rank with the fix, before anything hangs."""
    ids = replica_rows(batches()[0])
    path = checkpoint(llama, "llama.safetensors")
    out = {}
    # the ranks of a tp group calibrating on different batches
    theirs = [{"input_ids": ids["input_ids"] + (dist.get_rank() % TP)}]
    out["batches_differ"] = error_of(lambda: qc.distributed.compile_once(
        llama, spec_of("int8-static"), example_kwargs=ids, calibration=theirs,
        checkpoint=path))
    out["pipeline"] = error_of(lambda: qc.distributed.compile_once(
        llama, spec_of("int8-static", pipeline={"stages": 2}), example_kwargs=ids,
        checkpoint=path))
    # a mixture sliced within each expert (3 experts at tp 2): two ranges of the fused
    # gate/up rows a rank, not one box of the checkpoint's tensor
    out["experts_within"] = error_of(lambda: qc.distributed.compile_once(
        within, spec_of("8da4w-qat"), example_kwargs=ids,
        checkpoint=checkpoint(within, "within.safetensors")))
    t = torch.ones(1)
    dist.all_reduce(t)
    out["all_reduce_after"] = float(t)
    return out


# -- memory: compile, load and calibrate at 1/(tp x dp) ----------------------------------------
MEM_CONFIG = dict(num_hidden_layers=8, hidden_size=896, intermediate_size=2688,
                  vocab_size=4096, num_attention_heads=8, num_key_value_heads=4)


def case_memory() -> dict[str, Any]:
    """int8-static from a checkpoint, calibrated on two batches, glibc's malloc defaults:
    this rank's peak RSS over its RSS before the call (after a warm-up on a 64-wide model
    of the same depth, as the other memory tests do), against the model's bytes."""
    from _compile_once_hf_worker import reset_peak, rss_mb
    from transformers import LlamaConfig, LlamaForCausalLM

    from qcompile.runtime.calibration import return_freed_memory

    def build(**over: Any) -> torch.nn.Module:
        cfg = LlamaConfig(**{**MEM_CONFIG, **over}, use_cache=False, tie_word_embeddings=False)
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)

    spec = spec_of("int8-static")
    mine = [replica_rows(b) for b in batches()]
    warm = qc.distributed.compile_once(lambda: build(hidden_size=64, intermediate_size=128),
                                       spec, example_kwargs=mine[0], calibration=mine)
    del warm
    path = checkpoint(build, "llama_mem.safetensors")
    gc.collect()
    return_freed_memory()
    dist.barrier()
    measurable = reset_peak()
    before = rss_mb()["VmRSS"]
    gm = qc.distributed.compile_once(build, spec, example_kwargs=mine[0], calibration=mine,
                                     checkpoint=path)
    peak = rss_mb()["VmHWM"] - before
    mib = 2 ** 20

    def local_mb(m: torch.nn.Module) -> float:
        return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                   for p in m.parameters()) / mib

    model_mb = sum(p.numel() * p.element_size() for p in gm.parameters()) / mib
    with torch.device("meta"):  # the first block (embedding + layer 0): the largest
        m = build()
    block_mb = sum(p.numel() * p.element_size() for p in (
        *m.model.embed_tokens.parameters(), *m.model.layers[0].parameters())) / mib
    return {"measurable": measurable, "peak_mb": peak, "model_mb": model_mb,
            "block_mb": block_mb, "local_param_mb": local_mb(gm),
            "calibrated": all(q.enabled and not q.observe
                              for q in qc.quantizers(gm).values())}


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
