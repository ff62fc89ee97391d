"""Recurrent layers in ``insert_quant``: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells.

A selected recurrent layer call is re-expressed with the function of
``qcompile.runtime.recurrent`` that computes it (``lstm``, ``gru``, ``rnn``, ``lstm_cell``,
``gru_cell``, ``rnn_cell``) on its parameters (names unchanged), each weight through its
quantizer ``<module>.<param>_fake_quant`` (observed here; in QAT it keeps tracking its
weight). Both front ends: a ``call_module`` on a stock recurrent module (symbolic tracing
keeps it a leaf) or the aten op ``torch.export`` records (``aten.lstm.input``,
``aten.gru_cell.default``...), selected through the module outputs the rule annotated.
Activations, by mode:

- ``dynamic``: two dynamic quantizers the function applies, ``<module>.input_fake_quant``
  (each layer's input sequence, or the cell's input) and ``<module>.hidden_fake_quant``
  (the hidden state, at every step), as torch's dynamic quantized recurrent kernels
  quantize them; ``qc.convert`` turns the layer into those kernels
  (``qcompile.passes.convert.use_recurrent_kernels``).
- ``static`` / ``qat``: the output (the output sequence, or a cell's new hidden state)
  gets ``<module>.output_fake_quant``, so what follows reads quantized values; inside the
  layer only the weights are quantized (no integer kernel computes a static recurrent
  layer: its gates stay float), and training runs through torch's own recurrent kernels,
  gradients reaching the weights straight through their quantizers.

A module called several times (a cell in a loop) keeps one quantizer per weight and one
per activation role for all its calls. An LSTM with ``proj_size`` is refused in dynamic
mode (torch's quantized LSTM has no projections), a ``PackedSequence`` input always.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.graph.context import Context
    >>> from qcompile.passes.annotate import annotate
    >>> from qcompile.passes.fold_bn import fold_bn
    >>> from qcompile.passes.trace import trace
    >>> class M(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.rnn = torch.nn.GRU(3, 4)
    ...     def forward(self, x):
    ...         return self.rnn(x)[0]
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "dynamic", "rules": [
    ...     {"match": {"module": "GRU"}, "weight": {"dtype": "int8"},
    ...      "activation": {"dtype": "uint8", "symmetric": False}}]}})
    >>> ctx = Context(spec=spec, model=M())
    >>> gm = annotate(fold_bn(trace(None, ctx), ctx), ctx)
    >>> sorted(n.name for n in quantize_recurrent_layers(gm, ctx))
    ['gru', 'rnn_hidden_fake_quant', 'rnn_input_fake_quant', 'rnn_weight_hh_l0_fake_quant', \
'rnn_weight_ih_l0_fake_quant']
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.nn.utils.rnn import PackedSequence

from qcompile.errors import QCompileError
from qcompile.graph.context import Context
from qcompile.graph.matching import NodeQScheme, innermost_owner
from qcompile.graph.meta import MODULE_KEY, NN_MODULE_STACK, QSCHEME_KEY, TYPE
from qcompile.passes.insert_quant.common import (
    add_quantizer,
    attr,
    build,
    insert_after,
    model_device,
    move_to,
    param_attr,
    quantizer_call,
    quantizer_record,
    set_activation_mode,
    set_flag,
    tensor_shape,
)
from qcompile.runtime import recurrent
from qcompile.runtime.recurrent import RECURRENT_TYPES, cell_kind, is_cell, weight_names

__all__ = ["quantize_recurrent_layers"]

aten = torch.ops.aten
_FUNCTIONS = {(False, "lstm"): recurrent.lstm, (False, "gru"): recurrent.gru,
              (False, "rnn"): recurrent.rnn, (True, "lstm"): recurrent.lstm_cell,
              (True, "gru"): recurrent.gru_cell, (True, "rnn"): recurrent.rnn_cell}
# torch.export's recurrent ops -> the recurrence they compute
_ATEN_SEQUENCES = {aten.lstm.input: "lstm", aten.gru.input: "gru",
                   aten.rnn_tanh.input: "rnn_tanh", aten.rnn_relu.input: "rnn_relu"}
_ATEN_CELLS = {aten.lstm_cell.default: "lstm", aten.gru_cell.default: "gru",
               aten.rnn_tanh_cell.default: "rnn_tanh", aten.rnn_relu_cell.default: "rnn_relu"}
_ATEN_PACKED = frozenset({aten.lstm.data, aten.gru.data, aten.rnn_tanh.data,
                          aten.rnn_relu.data})
_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


@dataclass
class _Site:
    """One recurrent layer call, whichever front end recorded it."""

    node: Node
    owner: str  # the module's qualified name
    kind: str  # lstm | gru | rnn_tanh | rnn_relu
    cell: bool
    x: Any
    hx: Any
    params: list[tuple[str, Node | None]]  # (parameter name, its get_attr node if any)
    config: dict[str, Any]  # the function's keyword arguments (non-defaults)
    qs: NodeQScheme
    flat: bool = False  # aten.lstm.input: (output, h_n, c_n) rather than nn.LSTM's nesting
    handled: list[Node] = field(default_factory=list)  # annotated nodes it stands for


@dataclass
class _Layer:
    """What the calls of one recurrent module share: its weights (through their
    quantizers) and its activation quantizers, made at its first call."""

    weights: list[Node] = field(default_factory=list)
    # what its calls read with get_attr: "input" / "hidden" quantizers, the "module" itself
    reads: dict[str, Node] = field(default_factory=dict)
    output_quant: str | None = None


def _stock(m: nn.Module) -> bool:
    """A recurrent module computing what its stock class's forward computes."""
    return any(isinstance(m, cls) and type(m).forward is cls.forward for cls in RECURRENT_TYPES)


def _refuse_packed(node: Node, owner: str) -> None:
    raise QCompileError(
        f"node {node.name!r} ({owner}): a PackedSequence input is not supported by the "
        "quantized recurrent layer",
        fix=f"pass a padded tensor to {owner}, or exclude it with a rule "
        f"{{match: {{name: {owner!r}}}, skip: true}}")


def _module_site(gm: GraphModule, node: Node, qs: NodeQScheme) -> _Site | None:
    """A ``call_module`` on a stock recurrent module (symbolic tracing)."""
    owner = str(node.target)
    m = gm.get_submodule(owner)
    if not _stock(m):
        return None
    x = node.args[0] if node.args else node.kwargs.get("input")
    hx = node.args[1] if len(node.args) > 1 else node.kwargs.get("hx")
    if isinstance(x, Node) and x.meta.get(TYPE) is PackedSequence:
        _refuse_packed(node, owner)
    kind, cell = cell_kind(m), is_cell(m)
    config: dict[str, Any] = {"hidden_size": m.hidden_size}
    if kind == "rnn_relu":
        config["nonlinearity"] = "relu"
    if not cell:
        for key, default in (("num_layers", 1), ("batch_first", False), ("dropout", 0.0),
                             ("bidirectional", False), ("proj_size", 0)):
            value = getattr(m, key, default)
            if value != default:
                config[key] = float(value) if key == "dropout" else value
    if not m.bias:
        config["bias"] = False
    return _Site(node, owner, kind, cell, x, hx, [(p, None) for p in weight_names(m)],
                 config, qs)


def _param(gm: GraphModule, node: Any) -> tuple[str, str] | None:
    """(owner, parameter name) of a ``get_attr`` node reading a parameter, else None."""
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    if not isinstance(attr(gm, str(node.target)), nn.Parameter):
        return None
    owner, _, pname = str(node.target).rpartition(".")
    return owner, pname


def _module_outputs(node: Node) -> list[Node]:
    """The annotated nodes computed from ``node`` inside its own module, up to the next
    call of it: what the module returns (the items of the op's result, squeezed for an
    unbatched input)."""
    owner = innermost_owner(node)
    found, todo, seen = [], list(node.users), set()
    while todo:
        u = todo.pop()
        if (u in seen or u.op != "call_function" or innermost_owner(u) != owner
                or u.target in _ATEN_CELLS or u.target in _ATEN_SEQUENCES):
            continue
        seen.add(u)
        if isinstance(u.meta.get(QSCHEME_KEY), NodeQScheme):
            found.append(u)
        todo.extend(u.users)
    return found


def _aten_site(gm: GraphModule, node: Node) -> _Site | None:
    """A recurrent aten op of an export graph, selected through itself (a cell's output)
    or the items of its result (a sequence module's outputs)."""
    cell = node.target in _ATEN_CELLS
    users = _module_outputs(node)
    qs = node.meta.get(QSCHEME_KEY)
    if not isinstance(qs, NodeQScheme):
        qs = users[0].meta[QSCHEME_KEY] if users else None
    if qs is None or qs.skip:
        return None
    if node.target in _ATEN_PACKED:
        _refuse_packed(node, innermost_owner(node) or node.name)
    kind = (_ATEN_CELLS if cell else _ATEN_SEQUENCES)[node.target]
    if cell:
        x, hx, *ws = node.args
        ws = [w for w in ws if w is not None]
        has_bias = len(ws) == 4
        config: dict[str, Any] = {}
    else:
        x, hx, ws, has_bias, num_layers, dropout, _, bidirectional, batch_first = node.args
        config = {k: v for k, v, d in (("num_layers", num_layers, 1),
                                       ("batch_first", batch_first, False),
                                       ("dropout", float(dropout), 0.0),
                                       ("bidirectional", bidirectional, False)) if v != d}
    params = [_param(gm, w) for w in ws]
    if any(p is None for p in params) or len({p[0] for p in params}) != 1:
        return None  # not the parameters of one module
    owner = params[0][0]
    names = [p[1] for p in params]
    head: dict[str, Any] = {
        "hidden_size": int(attr(gm, f"{owner}.{names[0]}").shape[0]) // _GATES[kind]}
    if kind == "rnn_relu":
        head["nonlinearity"] = "relu"
    config = {**head, **config}
    if any(n.startswith("weight_hr") for n in names):  # an LSTM with projections
        config["proj_size"] = int(attr(gm, f"{owner}.{names[-1]}").shape[0])
    if not has_bias:
        config["bias"] = False
    flat = kind == "lstm" and not cell
    if flat and any(u.target is not operator.getitem for u in node.users):
        return None
    return _Site(node, owner, kind, cell, x, hx, list(zip(names, ws, strict=True)), config,
                 qs, flat=flat, handled=users)


def _site(gm: GraphModule, node: Node) -> _Site | None:
    """``node`` as a recurrent layer call to re-express, else None. Read just before the
    rewrite: an earlier call's rewrite changes what a later call reads (a cell's state)."""
    site = None
    if node.op == "call_module":
        qs = node.meta.get(QSCHEME_KEY)
        if isinstance(qs, NodeQScheme) and not qs.skip:
            site = _module_site(gm, node, qs)
    elif node.op == "call_function" and (node.target in _ATEN_SEQUENCES
                                         or node.target in _ATEN_CELLS
                                         or node.target in _ATEN_PACKED):
        site = _aten_site(gm, node)
    if site is None or (site.qs.weight is None and site.qs.activation is None):
        return None
    return site


def _weights(gm: GraphModule, ctx: Context, site: _Site, made: set[Node]) -> list[Node]:
    """The parameters in the kernel's order, each weight through its new quantizer when
    the rule has a weight scheme (inserted right after the parameter's ``get_attr``)."""
    g = gm.graph
    mode = ctx.spec.quant.mode
    owner, qs = site.owner, site.qs
    m = gm.get_submodule(owner)
    stack = {k: v for k, v in site.node.meta.items() if k == NN_MODULE_STACK}
    out = []
    for pname, p_node in site.params:
        if p_node is None:
            with g.inserting_before(site.node):
                p_node = param_attr(g, m, owner, pname)
        param = getattr(m, pname)
        if qs.weight is None or not pname.startswith("weight"):
            out.append(p_node)
            continue
        where = f"parameter '{owner}.{pname}' (node {site.node.name!r})"
        fq = build(qs.weight, ctx, role="weight", shape=tuple(param.shape), dynamic=False,
                   where=where, field=f"quant.rules[{qs.rule}].weight")
        move_to(fq, param.device)
        fq.observe_tensor(param)
        # weights move only in QAT: keep tracking them there, freeze them otherwise
        set_flag(fq, "observe", mode == "qat" and not fq.learnable)
        name = add_quantizer(gm, f"{owner}.{pname}_fake_quant", fq)
        with g.inserting_after(p_node):
            q = quantizer_call(gm, name, p_node)
        q.meta.update(stack)
        made.add(q)
        out.append(q)
        ctx.quantizers.append(quantizer_record(name, fq, "weight", f"{owner}.{pname}", qs.rule))
    return out


def _dynamic_quantizers(gm: GraphModule, ctx: Context, site: _Site, layer: _Layer) -> None:
    qs = site.qs
    _, shape = tensor_shape(site.x, ctx) if isinstance(site.x, Node) else (True, None)
    for role, shaped in (("input", shape), ("hidden", None)):
        fq = build(qs.activation, ctx, role="activation", shape=shaped, dynamic=True,
                   where=f"node {site.node.name!r} ({role})",
                   field=f"quant.rules[{qs.rule}].activation")
        move_to(fq, model_device(gm))
        name = add_quantizer(gm, f"{site.owner}.{role}_fake_quant", fq)
        with gm.graph.inserting_before(site.node):
            layer.reads[role] = gm.graph.get_attr(name)
        layer.reads[role].meta.update(
            {k: v for k, v in site.node.meta.items() if k == NN_MODULE_STACK})
        ctx.quantizers.append(quantizer_record(name, fq, "activation", site.node.name,
                                               qs.rule))


def _output_quantizer(gm: GraphModule, ctx: Context, site: _Site, call: Node, layer: _Layer,
                      made: set[Node]) -> None:
    """``<module>.output_fake_quant`` on what the layer outputs: the call itself (GRU /
    RNN cells), else its ``[0]`` items (the output sequence, an LSTM cell's new hidden
    state)."""
    qs = site.qs
    if site.cell and site.kind != "lstm":
        values = [call]
    else:
        values = [u for u in call.users if u.target is operator.getitem and u.args[1] == 0]
    if not values:
        ctx.note(f"rule {qs.rule}: the output of {site.owner} is not used as a tensor "
                 "(no [0] item): it is not quantized")
        return
    for value in values:
        if layer.output_quant is None:
            _, shape = tensor_shape(value, ctx)
            fq = build(qs.activation, ctx, role="activation", shape=shape, dynamic=False,
                       where=f"node {value.name!r}", field=f"quant.rules[{qs.rule}].activation")
            set_activation_mode(fq, ctx.spec.quant.mode)
            move_to(fq, model_device(gm))
            layer.output_quant = add_quantizer(gm, f"{site.owner}.output_fake_quant", fq)
            ctx.quantizers.append(quantizer_record(layer.output_quant, fq, "activation",
                                                   value.name, qs.rule))
        made.add(insert_after(gm, value, layer.output_quant))


def _replace(gm: GraphModule, site: _Site, new: Node) -> None:
    """``new`` in place of the call: aten's LSTM returns (output, h_n, c_n), the function
    nn.LSTM's (output, (h_n, c_n)), so its items are rewired."""
    g = gm.graph
    old = site.node
    if site.flat:
        with g.inserting_after(new):
            hidden = g.call_function(operator.getitem, (new, 1))
        for user in list(old.users):
            index = user.args[1]
            user.args = (new, 0) if index == 0 else (hidden, index - 1)
    old.replace_all_uses_with(new)
    g.erase_node(old)


def _rewrite(gm: GraphModule, ctx: Context, site: _Site, layers: dict[str, _Layer],
             made: set[Node]) -> None:
    mode = ctx.spec.quant.mode
    qs = site.qs
    if mode == "dynamic" and qs.activation is not None and site.config.get("proj_size"):
        raise QCompileError(
            f"node {site.node.name!r} ({site.owner}): quant.rules[{qs.rule}]: dynamic "
            "quantization of an LSTM with proj_size is not supported (torch's quantized "
            "LSTM has no projections)",
            fix=f"exclude {site.owner} with a skip rule, or compile with quant.mode qat or "
            "static")
    g = gm.graph
    layer = layers.get(site.owner)
    if layer is None:
        layer = layers[site.owner] = _Layer()
        layer.weights = _weights(gm, ctx, site, made)
        if mode == "dynamic" and qs.activation is not None:
            _dynamic_quantizers(gm, ctx, site, layer)
        if site.config.get("dropout") and site.config.get("num_layers", 1) > 1:
            with g.inserting_before(site.node):  # its .training switches the dropout
                layer.reads["module"] = g.get_attr(site.owner)
        made.update(layer.reads.values())
    kwargs = dict(site.config, name=site.owner)
    for role, read in layer.reads.items():
        kwargs["module" if role == "module" else f"{role}_quant"] = read
    with g.inserting_before(site.node):
        fn = _FUNCTIONS[(site.cell, site.kind.partition("_")[0])]
        new = g.call_function(fn, (site.x, site.hx, list(layer.weights)), kwargs)
    new.meta = dict(site.node.meta)
    if not isinstance(new.meta.get(QSCHEME_KEY), NodeQScheme):
        new.meta[QSCHEME_KEY] = qs
    new.meta[MODULE_KEY] = site.owner
    _replace(gm, site, new)
    made.add(new)
    made.update(site.handled)
    if mode in ("static", "qat") and qs.activation is not None:
        _output_quantizer(gm, ctx, site, new, layer, made)


def quantize_recurrent_layers(gm: GraphModule, ctx: Context) -> set[Node]:
    """Re-express every selected recurrent layer call (a stock ``RECURRENT_TYPES`` module,
    or its aten op in an export graph) with its function on its quantized weights, and add
    its activation quantizers per ``quant.mode`` (see the module docstring). Returns the
    nodes made or handled here, which the rest of ``insert_quant`` leaves alone."""
    made: set[Node] = set()
    layers: dict[str, _Layer] = {}
    for node in list(gm.graph.nodes):
        site = _site(gm, node)
        if site is not None:
            _rewrite(gm, ctx, site, layers, made)
    if layers:
        ctx.note(f"{len(layers)} recurrent layer(s) re-expressed with their quantized "
                 f"weights ({', '.join(sorted(layers)[:4])})")
    return made
