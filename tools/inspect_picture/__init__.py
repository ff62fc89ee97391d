"""Pictures of a compiled graph for ``qcompile-inspect --graph svg|html|dot``.

One concern per module, used in this order: ``graph`` reads a compiled ``GraphModule``
into plain data, ``collapse`` boxes module subtrees so any model fits a screen (one box
per call of a module), ``layout`` places boxes with a pure-Python layered layout (data
flowing down the page), ``labels`` finds room for edge and group labels, and ``svg``,
``html`` and ``dot`` write the documents. No system Graphviz is needed (``dot`` is only used when
asked for with ``--layout dot``, or when it is installed).

Example:
    >>> from qcompile.tools.inspect_picture import collapse, graph, layout, svg
    >>> pg = graph.PictureGraph(nodes=[graph.PNode("x", "x", "", "input", "")], edges=[])
    >>> svg.to_svg(collapse.collapse(pg, depth=None)).startswith("<svg")
    True
"""
