"""Working with a compiled graph: its report, its quantizers, freezing and calibration.

Example:
    >>> import torch, qcompile as qc
    >>> gm = qc.qcompile(torch.nn.Linear(4, 4), "int8-static", example_inputs=(torch.randn(2, 4),))
    >>> gm = qc.calibrate(gm, [(torch.randn(2, 4),) for _ in range(3)])
    >>> all(q.enabled and not q.observe for q in qc.quantizers(gm).values())
    True
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from qcompile.distributed.agree import (
    MODEL_FIX,
    agree,
    calibration_fingerprint,
    collective_phase,
    unchanged_on_failure,
)
from qcompile.distributed.convert import (
    data_parallel_layout,
    shard_converted,
    shard_over_dp,
    store_sharded_layers,
    tp_refusal,
)
from qcompile.distributed.data_parallel import (
    RankSync,
    apply_registered,
    reduce_observers,
    several_ranks,
    sum_across_ranks,
)
from qcompile.distributed.guards import data_parallel_inner
from qcompile.errors import QCompileError
from qcompile.graph.algorithms import pending, refuse_pending, run_pending
from qcompile.graph.layerwise import BatchFailed
from qcompile.graph.meta import (
    FIXED_GRID_KEY,
    PIPELINE_KEY,
    REPORT_KEY,
    SPEC_KEY,
    STAGE_NAMES_KEY,
    SYNC_OBSERVERS_KEY,
    TP_SHARDED_KEY,
)
from qcompile.graph.pipeline import Instrument
from qcompile.graph.records import Report, report
from qcompile.graph.signature import graph_inputs
from qcompile.passes import DATA_ALGORITHMS
from qcompile.passes.convert import convert_graph, torch_deprecations_silenced
from qcompile.passes.convert.sharded import data_parallel_whole_copy, local_rows_copy, refusal
from qcompile.runtime.calibration import (
    RankCombine,
    call_args,
    check_calibratable,
    collect_statistics,
    describe,
    distributed_failure,
    misfit,
    model_weights,
    quantizers,
    quiet_fx_trace,
    refuse_nonfinite,
    uncalibrated,
    weight_quantizers,
)
from qcompile.runtime.calibration import freeze as freeze_observers
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.sharded import fsdp_units, on_tp_mesh

__all__ = ["Report", "calibrate", "convert", "freeze", "quantizers", "report",
           "weight_quantizers"]


def freeze(gm: nn.Module) -> nn.Module:
    """Stop observers: qparams stay as they are (``observe=False`` on every quantizer).

    The statistics of the last optimizer step (``quant.observer_update: step``) are applied
    first, across the data-parallel group ``qc.distributed.wrap`` registered (call it on
    every rank then); weight quantizers still tracking their weights (QAT) take the
    current weights' ranges, as their next forward would (torch.ao's convert likewise
    observes the final weights). Under tensor parallelism each takes the whole weight's
    range from the shards (a reduction across tp; under FSDP2 each block gathered over dp
    while it is read): call it on every rank.

    Example:
        >>> import torch, qcompile as qc
        >>> gm = qc.qcompile(torch.nn.Linear(4, 4), "int8-qat", (torch.randn(2, 4),))
        >>> all(not q.observe for q in qc.freeze(gm).modules()
        ...     if isinstance(q, qc.FakeQuantize))
        True
    """
    _refuse_uncompiled(gm, "freeze")
    for m in gm.modules():
        if isinstance(m, GraphModule):
            apply_registered(m)
    return freeze_observers(gm)


def _compiled(gm: nn.Module) -> bool:
    """Whether ``gm`` holds a graph ``qcompile`` returned (its report), or quantizers."""
    return any((isinstance(getattr(m, "meta", None), dict) and REPORT_KEY in m.meta)
               or isinstance(m, FakeQuantize) for m in gm.modules())


def _refuse_uncompiled(gm: Any, what: str) -> None:
    """A ``QCompileError`` naming ``what`` when ``gm`` is not a module holding a compiled
    graph: a float model passed where the graph belongs would otherwise be returned as it
    is (``freeze``) or fail deep inside (``calibrate``)."""
    if not isinstance(gm, nn.Module):
        raise QCompileError(f"{what} takes the graph qc.qcompile returned, got "
                            f"{type(gm).__name__}",
                            fix="pass gm = qc.qcompile(model, spec, example_inputs=...)")
    if not _compiled(data_parallel_inner(gm)):
        raise QCompileError(f"{what}: {type(gm).__name__} was not compiled by qcompile (it "
                            "holds no qcompile report and no quantizers)",
                            fix=f"compile it first: gm = qc.qcompile(model, spec, "
                                f"example_inputs=...), then qc.{what}(gm, ...)")


def converted(gm: nn.Module) -> bool:
    """Whether ``gm`` is ``qc.convert``'s result (its report lists conversion passes)."""
    meta = getattr(gm, "meta", None)
    rep = meta.get(REPORT_KEY) if isinstance(meta, dict) else None
    return rep is not None and any(p.name.startswith("convert.") for p in rep.passes)


def _mode(gm: nn.Module) -> str | None:
    meta = getattr(gm, "meta", None)
    rep = meta.get(REPORT_KEY) if isinstance(meta, dict) else None
    return rep.mode if rep is not None else None


def calibrate(gm: nn.Module, batches: Iterable[Any], *, sync: bool | None = None,
              progress: bool = True, inputs: Callable[[Any], Any] | None = None) -> nn.Module:
    """Static PTQ: run ``batches`` (tuples of positional inputs, dicts of keyword inputs,
    or single tensors) through ``gm`` with observers on, then freeze qparams and turn
    fake-quant on. ``inputs`` maps each batch to those first: ``inputs=lambda b: b[0]``
    calibrates on a DataLoader of ``(x, y)`` pairs. A batch that does not fit the graph is
    a ``QCompileError`` naming it, and the quantizers stay as they were. With a process group
    and ``quant.sync_observers`` (or ``sync=True``) the statistics are reduced across
    ranks at the end, so every rank must call it; ``sync=False`` keeps them local.
    ``progress`` shows a tqdm bar when stderr is a terminal.

    The data-driven entries of ``quant.algorithms`` (``gptq``, ``adaround``,
    ``bias_correction``) run first, in the spec's order, on the same batches (held in a
    list meanwhile); then the observers see the final weights. A dynamic graph is
    calibrated only for those. Otherwise only static graphs are calibrated: QAT graphs learn
    their ranges while training and dynamic graphs compute activation qparams from every
    batch.

    A graph wrapped by ``qc.distributed.wrap`` calibrates as the graph it wraps (DDP's
    ``.module``; a ``fully_shard``-ed graph is the graph) and comes back as it was given.
    Synchronising ranks first agree on the call, the spec, the graph and its tensors' shapes
    (and, for a sharded graph, on the batch count and shapes), and a batch refused on one
    rank is refused on every rank: a mistake on one rank, another model there, or a
    calibration on some ranks only, is the same ``QCompileError`` everywhere, never a
    hang."""
    _refuse_uncompiled(gm, "calibrate")
    wrapped, gm = gm, data_parallel_inner(gm)
    if converted(gm):
        raise QCompileError("calibrate: this graph is qc.convert's result (integer kernels): "
                            "it has no observers left to calibrate",
                            fix="calibrate the fake-quant graph qc.qcompile returned, then "
                                "convert it again")
    todo = pending(gm)
    mode = _mode(gm)
    if not todo or mode != "dynamic":
        check_calibratable(mode)
    if sync is None:
        sync = bool(getattr(gm, "meta", {}).get(SYNC_OBSERVERS_KEY, False))
    signature = graph_inputs(gm)
    sharded = sharded_by(gm) is not None
    # histogram-based observers (and enabled quantizers) combine each batch across the
    # ranks inside the forward: then, as for a sharded graph, every forward is collective
    combine = RankCombine(RankSync()) if sync and several_ranks() else None
    in_forward = combine is not None and RankCombine.in_forward(gm)
    if sync:  # before the first collective: a mismatch is one clear error on every rank
        fingerprint, batches = calibration_fingerprint(gm, batches,
                                                       sharded=sharded or in_forward)
        agree("calibrate", fingerprint, fixes={"graph": MODEL_FIX, "tensors": MODEL_FIX})
    if todo:  # the data-driven quant.algorithms first: the observers see the final weights
        shard = sharded_by(gm)
        if shard is not None:
            raise QCompileError(
                f"calibrate: {shard}, and quant.algorithms[{todo[0]}] rewrites whole weights "
                "from calibration data", fix="run qc.calibrate on the graph before sharding it "
                "(every rank, with its own batches: the statistics are summed across ranks)")
        refuse_nonfinite(model_weights(gm), "calibrate")  # before any algorithm reads them
        batches = list(batches)
        calls = call_args(batches, inputs, signature)
        if not calls:
            raise QCompileError("calibrate: no batches were given",
                                fix="pass a non-empty iterable")
        try:
            run_pending(gm, calls, DATA_ALGORITHMS, progress=progress,
                        reduce=sum_across_ranks if sync else None)
        except BatchFailed as e:
            cause = e.__cause__ or e
            if isinstance(cause, QCompileError) or distributed_failure(cause):
                raise cause from None
            raise misfit(cause, e.index, *calls[e.index], signature) from cause
        if mode == "dynamic":
            return wrapped  # activation qparams come from every batch: nothing to observe
    fixed = gm.meta.get(FIXED_GRID_KEY, ())
    if not sync:
        collect_statistics(gm, batches, progress=progress, inputs=inputs,
                           signature=signature, fixed=fixed)
        return wrapped
    # every rank learns whether any rank's batches were refused before the observers are
    # reduced (one collective, not one per batch); then every rank ends with the same
    # qparams, those of one process observing the global batches (RankCombine: moving
    # averages fold each batch's global range, histograms the global histogram).
    # A sharded graph's forwards are collectives themselves (its batches were agreed above),
    # and so are those of a graph combining in its forwards: a phase check meeting a peer's
    # forward would mix two collectives, so they have none.
    with unchanged_on_failure(gm):
        with collective_phase("calibrate", enabled=not (sharded or in_forward)):
            collect_statistics(gm, batches, progress=progress, inputs=inputs,
                               signature=signature, fixed=fixed, combine=combine)
        if combine is not None:
            combine.fold()  # the moving averages' batch ranges, unless folded per batch
        # (agreed above: no second check)
        reduce_observers(gm, everything=True,
                         skip=combine.quantizers if combine is not None else ())
    return wrapped


def _outputs(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


_SHARDED_CLASSES = ("FSDPModule", "FullyShardedDataParallel")
_GATHER_RECIPE = (
    "gather the full state and convert an unsharded copy on rank 0:\n"
    "    from torch.distributed.checkpoint.state_dict import StateDictOptions, "
    "get_model_state_dict\n"
    "    sd = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, "
    "cpu_offload=True))  # every rank\n"
    "    if rank == 0: gm = qc.qcompile(model, spec, example_inputs=(x,)); "
    "gm.load_state_dict(sd); int8 = qc.convert(gm)\n"
    "    (a graph from qc.distributed.compile_once keeps the model's names: gather it with "
    "sd = {k: v.full_tensor() if hasattr(v, 'full_tensor') else v for k, v in "
    "sharded.state_dict().items()})")


def sharded_by(gm: nn.Module) -> str | None:
    """What shards ``gm`` (FSDP2 ``fully_shard``, FSDP1, or DTensor parameters), or None.
    Duck-typed: this layer does not import torch.distributed."""
    for name, m in gm.named_modules():
        for cls in type(m).__mro__:
            if cls.__name__ in _SHARDED_CLASSES or cls.__module__.startswith(
                    "torch.distributed.fsdp"):
                where = f"module {name!r}" if name else "the graph"
                return f"{where} is a {cls.__name__} (torch.distributed.fsdp)"
    for name, p in gm.named_parameters():
        if any(c.__name__ == "DTensor" for c in type(p.data).__mro__ + type(p).__mro__):
            return f"parameter {name!r} is a sharded DTensor"
    return None


def _refuse_ggml(gm: nn.Module) -> None:
    """llama.cpp's grids run in llama.cpp: qcompile has no kernel that reads them."""
    from qcompile.runtime.block_formats import GGML_FORMATS
    from qcompile.runtime.fake_quant import FakeQuantize

    for name, m in gm.named_modules():
        if isinstance(m, FakeQuantize) and m.block_format in GGML_FORMATS:
            raise QCompileError(
                f"convert: quantizer {name!r} uses llama.cpp's {m.block_format} grid, which "
                "qcompile's integer kernels do not run",
                fix="write the model for llama.cpp with qc.export_gguf(gm, path); or "
                    "compile with an int8 / int4 / block-format preset to convert")


def convert(gm: nn.Module, example_inputs: tuple[Any, ...] | None = None, *,
            instruments: Sequence[Instrument] = ()) -> nn.Module:
    """Lower a calibrated static, trained QAT or dynamic graph to integer kernels for
    inference (see ``qcompile.passes.convert``); ``gm`` is left as it is. With
    ``example_inputs``, both graphs run them and ``report(result).max_deviation`` records
    the largest difference per output, also in steps of the output's quantizer.

    The result is in eval mode and for inference (quantized kernels have no autograd).
    ``report(result).conversions`` says what each quantized node became and why;
    ``report(result).passes`` continues the compile passes with one record per conversion
    step (``convert.<step>``; ``convert.stage_<i>.<step>`` per stage of a pipeline-placed
    graph). ``instruments`` (e.g. ``GraphDumps``) see every conversion step, numbered after
    the compile passes, and ``finish`` with the result's report.

    Memory: the copy shares ``gm``'s float weights (they are only read) and each weight
    becomes integers one layer at a time (stored in the smallest integer type its grid
    fits), so the peak is about ``gm`` plus the result plus one layer.

    A graph sharded by FSDP2 (``fully_shard``, e.g. ``qc.distributed.compile_once`` with
    ``data_parallel: fsdp2``) converts per rank (call it on every rank): each rank turns
    its own rows of every weight into integers, and the result is ``fully_shard``-ed the
    same way, its integer weights sharded, so no rank ever holds the whole model (every
    weight is stored as integers, ``int_storage``: torch's packed kernels cannot be
    sharded). ``fully_shard(qc.convert(gm))`` of an unsharded graph shards the integer
    weights too. What a rank cannot convert from its own rows (FSDP1, learnable scales,
    block-format weights, weight quantizers still observing, per-group weights quantized
    transposed, layouts other than rows on a 1-D mesh) is refused with the recipe: gather
    the full state with ``get_model_state_dict(..., options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))`` on every rank, then convert an unsharded compile on rank 0.

    A graph ``qc.distributed.wrap`` sharded across tensor-parallel ranks converts per rank
    too (call it on every rank): each sharded Linear stores this rank's shard of its weight
    in its grid (integer codes with their scales, or a block format's codes and scales:
    ``FrozenWeight`` storage whose tensors are DTensors sharded as the weight was) and
    dequantizes it for its matmul at each forward, its input quantizer frozen; a mixture's
    experts sharded by expert store each rank's experts the same way (``StoredRows``); the
    rest of the graph converts as above. The sharded layers compute what they computed in
    the trained graph, exactly. Under FSDP2 (dp x tp) each rank gathers its tp shards over
    dp first, one block at a time, and the result is ``fully_shard``-ed over dp as the
    graph was: each rank holds 1/(T x D) of the stored weights. Pipeline stages sharded
    that way are refused with the recipe.

    A graph whose stages ``qc.distributed.pipeline`` spread over ranks (pp, pp x dp with
    DDP) converts on every rank (call it on every rank): each stage's trained state first
    reaches the other ranks' copies of that stage (``qcompile.deploy.stages.share_stages``),
    and every rank returns the whole converted model.

    Example:
        >>> import torch, qcompile as qc
        >>> m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        >>> x = torch.randn(8, 16)
        >>> gm = qc.qcompile(m, "int8-dynamic", example_inputs=(x,))
        >>> int8 = qc.convert(gm, example_inputs=(x,))
        >>> [c.op for c in qc.report(int8).conversions]
        ['quantized::linear_dynamic']
    """

    from qcompile.deploy.adapters import refuse_adapters
    from qcompile.deploy.stages import refuse_sharded_stage, spread
    from qcompile.deploy.whole_graph import agree_and_share

    refuse_adapters(gm, "convert")  # lowering the base alone would drop the adapters
    _refuse_ggml(gm)
    tp = bool(getattr(gm, "meta", {}).get(TP_SHARDED_KEY)) or on_tp_mesh(gm)
    dp = None  # dp x tp under FSDP2: (the dp mesh, the modules it shards)
    if tp:
        why = tp_refusal(gm)
        if why is not None:
            raise QCompileError("convert: this graph's layers are sharded across "
                                f"tensor-parallel ranks, and {why}", fix=_GATHER_RECIPE)
    # a pipeline's stages trained on different ranks: every rank converts the whole model,
    # once each stage's trained state reached the others' copies (one sharded within each
    # rank's stage, tp or FSDP2, is refused with the recipe)
    refuse_sharded_stage(gm, "convert")
    staged = spread(gm) is not None
    if staged:
        agree_and_share(gm, gm, "convert", {"example_inputs": example_inputs is not None},
                        lambda: None)
    sharded = None if tp else sharded_by(gm)
    if sharded is not None:
        fsdp1 = any(c.__name__ == "FullyShardedDataParallel"
                    for m in gm.modules() for c in type(m).__mro__)
        why = "FSDP1 keeps flat parameters" if fsdp1 else refusal(gm)
        if why is not None:  # what a rank cannot convert from its own rows
            raise QCompileError(f"convert: {sharded}: a sharded graph converts per rank only "
                                f"when every rank can convert its own rows, and {why}",
                                fix=_GATHER_RECIPE)
    rep = report(gm)
    if converted(gm):
        raise QCompileError("convert: this graph is converted already (qc.convert's result: "
                            "integer kernels, no quantizers left)",
                            fix="convert the fake-quant graph qc.qcompile returned (after "
                                "qc.calibrate or training); the converted graph is for "
                                "inference as it is")
    if not quantizers(gm):
        raise QCompileError("convert: the graph has no quantizers (quant.mode "
                            f"{rep.mode!r})", fix="compile with quant.mode static, qat or "
                            "dynamic; a float graph needs no conversion")
    refuse_pending(gm, "convert")
    missing = uncalibrated(gm, rep.mode)
    if missing:
        fix = ("run qc.calibrate(gm, batches) first" if rep.mode == "static" else
               "train it for some steps first (observers learn ranges in train mode; a "
               "training step's observations take effect after optimizer.step(), or call "
               "qc.freeze(gm))")
        raise QCompileError(f"convert: {len(missing)} activation quantizer(s) have no "
                            f"ranges yet, e.g. {missing[0]}", fix=fix)
    rows = None
    if sharded is not None or tp:  # every rank converts its part, collectively
        agree("convert", {"graph": str(getattr(gm, "code", "")),
                          "example_inputs": example_inputs is not None})
    if sharded is not None:  # each rank converts its rows; the ranks shard the result
        rows = local_rows_copy(gm)
        weights = model_weights(rows.graph)
        refuse_nonfinite(weights, "convert")  # NaN weights make NaN integer weights
        out = rows.graph
    elif tp and fsdp_units(gm):  # FSDP2 over dp: each dp rank's tp shards
        dp = data_parallel_layout(gm)
        out = data_parallel_whole_copy(gm)  # its parameters are its own already
        refuse_nonfinite(model_weights(out), "convert")
        weights = {}
    else:
        weights = model_weights(gm)
        refuse_nonfinite(weights, "convert")  # NaN weights make NaN integer weights
        out = _sharing_copy(gm, weights)
    freeze(out)
    out.eval()
    ref = None
    if example_inputs is not None:
        try:
            with torch.no_grad(), quiet_fx_trace():  # our error below says what misfit
                # a sharded graph computes with all its rows only as itself (collectively)
                ref = _outputs((gm if rows is not None else out)(*example_inputs))
        except Exception as e:  # the user's inputs, not a bug of ours: say what misfit
            sig = graph_inputs(out)
            given = describe(tuple(example_inputs), {}, [i.name for i in sig])
            raise QCompileError(
                f"convert: example_inputs ({given}) do not fit the graph, compiled for "
                f"({', '.join(map(str, sig))}): {type(e).__name__}: "
                f"{(str(e).strip().splitlines() or [''])[0]}",
                fix="pass example inputs shaped like those the graph was compiled with, or "
                    "leave example_inputs out") from e
    stored = store_sharded_layers(out) if tp else []  # each rank stores its shards
    # a pipeline-placed graph: each stage_<i> child is a graph of its own
    targets = [("", out)] if STAGE_NAMES_KEY not in out.meta else [
        (f"{n}.", m) for n, m in out.named_children() if n.startswith("stage_")]
    steps = _output_steps(out)
    spec = out.meta.get(SPEC_KEY)
    new_report = rep.model_copy(deep=True)
    records = []
    for stage, target in targets:
        if isinstance(target, GraphModule):
            done, passes = convert_graph(target, spec, prefix=f"convert.{stage}",
                                         instruments=instruments,
                                         first_index=len(new_report.passes) + 1,
                                         rows_only=rows is not None)
            records += done
            new_report.passes += passes
    new_report.conversions = stored + records
    if rows is not None:
        out = shard_converted(out, rows.mesh, rows.units, rows.rank, rows.world, rows.cut)
    if dp is not None:  # the stored shards sharded over dp again, as the source's were
        out = shard_over_dp(out, *dp)
    if ref is not None:
        with torch.no_grad(), torch_deprecations_silenced():  # torch's quantized kernels run
            got = _outputs(out(*example_inputs))
        for i, (a, b) in enumerate(zip(got, ref)):
            if not (a.is_floating_point() and b.is_floating_point()):
                continue
            dev = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
            new_report.max_deviation[f"output{i}"] = dev
            if i < len(steps) and steps[i] is not None:
                new_report.max_deviation[f"output{i}_steps"] = dev / steps[i]
    if rows is None:
        _own_parameters(out, weights)
    if staged:  # the result is one whole model on every rank
        out.meta.pop(PIPELINE_KEY, None)
    out.meta[REPORT_KEY] = new_report
    for inst in instruments:
        inst.finish(new_report, out)
    return out


def _sharing_copy(gm: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A deep copy of ``gm`` that shares ``weights`` (its parameters outside quantizers)
    instead of copying them: the conversion only reads them, and a second float copy of
    the model would be most of convert's peak. Quantizers, buffers and the graph are
    copied (``freeze`` and the conversion steps change them)."""
    memo: dict[int, Any] = {id(p): p for p in weights.values()}
    with torch_deprecations_silenced():  # an exported graph's pytree LeafSpec (see there)
        return copy.deepcopy(gm, memo)


def _own_parameters(out: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """The float parameters the converted graph still reads (biases, norms, weights left
    in float) become its own, one at a time: the result shares nothing with ``gm``."""
    shared = {id(p) for p in weights.values()}
    with torch.no_grad():
        for module in out.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in shared:
                    module._parameters[name] = nn.Parameter(p.detach().clone(),
                                                            requires_grad=p.requires_grad)


def _output_steps(gm: nn.Module) -> list[float | None]:
    """Per graph output: the scale of the per-tensor quantizer that produces it, if any."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return []
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    steps: list[float | None] = []
    for node in torch.utils._pytree.tree_leaves(out_node.args[0]):
        m = gm.get_submodule(str(node.target)) if getattr(node, "op", "") == "call_module" \
            else None
        ok = isinstance(m, FakeQuantize) and m.granularity == "per_tensor" and not m.dynamic
        steps.append(float(m.scale[0].detach()) if ok else None)
    return steps
