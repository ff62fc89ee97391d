"""The ``tp`` suite: tensor parallelism (``tensor_parallel: {size: T, plan: auto}``) of a
small Llama-style model under the QAT presets, next to torch's own tensor parallelism of
the float model.

For T = 1, 2 and 4 (``quick``: 1 and 2, a smaller model) and each of ``int8-qat``,
``8da4w-qat`` and ``nvfp4-qat``, on T ranks (gloo, CPU, one thread each; T = 1: one
process, no process group, neither model sharded):

- the QAT model is ``qc.qcompile`` + ``qc.distributed.wrap`` with the preset plus a
  ``tensor_parallel`` section; the float model is the same Hugging Face
  ``LlamaForCausalLM`` (eager, not compiled) sharded with torch's ``parallelize_module``
  on a 1-D ``tp`` mesh, each layer in the style qcompile's plan gives it
  (``qc.report(gm).tensor_parallel``, by layer name): ``ColwiseParallel``,
  ``RowwiseParallel``, the gathered LM head ``ColwiseParallel(output_layouts=Replicate())``
  and the embedding ``RowwiseParallel(input_layouts=Replicate())``. Both start from the
  same weights and read the same batch on every rank;
- bytes per rank: the tensors each model and its AdamW optimizer hold between steps, this
  rank's part of them (a sharded DTensor counts its local shard): parameters, gradients,
  optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``) and buffers, the quantizers'
  buffers (scales, zero points, observer ranges, flags; a colwise layer's per-row ones
  for its rows, the others whole on every rank) also counted apart. Not activations,
  not the peak: the state a step starts from. (torch's rowwise embedding leaves its
  weight's gradient whole, ``Replicate``, on every rank: in both);
- step time: zero_grad, forward, cross-entropy loss, backward and ``AdamW.step``, the
  models' steps interleaved round by round after their warm-up (``step.warm_up_steps``:
  the QAT graphs' ``check_finite`` steps are not the steady state), the ranks starting
  each step together (a barrier, not timed); each rank's median, the slowest rank's;
- communication of one steady-state step (after the timed rounds), per rank: every
  collective dispatched while it runs, counted with a subclass of torch's
  ``CommDebugMode`` (DTensor's functional collectives and ``torch.distributed``'s c10d
  ops; its own count is kept as ``comm_debug_mode_counts``), with the bytes of the
  tensors this rank puts into each (an all-gather counts its local shard, an all-reduce
  its whole buffer; not what the wire carries, which depends on the algorithm). A
  collective is the quantizers' ``sync`` when ``qcompile/distributed/data_parallel.py``
  (the observer sync ``wrap`` installs) is on the Python stack when it is dispatched,
  their ``statistics`` when qcompile's quantizer code is (``qcompile/runtime/``:
  fake-quant, observers and the shard-statistics functions of ``sharded.py``), and
  otherwise the layers' own (the activations torch's styles all-reduce and gather). The
  rows keep every op's count and bytes (``qat_ops``, ``float_ops``).

T = 4 runs 4 ranks on however many cores there are (oversubscribed on 2 cores: its step
times measure the sharing of the cores as much as the step). The model has 8 heads and 4
key/value heads (GQA), so that T = 4 splits whole key/value heads (qcompile refuses a
plan that would split 2 key/value heads 4 ways, naming the layer).

Prints two tables (``tp_text``); the JSON rows hold the parts of the bytes, the plan's
counts per style, whether every preset planned the same layers alike, and each model's
loss before its first update (QAT next to float).

Example:
    >>> from qcompile.tools.bench.suites.tp import tp_text
    >>> print(tp_text({"config": config(False), "cores": 2, "rows": [
    ...     {"tp": 2, "preset": "int8-qat", "qat_mb": 26.45, "float_mb": 26.29,
    ...      "bytes_ratio": 1.006, "quant_buffer_kb": 169.0, "qat_step_ms": 337.4,
    ...      "float_step_ms": 196.1, "step_ratio": 1.721, "qat_collectives": 92,
    ...      "qat_comm_kb": 16006.4, "float_collectives": 31, "float_comm_kb": 15872.0,
    ...      "stats_collectives": 58, "stats_comm_kb": 50.0, "sync_collectives": 3,
    ...      "sync_comm_kb": 84.4, "quant_comm_share": 0.008}]}))
    ... # doctest: +NORMALIZE_WHITESPACE
    tensor parallelism, Llama-style model: 4 layers, hidden 256, intermediate 768,
    8 heads (4 kv), vocab 512, batch 4 x 128 tokens, AdamW; 2 cores
    bytes per rank (params, grads, AdamW state, buffers); step: the slowest rank's median
     T  preset      MB QAT   float  ratio  quant buf KB  step ms QAT   float  ratio
     2  int8-qat     26.45   26.29  1.006         169.0        337.4   196.1  1.721
    collectives per rank in one step, count / KB put in: QAT model, float model; of the
    QAT model's, the quantizers' statistics, the observer sync, and their share of its KB
     T  preset                 QAT           float    statistics          sync  share
     2  int8-qat      92 / 16006.4    31 / 15872.0     58 / 50.0      3 / 84.4  0.008
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.tools.bench.measure import read_ranks, spawn

PRESETS = ("int8-qat", "8da4w-qat", "nvfp4-qat")


def config(quick: bool) -> dict[str, int]:
    """The model and batch: Llama-style, 8 heads (4 key/value heads); ``quick``: a smaller
    one (smoke runs)."""
    if quick:
        return {"layers": 1, "hidden": 128, "intermediate": 256, "heads": 8, "kv_heads": 4,
                "vocab": 256, "batch": 2, "seq": 32}
    return {"layers": 4, "hidden": 256, "intermediate": 768, "heads": 8, "kv_heads": 4,
            "vocab": 512, "batch": 4, "seq": 128}


def build_model(cfg: dict[str, int]) -> nn.Module:
    """The float ``LlamaForCausalLM`` (seed 0): built from a config, never downloaded."""
    import transformers

    hf = transformers.LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=cfg["seq"], use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf).train()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors: Any) -> int:
    """Bytes of this rank's part of ``tensors`` (each storage once)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer,
                quantizers: list[nn.Module]) -> dict[str, int]:
    """What ``model`` and ``opt`` hold between steps, this rank's part: parameters,
    gradients, optimizer state, the quantizers' buffers and every other buffer."""
    quant = {id(b) for q in quantizers for b in q.buffers()}
    buffers = list(model.buffers())
    out = {"params": _bytes(model.parameters()),
           "grads": _bytes(p.grad for p in model.parameters()),
           "optimizer": _bytes(v for s in opt.state.values() for v in s.values()),
           "quant_buffers": _bytes(b for b in buffers if id(b) in quant),
           "other_buffers": _bytes(b for b in buffers if id(b) not in quant)}
    out["total"] = sum(out.values())
    return out


# -- counting collectives ---------------------------------------------------------------------
_SYNC_CODE = os.path.join("qcompile", "distributed", "data_parallel.py")
_STATS_CODE = (os.path.join("qcompile", "runtime", "fake_quant.py"),
               os.path.join("qcompile", "runtime", "observers.py"))
_SHARDED = os.path.join("qcompile", "runtime", "sharded.py")
# in sharded.py, the shard-statistics functions (not ShardedLinear / ShardedEmbedding's
# forward, which run the layer itself)
_SHARDED_STATS = frozenset({"fake_quant_dtensor", "_global_minmax", "_extremes", "_joined",
                            "_nvfp4", "_pend", "_placement", "__call__"})


def quantizer_part() -> str | None:
    """Whose collective this is, by the innermost frame of qcompile's code on the Python
    stack: ``sync`` (the observer sync, ``qcompile/distributed/data_parallel.py``),
    ``stats`` (a quantizer's statistics: ``qcompile/runtime/`` fake-quant, observers and
    the shard-statistics functions of ``sharded.py``) or None (a layer's: no such frame, or
    ``ShardedLinear`` / ``ShardedEmbedding`` running the layer itself)."""
    frame = sys._getframe(1)
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if path.endswith(_SYNC_CODE):
            return "sync"
        if path.endswith(_STATS_CODE):
            return "stats"
        if path.endswith(_SHARDED):
            return "stats" if name in _SHARDED_STATS else None
        frame = frame.f_back
    return None


def _input_tensors(packet: Any, args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors this rank puts into a collective: the functional collectives' first
    argument; c10d's ops' input (the second argument of the all-gathers, gathers and
    reduce-scatters, the first of the rest)."""
    namespace, _, name = str(packet).partition(".")
    where = 1 if namespace == "c10d" and name in (
        "_allgather_base_", "allgather_", "allgather_coalesced_",
        "allgather_into_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_",
        "reduce_scatter_tensor_coalesced_", "gather_") else 0
    flat: list[torch.Tensor] = []
    stack = [args[where] if len(args) > where else None]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            flat.append(a)
        elif isinstance(a, list | tuple):
            stack.extend(a)
    return flat


def counting_mode() -> Any:
    """A ``CommDebugMode`` that also keeps, per collective, its op, the bytes this rank puts
    in and whether qcompile's quantizer code issued it (``.calls``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    class Counting(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[dict[str, Any]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            if isinstance(func, torch._ops.HigherOrderOperator) or any(
                    t == DTensor for t in types):
                return super().__torch_dispatch__(func, types, args, kwargs)
            packet = func._overloadpacket
            if packet in self.comm_registry or packet in c10d_collective_ops:
                self.calls.append({
                    "op": str(packet),
                    "bytes": sum(t.numel() * t.element_size()
                                 for t in _input_tensors(packet, args)),
                    "part": quantizer_part()})
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Counting()


def comm_summary(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Collectives and bytes in all, of the quantizers' statistics (``stats``) and of the
    observer sync (``sync``), and per op (and part): [count, bytes]."""
    out: dict[str, Any] = {"collectives": len(calls), "bytes": sum(c["bytes"] for c in calls)}
    for part in ("stats", "sync"):
        mine = [c for c in calls if c["part"] == part]
        out[f"{part}_collectives"] = len(mine)
        out[f"{part}_bytes"] = sum(c["bytes"] for c in mine)
    ops: dict[str, list[int]] = {}
    for c in calls:
        key = c["op"] + (f" ({c['part']})" if c["part"] else "")
        count, size = ops.get(key, [0, 0])
        ops[key] = [count + 1, size + c["bytes"]]
    out["ops"] = ops
    return out


# -- one rank ----------------------------------------------------------------------------------
def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        return out["logits"]
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, tuple | list) else out


def float_plan(records: list[Any]) -> dict[str, Any]:
    """torch's styles for qcompile's plan, by layer name (replicated layers left out)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for r in records:
        if r.style == "colwise":
            plan[r.layer] = ColwiseParallel(output_layouts=Replicate()) if r.gather \
                else ColwiseParallel()
        elif r.style == "rowwise":
            plan[r.layer] = (RowwiseParallel(input_layouts=Replicate())
                             if r.kind == "embedding" else RowwiseParallel())
        elif r.style != "replicate":
            raise ValueError(f"{r.layer}: style {r.style} has no float counterpart here")
    return plan


def tp_rank(rank: int, tp: int, store: str, cfg: dict[str, int], presets: list[str],
            rounds: int, out_dir: str) -> None:
    """One of ``tp`` ranks (one thread; ``tp`` 1: no process group): the float model under
    torch's tensor parallelism and each preset's QAT model under qcompile's, from the same
    weights, on the same batch; bytes, step times and one step's collectives of each, to
    ``out_dir/rank<r>.json``."""
    import torch.distributed as dist

    from qcompile.tools.bench.suites.step import warm_up_steps

    torch.set_num_threads(1)
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=tp)
    model = build_model(cfg)
    g = torch.Generator().manual_seed(1)  # every rank reads the same batch (tp only)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    models: dict[str, tuple[nn.Module, list[nn.Module]]] = {}
    plans: dict[str, list[Any]] = {}
    for preset in presets:
        spec = qc.load_spec(preset).model_dump()
        if tp > 1:
            spec["tensor_parallel"] = {"size": tp, "plan": "auto"}
        gm = qc.qcompile(model, spec, example_kwargs={"input_ids": ids})
        plans[preset] = qc.report(gm).tensor_parallel
        quantizers = list(qc.quantizers(gm).values())
        if tp > 1:
            gm = qc.distributed.wrap(gm, spec)
        models[preset] = (gm, quantizers)
    fp = copy.deepcopy(model)
    first = plans[presets[0]]
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        parallelize_module(fp, mesh["tp"], float_plan(first))
    models = {"float": (fp, []), **models}

    vocab = cfg["vocab"]
    target = ids[:, 1:].reshape(-1)
    steps: dict[str, Any] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    first_loss: dict[str, float] = {}
    for name, (m, _) in models.items():
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step(m: nn.Module = m, opt: torch.optim.Optimizer = opt) -> float:
            opt.zero_grad(set_to_none=True)
            logits = _logits(m(input_ids=ids))
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, vocab).float(), target)
            loss.backward()
            opt.step()
            return float(loss.detach())

        first_loss[name] = step()  # the loss before any update
        for _ in range(warm_up_steps(m) - 1):
            step()
        steps[name], opts[name] = step, opt
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):  # the models' steps interleaved, round by round
        for name, step in steps.items():
            if tp > 1:
                dist.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    layout = [(r.layer, r.style, r.gather) for r in first]
    result: dict[str, Any] = {
        "plans_agree": all([(r.layer, r.style, r.gather) for r in p] == layout
                           for p in plans.values()),
        "plan": {style: sum(r.style == style for r in first)
                 for style in ("colwise", "rowwise", "replicate")}}
    for name, step in steps.items():
        mode = counting_mode()
        with mode:
            step()
        m, quantizers = models[name]
        result[name] = {"step_s": statistics.median(times[name]),
                        "first_loss": first_loss[name],
                        "bytes": state_bytes(m, opts[name], quantizers),
                        "comm": {**comm_summary(mode.calls),
                                 "comm_debug_mode_total": mode.get_total_counts()}}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if tp > 1:
        dist.barrier()
        dist.destroy_process_group()


def tp_jobs_rank(rank: int, jobs: list[tuple[Any, ...]]) -> None:
    """``tp_rank`` for each of ``jobs`` (its arguments after ``rank``: tp, store, cfg,
    presets, rounds, out_dir) in turn, in this one process; a rank beyond a job's ``tp``
    sits it out (``quick``: one launch for T = 1 and 2)."""
    for job in jobs:
        if rank < job[0]:
            tp_rank(rank, *job)


# -- the suite ---------------------------------------------------------------------------------
def bench_tp(tps: tuple[int, ...], cfg: dict[str, int], presets: tuple[str, ...],
             rounds: int, one_launch: bool = False) -> dict[str, Any]:
    """A fresh launch of T ranks per T (``one_launch``: one launch of max(T) ranks runs
    every T in turn); one row per (T, preset)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(tp, os.path.join(tmp, f"tp{tp}", "store"), cfg, list(presets), rounds,
                 os.path.join(tmp, f"tp{tp}")) for tp in tps]
        for job in jobs:
            os.makedirs(job[-1])
        if one_launch:
            spawn(tp_jobs_rank, (jobs,), max(tps))
        else:
            for job in jobs:
                spawn(tp_rank, job, job[0])
        for tp, *_, out in jobs:
            ranks = read_ranks(out, tp)
            rows += [_row(tp, preset, ranks) for preset in presets]
    return {"config": cfg, "cores": os.cpu_count(), "rounds": rounds, "rows": rows}


def _row(tp: int, preset: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    def most(model: str, key: str) -> int:  # the largest rank's
        return max(r[model]["bytes"][key] for r in ranks)

    q, f = ranks[0][preset], ranks[0]["float"]
    qat_step = max(r[preset]["step_s"] for r in ranks)
    float_step = max(r["float"]["step_s"] for r in ranks)
    qcomm, fcomm = q["comm"], f["comm"]
    extra = qcomm["stats_bytes"] + qcomm["sync_bytes"]
    return {
        "tp": tp, "preset": preset,
        "qat_mb": most(preset, "total") / 2**20, "float_mb": most("float", "total") / 2**20,
        "bytes_ratio": most(preset, "total") / most("float", "total"),
        "quant_buffer_kb": most(preset, "quant_buffers") / 2**10,
        "qat_bytes": {k: most(preset, k) for k in q["bytes"]},
        "float_bytes": {k: most("float", k) for k in f["bytes"]},
        "qat_step_ms": qat_step * 1e3, "float_step_ms": float_step * 1e3,
        "step_ratio": qat_step / float_step,
        "qat_collectives": qcomm["collectives"], "qat_comm_kb": qcomm["bytes"] / 2**10,
        "float_collectives": fcomm["collectives"], "float_comm_kb": fcomm["bytes"] / 2**10,
        "stats_collectives": qcomm["stats_collectives"],
        "stats_comm_kb": qcomm["stats_bytes"] / 2**10,
        "sync_collectives": qcomm["sync_collectives"],
        "sync_comm_kb": qcomm["sync_bytes"] / 2**10,
        "quant_comm_share": extra / qcomm["bytes"] if qcomm["bytes"] else 0.0,
        "qat_ops": qcomm["ops"], "float_ops": fcomm["ops"],
        "comm_debug_mode_counts": [qcomm["comm_debug_mode_total"],
                                   fcomm["comm_debug_mode_total"]],
        "plan": ranks[0]["plan"], "plans_agree": ranks[0]["plans_agree"],
        "first_loss": q["first_loss"], "float_first_loss": f["first_loss"]}


def run_tp(quick: bool) -> dict[str, Any]:
    if quick:
        return bench_tp((1, 2), config(True), PRESETS, 2, one_launch=True)
    return bench_tp((1, 2, 4), config(False), PRESETS, 7)


def tp_text(r: dict[str, Any]) -> str:
    """Two tables. Per T and preset: the bytes per rank (QAT, float, ratio; the quantizers'
    buffers), the slowest rank's median step (QAT, float, ratio). Then per T > 1 and
    preset, one step's collectives per rank (count / KB): the QAT model's, the float
    model's, the quantizers' statistics and the observer sync among the QAT model's, and
    their share of its bytes."""
    c = r["config"]
    lines = [f"tensor parallelism, Llama-style model: {c['layers']} layers, hidden "
             f"{c['hidden']}, intermediate {c['intermediate']}, {c['heads']} heads "
             f"({c['kv_heads']} kv), vocab {c['vocab']}, batch {c['batch']} x {c['seq']} "
             f"tokens, AdamW; {r['cores']} cores",
             "bytes per rank (params, grads, AdamW state, buffers); step: the slowest "
             "rank's median",
             f"{'T':>2}  {'preset':<10} {'MB QAT':>7} {'float':>7} {'ratio':>6}  "
             f"{'quant buf KB':>12}  {'step ms QAT':>11} {'float':>7} {'ratio':>6}"]
    for row in r["rows"]:
        lines.append(
            f"{row['tp']:>2}  {row['preset']:<10} {row['qat_mb']:>7.2f} "
            f"{row['float_mb']:>7.2f} {row['bytes_ratio']:>6.3f}  "
            f"{row['quant_buffer_kb']:>12.1f}  {row['qat_step_ms']:>11.1f} "
            f"{row['float_step_ms']:>7.1f} {row['step_ratio']:>6.3f}")
    comm = [row for row in r["rows"] if row["tp"] > 1]
    if comm:
        lines += ["collectives per rank in one step, count / KB put in: QAT model, float "
                  "model; of the",
                  "QAT model's, the quantizers' statistics, the observer sync, and their "
                  "share of its KB",
                  f"{'T':>2}  {'preset':<10} {'QAT':>15} {'float':>15} {'statistics':>13} "
                  f"{'sync':>13} {'share':>6}"]

        def cell(n: int, kb: float, width: int) -> str:
            return f"{n} / {kb:.1f}".rjust(width)

        for row in comm:
            lines.append(
                f"{row['tp']:>2}  {row['preset']:<10} "
                f"{cell(row['qat_collectives'], row['qat_comm_kb'], 15)} "
                f"{cell(row['float_collectives'], row['float_comm_kb'], 15)} "
                f"{cell(row['stats_collectives'], row['stats_comm_kb'], 13)} "
                f"{cell(row['sync_collectives'], row['sync_comm_kb'], 13)} "
                f"{row['quant_comm_share']:>6.3f}")
    return "\n".join(lines)
