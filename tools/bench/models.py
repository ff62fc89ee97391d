"""The benchmark model zoo: what ``qcompile-bench`` compiles, trains and converts.

- ``deep_mlp(blocks, width)``: ``blocks`` x (Linear + ReLU), the scaling and pipeline
  workload;
- ``big_model(blocks, width)``: ~400 MB of fp32 weights at the defaults, 12 repeated
  blocks of 2 x Linear(2048) (``compile-once``; ``BigBlock``, ``BigModel``);
- ``transformer(layers)``: pre-norm encoder blocks (d 256, 4 heads, GELU MLP);
- ``resnet_like(width)``: a ResNet-18-shaped CNN for 32x32 inputs (64 channels in its
  first stage by default);
- ``workloads(quick)``: name -> (factory, example input) for the side-by-side suites
  (MLP 4 x Linear(1024), the CNN, the 12-layer transformer; with ``quick``, smoke-run
  sizes: MLP 4 x Linear(256), the CNN at a quarter of the channels, 2 layers).

Example:
    >>> from qcompile.tools.bench.models import deep_mlp, workloads
    >>> len(list(deep_mlp(3).modules())) > 3
    True
    >>> sorted(workloads(quick=True))
    ['cnn', 'mlp', 'transformer']
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def deep_mlp(blocks: int, width: int = 64) -> nn.Sequential:
    """``blocks`` x (Linear + ReLU): the scaling workload."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


class BigBlock(nn.Module):
    """Linear + ReLU + Linear + ReLU, ``width`` wide: one repeated block of ``big_model``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


class BigModel(nn.Module):
    """``blocks`` x ``BigBlock`` in a ModuleList (what ``compile_once`` shards per block)."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BigBlock(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def big_model(blocks: int = 12, width: int = 2048) -> BigModel:
    """~403 MB of fp32 weights at the defaults (12 blocks of 33.6 MB). Module level, so
    ``functools.partial(big_model, ...)`` pickles for spawned ranks."""
    return BigModel(blocks, width)


class Block(nn.Module):
    """One pre-norm transformer encoder block (attention written out, so fx traces it)."""

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
    return nn.Sequential(*[Block() for _ in range(layers)])


def basic_block(cin: int, cout: int, stride: int) -> nn.Module:
    """Two conv-bn-relu groups (a ResNet basic block without its skip)."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


def resnet_like(width: int = 64) -> nn.Module:
    """A ResNet-18-shaped CNN for 32x32 inputs (plain blocks; torch.fx traces it as is):
    ``width`` channels in the first stage, doubled at each of the next three (ResNet-18's
    64 by default; the ``--quick`` runs use fewer, the same layers)."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False),
                               nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for scale, stride in ((1, 1), (1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (8, 2), (8, 1)):
        layers.append(basic_block(cin, scale * width, stride))
        cin = scale * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


# ``--quick``: the same kinds of model, small enough for a smoke run (each contender's
# code runs, the numbers are not measurements)
QUICK_WIDTH = 256  # the MLP's width
QUICK_CNN_WIDTH = 16  # the CNN's first-stage channels


def workloads(quick: bool) -> dict[str, tuple[Callable[[], nn.Module], torch.Tensor]]:
    """name -> (model factory, example input) of the side-by-side suites."""
    if quick:
        return {
            "mlp": (lambda: deep_mlp(4, QUICK_WIDTH), torch.randn(16, QUICK_WIDTH)),
            "cnn": (lambda: resnet_like(QUICK_CNN_WIDTH), torch.randn(2, 3, 32, 32)),
            "transformer": (lambda: transformer(2), torch.randn(2, 16, 256)),
        }
    return {
        "mlp": (lambda: deep_mlp(4, 1024), torch.randn(64, 1024)),
        "cnn": (resnet_like, torch.randn(32, 3, 32, 32)),
        "transformer": (lambda: transformer(12), torch.randn(8, 128, 256)),
    }
