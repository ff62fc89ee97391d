"""Models, data and measurements shared by the tests of the data-driven PTQ algorithms
(``bias_correction``, ``adaround``, ``gptq``): small nets on correlated, off-centre inputs,
where low-bit round-to-nearest is measurably worse than the algorithms."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import qcompile as qc
from qcompile.api import weight_quantizers

D_IN = 16


def mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 32, bias=bias), nn.ReLU(), nn.Linear(32, 32, bias=bias),
                         nn.ReLU(), nn.Linear(32, 8, bias=bias))


class ConvNet(nn.Module):
    """Conv (stride 2, padding 1) -> ReLU -> conv (dilation 2) -> ReLU -> conv1d view ->
    flatten -> Linear: every way a layer's inputs are unfolded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, dilation=2, padding=2, bias=False)
        self.c3 = nn.Conv1d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        h = torch.relu(self.c3(h.flatten(2)))
        return self.fc(h.flatten(1))


def mlp_data(n: int, seed: int) -> torch.Tensor:
    """Correlated inputs with a non-zero mean (what makes rounding errors add up)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(D_IN, D_IN, generator=torch.Generator().manual_seed(99)) / 4 + torch.eye(D_IN)
    return torch.randn(n, D_IN, generator=g) @ mix + 0.5


def conv_data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g) + 0.3


def spec(algorithms: list[dict[str, Any]], *, dtype: str = "int3",
         granularity: str = "per_channel", mode: str = "static", method: str = "symbolic",
         group_size: int | None = None, activation: bool = False,
         pipeline: dict | None = None, batch_arg: str = "input") -> qc.CompileSpec:
    """A spec quantizing every Linear / Conv1d / Conv2d weight (and, with ``activation``,
    its output); with the export front end, dim 0 of ``batch_arg`` is dynamic."""
    weight: dict[str, Any] = {"dtype": dtype, "granularity": granularity}
    if group_size is not None:
        weight["group_size"] = group_size
    rule: dict[str, Any] = {"match": {"module": ["Linear", "Conv1d", "Conv2d"]}, "weight": weight}
    if activation:
        rule["activation"] = {"dtype": "uint8"}
    trace: dict[str, Any] = {"method": method}
    if method == "export":
        trace["dynamic_dims"] = {batch_arg: {0: "batch"}}
    s: dict[str, Any] = {"quant": {"mode": mode, "algorithms": algorithms, "rules": [rule]},
                         "trace": trace}
    if pipeline is not None:
        s["pipeline"] = pipeline
    return qc.CompileSpec.model_validate(s)


def calibrated(model: nn.Module, s: qc.CompileSpec, batches: list[torch.Tensor]) -> Any:
    gm = qc.qcompile(model, s, example_inputs=(batches[0],))
    return qc.calibrate(gm, batches, progress=False)


def output_mse(gm: Any, model: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((gm(x) - model(x)) ** 2).mean())


def mean_shift(gm: Any, model: nn.Module, x: torch.Tensor) -> float:
    """The largest per-output mean error: what bias correction removes."""
    with torch.no_grad():
        return float((gm(x) - model(x)).mean(dim=0).abs().max())


def weights_on_grid(gm: Any) -> bool:
    """Every fake-quantized weight is a fixed point of its quantizer (the algorithms wrote
    values the quantizer reproduces exactly, so convert and export see the same ones)."""
    with torch.no_grad():
        for fq, w in weight_quantizers(gm):
            if not torch.equal(fq(w.detach().clone()), w.detach()):
                return False
    return True
