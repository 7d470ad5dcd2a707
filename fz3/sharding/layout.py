"""Flat layouts: where each parameter of a unit lives inside the unit's one flat buffer.

A unit (the outer unit, or one layer of the stack) is stored as a single 1-D buffer of
``padded`` elements: its parameters' elements back to back in a fixed order, then zeros up
to a multiple of the world size. Rank ``r`` owns elements ``[r*shard, (r+1)*shard)``. The
layout is static: it is built once by ``fz3.shard`` and never changes during training.

Unflattening a gathered buffer gives views, never copies (``FlatLayout.views``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple

import torch


class Slot(NamedTuple):
    """One parameter's place in a flat buffer."""

    names: tuple[str, ...]  # every name the parameter has in its module (tied names alias one slot)
    shape: tuple[int, ...]
    dtype: torch.dtype  # the parameter's dtype in the original module (master copy is fp32)
    offset: int
    numel: int

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[Slot, ...]
    numel: int  # elements used by parameters
    padded: int  # numel rounded up to a multiple of world_size
    world_size: int

    @staticmethod
    def build(params: Iterable[tuple[tuple[str, ...], torch.Tensor]],
              world_size: int) -> "FlatLayout":
        """Lay out ``(names, tensor)`` pairs in order; pad to a multiple of ``world_size``."""
        slots, offset = [], 0
        for names, p in params:
            slots.append(Slot(tuple(names), tuple(p.shape), p.dtype, offset, p.numel()))
            offset += p.numel()
        padded = -(-offset // world_size) * world_size if offset else world_size
        return FlatLayout(tuple(slots), offset, padded, world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world_size

    @property
    def pad(self) -> int:
        return self.padded - self.numel

    @property
    def sizes(self) -> list[int]:
        """Split sizes of a padded flat buffer: one per slot, then the padding."""
        return [s.numel for s in self.slots] + [self.pad]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of each parameter inside ``flat`` (padded,), in slot order. No copies."""
        parts = torch.split(flat, self.sizes)
        return [part.view(s.shape) for part, s in zip(parts, self.slots)]

    def named_views(self, flat: torch.Tensor, prefix: str = "") -> dict[str, torch.Tensor]:
        """``{prefix + name: view}`` for every name of every slot (tied names share one view)."""
        return {prefix + n: v for v, s in zip(self.views(flat), self.slots) for n in s.names}

    def flatten(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                device) -> torch.Tensor:
        """The padded flat buffer (padded,) built from ``{name: tensor}`` (first names)."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for s in self.slots:
            flat[s.offset : s.offset + s.numel].copy_(tensors[s.name].detach().reshape(-1))
        return flat

    def fill_shard(self, out: torch.Tensor, rank: int,
                   piece: Callable[[Slot, slice], torch.Tensor]) -> None:
        """Write rank ``rank``'s shard of one row into ``out`` (shard,): for each parameter
        overlapping it, ``piece(slot, elements of the parameter)`` (flat) where it belongs."""
        for s, src, dst in self.local_pieces(rank):
            out[dst].copy_(piece(s, src))

    def local_pieces(self, rank: int) -> list[tuple[Slot, slice, slice]]:
        """``(slot, elements of the parameter, elements of the shard)`` for each parameter
        overlapping rank ``rank``'s shard ``[rank*shard, (rank+1)*shard)`` of a row."""
        n = self.shard_numel
        lo, hi = rank * n, (rank + 1) * n
        out = []
        for s in self.slots:
            start, end = max(s.offset, lo), min(s.offset + s.numel, hi)
            if start < end:
                out.append((s, slice(start - s.offset, end - s.offset),
                            slice(start - lo, end - lo)))
        return out
