"""One rank of the 2-process ``qc.distributed.compile_once`` tests on exported Hugging Face
models (``test_compile_once_hf.py`` launches them; run as a script, never imported from
the tests folder)::

    python tests/dist/_compile_once_hf_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` in the environment. Each rank writes
``OUTDIR/rank<r>.json`` (``{case: result}``) after every case; the test asserts on those.

The models are ``qcompile.tools.architectures``' tiny families (transformers' own classes,
random weights, a pad token in the batch). The one-process reference is ``qc.qcompile`` of
the real model on the global batch (``GLOBAL`` rows); rank ``r`` compiles once under
FSDP2 (a safetensors checkpoint rank 0 wrote, or rank 0's stream) and runs rows
``[r * LOCAL, (r + 1) * LOCAL)``. Training: SGD on the token cross entropy summed over the
rank's unpadded positions, divided by the global count and multiplied by the world size
(FSDP2 averages gradients over the ranks), so every step's gradient is the global batch's
mean loss gradient, as one process computes it.
"""

from __future__ import annotations

import datetime
import gc
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _worker_main import cases_in, error_of, run_cases
from safetensors.torch import save_model
from torch import nn

import qcompile as qc
from qcompile.tools.architectures import ARCHITECTURES, Architecture

PG_TIMEOUT = datetime.timedelta(seconds=60)
OUTDIR = Path(".")
PRESETS = ("qlora-nf4", "int8-qat", "8da4w-qat", "nvfp4-qat")
GLOBAL = 4  # rows of the global batch (the first one padded)
# config overrides: dropout off (GPT-2 drops 10% by default), so that one process and the
# ranks compute the same training steps
CONFIG = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}
STEPS = 3
LR = 0.1


# -- data and specs -----------------------------------------------------------------------
def global_batch(arch: Architecture) -> dict[str, torch.Tensor]:
    return arch.batch(seed=1, batch=GLOBAL)


def rows_of(batch: dict[str, torch.Tensor]) -> slice:
    local = GLOBAL // dist.get_world_size()
    return slice(dist.get_rank() * local, (dist.get_rank() + 1) * local)


def local_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[rows_of(batch)] for k, v in batch.items()}


def spec_of(preset: str, kind: str = "fsdp2") -> dict[str, Any]:
    spec = qc.load_spec(preset).model_dump()
    spec["data_parallel"] = {"kind": kind}
    return spec


def logits_of(out: Any) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out.logits


def token_loss_sum(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross entropy summed over the unpadded positions (the architectures'
    ``loss`` is this over their count)."""
    ids = batch["input_ids"].clone()
    ids[batch["attention_mask"] == 0] = -100
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                       ids[:, 1:].reshape(-1), ignore_index=-100,
                                       reduction="sum")


def token_count(batch: dict[str, torch.Tensor]) -> int:
    ids = batch["input_ids"].clone()
    ids[batch["attention_mask"] == 0] = -100
    return int((ids[:, 1:] != -100).sum())


def checkpoint(arch: Architecture, name: str, **overrides: Any) -> Path:
    """Rank 0 writes the model to ``OUTDIR/name`` as ``save_pretrained`` does (safetensors'
    ``save_model``: a tensor tied under two names, Gemma's embeddings, saved once); every
    rank returns the path."""
    path = OUTDIR / name
    if dist.get_rank() == 0 and not path.exists():
        model = arch.build(**overrides)
        save_model(model, str(path))
        del model
    dist.barrier()
    return path


# -- comparing ------------------------------------------------------------------------------
def plain_name(name: str) -> str:
    return re.sub(r"^stage_\d+\.", "", name)


def gathered(gm: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict (every rank calls this: sharded tensors are all-gathered)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in gm.state_dict().items()}


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    common = sorted(set(got) & set(want))
    bad = [k for k in common if got[k].shape != want[k].shape or got[k].dtype != want[k].dtype
           or not torch.equal(got[k], want[k])]
    return {"missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)),
            "not_equal": bad, "compared": len(common)}


def gap(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Largest absolute difference, and the reference's largest magnitude."""
    return {"abs": (got.double() - want.double()).abs().max().item(),
            "scale": want.double().abs().max().item()}


def frozen_names(gm: nn.Module) -> list[str]:
    """State-dict names of the frozen bases' storage (codes, scales)."""
    from qcompile.runtime.frozen import FrozenWeight

    out = []
    for name, m in gm.named_modules():
        if isinstance(m, FrozenWeight):
            out += [f"{plain_name(name)}.{leaf}" for leaf, _ in m.named_parameters()]
    return sorted(out)


def buffer_slots(gm: nn.Module, model: nn.Module) -> dict[str, Any]:
    """Every slot of ``gm`` holding one of the model's buffers (one per block child that
    reads it): equal to the model's value, and one tensor however many slots."""
    want = dict(model.named_buffers())
    slots: dict[str, list[torch.Tensor]] = {}
    for name, b in gm.named_buffers(remove_duplicate=False):
        if plain_name(name) in want:
            slots.setdefault(plain_name(name), []).append(b)
    return {name: {"slots": len(held),
                   "equal": all(torch.equal(b.detach().cpu(), want[name]) for b in held),
                   "one_tensor": len({b.data_ptr() for b in held}) == 1}
            for name, held in sorted(slots.items())}


def meta_literals(gm: nn.Module) -> list[str]:
    """Nodes of the graphs that still name the meta device."""
    found = []
    for child_name, g in [("", gm), *gm.named_children()]:
        for node in getattr(getattr(g, "graph", None), "nodes", ()):
            for v in (*node.args, *node.kwargs.values()):
                if (isinstance(v, torch.device) and v.type == "meta") or (
                        isinstance(v, str) and v == "meta"):
                    found.append(f"{child_name}:{node.name}")
    return found


# -- one family, every preset -------------------------------------------------------------
def train(model: nn.Module, batch: dict[str, torch.Tensor], count: int,
          scale: float) -> list[float]:
    """``STEPS`` SGD steps; each step's loss over the global batch (all-reduced when
    ``scale`` is the world size)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS):
        total = token_loss_sum(logits_of(model(**batch)), batch)
        (total * scale / count).backward()
        opt.step()
        opt.zero_grad()
        seen = total.detach().clone()
        if scale != 1.0:
            dist.all_reduce(seen)
        losses.append(seen.item() / count)
    return losses


def trained_gaps(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                 names: list[str]) -> dict[str, float]:
    """Per trainable tensor: largest difference over the reference's largest magnitude."""
    return {n: (got[n].double() - want[n].double()).abs().max().item()
            / max(want[n].double().abs().max().item(), 1e-12) for n in names}


def family(name: str) -> dict[str, Any]:
    """Every preset, from the checkpoint and from rank 0's stream: the gathered state, the
    frozen bases' storage and this rank's logits against one process's ``qc.qcompile``
    of the same rows; the model's buffers in every block child; then ``STEPS`` training
    steps (from the checkpoint) against one process on the global batch."""
    arch = ARCHITECTURES[name]
    config = CONFIG.get(name, {})

    def build() -> nn.Module:
        return arch.build(**config)

    gb = global_batch(arch)
    lb = local_batch(gb)
    count = token_count(gb)
    path = checkpoint(arch, f"{name}.safetensors", **config)
    model = build()
    out: dict[str, Any] = {}
    for preset in PRESETS:
        # one process, compiled for this rank's rows (the graphs' shapes are static; an
        # activation's range depends on the rows it sees)
        ref = qc.qcompile(build(), preset, example_kwargs=lb)
        ref_state = gathered(ref)
        with torch.no_grad():
            ref_logits = logits_of(ref.eval()(**lb))
        got: dict[str, Any] = {"frozen": frozen_names(ref)}
        del ref
        for mode, ckpt in (("ckpt", path), ("stream", None)):
            gm = qc.distributed.compile_once(build, spec_of(preset), example_kwargs=lb,
                                             checkpoint=ckpt)
            state = gathered(gm)
            got[mode] = {"state": compare(state, ref_state), "buffers": buffer_slots(gm, model),
                         "meta_literals": meta_literals(gm),
                         "children": sorted(n for n, _ in gm.named_children())}
            if mode == "stream":  # an evaluation forward observes (and syncs) at once: the
                with torch.no_grad():  # graph trained below (from the checkpoint) has none
                    got[mode]["logits"] = gap(logits_of(gm.eval()(**lb)), ref_logits)
                    for q in qc.quantizers(gm).values():  # the same forward twice below
                        q.observe = False
                    before = logits_of(gm(**lb))
                    for g in (gm, *gm.children()):  # FSDP2 subclassed the graphs' classes
                        if isinstance(g, torch.fx.GraphModule):
                            g.recompile()
                    got[mode]["recompiled"] = gap(logits_of(gm(**lb)), before)
            if mode == "ckpt":  # trained on the global batch, split across the ranks
                losses = train(gm, lb, count, float(dist.get_world_size()))
                ref = qc.qcompile(build(), preset, example_kwargs=gb)
                trainable = sorted(n for n, p in ref.named_parameters() if p.requires_grad)
                got["ref_losses"] = train(ref, gb, count, 1.0)
                got["losses"], got["trainable"] = losses, len(trainable)
                got["trained"] = trained_gaps(gathered(gm), gathered(ref), trainable)
                del ref
            del gm
            gc.collect()
        out[preset] = got
    return out


def case_llama() -> dict[str, Any]:
    return family("llama")


def case_mixtral() -> dict[str, Any]:
    return family("mixtral")


# the other decoder families, one case each (QCOMPILE_SWEEP=1)
for _name in ("mistral", "qwen2", "qwen3", "qwen2_moe", "olmoe", "deepseek_v3", "gemma2",
              "gemma3", "phi3", "falcon", "gpt_neox", "bloom", "gpt2"):
    globals()[f"case_{_name}"] = (lambda n: lambda: family(n))(_name)


# -- what compile_once cannot give values: refused on every rank, by name ----------------
def build_derived() -> nn.Module:
    """Llama whose rotary table is computed from a parameter: on the meta device when
    the parameters are (compile_once builds them there)."""
    model = ARCHITECTURES["llama"].build()
    rotary = model.model.rotary_emb
    weight = model.model.norm.weight.detach()[:rotary.inv_freq.numel()]
    rotary.register_buffer("inv_freq", rotary.inv_freq.to(weight.device) * weight,
                           persistent=False)
    return model


def case_errors() -> dict[str, Any]:
    out: dict[str, Any] = {}
    llama = ARCHITECTURES["llama"]
    lb = local_batch(global_batch(llama))
    path = checkpoint(llama, "llama.safetensors")
    out["derived_ckpt"] = error_of(lambda: qc.distributed.compile_once(
        build_derived, spec_of("qlora-nf4"), example_kwargs=lb, checkpoint=path))
    dist.barrier()  # both ranks got here: nobody is stuck in a collective
    # without a checkpoint rank 0 streams its real model, which has the value
    gm = qc.distributed.compile_once(build_derived, spec_of("qlora-nf4"), example_kwargs=lb)
    out["derived_stream"] = buffer_slots(gm, build_derived())
    del gm
    # falcon's list indices: constants torch.export captures on meta, filled by name
    falcon = ARCHITECTURES["falcon"]
    fb = local_batch(global_batch(falcon))
    gm = qc.distributed.compile_once(falcon.build, spec_of("qlora-nf4"), example_kwargs=fb,
                                     checkpoint=checkpoint(falcon, "falcon.safetensors"))
    ref = qc.qcompile(falcon.build(), "qlora-nf4", example_kwargs=fb)
    with torch.no_grad():
        got, want = logits_of(gm(**fb)), logits_of(ref(**fb))
    out["falcon_ckpt"] = {"max_diff": float((got - want).abs().max()),
                          "constants": sorted(n for n, _ in gm.named_buffers()
                                              if "lifted_tensor" in n)}
    del gm
    dist.barrier()
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    out["all_reduce_after"] = t.item()
    return out


# -- memory: calibrating through the sharded graph at 1/N -----------------------------------
# By world size: 2 ranks, 8 layers 640 wide (vocab 4096): 170 MiB, every block child (a
# layer; the first and last also hold an embedding) under glibc's largest mmap threshold
# (32 MiB); 4 ranks, 896 wide: 322 MiB (a rank's shards and two blocks well above what
# the compiled graph itself holds, ~0.5 MB a layer)
MEM_CONFIGS = {2: dict(num_hidden_layers=8, hidden_size=640, intermediate_size=1920,
                       vocab_size=4096, num_attention_heads=8, num_key_value_heads=4),
               4: dict(num_hidden_layers=8, hidden_size=896, intermediate_size=2688,
                       vocab_size=4096, num_attention_heads=8, num_key_value_heads=4)}
MEM_BATCHES = 2


def rss_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) / 1024
    return out


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def case_memory() -> dict[str, Any]:
    """int8-static from a checkpoint, calibrated on ``MEM_BATCHES`` batches per rank
    through the sharded graph, glibc's malloc defaults: this rank's peak RSS over its RSS
    before the call. First a tiny Llama of the same depth (64 wide: KBs of weights) runs
    the same call, so that what a process loads or builds once for a graph of this shape
    (torch's modules and op caches, export's state: a few MB, whatever the weights) is in
    the baseline, as the other memory tests' warm-ups put it; memory freed before the
    call is handed back first, so the call cannot hide its growth in it."""
    from qcompile.runtime.calibration import return_freed_memory

    llama = ARCHITECTURES["llama"]
    spec = spec_of("int8-static")
    config = MEM_CONFIGS[dist.get_world_size()]
    warm_config = {**config, "hidden_size": 64, "intermediate_size": 128}
    batches = [local_batch(llama.batch(seed=10 + i, batch=GLOBAL)) for i in range(MEM_BATCHES)]
    example = local_batch(global_batch(llama))
    warm = qc.distributed.compile_once(lambda: llama.build(**warm_config), spec,
                                       example_kwargs=example, calibration=batches)
    del warm
    path = checkpoint(llama, "llama_mem.safetensors", **config)
    gc.collect()
    return_freed_memory()
    dist.barrier()
    measurable = reset_peak()
    before = rss_mb()["VmRSS"]
    gm = qc.distributed.compile_once(lambda: llama.build(**config), spec,
                                     example_kwargs=example, calibration=batches,
                                     checkpoint=path)
    peak = rss_mb()["VmHWM"] - before
    mib = 2 ** 20
    model_mb = sum(p.numel() * p.element_size() for p in gm.parameters()) / mib
    blocks = [sum(p.numel() * p.element_size() for p in c.parameters()) / mib
              for n, c in gm.named_children() if n.startswith("stage_")]
    local_mb = sum(p.to_local().numel() * p.element_size() for p in gm.parameters()) / mib
    return {"measurable": measurable, "peak_mb": peak, "model_mb": model_mb,
            "block_mb": max(blocks), "blocks": len(blocks), "local_param_mb": local_mb,
            "world": dist.get_world_size(),
            "calibrated": all(q.enabled and not q.observe for q in qc.quantizers(gm).values())}


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
