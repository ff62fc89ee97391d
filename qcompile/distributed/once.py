"""Quantize once and share the result with every rank (``qc.distributed.compile_once``).

Without a process group it is compile (+ calibrate, + cache) in one process.

Example:
    >>> import torch, qcompile as qc
    >>> from qcompile.distributed.once import compile_once
    >>> gm = compile_once(lambda: torch.nn.Linear(4, 4), "int8-static", (torch.randn(2, 4),),
    ...                   calibration=[torch.randn(2, 4) for _ in range(2)])
    >>> all(q.enabled and not q.observe for q in qc.quantizers(gm).values())
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qcompile.distributed.cache import CompileCache, cache_key, misfit
from qcompile.distributed.data_parallel import initialised, watch_observer_sync
from qcompile.distributed.devices import collective_device, staged
from qcompile.distributed.guards import refuse_wrapped, unwrap_compiled
from qcompile.graph.records import report
from qcompile.passes import as_inputs, compile_model
from qcompile.runtime.calibration import check_calibratable, collect_statistics
from qcompile.specs import as_spec


def compile_once(build_model: Any, spec: Any, example_inputs: Any = None, *,
                 example_kwargs: dict[str, Any] | None = None,
                 calibration: Any = None, cache_dir: str | None = None,
                 group: Any = None) -> nn.Module:
    """Quantize once, share with every rank.

    Rank 0 builds the model, compiles it and (with ``calibration`` batches) calibrates it
    — or loads the result from the compile cache (``cache_dir``, or ``spec.cache_dir``).
    The other ranks build the model on the meta device (no memory), compile that, allocate
    the compiled graph once and receive every parameter and buffer from rank 0. All ranks
    end with bit-identical graphs; no rank but 0 ever holds the float model.
    Tensors travel on the backend's device (``collective_device``: the rank's GPU for
    NCCL, so call ``torch.cuda.set_device`` first; CPU for gloo), one at a time, and land
    in the graph on CPU: move it with ``.to(device)`` afterwards.
    Without a process group this is compile (+ calibrate, + cache) in one process.
    """
    spec = as_spec(spec)
    directory = cache_dir or spec.cache_dir
    rank = torch.distributed.get_rank(group) if initialised() else 0
    inputs = as_inputs(example_inputs)
    if rank == 0:
        model, note = unwrap_compiled(build_model())
        refuse_wrapped(model)
        key = None
        batches = list(calibration) if calibration is not None else None
        # The model was built here for this graph alone: no copy needed.
        gm = compile_model(model, spec, inputs, example_kwargs=example_kwargs, inplace=True)
        state, why = None, "no cache_dir"
        if directory is not None:
            # The compiled graph's own tensors (tensor constants included), before
            # calibration; where the cache lives is not part of what is cached.
            key = cache_key(gm.code, spec.model_dump_json(exclude={"cache_dir"}), gm, batches)
            state, why = CompileCache(directory).load(key)
            if state is not None and (bad := misfit(state, gm)) is not None:
                state, why = None, f"entry {bad}; rebuilt"
        if state is not None:
            gm.load_state_dict(state)
        else:
            if batches is not None:  # rank 0 alone: no cross-rank sync to wait for
                check_calibratable(report(gm).mode)
                collect_statistics(gm, batches)
            if directory is not None:
                CompileCache(directory).store(key, gm, report(gm).model_dump_json())
        report(gm).passes[-1].notes.append(f"compile cache: {why}")
        del model
    else:
        meta = torch.device("meta")
        with meta:
            model, note = unwrap_compiled(build_model())

        def to_meta(v: Any) -> Any:
            return v.to(meta) if isinstance(v, torch.Tensor) else v

        meta_inputs = tuple(to_meta(v) for v in inputs) if inputs is not None else None
        meta_kwargs = {k: to_meta(v) for k, v in (example_kwargs or {}).items()} or None
        gm = compile_model(model, spec, meta_inputs, example_kwargs=meta_kwargs, inplace=True)
        gm = gm.to_empty(device="cpu")
    if note is not None:
        report(gm).passes[0].notes.append(note)
    if initialised():
        tensors = [t for _, t in sorted([*gm.named_parameters(remove_duplicate=True),
                                         *gm.named_buffers(remove_duplicate=True)],
                                        key=lambda kv: kv[0])]
        src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
        device = collective_device(group)
        with torch.no_grad():
            for t in tensors:
                buffer = staged(t.data, device)  # NCCL sends CUDA tensors only
                torch.distributed.broadcast(buffer, src=src, group=group)
                if buffer is not t.data and rank != 0:
                    t.data.copy_(buffer)
        gm.load_state_dict(gm.state_dict())  # quantizer on/off flags follow their buffers
    return watch_observer_sync(gm)
