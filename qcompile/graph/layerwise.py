"""Layer-by-layer statistics of a compiled graph on calibration batches: what the
data-driven PTQ algorithms (``bias_correction``, ``adaround``, ``gptq``) need.

``quantized_layers(gm)`` finds every conv/linear whose weight is fake-quantized, in every
graph of ``gm`` (a pipeline's stages included). ``levels`` orders them so that the layers
of one level never feed each other: an algorithm rewrites level 1, then measures level 2's
inputs through the rewritten level 1, and so on (sequential, as GPTQ and AdaRound are
meant to run). ``Sweep`` runs the batches through the graph with ``torch.fx.Interpreter``
and keeps, per watched layer, only a running statistic: the Gram matrix ``X^T X`` of its
inputs (``k x k`` for ``k`` inputs per output: memory does not grow with the data) or the
sum of its outputs per channel. It stops each batch as soon as the watched layers have
run. With a ``reduce`` (a sum across data-parallel ranks) every rank ends with the same
statistics, so every rank makes the same choices.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.graph.layerwise import Sweep, levels, quantized_layers
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> gm = qc.qcompile(m, "int8-static", example_inputs=(torch.randn(3, 4),))
    >>> layers = quantized_layers(gm)
    >>> [(layer.name, layer.op) for layer in layers], list(levels(gm, layers).values())
    ([('0', 'linear'), ('2', 'linear')], [1, 2])
    >>> stats = Sweep(gm, [((torch.randn(5, 4),), {})], gram=layers[:1]).run()
    >>> stats.gram[layers[0]].shape, stats.rows[layers[0]]
    (torch.Size([4, 4]), 5)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

from qcompile.graph.matching import op_name
from qcompile.runtime.fake_quant import FakeQuantize

_OPS = ("linear", "conv1d", "conv2d", "conv3d")
_VIEWS = ("reshape", "view", "flatten", "transpose", "permute", "contiguous")
Reduce = Callable[[list[torch.Tensor]], None]  # sums tensors in place across ranks


@dataclass(frozen=True)
class QuantLayer:
    """A conv/linear node whose weight is a ``FakeQuantize`` of a parameter."""

    owner: str  # qualified name of the GraphModule whose graph holds the node ("" = root)
    node: str  # the node's name in that graph
    name: str  # the layer's name: the weight's owner module
    op: str  # linear | conv1d | conv2d | conv3d
    weight: str  # the weight parameter's target in ``owner``
    bias: str | None  # the bias parameter's target in ``owner``, None without one
    quantizer: str  # the weight quantizer's target in ``owner``
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] | str = ()
    dilation: tuple[int, ...] = ()
    groups: int = 1
    kernel: tuple[int, ...] = ()  # the weight's spatial size (conv)
    exclusive: bool = True  # the weight (and its quantizer) is read by this node only

    @property
    def key(self) -> str:
        return f"{self.owner}.{self.node}" if self.owner else self.node

    def module(self, gm: nn.Module) -> GraphModule:
        return gm.get_submodule(self.owner) if self.owner else gm  # type: ignore[return-value]

    def get_weight(self, gm: nn.Module) -> nn.Parameter:
        return self.module(gm).get_parameter(self.weight)

    def get_quantizer(self, gm: nn.Module) -> FakeQuantize:
        return self.module(gm).get_submodule(self.quantizer)  # type: ignore[return-value]

    def why_no_gram(self) -> str | None:
        """Why the inputs' Gram matrix is not defined for this layer (GPTQ and AdaRound
        skip it), else None."""
        if self.op == "conv3d":
            return "a 3-d convolution"
        if self.groups != 1:
            return f"a grouped convolution (groups={self.groups})"
        if isinstance(self.padding, str) and self.padding != "valid":
            return f"padding={self.padding!r}"
        return None

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input as rows of what each output is a dot product with: ``x`` with
        the last dimension kept (linear) or its sliding patches (``F.unfold``), in the
        order of the weight's flattened ``[in, kh, kw]``."""
        if self.op == "linear":
            return x.reshape(-1, x.shape[-1])
        padding = 0 if isinstance(self.padding, str) else self.padding
        if self.op == "conv1d":
            x = x.unsqueeze(-2)
            kernel: tuple[int, ...] = (1, self.kernel[-1])
            stride, dilation = (1, *self.stride[-1:]), (1, *self.dilation[-1:])
            padding = (0, *((padding,) if isinstance(padding, int) else padding)[-1:])
        else:
            kernel, stride, dilation = self.kernel, self.stride, self.dilation
        patches = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])


def _conv_args(node: Node) -> tuple[tuple[int, ...], tuple[int, ...] | str, tuple[int, ...], int]:
    """(stride, padding, dilation, groups) of a conv node, torch's defaults where omitted."""
    names = ("stride", "padding", "dilation", "groups")
    defaults: tuple[Any, ...] = (1, 0, 1, 1)
    values = []
    for i, (name, default) in enumerate(zip(names, defaults)):
        v = node.args[3 + i] if len(node.args) > 3 + i else node.kwargs.get(name, default)
        values.append(v)
    dims = {"conv1d": 1, "conv2d": 2, "conv3d": 3}[op_name(node) or "conv2d"]

    def tup(v: Any) -> tuple[int, ...]:
        return tuple(int(i) for i in v) if isinstance(v, (tuple, list)) else (int(v),) * dims
    padding = values[1] if isinstance(values[1], str) else tup(values[1])
    return tup(values[0]), padding, tup(values[2]), int(values[3])


def _param(owner: GraphModule, node: Any) -> str | None:
    if isinstance(node, Node) and node.op == "get_attr":
        target = str(node.target)
        try:
            if isinstance(owner.get_parameter(target), nn.Parameter):
                return target
        except AttributeError:
            return None
    return None


def _layer(owner_name: str, owner: GraphModule, node: Node) -> QuantLayer | None:
    op = op_name(node) if node.op == "call_function" else None
    if op not in _OPS or len(node.args) < 2:
        return None
    fq_node = node.args[1]
    if not isinstance(fq_node, Node) or fq_node.op != "call_module" or not fq_node.args:
        return None
    fq = owner.get_submodule(str(fq_node.target))
    weight = _param(owner, fq_node.args[0])
    if not isinstance(fq, FakeQuantize) or weight is None:
        return None
    bias_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    bias = _param(owner, bias_arg)
    if bias_arg is not None and bias is None:
        return None  # a computed bias: nothing to correct in place
    conv: dict[str, Any] = {}
    if op != "linear":
        stride, padding, dilation, groups = _conv_args(node)
        conv = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups,
                "kernel": tuple(owner.get_parameter(weight).shape[2:])}
    only = len(fq_node.users) == 1 and len(fq_node.args[0].users) == 1
    return QuantLayer(owner_name, node.name, weight.rpartition(".")[0] or node.name, op,
                      weight, bias, str(fq_node.target), exclusive=only, **conv)


def _nodes(gm: nn.Module) -> Iterator[tuple[str, GraphModule, Node]]:
    """(owner's qualified name, owner, node) for every node of every graph of ``gm`` but
    the calls of child graphs, in execution order (a stage's nodes where the root graph
    calls the stage)."""

    def walk(owner_name: str, owner: GraphModule) -> Iterator[tuple[str, GraphModule, Node]]:
        for node in owner.graph.nodes:
            if node.op == "call_module":
                child = owner.get_submodule(str(node.target))
                if isinstance(child, GraphModule):
                    yield from walk(f"{owner_name}.{node.target}" if owner_name
                                    else str(node.target), child)
                    continue
            yield owner_name, owner, node
    if isinstance(gm, GraphModule):
        yield from walk("", gm)


def quantized_layers(gm: nn.Module) -> list[QuantLayer]:
    """Every conv/linear node reading a fake-quantized parameter, in every graph of
    ``gm``, in execution order (a stage's nodes where the root graph calls the stage)."""
    found = (_layer(owner_name, owner, node) for owner_name, owner, node in _nodes(gm))
    return [layer for layer in found if layer is not None]


def other_weights(gm: nn.Module, layers: Sequence[QuantLayer]) -> list[str]:
    """The fake-quantized parameters of ``gm`` that no conv/linear layer of ``layers``
    reads (a mixture of experts' fused ``[experts, ...]`` weights, matrices read by
    ``bmm`` or ``einsum``), by qualified name, in graph order."""
    seen = {(layer.owner, layer.quantizer) for layer in layers}
    found: list[str] = []
    for owner_name, owner, node in _nodes(gm):
        if (node.op != "call_module" or not node.args or (owner_name, str(node.target)) in seen
                or not isinstance(owner.get_submodule(str(node.target)), FakeQuantize)):
            continue
        src = node.args[0]  # the parameter, maybe viewed first ([experts * out, in])
        while (isinstance(src, Node) and src.op in ("call_function", "call_method")
               and src.args and op_name(src) in _VIEWS):
            src = src.args[0]
        weight = _param(owner, src)
        if weight is not None:
            found.append(f"{owner_name}.{weight}" if owner_name else weight)
    return found


def levels(gm: nn.Module, layers: Sequence[QuantLayer]) -> dict[QuantLayer, int]:
    """Each layer's level: 1 + the highest level among the layers it depends on (through
    any path, across stage boundaries). Layers of one level never feed each other."""
    by_key = {layer.key: layer for layer in layers}
    out: dict[QuantLayer, int] = {}

    def walk(owner_name: str, owner: GraphModule, inputs: int) -> int:
        level: dict[Node, int] = {}
        result = 0
        for node in owner.graph.nodes:
            base = max((level[a] for a in node.all_input_nodes), default=0)
            if node.op == "placeholder":
                base = inputs  # conservatively: every input as deep as the deepest
            key = f"{owner_name}.{node.name}" if owner_name else node.name
            if key in by_key:
                base += 1
                out[by_key[key]] = base
            elif node.op == "call_module":
                child = owner.get_submodule(str(node.target))
                if isinstance(child, GraphModule):
                    name = f"{owner_name}.{node.target}" if owner_name else str(node.target)
                    base = walk(name, child, base)
            level[node] = base
            if node.op == "output":
                result = base
        return result
    if isinstance(gm, GraphModule):
        walk("", gm, 0)
    return out


@dataclass
class Stats:
    """What one sweep collected: per layer, ``X^T X`` of its inputs and the number of
    rows (``gram``, ``rows``), or the per-channel sum of its outputs and the number of
    values summed per channel (``out_sum``, ``out_count``)."""

    gram: dict[QuantLayer, torch.Tensor] = field(default_factory=dict)
    rows: dict[QuantLayer, int] = field(default_factory=dict)
    out_sum: dict[QuantLayer, torch.Tensor] = field(default_factory=dict)
    out_count: dict[QuantLayer, int] = field(default_factory=dict)


class BatchFailed(Exception):
    """Running calibration batch ``index`` raised (the cause): the caller names the batch."""

    def __init__(self, index: int) -> None:
        super().__init__(f"calibration batch {index} failed")
        self.index = index


class _Enough(Exception):
    """Every watched layer of this batch has run: the rest of the graph is not needed."""


class _Run(Interpreter):
    """Runs one graph (and, through ``call_module``, the stage graphs it calls), handing
    the watched nodes' inputs / outputs to the sweep."""

    def __init__(self, module: GraphModule, owner: str, sweep: Sweep) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.owner = owner
        self.sweep = sweep

    def run_node(self, n: Node) -> Any:
        key = f"{self.owner}.{n.name}" if self.owner else n.name
        layer = self.sweep.watched.get(key)
        collect = self.sweep.collect
        if layer is not None and layer in collect.gram_layers:
            x = self.env[n.args[0]] if isinstance(n.args[0], Node) else n.args[0]
            collect.add_gram(layer, x)
        out = super().run_node(n)
        if layer is not None:
            if layer in collect.mean_layers:
                collect.add_out(layer, out)
            self.sweep.done(key)
        return out

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        child = self.fetch_attr(str(target))
        if isinstance(child, GraphModule) and not kwargs:
            name = f"{self.owner}.{target}" if self.owner else str(target)
            return _Run(child, name, self.sweep).run(*args)
        return super().call_module(target, args, kwargs)


def positional(gm: GraphModule, args: tuple, kwargs: dict) -> tuple:
    """A batch's ``(args, kwargs)`` as the positional inputs of ``gm.forward``."""
    if not kwargs:
        return tuple(args)
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


class Collector:
    """Running statistics of the watched layers: ``X^T X`` of the inputs of ``gram``
    layers, the per-channel sum of the outputs of ``mean`` layers; ``finish`` sums them
    across ranks with ``reduce`` (when given)."""

    def __init__(self, gram: Sequence[QuantLayer], mean: Sequence[QuantLayer],
                 reduce: Reduce | None) -> None:
        self.gram_layers = set(gram)
        self.mean_layers = set(mean)
        self.reduce = reduce
        self.stats = Stats()

    def add_gram(self, layer: QuantLayer, x: torch.Tensor) -> None:
        cols = layer.columns(x.detach().float())
        g = cols.T @ cols
        s = self.stats
        s.gram[layer] = s.gram[layer] + g if layer in s.gram else g
        s.rows[layer] = s.rows.get(layer, 0) + cols.shape[0]

    def add_out(self, layer: QuantLayer, y: torch.Tensor) -> None:
        y = y.detach().double()
        y = y.reshape(-1, y.shape[-1]) if layer.op == "linear" else \
            y.movedim(1, -1).reshape(-1, y.shape[1])
        s = self.stats
        total = y.sum(dim=0)
        s.out_sum[layer] = s.out_sum[layer] + total if layer in s.out_sum else total
        s.out_count[layer] = s.out_count.get(layer, 0) + y.shape[0]

    def finish(self) -> Stats:
        if self.reduce is not None:
            s = self.stats
            self._reduce(self.gram_layers, s.gram, s.rows)
            self._reduce(self.mean_layers, s.out_sum, s.out_count)
        return self.stats

    def _reduce(self, watched: set[QuantLayer], sums: dict[QuantLayer, torch.Tensor],
                counts: dict[QuantLayer, int]) -> None:
        """Sum one kind of statistic across ranks in one collective (every rank watches
        the same layers, in the same order: the graphs are the same)."""
        layers = sorted(watched, key=lambda m: m.key)
        if not layers:
            return
        missing = [layer for layer in layers if layer not in sums]
        if missing:  # every batch runs every layer: only no batches at all gets here
            raise RuntimeError(f"no statistics for {missing[0].key} on this rank")
        flat = torch.cat([sums[layer].reshape(-1).double() for layer in layers]
                         + [torch.tensor([float(counts[layer]) for layer in layers],
                                         dtype=torch.float64, device=sums[layers[0]].device)])
        assert self.reduce is not None
        self.reduce([flat])
        offset = 0
        for layer in layers:
            n = sums[layer].numel()
            sums[layer] = flat[offset:offset + n].reshape(sums[layer].shape).to(
                sums[layer].dtype)
            offset += n
        for i, layer in enumerate(layers):
            counts[layer] = round(float(flat[offset + i]))


class Sweep:
    """One pass of ``batches`` (``(args, kwargs)`` pairs) through ``gm`` from its inputs,
    collecting ``gram`` layers' input Gram matrices and ``mean`` layers' output sums; each
    batch stops once the watched layers have run. Run it inside
    ``qcompile.graph.running.untouched(gm)`` (eval, no grad, state restored)."""

    def __init__(self, gm: GraphModule, batches: Sequence[tuple[tuple, dict]], *,
                 gram: Sequence[QuantLayer] = (), mean: Sequence[QuantLayer] = (),
                 reduce: Reduce | None = None) -> None:
        self.gm = gm
        self.batches = batches
        self.collect = Collector(gram, mean, reduce)
        self.watched = {layer.key: layer for layer in (*gram, *mean)}
        self._pending: set[str] = set()

    def done(self, key: str) -> None:
        self._pending.discard(key)
        if not self._pending:
            raise _Enough

    def run(self) -> Stats:
        for index, (args, kwargs) in enumerate(self.batches):
            self._pending = set(self.watched)
            try:
                _Run(self.gm, "", self).run(*positional(self.gm, args, kwargs))
            except _Enough:
                pass
            except Exception as e:
                raise BatchFailed(index) from e
        return self.collect.finish()


def _in_place(node: Node) -> bool:
    name = str(node.target) if node.op == "call_method" else getattr(
        node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name.endswith("_") and \
        not name.endswith("__")


class Walker:
    """The calibration batches' way through the root graph, level after level: each
    ``sweep`` continues every batch from where the previous one stopped, so a graph of
    ``L`` levels costs about one forward per batch in all, not ``L``.

    A sweep runs every node whose inputs are ready, except the watched layers of this
    level (their inputs are measured; for ``mean`` they also run, for their outputs) and
    everything downstream of them: those run in a later sweep, through whatever the
    algorithm changed. Values that no pending node reads are dropped. Nodes that read no
    input (a weight and its fake-quant) are computed once per sweep, for all batches, so a
    changed weight is seen at once. Memory: the values crossing the current level, per
    batch. Graphs with stages or in-place ops (whose cached values could be stale) use
    ``Sweep`` instead (``Walker.fits``)."""

    def __init__(self, gm: GraphModule, batches: Sequence[tuple[tuple, dict]], *,
                 reduce: Reduce | None = None) -> None:
        self.gm = gm
        self.reduce = reduce
        ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.envs: list[dict[Node, Any]] = []  # per batch: the values still needed
        self.done: list[set[Node]] = []  # per batch: the nodes that have run for good
        for batch_args, batch_kwargs in batches:
            args = list(gm.graph.process_inputs(*positional(gm, batch_args, batch_kwargs)))
            env: dict[Node, Any] = {}
            for i, n in enumerate(ph):
                env[n] = args[i] if i < len(args) else (n.args[0] if n.args else None)
            self.envs.append(env)
            self.done.append(set(ph))
        self.interp = Interpreter(gm)
        self.nodes: list[Node] = []
        self.constant: set[Node] = set()

    def _scan(self) -> None:
        """The graph's nodes and which of them read no input (a pass may have added nodes
        since the last sweep, e.g. bias_correction's new bias)."""
        self.nodes = [n for n in self.gm.graph.nodes if n.op != "output"]
        varying = {n for n in self.nodes if n.op == "placeholder"}
        for n in self.nodes:
            if any(a in varying for a in n.all_input_nodes):
                varying.add(n)
        self.constant = {n for n in self.nodes if n not in varying}

    @staticmethod
    def fits(gm: GraphModule) -> bool:
        for n in gm.graph.nodes:
            if _in_place(n):
                return False
            if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)),
                                                    GraphModule):
                return False
        return True

    def _run(self, n: Node, value: Callable[[Node], Any]) -> Any:
        args = torch.fx.node.map_arg(n.args, value)
        kwargs = torch.fx.node.map_arg(n.kwargs, value)
        return getattr(self.interp, n.op)(n.target, args, kwargs)

    def sweep(self, *, gram: Sequence[QuantLayer] = (), mean: Sequence[QuantLayer] = ()
              ) -> Stats:
        """Statistics of ``gram`` / ``mean`` layers (root-graph layers of one level)."""
        self._scan()
        collect = Collector(gram, mean, self.reduce)
        watched = {layer.node: layer for layer in (*gram, *mean)}
        consts: dict[Node, Any] = {}

        for index, (env, done) in enumerate(zip(self.envs, self.done)):
            def value(a: Node, env: dict[Node, Any] = env) -> Any:
                if a in self.constant:
                    if a not in consts:
                        consts[a] = self._run(a, value)
                    return consts[a]
                return env[a]
            held: set[Node] = set()
            try:
                for n in self.nodes:
                    if n in done or n in self.constant:
                        continue
                    if any(a in held or (a not in done and a not in self.constant)
                           for a in n.all_input_nodes):
                        held.add(n)
                        continue
                    layer = watched.get(n.name)
                    if layer is not None:
                        if layer in collect.gram_layers:
                            collect.add_gram(layer, value(n.args[0]))
                        if layer in collect.mean_layers:
                            collect.add_out(layer, self._run(n, value))
                        held.add(n)  # runs again next sweep, with what the algorithm changed
                        continue
                    env[n] = self._run(n, value)
                    done.add(n)
            except Exception as e:
                raise BatchFailed(index) from e
            for n in [n for n in env if all(u in done for u in n.users)]:
                del env[n]  # every reader has run for good: not needed again
        return collect.finish()


def weight_grid(q: FakeQuantize, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's scale and zero point for every element of ``weight``, as
    ``[out, in * kh * kw]`` float32 matrices matching ``weight.reshape(out, -1)``."""
    scale, zp = q.scale.detach().float(), q.zero_point.detach().float()
    shape = weight.shape
    if q.granularity == "per_channel":
        view = [1] * len(shape)
        view[q.axis] = -1
        s, z = (scale.view(view).expand(shape), zp.view(view).expand(shape))
    elif q.granularity == "per_group":
        grouped = (shape[0], -1, int(q.group_size or 1))
        s = scale.view(shape[0], -1, 1).expand(grouped).reshape(shape)
        z = zp.view(shape[0], -1, 1).expand(grouped).reshape(shape)
    else:
        s, z = scale.expand(shape), zp.expand(shape)
    return s.reshape(shape[0], -1).contiguous(), z.reshape(shape[0], -1).contiguous()


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                  quant_min: int, quant_max: int) -> torch.Tensor:
    """Round-to-nearest onto the quantizer's grid (as its fake-quant computes it)."""
    q = torch.clamp(torch.round(w / scale) + zero_point, quant_min, quant_max)
    return (q - zero_point) * scale


def output_error(delta: torch.Tensor, gram: torch.Tensor, rows: int) -> float:
    """Mean squared output error per row of a weight change ``delta`` ([out, k]) on inputs
    whose Gram matrix is ``gram``: ``trace(delta H delta^T) / rows``."""
    return float(((delta @ gram) * delta).sum()) / max(rows, 1)


@contextlib.contextmanager
def parameters_as(gm: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily give the parameters named in ``values`` (qualified names) those
    values, restoring the parameters (the same objects) afterwards."""
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for name, value in values.items():
            parent, _, leaf = name.rpartition(".")
            mod = gm.get_submodule(parent) if parent else gm
            saved.append((mod, leaf, mod._parameters[leaf]))
            mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        yield
    finally:
        for mod, leaf, p in reversed(saved):
            mod._parameters[leaf] = p
