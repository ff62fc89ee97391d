"""Op rules leave numerically sensitive values in float: what feeds a normalisation's
statistics (``rsqrt(variance + eps)``), a division's divisor, ``exp`` / ``log``, a
softmax's input. A rule naming the node (``match.name``) still quantizes it; the residual
add, the dividend and values that only pass on elsewhere stay quantized. Both front ends;
golden dumps of the annotations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qcompile as qc

A8 = {"dtype": "uint8", "symmetric": False}
W8 = {"dtype": "int8", "granularity": "per_channel"}


class RMSNorm(nn.Module):
    """Llama's RMSNorm, written out (the ops transformers' own RMSNorm runs)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Block(nn.Module):
    """Residual add -> RMSNorm -> attention-like scores (scaled, masked, softmax) and a
    few more sensitive ops: a divisor, exp, log."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.fc(x)  # residual add: quantized as usual
        n = self.norm(h)
        scores = torch.matmul(n, n.transpose(-1, -2)) / 4.0
        probs = torch.softmax(scores + mask, dim=-1)  # the masked add feeds softmax
        ctx = torch.matmul(probs, n)
        scale = ctx.abs().sum(-1, keepdim=True) + 1.0  # feeds the divisor
        ratio = (ctx + 2.0) / scale  # the dividend add stays quantized
        return ratio + torch.exp(n + 0.5) + torch.log(h.abs() + 1.0)


def compile_block(method: str, *extra_rules: dict):
    torch.manual_seed(0)
    model = Block()
    x, mask = torch.randn(2, 4, 8), torch.zeros(2, 4, 4)
    rules = [*extra_rules, {"match": {"module": "Linear"}, "weight": W8, "activation": A8},
             {"match": {"op": ["add", "matmul", "cat"]}, "activation": A8, "optional": True}]
    spec = {"quant": {"mode": "qat", "rules": rules}, "trace": {"method": method}}
    return qc.qcompile(model, spec, example_inputs=(x, mask)), (x, mask)


def activation_nodes(gm) -> set[str]:
    return {r.node for r in qc.report(gm).quantizers if r.role == "activation"}


def _name(target: object) -> str:
    """An op's name: ``str()`` of a builtin holds its address ("... at 0x7fadd0..."), whose
    hex digits may spell "add"."""
    return getattr(target, "__name__", str(target))


def sensitive_adds(gm) -> dict[str, str]:
    """Add nodes by what they feed, found from the graph here (not from qcompile's
    analysis): the add whose user is rsqrt / softmax / the divisor of a div / exp / log."""
    found = {}
    for node in gm.graph.nodes:
        for user in node.users:
            name = getattr(user.target, "__name__", str(user.target))
            if "add" not in _name(node.target):
                continue
            for op in ("rsqrt", "softmax", "exp", "log"):
                if op in name and user.args[0] is node:
                    found[op] = node.name
            if "div" in name and len(user.args) > 1 and user.args[1] is node:
                found["div"] = node.name
    return found


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_op_rules_leave_what_feeds_sensitive_ops_in_float(method: str) -> None:
    plain, _ = compile_block(method, {"match": {"name": "nothing"}, "skip": True,
                                      "optional": True})
    none_spec = {"quant": {"mode": "none"}, "trace": {"method": method}}
    float_gm = qc.qcompile(Block(), none_spec,
                           example_inputs=(torch.randn(2, 4, 8), torch.zeros(2, 4, 4)))
    adds = sensitive_adds(float_gm)
    assert set(adds) == {"rsqrt", "softmax", "div", "exp", "log"}, adds
    quantized = activation_nodes(plain)
    for op, node in adds.items():
        assert node not in quantized, f"{node} feeds {op} and was quantized"
    # the residual add and the dividend stay quantized: more than the sensitive ones
    rest = {n.name for n in float_gm.graph.nodes if "add" in _name(n.target)} - set(adds.values())
    assert rest and rest <= quantized, (rest, quantized)
    notes = [n for p in qc.report(plain).passes for n in p.notes if "stay in float" in n]
    assert any("feeding rsqrt" in n for n in notes), notes
    assert any("feeding softmax" in n for n in notes), notes


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_a_rule_naming_the_norm_quantizes_its_statistics(method: str) -> None:
    named, _ = compile_block(method, {"match": {"op": ["add"], "name": "norm"},
                                      "activation": A8})
    float_gm = qc.qcompile(Block(), {"quant": {"mode": "none"}, "trace": {"method": method}},
                           example_inputs=(torch.randn(2, 4, 8), torch.zeros(2, 4, 4)))
    assert sensitive_adds(float_gm)["rsqrt"] in activation_nodes(named)


def test_pad_token_rmsnorm_stays_finite_under_int8_qat() -> None:
    """The reported case: a Llama with a pad token (its embedding row is zero) trained
    with int8-qat; the second step used to quantize ``variance + eps`` to 0 (rsqrt: inf)."""
    from qcompile.tools.architectures import ARCHITECTURES

    arch = ARCHITECTURES["llama"]
    model, batch = arch.build(), arch.batch()
    assert torch.count_nonzero(model.model.embed_tokens.weight[0]) == 0
    gm = qc.qcompile(model, "int8-qat", example_kwargs=batch)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    for _ in range(3):
        loss = arch.loss(gm(**batch), batch)
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("method", ["symbolic", "export"])
def test_weight_rules_still_quantize_a_router_whose_output_feeds_softmax(method: str) -> None:
    """A weighted op whose output feeds softmax (a router): an op rule with a weight
    scheme quantizes its weight, not its output."""

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(torch.nn.functional.linear(x, self.w), dim=-1)

    spec = {"quant": {"mode": "qat", "rules": [
        {"match": {"op": ["linear"], "reads_weight": True}, "weight": W8, "activation": A8}]},
        "trace": {"method": method}}
    gm = qc.qcompile(Router(), spec, example_inputs=(torch.randn(3, 8),))
    roles = {(r.role, r.node) for r in qc.report(gm).quantizers}
    assert ("weight", "w") in roles
    assert not any(role == "activation" for role, _ in roles), roles


def test_a_required_op_rule_left_only_sensitive_nodes_says_so() -> None:
    class Norm(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    spec = {"quant": {"mode": "qat", "rules": [{"match": {"op": "add"}, "activation": A8}]}}
    with pytest.raises(qc.QCompileError, match="all feed a numerically sensitive op") as e:
        qc.qcompile(Norm(), spec, example_inputs=(torch.randn(2, 4),))
    assert "match.name" in e.value.fix
