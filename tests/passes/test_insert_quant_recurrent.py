"""Golden before/after dumps for recurrent layers in ``insert_quant``
(``quantize_recurrent_layers``): how nn.LSTM / GRU / RNN and their cells are re-expressed,
which quantizers they get per mode, on both front ends, and when the rewrite does not fire."""

from __future__ import annotations

import pytest
import torch
from pass_runs import annotated
from torch import nn

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.dump import format_graph
from qcompile.passes.insert_quant.recurrent import quantize_recurrent_layers
from qcompile.runtime import recurrent
from qcompile.runtime.fake_quant import FakeQuantize

W8 = {"dtype": "int8", "granularity": "per_channel"}
A8 = {"dtype": "uint8", "symmetric": False}
RECURRENT = ["LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell"]


def qspec(mode: str, *rules: dict, method: str = "symbolic") -> dict:
    rules = rules or ({"match": {"module": RECURRENT}, "weight": W8, "activation": A8},)
    return {"quant": {"mode": mode, "rules": list(rules)}, "trace": {"method": method}}


def run(model: nn.Module, spec: dict, *inputs: torch.Tensor):
    """(dump before, graph after quantize_recurrent_layers, ctx, nodes it returned)."""
    gm, ctx, before = annotated(model, spec, *inputs)
    handled = quantize_recurrent_layers(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return before, gm, ctx, handled


def dump(before: str, gm, ctx: Context, handled) -> str:
    quantizers = "\n".join(f"{name}: {m.extra_repr()}" for name, m in sorted(gm.named_modules())
                           if isinstance(m, FakeQuantize))
    return (f"## before\n{before}\n## after\n{format_graph(gm)}\n"
            f"## handled\n{', '.join(sorted(n.name for n in handled)) or '(none)'}\n"
            f"## quantizers\n{quantizers or '(none)'}\n"
            f"## notes\n{chr(10).join(ctx.notes) or '(none)'}")


class Seq(nn.Module):
    """A recurrent layer, then a Linear on its output sequence."""

    def __init__(self, kind: str = "LSTM", **kw) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = getattr(nn, kind)(4, 6, **kw)
        width = kw.get("proj_size") or 6
        self.fc = nn.Linear(width * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.fc(y)


class CellLoop(nn.Module):
    """A cell over three steps (symbolic tracing unrolls the loop)."""

    def __init__(self, kind: str = "GRUCell") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = getattr(nn, kind)(4, 6)
        self.kind = kind

    def forward(self, x):
        h = None
        for t in range(3):
            h = self.cell(x[t], h)
        return h[0] if self.kind == "LSTMCell" else h


X = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))


def test_dynamic_lstm(golden) -> None:
    before, gm, ctx, handled = run(Seq("LSTM", num_layers=2), qspec("dynamic"), X)
    golden("insert_quant_recurrent_lstm_dynamic", dump(before, gm, ctx, handled))
    call = next(n for n in gm.graph.nodes if n.target is recurrent.lstm)
    assert call in handled and call.meta["qcompile.module"] == "rnn"
    qs = qc.quantizers(gm)
    assert qs["rnn.input_fake_quant"].dynamic and qs["rnn.hidden_fake_quant"].dynamic
    assert (qs["rnn.input_fake_quant"].quant_min, qs["rnn.input_fake_quant"].quant_max) == (0, 127)
    # weights observed at insert: real per-channel scales before any forward
    w = gm.rnn.weight_hh_l1.detach()
    assert torch.allclose(qs["rnn.weight_hh_l1_fake_quant"].scale, w.abs().amax(1) / 127)
    assert not qs["rnn.weight_hh_l1_fake_quant"].observe
    assert {r.name for r in ctx.quantizers} == {n for n in qs if n.startswith("rnn.")}


def test_qat_gru_quantizes_its_output(golden) -> None:
    before, gm, ctx, handled = run(Seq("GRU", bidirectional=True), qspec("qat"), X)
    golden("insert_quant_recurrent_gru_qat", dump(before, gm, ctx, handled))
    qs = qc.quantizers(gm)
    assert qs["rnn.weight_ih_l0_reverse_fake_quant"].observe  # QAT: tracks its weight
    out_q = next(n for n in gm.graph.nodes if n.target == "rnn.output_fake_quant")
    assert out_q.args[0].target.__name__ == "getitem" and out_q in handled
    assert "rnn.input_fake_quant" not in qs


def test_static_cell_loop_shares_its_quantizers(golden) -> None:
    before, gm, ctx, handled = run(CellLoop(), qspec("static"), X)
    golden("insert_quant_recurrent_cell_loop_static", dump(before, gm, ctx, handled))
    calls = [n for n in gm.graph.nodes if n.target is recurrent.gru_cell]
    assert len(calls) == 3 and len({tuple(c.args[2]) for c in calls}) == 1
    assert sorted(qc.quantizers(gm)) == ["cell.output_fake_quant", "cell.weight_hh_fake_quant",
                                         "cell.weight_ih_fake_quant"]
    out_q = qc.quantizers(gm)["cell.output_fake_quant"]
    assert not out_q.enabled and out_q.observe  # static: observes until qc.calibrate


def test_export_lstm_is_rewritten_like_symbolic(golden) -> None:
    """torch.export records aten.lstm.input (output, h_n, c_n): the items are rewired to
    the function's nn.LSTM structure."""
    model = Seq("LSTM").eval()
    before, gm, ctx, handled = run(model, qspec("dynamic", method="export"), X)
    golden("insert_quant_recurrent_lstm_export_dynamic", dump(before, gm, ctx, handled))
    assert not any(n.target is torch.ops.aten.lstm.input for n in gm.graph.nodes)
    with torch.no_grad():
        got, ref = gm(X), model(X)
    got = got[0] if isinstance(got, tuple) else got
    assert 0 < float((got - ref).norm() / ref.norm()) < 0.05


class ShapeLoop(nn.Module):
    """An LSTM cell over the input's own length: symbolic tracing cannot unroll it, so
    ``auto`` captures it with torch.export (aten.lstm_cell per step)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.LSTMCell(4, 6)

    def forward(self, x):
        h = None
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
        return h[0]


def test_export_cell_loop_shares_its_quantizers() -> None:
    model = ShapeLoop().eval()
    _, gm, _, handled = run(model, qspec("dynamic", method="auto"), X)
    calls = [n for n in gm.graph.nodes if n.target is recurrent.lstm_cell]
    assert len(calls) == 3 and not any(
        n.target is torch.ops.aten.lstm_cell.default for n in gm.graph.nodes)
    assert set(calls) <= handled  # and the annotated items of each call's result
    assert all(u in handled for c in calls for u in c.users if "qcompile.qscheme" in u.meta)
    assert sorted(qc.quantizers(gm)) == ["cell.hidden_fake_quant", "cell.input_fake_quant",
                                         "cell.weight_hh_fake_quant", "cell.weight_ih_fake_quant"]
    with torch.no_grad():
        got, ref = gm(X), model(X)
    got = got[0] if isinstance(got, tuple) else got
    assert 0 < float((got - ref).norm() / ref.norm()) < 0.05


def test_rule_does_not_fire(golden) -> None:
    """A rule selecting only Linear leaves the LSTM a module call; a skip rule wins."""
    spec = qspec("dynamic", {"match": {"name": "rnn"}, "skip": True},
                 {"match": {"module": ["Linear", "LSTM"]}, "weight": W8, "activation": A8})
    before, gm, ctx, handled = run(Seq("LSTM"), spec, X)
    golden("insert_quant_recurrent_no_fire", dump(before, gm, ctx, handled))
    assert not handled and before == format_graph(gm)
    only_linear = qspec("qat", {"match": {"module": "Linear"}, "weight": W8, "activation": A8})
    _, gm, _, handled = run(Seq("LSTM"), only_linear, X)
    assert not handled and any(n.op == "call_module" and n.target == "rnn"
                               for n in gm.graph.nodes)


@pytest.mark.parametrize("mode", ["dynamic", "qat"])
def test_parameter_names_are_unchanged(mode: str) -> None:
    model = Seq("LSTM", num_layers=2, bidirectional=True)
    _, gm, _, _ = run(model, qspec(mode), X)
    keys = set(gm.state_dict())
    quantizer = {k for k in keys if "_fake_quant." in k}
    assert keys - quantizer == set(model.state_dict())
    assert all(torch.equal(gm.get_parameter(k), p) for k, p in model.named_parameters())


def test_proj_size_is_refused_in_dynamic_mode_only() -> None:
    model = Seq("LSTM", proj_size=3)
    with pytest.raises(qc.QCompileError, match=r"rnn.*proj_size"):
        run(model, qspec("dynamic"), X)
    _, gm, _, _ = run(model, qspec("qat"), X)
    assert "rnn.weight_hr_l0_fake_quant" in qc.quantizers(gm)


def test_weight_only_rule_and_dropout_read_the_module() -> None:
    """No activation scheme: weights only, the float kernels run; with dropout between
    layers the call reads the module itself for its training flag."""
    spec = qspec("dynamic", {"match": {"module": "LSTM"}, "weight": W8})
    model = Seq("LSTM", num_layers=2, dropout=0.5)
    _, gm, _, _ = run(model, spec, X)
    call = next(n for n in gm.graph.nodes if n.target is recurrent.lstm)
    assert call.kwargs["module"].target == "rnn" and "input_quant" not in call.kwargs
    assert sorted(qc.quantizers(gm)) == [f"rnn.weight_{a}_l{i}_fake_quant"
                                         for a in ("hh", "ih") for i in (0, 1)]
    gm.train()
    assert not torch.equal(gm(X), gm(X))
    gm.eval()
    assert torch.equal(gm(X), gm(X))
