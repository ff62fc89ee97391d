"""The qcompile version (base layer: imports nothing, so every layer may read it).

Example:
    >>> from qcompile.version import __version__
    >>> __version__.count(".")
    2
"""

__version__ = "0.1.0"
