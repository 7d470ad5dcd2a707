"""The shapes of a unit's memory: the one place where a unit of one layer differs from one of k.

A stack unit of k layers gathers its ``(k, shard)`` rows as one rank-major ``(world, k, n)``
buffer, copies it into layer-major ``(k, full)`` order, and hands its reduce a ``(world, k,
n)`` gradient made rank-major again. A unit of one layer needs none of that: its row is
gathered as it is (1-D, ``(full,)``: no copy, and no view made per op), its gradient stays
1-D ``(world*n,)`` (rank-major already), and a freed one is gathered straight back into its
released storage. That saved a few microseconds per layer and op on the host
(``benchmarks/host_overhead.py``, where most units are one layer), so it is kept, but every
shape that depends on it is decided here, by these functions of the ``Unit`` (and where
its reduce lands, by ``unit_io.result_lander``), once, when the schedule is lowered
(``fz3.step.executor.lower``); the steps never ask. A unit that is not a stack's (pre,
between, post, shared) is one ``(padded,)`` buffer.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..schedule.schedule import Unit
from ..schedule.structure import Role


class Split(NamedTuple):
    """A stack part's trained shard split into its layers' rows (``ShardRows``)."""

    shard: weakref.ref  # the tensor object last passed in for this memory
    ptr: int  # its data_ptr
    layout: tuple  # its storage's nbytes, its offset, shape, stride and dtype
    memory: StorageWeakRef  # its storage, expired once freed (keeps no memory alive)
    rows: tuple[torch.Tensor, ...]  # views of a non-owning alias of that memory


class ShardRows:
    """Each stack part's trained shard split into its layers' rows, kept across steps (one per
    lowered program, ``fz3.step.executor.Program``): a one-layer unit gathers its row, and one
    rank computes on it (``fz3.comm``), so a step called again on the same memory computes on
    the same row tensors and its parameter views are kept too (``fz3.step.views.RowViews``).
    The same memory: the same shard tensor (micro-batches, evaluation), or a new tensor object
    on the very same storage, address and layout (a training loop: ``fz3.optim.step(...,
    donate=True)`` updates the memory in place and returns a new alias every step).
    [Note: rows that own nothing]: the rows are views of an alias that does not own the memory
    (``torch._C._construct_storage_from_data_pointer``, as inductor's CUDA graph trees make
    theirs), so they keep nothing alive once the caller drops the shard; they are read only
    while a tensor on that memory, alive and checked as above, was passed in for this step,
    and the step hands none of them out (``step_through``'s frames may: its program, lowered
    per call, has ``owning=True``). Also a shard tensor pointed at other memory (``set_``)
    is split again (its address is checked on every hit; its layout on a new object only:
    a shard reshaped in place at the same address is not supported)."""

    def __init__(self, owning: bool = False):
        self.owning = owning
        self.made: dict[int, Split] = {}  # by part

    def get(self, part: int, trained: torch.Tensor) -> tuple[torch.Tensor, ...]:
        made = self.made.get(part)
        if made is not None and made.shard() is trained and trained.data_ptr() == made.ptr:
            return made.rows
        if type(trained) is not torch.Tensor or trained.is_meta:
            return trained.detach().unbind(0)  # (a fake or meta shard: a trace's; nothing kept)
        storage = trained.untyped_storage()
        layout = (storage.nbytes(), trained.storage_offset(), trained.shape, trained.stride(),
                  trained.dtype)
        if (made is not None and made.ptr == trained.data_ptr() and made.layout == layout
                and made.memory.cdata == storage._cdata and not made.memory.expired()):
            self.made[part] = made._replace(shard=weakref.ref(trained))  # a new alias of it
            return made.rows
        if self.owning:
            rows = trained.detach().unbind(0)
        else:
            alias = torch._C._construct_storage_from_data_pointer(
                storage.data_ptr(), trained.device, storage.nbytes())
            rows = trained.new_empty(0).set_(alias, trained.storage_offset(), trained.shape,
                                             trained.stride()).unbind(0)
        self.made[part] = Split(weakref.ref(trained), trained.data_ptr(), layout,
                                StorageWeakRef(storage), rows)
        return rows


def shard_picker(unit: Unit, frozen: torch.Tensor | None
                 ) -> Callable[[torch.Tensor, ShardRows], tuple[torch.Tensor,
                                                                torch.Tensor | None]]:
    """What a unit gathers, as ``pick(trained, rows) -> (trained, frozen)``, both 1-D:
    from its part's trained shard (``(L, shard)`` for a stack) a one-layer unit its row (the
    shard's rows, ``rows.get(unit.part, trained)``), a unit of k layers its ``(k, shard)``
    rows flat, any other unit the shard; likewise from the part's ``frozen`` shard (decided
    here, once)."""
    if unit.role is not Role.STACK:
        flat = None if frozen is None else frozen.reshape(-1)
        return lambda trained, rows: (trained.reshape(-1), flat)
    first, stop, part = unit.layers.start, unit.layers.stop, unit.part
    if stop - first == 1:
        row = None if frozen is None else frozen[first]

        def one(trained: torch.Tensor, rows: ShardRows):
            made = rows.made.get(part)  # (``ShardRows.get``'s hit, without its call)
            split = made.rows if made is not None and made.shard() is trained and \
                trained.data_ptr() == made.ptr else rows.get(part, trained)
            return split[first], row

        return one
    rows_k = None if frozen is None else frozen[first:stop].reshape(-1)
    return lambda trained, rows: (trained[first:stop].reshape(-1), rows_k)


def gathers_in_place(unit: Unit) -> bool:
    """Whether a released buffer of ``unit`` is regrown by its gather, which writes into it
    (one buffer as gathered); otherwise (k layers) its wait copies the gather into it."""
    return len(unit.layers) == 1


def arranger(unit: Unit, world: int) -> Callable[[torch.Tensor, torch.Tensor | None],
                                                 tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """``arrange(out, into) -> (buffer, rows)``: a waited gather ``out`` in its unit's shape,
    with its layers' rows (1-D, one per layer): a stack unit's ``(k, full)``, layer-major (for
    k > 1 copied out of the rank-major gather, into ``into`` if given: a released buffer,
    regrown by the caller, whose storage a live graph saved views of, or a fixed buffer),
    a one-layer unit's row as gathered; ``out`` and no rows otherwise."""
    if unit.role is not Role.STACK:
        return lambda out, into: (out, ())
    k = len(unit.layers)
    if k == 1:
        return lambda out, into: (out.view(1, -1), (out,))

    def layer_major(out: torch.Tensor, into: torch.Tensor | None):
        ranked = out.view(world, k, -1).transpose(0, 1)
        if into is None:
            buffer = ranked.reshape(k, -1)
        else:  # (a resize_ to its own size would reallocate it)
            buffer = into
            into.view(ranked.shape).copy_(ranked)
        return buffer, buffer.unbind(0)

    return layer_major


def gathered_as(unit: Unit) -> Callable[[Any], tuple[torch.Tensor | None, ...]]:
    """``(trained, frozen)`` of a unit's gathered memory (``Pieces``) as ``free`` releases
    them: a one-layer unit of a stack its gathers' own 1-D outputs (its rows), so the next
    gather writes into the very objects a program's views were made of; any other unit its
    buffers (pre's, post's, a shared unit's 1-D as gathered, a k-layer unit's ``(k, full)``
    layer-major copies)."""
    if keeps_its_rows(unit):
        return lambda g: (g.rows[0], g.frozen_rows[0] if g.frozen_rows else None)
    return lambda g: (g.buffer, g.frozen)


def keeps_its_rows(unit: Unit) -> bool:
    """A one-layer unit of a stack: its row is its gathered buffer itself, so a gather into
    the same buffer object gives the same row (``fz3.step.movement.free_op``)."""
    return unit.role is Role.STACK and len(unit.layers) == 1


def regrow(buf: torch.Tensor) -> torch.Tensor:
    """Give a released buffer (``fz3.step.state.release``) its storage back (contents
    undefined until written). Not one that has it: a ``resize_`` to its own size reallocates
    it, under whatever may still write into it."""
    size = buf.numel() * buf.element_size()
    storage = buf.untyped_storage()
    if storage.nbytes() != size:
        storage.resize_(size)
    return buf


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
