"""Every module's docstring example runs and shows what it claims."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import qcompile

# Package __init__ files that only describe their package (their modules carry examples).
NO_EXAMPLE = {"qcompile.tools", "qcompile.graph", "qcompile.runtime", "qcompile.deploy"}


def _modules() -> list[str]:
    """Every library module, sub-packages included (walked recursively)."""
    names = {"qcompile"}
    for pkg in ("qcompile", "qcompile.passes", "qcompile.specs", "qcompile.tools"):
        mod = importlib.import_module(pkg)
        names.add(pkg)
        names |= {m.name for m in pkgutil.walk_packages(mod.__path__, prefix=f"{pkg}.")}
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no module docstring"
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
    if name not in NO_EXAMPLE:
        assert result.attempted > 0, f"{name} has no runnable docstring example"


def test_package_lists_public_names() -> None:
    for name in ("qcompile", "report", "quantizers", "freeze", "calibrate", "FakeQuantize",
                 "QCompileError", "load_spec", "CompileSpec", "save_adapters", "merge_adapters",
                 "search", "save_spec"):
        assert hasattr(qcompile, name), name
