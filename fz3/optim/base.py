"""Optimizers as ``GradientTransformation(init, update)``: two pure functions over pytrees (optax)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

Tree = Any  # a pytree of tensors shaped like fz3.Params


class GradientTransformation(NamedTuple):
    init: Callable[[Tree], Any]  # params -> state
    update: Callable[..., tuple[Tree, Any]]  # (grads, state, params) -> (updates, state)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states."""

    def init(params: Tree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Tree, state: tuple, params: Tree | None = None) -> tuple[Tree, tuple]:
        new = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new.append(s)
        return grads, tuple(new)

    return GradientTransformation(init, update)


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """``params + updates``, leaf by leaf (new tensors; the inputs are untouched)."""
    return optree.tree_map(torch.add, params, updates)
