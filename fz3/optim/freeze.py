"""Freeze the updates of chosen parameters, by name: ``optax.set_to_zero`` under a mask.

    opt = fz3.optim.chain(fz3.optim.adamw(lr=1e-3, weight_decay=0.1),
                          fz3.optim.freeze(model, {"lm_head.weight"}))

Put it last: it zeroes the *updates* (AdamW's step and its weight decay), so a named
parameter keeps its value exactly. Before AdamW it would zero gradients only, and weight
decay and the moments' momentum would still move the parameter.

The parameters stay trained as far as the step is concerned: their gradients are computed and
reduced, and AdamW's moments for them are kept (and saved with the optimizer state): a mask
can change between steps without re-sharding. To save the gradient and optimizer memory
too, make them really frozen (``requires_grad=False`` before ``fz3.shard``, or
``fz3.refreeze`` between steps). ``fz3.optim.step(..., donate=True)`` and ``fz3.train_step``
run the optimizer's fused (in-place, per-unit) step on every element and put the named ones
back (``GradientTransformation.keeps``): their values are the same, the others' are the fused
step's. Elementwise: no communication.
"""

from __future__ import annotations

from typing import Callable, Collection, NamedTuple

import optree

from .masks import part_mask
from ..sharding.model import Params, ShardedModel
from .base import GradientTransformation, Tree


class FreezeState(NamedTuple):
    """Nothing: the mask is fixed when the transformation is built."""


def freeze(
    model: ShardedModel, names: Collection[str] | Callable[[str], bool]
) -> GradientTransformation:
    """Zero the updates of the parameters ``names`` (their names in the original module, any
    of a tied parameter's names; or a predicate on names). Every name must be a parameter of
    the model; frozen ones (``requires_grad=False``) are accepted and have no updates anyway."""
    keep = keep_mask(model, names)

    def init(params: Tree) -> FreezeState:
        return FreezeState()

    def update(
        updates: Tree, state: FreezeState, params: Tree | None = None
    ) -> tuple[Tree, FreezeState]:
        return optree.tree_map(lambda u, k: u * k, updates, keep), state

    return GradientTransformation(init, update, keeps=keep)


def keep_mask(model: ShardedModel, names: Collection[str] | Callable[[str], bool]) -> Params:
    """Bool shards shaped like params: False on the elements of the named parameters, True
    elsewhere (padding included: its updates are zero already). Local: no collective."""
    if callable(names):
        chosen = names
    else:
        wanted = set(names)
        every = {n for n, _ in model.skeleton.named_parameters(remove_duplicate=False)}
        unknown = sorted(wanted - every)
        if unknown:
            raise ValueError(
                f"fz3.optim.freeze: {unknown[:5]} name no parameter of the model; names are "
                f"the original module's, e.g. {sorted(every)[:4]}"
            )
        chosen = wanted.__contains__
    return Params(tuple(
        ~part_mask(model, part, lambda prefix, s: any(chosen(prefix + n) for n in s.names),
                   per_row=True)
        for part in model.parts))
