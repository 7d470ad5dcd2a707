"""Optimizers as ``GradientTransformation(init, update)``: two pure functions over pytrees (optax)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

Tree = Any  # a pytree of tensors shaped like fz3.Params


class GradientTransformation(NamedTuple):
    init: Callable[[Tree], Any]  # params -> state
    update: Callable[..., tuple[Tree, Any]]  # (grads, state, params) -> (updates, state), pure
    # Optional fast path: (grads, state, params) -> (params, state) computed in place, reusing
    # (donating) the buffers of params and state, as a fused kernel does. See ``step``.
    update_inplace: Callable[..., tuple[Tree, Any]] | None = None


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

    last = transforms[-1] if transforms else None
    if last is None or last.update_inplace is None:
        return GradientTransformation(init, update)

    def update_inplace(grads: Tree, state: tuple, params: Tree) -> tuple[Tree, tuple]:
        new = []
        for t, s in zip(transforms[:-1], state):
            grads, s = t.update(grads, s, params)
            new.append(s)
        params, s = last.update_inplace(grads, state[-1], params)
        return params, tuple(new) + (s,)

    return GradientTransformation(init, update, update_inplace)


def step(opt: GradientTransformation, grads: Tree, state: Any, params: Tree, *,
         donate: bool = False) -> tuple[Tree, Any]:
    """``(params, state)`` after one optimizer step.

    ``donate=False``: pure, ``apply_updates(params, opt.update(...))``; the inputs are untouched.
    ``donate=True``: ``params`` and ``state`` are given up (as with JAX's ``donate_argnums``):
    their buffers are updated in place by a fused kernel where ``opt`` has one, so the step
    reads and writes each element once and allocates nothing. Do not use the donated
    ``params``/``state`` afterwards; use the returned ones.
    """
    if donate and opt.update_inplace is not None:
        return opt.update_inplace(grads, state, params)
    updates, state = opt.update(grads, state, params)
    return apply_updates(params, updates), state


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """``params + updates``, leaf by leaf (new tensors; the inputs are untouched)."""
    return optree.tree_map(torch.add, params, updates)
