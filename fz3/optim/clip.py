"""Gradient clipping by the global norm across all shards (Pascanu et al. 2013).

    norm = sqrt(sum over the sharding group's shards of g^2)   one all-reduce of one number
    g   <- g * min(1, max_norm / (norm + 1e-6))               as torch.nn.utils.clip_grad_norm_

The sum runs over the model's sharding group, never the world: under hybrid sharding each
replica row holds the same shards, so the norm of R identical replicas is the norm of one
(a sum over the world would make it sqrt(R) too large). Padding is zero, so it adds nothing.
The norm stays on the device (no sync); it is kept in the state for logging:
``opt_state[0].norm``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import optree
import torch

from ..comm.collectives import all_reduce, wait
from .base import GradientTransformation, Tree, model_comm

if TYPE_CHECKING:
    from ..sharding.model import ShardedModel


class ClipState(NamedTuple):
    norm: torch.Tensor  # () fp32: the global norm of the last gradients, before clipping


def global_norm(grads: Tree, model: ShardedModel) -> torch.Tensor:
    """The L2 norm of the full gradient: local sum of squares, sqrt of its sum over the
    sharding group. Collective: one all-reduce of one fp32 number over ``model.comm.group``
    (a dead peer raises ``fz3.RankLostError``)."""
    comm = model_comm(model, "global_norm")
    # per leaf, in fp32 without an fp32 copy of the leaf: its norm, then squared
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in optree.tree_leaves(grads)]
    sq = torch.stack(norms).square().sum()
    return wait(all_reduce(comm, sq, group=comm.group, label="the global gradient norm")).sqrt()


def clip_by_global_norm(max_norm: float, model: ShardedModel) -> GradientTransformation:
    """Scale gradients so their global norm is at most ``max_norm``. ``model``: the
    ``ShardedModel`` the gradients belong to; its sharding group sums the shards. ``update``
    is collective (``global_norm``)."""
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be > 0")
    model_comm(model, "clip_by_global_norm")

    def init(params: Tree) -> ClipState:
        leaf = optree.tree_leaves(params)[0]
        return ClipState(torch.zeros((), dtype=torch.float32, device=leaf.device))

    def update(grads: Tree, state: ClipState, params: Tree | None = None) -> tuple[Tree, ClipState]:
        norm = global_norm(grads, model)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return optree.tree_map(lambda g: g * coef.to(g.dtype), grads), ClipState(norm)

    return GradientTransformation(init, update)
