"""When symbolic tracing cannot follow a forward, the Report (``trace.method: auto``) and
the error (``trace.method: symbolic``) say what the code does and where, in words."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch import nn

import qcompile as qc

NONE = {"quant": {"mode": "none"}}
SYMBOLIC = {"quant": {"mode": "none"}, "trace": {"method": "symbolic"}}


def trace_notes(gm: torch.fx.GraphModule) -> list[str]:
    return [n for p in qc.report(gm).passes if p.name == "trace" for n in p.notes]


def fallback_note(gm: torch.fx.GraphModule) -> str:
    assert qc.report(gm).trace_method == "export"
    why = [n for n in trace_notes(gm) if n.startswith("captured with torch.export")]
    assert len(why) == 1, trace_notes(gm)
    return why[0]


def keeps_kwargs(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @keeps_kwargs
    def forward(self, x, **kwargs):
        return self.fc(x)


class ShapeBranch(nn.Module):  # a branch on a shape: torch.export keeps the one taken
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] > 1:
            return self.fc(x)
        return x


class Inner(nn.Module):
    def forward(self, x):
        return x[: len(x)] * 2


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = Inner()

    def forward(self, x):
        return self.inner(self.fc(x))


def _line(cls: type, text: str) -> int:
    lines, first = inspect.getsourcelines(cls)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_decorated_forward_names_the_decorator_and_the_definition() -> None:
    with pytest.raises(qc.QCompileError) as info:
        qc.qcompile(Decorated(), SYMBOLIC, example_inputs=(torch.randn(2, 4),))
    msg = info.value.message
    assert "symbolic tracing failed in the forward of Decorated: Decorated.forward" in msg
    assert "decorator keeps_kwargs" in msg and "*args / **kwargs" in msg
    assert f"defined at trace/test_fallback_note.py:{_line(Decorated, '@keeps_kwargs')}" in msg
    assert "co_varnames" in msg  # torch's own words last, for the curious


def test_branch_on_a_shape_says_control_flow_and_the_line() -> None:
    model = ShapeBranch()
    gm = qc.qcompile(model, NONE, example_inputs=(torch.randn(2, 4),))
    note = fallback_note(gm)
    assert "cannot follow ShapeBranch.forward: it branches on a tensor's value" in note
    line = _line(ShapeBranch, "if x.shape[0] > 1:")
    assert f"at trace/test_fallback_note.py:{line} `if x.shape[0] > 1:`" in note
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), model(x))  # the branch taken at capture


def test_innermost_module_is_named_and_symbolic_alone_refuses_with_the_reason() -> None:
    gm = qc.qcompile(Outer(), NONE, example_inputs=(torch.randn(2, 4),))
    assert "cannot follow Inner.forward (module 'inner'): it calls len() on a tensor" in (
        fallback_note(gm))
    with pytest.raises(qc.QCompileError) as info:
        qc.qcompile(Outer(), SYMBOLIC, example_inputs=(torch.randn(2, 4),))
    msg = info.value.message
    assert msg.startswith("symbolic tracing failed in module 'inner' (Inner): Inner.forward "
                          "calls len() on a tensor")
    assert "`return x[: len(x)] * 2`" in msg and "leaf_modules: [Inner]" in info.value.fix


def test_hugging_face_llama_note_explains_the_fallback() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 8))
    gm = qc.qcompile(model, NONE, example_kwargs={"input_ids": ids})
    note = fallback_note(gm)
    assert "it cannot follow LlamaForCausalLM.forward: it is wrapped by the decorator" in note
    assert "(transformers." in note and "*args / **kwargs" in note
    assert "defined at transformers/models/llama/modeling_llama.py:" in note
    with torch.no_grad():
        torch.testing.assert_close(gm(input_ids=ids).logits, model(input_ids=ids).logits)


class TensorConstant(nn.Module):  # torch.tensor(...) in forward: the tracer stores it
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize("inplace", [False, True])
def test_a_tensor_made_in_forward_is_not_an_assignment(inplace: bool) -> None:
    model, x = TensorConstant(), torch.randn(2, 4)
    want = model(x)
    gm = qc.qcompile(model, NONE, example_inputs=(x,), inplace=inplace)
    assert qc.report(gm).trace_method == "symbolic"
    assert torch.equal(gm(x), want)
