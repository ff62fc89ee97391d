"""``qcompile(model, spec, example_inputs)``: trace, rewrite, return a GraphModule.

Example:
    >>> import torch, qcompile as qc
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> gm = qc.qcompile(model, "int8-qat", example_inputs=(torch.randn(4, 8),))
    >>> loss = gm(torch.randn(4, 8)).square().mean(); loss.backward()
    >>> gm.get_submodule("0").weight.grad is not None
    True

A graph ``qcompile`` returned is not compiled again (compile the original model), and
round-trips whole through ``torch.save`` / ``torch.load(f, weights_only=False)``::

    >>> try:
    ...     qc.qcompile(gm, "int8-qat", example_inputs=(torch.randn(4, 8),))
    ... except qc.QCompileError as e:
    ...     print(e.message.split(";")[0])
    qcompile: the model is already a graph returned by qcompile (quant.mode 'qat')
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.fx import GraphModule

from qcompile.distributed.data_parallel import watch_observer_sync
from qcompile.distributed.guards import refuse_wrapped, unwrap_compiled
from qcompile.distributed.once import block_spec, blocks, mark_blocks
from qcompile.errors import QCompileError
from qcompile.graph.pipeline import Instrument
from qcompile.graph.records import report
from qcompile.passes import compile_model
from qcompile.passes.trace import refuse_compiled
from qcompile.runtime.calibration import model_weights, refuse_nonfinite
from qcompile.specs import CompileSpec, as_spec


def qcompile(
    model: nn.Module,
    spec: CompileSpec | dict | str | Path,
    example_inputs: Any = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    instruments: Sequence[Instrument] = (),
    inplace: bool = False,
) -> GraphModule:
    """Compile ``model`` as ``spec`` says and return a ready-to-train ``GraphModule``.

    ``spec`` is a ``CompileSpec``, a dict, a spec file path or a preset name.
    ``example_inputs`` (optional) enables shape-dependent features. The model itself is
    never modified: passes work on a deep copy — unless ``inplace=True`` (as in torch.ao's
    ``prepare_fx``), which saves the copy's memory and lets the graph take over the model's
    modules and parameters: use it only for a model nothing else will use.

    What the model's forward does besides computing (hooks, attribute and in-place buffer
    updates, ``if self.training:`` branches) is kept by the graph or refused with the
    module's name and the fix (``qcompile.passes.trace.forward_effects``), never dropped
    in silence; so is a hook on a layer the spec quantizes, whose call the graph replaces
    by quantized operations (a ``skip: true`` rule keeps the layer a call, hooks and all).

    With ``data_parallel: {kind: fsdp2}`` (and no pipeline), the graph gets one child graph
    per repeated block (``qcompile.distributed.once.blocks``: a transformer's layers),
    which ``qc.distributed.wrap`` shards as one FSDP2 group each; state-dict names are
    the model's.

    A ``torch.compile``'d model is compiled from its original module (``model._orig_mod``;
    names without ``_orig_mod.``, a note in the Report); a model wrapped for data
    parallelism is refused (compile first, then ``qc.distributed.wrap``).
    """
    if not isinstance(model, nn.Module):
        raise QCompileError(f"qcompile takes an nn.Module, got {type(model).__name__}",
                            fix="pass the model instance (not its class or a function)")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise QCompileError(
            f"example_kwargs must be a dict of forward() argument names to values, got "
            f"{type(example_kwargs).__name__}",
            fix="pass example_kwargs={'input_ids': ids}, or positional values as "
                "example_inputs=(x,)")
    spec = as_spec(spec)
    if spec.quant.search is not None:
        raise QCompileError(
            "quant.search: this spec describes a search, not one quantization; qcompile "
            "compiles the spec the search returns",
            fix="run qc.search(model, spec, batches) first and compile the spec it returns")
    model, note = unwrap_compiled(model)
    refuse_compiled(model)
    refuse_wrapped(model)
    if spec.quant.mode != "none":  # a NaN weight would give NaN scales, and then NaN outputs
        refuse_nonfinite(model_weights(model), "qcompile")
    compile_spec, found = spec, []
    if spec.data_parallel.kind == "fsdp2" and spec.pipeline is None:
        # one child graph per repeated block, so that qc.distributed.wrap makes each an
        # FSDP2 group (as compile_once does): the graph reads its weights directly, and a
        # flat graph would be one group, the whole model unsharded for every step
        found = blocks(model)
        if len(found) >= 2:
            compile_spec = block_spec(spec, found)
    gm = compile_model(model, compile_spec, example_inputs, example_kwargs=example_kwargs,
                       instruments=instruments, inplace=inplace)
    if note is not None:
        report(gm).passes[0].notes.append(note)
    if compile_spec is not spec:
        mark_blocks(gm)
        report(gm).passes[-1].notes.append(
            f"data_parallel fsdp2: {len(found)} blocks as child graphs, one FSDP2 group "
            f"each under qc.distributed.wrap ({found[0]} .. {found[-1]})")
    return watch_observer_sync(gm)
