"""LoRA adapters leaving the graph: ``save_adapters`` writes what peft loads (the loaded
float model computes what the graph computes), ``merge_adapters`` folds them into a base
quantized again per the spec (what ``qc.convert`` / ``qc.export_onnx`` take), and the
graph's consumers refuse adapters that were not merged."""

from __future__ import annotations

import copy
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
from qcompile.runtime.fake_quant import FakeQuantize
from qcompile.runtime.frozen import FrozenWeight

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

INT8 = {"dtype": "int8", "granularity": "per_channel"}
NF4 = {"dtype": "nf4"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2) / 4.0, dim=-1)
        return self.o_proj(att @ self.v_proj(x))


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = Attn(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    """A transformer-like model: peft's names are ``layers.0.attn.q_proj`` etc."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(d), Layer(d)])
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train(gm: nn.Module, x: torch.Tensor, steps: int = 3) -> None:
    """SGD on the adapters only (layers without one keep the model's weights)."""
    opt = torch.optim.SGD([p for n, p in gm.named_parameters() if ".lora_" in n], lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        gm(x).pow(2).mean().backward()
        opt.step()
    for name in gm.meta[ADAPTERS_KEY]:
        assert gm.get_submodule(f"{name}.lora_B").weight.abs().max() > 0, name


def peft_model(model: nn.Module, folder: Path) -> nn.Module:
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(model, str(folder))
    ours = [str(w.message) for w in seen if "peft" in w.filename or "adapter" in str(w.message)]
    assert not ours, ours  # the config loads without peft complaining
    return loaded.eval()


def spec(rules: list | None, adapters: list, mode: str = "qat") -> dict:
    quant = {"mode": mode, "rules": rules} if rules else {"mode": "none"}
    return {"quant": quant, "adapters": adapters}


# -- save_adapters -> peft -------------------------------------------------------------
def test_float_base_loads_in_peft(tmp_path: Path) -> None:
    model, x = mlp(), torch.randn(8, 64)
    gm = qc.qcompile(model, spec(None, [{"match": {"module": "Linear"}, "rank": 4,
                                         "alpha": 8}]), example_inputs=(x,))
    train(gm, x)
    folder = save_adapters(gm, tmp_path / "adapter")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                        "adapter_model.safetensors"]
    loaded = peft_model(copy.deepcopy(model), folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), gm.eval()(x), atol=1e-6, rtol=0)
        # and the adapters do something: the bare model differs
        assert (model(x) - gm(x)).abs().max() > 1e-3


@pytest.mark.parametrize("weight", [INT8, NF4], ids=["int8_per_channel", "nf4"])
def test_frozen_base_loads_in_peft_on_its_dequantized_weights(tmp_path: Path,
                                                              weight: dict) -> None:
    model, x = mlp(), torch.randn(8, 64)
    gm = qc.qcompile(model, spec([{"match": {"module": "Linear"}, "weight": weight}],
                                 [{"match": {"module": "Linear"}, "rank": 4, "alpha": 16}]),
                     example_inputs=(x,))
    assert isinstance(gm.get_submodule("0.weight_frozen"), FrozenWeight)
    train(gm, x)
    folder = save_adapters(gm, tmp_path)
    base = copy.deepcopy(model)
    with torch.no_grad():
        for name in ("0", "2"):
            base.get_submodule(name).weight.copy_(
                gm.get_submodule(f"{name}.weight_frozen").dequantize())
    loaded = peft_model(base, folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), gm.eval()(x), atol=1e-6, rtol=0)


def test_names_config_and_rank_pattern_of_a_nested_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 5, 16)
    gm = qc.qcompile(model, spec(None, [
        {"match": {"name": "layers.0.attn.*"}, "rank": 4, "alpha": 8},
        {"match": {"name": "*.q_proj"}, "rank": 2, "alpha": 8, "dropout": 0.1},
        {"match": {"name": "layers.1.up"}, "rank": 4, "alpha": 2}]), example_inputs=(x,))
    train(gm, x)
    folder = save_adapters(gm, tmp_path / "a")
    layers = ["layers.0.attn.k_proj", "layers.0.attn.o_proj", "layers.0.attn.q_proj",
              "layers.0.attn.v_proj", "layers.1.attn.q_proj", "layers.1.up"]
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg == {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": None,
        "revision": None, "inference_mode": True, "r": 4, "lora_alpha": 8,
        "lora_dropout": 0.0, "target_modules": layers, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {"layers.1.attn.q_proj": 2},
        "alpha_pattern": {"layers.1.up": 2}}
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(f"base_model.model.{n}.lora_{p}.weight"
                                     for n in layers for p in "AB")
    assert tensors["base_model.model.layers.1.attn.q_proj.lora_A.weight"].shape == (2, 16)
    assert tensors["base_model.model.layers.1.up.lora_B.weight"].shape == (32, 4)
    loaded = peft_model(copy.deepcopy(model), folder)
    from peft.utils import get_peft_model_state_dict

    # peft's own names for what it loaded are the file's names
    assert sorted(get_peft_model_state_dict(loaded)) == sorted(tensors)
    q1 = loaded.base_model.model.layers[1].attn.q_proj
    assert q1.r["default"] == 2 and q1.scaling["default"] == 4.0
    assert loaded.base_model.model.layers[1].up.scaling["default"] == 0.5
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), gm.eval()(x), atol=1e-6, rtol=0)


class Shadowed(nn.Module):
    """``proj`` is adapted, ``inner.proj`` is not: the plain name would catch both."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.inner = nn.Sequential()
        self.inner.add_module("proj", nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.proj(self.proj(x))


def test_target_modules_catch_only_adapted_layers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Shadowed(), torch.randn(3, 8)
    gm = qc.qcompile(model, spec(None, [{"match": {"name": "proj"}, "rank": 2}]),
                     example_inputs=(x,))
    train(gm, x)
    folder = save_adapters(gm, tmp_path)
    assert json.loads((folder / "adapter_config.json").read_text())["target_modules"] == \
        "(proj)"
    loaded = peft_model(copy.deepcopy(model), folder)
    assert not hasattr(loaded.base_model.model.inner.proj, "lora_A")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), gm.eval()(x), atol=1e-6, rtol=0)
    # both adapted, with different ranks: the key for proj must not catch inner.proj
    gm = qc.qcompile(model, spec(None, [{"match": {"name": "proj"}, "rank": 2},
                                        {"match": {"name": "inner.proj"}, "rank": 4}]),
                     example_inputs=(x,))
    train(gm, x)
    cfg = json.loads((save_adapters(gm, tmp_path / "b") / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["rank_pattern"], cfg["target_modules"]) == (
        4, {"^proj": 2}, ["inner.proj", "proj"])
    loaded = peft_model(copy.deepcopy(model), tmp_path / "b")
    assert loaded.base_model.model.proj.r["default"] == 2
    assert loaded.base_model.model.inner.proj.r["default"] == 4
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), gm.eval()(x), atol=1e-6, rtol=0)


def test_wrapped_and_pipelined_graphs_save_the_model_names(tmp_path: Path) -> None:
    model, x = mlp(), torch.randn(8, 64)
    adapters = [{"match": {"module": "Linear"}, "rank": 4}]
    gm = qc.qcompile(model, spec(None, adapters), example_inputs=(x,))
    piped = qc.qcompile(model, {**spec(None, adapters), "pipeline": {"stages": 2}},
                        example_inputs=(x,))
    assert {n for n, _ in piped.named_children()} == {"stage_0", "stage_1"}

    class Wrapper(nn.Module):  # what DDP looks like to save_adapters: the graph as .module
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    from safetensors.torch import load_file

    a = load_file(str(save_adapters(Wrapper(gm), tmp_path / "a") / "adapter_model.safetensors"))
    b = load_file(str(save_adapters(piped, tmp_path / "b") / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) == sorted(f"base_model.model.{n}.lora_{p}.weight"
                                            for n in ("0", "2") for p in "AB")
    for k in a:  # the same deterministic initialisation, whatever the placement
        assert torch.equal(a[k], b[k]), k
    merged = merge_adapters(piped)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), piped(x), atol=1e-6, rtol=0)
    assert not [n for n, _ in merged.named_modules() if "lora" in n]


# -- merge_adapters --------------------------------------------------------------------
def per_channel_int8(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output channel, scale max|w| / 127 (qcompile's weights)."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    return torch.clamp(torch.round(w / scale), -128, 127) * scale


def merged_reference(gm: nn.Module, x: torch.Tensor, quantize, alpha: float, rank: int
                     ) -> tuple[torch.Tensor, dict]:
    """The model with each layer's weight ``W + alpha / rank * B @ A`` quantized, in float
    (``alpha`` and ``rank`` as the test's spec gives them, not the graph's own scaling)."""
    weights = {}
    for name in gm.meta[ADAPTERS_KEY]:
        base = gm.get_submodule(f"{name}.weight_frozen").dequantize()
        a = gm.get_submodule(f"{name}.lora_A").weight
        b = gm.get_submodule(f"{name}.lora_B").weight
        assert a.shape[0] == rank
        weights[name] = (base + (b @ a) * (alpha / rank)).detach()
    h = F.linear(x, quantize(weights["0"]), gm.get_submodule("0").bias)
    return F.linear(torch.relu(h), quantize(weights["2"]), gm.get_submodule("2").bias), weights


def test_adapted_forward_and_merge_scale_by_alpha_over_rank() -> None:
    """alpha 6, rank 3: the update is scaled by 2 (peft's alpha / r; alpha / sqrt(r) would
    be 3.46, rsLoRA's), in the adapted graph's forward and in the merged weight, against
    the formula written out here."""
    model, x = mlp(), torch.randn(8, 64)
    gm = qc.qcompile(model, spec(None, [{"match": {"name": "0"}, "rank": 3, "alpha": 6}]),
                     example_inputs=(x,))
    train(gm, x)
    a = gm.get_submodule("0.lora_A").weight.detach()
    b = gm.get_submodule("0.lora_B").weight.detach()
    w0 = model[0].weight.detach()
    with torch.no_grad():
        h = F.linear(x, w0, model[0].bias) + 2.0 * (x @ a.t() @ b.t())
        want = model[2](torch.relu(h))
        torch.testing.assert_close(gm.eval()(x), want, atol=1e-5, rtol=0)
        merged = merge_adapters(gm)
        torch.testing.assert_close(merged.get_submodule("0").weight, w0 + 2.0 * (b @ a),
                                   atol=1e-6, rtol=0)


def test_merge_int8_frozen_base_requantizes_and_leaves_gm_alone() -> None:
    model, x = mlp(), torch.randn(8, 64)
    gm = qc.qcompile(model, spec([{"match": {"module": "Linear"}, "weight": INT8}],
                                 [{"match": {"module": "Linear"}, "rank": 4, "alpha": 8}]),
                     example_inputs=(x,))
    train(gm, x)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    code = gm.code
    merged = merge_adapters(gm)
    # gm is as it was
    assert gm.code == code and len(gm.meta[ADAPTERS_KEY]) == 2
    after = gm.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # the merged graph: weights behind fresh quantizers, no adapter left
    assert merged.meta[ADAPTERS_KEY] == {} and qc.report(merged).adapters == []
    names = [n for n, _ in merged.named_modules()]
    assert not [n for n in names if "lora" in n or "frozen" in n]
    for layer in ("0", "2"):
        w = merged.get_submodule(layer).weight
        assert isinstance(w, nn.Parameter) and w.requires_grad
        assert isinstance(merged.get_submodule(f"{layer}.weight_fake_quant"), FakeQuantize)
    assert sorted(qc.quantizers(merged)) == ["0.weight_fake_quant", "2.weight_fake_quant"]
    assert {q.name for q in qc.report(merged).quantizers} >= set(qc.quantizers(merged))
    with torch.no_grad():
        ref, weights = merged_reference(gm, x, per_channel_int8, alpha=8, rank=4)
        for layer in ("0", "2"):
            torch.testing.assert_close(merged.get_submodule(layer).weight, weights[layer],
                                       atol=0, rtol=0)
        got, adapted = merged.eval()(x), gm.eval()(x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # the merge moves the output by re-quantizing the weights only: a few weight steps
    steps = max(float(merged.get_submodule(f"{n}.weight_fake_quant").scale.max())
                for n in ("0", "2"))
    assert 0 < float((got - adapted).abs().max()) < 64 * steps * float(x.abs().max())
    # the merged graph trains like a compiled QAT graph
    train_steps = torch.optim.SGD(merged.parameters(), lr=0.01)
    merged.train()(x).pow(2).mean().backward()
    assert merged.get_submodule("0").weight.grad is not None
    train_steps.zero_grad()


def test_merge_nf4_frozen_base_gives_an_nf4_weight_quantizer() -> None:
    model, x = mlp(), torch.randn(8, 64)
    gm = qc.qcompile(model, spec([{"match": {"module": "Linear"}, "weight": NF4}],
                                 [{"match": {"module": "Linear"}, "rank": 4, "alpha": 8}]),
                     example_inputs=(x,))
    train(gm, x)
    merged = merge_adapters(gm)
    fq = merged.get_submodule("0.weight_fake_quant")
    assert fq.block_format == "nf4" and fq.group_size == 64
    import block_reference as R  # an independent numpy NF4, not the implementation's

    def nf4(w: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(R.reference(w.detach().float().numpy(), "nf4", 64))

    with torch.no_grad():
        ref, _ = merged_reference(gm, x, nf4, alpha=8, rank=4)
        torch.testing.assert_close(merged.eval()(x), ref, atol=1e-5, rtol=0)


def test_merge_qat_base_observes_the_merged_weight() -> None:
    model, x = mlp(), torch.randn(8, 64)
    gm = qc.qcompile(model, spec([{"match": {"module": "Linear"}, "weight": INT8}],
                                 [{"match": {"name": "0"}, "rank": 4, "base": "qat"}]),
                     example_inputs=(x,))
    train(gm, x)
    old_scale = gm.get_submodule("0.weight_fake_quant").scale.clone()
    merged = merge_adapters(gm)
    # the spec's default alpha (8) over rank 4, not the graph's own scaling
    w = (gm.get_submodule("0").weight + gm.get_submodule("0.lora_B").weight
         @ gm.get_submodule("0.lora_A").weight * (8.0 / 4)).detach()
    fq = merged.get_submodule("0.weight_fake_quant")
    torch.testing.assert_close(fq.scale, w.abs().amax(dim=1) / 127.0, atol=0, rtol=1e-6)
    assert not torch.equal(fq.scale, old_scale)
    assert torch.equal(gm.get_submodule("0.weight_fake_quant").scale, old_scale)
    with torch.no_grad():
        h = torch.relu(F.linear(x, per_channel_int8(w), model[0].bias))
        ref = F.linear(h, per_channel_int8(gm.get_submodule("2").weight), model[2].bias)
        torch.testing.assert_close(merged.eval()(x), ref, atol=1e-5, rtol=0)


def test_merged_int8_graph_converts_and_exports(tmp_path: Path) -> None:
    model, x = mlp(), torch.randn(16, 64)
    rules = [{"match": {"module": "Linear"}, "weight": INT8,
              "activation": {"dtype": "uint8", "symmetric": False}}]
    gm = qc.qcompile(model, {"quant": {"mode": "qat", "rules": rules,
                                       "inputs": {"dtype": "uint8", "symmetric": False}},
                             "adapters": [{"match": {"module": "Linear"}, "rank": 4}]},
                     example_inputs=(x,))
    train(gm, x)
    merged = qc.freeze(merge_adapters(gm))
    int8 = qc.convert(merged, example_inputs=(x,))
    ops = [c.op for c in qc.report(int8).conversions if c.path == "kernel"]
    assert len(ops) == 2 and all(op.startswith("quantized::linear") for op in ops), ops
    assert qc.report(int8).max_deviation["output0_steps"] <= 1.01
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    path = qc.export_onnx(merged, tmp_path / "m.onnx", example_inputs=(x,))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = merged.eval()(x)
    step = float(merged.get_submodule("2.output_fake_quant").scale)
    assert float((torch.from_numpy(got) - want).abs().max()) <= step * 1.01


# -- errors ----------------------------------------------------------------------------
def test_graph_without_adapters_is_refused(tmp_path: Path) -> None:
    gm = qc.qcompile(mlp(), "int8-qat", example_inputs=(torch.randn(2, 64),))
    for call in (lambda: save_adapters(gm, tmp_path), lambda: merge_adapters(gm)):
        with pytest.raises(qc.QCompileError, match="no adapters") as e:
            call()
        assert "adapters" in e.value.fix
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(qc.QCompileError, match="not compiled by qcompile"):
        save_adapters(mlp(), tmp_path)


def test_unmerged_adapters_are_refused_by_convert_and_export(tmp_path: Path) -> None:
    x = torch.randn(8, 64)
    gm = qc.qcompile(mlp(), spec([{"match": {"module": "Linear"}, "weight": INT8}],
                                 [{"match": {"module": "Linear"}, "rank": 4}]),
                     example_inputs=(x,))
    calls = {"convert": lambda: qc.convert(gm, example_inputs=(x,)),
             "export_onnx": lambda: qc.export_onnx(gm, tmp_path / "m.onnx", example_inputs=(x,)),
             "export_encodings": lambda: qc.export_encodings(gm, tmp_path / "m.json")}
    for where, call in calls.items():
        with pytest.raises(qc.QCompileError, match=f"{where}: the graph holds LoRA adapters "
                           "on 2 layer") as e:
            call()
        assert "qc.merge_adapters(gm) first" in e.value.fix
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(qc.QCompileError, match="is a file"):
        (tmp_path / "f").write_text("")
        save_adapters(gm, tmp_path / "f")
