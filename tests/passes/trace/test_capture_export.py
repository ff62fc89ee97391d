"""The torch.export front end through every pass: golden dumps of an export-captured
graph, train/eval behaviour restored, functional BatchNorm folding, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.passes.annotate import annotate
from qcompile.passes.fold_bn import fold_bn
from qcompile.passes.insert_quant import insert_quant
from qcompile.passes.trace import trace
from qcompile.runtime.modes import ModeAwareBatchNorm, ModeAwareSDPA

X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))


class ShapeBranch(nn.Module):
    """conv-bn-relu, a branch on a shape (symbolic tracing fails on it), dropout, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)))
        if y.shape[-1] > 4:
            y = self.drop(y)
        return self.fc(y.flatten(1) + 1.0)


def seeded(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    m = cls()
    with torch.no_grad():  # non-default running statistics
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
    return m


def spec(mode: str, **extra: object) -> qc.CompileSpec:
    rules = [{"match": {"module": ["Conv2d", "Linear"]},
              "weight": {"dtype": "int8", "granularity": "per_channel"},
              "activation": {"dtype": "uint8", "symmetric": False}},
             {"match": {"op": "add"}, "activation": {"dtype": "uint8", "symmetric": False}}]
    quant = {"mode": mode, "rules": rules} if mode != "none" else {"mode": "none"}
    return qc.CompileSpec.model_validate({"quant": quant, **extra})


def run(model: nn.Module, s: qc.CompileSpec) -> tuple[list[str], Context]:
    """Run the passes one by one, dumping the graph after each."""
    ctx = Context(spec=s, model=model, example_inputs=(X,))
    dumps = []
    gm = None
    for p in (trace, fold_bn, annotate, insert_quant):
        gm = p(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        dumps.append(f"## after {p.name}\n{format_graph(gm)}")
    return dumps, ctx


def test_export_graph_through_every_pass_qat(golden) -> None:
    dumps, ctx = run(seeded(ShapeBranch), spec("qat"))
    assert ctx.trace_method == "export"
    for name, text in zip(("trace", "fold_bn", "annotate", "insert_quant"), dumps):
        golden(f"export_qat_{name}", text)
    text = dumps[-1]
    # weights are quantized between their get_attr and the aten op, named as on symbolic graphs
    assert "conv.weight_fake_quant(conv_weight)" in text
    assert "fc.weight_fake_quant(fc_weight)" in text
    # one quantizer for the conv-bn-relu group, at its output
    assert "conv.output_fake_quant(relu)" in text
    # BatchNorm and dropout are module calls again: they follow train()/eval()
    calls = {line.split()[0]: line.split()[2] for line in text.splitlines()[1:]
             if line.split()[1] == "call_module"}
    assert calls["bn"].startswith("bn(") and calls["drop"].startswith("drop(")
    assert "aten.batch_norm" not in text and "aten.dropout" not in text


def test_export_graph_static_folds_functional_conv(golden) -> None:
    model = seeded(ShapeBranch).eval()
    dumps, ctx = run(model, spec("static"))
    golden("export_static_fold_bn", dumps[1])
    assert "folded bn into conv" in ctx.notes
    gm = qc.qcompile(model, spec("static"), example_inputs=(X,))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())
    # fake-quant off before calibration: the folded float graph equals the eval model
    gm.eval()
    for q in qc.quantizers(gm).values():
        q.enabled = False
    torch.testing.assert_close(gm(X), model(X), atol=1e-5, rtol=1e-5)


def test_export_rule_does_not_fire_on_skipped_layer(golden) -> None:
    s = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": [
        {"match": {"name": "fc"}, "skip": True},
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8"}}]}})
    # the skip rule takes the only Linear: the second rule selects nothing -> error
    try:
        run(seeded(ShapeBranch), s)
    except qc.QCompileError as e:
        assert "quant.rules[1]" in e.message and "taken by earlier rules" in e.message
    else:
        raise AssertionError("a rule shadowed by a skip rule must be reported")
    s2 = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": [
        {"match": {"name": "fc"}, "skip": True},
        {"match": {"module": "Conv2d"}, "weight": {"dtype": "int8"}}]}})
    dumps, _ = run(seeded(ShapeBranch), s2)
    golden("export_skip_insert_quant", dumps[-1])
    assert "fc.weight_fake_quant" not in dumps[-1]


def test_mode_none_export_matches_model_in_train_and_eval() -> None:
    model = seeded(ShapeBranch)
    gm = qc.qcompile(model, spec("none"), example_inputs=(X,))
    assert qc.report(gm).trace_method == "export"
    for mode in ("train", "eval"):
        getattr(model, mode)()
        getattr(gm, mode)()
        torch.manual_seed(3)
        ref = model(X)
        torch.manual_seed(3)
        out = gm(X)
        assert torch.equal(out, ref), mode
    assert gm.training is False and gm.get_submodule("drop").training is False


def test_batchnorm_statistics_update_in_train_only() -> None:
    model = seeded(ShapeBranch)
    gm = qc.qcompile(model, spec("none"), example_inputs=(X,))
    bn = gm.get_submodule("bn")
    before = bn.running_mean.clone()
    gm.eval()
    gm(X)
    assert torch.equal(bn.running_mean, before)
    assert int(bn.num_batches_tracked) == int(model.bn.num_batches_tracked)
    gm.train()
    gm(X)
    assert not torch.equal(bn.running_mean, before)
    assert int(bn.num_batches_tracked) == int(model.bn.num_batches_tracked) + 1
    assert torch.equal(model.bn.running_mean, seeded(ShapeBranch).bn.running_mean)


class FunctionalModes(nn.Module):
    """batch_norm and attention dropout written functionally, reading self.training."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(x.transpose(1, 2), self.mean, self.var, training=self.training)
        q = self.proj(x.transpose(1, 2)).unsqueeze(1)
        p = 0.5 if self.training else 0.0
        return F.scaled_dot_product_attention(q, q, q, dropout_p=p).squeeze(1)


def test_functional_mode_dependent_ops_follow_train_and_eval() -> None:
    torch.manual_seed(0)
    model = FunctionalModes()
    x = torch.randn(2, 5, 8)
    gm = qc.qcompile(model, {"trace": {"method": "export"}}, example_inputs=(x,))
    kinds = {type(m) for m in gm.modules()}
    assert ModeAwareBatchNorm in kinds and ModeAwareSDPA in kinds
    model.eval()
    gm.eval()
    assert torch.equal(gm(x), model(x))  # no dropout, running statistics
    gm.train()
    model.train()
    torch.manual_seed(5)
    ref = model(x)
    torch.manual_seed(5)
    assert torch.equal(gm(x), ref)


def test_eval_model_exported_keeps_eval_flags() -> None:
    model = seeded(ShapeBranch).eval()
    model.drop.train()  # per-module flags are kept, not just the root's
    gm = qc.qcompile(model, spec("none"), example_inputs=(X,))
    assert gm.training is False and gm.get_submodule("bn").training is False
    assert gm.get_submodule("drop").training is True


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: neither front end can capture it
            return self.fc(x)
        return x


def test_both_front_ends_failing_is_one_error_with_both_reasons() -> None:
    try:
        qc.qcompile(Untraceable(), "int8-qat", example_inputs=(torch.randn(2, 4),))
    except qc.QCompileError as e:
        assert "symbolic tracing failed" in e.message
        assert "torch.export failed" in e.message
        assert "leaf_modules" in e.fix and "torch.cond" in e.fix
    else:
        raise AssertionError("expected a QCompileError")


def test_auto_without_inputs_explains_export_needs_them() -> None:
    try:
        qc.qcompile(Untraceable(), "int8-qat")
    except qc.QCompileError as e:
        assert "symbolic tracing failed" in e.message and "needs example inputs" in e.message
    else:
        raise AssertionError("expected a QCompileError")


def test_dynamic_dims_errors() -> None:
    m = nn.Sequential(nn.Linear(4, 4))
    cases = [
        ({"nope": {0: "batch"}}, (torch.randn(3, 4),), "trace.dynamic_dims names ['nope']"),
        ({"input": {0: "batch"}}, (torch.randn(1, 4),), "specialises sizes 0 and 1"),
        ({"input": {5: "batch"}}, (torch.randn(3, 4),), "dim 5 does not exist"),
    ]
    for dims, inputs, message in cases:
        s = {"trace": {"method": "export", "dynamic_dims": dims}}
        try:
            qc.qcompile(m, s, example_inputs=inputs)
        except qc.QCompileError as e:
            assert message in e.message, e.message
        else:
            raise AssertionError(f"expected an error for {dims}")


def test_dynamic_batch_serves_other_sizes() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    s = {"trace": {"method": "export", "dynamic_dims": {"input": {0: "batch"}}}}
    gm = qc.qcompile(m, s, example_inputs=(torch.randn(3, 4),))
    for b in (2, 7):
        x = torch.randn(b, 4)
        assert torch.equal(gm(x), m(x))
    static = qc.qcompile(m, {"trace": {"method": "export"}}, example_inputs=(torch.randn(3, 4),))
    try:
        static(torch.randn(7, 4))
    except Exception as e:  # export's input guard: a static graph refuses other shapes
        assert "Guard failed" in str(e) and "size()[0] == 3" in str(e)
    else:
        raise AssertionError("a graph exported with static shapes must refuse another batch")


class _ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: neither front end captures it
            return self.fc(x)
        return -self.fc(x)


def test_failed_export_prints_nothing_but_the_error(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    """torch.export prints its partial graph to stderr and logs warnings before raising;
    the QCompileError says what failed, so none of that reaches the user."""
    with pytest.raises(qc.QCompileError, match=r"torch\.export failed"):
        qc.qcompile(_ValueBranch(), "int8-qat", example_inputs=(torch.randn(4, 8),))
    err = capsys.readouterr().err
    assert "def forward" not in err and "Unable to find user code" not in err, err


@pytest.mark.parametrize("record", [False, True])
def test_stack_traces_only_when_the_spec_asks(record: bool) -> None:
    """Export records each node's source stack only with ``trace.stack_traces`` (walking
    the whole Python stack per node costs ~12% of an export), and torch.fx's switch is
    left as it was, after a failed export too."""
    before = torch.fx.config.do_not_emit_stack_traces
    s = spec("qat", trace={"method": "export", "stack_traces": record})
    gm = qc.qcompile(seeded(ShapeBranch), s, (X,))
    traced = [n for n in gm.graph.nodes if n.meta.get("stack_trace")]
    if record:
        assert traced and all("test_capture_export.py" in n.meta["stack_trace"] for n in traced)
    else:
        assert not traced
    assert torch.fx.config.do_not_emit_stack_traces is before
    with pytest.raises(qc.QCompileError, match=r"torch\.export failed"):
        qc.qcompile(_ValueBranch(), s, example_inputs=(torch.randn(4, 8),))
    assert torch.fx.config.do_not_emit_stack_traces is before
    torch.testing.assert_close(gm.eval()(X), qc.qcompile(seeded(ShapeBranch), spec(
        "qat", trace={"method": "export", "stack_traces": not record}), (X,)).eval()(X))


def test_stack_traces_the_user_turned_off_stay_off() -> None:
    """A user who switched torch.fx's stack traces off keeps them off, even with
    ``trace.stack_traces``: the spec only ever removes work."""
    old = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        gm = qc.qcompile(seeded(ShapeBranch),
                         spec("none", trace={"method": "export", "stack_traces": True}), (X,))
        assert not [n for n in gm.graph.nodes if n.meta.get("stack_trace")]
        assert torch.fx.config.do_not_emit_stack_traces is True
    finally:
        torch.fx.config.do_not_emit_stack_traces = old


# -- device and dtype follow the graph's tensors ------------------------------------------
def _compiled_decoder(arch: str, spec: object) -> tuple[nn.Module, dict[str, torch.Tensor],
                                                        object]:
    pytest.importorskip("transformers")
    from qcompile.tools.architectures import ARCHITECTURES

    a = ARCHITECTURES[arch]
    batch = a.batch()
    return qc.qcompile(a.build(), spec, example_kwargs=batch), batch, a


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("arch", ["llama", "gemma2", "bloom"])
def test_a_graph_exported_on_the_cpu_runs_where_it_is_moved(arch: str) -> None:
    """Positions, causal masks, rotary tables and a recurrent layer's zero state are made
    on the device export traced on; moved elsewhere (here the meta device, which runs
    every op's shape logic without a GPU, as ``.to("cuda")`` would) the graph makes them
    there: no op mixes devices, and no guard of the traced device or dtype is left. (No
    quantizers: they check their inputs are finite, which meta tensors cannot say.)"""
    gm, batch, _ = _compiled_decoder(arch, {"quant": {"mode": "none"}})
    for node in gm.graph.nodes:
        args = [*node.args, *node.kwargs.values()]
        assert not any(isinstance(v, torch.device) for v in args), node.format_node()
        assert "_assert_tensor_metadata" not in str(node.target), node.format_node()
    gm.to("meta")
    out = gm(**{k: v.to("meta") for k, v in batch.items()})
    logits = out["logits"] if isinstance(out, dict) else out.logits
    assert logits.device.type == "meta"
    assert logits.shape == (*batch["input_ids"].shape, 128)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_a_mixture_of_experts_graph_trains_under_autocast() -> None:
    """Mixtral's router casts its logits with ``.float()``: export guards that cast's input
    dtype (float32 when traced), which bf16 autocast changes. The guard is gone, the cast
    stays: the loss under autocast is finite and within bf16's rounding of float32's."""
    gm, batch, a = _compiled_decoder("mixtral", "8da4w-qat")
    ref = a.loss(gm(**batch), batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gm(**batch)
        assert out["logits"].dtype == torch.bfloat16  # the head ran in bf16
    loss = a.loss(out, batch)
    loss.backward()
    assert torch.isfinite(loss) and abs(float(loss) - float(ref)) < 0.05 * float(ref)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in gm.parameters())
