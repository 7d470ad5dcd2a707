"""The steps that move a unit's memory: its gather and wait, its free, its gradient's reduce
and wait (or its accumulation across micro-batches). ``fz3.step.executor`` lowers a schedule
into such steps beside its compute ones; ``state.py``'s Note says each buffer's lifetime.

Each is made once per op, ``(model, schedule, op, index, fixed) -> step``, with everything
that does not change between steps decided then (the unit's shapes, its dtypes, the
collective's kind and name, its fixed buffers: ``fixed``, ``fz3.step.arena``, or None); the
step, ``(state) -> None``, is what runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..comm.collectives import all_gather, all_reduce, reduce_scatter, wait
from ..schedule.ops import Op
from ..schedule.schedule import Schedule
from ..schedule.structure import Role
from ..sharding.model import ShardedModel
from . import shapes
from .arena import OpFixed
from .engine import Pieces
from .shapes import regrow
from .state import Gathering, Kept, Reducing, Released, Step, StepState, release
from .unit_io import result_lander


def gather_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
              fixed: OpFixed | None) -> Step:
    """The unit's trained shard, cast to the compute dtype before the gather (bf16 moves half
    the bytes), and its frozen one (stored in that dtype already), each gathered into the
    storage a live graph saved views of (or copied into it by the wait), else its fixed
    buffer (``fixed``, ``fz3.step.arena``), else a new one."""
    u, comm, unit = op.unit, model.comm, schedule.units[op.unit]
    part, label, dtype = unit.part, Label(schedule, op), model.precision.compute
    pick = shapes.shard_picker(unit, model.frozen[unit.part])
    in_place = shapes.gathers_in_place(unit)
    into_t, into_f = fixed[:2] if fixed else (None, None)  # fz3.step.arena's, or new buffers

    def gather(s: StepState) -> None:
        trained, frozen = pick(s.params.parts[part], s.shard_rows)
        cast = trained.dtype != dtype
        if cast:  # the step's own memory
            trained = trained.to(dtype)
        back = s.released.get(u) if in_place and s.released else None
        if back is None:
            out_t, out_f = into_t and into_t.get(), into_f and into_f.get()
        else:  # its storage back, written into: a program's views of it are kept
            out_t, out_f = _regrown(back)
        t = all_gather(comm, out_t, trained, label)
        f = None if frozen is None else all_gather(comm, out_f, frozen, label)
        # across ranks into buffers of its own (not one rank's copy or hand-back: [Note: a
        # group of one rank]), which free may keep
        written = t.work is not None
        s.gathering[u] = Gathering(t, f, (cast or not t.is_input, f is None or not f.is_input),
                                   written)

    return gather


def _regrown(back: Released) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A released record's buffers, trained and frozen, with their storage back (None stays
    None): a gather writes into them as they are (1-D), a k-layer unit's wait copies."""
    trained, frozen = back.trained, back.frozen
    if trained is not None:
        regrow(trained)
    if frozen is not None:
        regrow(frozen)
    return trained, frozen


def wait_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
            fixed: OpFixed | None) -> Step:
    """The unit's gathered memory, one ``Pieces`` record: its trained buffer (``(k, full)``
    for a stack unit, layer-major), each layer's row, its frozen buffer and rows."""
    u, unit = op.unit, schedule.units[op.unit]
    arrange, k = shapes.arranger(unit, model.world_size), len(unit.layers)
    in_place = shapes.gathers_in_place(unit)
    into_t, into_f = fixed[:2] if fixed else (None, None)  # k > 1: the layer-major copy's

    def wait_(s: StepState) -> None:
        gathering = s.gathering.pop(u)
        back = s.released.pop(u, None) if s.released else None
        if back is None:
            in_t = None if into_t is None else into_t.get().view(k, -1)
            in_f = None if into_f is None else into_f.get().view(k, -1)
        elif not in_place:  # its storage back, for the copy
            in_t, in_f = _regrown(back)
        else:
            # the gather wrote into it, regrown there (a resize_ to its own size would
            # reallocate it, under a gather still writing into it)
            in_t = in_f = None
        out = wait(gathering.trained)
        buffer, rows = arrange(out, in_t)
        frozen, frozen_rows = (None, ()) if gathering.frozen is None else \
            arrange(wait(gathering.frozen), in_f)
        if back is not None:
            # The graph's saved views now hold the same values again; collectives and the copy
            # bumped the version counters (gloo: when the work completes), which autograd
            # would take for an in-place change. Restore them.
            for version in back.versions:
                with version:
                    pass
        s.gathered[u] = Pieces(buffer, rows, frozen, gathering.owned, frozen_rows,
                               gathering.written)

    return wait_


def free_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
            fixed: OpFixed | None) -> Step:
    u = op.unit
    shared = schedule.units[u].role is Role.SHARED
    held = fixed[:2] if fixed else (None, None)
    gathered_as = shapes.gathered_as(schedule.units[u])
    # a one-layer unit of a stack is regathered into the same objects (its fixed buffers, if
    # any, are that already); not pre, post or a shared unit, gathered once a step, whose
    # parameters an aux or an extra may hand on as views
    reusable = shapes.keeps_its_rows(schedule.units[u]) and held == (None, None)

    def free(s: StepState) -> None:
        gathered = s.gathered.pop(u, None)
        if gathered is None:
            return
        saved = s.saved.get(u)
        # traced layers whose residuals view none of the buffer do not hold it
        if not (isinstance(saved, Kept) and saved.engine.holds_buffer
                or shared and held_by_a_reader(s, u)):
            if reusable and s.reuse and gathered.written:
                # the next gather writes into the same objects, so the views a program made of
                # them are kept (``fz3.step.views.RowViews``): free the storage only
                trained, frozen = gathered_as(gathered)
                trained.untyped_storage().resize_(0)
                if frozen is not None:
                    frozen.untyped_storage().resize_(0)
                # (``release`` inlined: no graph holds it, so no versions; per layer, 2 calls)
                s.released[u] = Released(trained, frozen, ())
            return
        # a live graph holds views: free the storage only (not the parameters' own, which a
        # one-rank run computes on)
        buffers = tuple(b if own else None
                        for b, own in zip(gathered_as(gathered), gathered.owned))
        if any(b is not None for b in buffers):
            for fix, b in zip(held, buffers):  # new ones next time ([Note: fixed buffers])
                if fix is not None:
                    fix.let_go(b)
            s.released[u] = release(buffers)

    return free


def held_by_a_reader(s: StepState, u: int) -> bool:
    """A shared unit's buffer is an input of every graph that read it: one kept until its
    backward (pre's, a between's, a saved layer's) would keep the whole buffer alive."""
    units = s.schedule.units
    return any(isinstance(saved, Kept) and u in units[v].reads for v, saved in s.saved.items())


def reduce_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
              fixed: OpFixed | None) -> Step:
    """This rank's shard of the unit's flat gradient (plus what earlier micro-batches carried)
    into where the step's result holds it (``unit_io.result_lander``)."""
    u, comm, unit = op.unit, model.comm, schedule.units[op.unit]
    land, label = result_lander(model, schedule, unit), Label(schedule, op)
    if schedule.reduce == "all_reduce":  # in place, on the layer-major memory of g
        stack = unit.role is Role.STACK

        def reduce_all(s: StepState) -> None:
            g = _with_carry(s, u)
            # (k, world, n) -> (world, k, n): no copy
            g = g.transpose(0, 1).contiguous() if stack else g
            s.reducing[u] = Reducing(all_reduce(comm, g, label=label), land(s))

        return reduce_all
    rdt, device = model.precision.reduce, model.device
    fp32, into = rdt == torch.float32, None if fixed is None else fixed.reduced

    def reduce(s: StepState) -> None:
        g = _with_carry(s, u)
        shard = land(s)  # fully written by the reduce
        out = shard if fp32 else into.get() if into is not None else torch.empty(
            shard.numel(), dtype=rdt, device=device)
        s.reducing[u] = Reducing(reduce_scatter(comm, out, g if g.dim() == 1 else g.reshape(-1),
                                                label), shard)

    return reduce


def _with_carry(s: StepState, u: int) -> torch.Tensor:
    """The unit's unreduced gradient, plus what earlier micro-batches deferred (``carry``)."""
    g = s.unreduced.pop(u)
    if s.carry and u in s.carry:
        g = s.carry.pop(u).add_(g)
    return g


def wait_reduce_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
                   fixed: OpFixed | None) -> Step:
    u, comm, label = op.unit, model.comm, Label(schedule, op)
    replicate = comm.replicas > 1
    every = schedule.reduce == "all_reduce"
    stack = schedule.units[u].role is Role.STACK

    def wait_reduce(s: StepState) -> None:
        pending, shard = s.reducing.pop(u)
        out = wait(pending)
        if every:  # this rank's chunk of each layer
            mine = out[:, comm.rank] if stack else out.view(comm.world_size, -1)[comm.rank]
            shard.view(mine.shape).copy_(mine)
        elif out is not shard:
            shard.copy_(out)
        # hybrid: sum the shard across replicas, waited at the end
        if replicate and s.reduces_replicas:
            s.replicating.append(all_reduce(comm, shard, group=comm.replicate_group,
                                            label=label))

    return wait_reduce


def accumulate_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
                  fixed: OpFixed | None) -> Step:
    u = op.unit

    def accumulate(s: StepState) -> None:
        g = s.unreduced.pop(u)
        s.carry[u] = g if u not in s.carry else s.carry[u].add_(g)

    return accumulate


class Label(NamedTuple):
    """What a collective is, named only if it fails (no string is built on the hot path)."""

    schedule: Schedule
    op: Op

    def __str__(self) -> str:
        return self.schedule.describe(self.op)
