"""The handlers that move a unit's memory: its gather and wait, its free, its gradient's
reduce and wait (or its accumulation across micro-batches). ``fz3.step.executor`` runs them
in the schedule's order beside the compute handlers; its Note says each buffer's lifetime.
Each is ``(state, op, index) -> None``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..comm.collectives import all_gather, all_reduce, reduce_scatter, wait
from ..schedule.ops import Op
from ..schedule.schedule import Schedule
from ..schedule.structure import Role
from . import shapes
from .engine import Pieces
from .shapes import regrow
from .state import Gathering, Kept, Reducing, StepState, release
from .unit_io import gather_pieces, result_shard


def gather_op(s: StepState, op: Op, index: int) -> None:
    u, comm = op.unit, s.model.comm
    unit = s.schedule.units[u]
    trained, frozen, cast = gather_pieces(s, unit)
    # gathered back into the storage a live graph saved views of (or copied into it by the wait)
    back = s.released.get(u) if shapes.gathers_in_place(unit) else None
    label = Label(s.schedule, op)
    t = _gather(comm, trained, None if back is None else back.trained, label)
    f = None if frozen is None else _gather(comm, frozen, None if back is None else back.frozen,
                                           label)
    s.gathering[u] = Gathering(t, f, (cast or not t.is_input, f is None or not f.is_input))


def _gather(comm, shard: torch.Tensor, into: torch.Tensor | None, label: Label):
    """Into ``into``'s regrown storage, or a new buffer (one rank's: the shard itself)."""
    out = None if into is None else regrow(into).view(-1)
    return all_gather(comm, out, shard if shard.dim() == 1 else shard.reshape(-1), label)


def wait_op(s: StepState, op: Op, index: int) -> None:
    """The unit's gathered memory, one ``Pieces`` record: its trained buffer (``(k, full)``
    for a stack unit, layer-major), each layer's row, its frozen buffer."""
    u = op.unit
    unit = s.schedule.units[u]
    gathering = s.gathering.pop(u)
    back = s.released.pop(u, None)
    world = s.model.world_size
    out = wait(gathering.trained)
    buffer = shapes.arranged(unit, out, world, None if back is None else back.trained)
    frozen = None if gathering.frozen is None else shapes.arranged(
        unit, wait(gathering.frozen), world, None if back is None else back.frozen)
    rows = shapes.layer_rows(unit, out, buffer)
    if back is not None:
        # The graph's saved views now hold the same values again; collectives and the copy
        # bumped the version counters (gloo: when the work completes), which autograd would
        # take for an in-place change. Restore them.
        for version in back.versions:
            with version:
                pass
    s.gathered[u] = Pieces(buffer, rows, frozen, gathering.owned)


def free_op(s: StepState, op: Op, index: int) -> None:
    u = op.unit
    saved = s.saved.get(u)
    # traced layers whose residuals view none of the buffer do not hold it
    held = (isinstance(saved, Kept) and saved.engine.holds_buffer
            or held_by_a_reader(s, u))
    gathered = s.gathered.pop(u, None)
    if gathered is None or not held:
        return
    # a live graph holds views: free the storage only (not the parameters' own, which a one-rank
    # run computes on)
    buffers = tuple(b if own else None
                    for b, own in zip((gathered.buffer, gathered.frozen), gathered.owned))
    if any(b is not None for b in buffers):
        s.released[u] = release(buffers)


def held_by_a_reader(s: StepState, u: int) -> bool:
    """A shared unit's buffer is an input of every graph that read it: one kept until its
    backward (pre's, a between's, a saved layer's) would keep the whole buffer alive."""
    units = s.schedule.units
    return units[u].role is Role.SHARED and any(
        isinstance(saved, Kept) and u in units[v].reads for v, saved in s.saved.items())


def reduce_op(s: StepState, op: Op, index: int) -> None:
    u, m = op.unit, s.model
    g = s.unreduced.pop(u)
    if s.carry and u in s.carry:  # gradients deferred from earlier micro-batches
        g = s.carry.pop(u).add_(g)
    unit = s.schedule.units[u]
    shard = result_shard(s, unit)  # fully written by the reduce
    if s.schedule.reduce == "all_reduce":  # in place, on the layer-major memory of g
        # (k, world, n): no copy
        g = g if unit.role is not Role.STACK else g.transpose(0, 1).contiguous()
        s.reducing[u] = Reducing(all_reduce(m.comm, g, label=Label(s.schedule, op)), shard)
    else:
        rdt = m.precision.reduce
        out = (shard if rdt == torch.float32
               else torch.empty(shard.numel(), dtype=rdt, device=m.device))
        s.reducing[u] = Reducing(reduce_scatter(m.comm, out, g if g.dim() == 1 else g.reshape(-1),
                                                Label(s.schedule, op)), shard)


def wait_reduce_op(s: StepState, op: Op, index: int) -> None:
    u, comm = op.unit, s.model.comm
    pending, shard = s.reducing.pop(u)
    out = wait(pending)
    if s.schedule.reduce == "all_reduce":  # this rank's chunk of each layer
        stack = s.schedule.units[u].role is Role.STACK
        mine = out[:, comm.rank] if stack else out.view(comm.world_size, -1)[comm.rank]
        shard.view(mine.shape).copy_(mine)
    elif out.data_ptr() != shard.data_ptr():
        shard.copy_(out)
    # hybrid: sum the shard across replicas, waited at the end
    if comm.replicas > 1 and s.reduces_replicas:
        s.replicating.append(all_reduce(comm, shard, group=comm.replicate_group,
                                        label=Label(s.schedule, op)))


def accumulate_op(s: StepState, op: Op, index: int) -> None:
    g = s.unreduced.pop(op.unit)
    s.carry[op.unit] = g if op.unit not in s.carry else s.carry[op.unit].add_(g)


# The executor's own helpers: naming collectives, averaging the loss.


class Label(NamedTuple):
    """What a collective is, named only if it fails (no string is built on the hot path)."""

    schedule: Schedule
    op: Op

    def __str__(self) -> str:
        return self.schedule.describe(self.op)
