"""Results out: the one output sink of ``qcompile-inspect`` and ``qcompile-bench``.

A command builds structured results (dicts, lists, pydantic models; rows are dicts) and
hands them to a ``Sink`` together with how people should read them. The sink is the only
place that writes results: JSON (``format="json"``: the data, behind the sink's header
keys, indented, pydantic models dumped, anything else ``str``-ed) or text (the command's
own text, or a renderer applied to the data, by default ``records``). Results go to
stdout; diagnostics go to stderr through ``note``.

Renderers: ``table`` (aligned columns, one row per dict) and ``records`` (one line per
named record, ``name: key value, ...``, numbers to 3 significant digits).

Example:
    >>> from qcompile.tools.output import Sink, records, table
    >>> rows = [{"node": "fc", "sqnr_db": 31.5}, {"node": "conv1", "sqnr_db": None}]
    >>> print(table(rows, ["node", "sqnr_db"]))
    node   sqnr_db
    fc     31.5
    conv1
    >>> Sink("text").emit({"mlp": {"qcompile_s": 0.012345, "kernels": 4}, "note": "ok"})
    mlp: qcompile_s 0.0123, kernels 4
    note: ok
    >>> Sink("json", header={"tool": 1}).emit({"layers": rows}, "ignored in JSON")
    {
      "tool": 1,
      "layers": [
        {
          "node": "fc",
          "sqnr_db": 31.5
        },
        {
          "node": "conv1",
          "sqnr_db": null
        }
      ]
    }
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("text", "json")

Text = str | Callable[[Any], str] | None


def plain(value: Any) -> Any:
    """``value`` with a pydantic model (anything with ``model_dump``) as its JSON-mode dict;
    everything else unchanged."""
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else value


def _json_default(value: Any) -> Any:
    dumped = plain(value)
    return str(value) if dumped is value else dumped


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float as the string ``"inf"``, ``"-inf"`` or
    ``"nan"``: Python's ``Infinity`` / ``NaN`` tokens are not JSON, and jq, browsers and
    ``json.loads(..., parse_constant=...)``-less readers reject them (an SQNR of a layer
    without error is ``inf``)."""
    value = plain(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def to_json(data: Any, header: Mapping[str, Any] | None = None) -> str:
    """``data`` as indented, strict JSON (non-finite floats as ``"inf"`` / ``"-inf"`` /
    ``"nan"`` strings); ``header`` keys come first in a top-level object.

    >>> to_json({"sqnr_db": float("inf")}).replace("\\n", " ")
    '{   "sqnr_db": "inf" }'
    """
    data = _strict(data)
    if header:
        data = {**header, **data}
    return json.dumps(data, indent=2, default=_json_default, allow_nan=False)


def table(rows: Sequence[Any], columns: Sequence[str]) -> str:
    """Aligned columns, a header line, one line per row (``None`` prints as nothing)."""
    dicts = [plain(r) for r in rows]
    cells = [[("" if r[c] is None else str(r[c])) for c in columns] for r in dicts]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def records(data: Mapping[str, Any]) -> str:
    """One line per entry of ``data``: ``name: key value, ...`` for a record (its numeric
    fields, to 3 significant digits), ``name: value`` for a string or a number."""
    lines = []
    for name, row in plain(data).items():
        row = plain(row)
        if isinstance(row, Mapping):
            cells = ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                              if isinstance(v, (int, float)))
            lines.append(f"{name}: {cells}")
        else:
            lines.append(f"{name}: {row if isinstance(row, str) else format(row, '.3g')}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Sink:
    """Where a command's results go: one format (``text`` or ``json``) and the keys that
    head every JSON object (e.g. ``{"qcompile_inspect": 1}``)."""

    format: str = "text"
    header: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {', '.join(FORMATS)}")

    def render(self, data: Any, text: Text = None) -> str:
        """JSON of ``data``, or for text: ``text`` itself if a string, ``text(data)`` if a
        renderer, else ``records(data)``."""
        if self.format == "json":
            return to_json(data, self.header)
        if isinstance(text, str):
            return text
        return (text or records)(plain(data))

    def emit(self, data: Any, text: Text = None) -> None:
        """Print ``render(data, text)`` to stdout."""
        print(self.render(data, text))


def note(message: str) -> None:
    """A diagnostic for people, on stderr (never mixed into results)."""
    print(message, file=sys.stderr)
