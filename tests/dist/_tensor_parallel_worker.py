"""One rank of the tensor-parallel tests (``test_tensor_parallel.py``).

Run as a script, never imported from the tests folder::

    python tests/dist/_tensor_parallel_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` (2: tp 2; 4: dp 2 x tp 2) and ``QC_DIST_INIT`` in the
environment. Rank = dp_index * 2 + tp_index (tp innermost); each dp replica trains on its
rows of the global batch, both tp ranks of a replica on the same rows. Every rank also
trains one process's graph on the whole global batch, the reference. Each rank writes
``OUTDIR/rank<r>.json`` after every case.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from _worker_main import cases_in, error_of, run_cases

import qcompile as qc

PG_TIMEOUT = datetime.timedelta(seconds=60)
TP = 2
ROWS, SEQ, VOCAB = 2, 8, 64  # rows per replica
STEPS, LR = 5, 0.1
OUTDIR = Path(".")


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def mixtral(idle_rank: bool = False, experts: int = 4) -> torch.nn.Module:
    """A 2-layer Mixtral (4 experts, top 2: sharded by expert at tp 2; 3 experts: within
    each expert). ``idle_rank``: layer 0's router reads zeros (its norm's weight zeroed),
    so every token ties and goes to the same two experts: at tp 2, one rank's experts get
    no token in that layer."""
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    if idle_rank:
        with torch.no_grad():
            model.model.layers[0].post_attention_layernorm.weight.zero_()
    return model


def spec_of(preset: str, dp: int, plan: Any = "auto") -> Any:
    d = qc.load_spec(preset).model_dump()
    d["tensor_parallel"] = {"size": TP, "plan": plan}
    d["data_parallel"] = {"kind": "fsdp2" if dp > 1 else "none"}
    return qc.specs.as_spec(d)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_of(model: Any) -> dict[str, torch.Tensor]:
    # quantizers' pending statistics (_extra_state) are the step's partial ones until the
    # next forward reduces them: not compared
    return {k: whole(v).detach() for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")}


def differences(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: max |got - ref| / max |ref| (floating point), 0/1 for integers."""
    out = {}
    for k, r in ref.items():
        g = got[k]
        if not r.is_floating_point():
            out[k] = float(not torch.equal(g, r))
            continue
        scale = float(r.abs().max()) or 1.0
        out[k] = float((g.float() - r.float()).abs().max()) / scale
    return out


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def lm_batch(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=g)}


def lm_loss(out: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
    ids = batch["input_ids"]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1])
                                             .float(), ids[:, 1:].reshape(-1))


def train(preset: str, build: Any = llama, batch_of: Any = lm_batch, loss_fn: Any = lm_loss,
          steps: int = STEPS, plan: Any = "auto") -> dict[str, Any]:
    """``steps`` SGD steps on one global batch (the loss must fall): one process's graph on
    all of it, the ranks' sharded graph on their replica's rows."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // TP
    spec = spec_of(preset, dp, plan)
    batch = batch_of(ROWS * dp)
    rows = slice((rank // TP) * ROWS, (rank // TP + 1) * ROWS)
    mine = {k: v[rows] for k, v in batch.items()}
    m = build()
    ref = qc.qcompile(m, spec, example_kwargs=batch)
    gm = qc.qcompile(m, spec, example_kwargs=mine)
    plan = {r.layer: r.style for r in qc.report(gm).tensor_parallel}
    model = qc.distributed.wrap(gm, spec)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in model.parameters())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, ref_losses, first = [], [], None
    for step in range(steps):
        r = loss_fn(ref(**batch), batch)
        r.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ref_losses.append(float(r))
        loss = loss_fn(model(**mine), mine)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the mean over the replicas (each tp rank has it once)
        losses.append(float(total) / world)
        if step == 0:
            first = differences(state_of(model), state_of(ref))
    got = state_of(model)
    digests = [None] * world
    dist.all_gather_object(digests, digest(got))
    # quantizer state: a colwise layer's per-row qparams are its rows only, as its weight
    held = sum(b.numel() for q in qc.quantizers(model).values() for b in q.buffers())
    whole = sum(b.numel() for q in qc.quantizers(ref).values() for b in q.buffers())
    # one process's whole state loaded through torch's full-state-dict API: every rank
    # keeps its part, and reads back one process's state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, ref.state_dict(),
                         options=StateDictOptions(full_state_dict=True))
    return {"plan": plan, "losses": losses, "ref_losses": ref_losses,
            "first": max(first.values()), "first_worst": max(first, key=first.get),
            "trained": differences(got, state_of(ref)), "replicas_equal":
            len(set(digests)) == 1, "local_parameters": local,
            "parameters": sum(p.numel() for p in ref.parameters()),
            "quantizer_state": held / whole,
            "loaded_back": digest(state_of(model)) == digest(state_of(ref))}


def family(name: str, plan: Any = "auto", **config: Any) -> dict[str, Any]:
    """A decoder family of the architecture table (tiny config, with ``config``'s
    changes), 8da4w-qat, three steps: whatever the plan shards, the ranks train as one
    process."""
    from qcompile.tools.architectures import ARCHITECTURES

    arch = ARCHITECTURES[name]
    # dropout off (GPT-2 drops 10% by default): one process and the ranks draw differently
    off = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if name == "gpt2" else {}
    return train("8da4w-qat", lambda: arch.build(seed=0, **off, **config),
                 lambda rows: arch.batch(seed=1, batch=rows), arch.loss, steps=3, plan=plan)


def case_int8_qat() -> dict[str, Any]:
    return train("int8-qat")


def case_8da4w_qat() -> dict[str, Any]:
    return train("8da4w-qat")


def case_nvfp4_qat() -> dict[str, Any]:
    return train("nvfp4-qat")


FAMILIES = ("mistral", "qwen2", "qwen3", "qwen2_moe", "olmoe", "gemma2", "phi3", "falcon",
            "gpt_neox", "bloom", "gpt2", "deepseek_v3")
for _name in FAMILIES:
    globals()[f"case_family_{_name}"] = lambda _name=_name: family(_name)
# 3 experts at tp 2: each expert sliced (its gate/up rows, its down input features)
for _name in ("qwen2_moe", "olmoe"):
    globals()[f"case_family_{_name}_within"] = lambda _name=_name: family(_name,
                                                                          num_experts=3)
# the layers as auto plans them, the norms named sequence (each family's norm names)
SEQUENCE_NORMS = {"qwen2": ["*layernorm", "model.norm"],
                  "gpt_neox": ["*layernorm", "gpt_neox.final_layer_norm"],
                  # its embedding tied to the LM head, both kept whole: the first norm's
                  # tokens cut from it, the LM head reading them all-gathered
                  "gemma2": ["*layernorm", "model.norm"]}
for _name, _norms in SEQUENCE_NORMS.items():
    globals()[f"case_family_{_name}_sequence"] = lambda _name=_name, _norms=_norms: family(
        _name, dict.fromkeys(_norms, "sequence"))


def case_mixtral_8da4w_qat() -> dict[str, Any]:
    """Attention sharded, the experts by expert (two of four per rank); the router whole
    on every rank."""
    return train("8da4w-qat", mixtral)


def case_mixtral_int8_qat() -> dict[str, Any]:
    """As above with int8-qat (the gate/up output's per-tensor quantizer between the
    experts' matmuls observes each rank's rows, reduced across tp), and one rank's
    experts idle in layer 0 (``mixtral(idle_rank=True)``): it still makes every
    reduction the other makes, with nothing of its own."""
    return train("int8-qat", lambda: mixtral(idle_rank=True))


def within(idle_rank: bool = False) -> torch.nn.Module:
    """The Mixtral with 3 experts: 2 ranks do not split them, so each expert is sliced
    (its gate and up rows, its down input features)."""
    return mixtral(idle_rank, experts=3)


def case_mixtral_within_8da4w_qat() -> dict[str, Any]:
    return train("8da4w-qat", within)


def case_mixtral_within_int8_qat() -> dict[str, Any]:
    return train("int8-qat", within)


def case_mixtral_within_nvfp4_qat() -> dict[str, Any]:
    return train("nvfp4-qat", within)


def case_mixtral_within_resume() -> dict[str, Any]:
    """tp 2, 3 experts sliced within each expert: two AdamW steps, torch's full state
    dicts of the model and the optimizer (the sharded checkpoint cannot hold the fused
    gate/up rows, two ranges a rank), a fresh graph loaded from them and two more steps:
    the state of four uninterrupted steps, bit for bit."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_state_dict,
    )

    spec = spec_of("8da4w-qat", 1)
    batch = lm_batch(ROWS)

    def fresh() -> tuple[Any, Any]:
        m = qc.distributed.wrap(qc.qcompile(within(), spec, example_kwargs=batch), spec)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def steps(m: Any, opt: Any, n: int) -> None:
        for _ in range(n):
            lm_loss(m(**batch), batch).backward()
            opt.step()
            opt.zero_grad()

    whole = StateDictOptions(full_state_dict=True)
    a, opt_a = fresh()
    steps(a, opt_a, 4)
    b, opt_b = fresh()
    steps(b, opt_b, 2)
    model_sd = get_model_state_dict(b, options=whole)
    optim_sd = qc.distributed.optimizer_state_dict(b, opt_b, options=whole)
    c, opt_c = fresh()
    set_state_dict(c, opt_c, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=whole)
    steps(c, opt_c, 2)
    return {"resumed_equal": digest(state_of(a)) == digest(state_of(c)),
            "moved": digest(state_of(a)) != digest(state_of(b))}


def case_ddp_refused() -> dict[str, Any]:
    d = spec_of("8da4w-qat", 1).model_dump()
    d["data_parallel"] = {"kind": "ddp"}
    spec = qc.specs.as_spec(d)
    gm = qc.qcompile(llama(), spec, example_kwargs={"input_ids": torch.zeros(ROWS, SEQ,
                                                                             dtype=torch.long)})
    return error_of(lambda: qc.distributed.wrap(gm, spec))


def case_onnx_refused() -> dict[str, Any]:
    """qc.export_onnx of a sharded graph: refused with the gather recipe."""
    spec = spec_of("int8-qat", dist.get_world_size() // TP)
    ids = torch.zeros(ROWS, SEQ, dtype=torch.long)
    model = qc.distributed.wrap(qc.qcompile(llama(), spec, example_kwargs={"input_ids": ids}),
                                spec)
    return {"onnx": error_of(lambda: qc.export_onnx(
        model, "never-written.onnx", example_kwargs={"input_ids": ids}))}


CONVERT_STEPS = 3


def logits_of(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)


def converted(preset: str, plan: Any = "auto", build: Any = llama) -> dict[str, Any]:
    """Three QAT steps on the ranks, ``qc.freeze``, then ``qc.convert`` on every rank.
    Against the trained graph (its outputs), and against one process's graph loaded with
    the ranks' full state: each sharded layer's stored shards, gathered, dequantize to one
    process's fake-quantized weight; the converted outputs equal one process's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from qcompile.runtime.frozen import FrozenWeight
    from qcompile.runtime.sharded import ShardedStoredLinear, StoredRows

    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // TP
    spec = spec_of(preset, dp, plan)
    batch = lm_batch(ROWS * dp)
    mine = {k: v[(rank // TP) * ROWS:(rank // TP + 1) * ROWS] for k, v in batch.items()}
    model = qc.distributed.wrap(qc.qcompile(build(), spec, example_kwargs=mine), spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(CONVERT_STEPS):
        lm_loss(model(**mine), mine).backward()
        opt.step()
        opt.zero_grad()
    qc.freeze(model).eval()
    with torch.no_grad():
        trained = logits_of(model(**mine))
    out = qc.convert(model, (mine["input_ids"],))
    with torch.no_grad():
        got = logits_of(out(**mine))
    # one process: the ranks' whole state (sharded weights and colwise qparams gathered)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    one = {**spec.model_dump(), "tensor_parallel": None, "data_parallel": {"kind": "none"}}
    ref = qc.qcompile(build(), qc.specs.as_spec(one), example_kwargs=mine)
    ref.load_state_dict(full)
    qc.freeze(ref).eval()
    with torch.no_grad():
        ref_logits = logits_of(ref(**mine))
    weights, stored, local, whole_bytes = {}, {}, 0, 0
    for name, layer in out.named_modules():
        if not isinstance(layer, (ShardedStoredLinear, StoredRows)):
            continue
        fw = layer.weight_frozen
        parts = {k: t.full_tensor() for k, t in fw.named_parameters()}
        local += sum(t.to_local().numel() * t.element_size() for t in fw.parameters())
        whole_bytes += sum(t.numel() * t.element_size() for t in parts.values())
        whole = FrozenWeight(parts, shape=(fw.rows, fw.cols), dtype=fw.out_dtype, fmt=fw.fmt,
                             block=fw.block, packed=fw.packed, offset=fw.offset)
        at = re.sub(r"^stage_\d+\.", "", name)  # (under FSDP2 the graph is in blocks)
        if isinstance(layer, StoredRows):  # a mixture's experts, as rows (or columns)
            at = at.removesuffix("_stored")
            w = ref.get_parameter(at).reshape(fw.rows, fw.cols)
            quantizer = f"{at}_fake_quant"
            style = "columns" if fw.codes.placements[-1].dim == 1 else "rows"
        else:
            w = ref.get_parameter(f"{at}.weight")
            quantizer = f"{at}.weight_fake_quant"
            style = "colwise" if fw.codes.placements[-1].is_shard(0) else "rowwise"
        with torch.no_grad():
            expect = ref.get_submodule(quantizer)(w)
        weights[at] = float((whole.dequantize() - expect).abs().max() / expect.abs().max())
        stored[at] = style
    strided = any(type(pl).__name__ == "_StridedShard" for t in out.parameters()
                  for pl in getattr(t, "placements", ()))
    reloaded = reload_state(out, mine, got) if strided else reload_stored(out, mine, got)
    rep = qc.report(out)
    scale = float(trained.abs().max())
    return {"plan": {r.layer: r.style for r in qc.report(model).tensor_parallel},
            "stored": stored, "weights": weights, "reloaded": reloaded,
            "vs_trained": float((got - trained).abs().max()) / scale,
            "vs_one_process": float((got - ref_logits).abs().max()) / scale,
            "max_deviation": rep.max_deviation.get("output0"),
            "records": sorted({r.op for r in rep.conversions if "shard" in r.op}),
            "local_bytes": local, "whole_bytes": whole_bytes,
            "float_bytes": sum(p.numel() * p.element_size() for n, p in ref.named_parameters()
                               if n in stored or n.rpartition(".")[0] in stored)}


def reload_stored(out: Any, batch: dict[str, torch.Tensor], want: torch.Tensor) -> bool:
    """The converted graph saved with torch.distributed.checkpoint (each rank its shards),
    its stored codes wiped, then loaded back: it computes ``want`` again."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    folder = [tempfile.mkdtemp(prefix="qc-tp-convert-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    dcp.save(out.state_dict(), checkpoint_id=folder[0])
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.endswith("weight_frozen.codes"):
                p.to_local().zero_()
    state = out.state_dict()
    dcp.load(state, checkpoint_id=folder[0])
    out.load_state_dict(state)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
    with torch.no_grad():
        return bool(torch.equal(logits_of(out(**batch)), want))


def reload_state(out: Any, batch: dict[str, torch.Tensor], want: torch.Tensor) -> bool:
    """The converted graph's state dict copied, its stored codes wiped, the copy loaded
    back: it computes ``want`` again. (For a mixture sliced within each expert: each rank
    holds two ranges of the gate/up rows, which torch.distributed.checkpoint, one box of
    a tensor a rank, does not write.)"""
    state = {k: v.detach().clone() for k, v in out.state_dict().items()}
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.endswith("weight_frozen.codes"):
                p.to_local().zero_()
    out.load_state_dict(state)
    with torch.no_grad():
        return bool(torch.equal(logits_of(out(**batch)), want))


def case_convert_int8_qat() -> dict[str, Any]:
    return converted("int8-qat")


def case_convert_8da4w_qat() -> dict[str, Any]:
    return converted("8da4w-qat")


def case_convert_nvfp4_qat() -> dict[str, Any]:
    return converted("nvfp4-qat")


def case_convert_mixtral_int8_qat() -> dict[str, Any]:
    """A mixture sharded by expert: each rank stores its experts' rows."""
    return converted("int8-qat", build=mixtral)


def case_convert_mixtral_8da4w_qat() -> dict[str, Any]:
    return converted("8da4w-qat", build=mixtral)


def case_convert_mixtral_within_8da4w_qat() -> dict[str, Any]:
    """A mixture sliced within each expert: each rank stores every expert's gate/up rows
    of its slice (two ranges each) and down's columns of it."""
    return converted("8da4w-qat", build=within)


def case_convert_mixtral_within_nvfp4_qat() -> dict[str, Any]:
    return converted("nvfp4-qat", build=within)


def case_convert_sequence() -> dict[str, Any]:
    """Under sequence parallelism: the identities that gather each rank's tokens stay."""
    return converted("8da4w-qat", SEQUENCE_PLAN)


BLOCKS = [{"modules": ["model.embed_tokens", "model.rotary_emb", "model.layers.0",
                       "model.layers.0.*"]},
          {"modules": ["model.layers.1", "model.layers.1.*", "model.norm", "lm_head"]}]


def pipelined(preset: str, build: Any = llama) -> dict[str, Any]:
    """pp 2 x tp 2 (4 ranks): two stages of whole blocks, each sharded across its two tp
    ranks (a Mixtral's experts by expert); GPipe, 2 micro-batches; three SGD steps against
    one process on the batch."""
    d = qc.load_spec(preset).model_dump()
    d["tensor_parallel"] = {"size": TP}
    d["pipeline"] = {"stages": BLOCKS, "microbatches": 2, "schedule": "gpipe"}
    spec = qc.specs.as_spec(d)
    batch = lm_batch(2 * ROWS)["input_ids"]
    gm = qc.qcompile(build(), spec, example_kwargs={"input_ids": batch[:ROWS]})
    ref = qc.qcompile(build(), qc.load_spec(preset), example_kwargs={"input_ids": batch})
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=lambda out, ids: lm_loss(
        out, {"input_ids": ids}))
    opt = torch.optim.SGD(stage.submod.parameters(), lr=LR)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    losses, ref_losses = [], []
    for _ in range(3):
        got: list = []
        schedule.step(input_ids=batch, target=batch, losses=got)
        opt.step()
        opt.zero_grad()
        r = lm_loss(ref(input_ids=batch), {"input_ids": batch})
        r.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ref_losses.append(float(r))
        if got:  # the last stage's ranks: the micro-batches' mean
            losses.append(sum(float(v) for v in got) / len(got))
    mine = state_of(stage.submod)
    whole = state_of(ref)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(mine))
    rank = dist.get_rank()
    return {"convert": error_of(lambda: qc.convert(gm)),
            "convert_stage": error_of(lambda: qc.convert(stage.submod)),
            "losses": losses, "ref_losses": ref_losses if losses else [],
            "trained": differences(mine, {k: whole[k] for k in mine}),
            "tp_equal": digests[rank] == digests[rank ^ 1],  # the other tp rank of my stage
            "local": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                         for p in stage.submod.parameters())}


def case_pp_int8_qat() -> dict[str, Any]:
    return pipelined("int8-qat")


def case_pp_8da4w_qat() -> dict[str, Any]:
    return pipelined("8da4w-qat")


def case_pp_nvfp4_qat() -> dict[str, Any]:
    return pipelined("nvfp4-qat")


def case_pp_mixtral_8da4w_qat() -> dict[str, Any]:
    return pipelined("8da4w-qat", mixtral)


def case_pp_mixtral_within_8da4w_qat() -> dict[str, Any]:
    return pipelined("8da4w-qat", within)


def case_pp_cut_in_a_block() -> dict[str, Any]:
    """A stage boundary between q/k/v and o_proj: refused on every rank by name."""
    d = qc.load_spec("8da4w-qat").model_dump()
    d["tensor_parallel"] = {"size": TP}
    attn = "model.layers.0.self_attn"
    d["pipeline"] = {"stages": [
        {"modules": ["model.embed_tokens", "model.rotary_emb", "model.layers.0.input_layernorm",
                     f"{attn}.q_proj", f"{attn}.q_proj.*", f"{attn}.k_proj", f"{attn}.k_proj.*",
                     f"{attn}.v_proj", f"{attn}.v_proj.*"]},
        {"modules": ["model.layers.0", "model.layers.0.*", "model.layers.1",
                     "model.layers.1.*", "model.norm", "lm_head"]}], "microbatches": 2}
    spec = qc.specs.as_spec(d)
    gm = qc.qcompile(llama(), spec, example_kwargs={"input_ids": lm_batch(ROWS)["input_ids"]})
    return error_of(lambda: qc.distributed.pipeline(gm, spec, loss_fn=lm_loss))


def case_plan_differs() -> dict[str, Any]:
    """Rank 1 wraps with another plan: the same clear error on every rank, no hang."""
    dp = dist.get_world_size() // TP
    spec = spec_of("8da4w-qat", dp)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ))
    gm = qc.qcompile(llama(), spec, example_kwargs={"input_ids": ids})
    if dist.get_rank() == 1:
        spec = spec_of("8da4w-qat", dp, plan={"*.q_proj": "colwise", "*.k_proj": "colwise",
                                              "*.v_proj": "colwise", "*.o_proj": "rowwise"})
    return error_of(lambda: qc.distributed.wrap(gm, spec))


def saved_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd keeps from a training forward of ``model``, parameters aside (they
    are held anyway): each storage once, a DTensor's local one."""
    held = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
            for p in model.parameters()}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            storage = local.untyped_storage()
            key = storage.data_ptr()
        except RuntimeError:  # no storage of its own (a fake or meta tensor)
            return t
        if key not in held:
            held.add(key)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(**batch), batch)
    loss.backward()
    return total[0]


def case_saved_tensors() -> dict[str, Any]:
    """What a sharded training forward keeps for its backward, against the float model
    sharded alike (quant mode none): a weight shard's fake-quantized copy, or a frozen
    base's dequantized shard, is computed again in backward, not kept."""
    dp = dist.get_world_size() // TP
    batch = lm_batch(ROWS)
    out = {}
    for preset in ("float", "int8-qat", "8da4w-qat", "qlora-nf4"):
        d = {"quant": {"mode": "none"}} if preset == "float" else \
            qc.load_spec(preset).model_dump()
        d["tensor_parallel"] = {"size": TP}
        d["data_parallel"] = {"kind": "fsdp2" if dp > 1 else "none"}
        gm = qc.qcompile(llama_wide(), d, example_kwargs=batch)
        model = qc.distributed.wrap(gm, d)
        saved_bytes(model, batch)  # the first step observes; the second is the steady one
        out[preset] = saved_bytes(model, batch)
        out[f"{preset}_weights"] = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
            for p in model.parameters())
    return out


# torchtitan's Llama plan by layer name, the norms between the blocks sequence-parallel
SEQUENCE_PLAN = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
                 "*.o_proj": "rowwise", "*.gate_proj": "colwise", "*.up_proj": "colwise",
                 "*.down_proj": "rowwise", "model.embed_tokens": "rowwise",
                 "lm_head": "colwise", "*.input_layernorm": "sequence",
                 "*.post_attention_layernorm": "sequence", "model.norm": "sequence"}


def sequence(preset: str) -> dict[str, Any]:
    """Sequence parallelism: the norms and the residual stream on each rank's tokens. Five
    steps against one process, and what a training forward keeps, next to the same plan
    with the norms whole on every rank."""
    out = train(preset, plan=SEQUENCE_PLAN)
    dp = dist.get_world_size() // TP
    batch = lm_batch(ROWS)
    whole = {k: v for k, v in SEQUENCE_PLAN.items() if v != "sequence"}
    for name, plan in (("saved_sequence", SEQUENCE_PLAN), ("saved_whole", whole)):
        spec = spec_of(preset, dp, plan)
        model = qc.distributed.wrap(qc.qcompile(llama(), spec, example_kwargs=batch), spec)
        saved_bytes(model, batch)  # the first step observes; the second is the steady one
        out[name] = saved_bytes(model, batch)
    return out


def case_sequence_int8_qat() -> dict[str, Any]:
    return sequence("int8-qat")


def case_sequence_8da4w_qat() -> dict[str, Any]:
    return sequence("8da4w-qat")


def case_sequence_nvfp4_qat() -> dict[str, Any]:
    return sequence("nvfp4-qat")


# -- adapters: LoRA on a frozen NF4 base (QLoRA) and on a QAT base -----------------------------
def llama_wide() -> torch.nn.Module:
    """Llama with 128 features: o_proj's and down_proj's inputs split in two hold whole
    NF4 blocks of 64."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def lora_spec(preset: str, dp: int) -> Any:
    d = qc.load_spec(preset).model_dump()
    if preset != "qlora-nf4":  # LoRA on the preset's QAT base (torchao's QAT + LoRA)
        d["adapters"] = [{"match": {"name": ["lm_head"]}, "skip": True},
                         {"match": {"module": ["Linear"]}, "rank": 8, "alpha": 16,
                          "base": "qat"}]
    d["tensor_parallel"] = {"size": TP}
    d["data_parallel"] = {"kind": "fsdp2" if dp > 1 else "none"}
    return qc.specs.as_spec(d)


def adapters(preset: str) -> dict[str, Any]:
    """Three SGD steps of the adapters on the ranks (the base frozen, sharded as its layer)
    against one process on the global batch; then ``qc.save_adapters`` from the ranks, and
    (rank 0) peft's model on the float weights the ranks trained against, loading it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // TP
    spec = lora_spec(preset, dp)
    one = qc.specs.as_spec({**spec.model_dump(), "tensor_parallel": None,
                            "data_parallel": {"kind": "none"}})
    batch = lm_batch(ROWS * dp)
    rows = slice((rank // TP) * ROWS, (rank // TP + 1) * ROWS)
    mine = {k: v[rows] for k, v in batch.items()}
    gm = qc.qcompile(llama_wide(), spec, example_kwargs=mine)
    ref = qc.qcompile(llama_wide(), one, example_kwargs=batch)
    plan = {r.layer: r.style for r in qc.report(gm).tensor_parallel}
    model = qc.distributed.wrap(gm, spec)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    losses, ref_losses = [], []
    for _ in range(3):
        loss = lm_loss(model(**mine), mine)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        r = lm_loss(ref(**batch), batch)
        r.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ref_losses.append(float(r))
    lora = {k: v for k, v in state_of(model).items() if ".lora_" in k}
    lora = {(k.partition(".")[2] if k.startswith("stage_") else k): v for k, v in lora.items()}
    want = {k: v for k, v in state_of(ref).items() if ".lora_" in k}
    folder = OUTDIR / f"adapter_{preset}_{world}"
    qc.save_adapters(model, str(folder))
    probe = batch["input_ids"][:ROWS]
    with torch.no_grad():
        ours = model(input_ids=probe).logits  # every rank: the LM head's logits gathered
    out = {"plan": plan, "losses": losses, "ref_losses": ref_losses,
           "lora_names_equal": sorted(lora) == sorted(want),
           "trained": max(differences(lora, want).values()),
           "local_bytes": sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                              * p.element_size() for p in model.parameters()),
           "bytes": sum(p.numel() * p.element_size() for p in ref.parameters())}
    if rank == 0:  # the file against one process's, and peft loading it
        from peft import PeftModel
        from safetensors.torch import load_file

        from qcompile.graph.meta import ADAPTERS_KEY

        qc.save_adapters(ref, str(folder) + "_one")
        mine_t = load_file(str(folder / "adapter_model.safetensors"))
        one_t = load_file(str(folder) + "_one/adapter_model.safetensors")
        out["file_names_equal"] = sorted(mine_t) == sorted(one_t)
        out["file_gap"] = max(differences(mine_t, one_t).values())
        if preset == "qlora-nf4":  # weight-only: peft on the NF4 values is the model
            base = llama_wide()
            with torch.no_grad():  # the weights the ranks trained against (the same codes)
                for layer, rec in ref.meta[ADAPTERS_KEY].items():
                    base.get_submodule(layer).weight.copy_(ref.get_submodule(rec.storage)())
                theirs = PeftModel.from_pretrained(base, str(folder)).eval()(
                    input_ids=probe).logits
            out["peft_gap"] = float((theirs - ours).abs().max())
            out["peft_scale"] = float(ours.abs().max())
    return out


def case_qlora_nf4() -> dict[str, Any]:
    return adapters("qlora-nf4")


def case_lora_8da4w_qat() -> dict[str, Any]:
    return adapters("8da4w-qat")


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
