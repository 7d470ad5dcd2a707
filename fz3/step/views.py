"""A row's parameter views in one C++ call (``Views``), and kept while the row lives
(``RowViews``): ``fz3.step.codegen`` puts them in the traced programs.
"""

from __future__ import annotations

import functools
import weakref
from typing import Sequence

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
    between them) read the same row within a step, and a one-layer unit's fixed buffer
    (``fz3.step.arena``) is the same tensor every step (a k-layer unit's rows are new each
    wait: made once per gather). The views are of a detached alias of the row, so they keep
    neither the row alive nor, once it is gone (``_forget``), its memory. A fake row (a
    trace's) is not kept."""

    def __new__(cls, shapes: Sequence[tuple[int, ...]]):
        self = super().__new__(cls, shapes)
        self.made: dict[int, tuple] = {}  # by id(row): (a weak reference to it, its views)
        return self

    def __call__(self, row: torch.Tensor) -> tuple:
        made = self.made.get(id(row))
        if made is not None and made[0]() is row:
            return made[1]
        if type(row) is not torch.Tensor:  # a trace's (fake) row: nothing kept
            return super().__call__(row)
        views = super().__call__(row.detach())
        key = id(row)
        self.made[key] = (weakref.ref(row, functools.partial(_forget, self.made, key)), views)
        return views


def _forget(made: dict, key: int, ref: weakref.ref) -> None:
    """A row is gone: drop its views (unless its id already names a newer row's)."""
    if made.get(key, (None,))[0] is ref:
        del made[key]
