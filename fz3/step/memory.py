"""``UnitMemory``: one owner for each unit's memory, made when a schedule is lowered
(``fz3.step.executor.lower``) and kept by the lowered program for the life of the step function
(``fz3.apply`` lowers at each call: its memory is made per call).

[Note: a unit's memory]
Each unit has one ``UnitMemory``: its gathered trained and frozen flat buffers in the compute
dtype, their ``(k, padded)`` layer-major form and layer rows (``Pieces``, the same tensor
objects every step, so the parameter views a program makes of a row are made once and kept in
``Pieces.made``, ``fz3.step.views``), the rank-major staging a unit of k > 1 layers gathers into
at more than one rank, and a stack unit's flat unreduced gradient (with its layer-major staging
where the reduce wants rank-major rows or another dtype; pre's, between's and post's gradients
are autograd's, made by their backward or the loss, and a shared unit's is its first reader's,
which later readers add into). The tensors never change (but for ``handed_out`` and
``hand_over_grad``, below); only their storage comes and goes:
- ``gather`` writes into the buffers (their storage regrown first): across ranks the
  collective, at one rank a copy of the shard (as FSDP2 does; with bf16 compute the cast is
  that copy). ``wait`` copies a k-layer unit's staging into layer order and releases it
  (where the unit has one: k layers at more than one rank), and sets the buffers' autograd
  version counters back to those they had when made (the collective's or the copy's write
  bumped them): a graph that saved views of them (pre's, a saved layer's, a shared unit's
  reader) sees the re-gathered values as unchanged.
- ``free`` releases the storage (``untyped_storage().resize_(0)``): that is the gathered
  parameters' whole lifetime, whoever else views them. So a unit that stays gathered
  (``resident`` parts, ``reshard_after_forward=False``) is one whose schedule frees it later,
  and a graph kept until backward holds no memory between ``free`` and the re-gather.
- ``backward`` writes a stack unit's gradient into the gradient buffer (a traced program's
  flatten is a copy into its rows' views, ``fz3.step.into``; autograd's result is copied); its
  reduce reads it, and ``wait_reduce`` releases it (other units' flat gradients are autograd's
  tensors, let go when their reduce is waited). Every reduce lands in the step's result (the
  part's gradient shard, ``executor.result_lander``; with ``join_grads`` a buffer per unit
  joined into it at the end; with ``update`` ops a buffer per unit its update lets go), never
  here. ``accumulate``'s carry takes the first micro-batch's gradient
  tensor over (``hand_over_grad``; the memory makes a new one at its next backward), later
  ones are added into it and released.
- What must outlive ``free`` is copied first or handed over: a layer's aux output or an
  extra that views the parameters is copied (``unit_io.apart``); ``step_through``'s program
  (``handed_out``) hands each buffer (and gradient) to its frames at ``free`` (at
  ``wait_reduce``) and makes new ones at the next gather (backward), so a frame kept by
  the user keeps its memory, as a graph kept past the step would.
A step that ends in an error leaves the buffers as they are; the next gather regrows them.
"""

from __future__ import annotations

import torch

from ..schedule.schedule import Unit
from ..schedule.structure import Role
from ..sharding.model import ShardedModel
from .engine import Pieces

_set_versions = torch._C._autograd._unsafe_set_version_counter


def _storages(tensors) -> tuple[tuple[torch.UntypedStorage, int], ...]:
    """Each distinct storage of ``tensors`` with its full size in bytes."""
    out: dict[int, tuple] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out.setdefault(storage.data_ptr(), (storage, t.numel() * t.element_size()))
    return tuple(out.values())


def regrow(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage back (contents undefined until written); one that has it is
    left alone (a ``resize_`` to its own size would reallocate it)."""
    size = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() != size:
        storage.resize_(size)
    return t


class UnitMemory:
    """One unit's memory (the module's Note)."""

    def __init__(self, model: ShardedModel, unit: Unit, *, all_reduce: bool, handed_out: bool):
        part = model.parts[unit.part]
        self.k, self.world, self.device = len(unit.layers), model.world_size, model.device
        self.stack, self.handed_out = unit.role is Role.STACK, handed_out
        self.compute_dtype, self.reduce_dtype = model.precision.compute, model.precision.reduce
        self.all_reduce = all_reduce  # the schedule reduces by all-reduce, not reduce-scatter
        frozen = model.frozen[unit.part]
        self.numel = self.world * self.k * part.layout.shard_numel
        self.frozen_numel = None if frozen is None else \
            self.world * self.k * part.frozen.shard_numel
        self.frozen_dtype = None if frozen is None else frozen.dtype
        self.pieces: Pieces | None = None
        self.grad: torch.Tensor | None = None
        self._make()
        if self.stack:
            self._make_grad()

    # parameters

    def _make(self) -> None:
        trained, layered, rows = self._buffers(self.numel, self.compute_dtype)
        frozen = frozen_layered = None
        frozen_rows: tuple = ()
        if self.frozen_numel is not None:
            frozen, frozen_layered, frozen_rows = self._buffers(self.frozen_numel,
                                                                self.frozen_dtype)
        self.flat = (trained, frozen)  # the flat buffers gathers write into
        self.pieces = Pieces(layered, rows, frozen_layered, frozen_rows,
                             tuple({} for _ in rows))
        self.staged = self.stack and self.k > 1 and self.world > 1
        self.versioned = tuple(b for b in (layered, frozen_layered) if b is not None)
        # (storage, its bytes) of what gathers write, and of every buffer (``free``'s)
        self.written = _storages(b for b in (trained, frozen) if b is not None)
        self.storages = _storages(b for b in (trained, *self.versioned, frozen) if b is not None)
        for storage, _ in self.storages:
            storage.resize_(0)
        self.versions = tuple(t._version for t in self.versioned)

    def _buffers(self, numel: int, dtype: torch.dtype) -> tuple:
        """``(flat, layered, rows)``: the flat buffer gathers write into, the unit's buffer
        as ``Pieces`` holds it, its layer rows."""
        flat = torch.empty(numel, dtype=dtype, device=self.device)
        if not self.stack:
            return flat, flat, ()
        if self.k == 1:
            return flat, flat.view(1, -1), (flat,)
        layered = flat.view(self.k, -1) if self.world == 1 else \
            torch.empty(self.k, numel // self.k, dtype=dtype, device=self.device)
        return flat, layered, layered.unbind(0)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a gather writes into: the trained and frozen flat buffers, storage regrown."""
        if self.pieces is None:
            self._make()
        for storage, size in self.written:
            if storage.nbytes() != size:
                storage.resize_(size)
        return self.flat

    def arrange(self, trained: torch.Tensor, frozen: torch.Tensor | None) -> Pieces:
        """The waited gathers (``flat``'s buffers) as ``Pieces``: a k-layer unit's
        staging copied into layer order and released; version counters as before."""
        pieces = self.pieces
        if self.staged:
            for out, layered in ((trained, pieces.buffer), (frozen, pieces.frozen)):
                if out is not None:
                    k = self.k
                    regrow(layered).view(k, self.world, -1).copy_(
                        out.view(self.world, k, -1).transpose(0, 1))
                    out.untyped_storage().resize_(0)
        _set_versions(self.versioned, self.versions)
        return pieces

    def free(self) -> None:
        """Release the storage; handed out (``step_through``): forget the tensors instead,
        new ones are made at the next gather."""
        if self.handed_out:
            self.pieces = None
            return
        for storage, _ in self.storages:
            storage.resize_(0)

    # gradients (a stack unit's)

    def _make_grad(self) -> None:
        """The flat gradient ``(world*k*n,)`` in the reduce dtype; ``grad_layered``, its
        layer-major ``(k, padded)`` form in the compute dtype that backward writes: the same
        memory unless the reduce wants rank-major rows of k > 1 layers or another dtype."""
        k, world, dtype, rdt = self.k, self.world, self.compute_dtype, self.reduce_dtype
        self.grad = torch.empty(self.numel, dtype=rdt, device=self.device)
        self.grad_apart = rdt != dtype or (k > 1 and world > 1 and not self.all_reduce)
        self.grad_layered = (torch.empty(k, self.numel // k, dtype=dtype, device=self.device)
                             if self.grad_apart else self.grad.view(k, -1))
        # each layer's row, with the views ``fz3.step.into`` keeps of it
        self.grad_each = tuple((r, {}) for r in self.grad_layered.unbind(0))
        self.grad_storages = _storages((self.grad, self.grad_layered))
        for storage, _ in self.grad_storages:
            storage.resize_(0)

    def grad_into(self) -> tuple[torch.Tensor, tuple[tuple[torch.Tensor, dict], ...]]:
        """``(rows, each row)``: the ``(k, padded)`` gradient backward writes, storage regrown."""
        if self.grad is None:
            self._make_grad()
        for storage, size in self.grad_storages:
            if storage.nbytes() != size:
                storage.resize_(size)
        return self.grad_layered, self.grad_each

    def unreduced(self, g: torch.Tensor | None) -> torch.Tensor:
        """The flat gradient as the reduce takes it, from backward's ``(k, padded)`` (or
        ``(padded,)``) gradient ``g`` (copied unless written in place; None: zeros):
        ``(world, k, n)`` rank-major, one layer's ``(world*n,)``, or with an all-reduce a
        ``(world, k, n)`` view of layer-major memory."""
        rows = None if self.grad is None else self.grad_layered
        if g is None or rows is None or g.data_ptr() != rows.data_ptr():
            # not written in place by a traced backward (``grad_into`` then grew the memory):
            # autograd's, or none
            rows = self.grad_into()[0]
            if g is None:
                rows.zero_()
            else:
                rows.copy_(g.view(rows.shape))
        grad, k, world = self.grad, self.k, self.world
        if self.grad_apart:
            if self.all_reduce or k == 1:
                grad.copy_(rows.view(-1))
            else:
                grad.view(world, k, -1).copy_(rows.view(k, world, -1).transpose(0, 1))
            rows.untyped_storage().resize_(0)
        if self.all_reduce:
            return grad.view(k, world, -1).transpose(0, 1)
        return grad if k == 1 else grad.view(world, k, -1)

    def free_grad(self) -> None:
        """After its reduce: release the gradient (handed out: forget it)."""
        if self.handed_out:
            self.grad = None
            return
        for storage, _ in self.grad_storages:
            storage.resize_(0)

    def hand_over_grad(self) -> None:
        """The gradient's tensor is someone else's now (``accumulate``'s carry)."""
        self.grad = None

