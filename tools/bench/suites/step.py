"""The ``step`` suite: a QAT training step (forward, backward, SGD) relative to the fp32
eager step, qcompile int8-qat next to torch.ao ``prepare_qat_fx`` and, when installed,
torchao's QAT, on the MLP, the ResNet-18-style CNN and the transformer. Prints as
``records`` (one line per model).

Example:
    >>> from qcompile.tools.bench.suites.step import bench_step
    >>> bench_step.__doc__
    'Training step (fwd + bwd + SGD) relative to fp32 eager.'
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.tools.bench.competitors import has_torchao, prepare_qat_fx, torchao_qat
from qcompile.tools.bench.measure import median_seconds
from qcompile.tools.bench.models import workloads


def bench_step(quick: bool) -> dict[str, Any]:
    """Training step (fwd + bwd + SGD) relative to fp32 eager."""
    out: dict[str, Any] = {}
    for name, (make, x) in workloads(quick).items():
        torch.manual_seed(0)
        model = make()
        results = {}
        builds: list[tuple[str, Any]] = [
            ("fp32", lambda m: m),
            ("qcompile", lambda m, x=x: qc.qcompile(m, "int8-qat", (x,))),
            ("prepare_qat_fx", lambda m, x=x: prepare_qat_fx(m, x))]
        if has_torchao():  # optional competitor (fake-quantizes Linear layers only)
            builds.append(("torchao_qat", torchao_qat))
        for label, build in builds:
            m = build(copy.deepcopy(model).train())
            opt = torch.optim.SGD(m.parameters(), lr=1e-4)

            def step(m: nn.Module = m, opt: Any = opt, x: torch.Tensor = x) -> None:
                opt.zero_grad()
                m(x).float().square().mean().backward()
                opt.step()

            step()
            results[label] = median_seconds(step, 3 if quick else 10)
        out[name] = {**{f"{k}_s": v for k, v in results.items()},
                     **{f"{k}_vs_fp32": v / results["fp32"] for k, v in results.items()
                        if k != "fp32"}}
    if not has_torchao():
        out["note"] = "torchao not installed (pip install .[bench]): its QAT is not compared"
    return out
