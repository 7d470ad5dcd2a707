"""Per-element masks over the flat shards, built once from the parts' layouts (e.g. weight
decay)."""

from __future__ import annotations

from typing import Callable

import torch

from ..schedule.structure import Role
from ..sharding.model import Params, ShardedModel
from ..sharding.parts import Part


def decay_matrices(name: str, shape: tuple[int, ...]) -> bool:
    """True where weight decay applies, by the usual rule: matrices and embeddings decay,
    biases and norm weights (vectors) do not."""
    return len(shape) >= 2


def decay_mask(model: ShardedModel,
               decay: Callable[[str, tuple[int, ...]], bool] = decay_matrices) -> Params:
    """Bool shards broadcastable to params, True where ``decay(name, shape)`` holds.

    Names are the module's own. Every layer of a stack shares one mask: the stack is asked
    about through its first layer (``blocks.0.fc.weight``) and gets one ``(1, shard)`` row that
    broadcasts over the stack. Padding is False.
    """
    return Params(tuple(_part_mask(model, part, decay) for part in model.parts))


def _part_mask(model: ShardedModel, part: Part, decay) -> torch.Tensor:
    mine = torch.zeros(part.layout.shard_numel, dtype=torch.bool, device=model.device)
    for s, _, dst in part.layout.local_pieces(model.rank):
        mine[dst] = bool(decay(part.prefix() + s.name, s.shape))
    return mine.view(1, -1) if part.role is Role.STACK else mine
