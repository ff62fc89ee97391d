"""Models and specs shared by the pipeline tests (``tests/conftest.py`` puts this folder
on ``sys.path``: ``from pipeline_models import Stack, qat``)."""

from __future__ import annotations

from torch import nn

import qcompile as qc


class Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.fc(x))


def layer(kind: str, d: int) -> nn.Module:
    return {"linear": lambda: nn.Linear(d, d), "relu": nn.ReLU,
            "layernorm": lambda: nn.LayerNorm(d), "residual": lambda: Residual(d),
            "dropout": lambda: nn.Dropout(0.5)}[kind]()


class Stack(nn.Module):
    """Layers from a drawn spec, e.g. ``["linear", "relu", "residual"]``, and a head."""

    def __init__(self, kinds: list[str], d: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[layer(k, d) for k in kinds])
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.layers(x))


class ResidualMLP(nn.Module):
    def __init__(self, d: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Residual(d) for _ in range(depth)])
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def qat(**extra) -> dict:
    spec = qc.load_spec("int8-qat").model_dump()
    spec.update(extra)
    return spec


def none(**extra) -> dict:
    return {"quant": {"mode": "none"}, **extra}
