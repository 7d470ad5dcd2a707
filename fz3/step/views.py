"""A row's parameter views in one C++ call (``Views``), and kept while the row lives
(``RowViews``), with the views a program takes of them (a weight's ``t``): ``fz3.step.codegen``
puts them in the traced programs.
"""

from __future__ import annotations

import functools
import weakref
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
    """A parameter row's ``Views``, made once per row tensor while it lives: a layer's
    programs (its forward, a recompute, its backward: ``codegen.one_call_views`` shares one
    between them) read the same row within a step, and a unit's rows are the same tensors
    every step (its memory, ``fz3.step.memory``). The views are of a detached alias of the
    row, so they keep neither the row alive nor, once it is gone (``forget``), its memory. A
    fake row (a trace's) is not kept. After the views come the ``derived`` ones, views of them
    made with them (``derive``)."""

    def __new__(cls, shapes: Sequence[tuple[int, ...]]):
        self = super().__new__(cls, shapes)
        self.made: dict[int, tuple] = {}  # by id(row): (a weak reference to it, its views)
        # (the position of the view it is taken of, the view op, its other arguments)
        self.derived: list[tuple[int, Callable, tuple]] = []
        return self

    def derive(self, source: int, op: Callable, args: tuple[Any, ...]) -> int:
        """The position among this call's results of ``op(results[source], *args)``, a view
        op on a parameter's view (a weight's ``t``, made again by each program otherwise,
        ~0.7 us a call here): made with the views, once per row. The same one asked twice
        (by a layer's forward and inference) is one."""
        spec = (source, op, args)
        if spec not in self.derived:
            self.derived.append(spec)
            self.made.clear()  # views made before lack it
        return len(self.keywords["tensors"]) + self.derived.index(spec)

    def __call__(self, row: torch.Tensor) -> tuple:
        made = self.made.get(id(row))
        if made is not None and made[0]() is row:
            return made[1]
        fake = type(row) is not torch.Tensor  # a trace's row: nothing kept
        views = super().__call__(row if fake else row.detach())
        if self.derived:  # (here, not in a method: no Python frame more per row)
            views = list(views)
            for source, op, args in self.derived:
                views.append(op(views[source], *args))
            views = tuple(views)
        if fake:
            return views
        key = id(row)
        self.made[key] = (weakref.ref(row, functools.partial(forget, self.made, key)), views)
        return views


def forget(made: dict, key: Any, ref: weakref.ref) -> None:
    """A weak reference's callback: its tensor is gone, so drop what ``made[key]`` kept for it
    (unless ``key`` already names a newer tensor's)."""
    if made.get(key, (None,))[0] is ref:
        del made[key]
