"""The ``architectures`` suite: every family of ``qcompile.tools.architectures`` (tiny
Hugging Face configs: Llama, Mistral, Qwen2/3, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3,
Gemma 2/3, Phi-3, Falcon, GPT-2, GPT-NeoX, Bloom, and the encoders BERT, ViT, T5) under each
LLM preset, as a user runs them: compile with a pad token in the batch, three AdamW steps
(``int8-static``: calibrate on two batches instead), every loss finite; the share of the
weights linear layers read that a quantizer reads, counted from the model (not from the
graph) with the preset's skip rules aside; convert to integer / block storage where the
preset converts (``qlora-nf4``: after ``qc.merge_adapters``), the converted graph's output
next to the fake-quant graph's; and ``qc.distributed.compile_once`` under FSDP2 on two
ranks (gloo), its logits next to one process's ``qc.qcompile``.

``sweep_case`` is one family under one preset, in this process (the tests call it);
``compile_once_rank`` is the two-rank part. The docs' table
(``docs/reference/architectures.md``) is generated from this suite's JSON output, kept in
``docs/benchmarks/data/architectures.json``.

Example:
    >>> from qcompile.tools.bench.suites.architectures import sweep_case
    >>> row = sweep_case("llama", "int8-qat")
    >>> row["finite"], row["share"] >= 0.99, row["converted"]
    (True, True, True)
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import tempfile
import time
from typing import Any

import torch

import qcompile as qc
from qcompile.tools.architectures import ARCHITECTURES, Architecture, linear_weight_parameters

PRESETS = ("int8-qat", "8da4w-qat", "nvfp4-qat", "qlora-nf4", "int8-static")
STEPS = 3
# the families of a quick run (and of the default test suite): a dense decoder, an MoE, a
# model with x @ W.T layers, GPT-2's Conv1D, an encoder
QUICK = ("llama", "mixtral", "falcon", "gpt2", "bert")
# convert's output next to the fake-quant graph's: largest difference over the largest
# magnitude. An 8-bit output grid is 1/255 of its range; per-token and block formats
# convert their activations as the fake-quant graph does
CONVERT_TOLERANCE = 0.05
ONCE_TOLERANCE = 1e-4


def _output(arch: Architecture, out: Any) -> torch.Tensor:
    key = "last_hidden_state" if arch.kind == "encoder" else "logits"
    if isinstance(out, dict):
        return out[key]
    return getattr(out, key) if hasattr(out, key) else out[0]


def skipped_names(spec: qc.CompileSpec, names: list[str]) -> set[str]:
    """The weights whose layer a skip rule of ``spec`` names (by ``match.name`` globs on
    the layer's qualified name), matched here with fnmatch, not with qcompile's matcher."""
    globs = [g for r in spec.quant.rules if r.skip and r.match.name for g in r.match.name]
    return {n for n in names if any(fnmatch.fnmatchcase(n.rpartition(".")[0], g)
                                     for g in globs)}


def coverage(model: torch.nn.Module, gm: torch.nn.Module,
             spec: qc.CompileSpec) -> tuple[float, list[str]]:
    """(share of the linear weights a quantizer reads, the float ones by name): the
    weights from the model itself (``linear_weight_parameters``), skip rules aside; a
    weight counts as quantized when a weight quantizer of the report reads it, or a frozen
    base stores it quantized."""
    linear = linear_weight_parameters(model)
    skipped = skipped_names(spec, list(linear))
    rep = qc.report(gm)
    read = {r.node for r in rep.quantizers if r.role == "weight"}
    read |= {f"{a.layer}.weight" for a in rep.adapters if a.stored}  # frozen quantized bases
    meant = {n: k for n, k in linear.items() if n not in skipped}
    done = sum(k for n, k in meant.items() if n in read)
    total = sum(meant.values())
    return (done / total if total else 1.0), sorted(n for n in meant if n not in read)


def sweep_case(name: str, preset: str, *, steps: int = STEPS) -> dict[str, Any]:
    """``name`` under ``preset``: a row of the table (see the module docstring); an error
    is the row's ``error`` (its message's first line), the rest left out."""
    arch = ARCHITECTURES[name]
    spec = qc.load_spec(preset)
    row: dict[str, Any] = {"arch": name, "preset": preset}
    try:
        model = arch.build()
        batch = arch.batch()
        t0 = time.perf_counter()
        gm = qc.qcompile(model, spec, example_kwargs=batch)
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        losses = _train(arch, gm, spec, steps)
        row["losses"] = [round(v, 4) for v in losses]
        row["finite"] = all(math.isfinite(v) for v in losses)
        row["share"], row["float"] = coverage(model, gm, spec)
        row.update(_convert(arch, gm, preset))
    except Exception as e:  # a row that says what failed, for the table
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return row


def _train(arch: Architecture, gm: torch.nn.Module, spec: qc.CompileSpec,
           steps: int) -> list[float]:
    """The losses of ``steps`` AdamW steps on batches that hold a pad token; for a static
    spec, the loss after calibrating on two batches (no training)."""
    if spec.quant.mode == "static":
        qc.calibrate(gm, [arch.batch(seed=s) for s in (1, 2)])
        with torch.no_grad():
            batch = arch.batch()
            return [float(arch.loss(gm(**batch), batch))]
    gm.train()
    opt = torch.optim.AdamW([p for p in gm.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(steps):
        batch = arch.batch(seed=step)
        loss = arch.loss(gm(**batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _convert(arch: Architecture, gm: torch.nn.Module, preset: str) -> dict[str, Any]:
    """Convert (adapters merged first), then the largest output difference to the graph it
    came from, over the largest output magnitude."""
    if preset == "qlora-nf4":
        gm = qc.merge_adapters(gm)
    qc.freeze(gm)
    gm.eval()
    converted = qc.convert(gm)
    batch = arch.batch(seed=7)
    with torch.no_grad():
        ref = _output(arch, gm(**batch)).float()
        out = _output(arch, converted(**batch)).float()
    deviation = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
    return {"converted": bool(torch.isfinite(out).all()) and deviation <= CONVERT_TOLERANCE,
            "convert_deviation": round(deviation, 5)}


# -- two ranks ---------------------------------------------------------------------------
def _once_spec(preset: str) -> dict[str, Any]:
    data = qc.load_spec(preset).model_dump()
    data["data_parallel"] = {"kind": "fsdp2"}
    return data


def compile_once_case(name: str, preset: str, rank: int, world: int,
                      checkpoint: str) -> dict[str, Any]:
    """On every rank of an initialised process group: ``compile_once`` of ``name`` under
    ``preset`` with FSDP2, from ``checkpoint`` (the model's safetensors), calibrated on
    each rank's half of two batches for a static preset; its logits on a batch next to
    one process's ``qc.qcompile`` of the same model (calibrated on both batches)."""
    arch = ARCHITECTURES[name]
    batch = arch.batch()
    calibration = [arch.batch(seed=s) for s in (1, 2)]
    static = qc.load_spec(preset).quant.mode == "static"
    gm = qc.distributed.compile_once(
        arch.build, _once_spec(preset), example_kwargs=batch, checkpoint=checkpoint,
        calibration=[calibration[rank]] if static and world == 2 else None)
    gm.eval()
    with torch.no_grad():
        got = _output(arch, gm(**batch)).float()
    ref_spec = qc.load_spec(preset).model_dump()
    ref_spec["quant"]["sync_observers"] = False
    ref = qc.qcompile(arch.build(), ref_spec, example_kwargs=batch)
    if static:
        qc.calibrate(ref, calibration)
    ref.eval()
    with torch.no_grad():
        want = _output(arch, ref(**batch)).float()
    deviation = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    return {"once_deviation": round(deviation, 7),
            "once_equal": bool(torch.isfinite(got).all()) and deviation <= ONCE_TOLERANCE}


def compile_once_rank(rank: int, store: str, cases: list[tuple[str, str]],
                      folder: str) -> None:
    """One of two ranks (gloo): every case in turn; rank 0 writes the rows."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    rows = []
    for name, preset in cases:
        ckpt = os.path.join(folder, f"{name}.safetensors")
        try:
            row = compile_once_case(name, preset, rank, 2, ckpt)
        except Exception as e:
            row = {"once_error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        rows.append({"arch": name, "preset": preset, **row})
    if rank == 0:
        with open(os.path.join(folder, "once.json"), "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def write_checkpoint(name: str, path: str) -> None:
    """The family's model (as ``build()`` draws it) as one safetensors file."""
    from safetensors.torch import save_model

    save_model(ARCHITECTURES[name].build(), path)


def sweep_compile_once(cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """``compile_once_rank`` on two spawned ranks for ``cases``; one row per case."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted({n for n, _ in cases}):
            write_checkpoint(name, os.path.join(tmp, f"{name}.safetensors"))
        torch.multiprocessing.spawn(compile_once_rank,
                                    args=(os.path.join(tmp, "store"), cases, tmp),
                                    nprocs=2, join=True)
        with open(os.path.join(tmp, "once.json")) as f:
            return json.load(f)


def bench_architectures(quick: bool) -> dict[str, Any]:
    """Every family under every LLM preset: compile, train, coverage, convert, compile_once."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed (pip install qcompile[models])"}
    names = QUICK if quick else tuple(ARCHITECTURES)
    rows = [sweep_case(n, p) for n in names for p in PRESETS]
    cases = [(r["arch"], r["preset"]) for r in rows if "error" not in r]
    once = {(r["arch"], r["preset"]): r for r in sweep_compile_once(cases)}
    for r in rows:
        extra = once.get((r["arch"], r["preset"]), {})
        r.update({k: v for k, v in extra.items() if k not in ("arch", "preset")})
    return {"presets": list(PRESETS), "measured": measured_on(), "rows": rows}


def measured_on() -> str:
    """The machine, the versions and the date, for the table's caption."""
    import datetime
    import platform

    import transformers

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"qcompile-bench architectures on {os.cpu_count()} cores of {cpu} "
            f"({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {datetime.date.today().isoformat()}")


def _mark(ok: Any) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def architectures_text(r: dict[str, Any]) -> str:
    """One line per family and preset.

    >>> print(architectures_text({"rows": [{"arch": "llama", "preset": "int8-qat",
    ...     "finite": True, "share": 1.0, "converted": True, "once_equal": True,
    ...     "compile_s": 0.5, "losses": [4.8, 4.6, 4.4]}]}))
    ... # doctest: +NORMALIZE_WHITESPACE
    family  preset  finite  linear quantized  converts  once = 1 process  losses
    llama  int8-qat  yes  100.0%  yes  yes  4.8 4.6 4.4
    """
    if "skipped" in r:
        return f"architectures: skipped ({r['skipped']})"
    lines = [f"{'family':<13} {'preset':<13} {'finite':<7} {'linear quantized':>16}  "
             f"{'converts':<9} {'once = 1 process':<17} losses"]
    for row in r["rows"]:
        if "error" in row:
            lines.append(f"{row['arch']:<13} {row['preset']:<13} ERROR {row['error']}")
            continue
        once = row.get("once_equal")
        if "once_error" in row:
            once = False
        lines.append(f"{row['arch']:<13} {row['preset']:<13} {_mark(row['finite']):<7} "
                     f"{100 * row['share']:>15.1f}%  {_mark(row.get('converted')):<9} "
                     f"{_mark(once):<17} {' '.join(f'{v:.3g}' for v in row['losses'])}")
    return "\n".join(lines)
