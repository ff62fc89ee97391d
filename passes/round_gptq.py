"""``round_gptq``: GPTQ (``quant.algorithms: [{kind: gptq, block_size: 128, damp: 0.01,
act_order: false}]``; Frantar et al. 2023), Hessian-based sequential rounding.

For every conv/linear layer with an integer weight quantizer, with ``H = X^T X`` the Gram
matrix of the layer's inputs on the calibration batches (each output is a dot product with
a row of ``X``; convolutions through their unfolded patches), GPTQ rounds the weight's
columns one at a time onto the quantizer's grid and spreads each column's rounding error
over the columns not rounded yet, in proportion to ``H^-1``: the layer's output error on
the data, ``trace(dW H dW^T)``, is what it minimises, not the weights' own error. Columns
go in blocks of ``block_size`` (the lazy batch update); ``damp`` (a share of the mean
diagonal) keeps ``H`` invertible; ``act_order`` rounds the columns with the largest input
energy first. The scales and zero points are the weight quantizer's (per tensor, channel
or group, from the original weights): only the integers change, so the result converts
and exports as any calibrated graph does.

Layers go level by level (``qcompile.graph.layerwise.levels``): each level's inputs come
from the graph with the levels before it already rounded, as in the paper. Memory is one
``k x k`` matrix per layer of the level being measured.

The compile-time pass only checks there are layers and records the entry as pending;
``qc.calibrate(gm, batches)`` runs it (``apply``) before calibrating the observers. Its
record (``round_gptq.calibrate``) notes, per layer, the output error of round-to-nearest
and of GPTQ on the calibration data.

Example:
    >>> import torch, qcompile as qc
    >>> torch.manual_seed(0) and None
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "static",
    ...     "algorithms": [{"kind": "gptq", "block_size": 4}],
    ...     "rules": [{"match": {"module": "Linear"},
    ...                "weight": {"dtype": "int4", "granularity": "per_channel"}}]}})
    >>> gm = qc.qcompile(torch.nn.Linear(16, 8), spec, example_inputs=(torch.randn(2, 16),))
    >>> gm = qc.calibrate(gm, [torch.randn(64, 16) @ torch.randn(16, 16) for _ in range(4)])
    >>> qc.report(gm).passes[-1].notes[0]  # doctest: +ELLIPSIS
    'linear (8x16): output error ... -> ... (...% of round-to-nearest)'
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from qcompile.graph.algorithms import Data, plan, round_layers
from qcompile.graph.context import Context
from qcompile.graph.layerwise import round_to_grid
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.equalize import algorithm_entry
from qcompile.specs.quant import GPTQ

_MAX_DAMP_RETRIES = 6  # each multiplies damp by 10 when H is not positive definite


@graph_pass(requires=("quantizers",), provides=("gptq",))
def round_gptq(gm: GraphModule, ctx: Context) -> GraphModule:
    """Check there are layers for GPTQ and record the entry for ``qc.calibrate``."""
    index, _ = algorithm_entry(ctx, "gptq")
    return plan(gm, ctx, index, "gptq", gram=True, verb="round")


def gptq(w: torch.Tensor, gram: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
         quant_min: int, quant_max: int, *, block_size: int = 128, damp: float = 0.01,
         act_order: bool = False) -> tuple[torch.Tensor, float]:
    """GPTQ on one ``[out, k]`` weight: the rounded (dequantized) weight and the damping
    used. ``scale`` / ``zero_point`` give every element's grid (``weight_grid``).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(256, 8, generator=g) @ torch.randn(8, 8, generator=g)
        >>> w = torch.randn(4, 8, generator=g)
        >>> s, z = torch.full_like(w, 0.25), torch.zeros_like(w)
        >>> q, _ = gptq(w, x.T @ x, s, z, -8, 7, block_size=4)
        >>> bool(((q / s).round() == q / s).all())  # on the grid
        True
        >>> from qcompile.graph.layerwise import output_error, round_to_grid
        >>> output_error(q - w, x.T @ x, 256) < output_error(round_to_grid(w, s, z, -8, 7) - w,
        ...                                                   x.T @ x, 256)
        True
    """
    w = w.detach().float().clone()
    h = gram.detach().double().clone()
    k = w.shape[1]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0  # an input that is always 0: any value of its column is exact
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
        scale, zero_point = scale[:, perm], zero_point[:, perm]
    mean_diag = float(torch.diag(h).mean())
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    used = damp
    for _ in range(_MAX_DAMP_RETRIES):
        chol, info = torch.linalg.cholesky_ex(h + used * mean_diag * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                break
        used *= 10
    else:
        u = torch.diag(torch.diag(h).rsqrt())  # hopeless: plain rounding, column by column
    u = u.float()
    out = torch.zeros_like(w)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        block = w[:, i1:i2].clone()
        errors = torch.zeros_like(block)
        u_block = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = block[:, i]
            q = round_to_grid(col, scale[:, i1 + i], zero_point[:, i1 + i], quant_min,
                              quant_max)
            out[:, i1 + i] = q
            err = (col - q) / u_block[i, i]
            block[:, i:] -= err.unsqueeze(1) * u_block[i, i:].unsqueeze(0)
            errors[:, i] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    if perm is not None:
        out = out[:, torch.argsort(perm)]
    return out, used


def apply(data: Data, index: int, entry: GPTQ) -> list[str]:
    """Round every usable layer's weight with GPTQ, level by level (``qc.calibrate``)."""
    def solve(w, gram, rows, scale, zero_point, quant_min, quant_max):
        new, used = gptq(w, gram, scale, zero_point, quant_min, quant_max,
                         block_size=entry.block_size, damp=entry.damp, act_order=entry.act_order)
        return new, (f"; damp raised to {used:g}" if used != entry.damp else "")
    return round_layers(data, index, "gptq", solve)
