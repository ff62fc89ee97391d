"""Models for the ``qcompile-inspect`` examples and the pictures in the documentation.

Each factory takes no argument and returns a fresh model in eval mode with seeded weights,
so ``--model examples/models.py:resnet18`` draws the same picture on every run:

- ``resnet18``: ResNet-18 as torchvision builds it (7x7 stem, max pool, four stages of two
  basic blocks, 1x1 downsampling shortcuts, average pool, linear head); each block calls its
  ``relu`` module twice, as torchvision's does. Ten classes, for 32x32 inputs.
- ``llama``: a small Llama-style decoder (``qcompile.tools.bench.lm.TinyLlama``: RMSNorm,
  rotary causal attention, SwiGLU MLP, untied head), 4 blocks of width 64, 96 tokens.

Example:
    >>> import torch
    >>> resnet18()(torch.randn(1, 3, 32, 32)).shape
    torch.Size([1, 10])
    >>> sum(p.numel() for p in resnet18().parameters())
    11181642
    >>> llama()(torch.zeros(1, 16, dtype=torch.int64)).shape
    torch.Size([1, 16, 96])
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-bn pairs and a shortcut (a 1x1 conv-bn when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18's layers and names (``conv1``, ``layer1.0.conv1``, ``fc``)."""

    def __init__(self, num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = width, []
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18() -> nn.Module:
    """ResNet-18 (11.2 M parameters), seeded, in eval mode."""
    torch.manual_seed(0)
    return ResNet18().eval()


def llama() -> nn.Module:
    """A 4-block Llama-style decoder (width 64, 4 heads, context 32, 96 tokens), seeded,
    in eval mode; its input is token ids ``[batch, tokens]`` (int64, tokens <= 32)."""
    from qcompile.tools.bench.lm import LMConfig, TinyLlama

    torch.manual_seed(0)
    return TinyLlama(LMConfig(layers=4, dim=64, heads=4, hidden=128, context=32), 96).eval()
