"""``Params``, the pytree of this rank's shards, and the check that a tree fits a model."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..schedule.structure import Role


class Params(NamedTuple):
    """This rank's shards, one tensor per part of the model (``model.parts``, in order):
    ``(shard,)`` for a part that is not a stack, ``(k, shard)`` for a stack of k layers (like
    JAX's scan-over-layers). An optree pytree; gradients and optimizer state have exactly
    this structure."""

    parts: tuple[torch.Tensor, ...]  # fp32


def check_tree(model: Any, tree: Any, what: str = "params",
               dtype: torch.dtype | None = None) -> None:
    """``tree`` is shaped like ``model``'s (a ``ShardedModel``'s) shards: one tensor per part,
    on the model's device, of ``dtype`` when given. Cheap, local, before any collective."""
    if not isinstance(tree, Params) or len(tree.parts) != len(model.parts):
        got = (f"Params of {len(tree.parts)} parts" if isinstance(tree, Params)
               else type(tree).__name__)
        raise TypeError(f"{what} is {got}; pass the Params that fz3.shard returned for this model "
                        f"(or a tree shaped like it: {len(model.parts)} parts, "
                        f"{[p.name for p in model.parts]})")
    for part, t in zip(model.parts, tree.parts):
        n = part.layout.shard_numel
        shape = (part.rows, n) if part.role is Role.STACK else (n,)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} of part {part.name} is {type(t).__name__}; pass the Params "
                            f"that fz3.shard returned")
        refuse_donated(t, what)
        wrong_dtype = dtype is not None and t.dtype != dtype
        if tuple(t.shape) != shape or wrong_dtype or t.device != model.device:
            want = f"{list(shape)} {dtype or t.dtype} on {model.device}"
            raise ValueError(f"{what} of part {part.name} is {list(t.shape)} {t.dtype} on "
                             f"{t.device}; this model's shards are {want} (world size "
                             f"{model.world_size}). Use the params from this model's fz3.shard, "
                             f"or fz3.load to reshard")


def is_donated(t: Any) -> bool:
    """``t`` was emptied by ``fz3.optim.step(..., donate=True)`` (no elements, no storage: see
    ``fz3/optim/base.py``'s [Note: donated trees])."""
    return (isinstance(t, torch.Tensor) and t.numel() == 0 and t.dim() == 1
            and t.untyped_storage().nbytes() == 0)


def refuse_donated(t: Any, what: str) -> None:
    """Raise if ``t`` was emptied by ``fz3.optim.step(..., donate=True)``."""
    if is_donated(t):
        raise ValueError(f"{what} were donated to fz3.optim.step(..., donate=True), which "
                         f"updated their buffers in place and returned new ones: use the "
                         f"{what.removeprefix('the ')} it returned")
