"""One unit at a time, gathered to the root rank's CPU: what full state dicts and exports are
built from, so neither ever holds more than one gathered unit."""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch

from ..comm.collectives import all_gather, wait
from ..sharding.layout import FlatLayout, Slot
from ..sharding.model import Params, ShardedModel


class UnitShard(NamedTuple):
    layout: FlatLayout
    shard: torch.Tensor  # this rank's shard of one row
    prefix: str  # the row's name prefix ("blocks.3." in a stack, "" elsewhere)


def unit_shards(model: ShardedModel, tree: Params, *, frozen: bool) -> list[UnitShard]:
    """Each row of each part of ``tree``, in the model's order; with ``frozen``, each part's
    frozen parameters (the model's own) right after its trained ones."""
    out = []
    for part, trained, held in zip(model.parts, tree.parts, model.frozen):
        pieces = [(part.layout, trained)]
        if frozen and part.frozen is not None:
            pieces.append((part.frozen, held))
        for layout, shards in pieces:
            out += [UnitShard(layout, shard, part.prefix(row))
                    for row, shard in enumerate(shards.reshape(part.rows, -1))]
    return out


class Gathered:
    """Iterate ``(unit, [(slot, full CPU tensor)] on the root rank, None elsewhere)``, one unit
    at a time. **Collective**: one all-gather per unit over the sharding group.

    Every unit is gathered into one buffer per dtype, the largest unit's size: a finished
    collective's output may stay referenced by the backend a moment after ``wait`` (gloo's
    worker thread), so a fresh buffer per unit briefly made two; reusing one keeps one."""

    def __init__(self, model: ShardedModel, units: list[UnitShard]):
        self.model, self.units = model, units
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def __iter__(self) -> Iterator[tuple[UnitShard, list[tuple[Slot, torch.Tensor]] | None]]:
        biggest = max((u.layout.padded for u in self.units), default=0)
        for unit in self.units:
            dtype = unit.shard.dtype
            if dtype not in self.buffers:
                self.buffers[dtype] = torch.empty(biggest, dtype=dtype, device=unit.shard.device)
            yield unit, gather_unit(self.model, unit.layout, unit.shard,
                                    self.buffers[dtype][:unit.layout.padded])


def own_buffers(model: ShardedModel) -> dict[str, torch.Tensor]:
    """The module's persistent buffers (what its state dict holds beside parameters), on the
    CPU."""
    params = {n for n, _ in model.skeleton.named_parameters(remove_duplicate=False)}
    return {k: v.detach().cpu().clone() for k, v in model.skeleton.state_dict().items()
            if k not in params}


def gather_unit(model: ShardedModel, layout: FlatLayout, shard: torch.Tensor,
                full: torch.Tensor) -> list[tuple[Slot, torch.Tensor]] | None:
    """``[(slot, full tensor on the CPU in the parameter's original dtype)]`` on the root rank,
    None elsewhere. **Collective**: one all-gather of ``shard`` (the unit's local shard) into
    ``full`` (``(padded,)``, a buffer the caller reuses) over the sharding group; every rank
    must call it."""
    wait(all_gather(model.comm, full, shard.contiguous(), label="a unit for a state dict"))
    if not model.is_root:
        return None
    return [(s, v.to(device="cpu", dtype=s.dtype, copy=True))
            for s, v in zip(layout.slots, layout.views(full))]
