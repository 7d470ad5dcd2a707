"""The shapes of a unit's parameters and gradients where a unit of one layer differs from
one of k, decided once per ``Unit`` (its memory's are ``fz3.step.memory``'s). A unit that is
not a stack's (pre, between, post, shared) is one ``(padded,)`` buffer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..schedule.schedule import Unit
from ..schedule.structure import Role


def shard_picker(unit: Unit, frozen: torch.Tensor | None
                 ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]:
    """What a unit gathers, as ``pick(trained) -> (trained, frozen)``, both 1-D: from its
    part's trained shard (``(L, shard)`` for a stack) a one-layer unit its row, a unit of k
    layers its ``(k, shard)`` rows flat, any other unit the shard; likewise from the part's
    ``frozen`` shard (decided here, once)."""
    if unit.role is not Role.STACK:
        flat = None if frozen is None else frozen.reshape(-1)
        return lambda trained: (trained.reshape(-1), flat)
    first, stop = unit.layers.start, unit.layers.stop
    if stop - first == 1:
        row = None if frozen is None else frozen[first]
        return lambda trained: (trained[first], row)
    rows_k = None if frozen is None else frozen[first:stop].reshape(-1)
    return lambda trained: (trained[first:stop].reshape(-1), rows_k)


def leaf_rows(buffer: torch.Tensor) -> Sequence[torch.Tensor]:
    """Each layer's row of a ``(k, padded)`` buffer (or a leaf of it, whose gradient autograd
    accumulates): one row is a view whose backward is free, unbind's stacks the rows'."""
    return (buffer.view(-1),) if buffer.shape[0] == 1 else buffer.unbind(0)


def buffer_grad(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradient of a unit's trained buffer from its layers' row gradients: ``(padded,)``
    for one layer, ``(k, padded)`` for k."""
    return grads[0] if len(grads) == 1 else torch.stack(grads)


def frame_grad(unit: Unit, grad: torch.Tensor, world: int) -> torch.Tensor:
    """A flat gradient as a ``Frame`` shows it: a stack unit's ``(world, k, n)``."""
    if grad.dim() == 1 and unit.role is Role.STACK:
        return grad.view(world, 1, -1)
    return grad
