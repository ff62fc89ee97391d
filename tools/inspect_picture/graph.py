"""The picture's own graph: what a compiled ``GraphModule`` looks like to a person.

``from_graph_module`` reads a compiled graph (pipeline stages included) into a
``PictureGraph`` of plain data, so that collapsing, layout and drawing never touch torch:

- one node per value people care about: parameters (``get_attr``) are not drawn (they are
  listed in the details of the op using them), and int8 transfer plumbing (``pack`` /
  ``unpack`` and the scale / zero-point slots) is folded into the cut edge it serves;
- each node is named once (its layer for a module call, else its fx name), with a second
  line saying what it is (op, or a quantizer's dtype, granularity and scale range); an
  output quantizer belongs (``module``, for collapsing) to the module computing the value
  it quantizes, so a fused conv-bn-relu's output quantizer is boxed with the relu;
- values crossing a pipeline cut become *cut edges* from the producing node in one stage to
  the consuming nodes in the next, carrying their bytes in fp32 and as transferred;
- fusion groups (``node.meta[FUSION_KEY]``) and a weighted op with its weight and output
  quantizers become groups, drawn as boxes;
- a weighted op and its weight quantizer carry the weight's dtype (``weight_dtype``: the
  quantizer's dtype, or ``"float"`` for a weighted op left in float) and its storage bits
  per element (``bits``: ``dtype_bits``), for ``--color bits``.

Example:
    >>> import torch, qcompile as qc
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> spec = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": [
    ...     {"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
    ...      "activation": {"dtype": "uint8", "symmetric": False}}]}})
    >>> pg = from_graph_module(qc.qcompile(m, spec, (torch.randn(2, 4),)))
    >>> [(n.title, n.kind) for n in pg.nodes]  # doctest: +NORMALIZE_WHITESPACE
    [('input_1', 'input'), ('0.weight_fake_quant', 'quantizer'), ('0', 'op'), ('1', 'op'),
     ('0.output_fake_quant', 'quantizer'), ('output', 'output')]
    >>> [g.label for g in pg.groups]
    ['fused linear+relu']
    >>> [(n.title, n.weight_dtype, n.bits) for n in pg.nodes if n.weight_dtype]
    [('0.weight_fake_quant', 'int8', 8.0), ('0', 'int8', 8.0)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qcompile.graph.meta import (
    FUSION_KEY,
    MODULE_KEY,
    QSCHEME_KEY,
    SPEC_KEY,
    TENSOR_META,
)

FAKE_QUANT_SUFFIX = "fake_quant"


@dataclass
class PNode:
    """One drawn box: a graph node, or (after collapsing) a whole module."""

    id: str
    title: str  # the name, shown once
    sub: str  # what it is: op, quantizer scheme and scale range, module class
    kind: str  # input | output | op | quantizer | module
    module: str  # owning module path ("" for the root), used for collapsing
    stage: int | None = None
    group: str | None = None
    details: dict[str, str] = field(default_factory=dict)
    sqnr: float | None = None
    quantizers: int = 0  # quantizer nodes it stands for
    members: int = 1  # graph nodes it stands for
    weight_dtype: str | None = None  # a weighted op's weight dtype, "float", or "mixed" (a box)
    bits: float | None = None  # storage bits per weight element (None: float or mixed)


@dataclass
class PEdge:
    """A value flowing from ``src`` to ``dst``; ``cut`` when it crosses a pipeline cut."""

    src: str
    dst: str
    shape: str = ""
    cut: bool = False
    fp32_bytes: int | None = None  # cut edges: the value's bytes as a float32 tensor
    bytes: int | None = None  # cut edges: the bytes actually sent (payload + qparams)
    transfer: str | None = None  # cut edges: fp32 | int8


@dataclass
class PStage:
    """A pipeline stage, drawn as a labelled cluster."""

    index: int
    device: str
    cost: float
    parameters: int
    parameter_bytes: int
    bytes_in: int
    bytes_out: int

    @property
    def label(self) -> str:
        return (f"stage {self.index} · {self.device} · cost {self.cost:.4g} · "
                f"{self.parameters} params · in {self.bytes_in} B · out {self.bytes_out} B")


@dataclass
class PGroup:
    """A fusion group (or a weighted op with its quantizers), drawn as a box."""

    id: str
    label: str
    members: list[str]


@dataclass
class PictureGraph:
    """Nodes in topological order, edges, stage clusters and groups: plain data."""

    nodes: list[PNode]
    edges: list[PEdge]
    stages: list[PStage] = field(default_factory=list)
    groups: list[PGroup] = field(default_factory=list)
    transfer: str | None = None


# -- small facts about fx nodes -------------------------------------------------------------
def _shape(node: Any) -> tuple[int, ...] | None:
    tm = node.meta.get(TENSOR_META)
    shape = getattr(tm, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def shape_text(shape: tuple[int, ...] | None) -> str:
    """``(2, 32)`` -> ``"2x32"`` (empty when unknown)."""
    return "x".join(str(d) for d in shape) if shape is not None else ""


def _float_bytes(node: Any) -> int | None:
    shape = _shape(node)
    return 4 * math.prod(shape) if shape is not None else None


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _range(t: Any) -> str:
    lo, hi = float(t.min()), float(t.max())
    return _fmt(lo) if lo == hi else f"{_fmt(lo)}…{_fmt(hi)}"


FLOAT_WEIGHT = "float"  # ``weight_dtype`` of a weighted op whose weight is not quantized
MIXED_WEIGHT = "mixed"  # ``weight_dtype`` of a module box holding several weight dtypes


def dtype_bits(dtype: str) -> float | None:
    """Storage bits per element of a weight dtype: ``int4`` 4, ``fp8_e4m3`` 8, a block
    format its element bits plus its shared scales (``nvfp4`` 4.5); None for float.

    >>> dtype_bits("int4"), dtype_bits("uint8"), dtype_bits("fp8_e5m2"), dtype_bits("mxfp4")
    (4.0, 8.0, 8.0, 4.25)
    >>> dtype_bits("float") is None
    True
    """
    from qcompile.runtime.block_formats import FORMATS, bits_per_element

    if dtype in FORMATS:
        return float(bits_per_element(dtype))
    if dtype.startswith("fp8"):
        return 8.0
    digits = dtype.removeprefix("u").removeprefix("int")
    return float(digits) if digits.isdigit() else None


def _op_text(gm: Any, node: Any) -> str:
    from qcompile.graph.matching import op_name

    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    return op_name(node) or node.op


def _scheme_text(s: Any) -> str:
    if s is None:
        return "-"
    text = f"{s.dtype} {s.granularity} {'sym' if s.symmetric else 'asym'}"
    return text + (f" g{s.group_size}" if s.group_size else "")


def _rule_text(spec: Any, index: int | None) -> str:
    if spec is None or index is None:
        return "-"
    m = spec.quant.rules[index].match
    fields = [f"{k}={','.join(v)}" for k, v in (("module", m.module), ("name", m.name),
                                                 ("op", m.op)) if v]
    return f"#{index} " + " ".join(fields)


def _short_kind(op: str) -> str:
    """``Conv2d`` / ``conv2d`` -> ``conv``, ``BatchNorm2d`` -> ``bn``: fusion group names."""
    op = op.lower()
    for prefix, short in (("conv", "conv"), ("batchnorm", "bn"), ("linear", "linear")):
        if op.startswith(prefix):
            return short
    return op


def _strip_suffix(name: str) -> str:
    """``linear_3`` -> ``linear``: fx's de-duplicating suffix, to compare with an op name."""
    base, _, tail = name.rpartition("_")
    return base if base and tail.isdigit() else name


# -- the reader ----------------------------------------------------------------------------
class _Reader:
    """Walks the top-level graph and its stage children once; one instance per call."""

    def __init__(self, gm: Any, sqnr: dict[str, float] | None) -> None:
        from qcompile.runtime.fake_quant import FakeQuantize

        self.gm = gm
        self.spec = gm.meta.get(SPEC_KEY)
        self.sqnr = sqnr or {}
        self.fq_type = FakeQuantize
        # STAGE_NAMES_KEY maps parameter names, not children: find the children by name
        self.stage_names = [n for n, _ in gm.named_children() if n.startswith("stage_")]
        self.stage_names.sort(key=lambda n: int(n.rpartition("_")[2]))
        self.stage_of = {name: i for i, name in enumerate(self.stage_names)}
        self.nodes: dict[str, PNode] = {}
        self.edges: list[PEdge] = []

    # ids: stage graphs reuse names, so prefix them with their stage
    def nid(self, stage: int | None, node: Any) -> str:
        return node.name if stage is None else f"s{stage}.{node.name}"

    def is_fq(self, g: Any, node: Any) -> bool:
        return node.op == "call_module" and isinstance(g.get_submodule(str(node.target)),
                                                       self.fq_type)

    def module_of(self, g: Any, node: Any) -> str:
        from qcompile.graph.matching import layer_of

        if self.is_fq(g, node):  # a quantizer belongs to the layer it quantizes
            owner, _, leaf = str(node.target).rpartition(".")
            return owner if leaf.endswith(FAKE_QUANT_SUFFIX) else ""
        return layer_of(node) or ""

    def quantizer_node(self, g: Any, node: Any, stage: int | None) -> PNode:
        fq = g.get_submodule(str(node.target))
        target = str(node.target)
        role = "weight" if target.endswith("weight_fake_quant") else (
            "input" if target.endswith("input_fake_quant") else "activation")
        sub = f"{fq.dtype} {fq.granularity}"
        details = {"role": role, "dtype": fq.dtype, "granularity": fq.granularity,
                   "symmetric": str(bool(getattr(fq, "symmetric", False))).lower(),
                   "scale": _range(fq.scale), "zero_point": _range(fq.zero_point),
                   "qrange": f"{fq.quant_min}…{fq.quant_max}"}
        shape = _shape(node)
        if shape is None and node.args and getattr(node.args[0], "op", "") == "get_attr":
            w = node.args[0]  # a weight quantizer: the weight's shape
            owner, _, leaf = str(w.target).rpartition(".")
            shape = tuple(getattr(g.get_submodule(owner) if owner else g, leaf).shape)
        if shape is not None:
            details["shape"] = shape_text(shape)
        if fq.scale.numel() and bool((fq.scale != 1).any()):  # observed: worth showing
            sub += f" · s {details['scale']}"
        module = self.module_of(g, node)
        src = node.args[0] if node.args else None
        if role == "activation" and getattr(src, "op", "placeholder") not in (
                "placeholder", "get_attr"):
            # an output quantizer is drawn with the value it quantizes: a fused
            # conv-bn-relu's output quantizer (named after the conv) follows the relu
            module = self.module_of(g, src)
        pn = PNode(id=self.nid(stage, node), title=target, sub=sub, kind="quantizer",
                   module=module, stage=stage, details=details, quantizers=1)
        if role == "weight":
            pn.weight_dtype, pn.bits = fq.dtype, dtype_bits(fq.dtype)
        return pn

    @staticmethod
    def _qparams(details: dict[str, str], role: str, fq: Any) -> None:
        details[f"{role} qparams"] = (f"{fq.dtype} {fq.granularity}, scale {_range(fq.scale)}, "
                                      f"zero point {_range(fq.zero_point)}")

    def op_node(self, g: Any, node: Any, stage: int | None) -> PNode:
        op = _op_text(g, node)
        layer = node.meta.get(MODULE_KEY) or (
            str(node.target) if node.op == "call_module" else None)
        if layer:  # a module call: named by its layer, once
            title, sub = layer, op
        else:
            title = node.name
            sub = "" if op == _strip_suffix(node.name) else op
        details = {"op": f"{node.op} {op}", "module": self.module_of(g, node) or "(root)"}
        shape = _shape(node)
        if shape is not None:
            details["shape"] = shape_text(shape)
        params = []
        weight_dtype = None
        for i in node.all_input_nodes:  # parameters, also those read through a quantizer
            if i.op == "get_attr":
                params.append(str(i.target))
            elif self.is_fq(g, i) and i.args and getattr(i.args[0], "op", "") == "get_attr":
                params.append(str(i.args[0].target))
                self._qparams(details, "weight", g.get_submodule(str(i.target)))
                weight_dtype = g.get_submodule(str(i.target)).dtype
        if weight_dtype is None and self.weighted_float(g, node):
            weight_dtype = FLOAT_WEIGHT
        if params:
            details["parameters"] = ", ".join(params)
        last, fusion = node, node.meta.get(FUSION_KEY)
        while fusion:  # a fusion group's output is quantized after its last member
            nxt = next((u for u in last.users if u.meta.get(FUSION_KEY) == fusion), None)
            if nxt is None:
                break
            last = nxt
        for u in last.users:  # the quantizer of this op's output
            if self.is_fq(g, u):
                self._qparams(details, "output", g.get_submodule(str(u.target)))
        qs = node.meta.get(QSCHEME_KEY)
        if qs is not None:
            details["rule"] = _rule_text(self.spec, qs.rule)
            details["scheme"] = ("skip" if qs.skip else
                                 f"weight {_scheme_text(qs.weight)}; "
                                 f"activation {_scheme_text(qs.activation)}")
        if weight_dtype is not None:
            bits = dtype_bits(weight_dtype)
            details["weight bits"] = "float" if bits is None else f"{bits:g} ({weight_dtype})"
        return PNode(id=self.nid(stage, node), title=title, sub=sub, kind="op",
                     module=self.module_of(g, node), stage=stage, details=details,
                     weight_dtype=weight_dtype,
                     bits=None if weight_dtype is None else dtype_bits(weight_dtype))

    @staticmethod
    def weighted_float(g: Any, node: Any) -> bool:
        """A Linear / Conv / Embedding (module call or functional) reading its weight
        straight from a parameter: a weighted op left in float."""
        from qcompile.graph.matching import is_weighted_call, weighted_module_op

        return weighted_module_op(g, node) is not None or is_weighted_call(node)

    def add_graph(self, g: Any, stage: int | None) -> None:
        """Nodes and edges of one graph (a stage's inputs are followed back across the cut
        to the node producing them, see ``resolve``)."""
        for n in g.graph.nodes:
            if n.op == "get_attr" or (n.op == "placeholder" and stage is not None):
                continue
            if n.op == "call_function" and getattr(n.target, "__name__", "") in (
                    "pack", "unpack") and stage is not None:
                continue  # int8 transfer plumbing: folded into the cut edge
            if n.op == "output" and stage is not None:
                continue  # the top-level output is drawn once
            if n.op == "call_module" and str(n.target) == "_guards_fn":
                continue  # torch.export's input guards: bookkeeping, no value flows on
            if n.op == "placeholder":
                pn = PNode(id=n.name, title=n.name, sub=shape_text(_shape(n)), kind="input",
                           module="", details={"shape": shape_text(_shape(n))})
            elif n.op == "output":
                pn = PNode(id=n.name, title="output", sub="", kind="output", module="")
            elif self.is_fq(g, n):
                pn = self.quantizer_node(g, n, stage)
            else:
                pn = self.op_node(g, n, stage)
            self.nodes[pn.id] = pn
            for i in n.all_input_nodes:
                src = self.resolve(g, i, stage)
                if src is None:
                    continue
                src_id, cut = src
                if src_id not in self.nodes:
                    continue
                edge = PEdge(src=src_id, dst=pn.id,
                             shape=self.nodes[src_id].details.get("shape", ""))
                if cut is not None:
                    edge.cut = True
                    edge.fp32_bytes, edge.bytes, edge.transfer = cut
                self.edges.append(edge)

    # -- pipeline plumbing: follow values across stage boundaries ----------------------
    def stage_output(self, stage: int, index: int | None) -> Any:
        g = self.gm.get_submodule(self.stage_names[stage])
        out = next(n for n in g.graph.nodes if n.op == "output").args[0]
        return g, (out[index] if index is not None and isinstance(out, (tuple, list))
                   else out)

    def top_value(self, node: Any) -> tuple[str, tuple[int, int, str] | None] | None:
        """A top-level value (argument of a stage call) -> its producer and cut facts."""
        import operator

        if node.op == "placeholder":
            return node.name, None
        index = None
        if node.op == "call_function" and node.target is operator.getitem:
            node, index = node.args[0], node.args[1]
        if node.op != "call_module" or str(node.target) not in self.stage_of:
            return None
        stage = self.stage_of[str(node.target)]
        g, value = self.stage_output(stage, index)
        return self.inner_value(g, value, stage)

    def inner_value(self, g: Any, value: Any, stage: int
                    ) -> tuple[str, tuple[int, int, str] | None] | None:
        if getattr(value, "op", "get_attr") == "get_attr":
            return None  # scale / zero point of an int8 payload (counted with it), a constant
        if value.op == "placeholder":  # passed through this stage: look further up
            return self.stage_input(g, value, stage)
        transfer = "fp32"
        sent = None
        if value.op == "call_function" and getattr(value.target, "__name__", "") == "pack":
            transfer = "int8"
            payload = value.args[0]
            numel = math.prod(_shape(payload) or ())
            qparams = sum(_attr_bytes(g, a) for a in value.args[1:3]
                          if getattr(a, "op", None) == "get_attr")
            sent = numel + qparams
            value = payload
        fp32 = _float_bytes(value)
        return self.nid(stage, value), (fp32, sent if sent is not None else fp32, transfer)

    def stage_input(self, g: Any, placeholder: Any, stage: int
                    ) -> tuple[str, tuple[int, int, str] | None] | None:
        call = next(n for n in self.gm.graph.nodes
                    if n.op == "call_module" and str(n.target) == self.stage_names[stage])
        placeholders = [n for n in g.graph.nodes if n.op == "placeholder"]
        arg = call.args[placeholders.index(placeholder)]
        return self.top_value(arg)

    def resolve(self, g: Any, node: Any, stage: int | None
                ) -> tuple[str, tuple[int, int, str] | None] | None:
        if node.op == "get_attr":
            return None  # parameters are listed in their user's details, not drawn
        if stage is None:  # an unsplit graph: values are the nodes themselves
            return node.name, None
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "unpack":
            node = node.args[0]
        if node.op == "placeholder":
            return self.stage_input(g, node, stage)
        return self.nid(stage, node), None


def _attr_bytes(g: Any, node: Any) -> int:
    owner, _, leaf = str(node.target).rpartition(".")
    t = getattr(g.get_submodule(owner) if owner else g, leaf)
    return int(t.numel() * t.element_size())


def from_graph_module(gm: Any, sqnr: dict[str, float] | None = None) -> PictureGraph:
    """The ``PictureGraph`` of a compiled graph; ``sqnr`` maps the node names ``qc.sqnr``
    reports to dB (they colour the layers they measure)."""
    import qcompile as qc

    r = _Reader(gm, sqnr)
    if r.stage_names:
        top = gm.graph
        for n in top.nodes:  # inputs first
            if n.op == "placeholder":
                r.nodes[n.name] = PNode(id=n.name, title=n.name, sub=shape_text(_shape(n)),
                                        kind="input", module="",
                                        details={"shape": shape_text(_shape(n))})
        for i, name in enumerate(r.stage_names):
            r.add_graph(gm.get_submodule(name), i)
        out = next(n for n in top.nodes if n.op == "output")
        r.nodes[out.name] = PNode(id=out.name, title="output", sub="", kind="output", module="")
        for i in out.all_input_nodes:
            src = r.top_value(i)
            if src is not None and src[0] in r.nodes:
                r.edges.append(PEdge(src=src[0], dst=out.name,
                                     shape=r.nodes[src[0]].details.get("shape", "")))
    else:
        r.add_graph(gm, None)
    nodes = list(r.nodes.values())
    _attach_sqnr(gm, r)
    groups = _groups(gm, r, nodes)
    stages = [PStage(index=s.stage, device=s.device, cost=s.cost, parameters=s.parameters,
                     parameter_bytes=s.parameter_bytes, bytes_in=s.bytes_in,
                     bytes_out=s.bytes_out) for s in qc.report(gm).stages]
    transfer = None
    if r.spec is not None and r.spec.pipeline is not None:
        transfer = r.spec.pipeline.transfer
    return PictureGraph(nodes=nodes, edges=_dedupe(r.edges), stages=stages, groups=groups,
                        transfer=transfer)


def module_classes(gm: Any) -> dict[str, str]:
    """Module path -> class name, from the module stacks the front ends record (symbolic
    tracing and torch.export both fill ``nn_module_stack``) and the called submodules."""
    from qcompile.graph.meta import NN_MODULE_STACK

    out: dict[str, str] = {}
    graphs = [c for n, c in gm.named_children() if n.startswith("stage_")] or [gm]
    for g in graphs:
        for n in g.graph.nodes:
            for path, cls in (n.meta.get(NN_MODULE_STACK) or {}).values():
                if path:
                    out.setdefault(str(path), getattr(cls, "__name__", str(cls).rsplit(".")[-1]))
    return out


def _dedupe(edges: list[PEdge]) -> list[PEdge]:
    seen: dict[tuple[str, str], PEdge] = {}
    for e in edges:
        seen.setdefault((e.src, e.dst), e)
    return list(seen.values())


def _graphs(gm: Any, r: _Reader) -> list[tuple[int | None, Any]]:
    if r.stage_names:
        return [(i, gm.get_submodule(n)) for i, n in enumerate(r.stage_names)]
    return [(None, gm)]


def _attach_sqnr(gm: Any, r: _Reader) -> None:
    """``qc.sqnr`` names a measured value by its float-graph name: a re-expressed layer by
    its module (dots as underscores), else the node's own name. Colour that node and the
    quantizer measuring it."""
    if not r.sqnr:
        return
    for stage, g in _graphs(gm, r):
        for n in g.graph.nodes:
            if not r.is_fq(g, n) or not n.args or getattr(n.args[0], "op", "") == "get_attr":
                continue
            src = n.args[0]
            module = src.meta.get(MODULE_KEY)
            keys = ([module.replace(".", "_"), module] if module else []) + [src.name]
            value = next((r.sqnr[k] for k in keys if k in r.sqnr), None)
            if value is None:
                continue
            for node_id in (r.nid(stage, n), r.nid(stage, src)):
                if node_id in r.nodes:
                    r.nodes[node_id].sqnr = value
                    r.nodes[node_id].details["sqnr"] = f"{value:.2f} dB"


def _groups(gm: Any, r: _Reader, nodes: list[PNode]) -> list[PGroup]:
    """Fusion groups, and each weighted op with its weight and output quantizers."""
    members: dict[str, list[str]] = {}
    labels: dict[str, str] = {}
    for stage, g in _graphs(gm, r):
        key_of: dict[str, str] = {}
        for n in g.graph.nodes:
            nid = r.nid(stage, n)
            if nid not in r.nodes:
                continue
            fusion = n.meta.get(FUSION_KEY)
            qs = n.meta.get(QSCHEME_KEY)
            if fusion:
                key = f"g{'' if stage is None else stage}:" + "+".join(fusion)
                kind = _short_kind(r.nodes[nid].sub or r.nodes[nid].title)
                labels[key] = (labels[key] + "+" if key in labels else "fused ") + kind
            elif qs is not None and qs.weight is not None and not qs.skip:
                key = f"g{'' if stage is None else stage}:{n.name}"
                labels[key] = ""
            else:
                continue
            key_of[n.name] = key
            members.setdefault(key, []).append(nid)
        for n in g.graph.nodes:  # quantizers join the group they feed or follow
            if not r.is_fq(g, n):
                continue
            nid = r.nid(stage, n)
            if nid not in r.nodes:
                continue
            src = n.args[0] if n.args else None
            key = key_of.get(getattr(src, "name", ""))
            if key is None:
                key = next((key_of[u.name] for u in n.users if u.name in key_of), None)
            if key is not None:
                members[key].append(nid)
                r.nodes[nid].group = key
    order = {n.id: i for i, n in enumerate(nodes)}
    groups = []
    for i, (key, ids) in enumerate(members.items()):
        if len(ids) < 2:
            continue
        ids = sorted(ids, key=order.__getitem__)
        for nid in ids:
            r.nodes[nid].group = f"group{i}"
        groups.append(PGroup(id=f"group{i}", label=labels[key], members=ids))
    drawn = {g.id for g in groups}
    for n in nodes:  # groups of one are not drawn
        if n.group not in drawn:
            n.group = None
    return groups
