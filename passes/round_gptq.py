"""``round_gptq``: GPTQ (``quant.algorithms: [{kind: gptq, block_size: 128, damp: 0.01,
act_order: false}]``; Frantar et al. 2023), Hessian-based sequential rounding.

For every conv/linear layer with an integer or block-format weight quantizer, with
``H = X^T X`` the Gram matrix of the layer's inputs on the calibration batches (each output
is a dot product with a row of ``X``; convolutions through their unfolded patches), GPTQ
rounds the weight's columns one at a time onto the quantizer's grid and spreads each
column's rounding error over the columns not rounded yet, in proportion to ``H^-1``: the
layer's output error on the data, ``trace(dW H dW^T)``, is what it minimises, not the
weights' own error. Columns go in blocks of ``block_size`` (the lazy batch update);
``damp`` (a share of the mean diagonal) keeps ``H`` invertible; ``act_order`` rounds the
columns with the largest input energy first. For integer weights the scales and zero
points are the weight quantizer's (per tensor, channel or group, from the original
weights): only the integers change, so the result converts and exports as any calibrated
graph does.

Block-scaled weights (``mxfp4``, ``nvfp4``, ``nf4``, ...; ``gptq_blocks``) have no fixed
grid: each forward computes every block's scale from the weight itself. GPTQ computes a
block's scale when it reaches the block's first column, from the weights as the errors of
the columns before have updated them (NVFP4's tensor scale from the original weight), and
rounds the block's columns on that grid. So that the forward finds the same scales again,
the element that sets each block's scale is rounded to a magnitude that keeps it (the
block's largest level for NF4 and NVFP4, its top binade for MX; NVFP4's largest original
element keeps its block's scale at the maximum, so the tensor scale stays), the others to
nearest: the weight GPTQ writes is its own fake-quant (NVFP4: to a float32 rounding of
the tensor scale). llama.cpp's grids pin their ends the same way: Q4_0's and Q8_0's
element of largest magnitude and Q4_1's minimum and maximum keep their values on the
block's grid; in Q4_K's and Q6_K's super-blocks of 256 every sub-block's ends (Q4_K's
maximum and negative minimum, Q6_K's largest magnitude) take the grid's end levels, so the
fp16 super-block scales and the sub-block scale codes come back exactly. The lazy batches
hold whole blocks (``block_size`` rounded down to a multiple of the block); ``act_order``
takes every block's scale from the original weights (the columns no longer go block by
block).

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

from dataclasses import dataclass, replace

import torch
from torch.fx import GraphModule

from qcompile.graph.algorithms import (
    Data,
    plan,
    round_layers,
)
from qcompile.graph.context import Context
from qcompile.graph.layerwise import round_to_grid
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.equalize import algorithm_entry
from qcompile.runtime.block_formats import (
    FORMATS,
    BlockGrid,
    block_scales,
    fake_quant_eager,
    nvfp4_tensor_scale,
)
from qcompile.specs.quant import GPTQ

_MAX_DAMP_RETRIES = 6  # each multiplies damp by 10 when H is not positive definite


@graph_pass(requires=("quantizers",), provides=("gptq",))
def round_gptq(gm: GraphModule, ctx: Context) -> GraphModule:
    """Check there are layers for GPTQ and record the entry for ``qc.calibrate``."""
    index, _ = algorithm_entry(ctx, "gptq")
    return plan(gm, ctx, index, "gptq", gram=True, verb="round")


def _inverse_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """The upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1`` (float32) and the
    damping used (raised tenfold while H is not positive definite)."""
    k = h.shape[0]
    mean_diag = float(torch.diag(h).mean())
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    used = damp
    for _ in range(_MAX_DAMP_RETRIES):
        chol, info = torch.linalg.cholesky_ex(h + used * mean_diag * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return u.float(), used
        used *= 10
    # hopeless: plain rounding, column by column
    return torch.diag(torch.diag(h).rsqrt()).float(), used


def _prepare(w: torch.Tensor, gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 copy of ``w`` and float64 copy of ``gram``, inputs that are always 0 made
    harmless (any value of their column is exact: it is set to 0)."""
    w = w.detach().float().clone()
    h = gram.detach().double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    return w, h


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
    w, h = _prepare(w, gram)
    k = w.shape[1]
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
        scale, zero_point = scale[:, perm], zero_point[:, perm]
    u, used = _inverse_factor(h, damp)
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


@dataclass(frozen=True)
class _BlockState:
    """One column block's grid while GPTQ rounds it: the grid of each row's block, and per
    row the column (within the block) of the element that set the scale (``lead``) and the
    magnitude it rounds to at least (``keep``) so that the scale is found again."""

    grid: BlockGrid
    lead: torch.Tensor  # [N] int64
    keep: torch.Tensor  # [N] float32
    # llama.cpp's grids: each row's lead (largest magnitude; Q4_1: its maximum) and, for
    # Q4_1, its minimum keep the values the block's grid gives them (``lead_value``,
    # ``low_value``), so the rounded block finds the same grid again (Q4_0's scale is
    # signed, Q4_1's has both ends)
    low: torch.Tensor | None = None  # [N] int64
    low_value: torch.Tensor | None = None  # [N] float32
    lead_value: torch.Tensor | None = None  # [N] float32


def _block_state(cols: torch.Tensor, fmt: str, tensor_scale: torch.Tensor | None,
                 pin: tuple[int, int, torch.Tensor] | None) -> _BlockState:
    """The grid of ``cols`` ([N, block]); ``pin``: (row, column, magnitude) of NVFP4's
    largest original element, which keeps at least that magnitude (its block's scale stays
    at the maximum, and with it the tensor scale)."""
    if pin is not None:
        row, col, magnitude = pin
        cols = cols.clone()
        cols[row, col] = torch.copysign(torch.maximum(cols[row, col].abs(), magnitude),
                                        cols[row, col])
    amax, lead = cols.abs().max(dim=-1, keepdim=True)
    grid = block_scales(cols, fmt, tensor_scale)
    if FORMATS[fmt].kind == "ggml":  # both ends pinned to their values on the grid
        hi, lo = cols.argmax(dim=-1, keepdim=True), cols.argmin(dim=-1, keepdim=True)
        if fmt == "q4_1":
            lead = hi
        on_grid = grid.fake_quant(cols)
        return _BlockState(grid, lead[:, 0], amax[:, 0], lo[:, 0],
                           on_grid.gather(-1, lo)[:, 0], on_grid.gather(-1, lead)[:, 0])
    keep = grid.fake_quant(amax)  # the block's largest level (NF4, NVFP4)
    f = FORMATS[fmt]
    if f.kind == "mx":  # any magnitude in the top binade keeps the shared exponent
        keep = torch.minimum(keep, grid.from_grid * 2.0 ** f.emax)
    keep = torch.where(amax > 0, keep, torch.zeros_like(keep))
    return _BlockState(grid, lead[:, 0], keep[:, 0])


@dataclass(frozen=True)
class _SuperBlockState:
    """One super-block's grid (llama.cpp's Q4_K, Q6_K) while GPTQ rounds it column by
    column. A sub-block's scale (and Q4_K's minimum) is found from its ends: Q4_K's maximum
    and its minimum (when negative), Q6_K's element of largest magnitude. Those elements
    take the grid's end levels (Q4_K: codes 15 and 0; Q6_K: code -32), not their nearest
    ones, so the rounded super-block's ranges give back exactly the fp16 super-block scales
    and the 6-bit / 8-bit sub-block codes they came from (round-to-nearest itself is not
    always a fixed point: an end may round a step inside)."""

    grid: BlockGrid                 # [N, 256] per-element scales
    sub: int                        # elements per sub-block
    hi: torch.Tensor                # [N, S] int64: column (within its sub-block) of the end
    hi_value: torch.Tensor          # [N, S] float32: its level
    lo: torch.Tensor | None         # Q4_K: [N, S] int64, column of a negative minimum or -1
    lo_value: torch.Tensor | None   # Q4_K: [N, S] float32, the level of code 0

    def round(self, col: torch.Tensor, pos: int) -> torch.Tensor:
        """Column ``pos`` of the super-block ([N] float32), rounded onto the grid."""
        g = self.grid
        here = {f: getattr(g, f)[:, pos:pos + 1] for f in ("to_grid", "from_grid", "offset",
                                                            "offset_out")
                if getattr(g, f) is not None}
        q = replace(g, **here).fake_quant(col.unsqueeze(1))[:, 0]
        s, within = divmod(pos, self.sub)
        if self.lo is not None:
            q = torch.where(self.lo[:, s] == within, self.lo_value[:, s], q)
        return torch.where(self.hi[:, s] == within, self.hi_value[:, s], q)


def _super_block_state(cols: torch.Tensor, fmt: str) -> _SuperBlockState:
    """The grid of ``cols`` ([N, 256]) and the ends of its sub-blocks."""
    grid = block_scales(cols, fmt)
    n = cols.shape[0]

    def level(code: float, sub: int) -> torch.Tensor:  # [N, S]: each sub-block's level
        return grid.values(torch.full_like(cols, code))[:, ::sub]

    if fmt == "q6_k":  # a sub-block's scale: its largest magnitude (the first on a tie)
        hi = cols.reshape(n, 16, 16).abs().argmax(dim=-1)
        return _SuperBlockState(grid, 16, hi, level(-32.0, 16), None, None)
    # q4_k: a sub-block spans min(its minimum, 0) .. its maximum; with no negative element
    # its code 0 is the level 0 whatever its smallest element, which stays free
    xs = cols.reshape(n, 8, 32)
    negative = xs.amin(dim=-1) < 0
    return _SuperBlockState(grid, 32, xs.argmax(dim=-1), level(15.0, 32),
                            torch.where(negative, xs.argmin(dim=-1), -1), level(0.0, 32))


def gptq_blocks(w: torch.Tensor, gram: torch.Tensor, fmt: str, block: int, *,
                block_size: int = 128, damp: float = 0.01,
                act_order: bool = False) -> tuple[torch.Tensor, float]:
    """GPTQ on one ``[out, k]`` weight in the block format ``fmt`` (blocks of ``block``
    along each row): the rounded weight, equal to its own fake-quant (NVFP4: to a few
    float32 ulps, through the tensor scale's rounding), and the damping used. The lazy
    batches are ``block_size`` rounded down to whole blocks (one block at least).

    Example:
        >>> import torch
        >>> from qcompile.graph.layerwise import output_error
        >>> from qcompile.runtime.block_formats import fake_quant_eager
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)
        >>> w = torch.randn(16, 64, generator=g)
        >>> q, _ = gptq_blocks(w, x.T @ x, "mxfp4", 32)
        >>> torch.equal(fake_quant_eager(q, "mxfp4", 32), q)  # the forward finds q again
        True
        >>> rtn = fake_quant_eager(w, "mxfp4", 32)
        >>> output_error(q - w, x.T @ x, 512) < output_error(rtn - w, x.T @ x, 512)
        True
    """
    k = w.shape[1]
    if k % block:
        raise ValueError(f"rows of {k} elements do not split into blocks of {block}")
    original = w.detach().float()
    w, h = _prepare(w, gram)
    tensor_scale, pin = None, None
    if FORMATS[fmt].kind == "nvfp4":
        tensor_scale = nvfp4_tensor_scale(original)
        row, col = divmod(int(original.abs().argmax()), k)
        pin = (row, col, original[row, col].abs())

    def state(cols: torch.Tensor, b: int) -> _BlockState | _SuperBlockState:
        if FORMATS[fmt].kind == "ggml_k":
            return _super_block_state(cols, fmt)
        here = pin if pin is not None and pin[1] // block == b else None
        if here is not None:
            here = (here[0], here[1] - b * block, here[2])
        return _block_state(cols, fmt, tensor_scale, here)

    states: dict[int, _BlockState | _SuperBlockState] = {}
    perm = None
    if act_order:  # columns out of block order: every grid from the original weights
        states = {b: state(w[:, b * block:(b + 1) * block], b) for b in range(k // block)}
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
        step = block_size
    else:  # a block's columns in one lazy batch, so its grid reads their updated values
        step = max(block, block_size // block * block)
    u, used = _inverse_factor(h, damp)
    out = torch.zeros_like(w)
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        cur = w[:, i1:i2].clone()
        errors = torch.zeros_like(cur)
        u_block = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i if perm is None else int(perm[i1 + i])
            b, pos = divmod(c, block)
            if b not in states:  # the block's first column: its grid from the columns now
                states[b] = state(cur[:, i:i + block], b)
            st = states[b]
            col = cur[:, i]
            if isinstance(st, _SuperBlockState):
                q = st.round(col, pos)
            elif st.lead_value is not None:  # llama.cpp's grids: the grid's ends stay put
                q = st.grid.fake_quant(col.unsqueeze(1))[:, 0]
                q = torch.where(st.lead == pos, st.lead_value, q)
                if fmt == "q4_1":
                    q = torch.where(st.low == pos, st.low_value, q)
            else:
                q = st.grid.fake_quant(col.unsqueeze(1))[:, 0]
                q = torch.where(st.lead == pos,
                                torch.copysign(torch.maximum(q.abs(), st.keep), col), q)
            out[:, i1 + i] = q
            err = (col - q) / u_block[i, i]
            cur[:, i:] -= err.unsqueeze(1) * u_block[i, i:].unsqueeze(0)
            errors[:, i] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    if perm is not None:
        out = out[:, torch.argsort(perm)]
    return out, used


def apply(data: Data, index: int, entry: GPTQ) -> list[str]:
    """Round every usable layer's weight with GPTQ, level by level (``qc.calibrate``)."""
    opts = {"block_size": entry.block_size, "damp": entry.damp, "act_order": entry.act_order}

    def solve(w, gram, rows, scale, zero_point, quant_min, quant_max, quantizer):
        if quantizer.block_format is not None:  # its grid comes from the weight itself
            fmt, block = quantizer.block_format, int(quantizer.group_size)
            new, used = gptq_blocks(w, gram, fmt, block, **opts)
            new = fake_quant_eager(new, fmt, block)  # what the forward computes
        else:
            new, used = gptq(w, gram, scale, zero_point, quant_min, quant_max, **opts)
        return new, (f"; damp raised to {used:g}" if used != entry.damp else "")
    return round_layers(data, index, "gptq", solve, blocks=True)
