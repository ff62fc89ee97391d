"""``FakeQuantize``: the quantizer module qcompile inserts into graphs.

``forward(x) = dequantize(quantize(x))`` with a straight-through gradient (and the LSQ
gradient for learnable scales), following the numerics in ``qcompile.runtime.quant_math``.
Two plain Python bools steer it: ``enabled`` (fake-quant on/off) and ``observe``
(observer updates qparams on forward). Scales are 1-D float32 whatever the model dtype.
A third, ``reuse_weight`` (default True), lets a weight quantizer reuse its last result
while the weight and qparams are unchanged (several forwards per optimizer step, see
``qcompile.runtime.weight_cache``).

Example:
    >>> import torch
    >>> from qcompile.runtime.fake_quant import FakeQuantize
    >>> fq = FakeQuantize("int8", granularity="per_channel", axis=0, channels=4)
    >>> w = torch.randn(4, 16)
    >>> out = fq(w)                       # observes w, then fake-quantizes it
    >>> steps = out / fq.scale[:, None]   # integers: the output lies on the grid
    >>> fq.scale.shape, bool((steps - steps.round()).abs().max() < 1e-4)
    (torch.Size([4]), True)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from qcompile.errors import QCompileError
from qcompile.runtime import kernels, recompute, sharded, weight_cache
from qcompile.runtime.block_formats import fake_quantize_block
from qcompile.runtime.observers import (
    MinMaxObserver,
    MovingAverageObserver,
    add_buffers,
    make_observer,
)
from qcompile.runtime.quant_math import (
    FP8_DTYPES,
    fake_quantize,
    fake_quantize_fp8,
    fp8_scale_from_minmax,
    learned_scale,
    qparams_from_minmax,
)
from qcompile.specs.quant import FP8_MAX, REDUCIBLE_DTYPES, Scheme, reduces_activation_range

_FLAG_INDEX = {"enabled": 0, "observe": 1}
# what qcompile::fake_quant_minmax reads (float16 through float32, as fake_quant does)
_ONE_PASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The extra-state entry (``get_extra_state``): its key within the quantizer's prefix (torch's
# name), and the codes of its ``pending`` field.
EXTRA_STATE = "_extra_state"
PENDING_NONE = 0.0  # no pending statistics
PENDING_IN_STEP = 1.0  # gathered in the step under way (no optimizer step since)
PENDING_STEP_ENDED = 2.0  # an optimizer step came after them: the next forward applies them


def _sharded(t: torch.Tensor) -> bool:
    """``t`` is a DTensor (an FSDP2 shard outside the module's forward)."""
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _local_values(t: torch.Tensor) -> torch.Tensor | None:
    """The values this process holds (a DTensor's local shard), or None where there are
    none to read (meta)."""
    local = t.to_local() if _sharded(t) else t
    return None if local.device.type == "meta" else local.detach()


def _not_positive(t: torch.Tensor) -> int:
    """How many of ``t``'s (local) values are not finite positive numbers."""
    local = _local_values(t)
    return 0 if local is None else int((~(torch.isfinite(local) & (local > 0))).sum())


def _assign(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target[...] = value`` for plain, parameter and FSDP2-sharded (DTensor) tensors."""
    local = target.data
    if hasattr(local, "to_local") and hasattr(local, "device_mesh"):  # a DTensor shard
        from torch.distributed.tensor import distribute_tensor

        shard = distribute_tensor(value.to(local.to_local().device), local.device_mesh,
                                  local.placements)
        local.to_local().copy_(shard.to_local())
        return
    local.copy_(value)


def scale_count(scheme: Scheme, shape: tuple[int, ...] | None, *, role: str) -> int:
    """How many scales a tensor of ``shape`` needs under ``scheme`` (raises ``ValueError``
    with the reason when the shape does not allow the scheme). A block format keeps none
    (its scales come from each tensor): 1, once the blocks fit ``shape``."""
    if scheme.is_block:
        check_blocks(scheme, shape, role=role)
        return 1
    g = scheme.granularity
    if g in ("per_tensor", "per_token"):
        return 1
    if shape is None:
        raise ValueError(f"{g} quantization needs the tensor's shape: pass example_inputs "
                         "to qcompile or set trace.inputs in the spec")
    if g == "per_channel":
        axis = default_axis(scheme, role)
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"axis {axis} is out of range for a tensor of shape {list(shape)}")
        return int(shape[axis])
    # per_group: rows = dim 0, groups run along the flattened remaining dims
    if len(shape) < 2:
        raise ValueError(f"per_group needs a tensor of 2 or more dims, got shape {list(shape)}")
    row = 1
    for d in shape[1:]:
        row *= int(d)
    gs = int(scheme.group_size or 0)
    if row % gs:
        divisors = [d for d in range(min(gs, row), 0, -1) if row % d == 0][:3]
        raise ValueError(f"group_size {gs} does not divide {row} (the {list(shape)} tensor's "
                         f"row length); use one of {divisors} or granularity per_channel")
    return int(shape[0]) * (row // gs)


def check_blocks(scheme: Scheme, shape: tuple[int, ...] | None, *, role: str) -> None:
    """``ValueError`` with the fix when ``shape`` does not split into ``scheme``'s blocks:
    along a weight's rows (every dim but the first: the reduction dim of linear / conv),
    along an activation's last dim."""
    if shape is None:
        return  # checked on the first tensor (no example inputs)
    block = int(scheme.group_size or 0)
    if role == "weight":
        if len(shape) < 2:
            raise ValueError(f"{scheme.dtype} needs a weight of 2 or more dims, got shape "
                             f"{list(shape)}")
        n, what = 1, "row length"
        for d in shape[1:]:
            n *= int(d)
    else:
        if len(shape) < 1:
            raise ValueError(f"{scheme.dtype} needs a tensor with a last dim, got a scalar")
        n, what = int(shape[-1]), "last dim"
    if n % block:
        hint = ("use a block format whose block divides it, or keep this layer in another "
                "dtype (a skip rule, or a rule with an integer scheme)")
        if scheme.dtype == "nf4":
            sizes = [d for d in range(min(block, n), 1, -1) if n % d == 0 and d % 2 == 0][:3]
            hint = f"set group_size to one of {sizes}" if sizes else hint
        raise ValueError(f"{scheme.dtype} blocks of {block} do not divide {n}, the "
                         f"{list(shape)} tensor's {what}: {hint}")


def default_axis(scheme: Scheme, role: str) -> int:
    """The channel axis: as given, else 0 for weights (output channels) and 1 for
    activations (PyTorch's N, C, ... layout)."""
    if scheme.axis is not None:
        return scheme.axis
    return 0 if role == "weight" else 1


def refuse_nonfinite_input(where: str, x: torch.Tensor) -> None:
    """A ``QCompileError`` when ``x`` holds NaN or an infinity (``train.check_finite``);
    ``where`` says which quantizer reads it, from which node, and what lies upstream."""
    weight = type(x) is nn.Parameter
    x = x.detach()  # isfinite is composite (abs, compare): autograd would keep x
    # one pass, no temporary: NaN and infinities make the sum non-finite; a finite tensor
    # whose sum overflows is told apart by the exact test
    if bool(torch.isfinite(x.sum(dtype=torch.float32))) or bool(torch.isfinite(x).all()):
        return
    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    raise QCompileError(
        f"training forward: {where}: its input holds {nan} NaN and {inf} infinite value(s) "
        f"of {x.numel()}" + (" (the weight itself: training diverged)" if weight else ""),
        fix=("lower the learning rate or clip gradients, and resume from the last finite "
             "checkpoint" if weight else
             "keep the op named above out of quantization (a skip rule, match: {name: "
             "<its layer>}, or drop the op rule that quantizes what feeds it), or check the "
             "batch for NaN") + "; train.check_finite: 0 turns this check off")


class FakeQuantize(nn.Module):
    """Simulated quantization of one tensor.

    Attributes (contract): ``scale`` (1-D float32 buffer; when learnable, the tensor
    computed from the parameter ``scale_offset``, see below), ``zero_point`` (1-D int32
    buffer), ``quant_min``, ``quant_max``, ``axis`` (None unless per-channel),
    ``group_size`` (None unless per-group), ``enabled``, ``observe``.

    Learnable (LSQ) scales are positive by construction: the trained parameter is
    ``scale_offset`` (an ``nn.Parameter``, in the scale's units) and ``scale`` is
    ``learned_scale(scale_offset, scale_ref)`` (``qcompile.runtime.quant_math``): the
    reference ``scale_ref`` (a buffer) plus the offset above it, geometric decay below it.
    Whatever sets a scale (the observer's first batch, ``set_qparams``, loading a state
    dict with a ``scale`` entry) sets ``scale_ref`` to it and the offset to 0. Read
    ``scale`` for the value; write through ``set_qparams``.

    Per-token and dynamic quantizers compute their qparams from each input and keep no
    state; ``observe`` does not apply to them.

    ``reuse_weight`` (plain bool, default True): when the input is a weight (exactly an
    ``nn.Parameter``), the fake-quantized result is kept and returned again, with an
    autograd node of its own and exact gradients, until the weight's version (an
    optimizer step, any in-place write), the qparams or the switches change; so gradient
    accumulation fake-quantizes each weight once per step. Costs one weight-sized tensor
    plus a 1-byte mask per weight quantizer. The rule for what is cached and when it is
    invalidated is in ``qcompile.runtime.weight_cache``; ``clear_weight_cache()`` drops it.

    ``reduce_range`` (plain bool): an 8-bit integer quantizer (uint8, int8) uses the 7-bit
    range ([0, 127], [-64, 63]), as activations do for the ``x86`` target
    (``qcompile.specs.quant.reduces_activation_range``); False for every other dtype.

    ``update`` (``"forward"`` or ``"step"``, the spec's ``quant.observer_update``): with
    ``"step"``, an activation quantizer with a min-max or moving-average observer does not
    change its qparams in a training step's forward (training mode, gradients on): it
    fake-quantizes with the qparams it
    has and folds the batch's minima and maxima into pending statistics (the minimum and
    maximum over the step's micro-batches), which ``apply_pending`` (after the optimizer
    step; across data-parallel ranks, ``qcompile.distributed.data_parallel``) folds into
    the observer, once per step. Until its observer has statistics such a quantizer passes
    training inputs through unchanged. Evaluation-mode forwards, and forwards without
    gradients (``torch.no_grad()``), observe at once.
    """

    reuse_weight: bool = True
    reduce_range: bool = False  # also what graphs pickled before the attribute existed read
    # Class defaults, also for graphs pickled before the attributes existed:
    weight: bool = False  # quantizes a weight (replicas agree on it: never reduced)
    block_format: str | None = None  # a block-scaled dtype: scales from each block
    update: str = "forward"  # when a training forward's observation takes effect
    initialised: bool = False  # step updates: the observer has statistics to quantize with
    _pending: tuple[torch.Tensor, torch.Tensor] | None = None
    # step updates in one pass (``_one_pass``); False: the two passes, for comparison
    _one_pass_step: bool = True
    # train.check_finite: while set (qcompile.graph.finite, the first training steps), what
    # an error says about this quantizer when its input holds NaN or an infinity
    check_finite: str | None = None

    def __init__(
        self,
        dtype: str = "int8",
        *,
        symmetric: bool = True,
        granularity: str = "per_tensor",
        axis: int | None = None,
        group_size: int | None = None,
        channels: int = 1,
        observer: object = "minmax",
        learnable: bool = False,
        dynamic: bool = False,
        per_example: bool = False,
        reduce_range: bool = False,
        weight: bool = False,
        update: str = "forward",
    ) -> None:
        # the arguments are validated as a spec's scheme would be
        scheme = Scheme(dtype=dtype, symmetric=symmetric, granularity=granularity,
                        axis=axis if granularity == "per_channel" else None,
                        group_size=group_size, observer=observer, learnable=learnable)
        if update not in ("forward", "step"):
            raise QCompileError(f"FakeQuantize: update {update!r} is not known",
                                fix="use update='forward' or update='step'")
        self._setup(scheme, axis=axis, channels=channels, dynamic=dynamic,
                    per_example=per_example, reduce_range=reduce_range, weight=weight,
                    update=update)

    def _setup(self, scheme: Scheme, *, axis: int | None, channels: int, dynamic: bool,
               per_example: bool, reduce_range: bool, weight: bool = False,
               update: str = "forward") -> None:
        """The construction proper, from a validated ``scheme`` (``from_scheme`` comes here
        directly: the spec validated its schemes already)."""
        nn.Module.__init__(self)
        granularity = scheme.granularity
        quant_min, quant_max = scheme.qrange(reduce_range=reduce_range)
        # Plain attributes go straight into __dict__: through __setattr__ (ours mirrors the
        # flags into their buffer, nn.Module's searches its tables) they cost more than all
        # the rest, and a graph builds hundreds of quantizers. The state_dict is the same.
        self.__dict__.update(
            # LSQ's gradient scale counts elements per scale *per example* (dim 0 is the
            # batch) for activations, so data-parallel ranks with smaller batches get the
            # same factor.
            per_example=per_example,
            dtype=scheme.dtype,
            symmetric=scheme.symmetric,
            granularity=granularity,
            axis=(axis if axis is not None else 0) if granularity == "per_channel" else None,
            group_size=scheme.group_size if granularity == "per_group" else None,
            quant_min=quant_min,
            quant_max=quant_max,
            # True only where it changed the range (8-bit integers), so readers such as
            # convert (reduce_range of torch's dynamic kernels) can take it as is.
            reduce_range=bool(reduce_range) and scheme.dtype in REDUCIBLE_DTYPES,
            learnable=scheme.learnable,
            dynamic=dynamic,
            weight=bool(weight),
            update=update,
            block_format=scheme.dtype if scheme.is_block else None,
            enabled=True,
            observe=True,
            observed=False,  # observed since the last synchronisation
            # step updates: (min, max) waiting for apply_pending, or None. Plain tensors,
            # not buffers: DDP broadcasts buffers from rank 0 before every forward, which
            # would replace each rank's own micro-batches' statistics
            _pending=None,
        )
        n = channels if granularity in ("per_channel", "per_group") else 1
        if scheme.is_block:
            n = 1  # no qparams to keep: each forward computes its blocks' scales
        scale = torch.ones(n, dtype=torch.float32)
        if scheme.learnable:
            # positive by construction: scale = learned_scale(scale_offset, scale_ref)
            self.register_parameter("scale_offset",
                                    nn.Parameter(torch.zeros(n, dtype=torch.float32)))
            add_buffers(self, mode_flags=torch.ones(2, dtype=torch.uint8),  # = the flags
                        scale_ref=scale)
        else:
            add_buffers(self, mode_flags=torch.ones(2, dtype=torch.uint8), scale=scale)
        add_buffers(self, zero_point=torch.zeros(n, dtype=torch.int32))
        # Per-token, dynamic and block quantizers derive qparams from each input: no
        # statistics.
        if dynamic or granularity == "per_token" or scheme.is_block:
            self.__dict__["observer"] = None
        else:
            self.add_module("observer", make_observer(scheme.observer, n,
                                                      levels=quant_max - quant_min + 1))

    @classmethod
    def from_scheme(
        cls, scheme: Scheme, *, role: str, shape: tuple[int, ...] | None, dynamic: bool = False,
        channel_axis: int | None = None, target: str = "generic", update: str = "forward",
    ) -> FakeQuantize:
        """Build the quantizer a spec scheme describes for a tensor of ``shape``.
        ``channel_axis`` is the default channel axis when the scheme gives none (a weight
        used as [in, out] has its output channels on axis 1). ``target`` (``quant.target``)
        decides the range of activation quantizers (``role`` other than ``"weight"``):
        reduced to 7 bits for 8-bit integer dtypes where the target's kernels need it.
        ``update`` (``quant.observer_update``) applies to activation quantizers."""
        if scheme.axis is None and channel_axis is not None:
            scheme = scheme.model_copy(update={"axis": channel_axis})
        fq = cls.__new__(cls)
        fq._setup(
            scheme,
            axis=default_axis(scheme, role) if scheme.granularity == "per_channel" else None,
            channels=scale_count(scheme, shape, role=role),
            dynamic=dynamic,
            per_example=role == "activation",
            reduce_range=role != "weight" and reduces_activation_range(target),
            weight=role == "weight",
            update=update if role != "weight" else "forward",
        )
        return fq

    # -- qparams -----------------------------------------------------------------------
    @property
    def scale(self) -> torch.Tensor:
        """The scales (1-D float32): the buffer, or for a learnable quantizer the positive
        tensor ``learned_scale(scale_offset, scale_ref)``, computed on each read (with
        its gradient to ``scale_offset``). Set it with ``set_qparams``."""
        buf = self._buffers.get("scale")
        if buf is not None:
            return buf
        offset = self._parameters.get("scale_offset")
        if offset is None:
            raise AttributeError("scale")
        ref = self._buffers["scale_ref"]
        if type(offset) is not nn.Parameter and _sharded(offset):  # a plain one: at once
            return self._sharded_scale(offset, ref)
        return learned_scale(offset, ref)

    @staticmethod
    def _sharded_scale(offset: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """The scale of an FSDP2-sharded offset (outside forward), as a DTensor sharded
        like it: computed on this rank's shard with the matching rows of the (replicated)
        reference; no communication."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, start = compute_local_shape_and_global_offset(
            offset.shape, offset.device_mesh, offset.placements)
        local_ref = ref.to(offset.device)[start[0]:start[0] + shape[0]]
        local = learned_scale(offset.to_local(), local_ref)
        return DTensor.from_local(local, offset.device_mesh, offset.placements,
                                  run_check=False, shape=offset.shape, stride=offset.stride())

    @torch.no_grad()
    def set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> None:
        """Set the scales (and zero points): copies into the buffers, or for a learnable
        quantizer makes ``scale`` the new reference with offset 0 (so the value read back
        is exactly ``scale``). A learnable scale must be finite and positive
        (``QCompileError`` otherwise, nothing changed). The cached weight is dropped.

        Example:
            >>> import torch
            >>> fq = FakeQuantize("int8", learnable=True)
            >>> fq.set_qparams(torch.tensor([0.02]))
            >>> fq.scale.detach(), float(fq.scale_offset)
            (tensor([0.0200]), 0.0)
        """
        scale = torch.as_tensor(scale).detach().to(torch.float32)
        if scale.shape != self.zero_point.shape:
            scale = scale.reshape(self.zero_point.shape)
        if self.learnable and _not_positive(scale):
            raise QCompileError(
                f"a learnable quantizer's scale must be finite and positive; "
                f"{_not_positive(scale)} of the {scale.numel()} values given are not "
                f"({scale.reshape(-1)[:4].tolist()}...)",
                fix="give finite positive scales; an observer gives NaN or inf ones when a "
                "batch (input or weight) holds NaN or inf values: check the data")
        weight_cache.clear(self)
        if self.learnable:
            _assign(self._buffers["scale_ref"], scale)
            _assign(self._parameters["scale_offset"], torch.zeros_like(scale))
        else:
            _assign(self._buffers["scale"], scale)
        if zero_point is not None:
            _assign(self.zero_point, torch.as_tensor(zero_point).detach()
                    .to(torch.int32).reshape(self.zero_point.shape))

    # -- statistics -------------------------------------------------------------------
    def _minmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.granularity
        # Reductions along a dim: amin + amax, two vectorised passes, not torch.aminmax,
        # whose dim reduction is ~14x slower on CPU (3.1 ms vs 0.22 ms for a 1024x1024
        # weight, one thread): it was a QAT step's largest fake-quant cost. Same values
        # (min / max are exact, NaN propagates in both).
        if g == "per_token":
            return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        if g == "per_channel":
            rows = x.movedim(self.axis, 0).reshape(x.shape[self.axis], -1)
            return rows.amin(dim=1), rows.amax(dim=1)
        if g == "per_group":
            groups = x.reshape(x.shape[0], -1, self.group_size)
            return groups.amin(dim=-1).reshape(-1), groups.amax(dim=-1).reshape(-1)
        mn, mx = torch.aminmax(x)  # whole tensor: torch's fast path
        return mn.reshape(1), mx.reshape(1)

    def _qparams(self, mn: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dtype in FP8_MAX:
            return fp8_scale_from_minmax(mn, mx, FP8_MAX[self.dtype])
        return qparams_from_minmax(mn, mx, self.quant_min, self.quant_max, self.symmetric)

    @torch.no_grad()
    def observe_tensor(self, x: torch.Tensor) -> None:
        """Fold ``x`` into the observer and recompute ``scale`` / ``zero_point``."""
        if x.numel() == 0 or self.observer is None:
            return
        if self._observe_fused(x):
            # observer statistics and qparams updated in place, as refresh_qparams would
            weight_cache.clear(self)
            self.observed = True
            return
        if getattr(self.observer, "needs_data", False):
            self.observer.observe(x)  # histogram-based: the whole tensor
        else:
            mn, mx = self._minmax(x.detach().float())
            self.observer.update(mn, mx)
        self._observed()

    def _observe_fused(self, x: torch.Tensor) -> bool:
        """Observe ``x`` with one C++ call (``qcompile::observe_minmax``: the observer's
        statistics and the qparams, one pass over ``x``, the same bits) where
        ``_fusable`` allows. Returns whether it did. (The Python path costs ~15 small
        tensor ops, ~140 us per activation quantizer per step.)"""
        fusable = self._fusable(x)
        if fusable is None:
            return False
        momentum, mn, mx, scale, zero_point = fusable
        torch.ops.qcompile.observe_minmax(x.detach(), mn, mx, scale, zero_point,
                                          self.quant_min, self.quant_max, self.symmetric,
                                          momentum)
        return True

    def _observe_fake_quant(self, x: torch.Tensor) -> torch.Tensor | None:
        """``observe_tensor(x)`` and then the fake-quant of ``x``, in one C++ call
        (``qcompile::fake_quant_observe``; the same bits and the same straight-through
        node), or None where ``_fusable`` does not allow it. A weight's rows are read once:
        each row's min / max, its qparams, then its forward while it is in cache."""
        fusable = self._fusable(x)
        if fusable is None:
            return None
        momentum, mn, mx, scale, zero_point = fusable
        out = torch.ops.qcompile.fake_quant_observe(x, mn, mx, scale, zero_point,
                                                    self.quant_min, self.quant_max,
                                                    self.symmetric, momentum)
        # what observe_tensor does after observing (plain attribute: no __setattr__)
        weight_cache.clear(self)
        self.__dict__["observed"] = True
        return out

    def _fusable(self, x: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor,
                                                  torch.Tensor, torch.Tensor] | None:
        """``(momentum, min_val, max_val, scale, zero_point)`` to pass
        ``qcompile::observe_minmax`` (momentum -1: a running min / max) when it can observe
        ``x`` for this quantizer, else None: a plain min-max or moving-average observer,
        per-tensor or per-channel along dim 0 (a weight's output channels), fixed integer
        scales, plain contiguous float32 CPU tensors, nothing tracing (``_cpu_state``)."""
        obs = self._modules.get("observer")
        kind = type(obs)
        if kind is MinMaxObserver:
            momentum = -1.0  # running min / max
        elif kind is MovingAverageObserver:
            momentum = float(obs.momentum)
        else:
            return None
        if self.learnable or self.dtype in FP8_DTYPES:
            return None
        granularity = self.granularity
        if not (granularity == "per_tensor" or (granularity == "per_channel" and self.axis == 0)):
            return None
        if weight_cache.tracing():  # first: the checks below would break a compiled graph
            return None
        if not (type(x) in (torch.Tensor, nn.Parameter) and x.dtype == torch.float32
                and x.is_cpu and x.is_contiguous() and not x.is_inference()):
            return None
        state = self._cpu_state(obs)
        if state is None or not kernels.available():
            return None
        mn, mx, scale, zero_point = state
        rows = 1 if granularity == "per_tensor" else x.shape[0]
        if mn.numel() != rows or x.dim() == 0 or x.numel() == 0:
            return None
        return momentum, mn, mx, scale, zero_point

    def _cpu_state(self, obs: nn.Module) -> tuple[torch.Tensor, ...] | None:
        """``(min_val, max_val, scale, zero_point)`` of ``obs`` (this quantizer's observer)
        and this quantizer when all four are plain CPU tensors, else None. Read from the
        module tables directly: ``nn.Module.__getattr__`` costs about a microsecond a name,
        and every training forward asks."""
        stats, bufs = obs._buffers, self._buffers
        state = (stats.get("min_val"), stats.get("max_val"), bufs.get("scale"),
                 bufs.get("zero_point"))
        for t in state:
            if type(t) is not torch.Tensor or not t.is_cpu:
                return None
        return state

    @torch.no_grad()
    def observe_range(self, mn: torch.Tensor, mx: torch.Tensor) -> None:
        """Fold a minimum and maximum computed elsewhere (one per scale, as ``observe_tensor``
        would compute them; e.g. reduced across the ranks that each hold some rows of a
        sharded weight) into a min-max observer and recompute ``scale`` / ``zero_point``."""
        if self.observer is None or getattr(self.observer, "needs_data", False):
            raise ValueError("observe_range needs a min-max observer")
        self.observer.update(mn, mx)
        self._observed()

    def _observed(self) -> None:
        self.refresh_qparams()
        self.observed = True  # for synchronisation across data-parallel ranks
        self.__dict__["initialised"] = True
        if self.learnable:
            # LSQ: the observer only initialises the scale; from then on it is learned.
            self.observe = False

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The state of a new quantizer: unit scale, zero point 0, an empty observer, the
        flag buffer matching ``enabled`` / ``observe``. What ``to_empty()`` leaves
        undefined (a graph compiled on the meta device, then allocated), as for torch's
        own modules."""
        self.set_qparams(torch.ones(self.zero_point.shape, dtype=torch.float32),
                         torch.zeros(self.zero_point.shape, dtype=torch.int32))
        self.mode_flags.copy_(torch.tensor([self.enabled, self.observe], dtype=torch.uint8))
        if self.observer is not None:
            self.observer.reset()
        self.observed = False
        self.__dict__.update(_pending=None, initialised=False)

    @torch.no_grad()
    def refresh_qparams(self) -> None:
        """Recompute ``scale`` / ``zero_point`` from the observer's statistics.

        A learnable scale becomes the reference with offset 0 (``set_qparams``), written
        through ``.data`` (after a forward that saved it for backward, autograd must not
        see a change), and into its local shard when FSDP2 has sharded it."""
        if self.observer is None:
            return
        scale, zero_point = self._qparams(self.observer.min_val, self.observer.max_val)
        # written through .data (no version bump): set_qparams drops the cached weight
        self.set_qparams(scale, zero_point)

    def clear_weight_cache(self) -> None:
        """Drop the cached fake-quantized weight (see ``reuse_weight``): needed only after
        writes autograd does not see, such as ``weight.data.copy_(...)``."""
        weight_cache.clear(self)

    # -- forward ----------------------------------------------------------------------
    def _shaped(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.granularity == "per_channel":
            shape = [1] * x.dim()
            shape[self.axis] = -1
            return t.view(shape)
        if self.granularity == "per_group":
            return t.view(x.shape[0], -1, 1)
        return t.view(()) if x.dim() == 0 else t  # a 0-d value (``y.sum()``)

    def _fake_quant(self, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                    shaped: bool) -> torch.Tensor:
        if self.block_format is not None:
            self._check_block_shape(x)
            return fake_quantize_block(x if x.is_contiguous() else x.contiguous(),
                                       self.block_format, self.group_size)
        src = x
        if self.granularity == "per_group":
            x = x.reshape(x.shape[0], -1, self.group_size)
        if not shaped:
            scale, zero_point = self._shaped(scale, x), self._shaped(zero_point, x)
        # a weight (its layer keeps it anyway) is saved for backward instead of a mask
        weight = type(src) is nn.Parameter or type(src._base) is nn.Parameter
        if self.dtype in FP8_DTYPES:
            out = fake_quantize_fp8(x, scale, self.dtype, FP8_MAX[self.dtype], weight=weight)
        else:
            batch = src.shape[0] if self.per_example and src.dim() > 1 else 1
            out = fake_quantize(x, scale, zero_point, self.quant_min, self.quant_max,
                                learnable=self.learnable, batch=batch, weight=weight)
        # per_group only changed the shape; returning a reshape view otherwise would make
        # FSDP2 warn about views at the module boundary
        return out.reshape(src.shape) if self.granularity == "per_group" else out

    def _check_block_shape(self, x: torch.Tensor) -> None:
        """A tensor whose blocks do not fit (a graph compiled without example inputs, run
        on a new shape): the error a spec would have given."""
        if x.dim() and x.shape[0] and (
                x.shape[-1] if not self.weight else x.numel() // x.shape[0]) % self.group_size == 0:
            return
        try:
            check_blocks(Scheme(dtype=self.block_format, group_size=self.group_size),
                         tuple(x.shape), role="weight" if self.weight else "activation")
        except ValueError as e:
            raise QCompileError(f"block fake-quant: {e}",
                                fix="compile with example_inputs of the shapes you run") from None

    def forward(self, x: torch.Tensor, overwrite: bool = False,
                local: bool = False) -> torch.Tensor:
        # ``local``: ``x`` is a tensor-parallel shard (a DTensor) and the caller computes on
        # this rank's values: they come back as a plain tensor (``ShardedLinear``)
        # ``overwrite``: the graph's code reads nothing of ``x`` after this call
        # (``passes.overwrite_inputs`` marks such calls), so a training forward (fixed
        # qparams, or step updates) may write its output over ``x``'s memory
        # (``_may_overwrite``). Evaluation forwards never do: measuring tools keep values.
        # The commonest call once observers are off (calibrated, frozen): a plain CPU
        # tensor through a fixed per-tensor integer quantizer, straight to the kernel.
        # Each Python layer of the general path below costs about a microsecond, together
        # more than the kernel on a small tensor; this is the operator call (and the
        # arguments) the general path ends in for such a call.
        if (type(x) is torch.Tensor and self.enabled and not self.observe
                and self.check_finite is None and self.granularity == "per_tensor"
                and not self.learnable
                and not self.dynamic and self.dtype not in FP8_DTYPES and x.is_cpu
                and x.is_floating_point() and x.numel() != 0 and x.dim() != 0
                and not torch.compiler.is_dynamo_compiling() and kernels.available()):
            op = torch.ops.qcompile.fake_quant
            if (overwrite and self.training and torch.is_grad_enabled()
                    and self._may_overwrite() and not weight_cache.tracing()):
                op = torch.ops.qcompile.fake_quant_overwrite
            return op(x, self.scale, self.zero_point, self.quant_min, self.quant_max)
        if type(x) is not torch.Tensor and type(x) is not nn.Parameter and _sharded(x):
            # a tensor-parallel shard: the whole tensor's qparams (qcompile.runtime.sharded)
            return sharded.fake_quant_dtensor(self, x, local=local)
        # Only floating-point tensors are quantized: indices, masks and sizes pass through.
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return x
        if self.check_finite is not None and not torch.compiler.is_compiling():
            refuse_nonfinite_input(self.check_finite, x)
        if self.block_format is not None:
            if not self.enabled:
                return x
            # a weight's copy is recomputed in backward, not kept (train.recompute_weights)
            return self._recomputable(
                self._fake_quant(x, self.scale, self.zero_point, shaped=True), x)
        if self.dynamic or self.granularity == "per_token":
            if not self.enabled:
                return x
            with torch.no_grad():
                scale, zero_point = self._qparams(*self._minmax(x.detach().float()))
            return self._fake_quant(x, scale, zero_point, shaped=self.granularity == "per_token")
        if self.enabled and self.reuse_weight and self._may_reuse(x):
            return weight_cache.forward(self, x)
        if self.observe:
            if self.training and torch.is_grad_enabled() and self.deferred():
                return self._observe_later(x, overwrite and self._may_overwrite())
            if self.enabled:
                out = self._observe_fake_quant(x)
                if out is not None:
                    return self._recomputable(out, x)
            self.observe_tensor(x)
        if not self.enabled:
            return x
        return self._recomputable(self._fake_quant(x, self.scale, self.zero_point, shaped=False), x)

    def _recomputable(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (this forward's fake-quantized ``x``), tagged to be recomputed in backward
        instead of kept (``qcompile.runtime.recompute``) when ``x`` is a weight and a
        compiled graph's forward runs with the recomputing hooks."""
        if type(x) is not nn.Parameter:
            base = x._base
            if base is None or type(base) is not nn.Parameter:
                return out
        # torch.compile: the hooks are not pushed while compiling (and reading them breaks
        # the graph); Inductor plans what it saves itself
        if torch.compiler.is_compiling() or not recompute.active():
            return out
        # the qparams as this forward used them: set_qparams writes the buffers in place
        scale = self.scale.detach()
        if not self.learnable:
            scale = scale.clone()
        return recompute.tag(out, x, self._fake_quant_again, scale, self.zero_point.clone())

    def _fake_quant_again(self, x: torch.Tensor, scale: torch.Tensor,
                          zero_point: torch.Tensor) -> torch.Tensor:
        return self._fake_quant(x.detach(), scale, zero_point, shaped=False)

    # -- step updates (``update == "step"``) ---------------------------------------------
    def deferred(self) -> bool:
        """Whether training forwards defer their observations to ``apply_pending``: step
        updates, an activation quantizer, a min-max or moving-average observer."""
        return (self.update == "step" and not self.weight
                and type(self._modules.get("observer")) in (MinMaxObserver,
                                                            MovingAverageObserver))

    def _observe_later(self, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        """A training forward with step updates: fold ``x``'s minima / maxima into the
        pending statistics; fake-quantize with the qparams as they are (unchanged until
        ``apply_pending``), or pass ``x`` through while the observer has no statistics.
        ``overwrite``: the output may go into ``x``'s memory."""
        qparams = self._one_pass(x) if self.enabled else None
        if qparams is not None and self._ready():
            # one C++ pass (qcompile::fake_quant_minmax): the fake-quant and its mask, and
            # the min / max folded into the pending statistics, x read once; the same bits
            # as the two passes below. The overwriting variant writes over x when nothing
            # else holds its memory (checked there), saving a new output's memory and
            # writes: 2% of a 12-layer transformer's QAT step on a 2-core AVX-512 machine.
            pending = self.__dict__.get("_pending")
            if pending is None:
                pending = self._fresh_pending()
            scale, zero_point = qparams
            op = (torch.ops.qcompile.fake_quant_minmax_overwrite if overwrite
                  else torch.ops.qcompile.fake_quant_minmax)
            return op(x, scale, zero_point, self.quant_min, self.quant_max, pending[0],
                      pending[1])
        with torch.no_grad():
            pending = self._pending
            if self._fusable(x) is not None:
                # one C++ pass: a running min / max into the pending statistics (the qparams
                # it also computes go to scratch tensors, never used)
                if pending is None:
                    pending = self._fresh_pending()
                scratch = self.__dict__.get("_scratch")
                if scratch is None or scratch[0].shape != self.scale.shape:
                    scratch = (torch.empty_like(self.scale), torch.empty_like(self.zero_point))
                    self.__dict__["_scratch"] = scratch
                torch.ops.qcompile.observe_minmax(x.detach(), pending[0], pending[1], *scratch,
                                                  self.quant_min, self.quant_max,
                                                  self.symmetric, -1.0)
            else:
                mn, mx = self._minmax(x.detach().float())
                if pending is None or pending[0].device != mn.device:
                    self.__dict__["_pending"] = (mn.clone(), mx.clone())
                else:
                    torch.minimum(pending[0], mn, out=pending[0])
                    torch.maximum(pending[1], mx, out=pending[1])
        if not self.enabled:
            return x
        if not self.initialised:
            # one check until the first statistics arrive (a loaded or calibrated observer
            # has them already)
            if torch.compiler.is_compiling():
                # no branch on a tensor's value while compiling: both, chosen by it
                ready = torch.isfinite(self.observer.min_val).any()
                return torch.where(ready, self._fake_quant(x, self.scale, self.zero_point,
                                                           shaped=False), x)
            if not self._ready():
                return x
        return self._fake_quant(x, self.scale, self.zero_point, shaped=False)

    def _may_overwrite(self) -> bool:
        """No hook (of this module, or of every module) has seen ``x``: one that keeps it
        would read the new values. What holds ``x``'s memory in C++ (another view of it,
        a tensor autograd saved) is checked by the kernel, and a marked call is the
        graph's own promise that its code reads nothing after it (as
        ``nn.ReLU(inplace=True)``)."""
        return not (self._forward_hooks or self._forward_pre_hooks
                    or _module._global_forward_hooks or _module._global_forward_pre_hooks)

    def _fresh_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """New pending statistics (+inf / -inf, one per scale), set and returned. Every
        step of every activation quantizer starts them, so they are the two halves of one
        kept tensor, reset by one copy (``apply_pending`` reads it whole, and each reader
        of the pending statistics copies them)."""
        d = self.__dict__
        like = self._modules["observer"]._buffers["min_val"]
        spare = d.get("_pending_spare")  # (both halves, its template, the halves)
        if (spare is None or spare[2][0].shape != like.shape
                or spare[0].device != like.device):
            n = like.numel()
            template = torch.cat([torch.full((n,), float("inf"), device=like.device),
                                  torch.full((n,), float("-inf"), device=like.device)])
            both = template.clone()
            spare = (both, template, (both[:n].view(like.shape), both[n:].view(like.shape)))
            d["_pending_spare"] = spare
        else:
            spare[0].copy_(spare[1])
        d["_pending"] = spare[2]
        return spare[2]

    def _ready(self) -> bool:
        """The observer has statistics to quantize with (``initialised``, set by the first
        forward that finds them). Not while compiling (a branch on a tensor's value)."""
        if not self.initialised:
            if not bool(torch.isfinite(self.observer.min_val).any()):
                return False
            self.__dict__["initialised"] = True
        return True

    def _one_pass(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The scale and zero point, shaped for ``x``, when ``qcompile::fake_quant_minmax``
        runs this training forward with step updates, else None: a fixed-scale integer
        quantizer, per-tensor or per-channel; a plain CPU float32, bfloat16 or float16
        activation; CPU statistics of one value per scale; nothing tracing; the kernels
        built. ``_one_pass_step`` (a private switch, True): False takes the two passes
        (the benchmark's comparison)."""
        if not self._one_pass_step or self.learnable or self.dtype in FP8_DTYPES:
            return None
        if weight_cache.tracing():  # first: the checks below would break a compiled graph
            return None
        if not (type(x) is torch.Tensor and x.dtype in _ONE_PASS_DTYPES and x.is_cpu):
            return None
        state = self._cpu_state(self._modules["observer"])  # deferred(): there is one
        if state is None:
            return None
        scale, zero_point = state[2:]
        n = zero_point.numel()
        if self.granularity == "per_channel":
            if not (-x.dim() <= self.axis < x.dim() and x.shape[self.axis] == n):
                return None
        elif self.granularity != "per_tensor":
            return None
        pending = self.__dict__.get("_pending")
        if pending is not None:
            for t in pending:
                if not (t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
                        and t.numel() == n):
                    return None
        if not kernels.available():
            return None
        if self.granularity == "per_tensor" and x.dim() != 0:
            return scale, zero_point
        return self._shaped(scale, x), self._shaped(zero_point, x)

    def pending_stats(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pending (min, max) of step updates, or None when there are none."""
        return self._pending

    def apply_pending(self, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Fold the pending statistics (or ``stats``: the same reduced across ranks) into
        the observer, once (a moving average takes one update), and recompute the qparams.
        Returns whether there was anything to apply."""
        d = self.__dict__
        pending = d.get("_pending")
        if pending is None:
            return False
        d["_pending"] = None
        spare = d.get("_pending_spare")
        if stats is None and spare is not None and pending is spare[2]:
            both = spare[0]  # [minima, maxima] already (_fresh_pending)
        else:
            mn, mx = stats if stats is not None else pending
            both = torch.cat([mn.reshape(-1), mx.reshape(-1)])
        obs = self._modules["observer"]
        both = both.to(obs._buffers["min_val"].device)
        if self.granularity == "per_tensor" and self._observe_fused(both):
            # one C++ call: the observer's update and the qparams, the same bits as below
            # (the minimum and maximum of [min, max] are min and max)
            d["observed"] = False
        else:
            n = both.numel() // 2
            with torch.no_grad():
                obs.update(both[:n].view_as(obs.min_val), both[n:].view_as(obs.max_val))
            self.refresh_qparams()
        # reduced already: not `observed` (nothing for a per-forward sync to do)
        d["initialised"] = True
        if self.learnable:
            self.observe = False  # LSQ: the observer only initialises the scale
        return True

    def _may_reuse(self, x: torch.Tensor) -> bool:
        """``x`` is a weight the cache may hold, and observing it again (when ``observe``
        is on) would change nothing: a fixed-scale min-max observer."""
        # Activations are never parameters: one type check, first, keeps their forward
        # free of the checks below (it is also safe to trace).
        if type(x) is not nn.Parameter or torch.compiler.is_compiling():
            return False
        if self.observe and not (type(self._modules.get("observer")) is MinMaxObserver
                                 and not self.learnable):
            return False
        # LSQ under saved-tensor hooks (non-reentrant checkpointing compares the tensors
        # saved by a forward with those of its recomputation): the uncached nodes, always
        if self.learnable and torch.is_grad_enabled() and weight_cache.saved_tensor_hooks_active():
            return False
        return weight_cache.cacheable_weight(x)

    # The two switches are plain Python bools, read in forward without .item() (export- and
    # meta-friendly). A calibrated graph must still reload as calibrated, so they are
    # mirrored into a small uint8 buffer (a tensor, like torch.ao's flags, so state_dicts
    # stay all-tensor for safetensors and distributed checkpoints) and read back on load.
    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name in _FLAG_INDEX:
            weight_cache.clear(self)
        if name in _FLAG_INDEX and "mode_flags" in self._buffers:
            flags = self._buffers["mode_flags"]
            if flags is not None and flags.device.type != "meta":
                with torch.no_grad():
                    flags[_FLAG_INDEX[name]] = int(bool(value))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        weight_cache.clear(self)
        self._convert_scale_entries(state_dict, prefix)
        key = prefix + EXTRA_STATE
        # torch's private copy: a state dict saved without the entry (before it existed)
        # loads under strict=True too, as set_extra_state(None)
        state_dict[key] = self._checked_extra_state(key, state_dict.get(key))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        flags = state_dict.get(prefix + "mode_flags")
        if isinstance(flags, torch.Tensor) and flags.device.type != "meta":
            self.enabled = bool(flags[0])
            self.observe = bool(flags[1])

    # -- what a state dict keeps besides parameters and buffers --------------------------
    # Step updates keep two facts outside the buffers: the pending statistics (plain tensors:
    # DDP broadcasts buffers from rank 0 before every forward, which would replace each
    # rank's own) and ``initialised``. The state dict carries them as the module's extra
    # state, one float32 tensor (state dicts stay all-tensor: safetensors, weights_only
    # loads, torch.distributed.checkpoint) of a fixed length per quantizer (DCP loads in
    # place): [initialised, pending, min..., max...], ``pending`` one of the PENDING_*
    # codes, the statistics (+inf / -inf without pending ones) only for quantizers that
    # defer (``deferred()``). The tensor is this quantizer's own, refreshed by each call,
    # like a buffer (a pipeline graph names state-dict entries by their tensors' identity).
    def get_extra_state(self) -> torch.Tensor:
        """``[initialised, pending, min..., max...]`` (float32): see the comment above.

        Example:
            >>> import torch
            >>> fq = FakeQuantize("uint8", symmetric=False, update="step")
            >>> _ = fq(torch.tensor([0.5, 2.0], requires_grad=True))   # a training forward
            >>> fq.state_dict()["_extra_state"].tolist()   # pending: [min], [max]
            [0.0, 1.0, 0.5, 2.0]
        """
        n = self._pending_size()
        device = self.observer.min_val.device if n else self.zero_point.device
        entry = self.__dict__.get("_extra_entry")
        if entry is None or entry.numel() != 2 + 2 * n or entry.device != device:
            entry = torch.empty(2 + 2 * n, dtype=torch.float32, device=device)
            self.__dict__["_extra_entry"] = entry
        if device.type == "meta":
            return entry
        pending = self._pending
        with torch.no_grad():
            entry[0] = float(self._has_statistics())
            entry[1] = PENDING_NONE if pending is None else PENDING_IN_STEP
            if n:
                if pending is None:
                    entry[2:2 + n].fill_(float("inf"))
                    entry[2 + n:].fill_(float("-inf"))
                else:
                    entry[2:2 + n].copy_(pending[0].reshape(-1))
                    entry[2 + n:].copy_(pending[1].reshape(-1))
        return entry

    def _pending_size(self) -> int:
        """How many minima (and maxima) the extra state holds: the observer's, for a
        quantizer that defers; 0 otherwise (a converted graph may have dropped the
        observer of a quantizer it only reads qparams from)."""
        obs = self._modules.get("observer")
        return obs.min_val.numel() if obs is not None and self.deferred() else 0

    def _has_statistics(self) -> bool:
        """``initialised`` as saved: the fact it caches (set by the first forward that finds
        the observer with finite statistics), so that graphs whose observers hold the same
        statistics save the same entry (ranks that received rank 0's statistics without
        observing, a graph loaded from a state dict and not run since)."""
        if self.initialised:
            return True
        min_val = getattr(self._modules.get("observer"), "min_val", None)
        local = _local_values(min_val) if isinstance(min_val, torch.Tensor) else None
        return local is not None and bool(torch.isfinite(local).any())

    def set_extra_state(self, state: torch.Tensor | None) -> None:
        """Restore ``initialised`` and the pending statistics from ``get_extra_state``'s
        tensor (checked by ``_load_from_state_dict``). ``None`` (a state dict saved without
        it) drops the pending statistics and checks again on the next training forward
        whether the observer has statistics. An entry without statistics (one saved by a
        quantizer that does not defer) restores none."""
        weight_cache.clear(self)
        self.__dict__.update(_pending=None, initialised=False, _pending_loaded=PENDING_NONE)
        local = _local_values(state) if isinstance(state, torch.Tensor) else None
        if local is None:
            return  # none saved, or none to read (meta)
        n = self._pending_size()
        if local.numel() != 2 + 2 * n:
            return  # another kind of quantizer saved it: nothing of ours to restore
        self.__dict__["initialised"] = bool(local[0])
        code = float(local[1])
        if n and code != PENDING_NONE:
            like = self.observer.min_val
            mn = local[2:2 + n].to(like.device, torch.float32).reshape(like.shape).clone()
            mx = local[2 + n:].to(like.device, torch.float32).reshape(like.shape).clone()
            self.__dict__.update(_pending=(mn, mx), _pending_loaded=code)

    def extra_state_entry(self) -> torch.Tensor | None:
        """The tensor the last ``get_extra_state`` returned (refreshed by each), or None."""
        return self.__dict__.get("_extra_entry")

    def loaded_pending(self) -> float:
        """What the last ``load_state_dict`` restored: ``PENDING_NONE``, ``PENDING_IN_STEP``
        (statistics of a step still under way) or ``PENDING_STEP_ENDED`` (statistics of a
        step whose optimizer step came before the save: the graph applies them at its next
        forward). Reading clears it."""
        return self.__dict__.pop("_pending_loaded", PENDING_NONE)

    def _checked_extra_state(self, key: str, value: object) -> torch.Tensor | None:
        """``value`` if it is an extra-state entry this quantizer can restore, None when
        there is none; anything else is a ``QCompileError`` naming the entry."""
        if value is None:
            return None
        n = self._pending_size()
        if not (isinstance(value, torch.Tensor) and value.dim() == 1
                and value.is_floating_point() and value.numel() in (2, 2 + 2 * n)):
            shown = (f"a {value.dtype} tensor of shape {list(value.shape)}"
                     if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
            raise QCompileError(
                f"state dict entry {key}: {shown} is not this quantizer's state (a float "
                f"tensor of {2 + 2 * n} values: initialised, pending, "
                f"{n} minima and {n} maxima{' (none here)' if not n else ''})",
                fix="load a state dict saved from a graph compiled from the same model and "
                "spec; drop the entry to load the rest (its step's pending statistics are "
                "then lost)")
        return value

    def _convert_scale_entries(self, state_dict: dict, prefix: str) -> None:
        """Map the scale entries of ``state_dict`` (torch's private copy) to this
        quantizer's kind: a plain ``scale`` (a fixed-scale graph, or a learnable one saved
        before scales were parameterised) becomes ``scale_ref`` with offset 0, and a
        learnable ``scale_offset`` / ``scale_ref`` pair becomes a fixed ``scale``. A
        learnable scale that is not finite and positive is refused, naming the entry,
        before this quantizer changes."""
        plain, offset, ref = (prefix + k for k in ("scale", "scale_offset", "scale_ref"))
        if self.learnable:
            if plain in state_dict and offset not in state_dict and ref not in state_dict:
                value = state_dict.pop(plain)
                if isinstance(value, torch.Tensor):
                    self._refuse_bad_scale(plain, value)
                    state_dict[ref] = value
                    state_dict[offset] = torch.zeros_like(value)
            elif isinstance(state_dict.get(ref), torch.Tensor):
                self._refuse_bad_scale(ref, state_dict[ref])
                if isinstance(state_dict.get(offset), torch.Tensor):
                    local = _local_values(state_dict[offset])
                    if local is not None and not bool(torch.isfinite(local).all()):
                        raise QCompileError(
                            f"state dict entry {offset}: the learnable scale's offset has "
                            "NaN or infinite values",
                            fix="load a checkpoint saved before training diverged")
        elif (plain not in state_dict and isinstance(state_dict.get(offset), torch.Tensor)
              and isinstance(state_dict.get(ref), torch.Tensor)):
            o, r = state_dict.pop(offset), state_dict.pop(ref)
            self._refuse_bad_scale(ref, r)
            if o.shape == r.shape and not _sharded(o):
                with torch.no_grad():
                    state_dict[plain] = learned_scale(o.float(), r.float())

    @staticmethod
    def _refuse_bad_scale(key: str, value: torch.Tensor) -> None:
        bad = _not_positive(value)
        if bad:
            local = _local_values(value)
            shown = local.reshape(-1)[:4].tolist() if local is not None else []
            raise QCompileError(
                f"state dict entry {key}: {bad} of its {value.numel()} scales are not finite "
                f"and positive (first values {shown}); a learnable scale must be > 0",
                fix="load a checkpoint whose scales are positive (re-export it, or "
                "re-calibrate this quantizer: set observe=True and run a batch)")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # a learnable quantizer pickled before scales were parameterised: scale -> ref
        params = self.__dict__.get("_parameters", {})
        if self.__dict__.get("learnable") and "scale" in params:
            old = params.pop("scale").detach().float()
            params["scale_offset"] = nn.Parameter(torch.zeros_like(old))
            self._buffers["scale_ref"] = old.clone()

    # The weight cache is runtime state of this instance only: moved or converted tensors
    # start without it, and copies and pickles never carry it.
    # Casting the graph (``gm.to(torch.bfloat16)``, ``.half()``) moves qparams and observer
    # statistics but keeps their dtypes: float32 scales and ranges, float64 histograms.
    def _apply(self, fn, recurse=True):  # type: ignore[override]
        weight_cache.clear(self)
        self.__dict__["_pending"] = None  # a step's pending statistics do not move
        dtypes = {name: t.dtype for name, t in self._state_tensors()}
        out = super()._apply(fn, recurse)
        self._restore_dtypes(dtypes)
        return out

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [*self.named_parameters(recurse=True), *self.named_buffers(recurse=True)]

    @torch.no_grad()
    def _restore_dtypes(self, dtypes: dict[str, torch.dtype]) -> None:
        for name, t in self._state_tensors():
            want = dtypes.get(name)
            if want is None or t.dtype == want or not (t.is_floating_point()
                                                        and want.is_floating_point):
                continue
            parent, _, leaf = name.rpartition(".")
            owner = self.get_submodule(parent) if parent else self
            if isinstance(t, nn.Parameter):
                t.data = t.data.to(want)
                if t.grad is not None:
                    t.grad = t.grad.to(want)
            else:
                owner._buffers[leaf] = t.to(want)

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # a copy of __dict__
        state.pop(weight_cache.ATTR, None)
        state.pop("_scratch", None)
        state.pop("_extra_entry", None)  # made again by the copy's own state_dict()
        return state

    def extra_repr(self) -> str:
        parts = [self.dtype, self.granularity, "symmetric" if self.symmetric else "affine",
                 f"range=[{self.quant_min}, {self.quant_max}]"]
        if self.axis is not None:
            parts.append(f"axis={self.axis}")
        if self.group_size is not None:
            parts.append(f"group_size={self.group_size}")
        parts += [f"scales={self.scale.numel()}", f"enabled={self.enabled}",
                  f"observe={self.observe}"]
        if self.learnable:
            parts.append("learnable")
        if self.dynamic:
            parts.append("dynamic")
        if self.block_format is not None:
            parts[1:4] = [f"blocks of {self.group_size}"]
            parts = [p for p in parts if not p.startswith(("group_size", "scales"))]
        return ", ".join(parts)
