"""Real transformer models through the torch.export front end (issue 3).

GPT-2, BERT, a Llama-style decoder (RoPE, RMSNorm, SwiGLU) and a ViT encoder are built
from tiny configs (never downloaded). For each: ``trace.method: auto`` picks export,
``mode: none`` is bit-identical in eval *and* train mode (export's train/eval trap,
pytorch/pytorch#151726), the user's model is left alone, int8 QAT trains, rules select
layers by module ownership, and ``w4a8-qat`` compiles. Small custom models cover what the
transformers cannot: the two front ends side by side, Python control flow on shapes,
nested dict/tuple outputs, and dynamic dimensions.

Every model is built and compiled once per module (module-scoped fixtures).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import qcompile as qc

transformers = pytest.importorskip("transformers")

transformers.logging.set_verbosity_error()

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
NONE = {"quant": {"mode": "none"}}


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                  n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                  intermediate_size=64, vocab_size=100,
                                  max_position_embeddings=64)
    return transformers.BertModel(cfg)


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, hidden_size=32, intermediate_size=64,
                                   vocab_size=100, max_position_embeddings=64, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _vit() -> nn.Module:
    # ViTConfig's dropouts default to 0.0 in transformers 5.x: set them, so the train/eval
    # behaviour of the compiled graph is observable.
    cfg = transformers.ViTConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                 intermediate_size=64, image_size=16, patch_size=4,
                                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return transformers.ViTModel(cfg)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    kwargs: dict[str, torch.Tensor]
    key: str  # the main output tensor
    dropout: bool  # dropout > 0 somewhere in the model
    glob: str  # a layer glob for the rule-selection test
    weighted: str = "Linear"  # the class a per-layer rule selects under ``glob``


CASES = {
    "gpt2": Case("gpt2", _gpt2, {"input_ids": IDS}, "logits", True, "transformer.h.0.*",
                 weighted="Conv1D"),
    "bert": Case("bert", _bert, {"input_ids": IDS}, "last_hidden_state", True,
                 "encoder.layer.0.*"),
    "llama": Case("llama", _llama, {"input_ids": IDS}, "logits", False, "model.layers.1.*"),
    "vit": Case("vit", _vit, {"pixel_values": PIXELS}, "last_hidden_state", True, "layers.0.*"),
}


@dataclass
class Built:
    case: Case
    model: nn.Module
    state: dict[str, torch.Tensor]  # the model's state_dict right after construction
    flags: dict[str, bool]  # every module's training flag right after construction
    extra: dict[str, Any] = field(default_factory=dict)


def flags_of(m: nn.Module) -> dict[str, bool]:
    return {name: mod.training for name, mod in m.named_modules()}


def linears(model: nn.Module, cls_name: str = "Linear") -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == cls_name]


def main(out: Any, key: str) -> torch.Tensor:
    return out[key] if isinstance(out, dict) else getattr(out, key)


def assert_same_output(a: Any, b: Any) -> None:
    """Same type, same keys, every tensor equal bit for bit."""
    assert type(a) is type(b)
    if isinstance(a, dict):  # also ModelOutput (an OrderedDict)
        assert list(a.keys()) == list(b.keys())
        for k in a:
            assert_same_output(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_output(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def spec_with(preset: str, **extra: Any) -> qc.CompileSpec:
    data = qc.load_spec(preset).model_dump()
    data.update(extra)
    return qc.CompileSpec.model_validate(data)


# -- fixtures: one model, one `none` graph and one int8-qat graph per model -------------

@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def built(request: pytest.FixtureRequest) -> Built:
    case = CASES[request.param]
    torch.manual_seed(0)
    model = case.make()
    assert model.training  # as constructed (the train-mode int8-qat compile relies on it)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Built(case, model, state, flags_of(model))


@pytest.fixture(scope="module")
def gm_none(built: Built) -> torch.fx.GraphModule:
    """``mode: none``, compiled while the model is in eval mode (the module flags the
    graph inherits are recorded in ``built.extra``); the model goes back to train mode."""
    m = built.model
    m.eval()
    before = flags_of(m)
    gm = qc.qcompile(m, NONE, example_kwargs=built.case.kwargs)
    built.extra["none_flags"] = (before, flags_of(m), flags_of(gm))
    m.train()
    return gm


@pytest.fixture(scope="module")
def gm_qat(built: Built) -> torch.fx.GraphModule:
    """``int8-qat``, compiled while the model is in train mode."""
    m = built.model
    m.train()
    before = flags_of(m)
    gm = qc.qcompile(m, "int8-qat", example_kwargs=built.case.kwargs)
    built.extra["qat_flags"] = (before, flags_of(m), flags_of(gm))
    return gm


# -- 1. front-end choice ------------------------------------------------------------------

def test_auto_picks_export_and_says_why(built: Built, gm_none: torch.fx.GraphModule) -> None:
    r = qc.report(gm_none)
    assert r.trace_method == "export"
    notes = [n for p in r.passes if p.name == "trace" for n in p.notes]
    why = [n for n in notes if n.startswith("captured with torch.export")]
    assert len(why) == 1, notes
    assert "symbolic tracing failed" in why[0]


def test_symbolic_alone_refuses_with_leaf_modules_advice(built: Built) -> None:
    spec = {"quant": {"mode": "none"}, "trace": {"method": "symbolic"}}
    with pytest.raises(qc.QCompileError, match="leaf_modules") as info:
        qc.qcompile(built.model, spec, example_kwargs=built.case.kwargs)
    assert "symbolic tracing failed" in str(info.value)
    assert "torch.export failed" not in str(info.value)  # export was not tried


# -- 2. mode none: bit-identical in eval and in train mode --------------------------------

def test_mode_none_bit_identical_eval_and_train(built: Built,
                                                gm_none: torch.fx.GraphModule) -> None:
    m, kw, key = built.model, built.case.kwargs, built.case.key
    try:
        m.eval()
        gm_none.eval()
        with torch.no_grad():
            ref, got, again = m(**kw), gm_none(**kw), gm_none(**kw)
        assert_same_output(got, ref)  # same ModelOutput class, keys and values
        assert torch.equal(main(again, key), main(got, key))  # dropout is off

        m.train()
        gm_none.train()
        torch.manual_seed(1)
        ref = m(**kw)
        torch.manual_seed(1)
        got = gm_none(**kw)
        assert_same_output(got, ref)  # dropout consumes the RNG exactly like the model
        torch.manual_seed(2)
        a, b = main(gm_none(**kw), key), main(gm_none(**kw), key)
        # export bakes the training flag in (pytorch/pytorch#151726): with dropout the two
        # calls must differ in train mode and, above, agree in eval mode
        assert torch.equal(a, b) is not built.case.dropout
    finally:
        m.train()


def test_modeloutput_class_and_keys_pass_through(built: Built,
                                                 gm_none: torch.fx.GraphModule) -> None:
    gm_none.eval()
    built.model.eval()
    try:
        with torch.no_grad():
            out, ref = gm_none(**built.case.kwargs), built.model(**built.case.kwargs)
    finally:
        built.model.train()
    assert isinstance(out, transformers.utils.ModelOutput)
    assert type(out) is type(ref)
    assert list(out.keys()) == list(ref.keys())
    if built.case.name == "bert":
        assert type(out).__name__ == "BaseModelOutputWithPoolingAndCrossAttentions"
        assert list(out.keys()) == ["last_hidden_state", "pooler_output"]


# -- 3. the user's model is not touched ---------------------------------------------------

def test_model_not_mutated(built: Built, gm_none: torch.fx.GraphModule,
                           gm_qat: torch.fx.GraphModule) -> None:
    m = built.model
    sd = m.state_dict()
    assert sd.keys() == built.state.keys()
    for k, v in built.state.items():
        assert torch.equal(sd[k], v), k
    theirs = {p.data_ptr() for p in m.parameters()} | {b.data_ptr() for b in m.buffers()}
    for gm in (gm_none, gm_qat):
        ours = {p.data_ptr() for p in gm.parameters()} | {b.data_ptr() for b in gm.buffers()}
        assert not ours & theirs, "the compiled graph shares storage with the model"
    # compiled from eval mode: the model stays in eval, the graph starts in eval
    before, after, graph = built.extra["none_flags"]
    assert not any(before.values())
    assert after == before
    assert not any(graph.values())
    # compiled from train mode: likewise in train
    before, after, graph = built.extra["qat_flags"]
    assert after == before == built.flags
    assert all(graph.values())


# Regressions these tests guard (qcompile.graph.state_layout): torch.export keeps one name per
# tied parameter (GPT-2's transformer.wte.weight), and GraphModule re-registers buffers as
# persistent (BERT's position_ids, Llama's inv_freq).


def test_state_dict_keys_stay_as_they_were(request: pytest.FixtureRequest, built: Built,
                                           gm_none: torch.fx.GraphModule) -> None:
    """docs/concepts/passes.md: parameter names (and so state_dict keys) stay as they were,
    so a checkpoint moves between the model and the compiled graph with strict loading."""
    ours = gm_none.state_dict()
    for k, v in ours.items():  # values shared with the model are equal in any case
        if k in built.state:
            assert torch.equal(v, built.state[k]), k
    assert set(ours) == set(built.state), (
        f"missing {sorted(set(built.state) - set(ours))}, "
        f"extra {sorted(set(ours) - set(built.state))}")
    fresh = copy.deepcopy(built.model)
    fresh.load_state_dict(ours)  # strict


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.offset


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_tied_parameter_keeps_both_names(method: str) -> None:
    model = Tied()
    x = torch.randint(0, 10, (2, 3))
    gm = qc.qcompile(model, {"trace": {"method": method}}, example_inputs=(x,))
    assert torch.equal(gm(x), model(x))
    assert sorted(gm.state_dict()) == ["emb.weight", "head.weight"]  # order is not a contract
    assert gm.get_parameter("emb.weight") is gm.get_parameter("head.weight")  # still tied


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_non_persistent_buffer_stays_out_of_state_dict(method: str) -> None:
    model = WithBuffer()
    x = torch.randn(2, 4)
    gm = qc.qcompile(model, {"trace": {"method": method}}, example_inputs=(x,))
    assert torch.equal(gm(x), model(x))
    assert list(gm.state_dict()) == ["fc.weight", "fc.bias"]
    assert "offset" in dict(gm.named_buffers())
    # a deep copy (GraphModule rebuilds its root there) keeps it out, and the graph's own
    # device anchor too (export): the copy and the original load each other's state
    twice = copy.deepcopy(copy.deepcopy(gm))
    assert list(twice.state_dict()) == ["fc.weight", "fc.bias"]
    twice.load_state_dict(gm.state_dict())  # strict
    assert torch.equal(twice(x), model(x))


# -- 4. int8 QAT: weight quantizers, training, gradients ----------------------------------

def test_int8_qat_quantizes_every_linear_weight(built: Built,
                                                gm_qat: torch.fx.GraphModule) -> None:
    qs = qc.quantizers(gm_qat)
    names = linears(built.model)
    assert names  # every model has at least one Linear (GPT-2: lm_head)
    for n in names:
        fq = qs.get(f"{n}.weight_fake_quant")
        assert fq is not None, f"{n}.weight_fake_quant missing"
        w = built.model.get_submodule(n).weight
        assert fq.axis == 0 and fq.scale.numel() == w.shape[0]
    records = {q.name: q for q in qc.report(gm_qat).quantizers}
    assert {f"{n}.weight_fake_quant" for n in names} <= {
        k for k, q in records.items() if q.role == "weight"}


def test_int8_qat_trains_and_gradients_reach_what_fp32_reaches(
        built: Built, gm_qat: torch.fx.GraphModule) -> None:
    kw, key = built.case.kwargs, built.case.key
    gm_qat.train()
    fp32 = copy.deepcopy(built.model).train()
    torch.manual_seed(0)
    with torch.no_grad():
        target = torch.randn_like(main(fp32(**kw), key))

    torch.manual_seed(3)
    ((main(fp32(**kw), key) - target) ** 2).mean().backward()
    # a parameter tied under several names (GPT-2: wte / lm_head) is one parameter
    aliases: dict[int, list[str]] = {}
    for n, p in fp32.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    reached = [aliases[id(p)] for p in fp32.parameters()
               if p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0]
    assert reached
    ours = dict(gm_qat.named_parameters(remove_duplicate=False))

    opt = torch.optim.Adam(gm_qat.parameters(), lr=1e-3)
    losses = []
    for step in range(6):  # 5 Adam steps, then the loss they led to
        torch.manual_seed(3)  # the same dropout masks every step: a deterministic loss
        loss = ((main(gm_qat(**kw), key) - target) ** 2).mean()
        losses.append(loss.item())
        if step == 5:
            break
        opt.zero_grad()
        loss.backward()
        if step == 0:
            missing = []
            for names in reached:
                grads = [ours[n].grad for n in names if n in ours]
                if not grads or any(g is None or not g.abs().sum() > 0 for g in grads):
                    missing.append(names[0])
            assert not missing, f"no gradient reaches {missing}"
        opt.step()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
    # training the graph left the model alone
    for k, v in built.model.state_dict().items():
        assert torch.equal(v, built.state[k]), k


# -- 5. a rule selects exactly the layers under a name glob -------------------------------

@pytest.fixture(scope="module")
def gm_glob(built: Built) -> torch.fx.GraphModule:
    case = built.case
    spec = {"quant": {"mode": "qat", "rules": [{
        "match": {"module": case.weighted, "name": case.glob},
        "weight": {"dtype": "int8", "granularity": "per_channel"},
        "activation": {"dtype": "uint8", "symmetric": False}}]}}
    return qc.qcompile(built.model, spec, example_kwargs=case.kwargs)


def test_rule_selects_exactly_the_layers_under_the_glob(
        built: Built, gm_glob: torch.fx.GraphModule) -> None:
    case = built.case
    everywhere = linears(built.model, case.weighted)
    chosen = [n for n in everywhere if fnmatchcase(n, case.glob)]
    assert chosen and len(chosen) < len(everywhere)  # the glob really selects a subset
    r = qc.report(gm_glob)
    weights = {q.name for q in r.quantizers if q.role == "weight"}
    assert weights == {f"{n}.weight_fake_quant" for n in chosen}
    assert set(r.rule_matches) == {0}
    qs = qc.quantizers(gm_glob)
    for n in chosen:
        fq = qs[f"{n}.weight_fake_quant"]
        w = built.model.get_submodule(n).weight
        if case.weighted == "Conv1D":  # HF Conv1D stores its weight as [in, out]
            assert fq.axis == 1
            assert fq.scale.numel() == built.model.get_submodule(n).nf == w.shape[1]
        else:
            assert fq.axis == 0
            assert fq.scale.numel() == w.shape[0]
    if case.weighted == "Linear":
        # one activation quantizer per selected layer, at its output, and nothing else
        acts = {q.name for q in r.quantizers if q.role == "activation"}
        assert acts == {f"{n}.output_fake_quant" for n in chosen}
        assert len(r.rule_matches[0]) == len(chosen)


def test_conv1d_output_quantized_once() -> None:
    """An activation scheme on a layer quantizes the layer's output once (as a fused
    integer kernel produces it): for GPT-2's Conv1D, ``<layer>.output_fake_quant`` only.

    matching.candidate() accepts both the addmm (a weighted call) and the view that
    returns it (module_output), so insert_quant._activations puts
    ``<layer>.addmm_fake_quant`` and ``<layer>.output_fake_quant`` on one layer."""
    torch.manual_seed(0)
    model = _gpt2()
    spec = {"quant": {"mode": "qat", "rules": [{
        "match": {"module": "Conv1D", "name": "transformer.h.0.*"},
        "weight": {"dtype": "int8", "granularity": "per_channel"},
        "activation": {"dtype": "uint8", "symmetric": False}}]}}
    gm = qc.qcompile(model, spec, example_kwargs={"input_ids": IDS})
    chosen = [n for n in linears(model, "Conv1D") if fnmatchcase(n, "transformer.h.0.*")]
    acts = {q.name for q in qc.report(gm).quantizers if q.role == "activation"}
    assert acts == {f"{n}.output_fake_quant" for n in chosen}


# -- 6. w4a8-qat ----------------------------------------------------------------------------

def test_w4a8_qat_compiles_and_trains(built: Built) -> None:
    m, kw, key = built.model, built.case.kwargs, built.case.key
    names = linears(m)
    assert all(m.get_submodule(n).in_features % 32 == 0 for n in names)
    gm = qc.qcompile(m, "w4a8-qat", example_kwargs=kw)
    qs = qc.quantizers(gm)
    for n in names:
        fq = qs[f"{n}.weight_fake_quant"]
        w = m.get_submodule(n).weight
        assert fq.group_size == 32 and fq.quant_min == -8 and fq.quant_max == 7
        assert fq.scale.numel() == w.numel() // 32
    gm.train()
    torch.manual_seed(0)
    out = gm(**kw)
    assert main(out, key).shape == main(m(**kw), key).shape
    # every float output (BERT/ViT: the pooler too), so every Linear gets a gradient
    sum(v.square().mean() for v in out.values() if v.is_floating_point()).backward()
    for n in names:
        g = gm.get_parameter(f"{n}.weight").grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


# -- 7. symbolic and export graphs of the same model agree --------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = Block()
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.inp(x))))


def test_symbolic_and_export_agree_on_a_traceable_model() -> None:
    """Same model, same rules (``int8-qat``: Linear weights/outputs, ``add`` outputs, plus a
    named rule on ``block.*``): both front ends create quantizers with the same names and
    the same rule matches. Then, with both graphs in eval mode, one call on the same input
    ``x1`` updates every observer identically (equal scale and zero_point, quantizer by
    quantizer), and a second call on ``x2`` gives outputs that agree within 1e-6."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 4)
    quant = qc.load_spec("int8-qat").quant.model_dump()
    quant["rules"].insert(0, {"match": {"module": "Linear", "name": "block.*"},
                              "weight": {"dtype": "int4", "granularity": "per_channel"}})
    gms = {}
    for method in ("symbolic", "export"):
        spec = {"quant": quant, "trace": {"method": method}}
        gms[method] = qc.qcompile(model, spec, example_inputs=(x,))
        assert qc.report(gms[method]).trace_method == method
    sym, exp = gms["symbolic"], gms["export"]
    rs, re_ = qc.report(sym), qc.report(exp)
    names = sorted(q.name for q in rs.quantizers)
    assert names == sorted(q.name for q in re_.quantizers)
    assert {"block.fc1.weight_fake_quant", "block.fc2.weight_fake_quant",
            "block.output_fake_quant", "inp.weight_fake_quant",
            "head.weight_fake_quant"} <= set(names)
    assert {q.name: (q.rule, q.dtype) for q in rs.quantizers} == {
        q.name: (q.rule, q.dtype) for q in re_.quantizers}
    assert {i: len(v) for i, v in rs.rule_matches.items()} == {
        i: len(v) for i, v in re_.rule_matches.items()}

    # the export graph is specialised to the example's shape (no trace.dynamic_dims)
    x1, x2 = torch.randn(5, 4), torch.randn(5, 4)
    sym.eval()
    exp.eval()
    with torch.no_grad():
        sym(x1)
        exp(x1)
        qs, qe = qc.quantizers(sym), qc.quantizers(exp)
        for n in names:
            assert torch.equal(qs[n].scale, qe[n].scale), n
            assert torch.equal(qs[n].zero_point, qe[n].zero_point), n
        out_s, out_e = sym(x2), exp(x2)
    assert (out_s - out_e).abs().max().item() <= 1e-6
    assert not torch.equal(out_s, model.eval()(x2))  # quantization did something


# -- 8. Python control flow on shapes -------------------------------------------------------

class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 4:  # symbolic tracing cannot branch on a Proxy
            return torch.relu(self.fc(x))
        return x


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.gate = Gate()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.inp(x)))


def test_shape_control_flow_export_or_leaf_modules() -> None:
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(3, 4)
    ref = model(x)

    with pytest.raises(qc.QCompileError, match="leaf_modules") as info:
        qc.qcompile(model, {"trace": {"method": "symbolic"}}, example_inputs=(x,))
    assert "'gate' (Gate)" in str(info.value)

    gm = qc.qcompile(model, NONE, example_inputs=(x,))
    assert qc.report(gm).trace_method == "export"
    assert torch.equal(gm(x), ref)
    gm = qc.qcompile(model, "int8-qat", example_inputs=(x,))
    assert qc.report(gm).trace_method == "export"
    assert "gate.fc.weight_fake_quant" in qc.quantizers(gm)

    for leaf in ("gate", "Gate"):  # a qualified name or a class name
        spec = {"trace": {"method": "symbolic", "leaf_modules": [leaf]}}
        gm = qc.qcompile(model, spec, example_inputs=(x,))
        assert qc.report(gm).trace_method == "symbolic"
        assert "gate" in [n.target for n in gm.graph.nodes if n.op == "call_module"]
        assert torch.equal(gm(x), ref)
    spec = spec_with("int8-qat", trace={"method": "symbolic", "leaf_modules": ["gate"]})
    gm = qc.qcompile(model, spec, example_inputs=(x,))
    qs = qc.quantizers(gm)
    assert {"inp.weight_fake_quant", "head.weight_fake_quant"} <= set(qs)
    assert "gate.fc.weight_fake_quant" not in qs  # a leaf stays one float node
    gm(x).sum().backward()
    assert model.inp.weight.grad is None  # the graph trains its own copy


# -- 9. nested outputs ------------------------------------------------------------------------

class Dicty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        t = self.fc(x)
        return {"a": t, "b": (t * 2, t + 1)}


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_dict_tuple_outputs_keep_their_structure(method: str) -> None:
    torch.manual_seed(0)
    model = Dicty()
    x = torch.randn(3, 4)
    gm = qc.qcompile(model, {"trace": {"method": method}}, example_inputs=(x,))
    assert qc.report(gm).trace_method == method
    out = gm(x)
    assert isinstance(out, dict) and list(out) == ["a", "b"]
    assert isinstance(out["b"], tuple) and len(out["b"]) == 2
    assert_same_output(out, model(x))
    gm = qc.qcompile(model, spec_with("int8-qat", trace={"method": method}),
                     example_inputs=(x,))
    out = gm(x)
    assert isinstance(out, dict) and list(out) == ["a", "b"]
    assert isinstance(out["b"], tuple) and len(out["b"]) == 2
    assert out["a"].shape == (3, 4)


# -- 10. dynamic dimensions ---------------------------------------------------------------------

DYNAMIC = {"dynamic_dims": {"input_ids": {0: "batch", 1: "seq"}}}


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    torch.manual_seed(0)
    return _llama().eval()


def test_dynamic_dims_one_graph_many_shapes(llama: nn.Module) -> None:
    gm = qc.qcompile(llama, {"quant": {"mode": "none"}, "trace": DYNAMIC},
                     example_kwargs={"input_ids": IDS})
    gm.eval()
    gen = torch.Generator().manual_seed(1)
    for shape in ((2, 16), (3, 9), (5, 30)):
        ids = torch.randint(0, 100, shape, generator=gen)
        with torch.no_grad():
            out, ref = gm(input_ids=ids), llama(input_ids=ids)
        assert out.logits.shape == (*shape, 100)
        assert_same_output(out, ref)

    gm = qc.qcompile(llama, spec_with("int8-qat", trace=DYNAMIC),
                     example_kwargs={"input_ids": IDS})
    ids = torch.randint(0, 100, (3, 9), generator=gen)
    out = gm(input_ids=ids).logits
    assert out.shape == (3, 9, 100) and torch.isfinite(out).all()
    with torch.no_grad():
        ref = llama(input_ids=ids).logits
    assert not torch.equal(out, ref)  # fake-quant is in the graph
    out.square().mean().backward()
    assert gm.get_parameter("model.layers.0.self_attn.q_proj.weight").grad is not None


@pytest.mark.parametrize("shape", [(1, 16), (2, 1)], ids=["batch1", "seq1"])
def test_dynamic_dims_refuse_size_one_examples(llama: nn.Module, shape: tuple[int, int]) -> None:
    ids = torch.randint(0, 100, shape)
    with pytest.raises(qc.QCompileError, match=r"trace\.dynamic_dims") as info:
        qc.qcompile(llama, {"trace": DYNAMIC}, example_kwargs={"input_ids": ids})
    assert "size >= 2" in str(info.value)


def test_dynamic_dims_unknown_input_is_named(llama: nn.Module) -> None:
    spec = {"trace": {"dynamic_dims": {"ids": {0: "batch"}}}}
    with pytest.raises(qc.QCompileError, match=r"trace\.dynamic_dims names \['ids'\]"):
        qc.qcompile(llama, spec, example_kwargs={"input_ids": IDS})


@pytest.mark.parametrize("name", ["batch size", "1seq", "seq-len", ""])
def test_dynamic_dim_names_must_be_identifiers(name: str) -> None:
    with pytest.raises(ValidationError, match="dynamic_dims"):
        qc.CompileSpec.model_validate({"trace": {"dynamic_dims": {"input_ids": {0: name}}}})
    ok = qc.CompileSpec.model_validate({"trace": DYNAMIC})
    assert ok.trace.dynamic_dims == {"input_ids": {0: "batch", 1: "seq"}}


def test_dynamic_dims_on_bert() -> None:
    """BERT slices its position_ids buffer to the sequence length, so torch.export guards
    ``seq <= 64``: an unbounded dynamic ``seq`` is a QCompileError that names
    trace.dynamic_dims and the bound 64 (the bounded spec below compiles)."""
    torch.manual_seed(0)
    model = _bert().eval()
    with pytest.raises(qc.QCompileError) as info:
        qc.qcompile(model, {"trace": DYNAMIC}, example_kwargs={"input_ids": IDS})
    assert "trace.dynamic_dims" in str(info.value) and "64" in str(info.value), str(info.value)


def test_bounded_dynamic_dims_on_bert() -> None:
    """The bound torch.export asks for is written in the spec: {name: seq, max: 64}."""
    torch.manual_seed(0)
    model = _bert().eval()
    dims = {"input_ids": {0: "batch", 1: {"name": "seq", "max": 64}}}
    gm = qc.qcompile(model, {"trace": {"method": "export", "dynamic_dims": dims}},
                     example_kwargs={"input_ids": IDS})
    gm.eval()
    for shape in ((3, 9), (2, 40)):
        ids = torch.randint(0, 100, shape)
        with torch.no_grad():
            assert_same_output(gm(input_ids=ids), model(input_ids=ids))


# -- 11. a 2-stage pipeline split of each model matches the unsplit graph ----------------------

def test_two_stage_pipeline_matches_unsplit(built: Built) -> None:
    """Every model splits into two stages (cost-balanced by parameters) whose composition
    gives the unsplit graph's outputs bit for bit, with int8-qat quantizers frozen."""
    kw = built.case.kwargs
    spec = spec_with("int8-qat").model_dump()
    flat = qc.qcompile(built.model, spec, example_kwargs=kw)
    spec["pipeline"] = {"stages": 2}
    piped = qc.qcompile(built.model, spec, example_kwargs=kw)
    assert [name for name, _ in piped.named_children()] == ["stage_0", "stage_1"]
    flat.eval()
    flat(**kw)  # observe once, then freeze both with the same qparams
    qc.freeze(flat)
    piped.load_state_dict(flat.state_dict())
    qc.freeze(piped)
    piped.eval()
    with torch.no_grad():
        assert_same_output(piped(**kw), flat(**kw))
    stages = qc.report(piped).stages
    assert len(stages) == 2 and all(s.nodes > 0 for s in stages)
    assert stages[0].bytes_out == stages[1].bytes_in > 0
