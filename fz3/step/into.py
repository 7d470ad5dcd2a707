"""A traced backward that writes its flat gradient into a given buffer (its unit's gradient
memory, ``fz3.step.memory``) instead of a new one: the ``flatten_dense_tensors`` that makes it is
replaced by one ``_foreach_copy_`` of the same sources, in the same order, into views of the
buffer (the same values, padding zeros included). Generated at its first call.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from .codegen import codegen, copy_graph
from .views import RowViews


class BackwardInto:
    """``backward_into(box, (row, kept), made)``: what ``backward(box, made=made)`` returns,
    its flat gradient written into ``row`` (a layer's row of its unit's gradient memory,
    ``fz3.step.memory``), the views of it made once and kept in ``kept``."""

    __slots__ = ("graph", "slow", "run", "views")

    def __init__(self, graph: fx.Graph, slow: frozenset | None):
        self.graph, self.slow = graph, slow  # the backward's, for ``codegen``
        self.run = self.views = None  # made at the first call

    @staticmethod
    def of(graph: fx.Graph, slow: frozenset | None) -> BackwardInto | None:
        """For a backward ``graph`` (after ``codegen.one_call_flatten`` and
        ``constant_factories``) whose flat gradient one flatten makes; None otherwise."""
        return None if _flatten(graph) is None else BackwardInto(graph, slow)

    def __call__(self, box: list, into: tuple, made: dict | None = None) -> tuple:
        if self.run is None:
            graph = copy_graph(self.graph)
            self.views = RowViews(flatten_into(graph))
            self.run = codegen(graph, "backward_into", boxed=True, slow=self.slow)[0]
        row, kept = into
        box.append((row, self.views(row, kept)))
        return self.run(box, made=made)


def _flatten(graph: fx.Graph) -> fx.Node | None:
    """The ``flatten_dense_tensors`` node that makes ``graph``'s first output, or None."""
    flat = next(n for n in graph.nodes if n.op == "output").args[0][0]
    is_flatten = isinstance(flat, fx.Node) and flat.target is torch._C._nn.flatten_dense_tensors
    return flat if is_flatten else None


def flatten_into(graph: fx.Graph) -> tuple[tuple[int, ...], ...]:
    """Change ``graph`` (one whose ``_flatten`` is a node) to take one more input, last,
    ``(flat, views)`` (``views``: views of ``flat`` shaped as the flatten's sources, in
    order), to copy the sources into ``views`` in one ``_foreach_copy_`` and to return
    ``flat`` for the flatten's value. Returns the sources' shapes."""
    flat = _flatten(graph)
    sources = flat.args[0]
    shapes = tuple(tuple((s.meta["val"] if isinstance(s, fx.Node) else s).shape)
                   for s in sources)
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        into = graph.placeholder("into")
    with graph.inserting_before(flat):
        views = graph.call_function(operator.getitem, (into, 1))
        # (no user: nothing here may eliminate dead code after this, which would drop it)
        graph.call_function(torch._foreach_copy_, (views, sources))
        dest = graph.call_function(operator.getitem, (into, 0))
    flat.replace_all_uses_with(dest)
    graph.erase_node(flat)
    return shapes
