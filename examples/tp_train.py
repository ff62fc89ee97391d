"""QAT of a Llama-style model with tensor parallelism (and data parallelism across nodes).

    torchrun --standalone --nproc_per_node=2 examples/tp_train.py                    # tp 2
    torchrun --standalone --nproc_per_node=4 examples/tp_train.py                    # dp 2 x tp 2

Quantized once, each rank reading only its share of each weight from a safetensors
checkpoint (rank 0 saves the float model first, standing in for one you already have):

    torchrun --standalone --nproc_per_node=4 examples/tp_train.py --once

A Mixtral-style mixture of experts instead (4 experts, top 2): each rank holds two of
each layer's experts, and computes the tokens routed to them:

    torchrun --standalone --nproc_per_node=2 examples/tp_train.py --moe

Three experts do not split over 2 ranks: each rank then holds every expert's share of
its gate and up rows and of its down input features (sliced within each expert), and
computes every routed token on it:

    torchrun --standalone --nproc_per_node=2 examples/tp_train.py --moe --experts 3

Sequence parallelism: an explicit plan, torchtitan's, naming the norms ``sequence``, so the
norms and the residual stream run on each rank's tokens:

    torchrun --standalone --nproc_per_node=2 examples/tp_train.py --sequence

Then integer weights for inference: ``qc.freeze`` and ``qc.convert`` on every rank, each
storing its own shards in the grid's integers (int4 codes with their group scales here):

    torchrun --standalone --nproc_per_node=4 examples/tp_train.py --convert          # dp 2 x tp 2
    torchrun --standalone --nproc_per_node=2 examples/tp_train.py --moe --convert    # experts too

Two pipeline stages, each sharded across its tp ranks (pp 2 x tp 2), trained with GPipe;
then every rank saves a Hugging Face checkpoint of the graph (each stage's trained state
reaches rank 0, which writes it) and rank 0 loads it with transformers:

    torchrun --standalone --nproc_per_node=4 examples/tp_train.py --pipeline         # pp 2 x tp 2
    torchrun --standalone --nproc_per_node=4 examples/tp_train.py --pipeline --moe \
        --preset w8-weight-only   # (8da4w's router input has no compressed-tensors scheme)

Across two nodes, tp inside each node and dp across them (run the same command on both,
``--node_rank`` 0 and 1, the rendezvous on the first node's address):

    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 --rdzv_backend=c10d \\
        --rdzv_endpoint=127.0.0.1:29531 examples/tp_train.py

The spec's ``tensor_parallel`` section plans the sharding from the graph (q/k/v and
gate/up colwise, o_proj and down_proj rowwise, the LM head colwise with its logits
gathered, the embedding by vocabulary); ``qc.distributed.wrap`` applies it with torch's
``parallelize_module`` on the mesh's ``tp`` dim and ``fully_shard`` on its ``dp`` dim.
Each dp replica reads its own rows of the global batch; both tp ranks of a replica read
the same rows. A colwise layer's per-row qparams are held for its rows, as its weight is.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import transformers

import qcompile as qc

VOCAB, SEQ, ROWS = 128, 32, 4  # ROWS per replica
# torchtitan's Llama plan by layer name, the norms between the blocks sequence-parallel
SEQUENCE_PLAN = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
                 "*.o_proj": "rowwise", "*.gate_proj": "colwise", "*.up_proj": "colwise",
                 "*.down_proj": "rowwise", "model.embed_tokens": "rowwise",
                 "lm_head": "colwise", "*.input_layernorm": "sequence",
                 "*.post_attention_layernorm": "sequence", "model.norm": "sequence"}


# two pipeline stages of whole blocks (a stage boundary never cuts a sharded block)
STAGES = [{"modules": ["model.embed_tokens", "model.rotary_emb", "model.layers.0",
                       "model.layers.0.*"]},
          {"modules": ["model.layers.1", "model.layers.1.*", "model.norm", "lm_head"]}]


def config_of(moe: bool = False, experts: int = 4) -> transformers.PretrainedConfig:
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  use_cache=False, tie_word_embeddings=False)
    if moe:
        return transformers.MixtralConfig(**common, num_local_experts=experts,
                                          num_experts_per_tok=2)
    return transformers.LlamaConfig(**common)


def build(moe: bool = False, experts: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_of(moe, experts))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(),
                                             ids[:, 1:].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--preset", default="8da4w-qat")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--once", action="store_true",
                        help="qc.distributed.compile_once from a safetensors checkpoint")
    parser.add_argument("--moe", action="store_true",
                        help="a Mixtral-style mixture of experts (experts sharded by expert)")
    parser.add_argument("--experts", type=int, default=4,
                        help="--moe's experts per layer (not a multiple of --tp: each "
                        "expert sliced)")
    parser.add_argument("--sequence", action="store_true",
                        help="the norms on each rank's tokens (sequence parallelism)")
    parser.add_argument("--convert", action="store_true",
                        help="then qc.convert on every rank: each stores its shards")
    parser.add_argument("--pipeline", action="store_true",
                        help="two pipeline stages across --tp ranks each, then a checkpoint")
    args = parser.parse_args()
    if args.sequence and args.moe:
        parser.error("--sequence shards a dense model's norms; a mixture's router reads "
                     "every token")
    if args.pipeline and (args.once or args.sequence or args.convert):
        parser.error("--pipeline trains and saves a checkpoint; it takes --tp, --preset, "
                     "--steps and --moe")
    make = functools.partial(build, args.moe, args.experts)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.pipeline:
        saved = pipelined(args, make, rank, world)
        dist.destroy_process_group()  # (compressed-tensors' loader would use the group)
        if rank == 0:
            load_saved(*saved)
        return
    dp = world // args.tp

    spec = qc.load_spec(args.preset).model_dump()
    spec["tensor_parallel"] = {"size": args.tp,
                               "plan": SEQUENCE_PLAN if args.sequence else "auto"}
    spec["data_parallel"] = {"kind": "fsdp2" if dp > 1 else "none"}
    ids = torch.randint(0, VOCAB, (ROWS * dp, SEQ), generator=torch.Generator().manual_seed(1))
    mine = ids[(rank // args.tp) * ROWS:(rank // args.tp + 1) * ROWS]  # this replica's rows
    if args.once:  # no rank builds the model: each reads its share of the checkpoint
        folder = [tempfile.mkdtemp(prefix="qc-ckpt-") if rank == 0 else None]
        dist.broadcast_object_list(folder)  # one machine here; a shared folder across nodes
        checkpoint = os.path.join(folder[0], "model.safetensors")
        if rank == 0:
            from safetensors.torch import save_model

            save_model(make(), checkpoint)
        dist.barrier()
        gm = qc.distributed.compile_once(make, spec, example_kwargs={"input_ids": mine},
                                         checkpoint=checkpoint)
        dist.barrier()  # every rank has read it
        if rank == 0:
            shutil.rmtree(folder[0])
    else:
        gm = qc.qcompile(make(), spec, example_kwargs={"input_ids": mine})
    if rank == 0:
        plan = qc.report(gm).tensor_parallel
        layers = sum(r.style in ("colwise", "rowwise") for r in plan)
        experts = [r for r in plan if r.style == "experts"]
        how = "within each expert" if any("within" in r.reason for r in experts) \
            else "by expert"
        norms = sum(r.style == "sequence" for r in plan)
        print(f"{layers} layers sharded {args.tp} ways"
              + (f", {len(experts)} expert weights {how}" if experts else "")
              + (f", {norms} norms on each rank's tokens" if norms else "") + f", dp {dp}")
    model = qc.distributed.wrap(gm, spec)  # parallelize_module on tp, fully_shard on dp
    if rank == 0:
        share = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                    for p in model.parameters()) / sum(p.numel() for p in model.parameters())
        print(f"rank 0 holds {share:.0%} of the parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        logits = model(input_ids=mine).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 mine[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}")
    # every rank's whole state (sharded weights gathered): one model, on every rank
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(key.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * world
    dist.all_gather_object(digests, h.hexdigest())
    if rank == 0:
        print(f"identical on every rank: {len(set(digests)) == 1}")
    if args.convert:
        convert(model, mine, rank)
    dist.destroy_process_group()


def pipelined(args: argparse.Namespace, make: functools.partial, rank: int, world: int
              ) -> tuple[str, torch.Tensor, float]:
    """pp 2 x tp: each stage sharded across its tp ranks, GPipe with two micro-batches;
    then every rank saves the graph as a Hugging Face checkpoint (rank 0 writes it).
    Returns the checkpoint's folder, the batch and the trained pipeline's loss on it."""
    if world != 2 * args.tp:
        raise SystemExit(f"--pipeline runs 2 stages x tp {args.tp}: launch {2 * args.tp} "
                         "processes")
    spec = qc.load_spec(args.preset).model_dump()
    spec["tensor_parallel"] = {"size": args.tp}
    spec["pipeline"] = {"stages": STAGES, "microbatches": 2, "schedule": "gpipe"}
    ids = torch.randint(0, VOCAB, (2 * ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    gm = qc.qcompile(make(), spec, example_kwargs={"input_ids": ids[:ROWS]})  # a micro-batch
    stage, schedule = qc.distributed.pipeline(
        gm, spec, loss_fn=lambda out, target: lm_loss(getattr(out, "logits", out), target))
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=3e-3)
    last = world - args.tp  # the last stage's first rank: it computes the loss
    for step in range(args.steps + 1):
        losses: list[torch.Tensor] = []
        schedule.step(input_ids=ids, target=ids, losses=losses)
        if step == args.steps:  # the trained model's loss on the batch: no update
            break
        opt.step()
        opt.zero_grad()
        if rank == last and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {sum(float(v.detach()) for v in losses) / len(losses):.4f}",
                  flush=True)
    trained = [sum(float(v.detach()) for v in losses) / len(losses) if rank == last else None]
    dist.broadcast_object_list(trained, src=last)
    folder = [tempfile.mkdtemp(prefix="qc-pp-") if rank == 0 else None]
    dist.broadcast_object_list(folder)  # one machine here; a shared folder across nodes
    target = os.path.join(folder[0], "checkpoint")
    # every rank: each stage's trained state reaches rank 0, which writes the checkpoint
    qc.save_pretrained(gm, target, config=config_of(args.moe, args.experts))
    return target, ids, trained[0]


def load_saved(target: str, ids: torch.Tensor, trained: float) -> None:
    """The checkpoint loaded with transformers, its loss on the batch against the trained
    pipeline's."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        loss = float(lm_loss(loaded(input_ids=ids).logits, ids))
    print(f"saved {', '.join(sorted(os.listdir(target)))}; transformers' loss on the batch "
          f"{loss:.4f}, the trained pipeline's {trained:.4f}")
    shutil.rmtree(os.path.dirname(target))


def convert(model: torch.nn.Module, ids: torch.Tensor, rank: int) -> None:
    """Integer storage of each rank's shards (every rank calls it), and what it computes
    against the trained graph's logits."""
    from qcompile.runtime.sharded import ShardedStoredLinear, StoredRows

    qc.freeze(model).eval()  # the weight quantizers take the trained weights' ranges
    stored_graph = qc.convert(model, (ids,))  # each rank stores its shards
    stored = [m.weight_frozen for m in stored_graph.modules()  # Linears; experts by rows
              if isinstance(m, (ShardedStoredLinear, StoredRows))]
    held = sum(t.to_local().numel() * t.element_size() for fw in stored
               for t in fw.parameters())
    floats = sum(fw.rows * fw.cols * 4 for fw in stored)
    with torch.no_grad():
        got, want = stored_graph(input_ids=ids).logits, model(input_ids=ids).logits
    if rank == 0:
        print(f"converted: {len(stored)} sharded weights stored, rank 0 holds "
              f"{held / 1024:.0f} KiB of them ({held / floats:.1%} of the whole "
              f"float32 weights); logits within {float((got - want).abs().max()):.1e} of "
              f"the trained graph's (largest {float(want.abs().max()):.2f})")


if __name__ == "__main__":
    main()
