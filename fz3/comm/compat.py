"""The collectives' names across the torch versions fz3 supports: torch >= 2.13 names them
``*_single`` and deprecates the old names with a warning on every call; older torch (2.11 on
the GPU machine) only has the old names. Everything in fz3 calls these two."""

from __future__ import annotations

import torch.distributed as dist

all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_store() -> dist.Store:
    """The rendezvous store every rank shares; it outlives the process groups built on it.
    torch has no public accessor for it (``init_process_group`` does not return it), so this
    reads torch's private one: the one place fz3 does."""
    return dist.distributed_c10d._get_default_store()
