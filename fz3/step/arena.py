"""Fixed buffers for a lowered schedule: each gather's output, a k-layer unit's layer-major
copy, a one-layer unit's unreduced gradient and a low-precision reduce's output live in
buffers that every step reuses at the same addresses (``Arena``); ``fz3.step.executor.lower``
hands each op its own (``Arena.plan``).

[Note: fixed buffers]
``plan`` walks the schedule's ops once, as the memory plan's fold does: a gather takes a
spare buffer of its kind (its size and dtype) or a new one, and its ``free`` gives it back;
a unit of k > 1 layers gives its rank-major gather's back at its ``wait``, which copies it
into a layer-major one kept until ``free``; a one-layer unit's backward takes one for its
unreduced gradient (its traced program writes into it: ``fz3.step.into``), and a
reduce in a dtype other than fp32 one for its output, both until its wait. Two buffers alive
at once never share one, and an op uses the same one every step. Each is made at its first
use and kept between steps: the arena holds, per kind, as many as were alive at once
(``Arena.nbytes``), and a steady step allocates none of them.

Not fixed: a gradient carried across micro-batches (``accumulate``'s deferred program), and
one in another dtype than the compute dtype (its cast is the executor's), a k-layer unit's
gradient (its layers' rows stacked). And a unit whose graph holds views of its buffer past its
``free`` (pre's and between's autograd graphs, the autograd engine's, a traced residual that
views it, a shared unit a kept graph read: ``fz3.step.movement``'s ``free``) has that
buffer's storage released there and re-gathered into the same storage before its backward:
its fixed buffer lets that tensor go (``Fixed.let_go``) and makes a new one at its next use,
so such a unit allocates its gather every step, as it did before the arena. A one-rank
group's gather is the shard itself (``fz3.comm``): nothing there takes a buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..schedule.ops import OpKind
from ..schedule.schedule import Schedule
from ..schedule.structure import Role
from ..sharding.model import ShardedModel

if TYPE_CHECKING:
    from .views import Views


class Fixed:
    """One fixed buffer of the arena, flat; made at its first use."""

    __slots__ = ("tensor", "numel", "dtype", "device", "made", "made_by")

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.tensor: torch.Tensor | None = None
        self.numel, self.dtype, self.device = numel, dtype, device
        self.made: tuple | None = None  # ``views``' last answer, and what made it
        self.made_by: Views | None = None

    def get(self) -> torch.Tensor:
        t = self.tensor
        if t is None:
            t = self.tensor = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return t

    def views(self, make: Views) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(flat, make(flat))``, for a gradient written into this buffer
        (``fz3.step.into``): made again only when another ``make`` than the last asks, of
        other shapes (a layer's backward and its recompute program ask for the same views;
        two layers' programs whose gradients take turns in one buffer make theirs at each
        turn)."""
        if self.made_by is not make:
            if self.made_by is None or self.made_by.shapes != make.shapes:
                flat = self.get()
                self.made = (flat, make(flat))
            self.made_by = make
        return self.made

    def let_go(self, buffer: torch.Tensor | None) -> None:
        """Forget this buffer's tensor if ``buffer`` is it (or a view of it from its start): a
        graph keeps it, with its storage released (``fz3.step.state.release``)."""
        t = self.tensor
        if t is not None and buffer is not None and t.data_ptr() == buffer.data_ptr():
            self.tensor = self.made = self.made_by = None


class OpFixed(NamedTuple):
    """One op's fixed buffers, each None where it takes none: a gather's outputs (``trained``,
    ``frozen``), a k-layer unit's wait's layer-major copies, a free's (those it gives back);
    a one-layer unit's backward's unreduced gradient (``grad``); a low-precision reduce's
    output (``reduced``)."""

    trained: Fixed | None = None
    frozen: Fixed | None = None
    grad: Fixed | None = None
    reduced: Fixed | None = None


class Arena:
    """The fixed buffers of one step function's programs (``value_and_grad``;
    ``accumulate``'s two, which never run at once, share them). Local; ``plan`` is called once
    per program."""

    def __init__(self, model: ShardedModel):
        self.model = model
        self.kinds: dict[tuple, list[Fixed]] = {}  # by kind, every buffer planned so far

    def plan(self, schedule: Schedule) -> dict[int, OpFixed]:
        """Each gather, wait, free, backward and reduce op's fixed buffers, by op index ([Note:
        fixed buffers]); none for a one-rank group, whose gathers copy nothing."""
        model = self.model
        if model.comm.local:
            return {}
        # by kind: numbers of those spare, last freed first; every buffer another program of
        # this arena made is spare at the start (programs never run at once)
        free = {kind: list(range(len(made)))[::-1] for kind, made in self.kinds.items()}
        live: dict[int, list[tuple]] = {}  # by unit: (kind, number) of its buffers, or None
        reducing: dict[int, list] = {}  # by unit: its unreduced gradient's, its reduce's
        out: dict[int, OpFixed] = {}
        compute = model.precision.compute
        # a gradient carried across micro-batches (``accumulate``) outlives the step: not fixed
        carried = {op.unit for op in schedule.ops if op.kind == OpKind.ACCUMULATE}

        def take(kind: tuple | None) -> tuple | None:
            if kind is None:
                return None
            spare = free.setdefault(kind, [])
            return kind, spare.pop() if spare else self._new(kind)

        def give(taken: tuple | None) -> None:
            if taken is not None:
                free[taken[0]].append(taken[1])

        def fixed(taken: tuple | None) -> Fixed | None:
            return None if taken is None else self.kinds[taken[0]][taken[1]]

        for index, op in enumerate(schedule.ops):
            u, unit = op.unit, schedule.units[op.unit]
            k = len(unit.layers)
            if op.kind == OpKind.GATHER:
                live[u] = [take(kind) for kind in self._kinds(unit)]
                out[index] = OpFixed(*map(fixed, live[u]))
            elif op.kind == OpKind.WAIT and unit.role is Role.STACK and k > 1:
                gathered, live[u] = live[u], [take(kind) for kind in self._kinds(unit)]
                for taken in gathered:
                    give(taken)
                out[index] = OpFixed(*map(fixed, live[u]))
            elif op.kind == OpKind.FREE and u in live:
                out[index] = OpFixed(*map(fixed, live[u]))
                for taken in live.pop(u):
                    give(taken)
            elif op.kind == OpKind.BACKWARD and unit.role is Role.STACK and k == 1 and \
                    model.precision.reduce == compute and u not in carried:
                # the unreduced gradient, written by the layer's program where it can
                part = model.parts[unit.part]
                reducing[u] = [take(("grad", part.layout.padded, compute))]
                out[index] = OpFixed(grad=fixed(reducing[u][0]))
            elif op.kind == OpKind.REDUCE and schedule.reduce != "all_reduce" and \
                    model.precision.reduce != torch.float32:
                n = model.parts[unit.part].layout.shard_numel * k
                reducing.setdefault(u, []).append(take((n, model.precision.reduce)))
                out[index] = OpFixed(reduced=fixed(reducing[u][-1]))
            elif op.kind == OpKind.WAIT_REDUCE and u in reducing:
                for taken in reducing.pop(u):
                    give(taken)
        return out

    def _kinds(self, unit) -> list[tuple | None]:
        """A unit's gathered buffers' kinds: (numel, dtype) of its trained one, and of its
        frozen one (None: it has none)."""
        model, k = self.model, len(unit.layers)
        part, world = model.parts[unit.part], model.world_size
        trained = (world * k * part.layout.shard_numel, model.precision.compute)
        frozen = model.frozen[unit.part]
        return [trained, None if frozen is None
                else (world * k * part.frozen.shard_numel, frozen.dtype)]

    def _new(self, kind: tuple) -> int:
        made = self.kinds.setdefault(kind, [])
        made.append(Fixed(*kind[-2:], self.model.device))
        return len(made) - 1

    def nbytes(self) -> int:
        """Bytes the arena holds now (buffers made and not let go)."""
        return sum(s.tensor.numel() * s.tensor.element_size() for made in self.kinds.values()
                   for s in made if s.tensor is not None)
