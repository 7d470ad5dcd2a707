"""Per-element masks over the flat shards, built once from the parts' layouts (e.g. weight
decay)."""

from __future__ import annotations

from typing import Callable

import torch

from ..schedule.structure import Role
from ..sharding.layout import Slot
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
    return Params(tuple(
        part_mask(model, part, lambda prefix, s: bool(decay(prefix + s.name, s.shape)))
        for part in model.parts))


def part_mask(model: ShardedModel, part: Part, holds: Callable[[str, Slot], bool], *,
              per_row: bool = False) -> torch.Tensor:
    """This rank's bool shard of ``part``, True on the elements of each parameter for which
    ``holds(prefix, slot)`` (``prefix``: ``"blocks.3."`` for layer 3, else ``""``); padding
    False. ``(rows, shard)`` for a stack asked about every layer (``per_row``), ``(1, shard)``
    for one asked through its first layer, ``(shard,)`` outside stacks."""
    mask = torch.zeros(part.rows if per_row else 1, part.layout.shard_numel, dtype=torch.bool,
                       device=model.device)
    pieces = part.layout.local_pieces(model.rank)
    for row in range(mask.shape[0]):
        prefix = part.prefix(row)
        for s, _, dst in pieces:
            mask[row, dst] = holds(prefix, s)
    return mask if part.role is Role.STACK else mask.view(-1)
