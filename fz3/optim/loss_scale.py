"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018), with one overflow check per step.

    loss, grads = step(params, batch, loss_scale=ls.scale)      # backward seeded with the scale
    grads, ls, finite = fz3.optim.unscale(grads, ls, model)    # one all-reduce of one flag
    if finite:
        params, opt_state = fz3.optim.step(opt, grads, opt_state, params)

The check looks at the flat gradient shards just before the optimizer step: one
``isfinite`` per shard tensor, one all-reduce of the result (not one per bucket, the point
of DeepSpeed PR #3622) and one host read of it, to decide whether to step. On overflow the
step is skipped and the scale divided by ``factor``; after ``growth_interval`` finite steps
in a row it is multiplied by ``factor``. The flag is summed over the model's sharding group:
under hybrid sharding every replica row holds the same (already all-reduced) shards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import optree
import torch

from ..comm.collectives import all_reduce, wait
from .base import Tree, model_comm

if TYPE_CHECKING:
    from ..sharding.model import ShardedModel


class LossScale(NamedTuple):
    scale: float = 2.0**16
    good_steps: int = 0  # finite steps since the last change
    factor: float = 2.0
    growth_interval: int = 2000
    min_scale: float = 1.0


def unscale(grads: Tree, state: LossScale, model: ShardedModel) -> tuple[Tree, LossScale, bool]:
    """``(grads / scale, next state, finite)``: ``finite`` is the same on every rank.
    Collective: one all-reduce of one int32 over ``model.comm.group`` (a dead peer raises
    ``fz3.RankLostError``)."""
    comm = model_comm(model, "unscale")
    leaves = optree.tree_leaves(grads)
    bad = torch.stack([~torch.isfinite(g).all() for g in leaves]).any().to(torch.int32).reshape(1)
    bad = wait(all_reduce(comm, bad, group=comm.group, label="the loss scale's overflow check"))
    finite = not bool(bad.item())  # the one host read per step: it decides whether the step runs
    if not finite:
        smaller = max(state.scale / state.factor, state.min_scale)
        return grads, state._replace(scale=smaller, good_steps=0), False
    inv = 1.0 / state.scale
    grads = optree.tree_map(lambda g: g * inv, grads)
    good = state.good_steps + 1
    if good >= state.growth_interval:
        return grads, state._replace(scale=state.scale * state.factor, good_steps=0), True
    return grads, state._replace(good_steps=good), True
