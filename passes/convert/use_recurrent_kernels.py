"""``use_recurrent_kernels``: dynamic recurrent layers become torch's dynamic int8 kernels.

A recurrent function of a dynamic graph (``qcompile.runtime.recurrent.lstm``, ``gru``,
``rnn``, ``lstm_cell``, ``gru_cell``, ``rnn_cell``, as ``insert_quant`` re-expressed
``nn.LSTM``...) whose input and hidden quantizers are 8-bit per-tensor asymmetric dynamic
ones and whose every weight fits ``qint8`` (symmetric, per-tensor or per-channel on axis 0)
becomes a ``DynamicRecurrent`` built from the graph's integer weights (not observed
again): torch's ``torch.ao.nn.quantized.dynamic`` ``LSTM`` / ``GRU`` / ``LSTMCell`` /
``GRUCell`` / ``RNNCell`` where one computes what the graph simulated, else the same
recurrence on ``quantized::linear_dynamic`` (``nn.RNN``; cells with 8-bit activations).
Activations use 7 bits where the quantizers did (``quant.target: x86``), as torch.ao's
dynamic recurrent modules do. The weights it consumes leave the conversion's integer
weights; the float parameters leave the graph in ``tidy``.

What holds: every product with a weight is the integer kernel's product of the same
integers, so each step computes what the fake-quant graph computes up to float32
rounding of the sums (the fake-quant graph adds dequantized products in float32, the
kernel adds integers exactly and scales once) and of the per-call activation scale.
Such a difference moves a quantized input or hidden value by one step only where it
falls within that rounding of a rounding boundary, which the tests see as the converted
layer matching the fake-quant graph to float32 rounding, far below one step of the hidden
quantizer.

Recurrent layers compiled in ``static`` or ``qat`` mode keep their float recurrence (no
integer kernel computes it): their weights are stored as integers (``store_weights``).

Example:
    >>> import torch, qcompile as qc
    >>> class M(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.rnn = torch.nn.LSTM(4, 8)
    ...     def forward(self, x):
    ...         return self.rnn(x)[0]
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "dynamic", "rules": [
    ...     {"match": {"module": "LSTM"}, "weight": {"dtype": "int8"},
    ...      "activation": {"dtype": "uint8", "symmetric": False}}]}})
    >>> x = torch.randn(5, 2, 4)
    >>> int8 = qc.convert(qc.qcompile(M(), spec, example_inputs=(x,)))
    >>> int8.rnn
    DynamicRecurrent(lstm, hidden_size=8, 7-bit activations, kernel=DynamicQuantizedLSTM(4, 8))
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcompile.graph.context import Context
from qcompile.graph.meta import FINAL_NAME_KEY, MODULE_KEY
from qcompile.graph.pipeline import graph_pass
from qcompile.passes.convert.common import Conversion, attr_value, qint8, state, where
from qcompile.runtime import recurrent
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.recurrent import RECURRENT_FUNCTIONS, DynamicRecurrent, LayerWeights

_CELLS = {recurrent.lstm_cell, recurrent.gru_cell, recurrent.rnn_cell}
_KINDS = {recurrent.lstm: "lstm", recurrent.lstm_cell: "lstm", recurrent.gru: "gru",
          recurrent.gru_cell: "gru"}


def _quantizer(gm: GraphModule, node: Any) -> FakeQuantize | None:
    """The dynamic 8-bit per-tensor asymmetric quantizer a ``get_attr`` node reads (what
    ``quantized::linear_dynamic`` computes), else None."""
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    fq = gm.get_submodule(str(node.target))
    if (isinstance(fq, FakeQuantize) and fq.dynamic and fq.enabled
            and fq.granularity == "per_tensor" and not fq.symmetric and fq.dtype == "uint8"
            and fq.quant_min == 0 and fq.quant_max in (127, 255)):
        return fq
    return None


def _layer_weights(gm: GraphModule, conv: Conversion, weights: list[Any], bias: bool
                   ) -> list[LayerWeights] | None:
    """The integer weights (qint8) and float biases per layer and direction, or None where
    a weight has no qint8 integers (not quantized, or not a scheme the kernels take)."""
    per = 2 + 2 * bias
    if len(weights) % per:
        return None  # weight_hr: an LSTM with projections
    out: list[LayerWeights] = []
    for k in range(0, len(weights), per):
        ints = [conv.weights.get(w) if isinstance(w, Node) else None for w in weights[k:k + 2]]
        if any(t is None for t in ints):
            return None
        q_ih, q_hh = qint8(ints[0]), qint8(ints[1])
        if q_ih is None or q_hh is None:
            return None
        biases: list[torch.Tensor | None] = [None, None]
        if bias:
            for i, b in enumerate(weights[k + 2:k + 4]):
                value = attr_value(gm, b)
                if value is None:
                    return None
                # a copy: the packed kernel keeps what it is given, and the float
                # parameters are the source graph's own
                biases[i] = value.detach().float().clone()
        out.append((q_ih, q_hh, biases[0], biases[1]))
    return out


def _eligible(gm: GraphModule, node: Node) -> int | None:
    """The activation range (127 or 255) of a call whose input and hidden quantizers are
    what ``quantized::linear_dynamic`` computes, else None."""
    kw = node.kwargs
    q_in, q_h = _quantizer(gm, kw.get("input_quant")), _quantizer(gm, kw.get("hidden_quant"))
    if q_in is None or q_h is None or q_in.quant_max != q_h.quant_max or kw.get("proj_size"):
        return None
    return q_in.quant_max


def _module(gm: GraphModule, conv: Conversion, node: Node, levels: int
            ) -> DynamicRecurrent | None:
    kw = node.kwargs
    layers = _layer_weights(gm, conv, list(node.args[2]), kw.get("bias", True))
    if layers is None:
        return None
    kind = _KINDS.get(node.target) or f"rnn_{kw.get('nonlinearity', 'tanh')}"
    return DynamicRecurrent(kind, layers, num_layers=kw.get("num_layers", 1),
                            bidirectional=kw.get("bidirectional", False),
                            batch_first=kw.get("batch_first", False),
                            cell=node.target in _CELLS, reduce_range=levels == 127)


def _simulated(conv: Conversion, calls: list[Node], why: str) -> int:
    """Record the dynamic calls that keep simulated activations, and why."""
    for node in calls:
        if "input_quant" in node.kwargs or "hidden_quant" in node.kwargs:
            conv.record(node, "fake_quant", "FakeQuantize",
                        f"{why}: no integer recurrent kernel; the recurrence runs in float "
                        "with its dynamic activation quantizers simulated")
    return 0


def _convert_calls(gm: GraphModule, conv: Conversion, calls: list[Node]) -> int:
    """The calls of one layer (a cell in a loop: several) on one ``DynamicRecurrent``."""
    ready = [(n, _eligible(gm, n)) for n in calls]
    ready = [(n, levels) for n, levels in ready if levels is not None]
    if not ready or len({levels for _, levels in ready}) != 1:
        return _simulated(conv, calls, "activations not 8-bit per-tensor asymmetric")
    module = _module(gm, conv, ready[0][0], ready[0][1])
    if module is None:
        return _simulated(conv, calls, "weights not int8 symmetric (per-tensor or per-channel)")
    layer = where(ready[0][0])
    name = conv.add_module(gm, layer, module)
    kernel = type(module.kernel).__name__ if module.kernel is not None else "recurrence"
    weights = [w for w in ready[0][0].args[2] if isinstance(w, Node)]
    for node, _ in ready:
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, node.args[:2])
        new.meta[MODULE_KEY] = layer
        new.meta[FINAL_NAME_KEY] = layer  # tidy names the module after its layer
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        conv.record(new, "dynamic_kernel", f"quantized::linear_dynamic ({module.kind}"
                    f"{' cell' if module.cell else ''})",
                    f"{kernel} on int8 weights, "
                    f"{'7' if module.reduce_range else '8'}-bit activations per call",
                    layer=layer)
    for w in weights:
        conv.release(w)
    return len(ready)


@graph_pass(requires=("kernels",), provides=("recurrent_kernels",))
def use_recurrent_kernels(gm: GraphModule, ctx: Context) -> GraphModule:
    conv = state(ctx)
    if conv.rows_only or not all(t.device.type == "cpu" for t in gm.parameters()):
        ctx.note("no recurrent kernels: see use_kernels")
        return gm
    layers: dict[tuple[Node, ...], list[Node]] = {}  # the calls of each layer, by weights
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in RECURRENT_FUNCTIONS:
            key = tuple(w for w in node.args[2] if isinstance(w, Node))
            layers.setdefault(key, []).append(node)
    used = sum(_convert_calls(gm, conv, calls) for calls in layers.values())
    ctx.note(f"{used} recurrent call(s) on dynamic int8 kernels"
             + (f", {torch.backends.quantized.engine} engine" if used else ""))
    return gm
