"""One rank of the exports-from-tensor-parallelism tests (``test_tp_export.py``).

Run as a script, never imported from the tests folder::

    python tests/dist/_tp_export_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` (2: tp 2; 4: dp 2 x tp 2, FSDP2 over dp) and ``QC_DIST_INIT``
in the environment. Every rank compiles the same tiny Llama (same seed) with a
``tensor_parallel`` spec and wraps it (``qc.distributed.wrap``: its Linear layers and
embedding sharded across the tp ranks, and at 4 ranks every block's weights across dp too);
every rank calls the export on the sharded graph (one path, shared by the ranks) and rank
0 also exports, in this one process, the same graph compiled again and never sharded,
then compares the files byte for byte. The ``*_pp*`` cases train two pipeline stages
instead (``qc.distributed.pipeline``: pp 2, pp 2 x tp 2, pp 2 x dp 2) and export the graph
``qc.qcompile`` returned, against one process's export of the stages' gathered state.
Each rank writes ``OUTDIR/rank<r>.json`` after every case.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from _tensor_parallel_worker import llama_wide, lm_batch, lm_loss, logits_of
from _worker_main import cases_in, error_of, run_cases

import qcompile as qc

PG_TIMEOUT = datetime.timedelta(seconds=30)  # a rank stuck in a gather fails in seconds
TP = 2
ROWS, SEQ, VOCAB = 2, 8, 64
LR = 0.1
OUTDIR = Path(".")


def config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, use_cache=False,
                                    tie_word_embeddings=False)


def mixtral_config(experts: int = 4) -> transformers.MixtralConfig:
    return transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_local_experts=experts,
                                      num_experts_per_tok=2, use_cache=False,
                                      tie_word_embeddings=False)


def mixtral(experts: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(mixtral_config(experts))


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config())


def spec_of(preset: str, tp: bool = True) -> Any:
    """``preset`` at tp 2 (``tp``), with FSDP2 over the other ranks (the graph compiled
    with a child graph per block, each an FSDP2 group): on 4 ranks dp 2 x tp 2; without
    ``tp``, FSDP2 alone."""
    d = qc.load_spec(preset).model_dump()
    if tp:
        d["tensor_parallel"] = {"size": TP, "plan": "auto"}
    if not tp or dist.get_world_size() > TP:
        d["data_parallel"] = {"kind": "fsdp2"}
    return qc.specs.as_spec(d)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def files_of(path: Path) -> dict[str, bytes]:
    """A file's bytes (under ``""``), or every file of a directory by name."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def same_files(a: Path, b: Path) -> dict[str, Any]:
    fa, fb = files_of(a), files_of(b)
    return {"files": sorted(fa), "bytes": sum(len(v) for v in fa.values()),
            "identical": fa.keys() == fb.keys() and all(fa[k] == fb[k] for k in fa),
            "differ": sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))}


def gguf_export(gm: Any, path: Path, conf: Any = None) -> Path:
    return qc.export_gguf(gm, path, config=conf or config())


def hf_export(gm: Any, path: Path, conf: Any = None) -> Path:
    return qc.save_pretrained(gm, path, config=conf or config())


def exported(export: Callable[[Any, Path], Path], model: Any, ref: Any, name: str
             ) -> dict[str, Any]:
    """Every rank exports the sharded ``model`` to one path; rank 0 then exports
    ``ref`` (the same weights, unsharded) in this process and compares the bytes."""
    rank = dist.get_rank()
    target = OUTDIR / name
    got = export(model, target)
    out: dict[str, Any] = {"returned": str(got) == str(target)}
    dist.barrier()  # rank 0 has written by now
    if rank == 0:
        reference = OUTDIR / f"{name}_one_process"
        export(ref, reference)
        out.update(same_files(target, reference))
        out["leftovers"] = sorted(p.name for p in OUTDIR.iterdir()
                                  if p.name.startswith(f".{name}") or ".tmp" in p.name)
    return out


def compare(preset: str, export: Callable[..., Path], kind: str, tp: bool = True,
            once: bool = False, moe: int = 0) -> dict[str, Any]:
    """The sharded graph's export against one process's: freshly compiled, and again after
    one SGD step on the ranks (the reference then holds the gathered trained state). The
    sharded graph is ``qc.distributed.wrap``'s, or ``compile_once``'s (``once``); of the
    Llama, or of a Mixtral of ``moe`` experts (4: sharded by expert; 3: within each)."""
    spec = spec_of(preset, tp)
    batch = lm_batch(ROWS)
    llama = functools.partial(mixtral, moe) if moe else globals()["llama"]
    export = functools.partial(export, conf=mixtral_config(moe) if moe else config())
    ref = qc.qcompile(llama(), spec, example_kwargs=batch)  # never sharded
    plain = qc.qcompile(llama(), preset, example_kwargs=batch)  # no tensor_parallel section
    if once:
        model = qc.distributed.compile_once(llama, spec, example_kwargs=batch)
    else:
        model = qc.distributed.wrap(qc.qcompile(llama(), spec, example_kwargs=batch), spec)
    out: dict[str, Any] = {"sharded": sorted(  # by the model's names (no block prefix)
        n.split(".", 1)[1] if n.startswith("stage_") else n
        for n, p in model.named_parameters() if hasattr(p, "full_tensor")),
                           "mesh_dims": sorted({d for p in model.parameters() for d in getattr(
                               getattr(p, "device_mesh", None), "mesh_dim_names", ()) or ()})}
    out["fresh"] = exported(export, model, ref, f"{kind}_fresh")
    if dist.get_rank() == 0:  # the compile without a tensor_parallel section writes the same
        export(plain, OUTDIR / f"{kind}_plain")
        out["fresh"]["plain_identical"] = same_files(OUTDIR / f"{kind}_fresh",
                                                     OUTDIR / f"{kind}_plain")["identical"]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = lm_loss(model(**batch), batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    state = {k: whole(v).detach() for k, v in model.state_dict().items()}  # every rank
    trained = qc.qcompile(llama(), spec, example_kwargs=batch)
    trained.load_state_dict(state)
    out["trained"] = exported(export, model, trained, f"{kind}_trained")
    if dist.get_rank() == 0:
        out["trained"]["differs_from_fresh"] = not same_files(
            OUTDIR / f"{kind}_trained", OUTDIR / f"{kind}_fresh")["identical"]
    return out


def case_gguf() -> dict[str, Any]:
    return compare("gguf-q4_0-qat", gguf_export, "gguf")


def case_hf() -> dict[str, Any]:
    return compare("8da4w-qat", hf_export, "hf")


def case_gguf_fsdp2() -> dict[str, Any]:
    return compare("gguf-q4_0-qat", gguf_export, "gguf_fsdp2", tp=False)


def case_hf_fsdp2() -> dict[str, Any]:
    return compare("8da4w-qat", hf_export, "hf_fsdp2", tp=False)


def case_gguf_moe() -> dict[str, Any]:
    return compare("gguf-q4_0-qat", gguf_export, "gguf_moe", moe=4)


def case_hf_moe() -> dict[str, Any]:
    return compare("w8-weight-only", hf_export, "hf_moe", moe=4)


def case_gguf_moe_within() -> dict[str, Any]:
    return compare("gguf-q4_0-qat", gguf_export, "gguf_moe_within", moe=3)


def case_hf_moe_within() -> dict[str, Any]:
    return compare("w8-weight-only", hf_export, "hf_moe_within", moe=3)


def case_gguf_once() -> dict[str, Any]:
    return compare("gguf-q4_0-qat", gguf_export, "gguf_once", tp=False, once=True)


def staged_spec(preset: str, layout: str) -> Any:
    """``preset`` in two pipeline stages (GPipe, 2 micro-batches); ``layout``: ``pp`` (one
    stage a rank), ``pp_tp`` (each stage across two tp ranks), ``pp_dp`` (each stage
    FSDP2-sharded over two dp ranks)."""
    d = qc.load_spec(preset).model_dump()
    d["pipeline"] = {"stages": 2, "microbatches": 2, "schedule": "gpipe"}
    if layout == "pp_tp":
        d["tensor_parallel"] = {"size": TP, "plan": "auto"}
    elif layout == "pp_dp":
        d["data_parallel"] = {"kind": "fsdp2"}
    return qc.specs.as_spec(d)


def trained_stages(spec: Any, build: Callable[[], torch.nn.Module], lr: float = LR
                   ) -> tuple[Any, torch.nn.Module, torch.Tensor, list[dict[str, Any]]]:
    """The graph compiled for ``spec`` (two pipeline stages), this rank's stage trained
    for two GPipe steps (SGD on what trains), and every rank's trained stage state
    gathered whole (``full_tensor``) and shared (``all_gather_object``): ``(gm, this
    rank's stage module, the batch, [each rank's stage state])``."""
    ids = lm_batch(2 * ROWS)["input_ids"]
    gm = qc.qcompile(build(), spec, example_kwargs={"input_ids": ids[:ROWS]})
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=lambda out, y: lm_loss(
        out, {"input_ids": y}))
    opt = torch.optim.SGD([p for p in stage.submod.parameters() if p.requires_grad], lr=lr)
    for _ in range(2):
        schedule.step(input_ids=ids, target=ids)
        opt.step()
        opt.zero_grad()
    own = getattr(stage.submod, "module", stage.submod)  # (pp x dp with DDP: its module)
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, {k: whole(v).detach() for k, v in own.state_dict().items()})
    return gm, own, ids, shares


def staged(preset: str, export: Callable[..., Path], kind: str, layout: str,
           moe: bool = False) -> dict[str, Any]:
    """Every rank trains its stage for two GPipe steps, then every rank calls the export
    on the graph ``qc.qcompile`` returned (each rank's own stage trained, the others
    untrained copies); rank 0 writes. The reference: each rank's trained stage state,
    gathered whole (``full_tensor``) and shared with ``all_gather_object``, loaded into
    one process's graph compiled without the pipeline section, exported there."""
    build, conf = (mixtral, mixtral_config()) if moe else (llama, config())
    export = functools.partial(export, conf=conf)
    gm, own, ids, shares = trained_stages(staged_spec(preset, layout), build)
    kept = {k: whole(v).detach().clone() for k, v in own.state_dict().items()}
    refused = {}
    if layout != "pp":  # each rank's stage sharded within: one whole model nowhere
        refused = {"convert": error_of(lambda: qc.convert(gm)),
                   "onnx": error_of(lambda: qc.export_onnx(
                       gm, OUTDIR / f"{kind}.onnx", example_kwargs={"input_ids": ids[:ROWS]})),
                   "encodings": error_of(lambda: qc.export_encodings(
                       gm, OUTDIR / f"{kind}.json"))}
    trained = qc.qcompile(build(), qc.load_spec(preset), example_kwargs={"input_ids": ids})
    fresh = {k: v.clone() for k, v in trained.state_dict().items()}
    merged = {k: v for share in shares for k, v in share.items()}
    missing = trained.load_state_dict(merged, strict=False).missing_keys
    out = exported(export, gm, trained, kind)
    out.update(refused=refused, missing=missing, own_stage_kept=all(
        torch.equal(whole(v), kept[k]) for k, v in own.state_dict().items()),
        stages_trained=sum(not torch.equal(merged[k], fresh[k]) for k in merged
                           if k.endswith(".weight")))
    return out


def case_gguf_pp() -> dict[str, Any]:
    return staged("gguf-q4_0-qat", gguf_export, "gguf_pp", "pp")


def case_hf_pp() -> dict[str, Any]:
    return staged("8da4w-qat", hf_export, "hf_pp", "pp")


def case_gguf_pp_tp() -> dict[str, Any]:
    return staged("gguf-q4_0-qat", gguf_export, "gguf_pp_tp", "pp_tp")


def case_hf_pp_tp_moe() -> dict[str, Any]:
    return staged("w8-weight-only", hf_export, "hf_pp_tp_moe", "pp_tp", moe=True)


def case_hf_pp_dp() -> dict[str, Any]:
    return staged("8da4w-qat", hf_export, "hf_pp_dp", "pp_dp")


def adapters_staged(layout: str) -> dict[str, Any]:
    """``qlora-nf4`` on a Llama with 128 features (at tp 2 each rank's share of a layer's
    input features holds whole NF4 blocks of 64) in two pipeline stages (``layout`` as
    ``staged_spec``), two GPipe steps
    of the adapters (SGD, lr 0.5), then every rank saves the adapters of the graph
    ``qc.qcompile`` returned; rank 0's file against every stage's trained adapters as its
    ranks hold them (gathered whole with ``full_tensor``)."""
    gm, _, _, shares = trained_stages(staged_spec("qlora-nf4", layout), llama_wide, lr=0.5)
    folder = qc.save_adapters(gm, OUTDIR / f"adapters_{layout}")
    out: dict[str, Any] = {"returned": folder == OUTDIR / f"adapters_{layout}"}
    dist.barrier()
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        saved = {k.removeprefix("base_model.model."): v for k, v in load_file(
            folder / "adapter_model.safetensors").items() if ".lora_" in k}
        trained = {k: v for share in shares for k, v in share.items() if ".lora_" in k}
        out["saved"] = sorted(saved)
        out["trained"] = sorted(trained)
        out["equal"] = sorted(k for k, v in trained.items() if k in saved
                              and torch.equal(saved[k], v))
        out["moved"] = sum(float(v.abs().sum()) > 0 for k, v in trained.items()
                           if ".lora_B." in k)
    return out


def case_adapters_pp() -> dict[str, Any]:
    return adapters_staged("pp")


def case_adapters_pp_tp() -> dict[str, Any]:
    return adapters_staged("pp_tp")


def case_mistakes_pp() -> dict[str, Any]:
    """Exports of a pipeline the ranks do not make alike: one QCompileError on every rank,
    before any stage's state moves, and the group still works."""
    rank = dist.get_rank()
    spec = staged_spec("gguf-q4_0-qat", "pp")
    ids = lm_batch(2 * ROWS)["input_ids"]
    gm = qc.qcompile(llama(), spec, example_kwargs={"input_ids": ids[:ROWS]})
    qc.distributed.pipeline(gm, spec, loss_fn=lambda out, y: lm_loss(out, {"input_ids": y}))
    out: dict[str, Any] = {}
    mistake(out, "path_differs", lambda: gguf_export(gm, OUTDIR / f"pp{rank}.gguf"))
    exists_on_rank0(out, gm, "pp_exists.gguf")
    out["unwritten"] = sorted(p.name for p in OUTDIR.iterdir() if p.name.startswith("pp") and
                              p.name != "pp_exists.gguf")
    return out


def group_works() -> bool:
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item() == 3.0


def mistake(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """What ``fn`` raised on this rank; then the ranks meet (a rank stuck in a gather would
    make this barrier time out: the process group's 30 s) and the group must still work."""
    out[name] = error_of(fn)
    dist.barrier()
    out[name]["group_works"] = group_works()


def exists_on_rank0(out: dict[str, Any], model: Any, name: str) -> None:
    """An export to ``name``, a file rank 0 (the writer) has: ``out["exists"]``, what each
    rank raised, and whether the file was kept."""
    exists = OUTDIR / name
    if dist.get_rank() == 0:
        exists.write_bytes(b"mine")
    dist.barrier()
    mistake(out, "exists", lambda: gguf_export(model, exists))
    out["exists"]["kept"] = exists.read_bytes() == b"mine"


def case_mistakes() -> dict[str, Any]:
    """Calls the ranks do not make together: each is a QCompileError on both ranks, before
    any gather, and the group and the agreement still work afterwards."""
    rank = dist.get_rank()
    spec = spec_of("gguf-q4_0-qat")
    model = qc.distributed.wrap(qc.qcompile(llama(), spec, example_kwargs=lm_batch(ROWS)), spec)
    out: dict[str, Any] = {}
    # rank 0 exports while rank 1 saves a checkpoint
    mistake(out, "only_rank0", lambda: gguf_export(model, OUTDIR / "only.gguf") if rank == 0
            else hf_export(model, OUTDIR / "only_hf"))
    # another path, another config on rank 1
    mistake(out, "path_differs", lambda: gguf_export(model, OUTDIR / f"path{rank}.gguf"))
    other = config()
    other.rms_norm_eps = 1e-6 if rank == 0 else 1e-5
    mistake(out, "config_differs", lambda: qc.export_gguf(model, OUTDIR / "cfg.gguf",
                                                          config=other))
    # the path exists: rank 0 (the writer) refuses; rank 1 must not gather alone
    exists_on_rank0(out, model, "exists.gguf")
    # rank 0 alone, rank 1 making no qcompile call: rank 0 gives up after the timeout
    os.environ["QCOMPILE_AGREE_TIMEOUT"] = "2"
    try:
        mistake(out, "absent", lambda: gguf_export(model, OUTDIR / "absent.gguf")
                if rank == 0 else None)
        # the ranks' next call finds them in step again (rank 1 skips the meeting it
        # missed, with a warning): the same refusal of the q4_0 grid on both ...
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mistake(out, "after_absent", lambda: hf_export(model, OUTDIR / "after_hf"))
        out["after_absent"]["warnings"] = [str(w.message) for w in seen
                                           if "without this rank" in str(w.message)]
    finally:
        del os.environ["QCOMPILE_AGREE_TIMEOUT"]
    # ... and an export on both ranks writes the file
    mistake(out, "good", lambda: gguf_export(model, OUTDIR / "good.gguf"))
    out["good"]["written"] = (OUTDIR / "good.gguf").is_file()
    # NaN in rank 1's shard: rank 1 refuses, rank 0 stops with it
    weight = model.get_parameter("model.layers.0.mlp.up_proj.weight")
    kept = weight.to_local().detach().clone()
    if rank == 1:
        with torch.no_grad():
            weight.to_local()[0, 0] = float("nan")
    mistake(out, "nan_on_rank1", lambda: hf_export(model, OUTDIR / "nan_hf"))
    with torch.no_grad():
        weight.to_local().copy_(kept)
    out["unwritten"] = sorted(p.name for p in OUTDIR.iterdir() if p.name.startswith(
        ("only", "path", "cfg", "absent", "after", "nan")))
    return out


def case_local_pp() -> dict[str, Any]:
    """``int8-qat`` in two pipeline stages (pp 2), two GPipe steps, then on every rank the
    calls that read one whole model: ``qc.convert`` (every rank gets the whole converted
    model), ``qc.export_encodings`` and ``qc.export_onnx`` (rank 0 writes). Against one
    process: the stages' trained state (gathered with ``all_gather_object``) loaded into
    an unsplit compile, converted and exported there."""
    gm, _, ids, shares = trained_stages(staged_spec("int8-qat", "pp"), llama)
    x = ids[:ROWS]  # the graph's shapes are a micro-batch's
    ref = qc.qcompile(llama(), qc.load_spec("int8-qat"), example_kwargs={"input_ids": x})
    ref.load_state_dict({k: v for share in shares for k, v in share.items()}, strict=False)
    qc.freeze(ref)
    qc.freeze(gm)
    out: dict[str, Any] = {}
    converted = qc.convert(gm, (x,))
    want = qc.convert(ref, (x,))
    with torch.no_grad():
        got_logits = logits_of(converted(input_ids=x))
        want_logits = logits_of(want(input_ids=x))
    out["convert_equal"] = torch.equal(got_logits, want_logits)
    out["convert_gap"] = float((got_logits - want_logits).abs().max())
    qc.export_encodings(gm, OUTDIR / "local_encodings.json")
    qc.export_onnx(gm, OUTDIR / "local.onnx", example_kwargs={"input_ids": x},
                   dynamic_batch=False)  # (the graph's shapes are fixed)
    dist.barrier()
    if dist.get_rank() == 0:
        qc.export_encodings(ref, OUTDIR / "ref_encodings.json")
        out["encodings_equal"] = json.loads((OUTDIR / "local_encodings.json").read_text()) == (
            json.loads((OUTDIR / "ref_encodings.json").read_text()))  # (as JSON: key order)
        qc.export_onnx(ref, OUTDIR / "ref.onnx", example_kwargs={"input_ids": x},
                       dynamic_batch=False)
        import onnxruntime as ort

        feed = {"input_ids": x.numpy()}
        a = ort.InferenceSession(str(OUTDIR / "local.onnx")).run(None, feed)[0]
        b = ort.InferenceSession(str(OUTDIR / "ref.onnx")).run(None, feed)[0]
        out["onnx_gap"] = float(abs(a - b).max())
    return out


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

