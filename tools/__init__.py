"""Command-line tools: ``qcompile-inspect`` and the quick-start example."""
