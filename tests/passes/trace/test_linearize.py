"""Weights read through views: ``x @ W.T`` products become ``linear`` (``linearize``), and a
weight read through a transpose, permute, reshape or cast is quantized per its output
channel, on both front ends.

References are computed here from the weights (a symmetric int8 grid per output row,
``amax(|W[row]|) / 127``), not from qcompile's quantizers; golden dumps show what the
rewrite does and where it does not fire."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.graph.dump import format_graph
from qcompile.passes.trace.linearize import linearize

W8 = {"dtype": "int8", "symmetric": True, "granularity": "per_channel"}
PRODUCTS = ["linear", "matmul", "mm", "einsum", "bmm"]


def spec(method: str, mode: str = "qat") -> dict:
    return {"quant": {"mode": mode, "rules": [
        {"match": {"op": PRODUCTS, "reads_weight": True}, "weight": W8}]},
        "trace": {"method": method}}


class Read(nn.Module):
    """One [out=6, in=8] weight read the ``kind`` way, then a second layer reading a
    [in=6, out=4] weight as stored (``h @ V``: its output channels are its columns)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        g = torch.Generator().manual_seed(0)
        # rows of very different ranges: a per-tensor or wrong-axis scale shows
        self.weight = nn.Parameter(torch.randn(6, 8, generator=g)
                                   * torch.logspace(-2, 1, 6).unsqueeze(1))
        self.v = nn.Parameter(torch.randn(6, 4, generator=g) * torch.logspace(-2, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, k = self.weight, self.kind
        h = {"T": lambda: x @ w.T,
             "t": lambda: torch.matmul(x, w.t()),
             "mT": lambda: x @ w.mT,
             "transpose": lambda: x @ w.transpose(0, 1),
             "permute": lambda: x @ w.permute(1, 0),
             "view": lambda: F.linear(x, w.view(6, 8)),
             "reshape": lambda: torch.einsum("bi,oi->bo", x, w.reshape(6, 8)),
             "cast": lambda: F.linear(x, w.float()),
             "split_rows": lambda: torch.einsum("bi,goi->bgo", x, w.view(2, 3, 8)).flatten(1),
             }[k]()
        return h @ self.v


KINDS = ["T", "t", "mT", "transpose", "permute", "view", "reshape", "cast"]


def per_row_int8(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 fake-quant with one scale per row: the independent reference."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    return (w / scale).round().clamp(-128, 127) * scale


@pytest.mark.parametrize("method", ["symbolic", "export"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_weight_read_through_a_view_is_quantized_per_output_channel(kind: str,
                                                                      method: str) -> None:
    model = Read(kind)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    gm = qc.qcompile(model, spec(method), example_inputs=(x,))
    rep = qc.report(gm)
    weights = {r.node: r for r in rep.quantizers if r.role == "weight"}
    assert set(weights) == {"weight", "v"}, rep.text()
    assert weights["weight"].scales == 6 and weights["v"].scales == 4
    assert rep.weights_quantized.share == 1.0 and not rep.weights_quantized.float
    # the graph computes with the weights on the per-row (per-column for v) grid
    expected = (x @ per_row_int8(model.weight.detach()).T) @ per_row_int8(
        model.v.detach().T).T
    torch.testing.assert_close(gm(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_a_weight_no_rule_recognises_is_named_and_counted_float(method: str) -> None:
    """An einsum whose weight operand holds two output dims (experts split from its rows):
    no weight rule quantizes it, the report says so, and the share counts it float."""
    model = Read("split_rows")
    gm = qc.qcompile(model, spec(method), example_inputs=(torch.randn(3, 8),))
    rep = qc.report(gm)
    assert rep.weights_quantized.float == ["weight"]
    assert rep.weights_quantized.share == pytest.approx(24 / 72)  # v: 6 x 4 of 72
    notes = [n for p in rep.passes for n in p.notes]
    assert any("stay in float, no rule quantizes them: weight" in n for n in notes), notes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_linearize_is_bit_identical(method: str, dtype: torch.dtype) -> None:
    model = Read("T").to(dtype)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    gm = qc.qcompile(model, {"quant": {"mode": "none"}, "trace": {"method": method},
                             "adapters": [{"match": {"name": "nothing"}, "optional": True}]},
                     example_inputs=(x,))
    assert any("read as linear layers" in n for p in qc.report(gm).passes for n in p.notes)
    assert "linear" in gm.code
    assert torch.equal(gm(x), model(x))


class NoFire(nn.Module):
    """Products linearize leaves alone: ``x @ V`` (V stored [in, out]), ``W.T @ x`` (the
    weight on the left), a batched weight, and a transposed activation."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(8, 8))
        self.w = nn.Parameter(torch.randn(8, 8))
        self.e = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x @ self.v
        b = (self.w.T @ a.T).T
        c = torch.bmm(a.unsqueeze(0).expand(2, -1, -1), self.e.transpose(1, 2)).sum(0)
        return c @ b.T


class Fires(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.weight.T)


@pytest.mark.parametrize("method", ["symbolic", "export"])
@pytest.mark.parametrize("case", ["fires", "no_fire"])
def test_linearize_golden(case: str, method: str, golden) -> None:
    model = Fires() if case == "fires" else NoFire()
    x = torch.randn(3, 8)
    if method == "symbolic":
        gm = torch.fx.symbolic_trace(model)
    else:
        from qcompile.passes.trace.capture_export import export_graph
        gm, _ = export_graph(model, (x,), {}, {})
    before = format_graph(gm)
    done = linearize(gm)
    gm.graph.lint()
    gm.recompile()
    assert (case == "fires") == bool(done)
    assert torch.equal(gm(x), model(x))
    golden(f"linearize_{case}_{method}",
           f"## before linearize\n{before}\n## after linearize ({done})\n{format_graph(gm)}")


def test_falcon_linear_layers_are_quantized_and_adapted() -> None:
    """Falcon's ``FalconLinear`` (``x @ self.weight.T``, an ``nn.Linear`` subclass): every
    preset quantizes it, ``module: Linear`` selects it, and LoRA adapters attach to it."""
    from qcompile.tools.architectures import ARCHITECTURES, linear_weight_parameters

    arch = ARCHITECTURES["falcon"]
    model = arch.build()
    batch = arch.batch()
    linear = linear_weight_parameters(model)
    gm = qc.qcompile(model, "int8-qat", example_kwargs=batch)
    quantized = {r.node for r in qc.report(gm).quantizers if r.role == "weight"}
    assert set(linear) <= quantized, sorted(set(linear) - quantized)
    spec_ = {"quant": {"mode": "qat", "rules": [
        {"match": {"module": "Linear", "name": "*.h.*"}, "weight": {"dtype": "nf4"}}]},
        "adapters": [{"match": {"module": "Linear", "name": "*.h.*"}, "rank": 4}]}
    gm = qc.qcompile(model, spec_, example_kwargs=batch)
    adapted = {a.layer for a in qc.report(gm).adapters}
    assert adapted == {n.rpartition(".")[0] for n in linear if ".h." in n}
    loss = arch.loss(gm(**batch), batch)
    loss.backward()
    assert torch.isfinite(loss)
