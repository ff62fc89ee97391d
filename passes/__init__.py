"""Graph passes, one per file, each a ``qcompile.pipeline.Pass``.

Example:
    >>> from qcompile.passes import trace, fold_bn, annotate, insert_quant
    >>> [p.name for p in (trace, fold_bn, annotate, insert_quant)]
    ['trace', 'fold_bn', 'annotate', 'insert_quant']
"""

from qcompile.passes.annotate import annotate
from qcompile.passes.fold_bn import fold_bn
from qcompile.passes.insert_quant import insert_quant
from qcompile.passes.partition import partition
from qcompile.passes.place import place
from qcompile.passes.trace import trace

__all__ = ["annotate", "fold_bn", "insert_quant", "partition", "place", "trace"]
