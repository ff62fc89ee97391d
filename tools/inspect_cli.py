"""``qcompile-inspect``: what qcompile does to a model, as text, JSON or a picture.

Subcommands (one function each; every result goes through one output sink, data on
stdout and diagnostics on stderr):

- ``validate SPEC``: check a spec file without importing torch.
- ``schema``: the JSON schema of the spec.
- ``show SPEC --model REF --input-shape 1x3x32x32``: the compiled graph as a table (node,
  op, target, shape, rule, scheme, quantizers, stage, device) and a summary; ``--world N``
  adds the device mesh the spec lays out on N ranks (pp x dp x tp: each rank's coordinates,
  stage, tp shard, fsdp2 rows and parameters held) and, with ``--graph svg|html``, its
  picture ``<out stem>-mesh.svg`` (``inspect_picture.mesh``).
- ``explain SPEC --model REF ... [--node NAME]``: the nodes each rule selected; for one
  node, every rule and why it did or did not match.
- ``passes SPEC --model REF ... --dump-dir DIR [--diff PASS]``: numbered per-pass dumps
  and the report JSON; ``--diff`` shows what one pass added and removed.
- ``sqnr SPEC --model REF ... [--calib FILE.pt | --random N]``: per-layer SQNR of the
  quantized graph against the float model, worst first.
- ``search DETAILS.json [--measured FILE.json] [--plot FILE.svg|FILE.png]``: the Pareto
  table of a ``qc.search(..., details=True)`` report (average weight bits, weight MB,
  predicted error and, from ``--measured``, the metric measured after compiling), the
  chosen candidate per group with its scores, and a plot of budget vs error (matplotlib).

``REF`` is ``package.module:factory`` or ``path/to/file.py:factory`` (a callable returning
the model). ``--format json`` gives stable, documented JSON; ``--graph svg|html|dot``
(``show``, ``sqnr``) writes a picture drawn by ``qcompile.tools.inspect_picture`` (no
Graphviz needed; ``--layout``, ``--depth``, ``--focus`` shape it; ``--color bits`` fills
each layer by its weight's bits, e.g. int4 vs int8 layers of a searched spec). Exit codes:
0 ok, 1 invalid spec or model error (``explain`` too, after explaining, when a rule
matches nothing), 2 usage (bad arguments or ``--calib`` data). ``--debug`` shows tracebacks.
Measuring (``sqnr``) leaves the model as the factory built it.

Example:
    >>> from qcompile.tools.inspect_cli import main
    >>> main(["validate", "int8-qat"])
    ok: int8-qat: mode qat, 4 rule(s), no pipeline
    0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

from qcompile.errors import QCompileError
from qcompile.files import atomic_path, write_atomically
from qcompile.graph.meta import QSCHEME_KEY, TENSOR_META
from qcompile.tools.output import Sink, note, table
from qcompile.version import __version__

JSON_VERSION = 1  # bumped when a JSON field changes meaning


class UsageError(Exception):
    """Wrong arguments (exit 2)."""


# -- the output sink (qcompile.tools.output, shared with qcompile-bench) ----------------------
def emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    """Print ``data`` as JSON (headed by ``"qcompile_inspect"``) or ``text`` for people,
    through the shared sink: the only place that writes results (``note``: stderr)."""
    Sink(args.format, header={"qcompile_inspect": JSON_VERSION}).emit(data, text)


# -- loading ----------------------------------------------------------------------------------
def load_factory(ref: str) -> Callable[[], Any]:
    """``pkg.module:factory`` or ``path/file.py:factory`` -> the factory callable."""
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise QCompileError(f"--model {ref!r} is not MODULE:FACTORY",
                            fix="use package.module:factory or path/to/file.py:factory")
    try:
        if module_ref.endswith(".py") or "/" in module_ref:
            path = Path(module_ref)
            if not path.is_file():
                raise QCompileError(f"--model: no file {module_ref}",
                                    fix="check the path to the Python file")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_ref)
    except QCompileError:
        raise
    except Exception as e:  # the user's module failed to import
        raise QCompileError(f"--model: importing {module_ref} failed: {type(e).__name__}: {e}",
                            fix="fix the module, or run with --debug for the traceback") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise QCompileError(f"--model: {module_ref} has no callable {attr!r}",
                            fix="name a function or class that returns the model")
    return factory


def build(args: argparse.Namespace) -> tuple[Any, Any, tuple[Any, ...] | None]:
    """(model, spec, example inputs) from the command line."""
    import torch

    import qcompile as qc

    spec = qc.load_spec(args.spec)
    factory = load_factory(args.model)
    try:
        model = factory()
    except SystemExit as e:  # sys.exit() in the factory: say so instead of exiting silently
        raise QCompileError(f"--model: {args.model} exited with code {e.code} (SystemExit) "
                            "instead of returning a model",
                            fix="return the model from the factory; do not call sys.exit()"
                            ) from e
    except Exception as e:
        raise QCompileError(f"--model: {args.model} raised {type(e).__name__}: {e}",
                            fix="fix the factory, or run with --debug for the traceback") from e
    if not isinstance(model, torch.nn.Module):
        raise QCompileError(f"--model: {args.model} returned {type(model).__name__}, not a "
                            "torch.nn.Module", fix="return the model instance")
    inputs = None
    if args.input_shape:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"--dtype {args.dtype!r} is not a torch dtype")
        inputs = []
        for shape in args.input_shape:
            try:
                dims = [int(d) for d in shape.lower().split("x")]
            except ValueError:
                raise UsageError(f"--input-shape {shape!r} is not like 1x3x32x32") from None
            if any(d < 0 for d in dims):
                raise UsageError(f"--input-shape {shape!r} has a negative dimension")
            gen = torch.Generator().manual_seed(0)
            inputs.append(torch.randn(dims, generator=gen).to(dtype) if dtype.is_floating_point
                          else torch.randint(0, 2, dims, generator=gen).to(dtype))
        inputs = tuple(inputs)
    return model, spec, inputs


def compile_graph(args: argparse.Namespace, instruments: tuple = ()) -> tuple[Any, Any, Any]:
    import qcompile as qc

    model, spec, inputs = build(args)
    gm = qc.qcompile(model, spec, inputs, instruments=instruments)
    return gm, spec, inputs


# -- graph facts ------------------------------------------------------------------------------
def _rule_text(spec: Any, index: int | None) -> str:
    if index is None:
        return ""
    m = spec.quant.rules[index].match
    fields = [f"{k}={','.join(v)}" for k, v in (("module", m.module), ("name", m.name),
                                                 ("op", m.op)) if v]
    return f"#{index} " + " ".join(fields)


def _scheme_text(s: Any) -> str | None:
    if s is None:
        return None
    return f"{s.dtype}/{s.granularity}/{'sym' if s.symmetric else 'asym'}"


def node_rows(gm: Any, spec: Any) -> list[dict[str, Any]]:
    """One row per node of the compiled graph (stage children flattened)."""
    from torch.fx.passes.shape_prop import TensorMetadata

    from qcompile.graph.dump import _target
    from qcompile.runtime.fake_quant import FakeQuantize

    stage_of_child = {}
    graphs = [("", gm)]
    children = [(n, c) for n, c in gm.named_children() if n.startswith("stage_")]
    if children:
        graphs = [(name, child) for name, child in children]
        for i, (name, _) in enumerate(children):
            stage_of_child[name] = i
    stages = qc_report(gm).stages
    rows = []
    for prefix, g in graphs:
        for n in g.graph.nodes:
            tm = n.meta.get(TENSOR_META)
            qs = n.meta.get(QSCHEME_KEY)
            quantizer = None
            if n.op == "call_module" and isinstance(g.get_submodule(str(n.target)),
                                                    FakeQuantize):
                fq = g.get_submodule(str(n.target))
                quantizer = f"{fq.dtype}/{fq.granularity}"
            stage = stage_of_child.get(prefix)
            rows.append({
                "node": n.name, "op": n.op, "target": _target(n),
                "shape": list(tm.shape) if isinstance(tm, TensorMetadata) else None,
                "rule": qs.rule if qs is not None else None,
                "rule_match": _rule_text(spec, qs.rule if qs is not None else None),
                "weight": _scheme_text(qs.weight) if qs is not None else None,
                "activation": _scheme_text(qs.activation) if qs is not None else None,
                "skip": bool(qs.skip) if qs is not None else False,
                "quantizer": quantizer,
                "stage": stage,
                "device": stages[stage].device if stage is not None else None,
            })
    return rows


def qc_report(gm: Any) -> Any:
    import qcompile as qc

    return qc.report(gm)


def summary(gm: Any) -> dict[str, Any]:
    import torch

    import qcompile as qc

    report = qc.report(gm)
    counts: dict[str, int] = {}
    for q in report.quantizers:
        key = f"{q.role} {q.dtype} {q.granularity}"
        counts[key] = counts.get(key, 0) + 1
    fp32 = quantized = 0
    bits = {q.node: int("".join(c for c in q.dtype if c.isdigit()) or 8)
            for q in report.quantizers if q.role == "weight"}
    seen: set[int] = set()
    for name, p in gm.state_dict(keep_vars=True).items():  # original names, also pipelined
        if not isinstance(p, torch.nn.Parameter) or id(p) in seen:
            continue
        seen.add(id(p))
        fp32 += p.numel() * 4
        quantized += p.numel() * bits.get(name, 32) / 8
    return {"quantizers": counts, "fp32_bytes": fp32, "quantized_bytes": int(quantized),
            "stages": [s.model_dump() for s in report.stages],
            "balance_ratio": report.balance_ratio, "mode": report.mode,
            "trace_method": report.trace_method,
            "tensor_parallel": [r.model_dump() for r in report.tensor_parallel]}


# -- pictures (drawn by qcompile.tools.inspect_picture) ---------------------------------------
TABLE_COLUMNS = ["node", "op", "target", "shape", "rule_match", "weight", "activation",
                 "quantizer", "stage", "device"]


def picture_graph(args: argparse.Namespace, gm: Any, sqnr: dict[str, float] | None = None
                  ) -> tuple[Any, int | None]:
    """The compiled graph as a collapsed ``PictureGraph`` (``--depth``, ``--focus``) and
    the depth used (None: every node)."""
    from qcompile.tools.inspect_picture import collapse, graph

    depth = collapse.parse_depth(getattr(args, "depth", None))
    pg = graph.from_graph_module(gm, sqnr)
    if depth == "auto":
        depth = collapse.auto_depth(pg)
    return collapse.collapse(pg, depth, getattr(args, "focus", None),
                             classes=graph.module_classes(gm)), depth


def _svg_by_dot(dot_text: str, dot_path: Path, svg_path: Path) -> None:
    exe = shutil.which("dot")
    if exe is None:
        raise QCompileError("--layout dot needs Graphviz's `dot`, which is not installed",
                            fix="use --layout python (no Graphviz needed), or install graphviz "
                            "(apt-get install graphviz)")
    write_atomically(dot_path, dot_text)
    with atomic_path(svg_path) as tmp:  # Graphviz writes the whole picture, then it moves
        subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(tmp)], check=True)


def write_picture(args: argparse.Namespace, rows: list[dict[str, Any]], gm: Any,
                  info: dict[str, Any], sqnr: dict[str, float] | None = None
                  ) -> tuple[list[str], dict[str, Any] | None]:
    """Write ``--graph dot|svg|html``; returns the files written and what was drawn."""
    if not getattr(args, "graph", None):
        return [], None
    from qcompile.tools.inspect_picture import dot, html, svg

    out = Path(args.out or f"qcompile-graph.{args.graph}")
    if not out.parent.is_dir():  # before drawing anything
        raise QCompileError(f"--out {out}: the folder {out.parent} does not exist",
                            fix="create the folder first, or give --out a path in an "
                                "existing folder")
    pg, depth = picture_graph(args, gm, sqnr)
    colour = getattr(args, "color", None) or "auto"
    layout = args.layout
    if layout == "auto":  # Graphviz when installed (svg only), else the Python layout
        layout = "dot" if args.graph == "svg" and shutil.which("dot") else "python"
    if args.graph == "html" and layout == "dot":
        note("note: --graph html always uses the Python layout (the page needs its markup)")
        layout = "python"
    written = []
    if args.graph == "dot":
        write_atomically(out.with_suffix(".dot"), dot.to_dot(pg, colour) + "\n")
        written.append(str(out.with_suffix(".dot")))
        layout = None
    elif args.graph == "svg" and layout == "dot":
        _svg_by_dot(dot.to_dot(pg, colour) + "\n", out.with_suffix(".dot"),
                    out.with_suffix(".svg"))
        written += [str(out.with_suffix(".dot")), str(out.with_suffix(".svg"))]
    elif args.graph == "svg":
        write_atomically(out.with_suffix(".svg"), svg.to_svg(pg, colour=colour))
        written.append(str(out.with_suffix(".svg")))
    else:
        text = (f"mode {info['mode']} · traced by {info['trace_method']} · "
                f"{sum(info['quantizers'].values())} quantizers · "
                f"{len(info['stages']) or 'no'} pipeline stage(s) · depth "
                f"{'full' if depth is None else depth}"
                + (f" · focus {args.focus}" if getattr(args, "focus", None) else ""))
        page = html.to_html(pg, svg.to_svg(pg, colour=colour),
                            title=f"qcompile graph: {args.model}", info=text, rows=rows,
                            columns=TABLE_COLUMNS, colour=colour)
        write_atomically(out.with_suffix(".html"), page)
        written.append(str(out.with_suffix(".html")))
    for path in written:
        note(f"wrote {path}")
    drawn = {"boxes": len(pg.nodes), "depth": "full" if depth is None else depth,
             "focus": getattr(args, "focus", None), "layout": layout,
             "clusters": len(pg.stages), "groups": len(pg.groups),
             "cut_edges": sum(e.cut for e in pg.edges),
             "colour": svg.resolve_colour(colour, pg)}
    if drawn["colour"] == "bits":
        drawn["weight_dtypes"] = [label for label, _ in svg.legend(pg)]
    return written, drawn



# -- the device mesh (show --world) -------------------------------------------------------------
MESH_DIMS = ("pp", "dp", "tp")  # torch's order as qc.distributed.mesh builds it: tp innermost
# (style, kind) of a planned layer -> the weight dim its tp shards split (torch's
# ColwiseParallel / RowwiseParallel), and how the text says it; read-only
TP_SPLITS = MappingProxyType({("colwise", "linear"): (0, "colwise rows"),
                              ("rowwise", "linear"): (1, "rowwise input columns"),
                              ("rowwise", "embedding"): (0, "embedding rows"),
                              ("colwise", "embedding"): (1, "embedding columns"),
                              ("experts", "experts"): (0, "experts")})
TP_ORDER = tuple(what for _, what in TP_SPLITS.values())


def mesh_layout(spec: Any, world: int) -> dict[str, int]:
    """The mesh ``spec`` lays out on ``world`` ranks: its dims (among pp, dp, tp, in that
    order) and their sizes, as ``qc.distributed.mesh`` and ``qc.distributed.pipeline``
    build it; or a ``QCompileError`` saying why the spec does not fit ``world`` ranks,
    from the spec alone (nothing is compiled or launched)."""
    try:
        if spec.tensor_parallel is not None:
            from qcompile.distributed.tensor_parallel import mesh_dims

            return mesh_dims(spec, world)
        if spec.pipeline is not None and spec.data_parallel.kind != "none":
            from qcompile.distributed.hybrid import mesh_shape

            pp, dp = mesh_shape(spec, world)
            return {"pp": pp, "dp": dp}
    except QCompileError as e:  # the library's reason and fix, said about --world
        raise QCompileError(f"--world {world}: {e.message}", fix=e.fix) from e
    if spec.pipeline is not None:  # a pipeline alone: stages placed as pipeline() places them
        k, schedule = spec.pipeline.num_stages, spec.pipeline.schedule
        if schedule == "interleaved_1f1b":
            if k % world or k // world < 2:
                fits = max(w for w in range(1, k + 1) if k % w == 0 and k // w >= 2)
                raise QCompileError(f"--world {world}: pipeline.schedule interleaved_1f1b "
                                    f"needs 2 or more of the {k} stages on each rank, the same "
                                    "number on each", fix=f"use --world {fits} (or another "
                                    f"divisor of {k} leaving 2 or more stages per rank)")
        elif k != world:
            raise QCompileError(f"--world {world}: pipeline.schedule {schedule} runs one "
                                f"stage per rank, and the spec has {k} stages",
                                fix=f"use --world {k}, or set pipeline.stages: {world}")
        return {"pp": world}
    if spec.data_parallel.kind != "none":
        return {"dp": world}
    if world != 1:
        raise QCompileError(f"--world {world}: the spec has no pipeline, data_parallel or "
                            "tensor_parallel section, so its ranks form no mesh (each would "
                            "train a whole copy of its own)",
                            fix="use --world 1, or add data_parallel: {kind: ddp} (or fsdp2), "
                            "pipeline stages or tensor_parallel")
    return {}


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``i`` of ``n`` split in ``parts`` as ``torch.chunk``
    splits it (DTensor's ``Shard`` and FSDP2 do): pieces of ``ceil(n / parts)``, the last
    ones shorter or empty."""
    size = -(-n // parts)
    return min(n, i * size), min(n, (i + 1) * size)


def _numel(shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def mesh_report(gm: Any, spec: Any, dims: dict[str, int]) -> dict[str, Any]:
    """What each rank of the mesh holds (``show``'s JSON ``mesh``): its coordinates,
    pipeline stage(s), tp shard of each planned layer (``report.tensor_parallel`` and the
    compiled graph's weight shapes), dp replica and, under fsdp2, chunk of rows; and the
    parameter elements it keeps, from the graph's parameter shapes."""
    import torch

    pp, dp, tp = (dims.get(d, 1) for d in MESH_DIMS)
    report = qc_report(gm)
    # every distinct parameter once, under the model's name (a tied name aliases the first)
    shapes: dict[str, list[int]] = {}
    element: dict[str, int] = {}
    canonical: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in gm.state_dict(keep_vars=True).items():
        if isinstance(p, torch.nn.Parameter):
            canonical[name] = first.setdefault(id(p), name)
            if canonical[name] == name:
                shapes[name], element[name] = list(p.shape), p.element_size()
    total = sum(_numel(s) for s in shapes.values())
    # the dim tp splits, per parameter; what no sharded layer owns stays whole on each rank
    split: dict[str, tuple[int, str]] = {}
    for r in report.tensor_parallel:
        how, weight = TP_SPLITS.get((r.style, r.kind)), canonical.get(f"{r.layer}.weight")
        if r.style == "experts":  # the record names the [experts, ...] parameter itself
            weight = canonical.get(r.layer)
        if how is not None and weight is None:  # a frozen base: its storage, laid out by rows
            for name in shapes:
                if name.startswith(f"{r.layer}.weight_frozen.") and len(shapes[name]) == 2 \
                        and shapes[name][how[0]] > 1:
                    split[name] = how
            continue
        if how is None or weight is None:
            continue
        split[weight] = how
        bias = canonical.get(f"{r.layer}.bias")
        if bias is not None and r.style == "colwise":  # a rowwise layer's bias is whole
            split[bias] = (0, how[1])
    # the parameters of each pipeline stage, by identity (a stage may name them its way)
    stages: list[dict[str, Any]] = []
    of_stage: list[list[str]] = []
    if spec.pipeline is not None:
        records = {s.stage: s for s in report.stages}
        for s in range(spec.pipeline.num_stages):
            names = [first[id(w)] for w in gm.get_submodule(f"stage_{s}").parameters()
                     if id(w) in first]
            of_stage.append(names)
            owners = [n.rpartition(".")[0] or n for n in names]
            rec = records.get(s)
            stages.append({"stage": s, "modules": rec.modules if rec else [],
                           "parameters": rec.parameters if rec else
                           sum(_numel(shapes[n]) for n in names),
                           "range": [owners[0], owners[-1]] if owners else []})
    fsdp = spec.data_parallel.kind == "fsdp2" and "dp" in dims
    ranks = []
    for rank in range(pp * dp * tp):
        p, d, t = rank // (dp * tp), rank // tp % dp, rank % tp
        mine = list(range(p, len(stages), pp))  # interleaved: stages p, p + pp, ...
        names = [n for s in mine for n in of_stage[s]] if stages else list(shapes)
        held = nbytes = 0
        ranges: dict[tuple[str, int], dict[str, Any]] = {}
        for name in dict.fromkeys(names):  # a parameter two of its stages share, once
            shape = list(shapes[name])
            if name in split and "tp" in dims:
                dim, what = split[name]
                start, stop = _chunk(shape[dim], tp, t)
                if name.endswith(".weight") or what == "experts":
                    entry = ranges.setdefault((what, shape[dim]), {
                        "what": what, "dim": dim, "start": start, "stop": stop,
                        "of": shape[dim], "layers": 0})
                    entry["layers"] += 1
                shape[dim] = stop - start
            if fsdp and shape:  # fully_shard: this rank's torch.chunk of dim 0 over dp
                start, stop = _chunk(shape[0], dp, d)
                shape[0] = stop - start
            held += _numel(shape)
            nbytes += _numel(shape) * element[name]
        ranks.append({
            "rank": rank, "coords": {"pp": p, "dp": d, "tp": t},
            "stage": mine[0] if len(mine) == 1 else None, "stages": mine,
            "holds": {"parameters": held, "parameter_bytes": nbytes,
                      "share": round(held / total, 6) if total else 0.0,
                      "tp_shard": t if "tp" in dims else None,
                      "tp_ranges": sorted(ranges.values(), key=lambda e: (
                          TP_ORDER.index(e["what"]), e["of"])),
                      "fsdp2_chunk": d if fsdp else None}})
    return {"world": pp * dp * tp, "dims": dims, "data_parallel": spec.data_parallel.kind,
            "parameters": total,
            "sharded_layers": sum(1 for r in report.tensor_parallel
                                  if (r.style, r.kind) in TP_SPLITS),
            "replicated_layers": sum(1 for r in report.tensor_parallel
                                     if r.style == "replicate"),
            "stages": stages, "ranks": ranks}


def _tp_ranges_text(ranges: list[dict[str, Any]]) -> str:
    """``colwise rows 32-63 of 64 (3 layers), 64-127 of 128 (2 layers); rowwise ...``."""
    parts: dict[str, list[str]] = {}
    for e in ranges:
        span = (f"{e['start']}-{e['stop'] - 1}" if e["stop"] > e["start"] else "none")
        parts.setdefault(e["what"], []).append(
            f"{span} of {e['of']} ({e['layers']} layer{'s' if e['layers'] != 1 else ''})")
    return "; ".join(f"{what} {', '.join(spans)}" for what, spans in parts.items())


def mesh_lines(mesh: dict[str, Any]) -> list[str]:
    """``show --world``'s text: the mesh's dims, then each rank's coordinates and holdings."""
    from qcompile.tools.inspect_picture.mesh import formula, stage_text, title

    dims, total = mesh["dims"], mesh["parameters"]
    lines = [title(mesh) + (f" ({formula(dims)})" if len(dims) > 1 else "")]
    kind = mesh["data_parallel"]
    if "dp" in dims and kind == "fsdp2":
        lines.append(f"  dp: fsdp2, so each rank keeps 1/{dims['dp']} of the rows (dim 0, as "
                     "torch.chunk splits it) of every parameter its dp replica holds")
    elif "dp" in dims and kind == "ddp":
        lines.append("  dp: ddp, so each dp replica holds a whole copy")
    if "tp" in dims:
        lines.append(f"  tp: {mesh['sharded_layers']} layer(s) sharded across each group of "
                     f"{dims['tp']} ranks; {mesh['replicated_layers']} replicated layer(s), "
                     "norms and other parameters whole on each rank")
    stages = {s["stage"]: s for s in mesh["stages"]}
    for r in mesh["ranks"]:
        c, held = r["coords"], r["holds"]
        coords = ", ".join(f"{d} {c[d]}" for d in MESH_DIMS if d in dims)
        parts = []
        if r["stages"]:
            about = [stages[s] for s in r["stages"] if s in stages]
            span = about[0]["range"] if len(about) == 1 else []  # interleaved: no one span
            params = f"{sum(a['parameters'] for a in about)} params"
            parts.append(stage_text(r) + (f" ({span[0]} .. {span[-1]}, {params})" if span
                                          else f" ({params})" if about else ""))
        if "dp" in dims:
            parts.append(f"dp replica {c['dp']} of {dims['dp']}")
        parts.append(f"holds {held['parameters']} of {total} params ({held['share']:.1%})")
        lines.append(f"  rank {r['rank']}" + (f" ({coords})" if coords else "") + ": "
                     + "; ".join(parts))
        if held["tp_shard"] is not None:
            lines.append(f"      tp {held['tp_shard']} of {dims['tp']}: "
                         + (_tp_ranges_text(held["tp_ranges"]) or "no sharded layer here"))
        if held["fsdp2_chunk"] is not None:
            lines.append(f"      fsdp2: keeps chunk {held['fsdp2_chunk']} of {dims['dp']} of "
                         "the rows of each of those parameters")
    return lines


def write_mesh_picture(args: argparse.Namespace, written: list[str],
                       mesh: dict[str, Any]) -> str | None:
    """``<out stem>-mesh.svg`` next to the ``--graph svg|html`` picture (``written``: its
    files); returns its path (None: no picture asked for, or a DOT one)."""
    if getattr(args, "graph", None) == "dot":  # DOT text of the graph only: say so
        note("note: --graph dot draws no mesh picture (--graph svg or html do)")
    if getattr(args, "graph", None) not in ("svg", "html") or not written:
        return None
    from qcompile.tools.inspect_picture import mesh as mesh_picture

    picture = Path(written[-1])  # the .svg or .html (a .dot comes first with --layout dot)
    path = picture.with_name(f"{picture.stem}-mesh.svg")
    write_atomically(path, mesh_picture.to_svg(mesh))
    note(f"wrote {path}")
    return str(path)


# -- subcommands ----------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from qcompile.specs import load_spec

    try:
        spec = load_spec(args.spec)
    except QCompileError as e:  # missing or unparsable file
        emit(args, {"valid": False, "errors": [{"field": "", "message": e.message,
                                                "fix": e.fix}]},
             f"invalid: {e.message}" + (f"\n  fix: {e.fix}" if e.fix else ""))
        return 1
    except ValidationError as e:
        errors = [{"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"]}
                  for err in e.errors()]
        text = "\n".join(f"invalid: {err['field']}: {err['message']}" for err in errors)
        emit(args, {"valid": False, "errors": errors}, text)
        return 1
    p = spec.pipeline
    pipe = f"{p.num_stages} pipeline stage(s)" if p is not None else "no pipeline"
    emit(args, {"valid": True, "spec": spec.model_dump(mode="json")},
         f"ok: {args.spec}: mode {spec.quant.mode}, {len(spec.quant.rules)} rule(s), {pipe}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from qcompile.specs import CompileSpec

    schema = CompileSpec.model_json_schema()
    Sink("json").emit(schema)  # JSON either way (and no header): it is a JSON schema
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    dims = None
    if args.world is not None:  # a layout that does not fit: said before compiling anything
        import qcompile as qc

        dims = mesh_layout(qc.load_spec(args.spec), args.world)
    gm, spec, _ = compile_graph(args)
    rows = node_rows(gm, spec)
    info = summary(gm)
    written, drawn = write_picture(args, rows, gm, info)
    mesh = mesh_report(gm, spec, dims) if dims is not None else None
    if mesh is not None:
        mesh_file = write_mesh_picture(args, written, mesh)
        if mesh_file is not None:
            written.append(mesh_file)
    cols = ["node", "op", "target", "shape", "rule_match", "weight", "activation", "quantizer"]
    if info["stages"]:
        cols += ["stage", "device"]
    lines = [table(rows, cols), "", f"mode {info['mode']}, traced by {info['trace_method']}"]
    lines += [f"quantizers: {n} x {k}" for k, n in sorted(info["quantizers"].items())]
    ratio = info["quantized_bytes"] / info["fp32_bytes"] if info["fp32_bytes"] else 1.0
    lines.append(f"parameters: fp32 {info['fp32_bytes']} bytes, quantized "
                 f"{info['quantized_bytes']} bytes ({ratio:.0%})")
    if info["stages"]:
        lines.append(f"stages: {len(info['stages'])}, max/mean cost "
                     f"{info['balance_ratio']:.2f}" if info["balance_ratio"] else "")
        for s in info["stages"]:
            lines.append(f"  stage {s['stage']} on {s['device']}: {s['nodes']} nodes, "
                         f"{s['parameters']} params, cost {s['cost']:.4g}, "
                         f"in {s['bytes_in']} B, out {s['bytes_out']} B")
    else:
        lines.append("stages: none (no pipeline section)")
    if info["tensor_parallel"]:
        from qcompile.graph.records import TensorParallelRecord, tensor_parallel_lines

        lines += tensor_parallel_lines([TensorParallelRecord(**r)
                                        for r in info["tensor_parallel"]])
    data = {"nodes": rows, "summary": info, "files": written}
    if drawn is not None:
        data["picture"] = drawn
    if mesh is not None:
        lines += mesh_lines(mesh)
        data["mesh"] = mesh
    emit(args, data, "\n".join(lines))
    return 0


def _why(rule: Any, node: Any, gm: Any) -> tuple[bool, str]:
    from qcompile.graph.matching import candidate, match_node, op_name, owners

    m = rule.match
    if not candidate(gm, node, rule):
        if m.op is not None:
            return False, f"not a function/method call ({node.op})"
        return False, "neither a module's output nor an op with a weight"
    own = owners(node, gm)
    if match_node(m, node, own) is not None:
        return True, "matches"
    if m.op is not None and op_name(node) not in m.op:
        return False, f"op {op_name(node)!r} is not one of {m.op}"
    names = ", ".join(f"{o.name or '<root>'} ({o.cls_name})" for o in own) or "no module"
    wanted = " and ".join(f"{k} {v}" for k, v in (("module", m.module), ("name", m.name)) if v)
    return False, f"no owner has {wanted}; owners: {names}"


def cmd_explain(args: argparse.Namespace) -> int:
    import qcompile as qc
    from qcompile.graph.context import Context
    from qcompile.graph.pipeline import Pipeline
    from qcompile.passes.annotate import annotate, assign_rules
    from qcompile.passes.fold_bn import fold_bn
    from qcompile.passes.trace import trace

    model, spec, inputs = build(args)
    # The graph before annotation shows matching as the rules saw it.
    ctx = Context(spec=spec, model=model, example_inputs=inputs)
    annotated, _ = Pipeline([trace, fold_bn]).run(ctx)
    matches = assign_rules(annotated, list(spec.quant.rules)).won
    graphs = [annotated]
    status = 0
    try:  # the compiled graph too: `show` prints its node names
        Pipeline([trace, fold_bn, annotate]).run(ctx)  # an unmatched rule raises here
        graphs.insert(0, qc.qcompile(model, spec, inputs))
    except QCompileError as e:  # an unmatched rule: explain the rest anyway, then exit 1
        note(f"note: {e.message}")  # as `show` does: the spec does not compile this model
        status = 1
    rules = [{"rule": i, "match": _rule_text(spec, i), "skip": r.skip,
              "nodes": matches.get(i, [])} for i, r in enumerate(spec.quant.rules)]
    if args.node is None:
        text = "\n".join(f"rule {r['match']}{' (skip)' if r['skip'] else ''}: "
                         f"{len(r['nodes'])} node(s): {', '.join(r['nodes']) or '-'}"
                         for r in rules)
        emit(args, {"rules": rules}, text or "the spec has no rules")
        return status
    found = [(g, n) for g in graphs for n in g.graph.nodes if n.name == args.node]
    if not found:
        names = ", ".join(n.name for n in list(graphs[0].graph.nodes)[:20])
        raise QCompileError(f"--node {args.node!r} is not a node of the graph",
                            fix=f"use a node name from `show`, e.g. {names}")
    graph, node = found[0]
    tried = []
    for i, rule in enumerate(spec.quant.rules):
        ok, why = _why(rule, node, graph)
        tried.append({"rule": i, "match": _rule_text(spec, i), "matched": ok, "why": why})
    qs = node.meta.get(QSCHEME_KEY)
    chosen = qs.rule if qs is not None else None
    text = "\n".join([f"node {node.name} ({node.op} {node.target}): "
                      + (f"rule {chosen} applies" if chosen is not None else "no rule applies")]
                     + [f"  {'*' if t['rule'] == chosen else ' '} {t['match']}: {t['why']}"
                        for t in tried])
    emit(args, {"node": node.name, "chosen_rule": chosen, "rules": tried}, text)
    return status


def cmd_passes(args: argparse.Namespace) -> int:
    from qcompile.graph.dump import GraphDumps

    out = Path(args.dump_dir)
    if out.exists() and not out.is_dir():  # before compiling: nothing written
        raise QCompileError(f"--dump-dir {out}: is a file, not a folder (the dumps are one "
                            "file per pass inside it)",
                            fix="give a folder path (created when missing), e.g. "
                                f"--dump-dir {out.with_suffix('')}-dumps")
    dumps = GraphDumps(out)
    gm, _, inputs = compile_graph(args, instruments=(dumps,))
    if args.convert:  # calibrate (static, QAT) on random batches, then the conversion steps
        import warnings

        import torch

        import qcompile as qc
        from qcompile.runtime.calibration import collect_statistics

        if qc.quantizers(gm) and qc.report(gm).mode in ("static", "qat"):
            if inputs is None:
                raise UsageError("passes --convert needs --input-shape (it calibrates on "
                                 "random batches of that shape)")
            gen = torch.Generator().manual_seed(1)
            collect_statistics(gm, [tuple(torch.randn(x.shape, generator=gen).to(x.dtype)
                                          if x.is_floating_point() else x for x in inputs)
                                    for _ in range(4)], progress=False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
            gm = qc.convert(gm, example_inputs=inputs, instruments=(dumps,))
    files = sorted(p.name for p in out.iterdir())
    data: dict[str, Any] = {"dump_dir": str(out), "files": files}
    text = [f"wrote {len(files)} files to {out}: {', '.join(files)}"]
    if args.convert:
        import qcompile as qc

        conversions = qc.report(gm).conversions
        data["conversions"] = [c.model_dump() for c in conversions]
        text += [f"converted: {len(conversions)} conversion record(s)"]
        text += [f"  {c.node}: {c.path} {c.op}" for c in conversions]
    if args.diff:
        import qcompile as qc

        record = next((p for p in qc.report(gm).passes if p.name == args.diff), None)
        if record is None:
            raise UsageError(f"--diff {args.diff!r} is not a pass of this compile "
                             f"({', '.join(p.name for p in qc.report(gm).passes)})")
        data["diff"] = {"pass": record.name, "added": record.added, "removed": record.removed,
                        "notes": record.notes}
        text += [f"pass {record.name}: +{len(record.added)} -{len(record.removed)}"]
        text += [f"  + {n}" for n in record.added] + [f"  - {n}" for n in record.removed]
        text += [f"  note: {n}" for n in record.notes]
    emit(args, data, "\n".join(text))
    return 0


def load_calib(path: str, inputs: tuple[Any, ...] | None) -> list[tuple[Any, ...]]:
    """The ``--calib`` file as a list of input tuples, or a ``UsageError`` (exit 2) saying
    what is wrong with it: missing, not a torch.save'd list of tensors (or of tuples of
    tensors), empty, not finite, or not matching ``--input-shape``."""
    import torch

    where = f"--calib {path}"
    expected = "a torch.save'd list of input tensors (or of tuples of tensors)"
    if not Path(path).is_file():
        raise UsageError(f"{where}: no such file")
    try:
        loaded = torch.load(path, weights_only=True)
    except Exception as e:  # not a torch file, or one that needs pickle: both are bad data
        raise UsageError(f"{where}: torch.load(weights_only=True) cannot read it "
                         f"({type(e).__name__}); expected {expected}") from None
    items = loaded if isinstance(loaded, (list, tuple)) else [loaded]
    if not items:
        raise UsageError(f"{where}: holds no batches; expected {expected}")
    batches = []
    for i, item in enumerate(items):
        batch = tuple(item) if isinstance(item, (tuple, list)) else (item,)
        for j, x in enumerate(batch):
            if not isinstance(x, torch.Tensor):
                raise UsageError(f"{where}: batch {i} input {j} is a {type(x).__name__}, not a "
                                 f"tensor; expected {expected}")
            if x.is_floating_point() and not bool(torch.isfinite(x).all()):
                raise UsageError(f"{where}: batch {i} input {j} contains NaN or Inf")
        if inputs is not None:
            if len(batch) != len(inputs):
                raise UsageError(f"{where}: batch {i} has {len(batch)} input(s), --input-shape "
                                 f"gives {len(inputs)}")
            for j, (x, ref) in enumerate(zip(batch, inputs)):
                if x.shape[1:] != ref.shape[1:]:
                    raise UsageError(f"{where}: batch {i} input {j} has shape "
                                     f"{list(x.shape)}, --input-shape gives {list(ref.shape)}")
        batches.append(batch)
    return batches


def cmd_sqnr(args: argparse.Namespace) -> int:
    import torch

    import qcompile as qc
    from qcompile.runtime.calibration import collect_statistics

    model, spec, inputs = build(args)
    if args.calib:
        batches = load_calib(args.calib, inputs)
    else:
        if inputs is None:
            raise UsageError("sqnr needs --input-shape (for --random) or --calib FILE.pt")
        gen = torch.Generator().manual_seed(1)
        batches = [tuple(torch.randn(x.shape, generator=gen).to(x.dtype)
                         if x.dtype.is_floating_point  # integers (token ids): 0 or 1
                         else torch.randint(0, 2, x.shape, generator=gen, dtype=x.dtype)
                         for x in inputs)  # shaped as --input-shape's example inputs
                   for _ in range(args.random)]
    # Per-layer error does not depend on how stages split the graph: measure unsplit.
    drawn_spec, spec = spec, spec.model_copy(update={"pipeline": None})
    try:
        gm = qc.qcompile(model, spec, inputs or batches[0])
    except QCompileError as e:
        if inputs is not None or not e.message.startswith("running node"):
            raise
        # the first --calib batch was the example input, and the model cannot run it
        raise UsageError(f"--calib {args.calib}: batch 0 does not fit the model: "
                         f"{e.message.splitlines()[0]}") from e
    if qc.quantizers(gm):  # qparams from these batches, whatever the mode (QAT too)
        try:
            collect_statistics(gm, batches)
        except QCompileError as e:
            if not args.calib:
                raise
            raise UsageError(f"--calib {args.calib}: {e.message.splitlines()[0]}") from e
    qc.freeze(gm)
    gm.eval()
    rows = qc.sqnr(gm, model, batches)  # measures a copy of the model, in eval mode
    text = table([{**r, "sqnr_db": f"{r['sqnr_db']:.2f}"} for r in rows], ["node", "sqnr_db"])
    data: dict[str, Any] = {"layers": rows, "batches": len(batches)}
    if args.graph:  # the picture, each measured layer coloured by its SQNR
        shown = gm  # the stages the spec asks for, when it asks for some
        if drawn_spec.pipeline is not None:
            shown = qc.qcompile(model, drawn_spec, inputs or batches[0])
        files, drawn = write_picture(args, node_rows(shown, drawn_spec), shown, summary(shown),
                                     sqnr={r["node"]: r["sqnr_db"] for r in rows})
        data.update(files=files, picture=drawn)
    emit(args, data, text if rows else "no quantized activations")
    return 0


# -- search: the report of qc.search(..., details=True) ---------------------------------------
PLOT_SUFFIXES = (".svg", ".png")
SAME_BITS = 0.005  # a measured point within this many avg bits of a Pareto point is that point


def load_search_details(path: str) -> Any:
    """``SearchDetails`` from a JSON file (``details.model_dump_json()``); a missing file
    is a usage error, a file that is not one a ``QCompileError`` naming the field."""
    from pydantic import ValidationError

    from qcompile.mixed_precision import SearchDetails

    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file (the JSON of qc.search(..., details=True)[1])")
    fix = ("write it with Path(p).write_text(details.model_dump_json()) from spec, details "
           "= qc.search(..., details=True)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QCompileError(f"{path}: not UTF-8 text (byte {e.start}), so not a search "
                            "report (a JSON file)", fix=fix) from None
    try:
        return SearchDetails.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "(top level)"
        raise QCompileError(f"{path}: not a search report: {where}: {first['msg']}",
                            fix=fix) from None


def load_measured(path: str) -> tuple[str, dict[float, float]]:
    """``--measured``: a JSON object mapping average weight bits to the measured metric
    (``{"4.0": 6.12, "4.5": 5.80}``), or ``{"metric": NAME, "values": {...}}`` naming it
    (``qcompile-bench search`` writes that form). Returns (metric name, bits -> value)."""
    import json

    fix = ('write {"metric": "perplexity", "values": {"4.0": 6.1, "8.0": 5.2}}: '
           "average weight bits -> the metric measured at them")
    if not Path(path).is_file():
        raise UsageError(f"--measured {path}: no such file")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:
        raise QCompileError(f"--measured {path}: not JSON ({e})", fix=fix) from None
    name = "measured"
    if isinstance(data, dict) and "values" in data:
        name = str(data.get("metric") or name)
        data = data["values"]
    if not isinstance(data, dict) or not data:
        raise QCompileError(f"--measured {path}: expected a non-empty JSON object", fix=fix)
    values: dict[float, float] = {}
    for key, value in data.items():
        try:
            bits = float(key)
            values[bits] = float(value)
        except (TypeError, ValueError):
            raise QCompileError(f"--measured {path}: entry {key!r}: {value!r} is not "
                                "average bits -> a number", fix=fix) from None
    return name, values


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.4g}"


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def pareto_rows(details: Any, measured: dict[float, float]) -> list[dict[str, Any]]:
    """The Pareto table: one row per distinct point the solver found (fewest bits first)
    and the chosen point, the groups at each candidate, the measured metric where one was
    measured at those bits (measured points matching no point get rows of their own,
    predicted left empty)."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[float, int]] = set()
    for p in sorted(details.pareto, key=lambda p: (p.avg_weight_bits, p.predicted_error)):
        key = (round(p.avg_weight_bits, 6), p.weight_bytes)
        if key in seen:  # budgets between two steps of the front give the same point
            continue
        seen.add(key)
        counts = [sum(1 for c in p.chosen.values() if c == i)
                  for i in range(len(details.candidates))]
        rows.append({"avg_weight_bits": p.avg_weight_bits, "weight_bytes": p.weight_bytes,
                     "predicted_error": p.predicted_error, "measured": None,
                     "groups_per_candidate": counts,
                     "chosen": abs(p.avg_weight_bits - details.avg_weight_bits) < 1e-9
                     and p.weight_bytes == details.weight_bytes})
    if not any(r["chosen"] for r in rows):  # the budget fell between the front's budgets
        rows.append({"avg_weight_bits": details.avg_weight_bits,
                     "weight_bytes": details.weight_bytes,
                     "predicted_error": details.predicted_error, "measured": None,
                     "groups_per_candidate": [
                         sum(1 for c in details.chosen.values() if c == i)
                         for i in range(len(details.candidates))], "chosen": True})
    for bits, value in sorted(measured.items()):
        row = min(rows, key=lambda r: abs(r["avg_weight_bits"] - bits), default=None)
        if row is not None and abs(row["avg_weight_bits"] - bits) <= SAME_BITS \
                and row["measured"] is None:
            row["measured"] = value
        else:
            rows.append({"avg_weight_bits": bits, "weight_bytes": None, "predicted_error": None,
                         "measured": value, "groups_per_candidate": None, "chosen": False})
    rows.sort(key=lambda r: r["avg_weight_bits"])
    return rows


def group_rows(details: Any) -> list[dict[str, Any]]:
    """One row per group: its layers, parameters, chosen candidate and score per candidate."""
    rows = []
    for g in details.groups:
        i = details.chosen.get(g.name)
        rows.append({"group": g.name, "layers": g.layers, "parameters": g.parameters,
                     "chosen": details.candidates[i] if i is not None else None,
                     "chosen_index": i, "scores": g.scores, "sqnr_db": g.sqnr_db})
    return rows


def plot_pareto(details: Any, rows: list[dict[str, Any]], measured_name: str,
                path: Path) -> None:
    """Budget (average weight bits) vs predicted error, and the measured metric on a second
    axis; the chosen point starred. SVG or PNG by ``path``'s suffix, drawn with matplotlib's
    object API (no pyplot, no global backend), written atomically."""
    try:
        from matplotlib import rc_context
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise QCompileError("--plot needs matplotlib, which is not installed",
                            fix="pip install matplotlib (or leave out --plot: the table "
                            "needs nothing)") from None
    predicted = [r for r in rows if r["predicted_error"] is not None]
    measured = [r for r in rows if r["measured"] is not None]
    with rc_context({"svg.hashsalt": "qcompile", "svg.fonttype": "none"}):
        fig = Figure(figsize=(6.4, 4.0))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot([r["avg_weight_bits"] for r in predicted],
                [r["predicted_error"] for r in predicted], "o-", color="#2563eb",
                label=f"predicted ({details.metric})")
        ax.plot([details.avg_weight_bits], [details.predicted_error], "*", color="#dc2626",
                markersize=14, label="chosen")
        ax.set_xlabel("average weight bits (budget)")
        ax.set_ylabel(f"predicted error ({details.metric}, lower is better)")
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if measured:
            ax2 = ax.twinx()
            ax2.plot([r["avg_weight_bits"] for r in measured], [r["measured"] for r in measured],
                     "s--", color="#16a34a", label=f"measured ({measured_name})")
            ax2.set_ylabel(f"measured {measured_name}")
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, loc="upper right", fontsize=8)
        budget = ", ".join(f"{k} {v}" for k, v in details.budget.items())
        ax.set_title(f"qc.search Pareto front: {details.metric}, {details.granularity}, "
                     f"budget {budget}", fontsize=10)
        fig.tight_layout()
        fmt = path.suffix.lstrip(".")
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt,
                        metadata={"Date": None} if fmt == "svg" else {"Software": None})


def cmd_search(args: argparse.Namespace) -> int:
    details = load_search_details(args.details)
    plot = Path(args.plot) if args.plot else None
    if plot is not None:  # before any work
        if plot.suffix.lower() not in PLOT_SUFFIXES:
            raise UsageError(f"--plot {plot}: the suffix says the format: .svg or .png")
        if not plot.parent.is_dir():
            raise QCompileError(f"--plot {plot}: the folder {plot.parent} does not exist",
                                fix="create the folder first, or give --plot a path in an "
                                "existing folder")
    measured_name, measured = (load_measured(args.measured) if args.measured
                               else ("measured", {}))
    rows = pareto_rows(details, measured)
    groups = group_rows(details)
    if plot is not None:
        plot_pareto(details, rows, measured_name, plot)
        note(f"wrote {plot}")
    budget = ", ".join(f"{k} {v}" for k, v in details.budget.items())
    data: dict[str, Any] = {
        "details": args.details, "metric": details.metric,
        "granularity": details.granularity, "budget": details.budget,
        "candidates": [{"label": c, "bits": b} for c, b in zip(details.candidates,
                                                                details.bits)],
        "chosen": {"avg_weight_bits": details.avg_weight_bits,
                   "weight_bytes": details.weight_bytes,
                   "predicted_error": details.predicted_error},
        "seconds": details.seconds, "batches": details.batches, "ranks": details.ranks,
        "measured_metric": measured_name if measured else None,
        "pareto": rows, "groups": groups, "files": [str(plot)] if plot else []}
    cands = details.candidates
    table_rows = []
    for r in rows:
        row = {"": "*" if r["chosen"] else "", "avg_bits": f"{r['avg_weight_bits']:.3f}",
               "weight_MB": _mb(r["weight_bytes"]) if r["weight_bytes"] is not None else "",
               "predicted": _num(r["predicted_error"]),
               measured_name: _num(r["measured"])}
        for c, n in zip(cands, r["groups_per_candidate"] or [None] * len(cands)):
            row[c] = "" if n is None else str(n)
        table_rows.append(row)
    columns = ["", "avg_bits", "weight_MB", "predicted",
               *([measured_name] if measured else []), *cands]
    group_table = []
    for g in groups:
        row = {"group": g["group"], "params": str(g["parameters"]),
               "chosen": g["chosen"] or ""}
        for i, c in enumerate(cands):
            row[c] = _num(g["scores"][i]) if i < len(g["scores"]) else ""
            if g["sqnr_db"] is not None:
                row[f"dB {c}"] = _num(g["sqnr_db"][i]) if i < len(g["sqnr_db"]) else ""
        group_table.append(row)
    gcols = ["group", "params", "chosen", *cands]
    if any(g["sqnr_db"] is not None for g in groups):
        gcols += [f"dB {c}" for c in cands]
    seconds = ", ".join(f"{k} {v:.3g} s" for k, v in details.seconds.items())
    text = [f"search: metric {details.metric}, granularity {details.granularity}, "
            f"budget {budget}; {len(details.groups)} group(s), {details.batches} batch(es), "
            f"{details.ranks} rank(s); {seconds}",
            "candidates: " + ", ".join(f"{c} ({b:g} bits)" for c, b in zip(cands, details.bits)),
            f"chosen: {details.avg_weight_bits:.3f} avg weight bits, "
            f"{_mb(details.weight_bytes)} MB, predicted error {details.predicted_error:.4g}",
            "", "Pareto front (budget vs error; groups per candidate; * the chosen point):",
            table(table_rows, columns), "",
            f"chosen candidate per group (scores: predicted error, {details.metric}):",
            table(group_table, gcols)]
    emit(args, data, "\n".join(text))
    return 0

# -- the command line ------------------------------------------------------------------------
def _positive(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the error into a usage message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="spec file (.yaml/.json) or preset name")
    p.add_argument("--model", required=True, help="package.module:factory or file.py:factory")
    p.add_argument("--input-shape", action="append", default=[],
                   help="example input shape like 1x3x32x32 (repeat for several inputs)")
    p.add_argument("--dtype", default="float32", help="example input dtype (float32)")


def _picture_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", choices=["dot", "svg", "html"],
                   help="also write a picture: svg, an interactive html page, or dot")
    p.add_argument("--out", help="picture file name (default qcompile-graph.<kind>)")
    p.add_argument("--layout", choices=["auto", "python", "dot"], default="auto",
                   help="svg layout: python (built in), dot (Graphviz), auto (dot when "
                   "installed, else python; html always uses python)")
    p.add_argument("--depth", default="auto",
                   help="collapse modules deeper than N into boxes: N >= 1, full, or auto "
                   "(the most detail that keeps the picture under 60 boxes)")
    p.add_argument("--focus", help="expand one module subtree fully (e.g. layers.3)")
    p.add_argument("--color", choices=["auto", "kind", "sqnr", "bits"], default="auto",
                   help="fill nodes by kind, by SQNR (sqnr only), or by the weight's bits "
                   "(bits: int4 vs int8 layers, with a legend); auto: SQNR when measured")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="qcompile-inspect",
                                   description="Inspect what qcompile does to a model.")
    root.add_argument("--version", action="version", version=f"qcompile-inspect {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--format", choices=["text", "json"], default="text")
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = root.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", parents=[common], help="validate a spec (no torch)")
    p.add_argument("spec")
    p.set_defaults(fn=cmd_validate)
    p = sub.add_parser("schema", parents=[common], help="print the spec's JSON schema")
    p.set_defaults(fn=cmd_schema)
    p = sub.add_parser("show", parents=[common], help="the compiled graph as a table")
    _model_args(p)
    _picture_args(p)
    p.add_argument("--world", type=_positive, metavar="N",
                   help="also lay the spec out on N ranks: the mesh (pp x dp x tp), each "
                   "rank's coordinates, stage and parameters held (with --graph svg|html, a "
                   "picture of it: <out stem>-mesh.svg)")
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("explain", parents=[common], help="which rule matched what, and why")
    _model_args(p)
    p.add_argument("--node", help="explain one node: every rule and why it (did not) match")
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("passes", parents=[common], help="per-pass graph dumps")
    _model_args(p)
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--diff", help="what one pass added and removed")
    p.add_argument("--convert", action="store_true",
                   help="also convert (qc.convert, after calibrating static/QAT graphs on "
                   "random batches of --input-shape) and dump each conversion step")
    p.set_defaults(fn=cmd_passes)
    p = sub.add_parser("sqnr", parents=[common], help="per-layer SQNR, worst first")
    _model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--calib", help="a .pt file: a list of input tuples (or tensors)")
    src.add_argument("--random", type=_positive, default=4,
                     help="N random batches (default 4, at least 1)")
    _picture_args(p)
    p.set_defaults(fn=cmd_sqnr)
    p = sub.add_parser("search", parents=[common],
                       help="the Pareto table (and plot) of a qc.search report")
    p.add_argument("details", help="JSON of qc.search(..., details=True)[1] "
                   "(details.model_dump_json())")
    p.add_argument("--measured", help="JSON mapping average weight bits to a measured "
                   'metric, e.g. {"metric": "perplexity", "values": {"4.0": 6.1}}')
    p.add_argument("--plot", help="draw budget vs predicted (and measured) error to "
                   "FILE.svg or FILE.png (needs matplotlib)")
    p.add_argument("--json", dest="format", action="store_const", const="json",
                   help="print JSON (= --format json)")
    p.set_defaults(fn=cmd_search)
    return root


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version exit 0, usage errors 2
        return int(e.code or 0)
    try:
        return args.fn(args)
    except UsageError as e:
        note(f"usage error: {e}")
        return 2
    except QCompileError as e:
        if args.debug:
            traceback.print_exc()
        note(f"error: {e.message}")
        if e.fix:
            note(f"  fix: {e.fix}")
        return 1
    except Exception as e:  # a user mistake surfacing as something else: one line, exit 1
        if args.debug:
            traceback.print_exc()
        else:
            with contextlib.suppress(Exception):
                from pydantic import ValidationError

                if isinstance(e, ValidationError):
                    first = e.errors()[0]
                    note(f"error: invalid spec: {'.'.join(map(str, first['loc']))}: "
                         f"{first['msg']}")
                    return 1
            note(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            note("  (run with --debug for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
