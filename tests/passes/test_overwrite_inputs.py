"""Golden before/after dumps for the ``overwrite_inputs`` pass: which activation quantizer
calls may write over their input (``overwrite=True``), and the cases where the mark must
not fire: a graph input, a weight, a submodule's output, a value read twice, an output
its operator's backward reads (ReLU), a pipeline stage's inputs."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.graph.dump import GraphDumps
from qcompile.passes.overwrite_inputs import _marks
from qcompile.runtime.fake_quant import FakeQuantize


def _dumps(tmp_path: Path, model: nn.Module, spec, *inputs: torch.Tensor) -> tuple[str, str]:
    """(the graph before overwrite_inputs, the dump after it with the pass's notes), from
    the real pipeline's numbered dumps."""
    gm = qc.qcompile(model, spec, inputs, instruments=[GraphDumps(tmp_path)])
    files = sorted(p for p in tmp_path.iterdir() if p.suffix == ".txt")
    assert files[-1].name.endswith("_overwrite_inputs.txt"), files
    notes = "\n".join(qc.report(gm).passes[-1].notes) or "(none)"
    before, after = files[-2].read_text(), files[-1].read_text()
    return gm, (f"## before overwrite_inputs\n{before}## after overwrite_inputs\n{after}"
                f"## notes\n{notes}")


def _marked(gm) -> list[str]:
    return [n.name for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.kwargs.get("overwrite")]


class _Residual(nn.Module):
    """Linear on a 3-D input, a batched matmul, a residual sum: each output read once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return x + torch.softmax(h @ h.transpose(-2, -1), -1) @ h


def test_outputs_read_once_are_marked(golden, tmp_path) -> None:
    gm, text = _dumps(tmp_path, _Residual(), "int8-qat", torch.randn(2, 3, 8))
    golden("overwrite_inputs_residual", text)
    assert set(_marked(gm)) == {"fc_output_fake_quant", "matmul_1_fake_quant",
                                "add_fake_quant"}


class _Leaf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _NoFire(nn.Module):
    """A submodule's output is quantized (its hooks may keep it); a value the Linear's
    input quantizer reads is also read by the sum; a Linear + ReLU group's quantizer
    reads the ReLU's output, which the ReLU's backward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.leaf, self.fc, self.fc2 = _Leaf(), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.tanh(self.leaf(x))
        return torch.relu(self.fc2(self.fc(g) + g))


def test_the_mark_does_not_fire(golden, tmp_path) -> None:
    w8 = {"dtype": "int8"}
    spec = {"trace": {"leaf_modules": [f"{__name__}._Leaf"]},
            "quant": {"mode": "qat", "rules": [
                {"match": {"module": "_Leaf"}, "activation": w8},
                {"match": {"name": "fc2"}, "weight": w8, "activation": w8},
                {"match": {"module": "Linear"}, "weight": w8, "activation": w8,
                 "activation_at": "input"}]}}
    gm, text = _dumps(tmp_path, _NoFire(), spec, torch.randn(2, 3, 4))
    golden("overwrite_inputs_no_fire", text)
    assert _marked(gm) == []


def test_a_pipeline_stage_marks_nothing_that_comes_in(tmp_path) -> None:
    """Each stage is marked in its own graph, never on a value that crossed the cut."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    spec = {"quant": {"mode": "qat", "rules": [
        {"match": {"module": "Linear"}, "weight": {"dtype": "int8"},
         "activation": {"dtype": "int8"}}]}, "pipeline": {"stages": 2}}
    gm = qc.qcompile(model, spec, (torch.randn(4, 8),))
    for name in ("stage_0", "stage_1"):
        stage = gm.get_submodule(name)
        for n in stage.graph.nodes:
            if n.kwargs.get("overwrite"):
                assert n.args[0].op == "call_function", (name, n.name)
    assert len(_marked(gm)) == 4
    x = torch.randn(4, 8)
    assert torch.equal(gm(x), gm(x))  # the stages' recompiled code runs


def test_a_marked_graph_computes_what_the_unmarked_one_does() -> None:
    """A training forward and backward, bit for bit, with the marks and without them."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    gm = qc.qcompile(_Residual(), "int8-qat", (x,))
    gm(x).sum().backward()  # statistics: the quantizers quantize from the next forward
    for q in qc.quantizers(gm).values():
        q.apply_pending()
    plain = qc.qcompile(_Residual(), "int8-qat", (x,))
    plain.load_state_dict(gm.state_dict())
    for n in plain.graph.nodes:
        n.kwargs = {k: v for k, v in n.kwargs.items() if k != "overwrite"}
    plain.recompile()
    outs = []
    for g in (gm, plain):
        g.zero_grad()
        y = g(x)
        F.mse_loss(y, torch.zeros_like(y)).backward()
        outs.append([y.detach()] + [p.grad for p in g.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_sum_written_into_a_kept_buffer_is_not_marked() -> None:
    """``torch.add(x, x, out=buf)`` returns the module's own buffer: never written over."""
    root = nn.Module()
    root.register_buffer("buf", torch.zeros(3))
    root.fq = FakeQuantize("uint8", symmetric=False)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for out in (graph.get_attr("buf"), None):
        kwargs = {"out": out} if out is not None else {}
        graph.call_module("fq", (graph.call_function(torch.add, (x, x), kwargs),))
    graph.output(x)
    gm = torch.fx.GraphModule(root, graph)
    assert _marks(gm) == 1
    assert [n.kwargs for n in gm.graph.nodes if n.op == "call_module"] == [{}, {"overwrite": True}]
