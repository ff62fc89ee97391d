"""Recurrent layers in compiled graphs: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells
as functions of their parameters, and the dynamic integer module ``qc.convert`` makes of them.

``insert_quant`` re-expresses a call of a stock recurrent module as one of ``lstm``, ``gru``,
``rnn``, ``lstm_cell``, ``gru_cell``, ``rnn_cell`` on the module's parameters, each weight
through its quantizer, as it re-expresses a Linear with ``F.linear``:

- Without activation quantizers (``qat``, ``static``, weight-only) they call the kernels the
  stock module calls (``torch._VF.lstm``, ``torch._VF.gru_cell``...) on the fake-quantized
  weights, so training works as before and gradients reach the parameters straight
  through the quantizers.
- With dynamic activation quantizers (``quant.mode: dynamic``) they compute what torch's
  dynamic quantized recurrent kernels compute (aten's ``quantized_lstm`` /
  ``quantized_gru`` and ``quantized::quantized_*_cell_dynamic``, which
  ``torch.ao.nn.quantized.dynamic.LSTM`` and its cells call): every product with a weight is
  ``quantized::linear_dynamic``, so the input and the hidden state are quantized per call
  with per-tensor qparams of their own. On the CPU the kernels project a layer's whole
  input sequence at once, so a layer's input (the model's input for the first layer, the
  previous layer's output sequence after it) is quantized once per call with one scale,
  and the hidden state once per time step. The cell state, the gates and their
  nonlinearities stay float32, in the kernels' order of operations.

``DynamicRecurrent`` is what ``qc.convert`` makes of a dynamic recurrent layer: torch's own
modules (``torch.ao.nn.quantized.dynamic.LSTM``, ``GRU``, ``LSTMCell``, ``GRUCell``,
``RNNCell``) built from the graph's integer weights, where one computes what the graph
simulated; otherwise (``nn.RNN``, for which torch has no dynamic module, and cells whose
activations use the full 8-bit range, which torch's cells never do) the same recurrence
as the fake-quant function with ``quantized::linear_dynamic`` in place of each fake-quant
linear.

Example:
    >>> import torch
    >>> from qcompile.runtime import recurrent
    >>> m = torch.nn.GRU(3, 4, batch_first=True)
    >>> x = torch.randn(2, 5, 3)
    >>> out, h = recurrent.gru(x, None, list(m.parameters()), hidden_size=4, batch_first=True)
    >>> ref, h_ref = m(x)
    >>> bool(torch.equal(out, ref)), bool(torch.equal(h, h_ref))
    (True, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.ao.nn.quantized.dynamic as nnqd
import torch.nn.functional as F
from torch import _VF, Tensor, nn
from torch.ao.nn.quantized.dynamic.modules.rnn import PackedParameter
from torch.ao.nn.quantized.modules.linear import LinearPackedParams
from torch.nn.utils.rnn import PackedSequence

from qcompile.errors import QCompileError

__all__ = ["RECURRENT_FUNCTIONS", "RECURRENT_TYPES", "DynamicRecurrent", "cell_kind", "gru",
           "gru_cell", "is_cell", "lstm", "lstm_cell", "rnn", "rnn_cell", "weight_names"]

#: The stock recurrent modules whose calls ``insert_quant`` re-expresses.
RECURRENT_TYPES: tuple[type[nn.Module], ...] = (nn.LSTM, nn.GRU, nn.RNN, nn.LSTMCell,
                                                nn.GRUCell, nn.RNNCell)
_CELLS = (nn.LSTMCell, nn.GRUCell, nn.RNNCell)
_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}

Quantizer = Callable[[Tensor], Tensor]
Linear = Callable[[Tensor], Tensor]
Hidden = Any  # a tensor, or (h, c) for an LSTM


def is_cell(m: nn.Module) -> bool:
    """Whether ``m`` is one of the cells (one time step per call)."""
    return isinstance(m, _CELLS)


def cell_kind(m: nn.Module) -> str:
    """The recurrence a stock module computes: ``lstm``, ``gru``, ``rnn_tanh`` or
    ``rnn_relu`` (cells and sequence modules alike)."""
    if isinstance(m, (nn.LSTM, nn.LSTMCell)):
        return "lstm"
    if isinstance(m, (nn.GRU, nn.GRUCell)):
        return "gru"
    return f"rnn_{m.nonlinearity}"


def weight_names(m: nn.Module) -> list[str]:
    """The parameters a stock recurrent module passes to its kernel, in the kernel's order
    (``_flat_weights_names`` of a sequence module: per layer and direction ``weight_ih``,
    ``weight_hh``, then the biases, then an LSTM's ``weight_hr``)."""
    if is_cell(m):
        return ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if m.bias else [])
    return list(m._flat_weights_names)


# -- the recurrence (the CPU kernels' order of operations) -------------------------------
def _step(kind: str, gi: Tensor, hidden: Hidden, linear_hh: Linear) -> Hidden:
    """One time step from its input projection ``gi`` (bias included), as aten's CPU cells
    compute it: the hidden projection plus ``gi``, then the gates in float32."""
    if kind == "lstm":
        h, c = hidden
        gates = linear_hh(h) + gi
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    gh = linear_hh(hidden)
    if kind == "gru":
        ir, iz, in_ = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r = torch.sigmoid(hr + ir)
        z = torch.sigmoid(hz + iz)
        n = torch.tanh(in_ + hn * r)
        return (hidden - n) * z + n
    pre = gh + gi
    return torch.tanh(pre) if kind == "rnn_tanh" else torch.relu(pre)


def _layer(kind: str, x: Tensor, hidden: Hidden, linear_ih: Linear, linear_hh: Linear,
           reverse: bool) -> tuple[Tensor, Hidden]:
    """One layer and direction over a time-major sequence: the whole input projected at
    once (one ``linear_dynamic`` call in the kernels, so one set of input qparams), then the
    steps."""
    gi = linear_ih(x)
    steps = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    outs: list[Tensor] = [gi] * x.shape[0]
    for t in steps:
        hidden = _step(kind, gi[t], hidden, linear_hh)
        outs[t] = hidden[0] if kind == "lstm" else hidden
    return torch.stack(outs), hidden


def _stack(kind: str, x: Tensor, h0: Tensor, c0: Tensor | None,
           linears: Sequence[tuple[Linear, Linear]], *, num_layers: int, bidirectional: bool,
           dropout: float, training: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Layers over a time-major sequence ``x`` [T, B, I] from hidden states [L*D, B, H]:
    (output [T, B, D*H], h_n, c_n or None)."""
    dirs = 2 if bidirectional else 1
    hs: list[Tensor] = []
    cs: list[Tensor] = []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            i = layer * dirs + d
            hidden = (h0[i], c0[i]) if c0 is not None else h0[i]
            out, hidden = _layer(kind, x, hidden, *linears[i], reverse=d == 1)
            outs.append(out)
            if c0 is not None:
                hs.append(hidden[0])
                cs.append(hidden[1])
            else:
                hs.append(hidden)
        x = outs[0] if dirs == 1 else torch.cat(outs, -1)
        if dropout and training and layer < num_layers - 1:
            x = F.dropout(x, dropout, True)
    return x, torch.stack(hs), torch.stack(cs) if c0 is not None else None


def _fq_linear(weight: Tensor, bias: Tensor | None, quant: Quantizer | None) -> Linear:
    """``F.linear`` of the quantized input: what ``quantized::linear_dynamic`` computes,
    in float32."""
    if quant is None:
        return lambda x: F.linear(x, weight, bias)
    return lambda x: F.linear(quant(x), weight, bias)


def _refuse_packed(input: Any, name: str) -> None:
    if isinstance(input, PackedSequence):
        raise QCompileError(
            f"{name}: a PackedSequence input is not supported by the quantized recurrent "
            "layer", fix=f"pass a padded tensor to {name} (torch.nn.utils.rnn."
            "pad_packed_sequence), or exclude it with a rule {match: {name: "
            f"{name!r}}}, skip: true}}")


# -- sequence modules ----------------------------------------------------------------------
def _sequence(kind: str, input: Tensor, hx: Any, weights: Sequence[Tensor], *,
              hidden_size: int, num_layers: int, bias: bool, batch_first: bool,
              dropout: float, bidirectional: bool, proj_size: int, module: nn.Module | None,
              input_quant: Quantizer | None, hidden_quant: Quantizer | None,
              name: str) -> tuple[Tensor, Any]:
    _refuse_packed(input, name)
    lstm_ = kind == "lstm"
    if input.dim() not in (2, 3):
        raise QCompileError(f"{name}: expected a 2-D or 3-D input, got "
                            f"{str(input.dtype).removeprefix('torch.')}{list(input.shape)}",
                            fix=f"pass {name} a [seq, features] or [batch, seq, features] "
                                f"tensor (batch_first={batch_first})")
    batched = input.dim() == 3
    batch_dim = 0 if batch_first else 1
    seq_dim = 1 if batched and batch_first else 0
    if input.shape[seq_dim] == 0:  # torch's own kernels refuse it deep inside
        raise QCompileError(f"{name}: the input sequence has length 0 "
                            f"({str(input.dtype).removeprefix('torch.')}{list(input.shape)}, "
                            f"batch_first={batch_first})",
                            fix="pass sequences of at least one step (drop empty ones)")
    if not batched:
        input = input.unsqueeze(batch_dim)
        if hx is not None:
            hx = (hx[0].unsqueeze(1), hx[1].unsqueeze(1)) if lstm_ else hx.unsqueeze(1)
    if hx is None:
        dirs = 2 if bidirectional else 1
        size = (num_layers * dirs, input.size(batch_dim))
        h0 = input.new_zeros(*size, proj_size or hidden_size)
        hx = (h0, input.new_zeros(*size, hidden_size)) if lstm_ else h0
    training = module is not None and module.training
    if input_quant is None and hidden_quant is None:
        vf = {"lstm": _VF.lstm, "gru": _VF.gru, "rnn_tanh": _VF.rnn_tanh,
              "rnn_relu": _VF.rnn_relu}[kind]
        result = vf(input, hx, list(weights), bias, num_layers, dropout, training,
                    bidirectional, batch_first)
        out, hidden = result[0], (tuple(result[1:]) if lstm_ else result[1])
    else:
        if proj_size:
            raise QCompileError(f"{name}: dynamic quantization of an LSTM with proj_size is "
                                "not supported (torch's quantized LSTM has no projections)",
                                fix=f"exclude {name} with a skip rule, or use quant.mode qat")
        per = 2 + 2 * bias
        linears = []
        for k in range(0, len(weights), per):
            w_ih, w_hh = weights[k], weights[k + 1]
            b_ih, b_hh = (weights[k + 2], weights[k + 3]) if bias else (None, None)
            linears.append((_fq_linear(w_ih, b_ih, input_quant),
                            _fq_linear(w_hh, b_hh, hidden_quant)))
        x = input.transpose(0, 1) if batch_first else input
        h0, c0 = hx if lstm_ else (hx, None)
        out, h, c = _stack(kind, x, h0, c0, linears, num_layers=num_layers,
                           bidirectional=bidirectional, dropout=dropout, training=training)
        out = out.transpose(0, 1) if batch_first else out
        hidden = (h, c) if lstm_ else h
    if not batched:
        out = out.squeeze(batch_dim)
        hidden = (hidden[0].squeeze(1), hidden[1].squeeze(1)) if lstm_ else hidden.squeeze(1)
    return out, hidden


def lstm(input: Tensor, hx: tuple[Tensor, Tensor] | None, weights: Sequence[Tensor], *,
         hidden_size: int, num_layers: int = 1, bias: bool = True, batch_first: bool = False,
         dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
         module: nn.Module | None = None, input_quant: Quantizer | None = None,
         hidden_quant: Quantizer | None = None,
         name: str = "lstm") -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``nn.LSTM``'s forward on ``weights`` (its ``_flat_weights`` order). ``module``: the
    layer, whose ``training`` switches dropout between layers (given where dropout
    applies); ``input_quant`` / ``hidden_quant``: dynamic quantizers of each layer's input
    sequence and of the hidden state at each step (see the module docstring); ``name``
    names the layer in errors.

    Example:
        >>> m = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True)
        >>> x = torch.randn(5, 2, 3)
        >>> out, (h, c) = lstm(x, None, m._flat_weights, hidden_size=4, num_layers=2,
        ...                    bidirectional=True)
        >>> ref, (h_ref, c_ref) = m(x)
        >>> out.shape, bool(torch.equal(out, ref) and torch.equal(c, c_ref))
        (torch.Size([5, 2, 8]), True)
    """
    return _sequence("lstm", input, hx, weights, hidden_size=hidden_size,
                     num_layers=num_layers, bias=bias, batch_first=batch_first,
                     dropout=dropout, bidirectional=bidirectional, proj_size=proj_size,
                     module=module, input_quant=input_quant, hidden_quant=hidden_quant,
                     name=name)


def gru(input: Tensor, hx: Tensor | None, weights: Sequence[Tensor], *, hidden_size: int,
        num_layers: int = 1, bias: bool = True, batch_first: bool = False,
        dropout: float = 0.0, bidirectional: bool = False, module: nn.Module | None = None,
        input_quant: Quantizer | None = None, hidden_quant: Quantizer | None = None,
        name: str = "gru") -> tuple[Tensor, Tensor]:
    """``nn.GRU``'s forward on ``weights``; the arguments are ``lstm``'s."""
    return _sequence("gru", input, hx, weights, hidden_size=hidden_size,
                     num_layers=num_layers, bias=bias, batch_first=batch_first,
                     dropout=dropout, bidirectional=bidirectional, proj_size=0,
                     module=module, input_quant=input_quant, hidden_quant=hidden_quant,
                     name=name)


def rnn(input: Tensor, hx: Tensor | None, weights: Sequence[Tensor], *, hidden_size: int,
        nonlinearity: str = "tanh", num_layers: int = 1, bias: bool = True,
        batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
        module: nn.Module | None = None, input_quant: Quantizer | None = None,
        hidden_quant: Quantizer | None = None, name: str = "rnn") -> tuple[Tensor, Tensor]:
    """``nn.RNN``'s forward on ``weights`` (``nonlinearity`` ``tanh`` or ``relu``); the other
    arguments are ``lstm``'s."""
    return _sequence(f"rnn_{nonlinearity}", input, hx, weights, hidden_size=hidden_size,
                     num_layers=num_layers, bias=bias, batch_first=batch_first,
                     dropout=dropout, bidirectional=bidirectional, proj_size=0,
                     module=module, input_quant=input_quant, hidden_quant=hidden_quant,
                     name=name)


# -- cells -----------------------------------------------------------------------------------
_VF_CELLS = {"lstm": "lstm_cell", "gru": "gru_cell", "rnn_tanh": "rnn_tanh_cell",
             "rnn_relu": "rnn_relu_cell"}


def _cell(kind: str, input: Tensor, hx: Any, weights: Sequence[Tensor], *, hidden_size: int,
          bias: bool, input_quant: Quantizer | None, hidden_quant: Quantizer | None,
          name: str) -> Any:
    lstm_ = kind == "lstm"
    if input.dim() not in (1, 2):
        raise ValueError(f"{name}: expected a 1-D or 2-D input, got {input.dim()}-D")
    batched = input.dim() == 2
    if not batched:
        input = input.unsqueeze(0)
        if hx is not None:
            hx = (hx[0].unsqueeze(0), hx[1].unsqueeze(0)) if lstm_ else hx.unsqueeze(0)
    if hx is None:
        zeros = input.new_zeros(input.size(0), hidden_size)
        hx = (zeros, zeros) if lstm_ else zeros
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if bias else (None, None)
    if input_quant is None and hidden_quant is None:
        out = getattr(_VF, _VF_CELLS[kind])(input, hx, w_ih, w_hh, b_ih, b_hh)
    else:
        gi = _fq_linear(w_ih, b_ih, input_quant)(input)
        out = _step(kind, gi, tuple(hx) if lstm_ else hx, _fq_linear(w_hh, b_hh, hidden_quant))
    if not batched:
        out = (out[0].squeeze(0), out[1].squeeze(0)) if lstm_ else out.squeeze(0)
    return tuple(out) if lstm_ else out


def lstm_cell(input: Tensor, hx: tuple[Tensor, Tensor] | None, weights: Sequence[Tensor], *,
              hidden_size: int, bias: bool = True, input_quant: Quantizer | None = None,
              hidden_quant: Quantizer | None = None,
              name: str = "lstm_cell") -> tuple[Tensor, Tensor]:
    """``nn.LSTMCell``'s forward on ``weights`` (``weight_ih``, ``weight_hh``[, ``bias_ih``,
    ``bias_hh``]); ``input_quant`` / ``hidden_quant`` quantize the input and the hidden
    state of the call (dynamic mode), ``name`` names the layer in errors.

    Example:
        >>> m = torch.nn.LSTMCell(3, 4)
        >>> x, hc = torch.randn(2, 3), (torch.randn(2, 4), torch.randn(2, 4))
        >>> h, c = lstm_cell(x, hc, list(m.parameters()), hidden_size=4)
        >>> bool(torch.equal(h, m(x, hc)[0]))
        True
    """
    return _cell("lstm", input, hx, weights, hidden_size=hidden_size, bias=bias,
                 input_quant=input_quant, hidden_quant=hidden_quant, name=name)


def gru_cell(input: Tensor, hx: Tensor | None, weights: Sequence[Tensor], *, hidden_size: int,
             bias: bool = True, input_quant: Quantizer | None = None,
             hidden_quant: Quantizer | None = None, name: str = "gru_cell") -> Tensor:
    """``nn.GRUCell``'s forward on ``weights``; the arguments are ``lstm_cell``'s."""
    return _cell("gru", input, hx, weights, hidden_size=hidden_size, bias=bias,
                 input_quant=input_quant, hidden_quant=hidden_quant, name=name)


def rnn_cell(input: Tensor, hx: Tensor | None, weights: Sequence[Tensor], *, hidden_size: int,
             nonlinearity: str = "tanh", bias: bool = True,
             input_quant: Quantizer | None = None, hidden_quant: Quantizer | None = None,
             name: str = "rnn_cell") -> Tensor:
    """``nn.RNNCell``'s forward on ``weights``; the arguments are ``lstm_cell``'s."""
    return _cell(f"rnn_{nonlinearity}", input, hx, weights, hidden_size=hidden_size,
                 bias=bias, input_quant=input_quant, hidden_quant=hidden_quant, name=name)


#: The functions a compiled graph calls for recurrent layers (``insert_quant``).
RECURRENT_FUNCTIONS = frozenset({lstm, gru, rnn, lstm_cell, gru_cell, rnn_cell})


# -- what qc.convert makes of a dynamic recurrent layer ---------------------------------------
#: One layer and direction's weights for ``DynamicRecurrent``: qint8 ``weight_ih``,
#: ``weight_hh`` and float ``bias_ih``, ``bias_hh`` (None without biases).
LayerWeights = tuple[Tensor, Tensor, Tensor | None, Tensor | None]


def _packed(weight: Tensor, bias: Tensor | None) -> LinearPackedParams:
    p = LinearPackedParams(dtype=torch.qint8)
    p.set_weight_bias(weight, bias)
    return p


def _torch_module(kind: str, cell: bool, weights: Sequence[LayerWeights], *, num_layers: int,
                  bidirectional: bool, batch_first: bool, reduce_range: bool
                  ) -> nn.Module | None:
    """torch's dynamic quantized module holding ``weights``, where one computes what the
    fake-quant function simulated, else None."""
    w_ih, w_hh = weights[0][0], weights[0][1]
    input_size, hidden_size = w_ih.shape[1], w_hh.shape[1]
    with warnings.catch_warnings():  # their constructors quantize placeholder weights
        warnings.simplefilter("ignore")
        if cell:
            if not reduce_range:  # torch's cells always quantize activations to 7 bits
                return None
            b_ih, b_hh = weights[0][2], weights[0][3]
            bias = b_ih is not None
            if kind == "lstm":
                module: nn.Module = nnqd.LSTMCell(input_size, hidden_size, bias=bias)
            elif kind == "gru":
                module = nnqd.GRUCell(input_size, hidden_size, bias=bias)
            else:
                module = nnqd.RNNCell(input_size, hidden_size, bias=bias,
                                      nonlinearity=kind.removeprefix("rnn_"))
            module.set_weight_bias({"weight": {"weight_ih": w_ih, "weight_hh": w_hh},
                                    "bias": {"bias_ih": b_ih, "bias_hh": b_hh}})
            module.bias_ih, module.bias_hh = b_ih, b_hh
            return module
        if kind not in ("lstm", "gru"):  # torch has no dynamic quantized nn.RNN
            return None
        cls = nnqd.LSTM if kind == "lstm" else nnqd.GRU
        # quantized_lstm / quantized_gru require has_biases: a layer without biases
        # packs none and passes zeros where the op wants bias tensors
        module = cls(input_size, hidden_size, num_layers, True, batch_first, 0.0,
                     bidirectional)
    values = []
    for w_ih, w_hh, b_ih, b_hh in weights:
        zeros = torch.zeros(w_ih.shape[0])
        params = torch.ops.quantized.make_quantized_cell_params_dynamic(
            torch.ops.quantized.linear_prepack(w_ih, b_ih),
            torch.ops.quantized.linear_prepack(w_hh, b_hh),
            zeros if b_ih is None else b_ih, zeros if b_hh is None else b_hh, reduce_range)
        values.append(PackedParameter(params))
    module._all_weight_values = nn.ModuleList(values)
    return module


class DynamicRecurrent(nn.Module):
    """A recurrent layer with int8 weights and activations quantized per call
    (``quantized::linear_dynamic``), computing what the dynamic fake-quant functions above
    simulate: what ``qc.convert`` makes of a recurrent layer compiled in ``dynamic`` mode.

    ``kind``: ``lstm``, ``gru``, ``rnn_tanh`` or ``rnn_relu``; ``weights``: per layer and
    direction (``LayerWeights``); ``cell``: one step per call (the cells' interface) rather
    than a sequence (``nn.LSTM``'s); ``reduce_range``: 7-bit activations (the ``x86``
    target's) rather than 8-bit. The layer runs torch's own dynamic module (``kernel``)
    where one computes that, else the recurrence of ``_stack`` on packed weights
    (``packed``). ``forward`` takes what the stock module takes (unbatched inputs and a
    missing ``hx`` too) and returns what it returns.

    Example:
        >>> import warnings
        >>> q = torch.quantize_per_tensor(torch.randn(8, 3), 0.02, 0, torch.qint8)
        >>> r = torch.quantize_per_tensor(torch.randn(8, 2), 0.02, 0, torch.qint8)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     layer = DynamicRecurrent("lstm", [(q, r, None, None)], cell=True)
        >>> type(layer.kernel).__name__, [t.shape for t in layer(torch.randn(4, 3))]
        ('LSTMCell', [torch.Size([4, 2]), torch.Size([4, 2])])
    """

    def __init__(self, kind: str, weights: Sequence[LayerWeights], *, num_layers: int = 1,
                 bidirectional: bool = False, batch_first: bool = False, cell: bool = False,
                 reduce_range: bool = True) -> None:
        super().__init__()
        if kind not in _GATES:
            raise ValueError(f"unknown recurrent kind {kind!r}")
        self.kind, self.cell, self.reduce_range = kind, cell, reduce_range
        self.num_layers, self.bidirectional, self.batch_first = (
            num_layers, bidirectional, batch_first)
        self.hidden_size = int(weights[0][1].shape[1])
        self.kernel = _torch_module(kind, cell, weights, num_layers=num_layers,
                                    bidirectional=bidirectional, batch_first=batch_first,
                                    reduce_range=reduce_range)
        self.packed = nn.ModuleList() if self.kernel is not None else nn.ModuleList(
            _packed(w, b) for w_ih, w_hh, b_ih, b_hh in weights
            for w, b in ((w_ih, b_ih), (w_hh, b_hh)))

    def _linear(self, index: int) -> Linear:
        packed = self.packed[index]._packed_params
        return lambda x: torch.ops.quantized.linear_dynamic(x, packed, self.reduce_range)

    def _linears(self) -> list[tuple[Linear, Linear]]:
        return [(self._linear(2 * i), self._linear(2 * i + 1))
                for i in range(len(self.packed) // 2)]

    def forward(self, input: Tensor, hx: Any = None) -> Any:
        lstm_ = self.kind == "lstm"
        if self.cell:
            batched = input.dim() == 2
            if not batched:
                input = input.unsqueeze(0)
                if hx is not None:
                    hx = (hx[0].unsqueeze(0), hx[1].unsqueeze(0)) if lstm_ else hx.unsqueeze(0)
            if self.kernel is not None:
                out = self.kernel(input, hx)
            else:
                if hx is None:
                    zeros = input.new_zeros(input.size(0), self.hidden_size)
                    hx = (zeros, zeros) if lstm_ else zeros
                (ih, hh), = self._linears()
                out = _step(self.kind, ih(input), tuple(hx) if lstm_ else hx, hh)
            if not batched:
                out = (out[0].squeeze(0), out[1].squeeze(0)) if lstm_ else out.squeeze(0)
            return tuple(out) if lstm_ else out
        batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        if not batched:
            input = input.unsqueeze(batch_dim)
            if hx is not None:
                hx = (hx[0].unsqueeze(1), hx[1].unsqueeze(1)) if lstm_ else hx.unsqueeze(1)
        if self.kernel is not None:
            out, hidden = self.kernel(input, hx)
        else:
            x = input.transpose(0, 1) if self.batch_first else input
            if hx is None:
                dirs = 2 if self.bidirectional else 1
                hx = x.new_zeros(self.num_layers * dirs, x.size(1), self.hidden_size)
            out, h, _ = _stack(self.kind, x, hx, None, self._linears(),
                               num_layers=self.num_layers, bidirectional=self.bidirectional,
                               dropout=0.0, training=False)
            out, hidden = (out.transpose(0, 1) if self.batch_first else out), h
        if not batched:
            out = out.squeeze(batch_dim)
            hidden = (hidden[0].squeeze(1), hidden[1].squeeze(1)) if lstm_ else hidden.squeeze(1)
        return out, hidden

    def extra_repr(self) -> str:
        return (f"{self.kind}{' cell' if self.cell else ''}, hidden_size={self.hidden_size}, "
                f"{'7' if self.reduce_range else '8'}-bit activations")

    def __repr__(self) -> str:
        """One line (the packed weights' own repr prints every integer)."""
        kernel = "" if self.kernel is None else (
            f", kernel={self.kernel._get_name()}({self.kernel.extra_repr()})")
        return f"{self._get_name()}({self.extra_repr()}{kernel})"
