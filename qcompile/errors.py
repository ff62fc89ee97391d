"""The one exception type users see for their own mistakes (torch-free).

Example:
    >>> from qcompile.errors import QCompileError
    >>> str(QCompileError("quant.rules[0]: matched no node", fix="set optional: true"))
    'quant.rules[0]: matched no node\\n  fix: set optional: true'
"""

from __future__ import annotations


class QCompileError(Exception):
    """A user-caused problem: the message names the spec field or graph node; ``fix`` says
    what to do about it."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message}\n  fix: {fix}")
