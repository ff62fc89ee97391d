"""Hugging Face GPT-2's ``Conv1D`` (``y = x @ W + b``, ``W`` stored [in, out]) is quantized
like a Linear by every preset: per-channel along the output channels (dim 1 of ``W``),
per-group along the input dimension (dim 0), in QAT, static, dynamic, ``qc.convert`` and
``qc.export_encodings``; layers no rule selects are named in the Report.

References are computed here from the definitions (symmetric scale = max|w| / (levels on
the shorter side), ``clamp(round(w / scale)) * scale``), never read back from the code.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import qcompile as qc

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D

CONV1D = ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
          "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj")
PRESETS = ("int8-qat", "int8-static", "int8-dynamic", "w4a8-qat", "w8-weight-only")
# what each preset quantizes besides the Conv1D layers (wte is tied to lm_head: one
# quantizer, named after lm_head)
EXTRA = {"int8-qat": ("lm_head",), "int8-static": ("lm_head",), "int8-dynamic": ("lm_head",),
         "w4a8-qat": ("lm_head",), "w8-weight-only": ("lm_head", "transformer.wpe")}
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                  n_positions=16, use_cache=False, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


Compiled = Callable[[str], torch.fx.GraphModule]


@pytest.fixture(scope="module")
def compiled() -> Compiled:
    """``compiled(preset)``: a fresh copy of the tiny GPT-2 compiled with ``preset``
    (each preset compiled once per module)."""
    graphs: dict[str, torch.fx.GraphModule] = {}

    def get(preset: str) -> torch.fx.GraphModule:
        if preset not in graphs:
            graphs[preset] = qc.qcompile(gpt2(), preset, example_kwargs={"input_ids": IDS})
        return copy.deepcopy(graphs[preset])
    return get


def logits(out: object) -> torch.Tensor:
    if isinstance(out, dict):
        return out["logits"]
    return out[0] if isinstance(out, (tuple, list)) else out.logits  # type: ignore[attr-defined]


def qdq_per_channel(w: torch.Tensor, axis: int, bits: int) -> torch.Tensor:
    """Symmetric per-channel quantize-dequantize of ``w``, channels along ``axis``."""
    steps = 2 ** (bits - 1) - 1  # the shorter side of [-2^(b-1), 2^(b-1) - 1]
    reduce = [d for d in range(w.dim()) if d != axis]
    scale = (w.abs().amax(dim=reduce, keepdim=True) / steps).clamp(min=torch.finfo().eps)
    return torch.clamp(torch.round(w / scale), -steps - 1, steps) * scale


def qdq_per_group_rows(w: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Symmetric per-group quantize-dequantize of a [in, out] weight, groups of ``group``
    consecutive inputs (dim 0) per output channel."""
    steps = 2 ** (bits - 1) - 1
    g = w.t().reshape(w.shape[1], -1, group)  # [out, in / group, group]
    scale = (g.abs().amax(dim=-1, keepdim=True) / steps).clamp(min=torch.finfo().eps)
    q = torch.clamp(torch.round(g / scale), -steps - 1, steps) * scale
    return q.reshape(w.shape[1], w.shape[0]).t()


def weight_fake_quant(gm: torch.fx.GraphModule, layer: str) -> torch.Tensor:
    """The fake-quantized weight the layer's op reads, as the graph computes it."""
    m = gm.get_submodule(layer)
    fq = m.weight_fake_quant
    w = m.weight.detach()
    with torch.no_grad():
        if fq.group_size is not None and layer != "lm_head":  # quantized as [out, in]
            return fq(w.t()).t()
        return fq(w)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_quantize_every_conv1d_on_the_right_axis(preset: str,
                                                          compiled: Compiled) -> None:
    gm = compiled(preset)
    weights = {name.removesuffix(".weight_fake_quant") for name, q in qc.quantizers(gm).items()
               if name.endswith(".weight_fake_quant")}
    assert weights == set(CONV1D) | set(EXTRA[preset])
    for layer in CONV1D:
        w = gm.get_submodule(layer).weight.detach()  # [in, out]
        if preset == "w4a8-qat":
            want = qdq_per_group_rows(w, 32, 4)
        else:
            want = qdq_per_channel(w, axis=1, bits=8)
        torch.testing.assert_close(weight_fake_quant(gm, layer), want, rtol=0, atol=1e-6)
    notes = [n for p in qc.report(gm).passes for n in p.notes]
    left = [n for n in notes if "selected by no rule stay in float" in n]
    if preset == "w8-weight-only":
        assert not left, left
    else:  # the embeddings: named, not silent
        assert len(left) == 1 and "transformer.wte (Embedding)" in left[0], notes
    assert not any("weight scheme not applied" in n for n in notes), notes


def test_qat_trains_conv1d_weights_through_their_quantizers(compiled: Compiled) -> None:
    gm = compiled("int8-qat").train()
    logits(gm(input_ids=IDS)).square().mean().backward()
    for layer in CONV1D:
        grad = gm.get_submodule(layer).weight.grad
        assert grad is not None and grad.abs().sum() > 0, layer


def test_static_calibrate_convert_and_encodings(tmp_path: Path, compiled: Compiled) -> None:
    gm = compiled("int8-static")
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 64, (2, 8), generator=gen)} for _ in range(3)]
    gm = qc.calibrate(gm, data, progress=False)
    int8 = qc.convert(gm)
    stored = {c.module for c in qc.report(int8).conversions if c.op == "int8 weight"}
    assert {f"{layer}.weight" for layer in CONV1D} <= stored
    assert not any(n.endswith(".weight") and n.rpartition(".")[0] in CONV1D
                   for n, _ in int8.named_parameters())  # no float Conv1D weight left
    with torch.no_grad():
        diff = (logits(int8(input_ids=IDS)) - logits(gm(input_ids=IDS))).abs().max()
    assert diff < 0.05  # the same grid; integer add kernels round once more at most

    qc.export_encodings(gm, tmp_path / "enc.json")
    enc = json.loads((tmp_path / "enc.json").read_text())["param_encodings"]
    for layer in CONV1D:
        w = gm.get_submodule(layer).weight.detach()
        rows = enc[f"{layer}.weight"]
        assert len(rows) == w.shape[1] and {r["axis"] for r in rows} == {1}
        want = w.abs().amax(dim=0) / 127
        got = torch.tensor([r["scale"] for r in rows])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_dynamic_convert_uses_linear_kernels_with_the_transposed_weight(
        compiled: Compiled) -> None:
    gm = compiled("int8-dynamic")
    int8 = qc.convert(gm)
    kernels = [c.module for c in qc.report(int8).conversions
               if c.op == "quantized::linear_dynamic"]
    assert set(CONV1D) <= set(kernels)
    with torch.no_grad():
        diff = (logits(int8(input_ids=IDS)) - logits(gm(input_ids=IDS))).abs().max()
    assert diff < 1e-4


def test_per_group_conv1d_converts_to_int4_storage(compiled: Compiled) -> None:
    gm = compiled("w4a8-qat").eval()
    qc.freeze(gm)
    int4 = qc.convert(gm)
    stored = {c.module for c in qc.report(int4).conversions if c.op == "int4 weight"}
    assert {f"{layer}.weight" for layer in CONV1D} <= stored


class TwoConv1D(nn.Module):
    """Conv1D layers in a model symbolic tracing captures (no torch.export needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Conv1D(64, 32)  # nf (out), nx (in): weight [32, 64]
        self.act = nn.ReLU()
        self.b = Conv1D(8, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def test_symbolic_conv1d_per_channel_and_dynamic_kernel() -> None:
    torch.manual_seed(0)
    model = TwoConv1D().eval()
    x = torch.randn(2, 5, 32)
    gm = qc.qcompile(model, "int8-dynamic", example_inputs=(x,))
    for layer in ("a", "b"):
        w = model.get_submodule(layer).weight.detach()
        torch.testing.assert_close(weight_fake_quant(gm, layer),
                                   qdq_per_channel(w, axis=1, bits=8), rtol=0, atol=1e-6)
    assert set(qc.quantizers(gm)) == {"a.input_fake_quant", "a.weight_fake_quant",
                                      "b.input_fake_quant", "b.weight_fake_quant"}
    int8 = qc.convert(gm)
    assert [c.op for c in qc.report(int8).conversions] == ["quantized::linear_dynamic"] * 2
    torch.testing.assert_close(int8(x), gm(x), rtol=0, atol=1e-4)
