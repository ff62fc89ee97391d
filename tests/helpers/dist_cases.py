"""Which worker cases a multi-process test module launches: the tests mark the cases they
read (``@uses("case")`` or a ``case`` parameter), and the module's ``dist_run`` fixture
launches only those of the tests selected in this session (all, when none is)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest


def uses(*cases: str) -> Callable[[Any], Any]:
    """Mark a test as reading ``cases`` from the launch (the fixture runs only those)."""
    def mark(fn: Any) -> Any:
        fn.dist_cases = cases
        return fn
    return mark


def _cases_of(item: pytest.Item) -> set[str]:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "case" in callspec.params:
        return {str(callspec.params["case"])}
    return set(getattr(getattr(item, "function", None), "dist_cases", ()))


def wanted_cases(request: pytest.FixtureRequest, order: Sequence[str]) -> list[str]:
    """The cases the selected tests of ``request``'s module read, in ``order``."""
    wanted = set().union(*(_cases_of(item) for item in request.session.items
                           if item.path == request.path))
    return [c for c in order if c in wanted] or list(order)
