"""Every module's docstring example runs and shows what it claims."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import qcompile


def _modules() -> list[str]:
    names = ["qcompile"]
    for pkg in ("qcompile", "qcompile.passes", "qcompile.specs", "qcompile.tools"):
        mod = importlib.import_module(pkg)
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(mod.__path__)
                  if not m.ispkg and f"{pkg}.{m.name}" not in names]
    return sorted(set(names) - {"qcompile.passes", "qcompile.specs", "qcompile.tools"}
                  | {"qcompile.passes", "qcompile.specs"})


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no module docstring"
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
    if name != "qcompile.tools":
        assert result.attempted > 0, f"{name} has no runnable docstring example"


def test_package_lists_public_names() -> None:
    for name in ("qcompile", "report", "quantizers", "freeze", "calibrate", "FakeQuantize",
                 "QCompileError", "load_spec", "CompileSpec"):
        assert hasattr(qcompile, name), name
