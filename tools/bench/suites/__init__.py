"""The suites of ``qcompile-bench``, by subcommand name, in the order ``--help`` lists
them. A ``Suite`` is how to run it (``run(quick) -> result dict``), how its result reads
as text (``records`` unless it says it in sentences) and how many torch threads it may
use (``None``: as many as the process has).

Example:
    >>> from qcompile.tools.bench.suites import SUITES
    >>> list(SUITES)[:3]
    ['pipeline', 'compile-once', 'observer-sync']
    >>> SUITES["step"].threads
    2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qcompile.tools.bench.suites.adapters import adapters_text, bench_adapters
from qcompile.tools.bench.suites.algorithms import algorithms_text, bench_algorithms
from qcompile.tools.bench.suites.architectures import architectures_text, bench_architectures
from qcompile.tools.bench.suites.compile import bench_compile, bench_memory, memory_text
from qcompile.tools.bench.suites.convert import bench_convert
from qcompile.tools.bench.suites.convert_presets import bench_convert_presets
from qcompile.tools.bench.suites.cuda import bench_cuda, cuda_text
from qcompile.tools.bench.suites.deploy import bench_deploy, deploy_text
from qcompile.tools.bench.suites.distributed import (
    compile_once_text,
    hybrid_text,
    observer_sync_text,
    pipeline_text,
    run_compile_once,
    run_hybrid,
    run_observer_sync,
    run_pipeline,
)
from qcompile.tools.bench.suites.fakequant import bench_fakequant
from qcompile.tools.bench.suites.llm import bench_llm, llm_text
from qcompile.tools.bench.suites.moe import bench_moe
from qcompile.tools.bench.suites.onnx import bench_onnx
from qcompile.tools.bench.suites.search import bench_search, search_text
from qcompile.tools.bench.suites.step import bench_step
from qcompile.tools.bench.suites.torch_models import bench_torch_models, torch_models_text
from qcompile.tools.bench.suites.tp import run_tp, tp_text
from qcompile.tools.output import records


@dataclass(frozen=True)
class Suite:
    run: Callable[[bool], dict[str, Any]]
    text: Callable[[dict[str, Any]], str] = records
    threads: int | None = None  # cap torch's intra-op threads at this many
    # what --deploy runs instead (the llm suite: the model served by llama.cpp), and its text
    deploy: Callable[[bool], dict[str, Any]] | None = None
    deploy_text: Callable[[dict[str, Any]], str] = records


SUITES: dict[str, Suite] = {
    "pipeline": Suite(run_pipeline, pipeline_text),
    "compile-once": Suite(run_compile_once, compile_once_text),
    "observer-sync": Suite(run_observer_sync, observer_sync_text),
    "hybrid": Suite(run_hybrid, hybrid_text),
    "tp": Suite(run_tp, tp_text),
    "compile": Suite(bench_compile, threads=2),
    "memory": Suite(bench_memory, memory_text, threads=2),
    "step": Suite(bench_step, threads=2),
    "fakequant": Suite(bench_fakequant, threads=2),
    "convert": Suite(bench_convert, threads=2),
    "convert-presets": Suite(bench_convert_presets, threads=2),
    "onnx": Suite(bench_onnx, threads=2),
    "algorithms": Suite(bench_algorithms, algorithms_text, threads=2),
    "torch-models": Suite(bench_torch_models, torch_models_text, threads=2),
    "moe": Suite(bench_moe, threads=2),
    "architectures": Suite(bench_architectures, architectures_text, threads=2),
    "llm": Suite(bench_llm, llm_text, threads=2, deploy=bench_deploy, deploy_text=deploy_text),
    "adapters": Suite(bench_adapters, adapters_text, threads=2),
    "search": Suite(bench_search, search_text, threads=2),
    "cuda": Suite(bench_cuda, cuda_text),
}
