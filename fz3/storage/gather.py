"""One unit at a time, gathered to the root rank's CPU: what full state dicts and exports are
built from, so neither ever holds more than one gathered unit."""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather, wait
from ..sharding.layout import FlatLayout, Slot
from ..sharding.model import ShardedModel


def gather_unit(model: ShardedModel, layout: FlatLayout, shard: torch.Tensor,
                out: torch.Tensor | None = None) -> list[tuple[Slot, torch.Tensor]] | None:
    """``[(slot, full tensor on the CPU in the parameter's original dtype)]`` on the root rank,
    None elsewhere. **Collective**: one all-gather of ``shard`` (the unit's local shard) over
    the sharding group; every rank must call it. The gathered buffer (``out`` if given,
    ``(padded,)``, reused by the caller) is dropped on return."""
    full = (torch.empty(layout.padded, dtype=shard.dtype, device=shard.device) if out is None
            else out)
    wait(all_gather(model.comm, full, shard.contiguous(), label="a unit for a state dict"))
    if not model.is_root:
        return None
    return [(s, v.to(device="cpu", dtype=s.dtype, copy=True))
            for s, v in zip(layout.slots, layout.views(full))]
