"""The collectives' names across the torch versions fz3 supports: torch >= 2.13 names them
``*_single`` and deprecates the old names with a warning on every call; older torch (2.11 on
the GPU machine) only has the old names. Everything in fz3 calls these two."""

from __future__ import annotations

import torch.distributed as dist

all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
