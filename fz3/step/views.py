"""A row's parameter views in one C++ call (``Views``), with the views a program takes of them
(a weight's ``t``, ``RowViews``): ``fz3.step.codegen`` puts them in the traced programs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch


class Views(functools.partial):
    """``row -> views`` of consecutive pieces of it, shaped as given: what
    ``FlatLayout.views``' split and views do, in one C++ call (a ``partial`` of it: no Python
    frame per call; ``RowViews`` adds one)."""

    __name__ = "views"  # a node's target needs one

    def __new__(cls, shapes: Sequence[tuple[int, ...]]):
        return super().__new__(cls, torch._C._nn.unflatten_dense_tensors,
                               tensors=[torch.empty(shape, device="meta") for shape in shapes])

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in self.keywords["tensors"]]

    def __repr__(self) -> str:
        return f"views{self.shapes}"


class RowViews(Views):
    """A parameter row's ``Views`` as a layer's programs take them (its forward, a
    recompute, its backward: ``codegen.one_call_views`` shares one between them):
    ``views(row, made)``, kept in ``made`` (the row's, a dict that its unit's memory holds,
    ``fz3.step.memory``: a unit's rows are the same tensors every step) and found there by
    the next call; ``made`` None (a trace's row, a caller without memory): made each call.
    After the views come the ``derived`` ones, views of them made with them (``derive``)."""

    def __new__(cls, shapes: Sequence[tuple[int, ...]]):
        self = super().__new__(cls, shapes)
        # (the position of the view it is taken of, the view op, its other arguments)
        self.derived: list[tuple[int, Callable, tuple]] = []
        return self

    def derive(self, source: int, op: Callable, args: tuple[Any, ...]) -> int:
        """The position among this call's results of ``op(results[source], *args)``, a view
        op on a parameter's view (a weight's ``t``, made again by each program otherwise,
        ~0.7 us a call here): made with the views. The same one asked twice (by a layer's
        forward and inference) is one."""
        spec = (source, op, args)
        if spec not in self.derived:
            self.derived.append(spec)
        return len(self.keywords["tensors"]) + self.derived.index(spec)

    def __call__(self, row: torch.Tensor, made: dict | None = None) -> tuple:
        views = None if made is None else made.get(self)
        if views is not None:
            return views
        views = super().__call__(row)
        if self.derived:  # (here, not in a method: no Python frame more per row)
            views = list(views)
            for source, op, args in self.derived:
                views.append(op(views[source], *args))
            views = tuple(views)
        if made is not None:
            made[self] = views
        return views
