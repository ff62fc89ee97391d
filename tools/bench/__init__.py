"""``qcompile-bench``: side-by-side measurements, medians and ratios in one run.

Subcommands:

- ``pipeline``: partitioning time on a ~10,000-node graph, bytes crossing each cut with
  ``transfer: fp32`` vs ``int8``, and the step time of a 2-stage GPipe pipeline (2 ranks,
  gloo, CPU) next to the same model trained in one process.
- ``compile-once``: peak RSS of each rank, over its post-import baseline, when 1, 2 or 4
  ranks share one compile of a 384 MB model (``qc.distributed.compile_once`` with
  ``fsdp2``: from a safetensors checkpoint, streamed from rank 0, and the naive way where
  every rank builds and compiles the whole model, and a calibrated static compile from
  the checkpoint, 8 batches per rank), against model/N + 2 blocks + 10%.
- ``observer-sync``: collectives and bytes per step that keep observers identical on 2
  DDP ranks (one flattened collective per reduction kind, whatever the quantizer count).
- ``hybrid``: traffic per training step (gradient buckets, observer all-reduces,
  pipeline sends) of one int8-QAT MLP on 4 ranks as 2 stages x 2 DDP replicas, 4 DDP
  replicas and 4 GPipe stages.
- ``tp``: tensor parallelism of a small Llama-style model on 1, 2 and 4 ranks (gloo, CPU)
  under int8-qat, 8da4w-qat and nvfp4-qat next to torch's own tensor parallelism of the
  float model (``parallelize_module``, the same per-layer styles): bytes per rank
  (parameters, gradients, AdamW state, quantizer buffers), step time, and the collectives
  and bytes of one step (``CommDebugMode``), the quantizers' statistics and observer sync
  apart.
- ``compile``: compile time of qcompile int8-qat and torch.ao ``prepare_qat_fx`` relative
  to ``torch.fx.symbolic_trace`` (MLP, ResNet-18-style CNN, 12-layer transformer), and
  compile time of 50..400-block MLPs (scaling).
- ``memory``: peak RSS of compile + 2 QAT steps of the 12-layer transformer, qcompile
  (with and without its copy of the model) vs torch.ao ``prepare_qat_fx``, each in a
  fresh process; and the training step under FSDP2 on 1, 2 and 4 ranks (gloo): per-rank
  peak of a float step, a qcompile QAT step (``compile_once``), the same keeping its
  fake-quantized weights (``train.recompute_weights: false``) and torch.ao
  ``prepare_qat_fx`` + ``fully_shard``, with the bytes autograd keeps after the forward.
- ``step``: QAT training-step time relative to the fp32 eager step, qcompile vs
  ``prepare_qat_fx``, same models.
- ``convert``: int8 inference latency after ``qc.convert`` vs fp32, next to torch.ao
  ``convert_fx`` (MLP at batch 64 and 1, ResNet-style CNN at batch 32).
- ``convert-presets``: converted int8-static / int8-qat presets (a float input quantized
  where a quantized layer reads it) vs fp32 vs torch.ao ``convert_fx``, batch 1 and 64,
  measured side by side in one run.
- ``onnx``: onnxruntime latency of the QDQ model from ``qc.export_onnx`` (fused into
  integer kernels) vs the fp32 ONNX model vs ``qc.convert``, and its file size vs fp32.
- ``fakequant``: fake-quant throughput (GB/s, forward and forward+backward) per-tensor /
  per-channel / per-group / LSQ next to ``y.copy_(x)`` and torch's built-in ops.
- ``algorithms``: accuracy / perplexity of each ``quant.algorithms`` PTQ algorithm (CLE,
  SmoothQuant, bias correction, AdaRound, GPTQ) vs round-to-nearest at int8 per-tensor,
  w4 per-group, w3 per-channel and w8a8, on the digits CNN/MLP and a small Llama-style
  character LM trained on the stdlib's source (``lm``; weights cached), next to torchao.
- ``torch-models``: coverage of torch's own quantization test models
  (``torch.testing._internal.common_quantization``, about 100): per model and preset
  (int8-qat, int8-static, int8-dynamic), whether qcompile and torch.ao FX compile and
  convert it, the fraction of weights quantized and the rel-L2 of the fake-quant and
  converted outputs vs fp32, failures with their first error line (needs ``expecttest``).
- ``moe``: mixture-of-experts language models (Mixtral-, Qwen2-MoE-, DeepSeek-V3-style tiny
  configs): expert parameters behind a quantizer, QAT loss next to fp32, and in mode none
  bit-identical logits and identical routing.
- ``architectures``: every Hugging Face family of ``qcompile.tools.architectures`` (tiny
  configs: 15 decoders, BERT, ViT, T5) under int8-qat, 8da4w-qat, nvfp4-qat, qlora-nf4 and
  int8-static: finite losses with a pad token in the batch, the share of linear weights
  behind a quantizer, convert, and ``compile_once`` on 2 ranks next to one process; its
  JSON is the table of ``docs/reference/architectures.md``.
- ``llm``: a small Llama-style language model (dense and mixture-of-experts) trained on
  English text that ships with Python: validation perplexity of fp32, round-to-nearest PTQ,
  GPTQ and QAT for w8a8, 8da4w, int4 weight-only, MXFP4, NVFP4 and NF4, and the share of
  the PTQ loss QAT wins back.
- ``adapters``: LoRA (r 16) on a frozen quantized base of a 109M-parameter decoder: qcompile
  int8 / int4 g32 / NF4 / NVFP4 / MXFP4 frozen bases and an int4 QAT base next to peft (fp32)
  and bitsandbytes NF4 + peft: resident memory, base bytes vs fp32, step time vs peft, loss.
- ``search``: ``qc.search`` on the llm suite's dense LM and the digits CNN: uniform int4 /
  int8 vs the searched mix at 4.5 and 5 bits (sqnr, fisher; loss on the CNN), measured after
  compiling, the share of the int4->int8 gap closed, search time vs calibration, and files
  for ``qcompile-inspect search --measured``.
- ``cuda``: on a CUDA GPU (skipped without one): fake-quant forward + backward as a share
  of the device's copy bandwidth, eager and under ``torch.compile``, and the compiled
  training step of a ~340M-parameter Llama-style model with ``8da4w-qat`` and
  ``gguf-q4_0-qat`` relative to its bf16 step, next to torchao's QAT (``tools/gpu-check``
  runs it with the CUDA tests).

``--quick`` runs smaller workloads; ``--format json`` (or ``--json``) prints the result
dict as JSON instead of text, through the output sink shared with ``qcompile-inspect``
(``qcompile.tools.output``). ``--help`` lists the suites, one line each (``SUMMARIES``).
A machine busier than its cores (1-minute load average above the core count) at the
start or the end of a suite gets a note on stderr: its numbers may be noisy.

The package: ``models`` (the model zoo), ``lm`` (the character LM), ``competitors``
(torch.ao, torchao and ``symbolic_trace`` adapters), ``measure`` (timing, peak RSS),
``workers`` (what runs in spawned processes) and ``suites`` (one module per suite group,
and the ``SUITES`` registry this command line dispatches on).

Example:
    >>> from qcompile.tools.bench import busy_note, deep_mlp
    >>> len(list(deep_mlp(3).modules())) > 3
    True
    >>> print(busy_note("step", "start", load=3.5, cores=2))  # doctest: +NORMALIZE_WHITESPACE
    qcompile-bench step: the machine is busy at the start (1-minute load average 3.50 on 2
    cores): its numbers may be noisy
    >>> busy_note("step", "end", load=1.5, cores=2) is None
    True
"""

from __future__ import annotations

import argparse
import os
import sys

from qcompile.tools.bench.models import deep_mlp, resnet_like, transformer
from qcompile.tools.bench.suites import SUITES, Suite
from qcompile.tools.output import FORMATS, Sink, note

__all__ = ["SUITES", "SUMMARIES", "Suite", "busy_note", "deep_mlp", "main", "parser",
           "resnet_like", "transformer"]

#: What each suite measures, in one line of ``--help`` (the module docstring says more).
SUMMARIES: dict[str, str] = {
    "pipeline": "partitioning time, bytes across cuts (fp32 vs int8), 2-stage GPipe step",
    "compile-once": "per-rank peak memory of compile_once on 1, 2, 4 ranks vs the naive way",
    "observer-sync": "collectives and bytes per step keeping 2 DDP ranks' observers equal",
    "hybrid": "traffic per step: 2 stages x 2 DDP replicas vs 4 replicas vs 4 stages",
    "tp": "tensor parallel QAT vs torch's float TP: bytes/rank, step, collectives",
    "compile": "compile time vs symbolic_trace and torch.ao prepare_qat_fx; scaling",
    "memory": "peak RSS of compile + QAT steps; FSDP2 step memory on 1, 2, 4 ranks",
    "step": "QAT training-step time vs fp32 eager, qcompile vs prepare_qat_fx",
    "fakequant": "fake-quant GB/s per granularity next to a copy and torch's own ops",
    "convert": "int8 latency after qc.convert vs fp32 and torch.ao convert_fx",
    "convert-presets": "converted int8-static / int8-qat presets vs fp32 and convert_fx",
    "onnx": "onnxruntime latency and file size of the QDQ export vs fp32 ONNX",
    "algorithms": "PTQ algorithms (CLE, SmoothQuant, AdaRound, GPTQ, ...) vs rounding",
    "torch-models": "torch's ~100 quantization test models: qcompile vs torch.ao coverage",
    "moe": "mixture-of-experts LMs: experts quantized, QAT loss, unchanged routing",
    "architectures": "every Hugging Face family under the LLM presets (the docs' table)",
    "llm": "a small LM's perplexity: fp32 vs PTQ, GPTQ and QAT in six formats",
    "adapters": "LoRA on a frozen quantized base vs peft and bitsandbytes NF4",
    "search": "qc.search's mixed precision vs uniform int4 / int8 under a bit budget",
    "cuda": "GPU: fake-quant bandwidth, compiled 8da4w step vs bf16 (needs CUDA)",
}


def busy_note(suite: str, when: str, *, load: float | None = None,
              cores: int | None = None) -> str | None:
    """The note for a machine busier than its cores when ``suite`` starts or ends
    (``when``), or None. ``load`` (the 1-minute load average) and ``cores`` default to
    this machine's; None where the system has no load average."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # Windows; a system without /proc/loadavg
            return None
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if load <= cores:
        return None
    return (f"qcompile-bench {suite}: the machine is busy at the {when} (1-minute load "
            f"average {load:.2f} on {cores} cores): its numbers may be noisy")


def _note_if_busy(suite: str, when: str) -> None:
    message = busy_note(suite, when)
    if message is not None:
        note(message)  # stderr: the results on stdout stay clean (and valid JSON)


def _suites_help() -> str:
    width = max(map(len, SUITES)) + 2
    return "suites:\n" + "\n".join(f"  {name:<{width}}{SUMMARIES.get(name, '')}".rstrip()
                                    for name in SUITES)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qcompile-bench", description=__doc__.split("\n\n")[0],
                                epilog=_suites_help(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES), metavar="SUITE",
                   help="the suite to run (listed below)")
    p.add_argument("--quick", action="store_true", help="smaller workloads")
    p.add_argument("--deploy", action="store_true",
                   help="llm only: a dense and an MoE LM exported to GGUF (Q4_0, Q4_K), their "
                        "perplexity measured inside llama.cpp (needs the llama extra)")
    p.add_argument("--format", choices=FORMATS, default="text",
                   help="text (default) or JSON")
    p.add_argument("--json", dest="format", action="store_const", const="json",
                   default="text", help="print JSON instead of text (= --format json)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    if args.deploy:
        if suite.deploy is None:
            p.error(f"--deploy applies to the llm suite, not {args.suite}")
        suite = Suite(suite.deploy, suite.deploy_text, suite.threads)
    if suite.threads is not None:
        import torch

        torch.set_num_threads(min(suite.threads, torch.get_num_threads()))
    # a busy machine makes timings noisy: say so when the suite starts and when it ends
    _note_if_busy(args.suite, "start")
    result = suite.run(args.quick)
    _note_if_busy(args.suite, "end")
    Sink(args.format).emit(result, suite.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
