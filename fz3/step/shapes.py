"""The shapes of a unit's memory: the one place where a unit of one layer differs from one of k.

A stack unit of k layers gathers its ``(k, shard)`` rows as one rank-major ``(world, k, n)``
buffer, copies it into layer-major ``(k, full)`` order, and hands its reduce a ``(world, k,
n)`` gradient made rank-major again. A unit of one layer needs none of that: its row is
gathered as it is (1-D, ``(full,)``: no copy, and no view made per op), its gradient stays
1-D ``(world*n,)`` (rank-major already), and a freed one is gathered straight back into its
released storage. That saved a few microseconds per layer and op on the host
(``benchmarks/host_overhead.py``, where most units are one layer), so it is kept, but every
shape that depends on it is decided here, by these functions of the ``Unit``; the handlers
never ask. A unit that is not a stack's (pre, between, post, shared) is one ``(padded,)``
buffer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..schedule.schedule import Unit
from ..schedule.structure import Role


def gathered_shards(unit: Unit, trained: torch.Tensor, frozen: torch.Tensor | None,
                    rows: Callable[[], tuple[torch.Tensor, ...]]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a unit gathers from its part's trained shard (``(L, shard)`` for a stack) and
    frozen one: a one-layer unit its row (1-D; ``rows()``: the trained shard's rows, split
    once per step), a unit of k layers its ``(k, shard)`` rows, any other unit the shard."""
    if unit.role is not Role.STACK:
        return trained, frozen
    first, stop = unit.layers.start, unit.layers.stop
    if stop - first == 1:
        return rows()[first], None if frozen is None else frozen[first]
    return trained[first:stop], None if frozen is None else frozen[first:stop]


def gathers_in_place(unit: Unit) -> bool:
    """Whether a released buffer of ``unit`` is regrown by its gather, which writes into it
    (one buffer as gathered); otherwise (k layers) its wait copies the gather into it."""
    return len(unit.layers) == 1


def arranged(unit: Unit, out: torch.Tensor, world: int,
             into: torch.Tensor | None) -> torch.Tensor:
    """A waited gather ``out`` in its unit's shape: a stack unit's ``(k, full)``, layer-major
    (for k > 1 copied out of the rank-major gather, into ``into`` if it was released:
    regrown, the same storage a live graph saved views of); ``out`` otherwise."""
    if unit.role is not Role.STACK:
        return out
    k = len(unit.layers)
    if k == 1:
        return out.view(1, -1)
    ranked = out.view(world, k, -1).transpose(0, 1)
    if into is None:
        return ranked.reshape(k, -1)
    regrow(into).view(ranked.shape).copy_(ranked)
    return into


def regrow(buf: torch.Tensor) -> torch.Tensor:
    """Give a released buffer (``fz3.step.state.release``) its storage back (contents
    undefined until written)."""
    buf.untyped_storage().resize_(buf.numel() * buf.element_size())
    return buf


def layer_rows(unit: Unit, out: torch.Tensor, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A stack unit's gathered rows, one 1-D tensor per layer (a one-layer unit's as gathered,
    ``out``); () for other units."""
    if unit.role is not Role.STACK:
        return ()
    return (out,) if len(unit.layers) == 1 else buffer.unbind(0)


def leaf_rows(buffer: torch.Tensor) -> Sequence[torch.Tensor]:
    """Each layer's row of a ``(k, padded)`` buffer (or a leaf of it, whose gradient autograd
    accumulates): one row is a view whose backward is free, unbind's stacks the rows'."""
    return (buffer.view(-1),) if buffer.shape[0] == 1 else buffer.unbind(0)


def buffer_grad(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradient of a unit's trained buffer from its layers' row gradients: ``(padded,)``
    for one layer, ``(k, padded)`` for k."""
    return grads[0] if len(grads) == 1 else torch.stack(grads)


def flat_grad(unit: Unit, grad: torch.Tensor, world: int, *, by_layer: bool) -> torch.Tensor:
    """A stack unit's flat gradient for its reduce, from its buffer's gradient: ``(world, k,
    n)``, each layer's ``(world, n)`` in rank order (one layer's: ``(world*n,)``, the same
    memory, for a reduce-scatter). ``by_layer`` (an all-reduce, which sums in any order): the
    memory may stay layer-major; a reduce-scatter hands rank r the r-th contiguous chunk, so
    k layers are made rank-major."""
    if len(unit.layers) == 1 and not by_layer:
        return grad if grad.dim() == 1 else grad.view(-1)
    k = len(unit.layers)
    layered = grad.view(k, world, -1).transpose(0, 1)
    return layered if k == 1 or by_layer else layered.contiguous()


def frame_grad(unit: Unit, grad: torch.Tensor, world: int) -> torch.Tensor:
    """A flat gradient as a ``Frame`` shows it: a stack unit's ``(world, k, n)``."""
    if grad.dim() == 1 and unit.role is Role.STACK:
        return grad.view(world, 1, -1)
    return grad


def result_rows(unit: Unit, grads: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Where this rank's reduced gradient of a stack unit lands in its part's ``(L, shard)``
    gradient shard ``grads`` (``rows``: its rows, split once per step): a one-layer unit's
    row, k layers' ``(k*shard,)``."""
    first, stop = unit.layers.start, unit.layers.stop
    return rows[first] if stop - first == 1 else grads[first:stop].view(-1)
