"""Running a graph inside a pass (timing it, collecting statistics) without leaving a
trace: eval mode for the run, every module's training flag and every buffer as they were
after it, and the example inputs cloned so a model that writes its inputs in place
(``x.mul_(2)``) never changes the caller's tensors.

Example:
    >>> import torch
    >>> from qcompile.graph.running import fresh, untouched
    >>> bn = torch.nn.BatchNorm1d(3)
    >>> x = torch.randn(4, 3)
    >>> with untouched(bn):
    ...     _ = bn(*fresh((x,)))
    >>> bool(bn.training), float(bn.num_batches_tracked)
    (True, 0.0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def fresh(args: Any) -> Any:
    """``args`` with every tensor cloned (a new copy per run)."""
    return torch.utils._pytree.tree_map(
        lambda v: v.clone() if isinstance(v, torch.Tensor) else v, args)


@contextlib.contextmanager
def untouched(gm: nn.Module) -> Iterator[nn.Module]:
    """Eval mode and ``no_grad`` inside; afterwards every module's training flag and every
    buffer's values are restored (a counter, BatchNorm statistics, anything written in
    place by the forward)."""
    modes = {name: m.training for name, m in gm.named_modules()}
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    gm.eval()
    try:
        with torch.no_grad():
            yield gm
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for name, m in gm.named_modules():
            m.training = modes.get(name, m.training)
