"""Modules trained in full next to LoRA adapters (``adapters: [{kind: full, ...}]``, peft's
``modules_to_save``): only the adapters and those modules train, ``save_adapters`` writes
both, and peft's reload computes what the trained graph computes, on both front ends (a
symbolic-traceable model, and a Hugging Face sequence classifier through torch.export).

The reference for each comparison is built here, not read from the code under test: a
float copy of the model whose adapted layers hold the graph's dequantized base weights
(only they are quantized), so the graph and peft's model differ by float rounding only;
and the same float model with each adapted weight merged by hand, ``W + alpha / rank * B @
A`` with ``alpha / rank`` taken from the spec's numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc
from qcompile.deploy.adapters import merge_adapters, save_adapters
from qcompile.graph.meta import ADAPTERS_KEY

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                         "ignore::FutureWarning")]

RANK, ALPHA = 4, 16  # alpha / rank = 4.0, the scaling peft and the graph must both apply
NF4 = {"dtype": "nf4", "group_size": 32}
ATTN = ["*.q_proj", "*.v_proj"]  # the attention projections that get adapters
TOL = {"atol": 1e-5, "rtol": 1e-5}  # float rounding only: the bases are the graph's values


def spec(method: str) -> dict:
    """NF4 bases on the adapted projections only (every other layer stays float, so the
    float reference needs no quantizer), LoRA on them, the head trained in full."""
    return {"quant": {"mode": "qat", "target": "generic", "rules": [
                {"match": {"name": ATTN}, "weight": NF4}]},
            "trace": {"method": method},
            "adapters": [{"match": {"module": "Linear", "name": ATTN}, "rank": RANK,
                          "alpha": ALPHA},
                         {"kind": "full", "match": {"name": HEAD[method]}}]}


HEAD = {"symbolic": "head", "export": "score"}


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2) / 8.0, dim=-1)
        return self.o_proj(att @ self.v_proj(x))


class Classifier(nn.Module):
    """Two attention layers, a norm, a classifier head over the mean of the sequence."""

    def __init__(self, d: int = 64, labels: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Attn(d), Attn(d)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x).mean(1))


def hf_classifier() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from qcompile.tools.architectures import ARCHITECTURES

    arch = dataclasses.replace(ARCHITECTURES["llama"], model="LlamaForSequenceClassification")
    return arch.build(num_labels=3), arch.batch()


def logits(out: object) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)


def run(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return logits(model(**inputs))


@pytest.fixture(scope="module", params=["symbolic", "export"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(method, model, inputs, graph trained 4 AdamW steps, the graph's trainable names
    before training, the saved adapter folder)."""
    method = request.param
    if method == "symbolic":
        model = Classifier()
        inputs = {"x": torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(1))}
        gm = qc.qcompile(model, spec(method), example_inputs=(inputs["x"],))
    else:
        pytest.importorskip("transformers")
        model, inputs = hf_classifier()
        gm = qc.qcompile(model, spec(method), example_kwargs=inputs)
    labels = torch.arange(next(iter(inputs.values())).shape[0]) % 3
    names = {n for n, p in gm.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in gm.parameters() if p.requires_grad], lr=2e-2)
    torch.manual_seed(0)
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(run(gm, inputs), labels).backward()
        opt.step()
    gm.eval()
    folder = save_adapters(gm, tmp_path_factory.mktemp(method) / "adapter")
    return method, model, inputs, gm, names, folder


def float_base(model: nn.Module, gm: nn.Module) -> nn.Module:
    """A float copy of ``model`` whose adapted layers hold the graph's dequantized bases."""
    base = copy.deepcopy(model).eval()
    with torch.no_grad():
        for layer in gm.meta[ADAPTERS_KEY]:
            base.get_submodule(layer).weight.copy_(
                gm.get_submodule(f"{layer}.weight_frozen").dequantize())
    return base


def peft_load(model: nn.Module, folder: Path) -> nn.Module:
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(model, str(folder)).eval()


def test_only_the_adapters_and_the_head_train(trained) -> None:
    method, model, _, gm, names, _ = trained
    head = HEAD[method]
    layers = sorted(gm.meta[ADAPTERS_KEY])
    assert len(layers) == 4 and all(n.endswith(("q_proj", "v_proj")) for n in layers)
    head_params = {f"{head}.{n}" for n, _ in model.get_submodule(head).named_parameters()}
    assert names == {f"{n}.lora_{p}.weight" for n in layers for p in "AB"} | head_params
    # the user's model: untouched, flags included
    assert all(p.requires_grad for p in model.parameters())
    moved = (gm.get_submodule(head).weight - model.get_submodule(head).weight).abs().max()
    moved = moved.detach()
    assert float(moved) > 1e-3  # the head trained (the float model's head is not the answer)
    rep = qc.report(gm)
    full = [(r.module, r.parameters) for r in rep.trainable if r.kind == "full"]
    assert full == [(head, sum(p.numel() for p in model.get_submodule(head).parameters()))]
    assert {r.kind for r in rep.trainable} == {"lora", "full"}
    assert f"in full {head} (" in rep.text()


def test_the_adapter_holds_the_head_as_peft_names_it(trained) -> None:
    method, model, _, gm, _, folder = trained
    head = HEAD[method]
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == [head]
    assert (cfg["r"], cfg["lora_alpha"]) == (RANK, ALPHA)
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    saved = {k for k in tensors if not k.split(".")[-2].startswith("lora_")}
    assert saved == {f"base_model.model.{head}.{k}" for k in model.get_submodule(head).state_dict()}
    for k in saved:
        assert torch.equal(tensors[k], gm.get_submodule(head).get_parameter(k.split(".")[-1]))
    loaded = peft_load(float_base(model, gm), folder)
    from peft.utils import get_peft_model_state_dict

    assert sorted(get_peft_model_state_dict(loaded)) == sorted(tensors)  # peft's own names


def test_peft_reload_computes_what_the_graph_computes(trained) -> None:
    method, model, inputs, gm, _, folder = trained
    head = HEAD[method]
    loaded = peft_load(float_base(model, gm), folder)
    q = next(m for n, m in loaded.named_modules() if n.endswith("q_proj"))
    assert q.scaling["default"] == ALPHA / RANK
    with torch.no_grad():
        want = run(gm, inputs)
        torch.testing.assert_close(run(loaded, inputs), want, **TOL)
        # the reference by hand: W + alpha / rank * B @ A in each adapted layer, the
        # graph's head; no peft, no qcompile code
        by_hand = float_base(model, gm)
        for layer in gm.meta[ADAPTERS_KEY]:
            a = gm.get_submodule(f"{layer}.lora_A").weight
            b = gm.get_submodule(f"{layer}.lora_B").weight
            by_hand.get_submodule(layer).weight.add_((ALPHA / RANK) * (b @ a))
        for n, p in by_hand.get_submodule(head).named_parameters():
            p.copy_(gm.get_submodule(head).get_parameter(n))
        torch.testing.assert_close(run(by_hand, inputs), want, **TOL)
        # without the head the adapter alone is far off: the head is what the fix saves
        stale = float_base(model, gm)
        for layer in gm.meta[ADAPTERS_KEY]:
            stale.get_submodule(layer).weight.copy_(by_hand.get_submodule(layer).weight)
        gap = (run(stale, inputs) - want).abs().max()
        assert float(gap) > 100 * TOL["atol"]


def test_merge_keeps_the_head_and_gives_back_the_model_flags(trained) -> None:
    method, _, inputs, gm, _, _ = trained
    head = HEAD[method]
    merged = merge_adapters(gm)
    assert torch.equal(merged.get_submodule(head).weight, gm.get_submodule(head).weight)
    # the model trained everything: the merged graph does too (frozen base layers included)
    assert all(p.requires_grad for p in merged.parameters())
    assert qc.report(merged).trainable == []
    with torch.no_grad():  # merging re-quantizes the merged NF4 weights: a small move only
        gap = (run(merged.eval(), inputs) - run(gm, inputs)).abs().max()
        assert float(gap) < 0.1 * float(run(gm, inputs).abs().max())


def test_merge_of_a_frozen_model_freezes_the_head_again() -> None:
    model = Classifier().requires_grad_(False)
    x = torch.randn(2, 6, 64)
    gm = qc.qcompile(model, spec("symbolic"), example_inputs=(x,))
    assert gm.get_submodule("head").weight.requires_grad
    merged = merge_adapters(gm)
    trains = {n for n, p in merged.named_parameters() if p.requires_grad}
    # merge_adapters makes the merged layers trainable; the rest is as the model had it
    assert trains == {f"layers.{i}.{n}.{p}" for i in (0, 1) for n in ("q_proj", "v_proj")
                      for p in ("weight", "bias")}


class Suffixed(nn.Module):
    """``score`` trains in full; peft's modules_to_save rule (a name ending with a listed
    one) also takes ``inner.score`` and ``xscore``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj = nn.Linear(16, 16)
        self.inner = nn.Sequential()
        self.inner.add_module("score", nn.Linear(16, 16))
        self.score = nn.Linear(16, 8)
        self.xscore = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.xscore(self.score(self.inner.score(self.q_proj(x))))


def test_modules_peft_also_selects_are_written_with_the_graph_values(tmp_path: Path) -> None:
    model, x = Suffixed(), torch.randn(5, 16)
    gm = qc.qcompile(model, {"adapters": [{"match": {"name": "q_proj"}, "rank": 2},
                                          {"kind": "full", "match": {"name": "score"}}]},
                     example_inputs=(x,))
    opt = torch.optim.SGD([p for p in gm.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        gm(x).square().mean().backward()
        opt.step()
    assert not gm.get_submodule("xscore").weight.requires_grad
    folder = save_adapters(gm, tmp_path)
    assert json.loads((folder / "adapter_config.json").read_text())["modules_to_save"] == [
        "score"]
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    for name in ("score", "inner.score", "xscore"):  # all end with "score"
        assert torch.equal(tensors[f"base_model.model.{name}.weight"],
                           gm.get_submodule(name).weight)
    loaded = peft_load(copy.deepcopy(model), folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), gm.eval()(x), **TOL)
    # an adapted layer that peft's rule would also take: refused, nothing written
    gm = qc.qcompile(model, {"adapters": [{"match": {"name": "inner.score"}, "rank": 2},
                                          {"kind": "full", "match": {"name": "score"}}]},
                     example_inputs=(x,))
    with pytest.raises(qc.QCompileError, match=r"'score' \(trained in full\) also selects "
                       r"'inner\.score', which is a LoRA-adapted layer") as e:
        save_adapters(gm, tmp_path / "refused")
    assert "rename" in e.value.fix
    assert not (tmp_path / "refused").exists()
