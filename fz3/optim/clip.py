"""Gradient clipping by the global norm across all shards (Pascanu et al. 2013).

    norm = sqrt(sum over the sharding group's shards of g^2)   one all-reduce of one number
           (each rank's sum: the square of each layer row's norm, in order: ``row_norms``)
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
from .base import GradientTransformation, Tree, model_comm, row_norms

if TYPE_CHECKING:
    from ..sharding.model import ShardedModel


class ClipState(NamedTuple):
    norm: torch.Tensor  # () fp32: the global norm of the last gradients, before clipping


def global_norm(grads: Tree, model: ShardedModel) -> torch.Tensor:
    """The L2 norm of the full gradient: local sum of squares, sqrt of its sum over the
    sharding group. Collective: one all-reduce of one fp32 number over ``model.comm.group``
    (a dead peer raises ``fz3.RankLostError``)."""
    return _total([n for g in optree.tree_leaves(grads) for n in row_norms(g)], model)


def _total(norms: list[torch.Tensor], model: ShardedModel) -> torch.Tensor:
    """The global norm from this rank's ``row_norms`` (each row's in fp32, without an fp32 copy
    of it; squared and summed in order). Collective (``global_norm``)."""
    comm = model_comm(model, "global_norm")
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

    def scaling(state: ClipState, norms: list[torch.Tensor]) -> tuple[torch.Tensor, ClipState]:
        norm = _total(norms, model)
        return (max_norm / (norm + 1e-6)).clamp(max=1.0), ClipState(norm)

    def update(grads: Tree, state: ClipState, params: Tree | None = None) -> tuple[Tree, ClipState]:
        coef, state = scaling(state, [n for g in optree.tree_leaves(grads) for n in row_norms(g)])
        return optree.tree_map(lambda g: g * coef.to(g.dtype), grads), state

    return GradientTransformation(init, update, scaling=scaling)
