"""Why symbolic tracing could not follow a forward, in words a user understands.

torch.fx reports what broke inside torch.fx (``co_varnames is too small``, ``Proxy object
cannot be iterated``); ``explain`` says what the model's code does that symbolic tracing
cannot follow, and where: a forward wrapped by decorators that take ``*args, **kwargs``
(every Hugging Face model's), Python control flow on a tensor's value, ``len()`` or
iteration over a tensor, a tensor where Python needs a plain number. The location is the
last line of the model's own code in the traceback (or the forward's definition when the
failure came before any of it ran).

Example:
    >>> import torch
    >>> from qcompile.passes.trace.explain import explain
    >>> class Gate(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x if x.sum() > 0 else -x
    >>> try:
    ...     torch.fx.symbolic_trace(Gate())
    ... except Exception as e:
    ...     print(explain(e, Gate.forward).what)
    branches on a tensor's value in Python (if / while / and / or on a traced tensor)
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import qcompile.errors

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# our own frames (the tracer subclass, the hook runner) are not the model's code
_OUR_DIRS = tuple(os.path.dirname(os.path.abspath(p)) + os.sep for p in (
    os.path.dirname(os.path.abspath(__file__)), qcompile.errors.__file__))
_SKIP_FILES = (inspect.__file__, functools.__file__)

# (text in torch.fx's first error line, what the model does), first match wins
_KNOWN: tuple[tuple[str, str], ...] = (
    ("cannot be used as inputs to control flow",
     "branches on a tensor's value in Python (if / while / and / or on a traced tensor)"),
    ("object cannot be iterated", "iterates over or unpacks a tensor in Python"),
    ("'len' is not supported", "calls len() on a tensor"),
    ("cannot be interpreted as an integer",
     "uses a tensor where Python needs an int (range(), a size or an index)"),
    ("not 'Proxy'", "passes a tensor where Python needs a plain value: int(), float(), bool()"),
    ("is not installed as a submodule", "calls a module that is not one of its submodules"),
)


@dataclass(frozen=True)
class Explanation:
    """``what``: what the code does, a clause after the forward's name (``"branches on
    ..."``); ``where``: ``file:line `code``` of the model's line, or where the forward is
    defined, or None; ``torch``: torch.fx's own first line (``"TraceError: ..."``)."""

    what: str
    where: str | None
    torch: str

    def detail(self) -> str:
        """``"at <where>; torch.fx said: <torch>"``, the parenthesis after ``what``."""
        return "; ".join([*([self.where] if self.where else []), f"torch.fx said: {self.torch}"])


def explain(e: BaseException, forward: Callable[..., Any] | None) -> Explanation:
    """What the model's code does that symbolic tracing cannot follow, from torch.fx's
    exception ``e`` raised while tracing ``forward`` (the innermost forward being traced,
    as defined on its class; None when unknown)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    frames = traceback.extract_tb(e.__traceback__)
    decorators = _decorators(forward) if forward is not None else []
    in_signature = any(f.name in ("create_args_for_root", "_patch_function") for f in frames)
    if decorators and in_signature:
        names = " and ".join(f"{n} ({m})" if m else n for n, m in decorators)
        plural = "s" if len(decorators) > 1 else ""
        what = (f"is wrapped by the decorator{plural} {names}, which take{'' if plural else 's'}"
                " *args / **kwargs; torch.fx cannot rebuild the signature of such a wrapper")
        where = _definition(forward)
        return Explanation(what, f"defined at {where}" if where else None,
                           f"{type(e).__name__}: {first}")
    what = next((words for key, words in _KNOWN if key in first),
                "does something torch.fx cannot record")
    where = _model_line(frames)
    return Explanation(what, f"at {where}" if where else None, f"{type(e).__name__}: {first}")


def _decorators(forward: Callable[..., Any]) -> list[tuple[str, str]]:
    """(decorator, its module) for each ``functools.wraps`` layer around ``forward``."""
    out = []
    f: Any = forward
    while hasattr(f, "__wrapped__") and len(out) < 8:
        code = getattr(f, "__code__", None)
        name = code.co_qualname if code is not None and hasattr(code, "co_qualname") else (
            getattr(code, "co_name", type(f).__name__))
        module = getattr(f, "__globals__", {}).get("__name__", "")
        out.append((name.split(".<locals>")[0], module))
        f = f.__wrapped__
    return out


def _definition(forward: Callable[..., Any]) -> str | None:
    inner = inspect.unwrap(forward)
    code = getattr(inner, "__code__", None)
    if code is None:
        return None
    return f"{_short(code.co_filename)}:{code.co_firstlineno}"


def _model_line(frames: traceback.StackSummary) -> str | None:
    """The last frame of the model's own code: not torch, not qcompile, not functools."""
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if (path.startswith(_TORCH_DIR) or path.startswith(_OUR_DIRS)
                or path in _SKIP_FILES or f.filename.startswith("<")):
            continue
        line = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
        code = f" `{line}`" if line else ""
        return f"{_short(f.filename)}:{f.lineno}{code}"
    return None


def _short(filename: str) -> str:
    """A path from its package on (``transformers/models/llama/modeling_llama.py``), or
    its file name."""
    parts = filename.replace(os.sep, "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1:])
    return "/".join(parts[-2:]) if len(parts) > 1 else filename
