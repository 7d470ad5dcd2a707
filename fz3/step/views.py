"""A row's parameter views in one C++ call, with the views a program takes of them (a
weight's ``t``), kept where the row's owner keeps them: ``fz3.step.codegen`` puts them in the
traced programs, ``fz3.step.into`` takes the views of a row of a unit's gradient memory.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch


class RowViews(functools.partial):
    """``views(row, made)``: views of consecutive pieces of ``row``, shaped as given (what
    ``FlatLayout.views``' split and views do, in one C++ call: ``make``), then the
    ``derived`` ones, views of them (``derive``); kept in ``made`` (a dict of the row's, held
    by its unit's memory, ``fz3.step.memory``: a unit's rows are the same tensors every step)
    and found there by the next call. ``made`` None (a trace's row, a caller without
    memory): made each call. A layer's programs (its forward, a recompute, its backward)
    share one per row (``codegen.one_call_views``)."""

    __name__ = "views"  # a node's target needs one

    def __new__(cls, shapes: Sequence[tuple[int, ...]]):
        self = super().__new__(cls, torch._C._nn.unflatten_dense_tensors,
                               tensors=[torch.empty(shape, device="meta") for shape in shapes])
        # (the position of the view it is taken of, the view op, its other arguments)
        self.derived: list[tuple[int, Callable, tuple]] = []
        return self

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in self.keywords["tensors"]]

    def __repr__(self) -> str:
        return f"views{self.shapes}"

    def derive(self, source: int, op: Callable, args: tuple[Any, ...]) -> int:
        """The position among this call's results of ``op(results[source], *args)``, a view
        op on a parameter's view (a weight's ``t``, made again by each program otherwise,
        ~0.7 us a call here): made with the views. The same one asked twice (by a layer's
        forward and inference) is one. Asked before any call: ``joint`` rewrites all of a
        layer's programs before one runs (views kept earlier would lack it)."""
        spec = (source, op, args)
        if spec not in self.derived:
            self.derived.append(spec)
        return len(self.keywords["tensors"]) + self.derived.index(spec)

    def __call__(self, row: torch.Tensor, made: dict | None = None) -> tuple:
        views = None if made is None else made.get(self)
        if views is None:
            views = self.make(row)
            if made is not None:
                made[self] = views
        return views

    def make(self, row: torch.Tensor) -> tuple:
        views = super().__call__(row)
        if not self.derived:
            return views
        views = list(views)
        for source, op, args in self.derived:
            views.append(op(views[source], *args))
        return tuple(views)
