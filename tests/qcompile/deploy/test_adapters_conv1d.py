"""LoRA on layers that store their weight ``[in, out]`` (Hugging Face GPT-2's ``Conv1D``,
``addmm(bias, x, W)``), on both front ends, with the two frozen layouts: NF4 (the quantizer
reads the transpose, so its blocks run along the inputs) and int8 per channel (the
quantizer reads the weight as stored, one scale per output column), and a ``qat`` base.

Every reference is computed here from the model's float weights and the spec's numbers,
never read from the code under test: the base is the weight's rows ``W^T`` (``[out,
in]``) quantized along the inputs (``block_reference`` for NF4, ``max|row| / 127`` for
int8), the adapter adds ``x @ A^T @ B^T * alpha / rank``. Both directions of the layout
are checked: the graph and peft's reload of ``save_adapters`` (what goes out), and
``merge_adapters`` (the adapters folded back into an ``[in, out]`` weight).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import block_reference as R
import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.deploy.adapters import merge_adapters, save_adapters
from qcompile.runtime.frozen import FrozenWeight

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                         "ignore::FutureWarning")]

RANK, ALPHA = 4, 16
SCALING = ALPHA / RANK  # the spec's numbers: what the graph and peft must both apply
LAYERS = ("c_fc", "c_proj")
NF4 = {"dtype": "nf4"}
INT8 = {"dtype": "int8", "granularity": "per_channel"}


def nf4_rows(rows: torch.Tensor) -> torch.Tensor:
    """NF4 of ``[out, in]`` rows, 64-element blocks along the inputs (numpy reference)."""
    return torch.from_numpy(R.nf4_fake_quant(rows.detach().float().numpy(), 64))


def int8_rows(rows: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output row, scale ``max|row| / 127``."""
    scale = rows.detach().abs().amax(dim=1, keepdim=True) / 127.0
    return torch.clamp(torch.round(rows.detach() / scale), -128, 127) * scale


QUANTIZE = {"nf4": nf4_rows, "int8": int8_rows}


class GPT2MLP(nn.Module):
    """GPT-2's MLP: ``c_fc`` (64 -> 128) and ``c_proj`` (128 -> 64), both ``Conv1D``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        g = torch.Generator().manual_seed(0)
        self.c_fc, self.c_proj = Conv1D(128, 64), Conv1D(64, 128)
        with torch.no_grad():
            for layer in (self.c_fc, self.c_proj):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(torch.relu(self.c_fc(x)))


def reference(model: nn.Module, x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model``'s forward with each layer's ``[in, out]`` weight replaced."""
    h = torch.relu(x @ weights["c_fc"] + model.c_fc.bias)
    return h @ weights["c_proj"] + model.c_proj.bias


X = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=[("nf4", "symbolic"), ("nf4", "export"),
                                        ("int8", "export")], ids=lambda p: "-".join(p))
def adapted(request: pytest.FixtureRequest):
    """(scheme name, model, graph with non-zero adapters, the adapters by layer: (A, B))."""
    pytest.importorskip("transformers")
    kind, method = request.param
    model = GPT2MLP()
    spec = {"quant": {"mode": "qat", "target": "generic", "rules": [
                {"match": {"module": "Conv1D"}, "weight": NF4 if kind == "nf4" else INT8}]},
            "trace": {"method": method},
            "adapters": [{"match": {"module": "Conv1D"}, "rank": RANK, "alpha": ALPHA}]}
    gm = qc.qcompile(model, spec, example_inputs=(X,))
    g = torch.Generator().manual_seed(2)
    ab = {}
    with torch.no_grad():  # what training would leave: B away from its zero start
        for layer in LAYERS:
            b = gm.get_submodule(f"{layer}.lora_B").weight
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
            ab[layer] = (gm.get_submodule(f"{layer}.lora_A").weight.detach().clone(),
                         b.detach().clone())
    return kind, model, gm.eval(), ab


def bases(kind: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Each layer's quantized base, ``[in, out]`` as the model stores it."""
    return {n: QUANTIZE[kind](getattr(model, n).weight.t()).t() for n in LAYERS}


def test_the_base_is_stored_by_output_rows_and_the_adapter_adds_x_a_b(adapted) -> None:
    kind, model, gm, ab = adapted
    base = bases(kind, model)
    for layer in LAYERS:
        fw = gm.get_submodule(f"{layer}.weight_frozen")
        w = getattr(model, layer).weight  # [in, out]
        assert isinstance(fw, FrozenWeight) and (fw.rows, fw.cols) == (w.shape[1], w.shape[0])
        assert "weight" not in dict(gm.get_submodule(layer).named_parameters())
        torch.testing.assert_close(fw.dequantize(), base[layer].t(), atol=1e-6, rtol=0)
        a, b = ab[layer]
        assert a.shape == (RANK, w.shape[0]) and b.shape == (w.shape[1], RANK)  # peft's
    with torch.no_grad():
        h = torch.relu(X @ base["c_fc"] + model.c_fc.bias
                       + X @ ab["c_fc"][0].T @ ab["c_fc"][1].T * SCALING)
        want = (h @ base["c_proj"] + model.c_proj.bias
                + h @ ab["c_proj"][0].T @ ab["c_proj"][1].T * SCALING)
        torch.testing.assert_close(gm(X), want, atol=1e-5, rtol=1e-5)
    assert {n for n, p in gm.named_parameters() if p.requires_grad} == {
        f"{n}.lora_{p}.weight" for n in LAYERS for p in "AB"}


def test_peft_reload_on_the_float_model_computes_what_the_graph_computes(
        adapted, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    kind, model, gm, ab = adapted
    folder = save_adapters(gm, tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True and config["target_modules"] == list(LAYERS)
    float_model = copy.deepcopy(model).eval()
    with torch.no_grad():
        for layer, w in bases(kind, model).items():
            getattr(float_model, layer).weight.copy_(w)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(float_model, str(folder)).eval()
    assert not [w for w in seen if "fan_in_fan_out" in str(w.message)]  # as peft needs it
    with torch.no_grad():
        for layer in LAYERS:  # peft holds the adapters as the graph does: [r, in], [out, r]
            lora = loaded.base_model.model.get_submodule(layer)
            assert torch.equal(lora.lora_A["default"].weight, ab[layer][0])
            assert torch.equal(lora.lora_B["default"].weight, ab[layer][1])
        torch.testing.assert_close(loaded(X), gm(X), atol=1e-5, rtol=1e-5)


def test_merge_folds_the_adapters_into_in_out_weights_quantized_along_the_inputs(
        adapted) -> None:
    kind, model, gm, ab = adapted
    merged = merge_adapters(gm).eval()
    base = bases(kind, model)
    want = {}
    for layer in LAYERS:
        a, b = ab[layer]
        want[layer] = base[layer] + (b @ a).T * SCALING  # [in, out]
        got = merged.get_submodule(layer).weight
        assert got.shape == getattr(model, layer).weight.shape and got.requires_grad
        torch.testing.assert_close(got, want[layer], atol=1e-6, rtol=1e-6)
    quantized = {n: QUANTIZE[kind](w.t()).t() for n, w in want.items()}
    with torch.no_grad():
        torch.testing.assert_close(merged(X), reference(model, X, quantized),
                                   atol=1e-5, rtol=1e-5)
    assert not [n for n, _ in merged.named_modules() if "lora" in n or "frozen" in n]


def test_qat_base_merge_observes_the_merged_in_out_weight_per_output() -> None:
    """``base: qat`` keeps the [in, out] weight behind its per-channel quantizer (axis 1):
    the merge folds ``(B @ A)^T`` into it and the quantizer's scales become the merged
    weight's per-output ranges."""
    pytest.importorskip("transformers")
    model = GPT2MLP()
    spec = {"quant": {"mode": "qat", "rules": [{"match": {"module": "Conv1D"},
                                                "weight": INT8}]},
            "adapters": [{"match": {"module": "Conv1D"}, "rank": RANK, "alpha": ALPHA,
                          "base": "qat"}]}
    gm = qc.qcompile(model, spec, example_inputs=(X,))
    with torch.no_grad():
        for layer in LAYERS:
            b = gm.get_submodule(f"{layer}.lora_B").weight
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    merged = merge_adapters(gm).eval()
    want = {}
    for layer in LAYERS:
        a, b = (gm.get_submodule(f"{layer}.lora_{p}").weight.detach() for p in "AB")
        want[layer] = getattr(model, layer).weight.detach() + (b @ a).T * SCALING
        torch.testing.assert_close(merged.get_submodule(layer).weight, want[layer],
                                   atol=1e-6, rtol=1e-6)
        scale = merged.get_submodule(f"{layer}.weight_fake_quant").scale
        torch.testing.assert_close(scale, want[layer].abs().amax(dim=0) / 127.0,
                                   atol=0, rtol=1e-6)
    quantized = {n: int8_rows(w.t()).t() for n, w in want.items()}
    with torch.no_grad():
        torch.testing.assert_close(merged(X), reference(model, X, quantized),
                                   atol=1e-5, rtol=1e-5)
