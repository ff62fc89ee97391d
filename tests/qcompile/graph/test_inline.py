"""``inline_children``: one flat graph from a graph whose blocks are child graphs, reading
the very same modules and tensors (what the exporters read of a ``data_parallel: fsdp2``
compile)."""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule, Tracer, symbolic_trace

import qcompile as qc
from qcompile.graph.inline import inline_children
from qcompile.graph.meta import BLOCKS_KEY


class Pair(nn.Module):
    """A block with two outputs (the next block reads both)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.register_buffer("shift", torch.linspace(-1, 1, 6))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.a(x) + y), self.b(y) - self.shift


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 6)
        self.blocks = nn.ModuleList([Pair(), Pair()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x)
        for block in self.blocks:
            x, y = block(x, y)
        return x * y


class _BlocksAsLeaves(Tracer):
    def is_leaf_module(self, m: nn.Module, name: str) -> bool:
        return isinstance(m, Pair) or super().is_leaf_module(m, name)


def blocked(model: Outer) -> GraphModule:
    """``model`` traced with each block a child graph ``stage_<i>`` (their names inside are
    the model's, as qcompile's block children have them)."""
    outer = GraphModule(model, _BlocksAsLeaves().trace(model))
    for i, node in enumerate(n for n in outer.graph.nodes if n.op == "call_module"
                             and isinstance(outer.get_submodule(str(n.target)), Pair)):
        prefix = str(node.target)
        child = symbolic_trace(outer.get_submodule(prefix))
        for n in child.graph.nodes:  # the model's names
            if n.op in ("get_attr", "call_module"):
                n.target = f"{prefix}.{n.target}"
        child = GraphModule(model, child.graph)
        outer.add_submodule(f"stage_{i}", child)
        node.target = f"stage_{i}"
    outer.graph.lint()
    outer.recompile()
    return outer


def test_the_flat_graph_computes_the_same_from_the_same_tensors() -> None:
    torch.manual_seed(0)
    model = Outer()
    gm = blocked(model)
    code, children = gm.code, [n for n, _ in gm.named_children()]
    flat = inline_children(gm, ["stage_0", "stage_1"])
    x = torch.randn(3, 6)
    assert torch.equal(flat(x), gm(x)) and torch.equal(flat(x), model(x))
    assert not [n for n in flat.graph.nodes if str(n.target).startswith("stage_")]
    mine = {id(t) for t in (*model.parameters(), *model.buffers())}
    assert {id(t) for t in (*flat.parameters(), *flat.buffers())} == mine  # nothing copied
    assert gm.code == code and [n for n, _ in gm.named_children()] == children


def test_order_lists_the_state_in_the_given_order() -> None:
    model = Outer()
    gm = blocked(model)
    names = [n for n, _ in model.named_parameters()]
    # the last block first, the head last (each layer's weight before its bias)
    wanted = sorted(names, key=lambda n: ("blocks.1" not in n, n.startswith("head")))
    assert [n for n, _ in inline_children(gm, ["stage_0", "stage_1"]).named_parameters()
            ] == names  # without an order: first use in the graph
    flat = inline_children(gm, ["stage_0", "stage_1"], order=wanted)
    assert [n for n, _ in flat.named_parameters()] == wanted != names


def test_a_qcompile_fsdp2_graph_flattens_to_the_model_order() -> None:
    """qc.qcompile with data_parallel fsdp2 records its blocks; flattened, the graph lists
    the state as one process's compile without that section does, and computes the same."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    x = torch.randn(4, 8)
    spec = {**qc.load_spec("int8-qat").model_dump(), "data_parallel": {"kind": "fsdp2"}}
    gm = qc.qcompile(model, spec, example_inputs=(x,))
    assert gm.meta[BLOCKS_KEY] == ["stage_0", "stage_1", "stage_2"]
    one = qc.qcompile(model, "int8-qat", example_inputs=(x,))
    flat = inline_children(gm, gm.meta[BLOCKS_KEY], order=list(gm.state_dict(keep_vars=True)))
    assert [n for n, _ in flat.named_parameters()] == [n for n, _ in one.named_parameters()]
    assert torch.equal(flat(x), one(x))
