"""``qc.search``: mixed precision under a budget (metrics, budgets, granularity, solver).

The MLP has four equal 64x64 layers, so an average of 6 bits over int4 / int8 candidates
is two layers of each; ``fc2`` is made the obviously sensitive one (large weights on dead
inputs in every group of 32: int4 per group rounds all its other weights to zero, int8
per channel keeps them), so every metric must give it int8.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from torch import nn

import qcompile as qc
from qcompile.mixed_precision import SearchDetails, solve, stored_bytes
from qcompile.specs import Scheme

INT4 = {"dtype": "int4", "granularity": "per_group", "group_size": 32}
INT8 = {"dtype": "int8", "granularity": "per_channel"}
LAYERS = ["fc1", "fc2", "fc3", "fc4"]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        for name in LAYERS:
            setattr(self, name, nn.Linear(64, 64))
        with torch.no_grad():
            # fc2: a large weight in every group of 16 columns, on inputs fc1 never feeds
            # (dead units): they set int4's per-group scale and round the rest to zero
            self.fc1.weight[::16] = 0.0
            self.fc1.bias[::16] = -1.0
            self.fc2.weight[:, ::16] = 5.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in LAYERS[:-1]:
            x = torch.relu(getattr(self, name)(x))
        return self.fc4(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(32, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(F.layer_norm(x, x.shape[-1:]))
        return x + self.down(F.gelu(self.up(F.layer_norm(x, x.shape[-1:]))))


class Tiny(nn.Module):
    """A tiny transformer-shaped stack: embedding, two repeated blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 50)
        with torch.no_grad():  # the second block's down projection: as MLP's fc2
            block = self.layers[1]
            block.up.weight[::16] = 0.0
            block.up.bias[::16] = -10.0
            block.down.weight[:, ::16] = 5.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def spec_of(metric: str = "sqnr", budget: dict | None = None, **search: Any) -> dict:
    return {"quant": {
        "mode": "static",
        "rules": [{"match": {"module": "Linear"}, "weight": INT8,
                   "activation": {"dtype": "uint8", "symmetric": False}}],
        "search": {"candidates": [{"weight": INT4}, {"weight": INT8}],
                   "budget": budget or {"avg_weight_bits": 6.0}, "metric": metric,
                   **search}}}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, target): the target is the float model's output plus noise, so the loss has a
    gradient at the float weights (fisher)."""
    g = torch.Generator().manual_seed(2)
    model = MLP().eval()
    out = []
    for _ in range(3):
        x = torch.randn(16, 64, generator=g)
        with torch.no_grad():
            out.append((x, model(x) + 0.5 * torch.randn(16, 64, generator=g)))
    return out


class Counted:
    """``loss_fn(output, batch)``: MSE to the batch's target, counting its calls (one per
    forward of the model copy the search runs)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        self.calls += 1
        return F.mse_loss(output, batch[1])


def inputs(data: list) -> list[tuple[torch.Tensor]]:
    return [(x,) for x, _ in data]


def run(model: nn.Module, spec: dict, data: list, metric: str, loss_fn: Any = None
        ) -> tuple[qc.CompileSpec, SearchDetails]:
    if metric == "sqnr":  # the model takes x only: the batches are its inputs
        return qc.search(model, spec, inputs(data), details=True)
    # loss / fisher: batches with targets; the model gets the inputs through a wrapper
    return qc.search(Pair(model), spec, data, loss_fn=loss_fn or Counted(), details=True)


class Pair(nn.Module):
    """Takes (x, target) batches, computes the model on x (its layers are ``net.*``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# What qc.convert stores for a 64x64 weight, written out (the module docstring's formula):
# int4 per group of 32: 4096 / 2 bytes of elements, 128 float16 scales, one int32 zero
# point (symmetric); int8 per channel: 4096 bytes, 64 float32 scales, one int32 zero point.
BYTES_64x64 = (64 * 64 // 2 + 64 * 64 // 32 * 2 + 4, 64 * 64 + 64 * 4 + 4)


EPS = torch.finfo(torch.float32).eps


def _int4_per_group(w: torch.Tensor) -> torch.Tensor:
    g = w.reshape(w.shape[0], -1, 32)
    scale = (g.abs().amax(-1, keepdim=True) / 7).clamp_min(EPS)  # all-zero groups
    return (torch.clamp(torch.round(g / scale), -8, 7) * scale).reshape(w.shape)


def _int8_per_channel(w: torch.Tensor) -> torch.Tensor:
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(EPS)
    return torch.clamp(torch.round(w / scale), -128, 127) * scale


def reference_sqnr_scores(data: list) -> dict[str, tuple[float, float]]:
    """Per layer, for int4 per group and int8 per channel: the noise energy of the layer's
    output with the quantized weight over the float output's energy, over all batches,
    each layer fed what the float model gives it (float64 sums)."""
    model = MLP().eval()
    noise = {n: [0.0, 0.0] for n in LAYERS}
    signal = dict.fromkeys(LAYERS, 0.0)

    def hook(name: str):
        def record(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            signal[name] += float(out.double().square().sum())
            for c, q in enumerate((_int4_per_group, _int8_per_channel)):
                o = F.linear(args[0], q(m.weight), m.bias)
                noise[name][c] += float((o.double() - out.double()).square().sum())
        return record

    for name in LAYERS:
        getattr(model, name).register_forward_hook(hook(name))
    with torch.no_grad():
        for (x,) in data:
            model(x)
    return {n: (noise[n][0] / signal[n], noise[n][1] / signal[n]) for n in LAYERS}


@pytest.fixture(scope="module")
def data() -> list:
    return batches()


@pytest.fixture(scope="module")
def searched(data: list) -> dict[str, tuple[qc.CompileSpec, SearchDetails, dict]]:
    """One search per metric (shared by the tests), with its loss_fn call count and the
    model it searched (in training mode, as given)."""
    out = {}
    for metric in ("sqnr", "fisher", "loss"):
        counted = Counted()
        model = MLP().train()
        found, info = run(model, spec_of(metric), data, metric, counted)
        out[metric] = (found, info, {"loss_calls": counted.calls, "model": model})
    return out


def layer_names(metric: str) -> list[str]:
    return LAYERS if metric == "sqnr" else [f"net.{n}" for n in LAYERS]


@pytest.mark.parametrize("metric", ["sqnr", "fisher", "loss"])
def test_budget_mixes_bits_and_keeps_the_sensitive_layer_int8(searched: dict,
                                                              metric: str) -> None:
    found, info, _ = searched[metric]
    names = layer_names(metric)
    assert info.metric == metric and info.granularity == "layer"
    assert info.candidates == ["int4/per_group32", "int8/per_channel"]
    assert info.bits == [4.0, 8.0]
    assert [g.name for g in info.groups] == names
    assert info.avg_weight_bits <= 6.0 + 1e-9
    assert info.avg_weight_bits == pytest.approx(6.0)  # the budget is worth spending
    sensitive = names[1]
    assert info.chosen[sensitive] == 1, (metric, info.chosen,
                                         {g.name: g.scores for g in info.groups})
    # the sensitive layer is the one int4 hurts most
    gap = {g.name: g.scores[0] - g.scores[1] for g in info.groups}
    assert max(gap, key=gap.get) == sensitive
    # the spec: search gone, one rule per layer before the original rule
    assert found.quant.search is None
    assert len(found.quant.rules) == len(names) + 1
    for rule in found.quant.rules[:-1]:
        (layer,) = rule.match.name
        assert rule.weight == Scheme.model_validate([INT4, INT8][info.chosen[layer]])
        assert rule.activation == Scheme(dtype="uint8", symmetric=False)
        assert rule.note.startswith(f"qc.search, metric {metric}")
    assert found.quant.rules[-1].optional  # every Linear it matched has a rule above it


def test_details_are_consistent(searched: dict) -> None:
    _, info, _ = searched["sqnr"]
    assert info.batches == 3 and info.ranks == 1
    assert set(info.seconds) >= {"scoring", "solving"}
    assert all(v >= 0 for v in info.seconds.values())
    assert [g.parameters for g in info.groups] == [64 * 64] * 4
    chosen_error = sum(g.scores[info.chosen[g.name]] for g in info.groups)
    assert info.predicted_error == pytest.approx(chosen_error)
    want_bytes = sum(BYTES_64x64[c] for c in info.chosen.values())
    assert info.weight_bytes == want_bytes
    reference = reference_sqnr_scores(inputs(batches()))
    for g in info.groups:  # sqnr: the score is the noise / signal ratio the dB show
        assert len(g.scores) == len(g.sqnr_db) == 2
        for score, db, want in zip(g.scores, g.sqnr_db, reference[g.name]):
            assert score == pytest.approx(want, rel=1e-4), g.name
            assert 10 * math.log10(1 / want) == pytest.approx(db, abs=1e-3)
        assert g.scores[1] < g.scores[0]  # int8 per channel beats int4 per group
    pareto = info.pareto
    assert pareto[0].avg_weight_bits == pytest.approx(4.0)
    assert pareto[-1].avg_weight_bits == pytest.approx(8.0)
    for a, b in itertools.pairwise(pareto):
        assert a.avg_weight_bits < b.avg_weight_bits
        assert a.predicted_error > b.predicted_error
    assert SearchDetails.model_validate_json(info.model_dump_json()) == info
    for metric in ("fisher", "loss"):
        assert all(g.sqnr_db is None for g in searched[metric][1].groups)


def test_fisher_costs_fewer_forwards_than_loss(searched: dict) -> None:
    fisher, loss = searched["fisher"][2]["loss_calls"], searched["loss"][2]["loss_calls"]
    assert fisher == 3  # one forward (and backward) per batch
    assert loss == 3 * (1 + 4 * 2)  # the float loss, then each layer x candidate
    assert fisher < loss


def test_found_spec_compiles_with_the_chosen_dtypes(searched: dict, data: list) -> None:
    found, info, _ = searched["sqnr"]
    model = MLP()
    gm = qc.qcompile(model, found, example_inputs=(data[0][0],))
    got = {r.node.removesuffix(".weight"): (r.dtype, r.granularity)
           for r in qc.report(gm).quantizers if r.role == "weight"}
    want = {name: ("int4", "per_group") if c == 0 else ("int8", "per_channel")
            for name, c in info.chosen.items()}
    assert got == want
    # the activation quantizers are the original spec's
    without = spec_of()
    del without["quant"]["search"]
    base = qc.qcompile(model, without, example_inputs=(data[0][0],))

    def activations(g: Any) -> list[tuple[str, str, str]]:
        return sorted((r.node, r.dtype, r.granularity) for r in qc.report(g).quantizers
                      if r.role != "weight")

    assert activations(gm) == activations(base)


@pytest.mark.parametrize("metric", ["sqnr", "fisher", "loss"])
def test_the_model_is_not_changed(searched: dict, metric: str) -> None:
    model = searched[metric][2]["model"]
    fresh = MLP().state_dict()
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(fresh[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize(("bits", "want"), [(4.0, 0), (8.0, 1)])
def test_budget_extremes_give_uniform_specs(data: list, bits: float, want: int) -> None:
    _, info = run(MLP(), spec_of(budget={"avg_weight_bits": bits}), data, "sqnr")
    assert set(info.chosen.values()) == {want}


def test_budget_below_the_cheapest_is_an_error(data: list) -> None:
    with pytest.raises(qc.QCompileError, match=r"budget\.avg_weight_bits 3\.5 is below") as e:
        run(MLP(), spec_of(budget={"avg_weight_bits": 3.5}), data, "sqnr")
    assert "(4 bits" in e.value.message and "at least 4" in e.value.fix


def test_weight_bytes_and_max_loss_increase_budgets(data: list) -> None:
    int4, int8 = BYTES_64x64
    assert (int4, int8) == tuple(stored_bytes(Scheme.model_validate(s), (64, 64))
                                 for s in (INT4, INT8))
    budget = 3 * int4 + int8 + 10  # room for one int8 layer
    _, info = run(MLP(), spec_of(budget={"weight_bytes": budget}), data, "sqnr")
    assert info.weight_bytes <= budget
    assert list(info.chosen.values()) == [0, 1, 0, 0]
    with pytest.raises(qc.QCompileError, match="weight_bytes 100 is below"):
        run(MLP(), spec_of(budget={"weight_bytes": 100}), data, "sqnr")
    # the fewest bits whose predicted loss increase stays within the bound
    _, fisher = run(MLP(), spec_of("fisher", budget={"max_loss_increase": 1.0}), data,
                    "fisher")
    scores = {g.name: g.scores for g in fisher.groups}
    bound = scores["net.fc2"][1] + sum(s[0] for n, s in scores.items() if n != "net.fc2")
    _, tight = run(MLP(), spec_of("fisher", budget={"max_loss_increase": bound * 1.0001}),
                   data, "fisher")
    assert tight.predicted_error <= bound * 1.0001
    assert tight.chosen == {"net.fc1": 0, "net.fc2": 1, "net.fc3": 0, "net.fc4": 0}
    assert set(fisher.chosen.values()) == {0}  # a loose bound: all int4


def test_granularity_block_on_a_tiny_transformer() -> None:
    ids = [(torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(i)),)
           for i in range(2)]
    # 6 bits: room for one block in int8 (5.73 bits), not for a block and the head (6.27)
    spec = spec_of(budget={"avg_weight_bits": 6.0}, granularity="block")
    found, info = qc.search(Tiny(), spec, ids, details=True)
    assert [g.name for g in info.groups] == ["layers.0", "layers.1", "head"]
    assert info.groups[0].layers == ["layers.0.attn", "layers.0.up", "layers.0.down"]
    assert info.chosen["layers.1"] == 1  # the block with the outliers
    assert info.chosen == {"layers.0": 0, "layers.1": 1, "head": 0}
    blocks = [r for r in found.quant.rules if r.match.name and r.match.name[0].endswith(".*")]
    assert sorted(r.match.name[0] for r in blocks) == ["layers.0.*", "layers.1.*"]
    assert all(r.match.module == ["Linear"] for r in blocks)
    gm = qc.qcompile(Tiny(), found, example_inputs=ids[0])
    dtypes = {r.node.removesuffix(".weight"): r.dtype for r in qc.report(gm).quantizers
              if r.role == "weight"}
    assert "embed" not in dtypes  # not a Linear: the spec's rules never quantized it
    for g in info.groups:
        want = "int8" if info.chosen[g.name] == 1 else "int4"
        assert {dtypes[layer] for layer in g.layers} == {want}


def test_a_candidate_that_does_not_fit_a_layer_is_never_chosen_for_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 64))  # 48: no groups of 32
    _, info = qc.search(model, spec_of(), [torch.randn(4, 64)], details=True)
    assert math.isinf(info.groups[1].scores[0]) and math.isfinite(info.groups[0].scores[0])
    assert info.chosen == {"0": 0, "2": 1}  # 6 bits: the layer that fits int4 takes it
    both = spec_of()
    both["quant"]["search"]["candidates"] = [
        {"weight": INT4}, {"weight": {"dtype": "int8", "granularity": "per_group",
                                      "group_size": 32}}]
    with pytest.raises(qc.QCompileError, match=r"no candidate fits group '2'.*group_size 32"):
        qc.search(model, both, [torch.randn(4, 64)])


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


class Outer(nn.Module):
    """Holds a weight of its own and a child whose weight another rule leaves alone."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.inner(x), self.w)


def test_rules_that_would_change_other_nodes_are_refused() -> None:
    spec = spec_of()
    spec["quant"]["rules"] = [
        {"match": {"name": "outer.inner"}, "activation": {"dtype": "uint8", "symmetric": False}},
        {"match": {"op": "linear", "reads_weight": True}, "weight": INT8}]
    model = nn.Sequential()
    model.add_module("outer", Outer())
    with pytest.raises(qc.QCompileError, match="would also change node") as e:
        qc.search(model, spec, [torch.randn(4, 64)])
    assert "exclude the module enclosing" in e.value.fix


def test_qcompile_refuses_a_spec_with_search() -> None:
    with pytest.raises(qc.QCompileError, match=r"quant\.search") as e:
        qc.qcompile(MLP(), spec_of(), example_inputs=(torch.randn(2, 64),))
    assert e.value.fix == ("run qc.search(model, spec, batches) first and compile the spec "
                           "it returns")


def test_loss_metric_without_a_loss_says_loss_fn(data: list) -> None:
    with pytest.raises(qc.QCompileError, match=r"no \.loss") as e:
        qc.search(MLP(), spec_of("loss"), inputs(data))
    assert "loss_fn" in e.value.fix


def test_search_stays_callable_after_importing_its_module() -> None:
    import qcompile.mixed_precision as module

    assert callable(qc.search) and module.search is qc.search
    assert module.SearchDetails is SearchDetails


@pytest.mark.parametrize(("search", "words"), [
    ({"candidates": [{"weight": INT4, "activation": {"dtype": "int8"}}, {"weight": INT8}],
      "budget": {"avg_weight_bits": 5}}, "weight scheme only"),
    ({"candidates": [{"weight": INT4}], "budget": {"avg_weight_bits": 5}}, "at least 2"),
    ({"candidates": [{"weight": INT4}, {"weight": INT4}], "budget": {"avg_weight_bits": 5}},
     "repeats candidates"),
    ({"candidates": [{"weight": INT4}, {"weight": INT8}],
      "budget": {"avg_weight_bits": 5, "weight_bytes": 10}}, "exactly one"),
    ({"candidates": [{"weight": INT4}, {"weight": INT8}], "budget": {}}, "exactly one"),
    ({"candidates": [{"weight": INT4}, {"weight": INT8}], "budget": {"max_loss_increase": 1.0}},
     "metric loss or fisher"),
])
def test_bad_search_sections_are_validation_errors(search: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        qc.CompileSpec.model_validate({"quant": {"mode": "static", "search": search}})


def test_search_needs_a_quantizing_mode() -> None:
    with pytest.raises(ValidationError, match=r"quant\.mode is none"):
        qc.CompileSpec.model_validate({"quant": {"search": {
            "candidates": [{"weight": INT4}, {"weight": INT8}],
            "budget": {"avg_weight_bits": 5}}}})


# -- the solver against brute force ------------------------------------------------------------
def brute(costs: list[list[float]], errors: list[list[float]], budget: float) -> float:
    best = math.inf
    for choice in itertools.product(*(range(len(c)) for c in costs)):
        cost = sum(costs[g][c] for g, c in enumerate(choice))
        if cost <= budget + 1e-9:
            best = min(best, sum(errors[g][c] for g, c in enumerate(choice)))
    return best


instances = st.integers(1, 5).flatmap(lambda groups: st.integers(2, 3).flatmap(
    lambda options: st.tuples(
        st.lists(st.lists(st.integers(1, 40), min_size=options, max_size=options),
                 min_size=groups, max_size=groups),
        st.lists(st.lists(st.floats(0, 10, allow_nan=False), min_size=options,
                          max_size=options), min_size=groups, max_size=groups),
        st.floats(0, 1))))


@settings(max_examples=20, deadline=None)
@given(instances)
def test_solver_is_exact_against_brute_force(instance: tuple) -> None:
    costs, errors, t = instance
    costs = [[float(c) for c in row] for row in costs]
    frontier = solve(costs, errors)
    assert frontier.merges == 0
    lo, hi = sum(min(r) for r in costs), sum(max(r) for r in costs)
    for budget in (lo, lo + t * (hi - lo), hi):
        k = frontier.within(budget)
        choice = frontier.choice(k)
        assert sum(costs[g][c] for g, c in enumerate(choice)) <= budget + 1e-9
        got = sum(errors[g][c] for g, c in enumerate(choice))
        assert got == pytest.approx(brute(costs, errors, budget), abs=1e-9)


@settings(max_examples=15, deadline=None)
@given(instances)
def test_solver_with_merged_states_keeps_its_stated_bound(instance: tuple) -> None:
    costs, errors, t = instance
    costs = [[float(c) for c in row] for row in costs]
    frontier = solve(costs, errors, cap=2)  # forces merging
    lo, hi = sum(min(r) for r in costs), sum(max(r) for r in costs)
    budget = lo + t * (hi - lo)
    k = frontier.within(budget)
    assert k is not None  # some assignment fits: the solver finds one
    choice = frontier.choice(k)
    assert sum(costs[g][c] for g, c in enumerate(choice)) <= budget + 1e-9  # always feasible
    got = sum(errors[g][c] for g, c in enumerate(choice))
    slack = frontier.merges * frontier.delta
    assert got <= brute(costs, errors, budget - slack) + 1e-9


def brute_pareto(costs: list[list[float]], errors: list[list[float]]
                 ) -> list[tuple[float, float]]:
    """Every (cost, error) total no other choice beats on both (ties: one of them)."""
    totals = {(sum(costs[g][c] for g, c in enumerate(ch)),
               sum(errors[g][c] for g, c in enumerate(ch)))
              for ch in itertools.product(*(range(len(c)) for c in costs))}
    return sorted((c, e) for c, e in totals
                  if not any(c2 <= c and e2 <= e and (c2, e2) != (c, e) for c2, e2 in totals))


tied = st.integers(1, 4).flatmap(lambda groups: st.integers(2, 3).flatmap(
    lambda options: st.tuples(
        st.lists(st.lists(st.integers(0, 3), min_size=options, max_size=options),
                 min_size=groups, max_size=groups),
        st.lists(st.lists(st.integers(0, 3), min_size=options, max_size=options),
                 min_size=groups, max_size=groups))))


@settings(max_examples=40, deadline=None)
@given(tied)
def test_solver_frontier_with_ties_is_the_brute_force_pareto_set(instance: tuple) -> None:
    """Small integer costs and errors: equal costs, equal errors and equal totals reached
    by different choices everywhere. The frontier is exactly the Pareto set (costs strictly
    rising, errors strictly falling), and each state's choice adds up to it."""
    costs = [[float(c) for c in row] for row in instance[0]]
    errors = [[float(e) for e in row] for row in instance[1]]
    frontier = solve(costs, errors)
    got = list(zip(frontier.costs.tolist(), frontier.errors.tolist()))
    assert got == brute_pareto(costs, errors)
    for i, (c, e) in enumerate(got):
        choice = frontier.choice(i)
        assert sum(costs[g][k] for g, k in enumerate(choice)) == c
        assert sum(errors[g][k] for g, k in enumerate(choice)) == e
        assert frontier.within(c) == i
        assert frontier.cheapest_under(e) == i
