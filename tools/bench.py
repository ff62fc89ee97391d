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
- ``step``: QAT training-step time relative to the fp32 eager step, qcompile vs
  ``prepare_qat_fx``, same models.
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


def bench_compile(quick: bool) -> dict[str, Any]:
    """Compile time: symbolic_trace vs qcompile int8-qat vs prepare_qat_fx, and scaling."""
    import copy

    out: dict[str, Any] = {}
    for name, (make, x) in _workloads(quick).items():
        torch.manual_seed(0)
        model = make()
        trace = _median(lambda m=model: torch.fx.symbolic_trace(m), 3)
        ours = _median(lambda m=model, x=x: qc.qcompile(m, "int8-qat", (x,)), 3)
        ao = _median(lambda m=model, x=x: _prepare_qat_fx(copy.deepcopy(m), x), 3)
        out[name] = {"symbolic_trace_s": trace, "qcompile_s": ours, "prepare_qat_fx_s": ao,
                     "qcompile_vs_trace": ours / trace, "prepare_qat_fx_vs_trace": ao / trace}
    sizes = (50, 100) if quick else (50, 100, 200, 400)
    qc.qcompile(deep_mlp(10), "int8-qat", (torch.randn(4, 64),))  # warm up imports and caches
    scaling = {n: _median(lambda n=n: qc.qcompile(deep_mlp(n), "int8-qat",
                                                    (torch.randn(4, 64),)), 1) for n in sizes}
    out["scaling_s"] = scaling
    out["scaling_ratio"] = scaling[sizes[-1]] / scaling[sizes[0]]
    return out


def bench_step(quick: bool) -> dict[str, Any]:
    """Training step (fwd + bwd + SGD) relative to fp32 eager."""
    import copy

    out: dict[str, Any] = {}
    for name, (make, x) in _workloads(quick).items():
        torch.manual_seed(0)
        model = make()
        results = {}
        for label, build in (("fp32", lambda m: m),
                             ("qcompile", lambda m, x=x: qc.qcompile(m, "int8-qat", (x,))),
                             ("prepare_qat_fx", lambda m, x=x: _prepare_qat_fx(m, x))):
            m = build(copy.deepcopy(model).train())
            opt = torch.optim.SGD(m.parameters(), lr=1e-4)

            def step(m: nn.Module = m, opt: Any = opt, x: torch.Tensor = x) -> None:
                opt.zero_grad()
                m(x).float().square().mean().backward()
                opt.step()

            step()
            results[label] = _median(step, 3 if quick else 10)
        out[name] = {**{f"{k}_s": v for k, v in results.items()},
                     "qcompile_vs_fp32": results["qcompile"] / results["fp32"],
                     "prepare_qat_fx_vs_fp32": results["prepare_qat_fx"] / results["fp32"]}
    return out


def bench_fakequant(quick: bool) -> dict[str, Any]:
    """GB/s (read + write of the tensor) of fake-quant forward and forward+backward."""
    from qcompile.fake_quant import FakeQuantize

    n = (1 if quick else 16) * 1024 * 1024
    x = torch.randn(n // 1024, 1024)
    gb = 2 * x.numel() * 4 / 1e9
    y = torch.empty_like(x)
    out: dict[str, Any] = {"copy_GBps": gb / _median(lambda: y.copy_(x), 5)}

    def rate(fn: Any, backward: bool) -> float:
        def run() -> None:
            xi = x.detach().requires_grad_(backward)
            r = fn(xi)
            if backward:
                r.sum().backward()
        return gb / _median(run, 5)

    cases: dict[str, tuple[FakeQuantize, Any]] = {}
    for name, kw in (("per_tensor", {}),
                     ("per_channel", {"granularity": "per_channel", "axis": 0,
                                      "channels": x.shape[0]}),
                     ("per_group", {"granularity": "per_group", "group_size": 128,
                                    "channels": x.shape[0] * 8}),
                     ("lsq", {"learnable": True})):
        fq = FakeQuantize("int8", **kw)
        fq(x)
        fq.observe = False
        s, z = fq.scale.detach().clone(), fq.zero_point.clone()
        if name == "per_tensor":
            builtin = lambda t, s=s, z=z: torch.fake_quantize_per_tensor_affine(  # noqa: E731
                t, float(s), int(z), -128, 127)
        elif name == "per_channel":
            builtin = lambda t, s=s, z=z: torch.fake_quantize_per_channel_affine(  # noqa: E731
                t, s, z, 0, -128, 127)
        elif name == "lsq":
            sp = s.clone().requires_grad_(True)
            builtin = lambda t, sp=sp, z=z: torch._fake_quantize_learnable_per_tensor_affine(  # noqa: E731
                t, sp, z.float(), -128, 127, 1.0)
        else:
            builtin = None
        cases[name] = (fq, builtin)
    for name, (fq, builtin) in cases.items():
        row: dict[str, Any] = {}
        for backward in (False, True):
            key = "fwd_bwd" if backward else "fwd"
            row[f"qcompile_{key}_GBps"] = rate(fq, backward)
            if builtin is not None:
                row[f"torch_{key}_GBps"] = rate(builtin, backward)
                row[f"speedup_{key}"] = row[f"qcompile_{key}_GBps"] / row[f"torch_{key}_GBps"]
        row["fwd_vs_copy"] = row["qcompile_fwd_GBps"] / out["copy_GBps"]
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qcompile-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=["pipeline", "compile-once", "observer-sync",
                                          "compile", "step", "fakequant"])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.suite in ("compile", "step", "fakequant"):
        torch.set_num_threads(min(2, torch.get_num_threads()))
        fn = {"compile": bench_compile, "step": bench_step, "fakequant": bench_fakequant}
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
                    print(f"{name}: {row:.3g}")
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
