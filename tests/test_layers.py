"""The architecture as a test: library imports run one way, downwards, with no cycle.

Every library module (``qcompile``, ``qcompile.passes``, ``qcompile.specs``,
``qcompile.tools``) is parsed, and every import it makes — top-level *and* inside
functions, ``from x import y`` and ``import x`` alike — becomes an edge of a networkx
graph of modules. The layers, from the top:

    tools -> API (qcompile/__init__, api, compile, measure) -> distributed, deploy
          -> passes -> graph -> runtime -> specs -> errors, version

A module may import its own layer (acyclically) and any layer below; never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# package name -> folder, as pyproject.toml's package-dir maps them
PACKAGES = {"qcompile": ROOT / "qcompile", "qcompile.passes": ROOT / "passes",
            "qcompile.specs": ROOT / "specs", "qcompile.tools": ROOT / "tools"}
# higher number = higher layer; the longest matching prefix decides a module's layer
LAYERS = {
    "qcompile.errors": 0,
    "qcompile.files": 0,
    "qcompile.version": 0,
    "qcompile.specs": 1,
    "qcompile.runtime": 2,
    "qcompile.graph": 3,
    "qcompile.passes": 4,
    "qcompile.distributed": 5,
    "qcompile.deploy": 5,
    "qcompile": 6,  # the public face: __init__, api, compile, measure
    "qcompile.tools": 7,
}


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def library_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if any(part.startswith(".") for part in path.relative_to(folder).parts):
                continue
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "qcompile" and parts and f"qcompile.{parts[0]}" in PACKAGES:
                continue  # never happens with the mapping above; guards a stray copy
            modules[name] = path
    return modules


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules ``name`` imports anywhere in its file (function-local included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(target: str) -> str | None:
        # the module itself, else its longest known parent (``from pkg.mod import name``)
        while target:
            if target in known:
                return target
            target = target.rpartition(".")[0]
        return None

    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names] + [module]
        for t in targets:
            if not t.startswith("qcompile"):
                continue
            r = resolve(t)
            if r is not None and r != name:
                found.add(r)
    # ``from qcompile.x import y`` imports qcompile.x, not qcompile.x.y, unless y is a module
    return found


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    modules = library_modules()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        for target in imports_of(name, path, set(modules)):
            g.add_edge(name, target)
    return g


def test_every_package_is_seen(graph: nx.DiGraph) -> None:
    for expected in ("qcompile.errors", "qcompile.graph.pipeline", "qcompile.runtime.fake_quant",
                     "qcompile.distributed.guards", "qcompile.deploy.encodings",
                     "qcompile.passes.trace", "qcompile.passes.convert", "qcompile.specs.load",
                     "qcompile.tools.inspect_cli"):
        assert expected in graph, expected
    # the parser sees function-local imports too (a cycle could hide in one)
    assert graph.number_of_edges() > graph.number_of_nodes()


def test_no_import_cycle(graph: nx.DiGraph) -> None:
    # importing a package runs its __init__: a submodule importing its own package's
    # __init__ (or the reverse) is not a cycle Python trips on when __init__ is lazy,
    # but we forbid every cycle, so that each module can be read without the rest.
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles[:5])
    assert nx.is_directed_acyclic_graph(graph)


def test_imports_only_run_downwards(graph: nx.DiGraph) -> None:
    upward = sorted((a, b) for a, b in graph.edges if layer(b) > layer(a))
    assert not upward, "imports running upwards: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_distributed_and_deploy_do_not_import_each_other(graph: nx.DiGraph) -> None:
    def room(module: str) -> str:
        return [*module.split("."), ""][1]

    side = sorted((a, b) for a, b in graph.edges if {room(a), room(b)} == {"distributed", "deploy"})
    assert not side, side


def test_specs_never_import_torch() -> None:
    for path in PACKAGES["qcompile.specs"].rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom)}
        assert "torch" not in names, f"{path} imports torch"


# Writing a full value into an FSDP2 shard needs DTensor's own ``distribute_tensor``; the
# quantizer reaches it only for a tensor that already is a DTensor (duck-typed), i.e. only
# in a process where torch.distributed is in use. So does a quantizer on a tensor-parallel
# shard (``runtime.sharded``: the whole tensor's statistics across the tp mesh), reached
# only for DTensor inputs, imported inside its functions.
TORCH_DISTRIBUTED_ALLOWED = {"qcompile.runtime.fake_quant", "qcompile.runtime.sharded"}


def test_only_distributed_imports_torch_distributed() -> None:
    offenders = []
    for name, path in library_modules().items():
        if name.startswith(("qcompile.distributed", "qcompile.tools")):
            continue
        if name in TORCH_DISTRIBUTED_ALLOWED:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for n in ast.walk(tree):
            mods = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                    [n.module or ""] if isinstance(n, ast.ImportFrom) else [])
            if any(m == "torch.distributed" or m.startswith("torch.distributed.") for m in mods):
                offenders.append(name)
    assert not offenders, f"torch.distributed imported outside qcompile.distributed: {offenders}"


def test_the_layer_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a runtime module importing the API must be reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from qcompile.api import calibrate\n", encoding="utf-8")
    known = {"qcompile.api", "qcompile.runtime.bad"}
    edges = imports_of("qcompile.runtime.bad", bad, known)
    assert edges == {"qcompile.api"}
    assert layer("qcompile.api") > layer("qcompile.runtime.bad")
