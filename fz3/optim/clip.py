"""Gradient clipping by the global norm across all shards (Pascanu et al. 2013).

    norm = sqrt(sum over every rank's shards of g^2)      one all-reduce of one number
    g   <- g * min(1, max_norm / (norm + 1e-6))           as torch.nn.utils.clip_grad_norm_

Padding is zero, so it adds nothing to the norm. The norm stays on the device (no sync);
it is kept in the state for logging: ``opt_state[0].norm``.
"""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch
import torch.distributed as dist

from .base import GradientTransformation, Tree


class ClipState(NamedTuple):
    norm: torch.Tensor  # () fp32: the global norm of the last gradients, before clipping


def global_norm(grads: Tree, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of the full gradient: local sum of squares, one all-reduce, sqrt."""
    leaves = optree.tree_leaves(grads)
    sq = torch.stack([g.float().square().sum() for g in leaves]).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq.sqrt()


def clip_by_global_norm(max_norm: float, group: dist.ProcessGroup | None = None) -> GradientTransformation:
    """Scale gradients so their global norm is at most ``max_norm``. ``group``: the sharding
    group (``model.comm.group``; default the default group) over which shards are summed."""
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be > 0")

    def init(params: Tree) -> ClipState:
        leaf = optree.tree_leaves(params)[0]
        return ClipState(torch.zeros((), dtype=torch.float32, device=leaf.device))

    def update(grads: Tree, state: ClipState, params: Tree | None = None) -> tuple[Tree, ClipState]:
        norm = global_norm(grads, group)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return optree.tree_map(lambda g: g * coef.to(g.dtype), grads), ClipState(norm)

    return GradientTransformation(init, update)
