"""Per-element masks over the flat shards, built once from the layouts (e.g. weight decay)."""

from __future__ import annotations

from typing import Callable

import torch

from ..sharding.layout import FlatLayout
from ..sharding.model import Params, ShardedModel


def decay_matrices(name: str, shape: tuple[int, ...]) -> bool:
    """True where weight decay applies, by the usual rule: matrices and embeddings decay,
    biases and norm weights (vectors) do not."""
    return len(shape) >= 2


def decay_mask(model: ShardedModel, decay: Callable[[str, tuple[int, ...]], bool] = decay_matrices) -> Params:
    """Bool shards broadcastable to params, True where ``decay(name, shape)`` holds.

    Names are the module's own; every layer shares one mask, so layers are asked about as
    ``<layers>.0.<name>`` and ``layers`` is one ``(1, shard)`` row that broadcasts over the
    stack. Padding is False.
    """
    outer = _unit_mask(model, model.outer, decay, "")
    layer = _unit_mask(model, model.layer, decay, f"{model.layers_path}.0.")
    return Params(outer, layer.view(1, -1))


def _unit_mask(model: ShardedModel, layout: FlatLayout, decay, prefix: str) -> torch.Tensor:
    full = torch.zeros(layout.padded, dtype=torch.bool)
    for s in layout.slots:
        full[s.offset : s.offset + s.numel] = bool(decay(prefix + s.name, s.shape))
    n = layout.shard_numel
    return full[model.rank * n : (model.rank + 1) * n].clone().to(model.device)
