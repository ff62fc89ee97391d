"""The pass framework: ``Pass``, ``Pipeline``, ``Context``, the ``Report`` records, the
node.meta keys (``meta``), rule matching and graph dumps.

Sub-modules are imported directly (``from qcompile.graph.pipeline import Pipeline``);
``qcompile.graph.meta`` imports nothing, so the torch-free tools can read it.
"""
