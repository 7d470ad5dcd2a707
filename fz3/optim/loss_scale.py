"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018), with one overflow check per step.

    loss, grads = step(params, batch, loss_scale=ls.scale)      # backward seeded with the scale
    grads, ls, finite = fz3.optim.unscale(grads, ls, group)    # one all-reduce of one flag
    if finite:
        params, opt_state = fz3.optim.step(opt, grads, opt_state, params)

The check looks at the flat gradient shards just before the optimizer step: one
``isfinite`` per shard tensor, one all-reduce of the result (not one per bucket, the point
of DeepSpeed PR #3622) and one host read of it, to decide whether to step. On overflow the
step is skipped and the scale divided by ``factor``; after ``growth_interval`` finite steps
in a row it is multiplied by ``factor``.
"""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch
import torch.distributed as dist

from .base import Tree


class LossScale(NamedTuple):
    scale: float = 2.0**16
    good_steps: int = 0  # finite steps since the last change
    factor: float = 2.0
    growth_interval: int = 2000
    min_scale: float = 1.0


def unscale(grads: Tree, state: LossScale, group: dist.ProcessGroup | None = None) -> tuple[Tree, LossScale, bool]:
    """``(grads / scale, next state, finite)``: ``finite`` is the same on every rank."""
    leaves = optree.tree_leaves(grads)
    ok = torch.stack([torch.isfinite(g).all() for g in leaves]).all().to(torch.int32).reshape(1)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    finite = bool(ok.item())  # the one host read per step: it decides whether the step runs
    if not finite:
        return grads, state._replace(scale=max(state.scale / state.factor, state.min_scale), good_steps=0), False
    inv = 1.0 / state.scale
    grads = optree.tree_map(lambda g: g * inv, grads)
    good = state.good_steps + 1
    if good >= state.growth_interval:
        return grads, state._replace(scale=state.scale * state.factor, good_steps=0), True
    return grads, state._replace(good_steps=good), True
