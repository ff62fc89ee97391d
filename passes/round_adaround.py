"""``round_adaround``: AdaRound (``quant.algorithms: [{kind: adaround, iterations: 1000,
reg_weight: 3.0, lr: 0.05, warmup: 0.2}]``; Nagel et al. 2020), learned rounding.

Round-to-nearest is not the best rounding for a layer's output: for every conv/linear layer
with an integer weight quantizer, AdaRound learns, per weight, whether to round down or up.
A continuous variable ``V`` per weight gives the soft rounding ``h(V) = clip(sigmoid(V) *
1.2 - 0.1, 0, 1)`` (the rectified sigmoid), started at the weight's fractional part, and
Adam minimises the layer's output error on the calibration batches plus ``reg_weight``
times the mean over the weights of ``1 - |2h - 1|^beta``, which pushes every ``h`` to 0
or 1 (``beta`` anneals from 20 to 2 after the first ``warmup`` share of the
``iterations``); the result rounds ``h`` to 0 or 1. The output error is the exact
quadratic ``trace(dW H dW^T)`` with ``H = X^T X`` of the layer's inputs (each output is a
dot product with a row of ``X``), divided by round-to-nearest's: it costs one ``k x k``
matrix per layer whatever the amount of data, and ``reg_weight`` means the same for every
layer shape (the paper's 0.01 multiplies a raw sum instead). (The paper's loss adds
the activation function after the layer; this one, AIMET's default too, is the layer's
own output.) The scales are the weight quantizer's: only the integers change.

Layers go level by level, each level's inputs from the graph with the levels before it
already rounded. The compile-time pass checks there are layers and records the entry;
``qc.calibrate`` runs it. Deterministic: a fixed start and full-batch steps.

Example:
    >>> import torch, qcompile as qc
    >>> torch.manual_seed(0) and None
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "static",
    ...     "algorithms": [{"kind": "adaround", "iterations": 100}],
    ...     "rules": [{"match": {"module": "Linear"},
    ...                "weight": {"dtype": "int4", "granularity": "per_channel"}}]}})
    >>> gm = qc.qcompile(torch.nn.Linear(16, 8), spec, example_inputs=(torch.randn(2, 16),))
    >>> gm = qc.calibrate(gm, [torch.randn(64, 16) @ torch.randn(16, 16) for _ in range(4)])
    >>> qc.report(gm).passes[-1].notes[0]  # doctest: +ELLIPSIS
    'linear (8x16): output error ... -> ... (...% of round-to-nearest), ... the other way'
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from qcompile.graph.algorithms import Data, plan, round_layers
from qcompile.graph.context import Context
from qcompile.graph.layerwise import output_error, round_to_grid
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.equalize import algorithm_entry
from qcompile.specs.quant import AdaRound

_ZETA, _GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch (the paper's values)
_BETA = (20.0, 2.0)  # the regulariser's exponent, annealed from the first to the second


@graph_pass(requires=("quantizers",), provides=("adaround",))
def round_adaround(gm: GraphModule, ctx: Context) -> GraphModule:
    """Check there are layers for AdaRound and record the entry for ``qc.calibrate``."""
    index, _ = algorithm_entry(ctx, "adaround")
    return plan(gm, ctx, index, "adaround", gram=True, verb="round", blocks=False)


def _soft(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(v) * (_ZETA - _GAMMA) + _GAMMA, 0.0, 1.0)


def _beta(t: int, iterations: int, start: int) -> float | None:
    """The regulariser's exponent at step ``t``: None during the warm-up (no regulariser),
    then annealed linearly from ``_BETA[0]`` to ``_BETA[1]``."""
    if t < start:
        return None
    return _BETA[0] + (_BETA[1] - _BETA[0]) * (t - start) / max(iterations - start, 1)


def _gradient(v: torch.Tensor, w: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
              zero_point: torch.Tensor, quant_min: int, quant_max: int, h_mat: torch.Tensor,
              norm: float, reg_weight: float, beta: float) -> torch.Tensor:
    """d loss / d V of the solver's objective, in closed form: with ``h = _soft(V)`` and
    ``dW = (clamp(base + h, quant_min, quant_max) - zero_point) * scale - w``,
    ``loss = trace(dW H dW^T) / norm + reg_weight * mean(1 - |2h - 1|^beta)``
    (``reg_weight`` 0: the warm-up, no regulariser). Adam runs on this rather than on
    autograd: autograd's graph of ~20 small ops per step would cost more than the
    arithmetic."""
    span = _ZETA - _GAMMA
    sig = torch.sigmoid(v)
    raw = sig * span + _GAMMA
    h = raw.clamp(0.0, 1.0)
    level = base + h
    d = (level.clamp(quant_min, quant_max) - zero_point) * scale - w
    # d loss / d h: the quadratic's 2 d H (H symmetric), through the grid's clamp
    grad_h = (2.0 / norm) * (d @ h_mat) * scale
    grad_h = grad_h * ((level > quant_min) & (level < quant_max))
    if reg_weight:
        c = 2 * h - 1
        # d/dh of reg_weight * mean(1 - |2h - 1|^beta)
        grad_h = grad_h - (2 * beta * reg_weight / w.numel()) * c.abs().pow(beta - 1) \
            * c.sign()
    # through the rectified sigmoid (zero where it is clipped)
    return grad_h * (span * sig * (1 - sig)) * ((raw > 0) & (raw < 1))


def adaround(w: torch.Tensor, gram: torch.Tensor, rows: int, scale: torch.Tensor,
             zero_point: torch.Tensor, quant_min: int, quant_max: int, *,
             iterations: int = 1000, reg_weight: float = 3.0, lr: float = 0.05,
             warmup: float = 0.2) -> tuple[torch.Tensor, int]:
    """AdaRound on one ``[out, k]`` weight: the rounded (dequantized) weight and how many
    weights round the other way from round-to-nearest.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(256, 8, generator=g) @ torch.randn(8, 8, generator=g)
        >>> w = torch.randn(4, 8, generator=g)
        >>> s, z = torch.full_like(w, 0.25), torch.zeros_like(w)
        >>> q, flipped = adaround(w, x.T @ x, 256, s, z, -8, 7, iterations=200)
        >>> bool(((q / s).round() == q / s).all())  # on the grid
        True
        >>> from qcompile.graph.layerwise import output_error, round_to_grid
        >>> output_error(q - w, x.T @ x, 256) < output_error(round_to_grid(w, s, z, -8, 7) - w,
        ...                                                   x.T @ x, 256)
        True
    """
    w = w.detach().float()
    h_mat = (gram.detach().double() / max(rows, 1)).float()
    nearest = round_to_grid(w, scale, zero_point, quant_min, quant_max)
    norm = max(output_error(nearest - w, h_mat, 1), 1e-30)
    base = torch.floor(w / scale) + zero_point
    rest = (w / scale - torch.floor(w / scale)).clamp(0.0, 1.0)
    # start where the soft rounding equals the fractional part (the weight itself)
    p = ((rest - _GAMMA) / (_ZETA - _GAMMA)).clamp(1e-4, 1 - 1e-4)
    v = torch.logit(p)
    v.grad = torch.zeros_like(v)
    # Adam on the closed-form gradient (``_gradient``)
    opt = torch.optim.Adam([v], lr=lr)
    start = int(warmup * iterations)
    for t in range(iterations):
        beta = _beta(t, iterations, start)
        v.grad = _gradient(v, w, base, scale, zero_point, quant_min, quant_max, h_mat, norm,
                           reg_weight if beta is not None else 0.0, beta or 0.0)
        opt.step()
    up = (v.detach() >= 0).float()  # h >= 0.5: round up
    out = (torch.clamp(base + up, quant_min, quant_max) - zero_point) * scale
    flipped = int((out != nearest).sum())
    return out, flipped


def apply(data: Data, index: int, entry: AdaRound) -> list[str]:
    """Learn every usable layer's rounding, level by level (``qc.calibrate``)."""
    def solve(w, gram, rows, scale, zero_point, quant_min, quant_max, _quantizer):
        new, flipped = adaround(w, gram, rows, scale, zero_point, quant_min, quant_max,
                                iterations=entry.iterations, reg_weight=entry.reg_weight,
                                lr=entry.lr, warmup=entry.warmup)
        return new, f", {flipped} of {w.numel()} weights rounded the other way"
    return round_layers(data, index, "adaround", solve)
