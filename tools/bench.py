"""``qcompile-bench``: side-by-side measurements, medians and ratios in one run.

Subcommands:

- ``pipeline``: partitioning time on a ~10,000-node graph, bytes crossing each cut with
  ``transfer: fp32`` vs ``int8``, and the step time of a 2-stage GPipe pipeline (2 ranks,
  gloo, CPU) next to the same model trained in one process.
- ``compile-once``: peak RSS of each rank when two ranks share one compile of a ~400 MB
  model (``qc.distributed.compile_once``: rank 1 builds on the meta device).
- ``observer-sync``: collectives and bytes per step that keep observers identical on 2
  DDP ranks (one flattened collective per reduction kind, whatever the quantizer count).
- ``compile``: compile time of qcompile int8-qat and torch.ao ``prepare_qat_fx`` relative
  to ``torch.fx.symbolic_trace`` (MLP, ResNet-18-style CNN, 12-layer transformer), and
  compile time of 50..400-block MLPs (scaling).
- ``memory``: peak RSS of compile + 2 QAT steps of the 12-layer transformer, qcompile
  (with and without its copy of the model) vs torch.ao ``prepare_qat_fx``, each in a
  fresh process.
- ``step``: QAT training-step time relative to the fp32 eager step, qcompile vs
  ``prepare_qat_fx``, same models.
- ``convert``: int8 inference latency after ``qc.convert`` vs fp32, next to torch.ao
  ``convert_fx`` (MLP at batch 64 and 1, ResNet-style CNN at batch 32).
- ``fakequant``: fake-quant throughput (GB/s, forward and forward+backward) per-tensor /
  per-channel / per-group / LSQ next to ``y.copy_(x)`` and torch's built-in ops.

Example:
    >>> from qcompile.tools.bench import deep_mlp
    >>> len(list(deep_mlp(3).modules())) > 3
    True
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import qcompile as qc


def deep_mlp(blocks: int, width: int = 64) -> nn.Sequential:
    """``blocks`` x (Linear + ReLU): the scaling workload."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _median(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_partition(blocks: int, stages: int) -> dict[str, Any]:
    model = deep_mlp(blocks)
    x = torch.randn(8, 64)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["pipeline"] = {"stages": stages, "balance": "flops"}
    gm = qc.qcompile(model, spec, example_inputs=(x,))
    report = qc.report(gm)
    seconds = {p.name: p.seconds for p in report.passes}
    nodes = next(p.nodes_after for p in report.passes if p.name == "partition")
    return {"graph_nodes": nodes, "stages": stages, "partition_s": seconds["partition"],
            "place_s": seconds["place"], "balance_ratio": report.balance_ratio}


def bench_transfer(blocks: int = 8, batch: int = 64) -> dict[str, Any]:
    model = deep_mlp(blocks, 256)
    x = torch.randn(batch, 256)
    out = {}
    for transfer in ("fp32", "int8"):
        spec = qc.load_spec("int8-qat").model_dump()
        spec["pipeline"] = {"stages": 2, "transfer": transfer}
        gm = qc.qcompile(model, spec, example_inputs=(x,))
        out[transfer] = qc.report(gm).stages[0].bytes_out
    out["ratio"] = out["fp32"] / out["int8"]
    return out


def _rank(rank: int, store: str, steps: int, result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = deep_mlp(16, 256)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["pipeline"] = {"stages": 2, "microbatches": 4}
    gm = qc.qcompile(model, spec, example_inputs=(x[:16],))
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()

    step()
    dist.barrier()
    seconds = _median(step, steps)
    if rank == 0:
        with open(result, "w") as f:
            json.dump({"pipeline_step_s": seconds}, f)
    dist.destroy_process_group()


def bench_pipeline_step(steps: int = 10) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = deep_mlp(16, 256)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    gm = qc.qcompile(model, "int8-qat", example_inputs=(x[:16],))
    opt = torch.optim.SGD(gm.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(4), y.chunk(4)):  # the same 4 micro-batches
            (nn.functional.mse_loss(gm(xm), ym) / 4).backward()
        opt.step()

    step()
    single = _median(step, steps)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_rank, args=(os.path.join(tmp, "store"), steps, result),
                                    nprocs=2, join=True)
        with open(result) as f:
            piped = json.load(f)["pipeline_step_s"]
    return {"one_process_step_s": single, "pipeline_step_s": piped,
            "pipeline_vs_one_process": piped / single}


def _big_model(layers: int = 24, width: int = 2048) -> nn.Sequential:
    """~400 MB of fp32 weights at the defaults."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _compile_once_rank(rank: int, store: str, layers: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    base = _peak_rss_mb()
    torch.manual_seed(0)
    gm = qc.distributed.compile_once(lambda: _big_model(layers), "int8-qat",
                                     (torch.randn(2, 2048),))
    params = sum(p.numel() for p in gm.parameters()) * 4 / 2**20
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_mb": _peak_rss_mb(), "import_mb": base, "model_mb": params}, f)
    dist.destroy_process_group()


def bench_compile_once(layers: int) -> dict[str, Any]:
    """Peak RSS per rank of compile_once on two ranks (rank 1 builds on meta)."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_compile_once_rank,
                                    args=(os.path.join(tmp, "store"), layers, tmp),
                                    nprocs=2, join=True)
        ranks = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    net = [r["peak_mb"] - r["import_mb"] for r in ranks]  # above the torch-import baseline
    return {"model_mb": ranks[0]["model_mb"], "rank0_peak_mb": ranks[0]["peak_mb"],
            "rank1_peak_mb": ranks[1]["peak_mb"],
            "rank1_vs_rank0": ranks[1]["peak_mb"] / ranks[0]["peak_mb"],
            "rank0_net_mb": net[0], "rank1_net_mb": net[1], "net_ratio": net[1] / net[0]}


def _sync_rank(rank: int, store: str, quantized_layers: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = deep_mlp(quantized_layers, 64)
    spec = qc.load_spec("int8-qat").model_dump()
    spec["data_parallel"] = {"kind": "ddp"}
    gm = qc.qcompile(model, spec, example_inputs=(torch.randn(2, 64),))
    ddp = DistributedDataParallel(gm)  # the observer sync itself is measured directly
    counts = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:  # count every all_reduce of a step
        counts[-1] += 1
        return original(*args, **kwargs)

    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(3):
        counts.append(0)
        dist.all_reduce = counting
        try:
            ddp(torch.randn(16, 64)).square().mean().backward()
            stats = qc.distributed.sync_observers(gm)
        finally:
            dist.all_reduce = original
        opt.step()
    if rank == 0:
        with open(os.path.join(out_dir, "sync.json"), "w") as f:
            json.dump({"quantizers": len(qc.quantizers(gm)), "collectives": stats["collectives"],
                       "bytes": stats["bytes"], "all_reduce_calls": counts[-1]}, f)
    dist.destroy_process_group()


def bench_observer_sync(layers: int = 16) -> dict[str, Any]:
    """Collectives and bytes per step of observer synchronisation on 2 DDP ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_sync_rank, args=(os.path.join(tmp, "store"), layers, tmp),
                                    nprocs=2, join=True)
        with open(os.path.join(tmp, "sync.json")) as f:
            return json.load(f)


# -- issue 7's side-by-side suites: compile, training step, fake-quant throughput --------------
class _Block(nn.Module):
    def __init__(self, d: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2, self.act = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, -1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


def transformer(layers: int = 12) -> nn.Module:
    return nn.Sequential(*[_Block() for _ in range(layers)])


def _basic(cin: int, cout: int, stride: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


def resnet_like() -> nn.Module:
    """A ResNet-18-shaped CNN for 32x32 inputs (plain blocks; torch.fx traces it as is)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
                         (512, 1)):
        layers.append(_basic(cin, cout, stride))
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers)


def _workloads(quick: bool) -> dict[str, tuple[Any, torch.Tensor]]:
    return {
        "mlp": (lambda: deep_mlp(4, 1024), torch.randn(64, 1024)),
        "cnn": (resnet_like, torch.randn(8 if quick else 32, 3, 32, 32)),
        "transformer": (lambda: transformer(4 if quick else 12),
                        torch.randn(2 if quick else 8, 32 if quick else 128, 256)),
    }


def _prepare_qat_fx(model: nn.Module, x: torch.Tensor) -> nn.Module:
    import warnings

    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_qat_fx(model.train(), get_default_qat_qconfig_mapping("x86"), (x,))


def _torchao_qat(model: nn.Module) -> nn.Module:
    """torchao's QAT prepare on ``model`` (in place) with the closest recipe to int8-qat:
    int8 per-channel symmetric weights, int8 per-token asymmetric activations. It swaps
    ``nn.Linear`` only (convolutions stay float). Needs torchao (``pip install .[bench]``)."""
    import warnings

    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
        weight = IntxFakeQuantizeConfig(torch.int8, granularity="per_channel")
        quantize_(model, QATConfig(activation_config=act, weight_config=weight,
                                   step="prepare"))
    return model


def _has_torchao() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def bench_compile(quick: bool) -> dict[str, Any]:
    """Compile time: symbolic_trace vs qcompile int8-qat (also ``inplace=True``, which skips
    qcompile's copy of the model) vs prepare_qat_fx (on a copy, as qcompile makes one), and
    scaling with depth. Each model's contenders run once untimed (warm-up), then in
    interleaved rounds; medians of the rounds. Models are built outside the timings."""
    import copy

    rounds = 3 if quick else 5
    out: dict[str, Any] = {}
    for name, (make, x) in _workloads(quick).items():
        torch.manual_seed(0)
        model = make()
        runs = {
            "symbolic_trace": lambda m, x=x: torch.fx.symbolic_trace(m),
            "qcompile": lambda m, x=x: qc.qcompile(m, "int8-qat", (x,)),
            "qcompile_inplace": lambda m, x=x: qc.qcompile(m, "int8-qat", (x,), inplace=True),
            "prepare_qat_fx": lambda m, x=x: _prepare_qat_fx(copy.deepcopy(m), x),
        }
        if _has_torchao():  # optional competitor (Linear layers only)
            runs["torchao_qat"] = lambda m: _torchao_qat(copy.deepcopy(m))
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(rounds + 1):
            for key, fn in runs.items():
                m = copy.deepcopy(model) if key == "qcompile_inplace" else model
                t0 = time.perf_counter()
                fn(m)
                if r:  # round 0 warms up
                    times[key].append(time.perf_counter() - t0)
        t = {k: statistics.median(v) for k, v in times.items()}
        out[name] = {f"{k}_s": v for k, v in t.items()}
        for k in t:
            if k != "symbolic_trace":
                out[name][f"{k}_vs_trace"] = t[k] / t["symbolic_trace"]
    sizes = (50, 100) if quick else (50, 100, 200, 400)
    qc.qcompile(deep_mlp(10), "int8-qat", (torch.randn(4, 64),))  # warm up imports and caches
    scaling: dict[int, float] = {}
    for n in sizes:
        times_n = []
        for _ in range(rounds):
            m, x = deep_mlp(n), torch.randn(4, 64)
            t0 = time.perf_counter()
            qc.qcompile(m, "int8-qat", (x,))
            times_n.append(time.perf_counter() - t0)
        scaling[n] = statistics.median(times_n)
    out["scaling_s"] = scaling
    out["scaling_ratio"] = scaling[sizes[-1]] / scaling[sizes[0]]
    return out


def _memory_worker(how: str, quick: bool, out: str) -> None:
    """One fresh process: import, build the transformer, compile it ``how`` (qcompile
    int8-qat with its copy of the model, qcompile ``inplace=True``, or torch.ao
    ``prepare_qat_fx``, which rewrites the model in place), train 2 QAT steps; peak RSS
    (ru_maxrss) after each stage."""
    import resource  # noqa: F401  (the peak comes from _peak_rss_mb)
    import warnings

    from torch.ao.quantization import get_default_qat_qconfig_mapping  # both sides import it
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    torch.set_num_threads(min(2, torch.get_num_threads()))
    assert qc.qcompile is not None  # qcompile's modules load lazily: in the baseline too
    stages = {"import_mb": _peak_rss_mb()}
    torch.manual_seed(0)
    model = transformer(4 if quick else 12).train()
    x = torch.randn(2 if quick else 8, 32 if quick else 128, 256)
    stages["model_mb"] = _peak_rss_mb()
    if how == "prepare_qat_fx":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = prepare_qat_fx(model, get_default_qat_qconfig_mapping("x86"), (x,))
    else:
        gm = qc.qcompile(model, "int8-qat", (x,), inplace=how == "qcompile_inplace")
    stages["compile_mb"] = _peak_rss_mb()
    opt = torch.optim.SGD(gm.parameters(), lr=1e-4)
    for _ in range(2):
        opt.zero_grad()
        gm(x).square().mean().backward()
        opt.step()
    stages["peak_mb"] = _peak_rss_mb()
    stages["weights_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with open(out, "w") as f:
        json.dump(stages, f)


def bench_memory(quick: bool) -> dict[str, Any]:
    """Peak RSS (MB) of compile + 2 QAT steps of the transformer (12 layers; 4 with
    ``quick``), each way in a fresh process: qcompile (which compiles a copy and leaves the
    model alone), qcompile ``inplace=True``, and torch.ao ``prepare_qat_fx`` (in place).
    ``*_net_mb`` is above the process's RSS after imports (torch, qcompile, torch.ao)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {}
    hows = ("qcompile", "qcompile_inplace", "prepare_qat_fx")
    with tempfile.TemporaryDirectory() as tmp:
        # concurrently: each process's peak RSS is its own, and the imports dominate the time
        procs = {how: ctx.Process(target=_memory_worker,
                                  args=(how, quick, os.path.join(tmp, f"{how}.json")))
                 for how in hows}
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join()
        for how, p in procs.items():
            if p.exitcode != 0:
                raise RuntimeError(f"memory worker {how!r} exited with {p.exitcode}")
            with open(os.path.join(tmp, f"{how}.json")) as f:
                r = json.load(f)
            out[how] = {"peak_mb": r["peak_mb"], "net_mb": r["peak_mb"] - r["import_mb"],
                        "after_compile_mb": r["compile_mb"], "import_mb": r["import_mb"],
                        "weights_mb": r["weights_mb"]}
    ao = out["prepare_qat_fx"]
    for how in ("qcompile", "qcompile_inplace"):
        out[f"{how}_vs_prepare_qat_fx"] = out[how]["peak_mb"] / ao["peak_mb"]
        out[f"{how}_vs_prepare_qat_fx_net"] = out[how]["net_mb"] / ao["net_mb"]
    return out


def bench_step(quick: bool) -> dict[str, Any]:
    """Training step (fwd + bwd + SGD) relative to fp32 eager."""
    import copy

    out: dict[str, Any] = {}
    for name, (make, x) in _workloads(quick).items():
        torch.manual_seed(0)
        model = make()
        results = {}
        builds: list[tuple[str, Any]] = [
            ("fp32", lambda m: m),
            ("qcompile", lambda m, x=x: qc.qcompile(m, "int8-qat", (x,))),
            ("prepare_qat_fx", lambda m, x=x: _prepare_qat_fx(m, x))]
        if _has_torchao():  # optional competitor (fake-quantizes Linear layers only)
            builds.append(("torchao_qat", _torchao_qat))
        for label, build in builds:
            m = build(copy.deepcopy(model).train())
            opt = torch.optim.SGD(m.parameters(), lr=1e-4)

            def step(m: nn.Module = m, opt: Any = opt, x: torch.Tensor = x) -> None:
                opt.zero_grad()
                m(x).float().square().mean().backward()
                opt.step()

            step()
            results[label] = _median(step, 3 if quick else 10)
        out[name] = {**{f"{k}_s": v for k, v in results.items()},
                     **{f"{k}_vs_fp32": v / results["fp32"] for k, v in results.items()
                        if k != "fp32"}}
    if not _has_torchao():
        out["note"] = "torchao not installed (pip install .[bench]): its QAT is not compared"
    return out


def _fakequant_cases(x: torch.Tensor, only: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
    """name -> (qcompile FakeQuantize, torch's built-in op of the same kind) on ``x``
    ([rows, 1024]); per-group has no built-in op of its own: torch's per-channel op on
    the [rows * groups, group_size] view computes the same thing."""
    from qcompile.runtime.fake_quant import FakeQuantize

    rows, cols = x.shape
    kinds = {"per_tensor": {},
             "per_channel": {"granularity": "per_channel", "axis": 0, "channels": rows},
             "per_channel_last": {"granularity": "per_channel", "axis": -1, "channels": cols},
             "per_group": {"granularity": "per_group", "group_size": 128,
                           "channels": rows * cols // 128},
             "lsq": {"learnable": True},
             "lsq_per_channel": {"learnable": True, "granularity": "per_channel", "axis": 0,
                                 "channels": rows}}
    cases: dict[str, tuple[Any, Any]] = {}
    for name, kw in kinds.items():
        if only and name not in only:
            continue
        fq = FakeQuantize("int8", **kw)
        fq(x)
        fq.observe = False
        s, z = fq.scale.detach().clone(), fq.zero_point.clone()
        sp, zf = s.clone().requires_grad_(True), z.float()
        builtin = {
            "per_tensor": lambda t, s=s, z=z: torch.fake_quantize_per_tensor_affine(
                t, float(s), int(z), -128, 127),
            "per_channel": lambda t, s=s, z=z: torch.fake_quantize_per_channel_affine(
                t, s, z, 0, -128, 127),
            "per_channel_last": lambda t, s=s, z=z: torch.fake_quantize_per_channel_affine(
                t, s, z, 1, -128, 127),
            "per_group": lambda t, s=s, z=z: torch.fake_quantize_per_channel_affine(
                t.reshape(-1, 128), s, z, 0, -128, 127).view_as(t),
            "lsq": lambda t, sp=sp, zf=zf: torch._fake_quantize_learnable_per_tensor_affine(
                t, sp, zf, -128, 127, 1.0),
            "lsq_per_channel": lambda t, sp=sp, zf=zf:
                torch._fake_quantize_learnable_per_channel_affine(t, sp, zf, 0, -128, 127, 1.0),
        }[name]
        cases[name] = (fq, builtin)
    return cases


def bench_fakequant(quick: bool) -> dict[str, Any]:
    """Fake-quant throughput (GB/s), qcompile vs torch's built-in op of the same kind, next
    to ``y.copy_(x)``, all interleaved in one run (medians of the rounds).

    GB/s counts the bytes every implementation must move: the forward reads x and writes
    the output (2 x 4 bytes per element, like the copy); forward+backward also reads the
    output's gradient and writes x's (4 x 4 bytes; saved state such as a mask is not
    counted). The backward gets a dense upstream gradient (``out.backward(g)``).
    ``small_64x64_us``: per-call time on a 64x64 tensor (dispatch overhead)."""
    from qcompile.runtime import kernels

    n = (1 if quick else 16) * 1024 * 1024
    rounds = 3 if quick else 7
    x = torch.randn(n // 1024, 1024)
    g = torch.randn_like(x)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()

    def fwd(fn: Any, t: torch.Tensor = x) -> Any:
        return lambda: fn(t)

    def fwd_bwd(fn: Any, t: torch.Tensor = x, grad: torch.Tensor = g) -> Any:
        def run() -> None:
            fn(t.detach().requires_grad_(True)).backward(grad)
        return run

    cases = _fakequant_cases(x)
    runs: list[tuple[str, Any]] = []
    for name, (fq, builtin) in cases.items():
        runs.append(("copy", lambda: y.copy_(x)))  # a copy next to every case
        for impl, fn in (("qcompile", fq), ("torch", builtin)):
            runs.append((f"{name}.{impl}_fwd", fwd(fn)))
            runs.append((f"{name}.{impl}_fwd_bwd", fwd_bwd(fn)))
    times: dict[str, list[float]] = {k: [] for k, _ in runs}
    for _, fn in runs:  # warm up (allocator, first-call paths)
        fn()
    for _ in range(rounds):
        for key, fn in runs:
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    t = {k: statistics.median(v) for k, v in times.items()}
    copy_gbps = 2 * nbytes / t["copy"] / 1e9
    out: dict[str, Any] = {"elements": n, "copy_GBps": copy_gbps,
                           "kernels": 1 if kernels.available() else 0}
    for name in cases:
        row: dict[str, Any] = {}
        for key, tensors in (("fwd", 2), ("fwd_bwd", 4)):
            for impl in ("qcompile", "torch"):
                row[f"{impl}_{key}_GBps"] = tensors * nbytes / t[f"{name}.{impl}_{key}"] / 1e9
            row[f"speedup_{key}"] = t[f"{name}.torch_{key}"] / t[f"{name}.qcompile_{key}"]
            row[f"{key}_vs_copy"] = row[f"qcompile_{key}_GBps"] / copy_gbps
        out[name] = row
    # per-call overhead: a 64x64 per-tensor quantizer, forward and forward+backward
    small = torch.randn(64, 64)
    fq, builtin = _fakequant_cases(small, ("per_tensor",))["per_tensor"]
    gs = torch.randn_like(small)
    calls = 50 if quick else 500
    row = {}
    for impl, fn in (("qcompile", fq), ("torch", builtin)):
        for key, run in (("fwd", fwd(fn, small)), ("fwd_bwd", fwd_bwd(fn, small, gs))):
            def many(run: Any = run) -> None:
                for _ in range(calls):
                    run()
            many()
            row[f"{impl}_{key}_us"] = _median(many, rounds) / calls * 1e6
    out["small_64x64_us"] = row
    return out


def _int8_spec() -> qc.CompileSpec:
    """int8-static, plus quantized model inputs and pooled features, so every conv and
    linear reads integers (what torch.ao's prepare_fx does by default)."""
    d = qc.load_spec("int8-static").model_dump()
    d["quant"]["inputs"] = {"dtype": "uint8", "symmetric": False}
    d["quant"]["rules"].append({"match": {"module": "AdaptiveAvgPool2d"}, "optional": True,
                                "activation": {"dtype": "uint8", "symmetric": False}})
    return qc.CompileSpec.model_validate(d)


def bench_convert(quick: bool) -> dict[str, Any]:
    """Inference latency of converted int8 graphs relative to fp32 eager: ``qc.convert``
    next to torch.ao ``prepare_fx`` + ``convert_fx`` (x86 default qconfig) on the same
    models, calibrated on the same batches."""
    import copy
    import warnings

    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    cases = {"mlp_b64": (lambda: deep_mlp(4, 1024), (64, 1024)),
             "mlp_b1": (lambda: deep_mlp(4, 1024), (1, 1024)),
             "cnn_b32": (resnet_like, (8 if quick else 32, 3, 32, 32))}
    out: dict[str, Any] = {}
    for name, (make, shape) in cases.items():
        torch.manual_seed(0)
        model = make().eval()
        calib = [(torch.randn(shape),) for _ in range(2 if quick else 8)]
        x = torch.randn(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = qc.qcompile(model, _int8_spec(), calib[0])
            qc.calibrate(gm, calib, progress=False)
            ours = qc.convert(gm)
            ao = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), calib[0])
            with torch.no_grad():
                for b in calib:
                    ao(*b)
            ao = convert_fx(ao)
        kernels = sum(c.path in ("kernel", "dynamic_kernel") for c in qc.report(ours).conversions)
        repeat = 3 if quick else (40 if shape[0] == 1 else 8)
        runs: dict[str, list[float]] = {"fp32": [], "qcompile": [], "convert_fx": []}
        contenders = (("fp32", model), ("qcompile", ours), ("convert_fx", ao))
        with torch.inference_mode():
            for _, m in contenders:
                m(x)  # warm-up
            # Rounds of back-to-back calls per contender (warm caches: the fp32 model's
            # 16 MB of weights would evict the int8 ones for whoever runs right after it),
            # contenders interleaved round by round.
            for _ in range(5):
                for label, m in contenders:
                    block = []
                    for _ in range(repeat):
                        t0 = time.perf_counter()
                        m(x)
                        block.append(time.perf_counter() - t0)
                    runs[label].append(statistics.median(block))
            dev = float((ours(x) - gm.eval()(x)).abs().max())
        times = {k: statistics.median(v) for k, v in runs.items()}
        out[name] = {**{f"{k}_ms": v * 1e3 for k, v in times.items()},
                     "qcompile_speedup": times["fp32"] / times["qcompile"],
                     "convert_fx_speedup": times["fp32"] / times["convert_fx"],
                     "kernels": kernels, "max_dev_vs_fake_quant": dev}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qcompile-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=["pipeline", "compile-once", "observer-sync",
                                          "compile", "memory", "step", "fakequant",
                                          "convert"])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.suite in ("compile", "memory", "step", "fakequant", "convert"):
        torch.set_num_threads(min(2, torch.get_num_threads()))
        fn = {"compile": bench_compile, "memory": bench_memory, "step": bench_step,
              "fakequant": bench_fakequant, "convert": bench_convert}
        r = fn[args.suite](args.quick)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            for name, row in r.items():
                if isinstance(row, dict):
                    cells = ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                      if isinstance(v, (int, float)))
                    print(f"{name}: {cells}")
                else:
                    print(f"{name}: {row if isinstance(row, str) else format(row, '.3g')}")
        return 0
    if args.suite == "observer-sync":
        r = bench_observer_sync()
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"observer sync on 2 DDP ranks: {r['quantizers']} quantizers, "
                  f"{r['collectives']} collective(s) and {r['bytes']} bytes per step "
                  f"({r['all_reduce_calls']} all_reduce call(s) from qcompile in the step)")
        return 0
    if args.suite == "compile-once":
        r = bench_compile_once(6 if args.quick else 24)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"compile_once of a {r['model_mb']:.0f} MB model on 2 ranks: peak RSS rank 0 "
                  f"{r['rank0_peak_mb']:.0f} MB, rank 1 {r['rank1_peak_mb']:.0f} MB "
                  f"({r['rank1_vs_rank0']:.0%} of rank 0); above the torch import: rank 0 "
                  f"{r['rank0_net_mb']:.0f} MB, rank 1 {r['rank1_net_mb']:.0f} MB "
                  f"({r['net_ratio']:.0%})")
        return 0
    blocks = 300 if args.quick else 1667  # 6 nodes per block in an int8-qat graph: ~10,000
    results = {
        "partition": bench_partition(blocks, 4),
        "transfer_bytes": bench_transfer(),
        "step": bench_pipeline_step(3 if args.quick else 10),
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    p, t, s = results["partition"], results["transfer_bytes"], results["step"]
    print(f"partition: {p['graph_nodes']} nodes into {p['stages']} stages in "
          f"{p['partition_s'] * 1e3:.0f} ms (place {p['place_s'] * 1e3:.0f} ms), "
          f"balance max/mean {p['balance_ratio']:.3f}")
    print(f"bytes across the cut per forward: fp32 {t['fp32']}, int8 {t['int8']} "
          f"({t['ratio']:.2f}x fewer)")
    print(f"train step (4 micro-batches): one process {s['one_process_step_s'] * 1e3:.1f} ms, "
          f"2-stage GPipe on 2 ranks {s['pipeline_step_s'] * 1e3:.1f} ms "
          f"(ratio {s['pipeline_vs_one_process']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
