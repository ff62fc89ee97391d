"""Every key qcompile reads or writes in ``node.meta`` and ``GraphModule.meta``, in one place.

Passes, the runtime adapters and the tools name keys through these constants, never as
string literals, so that a key's writers and readers can be found with one search and a
rename is one edit. torch's own keys (written by ``ShapeProp``, ``torch.export`` and fx)
are listed too, because qcompile reads them.

Example:
    >>> from qcompile.graph.meta import QSCHEME_KEY, TENSOR_META
    >>> QSCHEME_KEY, TENSOR_META
    ('qcompile.qscheme', 'tensor_meta')
"""

from __future__ import annotations

# -- node.meta keys written by qcompile's passes ------------------------------------------
#: fold_bn: the fusion group a node belongs to (conv-bn-relu, linear-relu, ...)
FUSION_KEY = "qcompile.fusion"
#: annotate: the ``NodeQScheme`` (rule index, weight / activation schemes) of a node
QSCHEME_KEY = "qcompile.qscheme"
#: insert_quant / fold_bn: the module (qualified name) a re-expressed call belongs to
MODULE_KEY = "qcompile.module"
#: place: the node's name in the unsplit graph (stage graphs rename values)
FINAL_NAME_KEY = "qcompile.final_name"
#: convert: the quantization parameters of a value that is a quantized tensor
QPARAMS_KEY = "qcompile.qparams"
#: convert: the float value a ``dequantize`` node stands for
DQ_KEY = "qcompile.dq"
#: partition: the pipeline stage index of a node
STAGE_KEY = "qcompile.stage"

# -- GraphModule.meta keys ----------------------------------------------------------------
#: the compile ``Report`` (``qc.report(gm)``)
REPORT_KEY = "qcompile.report"
#: the ``CompileSpec`` the graph was compiled with
SPEC_KEY = "qcompile.spec"
#: trace: the qcompile version that compiled the graph; marks every graph ``qcompile``
#: returned (pipeline stages and converted graphs too), which is never compiled again
COMPILED_KEY = "qcompile.compiled"
#: ``quant.sync_observers`` of that spec (read by ``qc.calibrate``)
SYNC_OBSERVERS_KEY = "qcompile.sync_observers"
#: trace: the class of the traced model (module-type rules match the root by it)
ROOT_CLASS_KEY = "qcompile.root_class"
#: place: the names of the ``stage_<i>`` children of a pipeline-placed graph
STAGE_NAMES_KEY = "qcompile.stage_names"
#: place: for each parameter several stages hold, its qualified name in each stage
TIED_KEY = "qcompile.tied"
#: qcompile / compile_once with ``data_parallel: fsdp2``: the names of the ``stage_<i>``
#: children that are the model's repeated blocks in one process (FSDP2's groups), not
#: pipeline stages: an exporter reads them as one graph (``qcompile.graph.inline``)
BLOCKS_KEY = "qcompile.blocks"
#: compile_once: the graph is already ``fully_shard``-ed per block (``wrap`` returns it as is)
SHARDED_KEY = "qcompile.sharded"
# qc.distributed.wrap sharded the graph's layers across tensor-parallel ranks (the plan's
# size): its weights are DTensors split by rows (colwise) or columns (rowwise)
TP_SHARDED_KEY = "qcompile.tp_sharded"
# qc.distributed.pipeline x tensor parallel: the stage (child graph name) this rank sharded
# and trains; the graph's other stages are other ranks'
TP_STAGE_KEY = "qcompile.tp_stage"
#: wrap / compile_once: the graph's data-parallel group (``distributed.agree.GroupCheck``);
#: ``check(call, gm)`` has its ranks agree on the call and the model before a collective
#: (how ``save_adapters`` checks before gathering a sharded graph); None once pickled
COLLECTIVES_KEY = "qcompile.collectives"
#: qc.distributed.pipeline: which ranks train each stage and the group they step in
#: (``distributed.pipelining.StagePlacement``): how an exporter brings every stage's
#: trained state to the rank that writes; None once pickled
PIPELINE_KEY = "qcompile.pipeline"
#: fold_bn: for each folded weight (and bias), the model tensors and BatchNorm it was
#: computed from (``passes.fold_bn.Fold``): how a checkpoint's tensors become the graph's
FOLDS_KEY = "qcompile.folds"
#: insert_adapters: layer name -> ``passes.insert_adapters.AdapterLayer`` (its adapter, how
#: its base is held): what ``qc.save_adapters`` / ``qc.merge_adapters`` read
ADAPTERS_KEY = "qcompile.adapters"
#: insert_adapters: what an ``adapters`` section trains besides the adapters
#: (``passes.insert_adapters.Training``): the modules trained in full, which
#: ``qc.save_adapters`` writes as peft's ``modules_to_save``, and the parameters it stopped
#: training, which ``qc.merge_adapters`` gives back
TRAINING_KEY = "qcompile.adapters_training"
#: algorithm passes: the ``quant.algorithms[i]`` entries skipped because the weights were
#: on the meta device (no values to rewrite): fine when the real compiled graph's tensors
#: are copied in afterwards, wrong when the model's own weights are loaded
ALGORITHMS_SKIPPED_KEY = "qcompile.algorithms_skipped"

#: the optimizer step count the graph's last forward saw (``distributed.data_parallel``'s
#: ``_StepsSeen``): in ``meta``, the one attribute of a graph that deep copies (torch
#: rebuilds a copied GraphModule from its graph and keeps ``meta``) and pickles keep
STEPS_SEEN_KEY = "qcompile.steps_seen"
#: train.check_finite: the graph's budget of checked steps ([steps left, optimizer steps
#: seen, checks on]; ``qcompile.graph.finite``)
CHECK_FINITE_KEY = "qcompile.check_finite"

# -- torch's node.meta keys that qcompile reads --------------------------------------------
#: ``torch.fx.passes.shape_prop.TensorMetadata`` (shape, dtype, ...) of a node's value
TENSOR_META = "tensor_meta"
#: the Python type of a node's value (written next to ``tensor_meta`` by shape propagation)
TYPE = "type"
#: torch.export: the fake tensor (or SymInt) a node computes
VAL = "val"
#: torch.export / dynamo: the module call stack a node was traced in
NN_MODULE_STACK = "nn_module_stack"

#: root graph: indices into ``quant.algorithms`` of the data-driven algorithms (gptq,
#: adaround, bias_correction) still waiting for ``qc.calibrate``'s batches, in order
PENDING_ALGORITHMS_KEY = "qcompile.pending_algorithms"
#: root graph: qualified names of the weight quantizers whose weights an algorithm put on
#: their grid: their scales are fixed (calibration does not observe those weights again)
FIXED_GRID_KEY = "qcompile.fixed_grid"
#: root graph: names of its own (root-level) non-persistent buffers; a deep copy restores
#: their persistence (``GraphModule.__deepcopy__`` registers root buffers as persistent)
ROOT_NON_PERSISTENT_KEY = "qcompile.root_non_persistent"
