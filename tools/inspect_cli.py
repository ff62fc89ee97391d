"""``qcompile-inspect``: the graph dump tool (its subcommands are still being built).

Example:
    >>> from qcompile.tools.inspect_cli import main
    >>> main(["--version"])  # doctest: +ELLIPSIS
    qcompile-inspect ...
    0
"""

from __future__ import annotations

import argparse
import sys

from qcompile import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qcompile-inspect",
                                     description="Inspect what qcompile does to a model.")
    parser.add_argument("--version", action="store_true", help="print the version")
    args = parser.parse_args(argv)
    if args.version:
        print(f"qcompile-inspect {__version__}")
        return 0
    print("qcompile-inspect: subcommands (validate, show, explain, passes, sqnr) are not "
          "available in this version yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
