"""``quant.inputs: auto`` (the int8-static / int8-qat presets): a float model input that a
quantized Linear / Conv reads is quantized where that layer reads it, with the layer's
activation scheme, as torch.ao's input observer does; inputs nothing quantized reads stay
float. Golden dumps of ``insert_quant``, including a case where it does not fire."""

from __future__ import annotations

import copy

import pytest
import torch
from pass_runs import annotated
from pydantic import ValidationError
from torch import nn

import qcompile as qc
from qcompile.graph.dump import format_graph
from qcompile.passes.insert_quant import insert_quant

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")

W8C = {"dtype": "int8", "granularity": "per_channel"}
A8 = {"dtype": "uint8", "symmetric": False}


def qspec(*rules: dict, mode: str = "static") -> dict:
    return {"quant": {"mode": mode, "rules": list(rules), "inputs": "auto"}}


def run_insert(model: nn.Module, spec_dict: dict, *inputs: torch.Tensor) -> str:
    """The golden text: the graph before and after ``insert_quant``, its quantizers and
    notes."""
    gm, ctx, before = annotated(model, spec_dict, *inputs)
    gm = insert_quant(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    records = "\n".join(f"{r.name}: role={r.role} node={r.node} rule={r.rule}"
                        for r in ctx.quantizers)
    return (f"## before insert_quant\n{before}\n## after insert_quant\n{format_graph(gm)}\n"
            f"## quantizers\n{records}\n## notes\n{chr(10).join(ctx.notes) or '(none)'}")


class TwoInputs(nn.Module):
    """``x`` reaches ``fc`` through a flatten; ``scale`` only multiplies float values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head = nn.Linear(12, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(torch.flatten(x, 1))) * scale)


def test_golden_auto_quantizes_what_the_first_layer_reads(golden) -> None:
    text = run_insert(TwoInputs(), qspec({"match": {"module": "Linear"}, "weight": W8C,
                                          "activation": A8}),
                      torch.randn(2, 3, 4), torch.randn(2, 4))
    golden("insert_quant_inputs_auto", text)
    assert "x_input_fake_quant(flatten)" in text and "scale_input_fake_quant" not in text


def test_golden_auto_does_not_fire_for_float_or_weight_only_readers(golden) -> None:
    """The input reaches a skipped layer, and a weight-only layer reads float values:
    nothing quantizes what it reads, so no input quantizer."""
    text = run_insert(TwoInputs(), qspec({"match": {"name": "fc"}, "skip": True},
                                         {"match": {"module": "Linear"}, "weight": W8C}),
                      torch.randn(2, 3, 4), torch.randn(2, 4))
    golden("insert_quant_inputs_auto_no_fire", text)
    assert "input_fake_quant" not in text


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + x


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_only_the_quantized_layer_reads_the_quantized_input(method: str) -> None:
    spec = qc.CompileSpec.model_validate({**qspec({"match": {"module": "Linear"},
                                                   "weight": W8C, "activation": A8}),
                                          "trace": {"method": method}})
    gm = qc.qcompile(Residual(), spec, example_inputs=(torch.randn(4, 8),))
    (x,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [str(u.target) for u in x.users if "fake_quant" in str(u.target)] == [
        "x_input_fake_quant"]
    assert [r.role for r in qc.report(gm).quantizers].count("input") == 1
    # by name: str() of a builtin holds its address, whose hex digits may spell "add"
    (add,) = [n for n in gm.graph.nodes
              if n.op == "call_function" and "add" in getattr(n.target, "__name__", "")]
    assert x in add.args, "the residual add reads the float input, as in the model"


def test_dynamic_mode_adds_nothing_it_does_not_quantize_already() -> None:
    spec = {"quant": {"mode": "dynamic", "inputs": "auto", "rules": [
        {"match": {"module": "Linear"}, "weight": W8C, "activation": A8}]}}
    gm = qc.qcompile(Residual(), spec, example_inputs=(torch.randn(4, 8),))
    assert sorted(r.role for r in qc.report(gm).quantizers) == ["activation", "weight"]


def test_the_spec_takes_auto_and_names_a_wrong_value() -> None:
    assert qc.load_spec("int8-static").quant.inputs == "auto"
    assert qc.load_spec("int8-qat").quant.inputs == "auto"
    with pytest.raises(ValidationError) as e:
        qc.CompileSpec.model_validate({"quant": {"mode": "static", "inputs": "all"}})
    assert [err["loc"] for err in e.value.errors()] == [("quant", "inputs", "auto")]
    with pytest.raises(ValidationError, match=r"quant\.mode is none"):
        qc.CompileSpec.model_validate({"quant": {"inputs": "auto"}})


@pytest.mark.parametrize("preset", ["int8-static", "int8-qat"])
def test_preset_mlp_is_all_kernels_within_one_step(preset: str) -> None:
    """With the presets as shipped, every Linear of an MLP on a float input runs an integer
    kernel, within one output step of the fake-quant graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 8))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 16, generator=gen),) for _ in range(3)]
    gm = qc.qcompile(model, preset, example_inputs=batches[0])
    if preset == "int8-static":
        qc.calibrate(gm, batches, progress=False)
    else:
        gm.train()
        with torch.no_grad():
            for b in batches:
                gm(*b)
        qc.freeze(gm)
    ref = copy.deepcopy(gm).eval()
    out = qc.convert(gm, example_inputs=batches[0])
    assert [c.op for c in qc.report(out).conversions if c.path == "kernel"] == [
        "quantized::linear_relu", "quantized::linear_relu", "quantized::linear"]
    step = float(qc.quantizers(ref)["4.output_fake_quant"].scale[0])
    with torch.no_grad():
        for x in (batches[0][0], 3 * torch.randn(16, 16, generator=gen)):  # and out of range
            assert float((out(x) - ref(x)).abs().max()) <= step * (1 + 1e-5)
