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
  training step of a ~340M-parameter Llama-style model with ``8da4w-qat`` relative to its
  bf16 step, next to torchao's QAT (``tools/gpu-check`` runs it with the CUDA tests).

``--quick`` runs smaller workloads; ``--format json`` (or ``--json``) prints the result
dict as JSON instead of text, through the output sink shared with ``qcompile-inspect``
(``qcompile.tools.output``).

The package: ``models`` (the model zoo), ``lm`` (the character LM), ``competitors``
(torch.ao, torchao and ``symbolic_trace`` adapters), ``measure`` (timing, peak RSS),
``workers`` (what runs in spawned processes) and ``suites`` (one module per suite group,
and the ``SUITES`` registry this command line dispatches on).

Example:
    >>> from qcompile.tools.bench import deep_mlp
    >>> len(list(deep_mlp(3).modules())) > 3
    True
"""

from __future__ import annotations

import argparse
import sys

from qcompile.tools.bench.models import deep_mlp, resnet_like, transformer
from qcompile.tools.bench.suites import SUITES, Suite
from qcompile.tools.output import FORMATS, Sink

__all__ = ["SUITES", "Suite", "deep_mlp", "main", "parser", "resnet_like", "transformer"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qcompile-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=list(SUITES))
    p.add_argument("--quick", action="store_true", help="smaller workloads")
    p.add_argument("--format", choices=FORMATS, default="text",
                   help="text (default) or JSON")
    p.add_argument("--json", dest="format", action="store_const", const="json",
                   default="text", help="print JSON instead of text (= --format json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    suite = SUITES[args.suite]
    if suite.threads is not None:
        import torch

        torch.set_num_threads(min(suite.threads, torch.get_num_threads()))
    Sink(args.format).emit(suite.run(args.quick), suite.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
