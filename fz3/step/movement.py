"""The steps that move a unit's memory: its gather and wait, its free, its gradient's reduce
and wait (or its accumulation across micro-batches), and the update that steps its
parameters with the reduced gradient and lets it go. ``fz3.step.executor`` lowers a schedule
into such steps beside its compute ones; ``memory.py``'s Note says each buffer's lifetime.

Each is made once per op, ``(model, schedule, op, index, memories) -> step``, with everything
that does not change between steps decided then (the unit's shapes, its dtypes, the
collective's kind and name, its memory: ``fz3.step.memory``); the step, ``(state) -> None``,
is what runs.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..comm.collectives import all_gather, all_reduce, reduce_scatter, wait
from ..schedule.ops import Op
from ..schedule.schedule import Schedule, Unit
from ..schedule.structure import Role
from ..sharding.model import ShardedModel
from .memory import UnitMemory
from .state import Frame, Gathering, Reduced, Reducing, Shard, Step, StepState


def gather_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
              memories: tuple[UnitMemory, ...]) -> Step:
    """The unit's trained shard (cast to the compute dtype before a gather across ranks: bf16
    moves half the bytes; at one rank the copy casts) and its frozen one, gathered into its
    memory (``fz3.step.memory``)."""
    u, comm, unit, memory = op.unit, model.comm, schedule.units[op.unit], memories[op.unit]
    part, label, dtype = unit.part, Label(schedule, op), model.precision.compute
    pick = _picker(unit, model.frozen[unit.part])
    cast = not comm.local and dtype != torch.float32

    def gather(s: StepState) -> None:
        trained, frozen = pick(s.call.shards.parts[part])
        if cast and trained.dtype != dtype:
            trained = trained.to(dtype)
        out_t, out_f = memory.outputs()
        t = all_gather(comm, out_t, trained, label)
        f = None if frozen is None else all_gather(comm, out_f, frozen, label)
        s.params[u] = Gathering(t, f)

    return gather


def _picker(unit: Unit, frozen: torch.Tensor | None
            ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]:
    """What a unit gathers, ``pick(trained) -> (trained, frozen)``, both 1-D: from its
    part's trained shard (``(L, shard)`` for a stack) a one-layer unit its row, a unit of k
    layers its ``(k, shard)`` rows flat, any other unit the shard; likewise from ``frozen``."""
    if unit.role is not Role.STACK:
        flat = None if frozen is None else frozen.reshape(-1)
        return lambda trained: (trained.reshape(-1), flat)
    first, stop = unit.layers.start, unit.layers.stop
    if stop - first == 1:
        row = None if frozen is None else frozen[first]
        return lambda trained: (trained[first], row)
    rows_k = None if frozen is None else frozen[first:stop].reshape(-1)
    return lambda trained: (trained[first:stop].reshape(-1), rows_k)


def wait_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
            memories: tuple[UnitMemory, ...]) -> Step:
    """The unit's gathered memory, one ``Pieces`` record (``UnitMemory.arrange``)."""
    u, memory = op.unit, memories[op.unit]

    def wait_(s: StepState) -> None:
        # out of the table before waiting, as wait_reduce's: a wait that raises leaves no record
        # for ``drain`` to wait on again, nor for ``abandon`` to count twice
        gathering = s.params.pop(u)
        trained = wait(gathering.trained)
        frozen = None if gathering.frozen is None else wait(gathering.frozen)
        s.params[u] = memory.arrange(trained, frozen)

    return wait_


def free_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
            memories: tuple[UnitMemory, ...]) -> Step:
    u, memory = op.unit, memories[op.unit]

    def free(s: StepState) -> None:
        if s.params.pop(u, None) is not None:
            memory.free()

    return free


def reduce_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
              memories: tuple[UnitMemory, ...]) -> Step:
    """This rank's shard of the unit's flat gradient (plus what earlier micro-batches carried)
    into where the step's result holds it (``result_lander``)."""
    u, comm, unit = op.unit, model.comm, schedule.units[op.unit]
    land, label = result_lander(model, schedule, unit), Label(schedule, op)
    if schedule.reduce == "all_reduce":  # in place, on the layer-major memory of g
        stack = unit.role is Role.STACK

        def reduce_all(s: StepState) -> None:
            g = _with_carry(s, u)
            # a (world, k, n) view of layer-major memory -> that (k, world, n) memory: no copy
            g = g.transpose(0, 1).contiguous() if stack else g
            s.grad[u] = Reducing(all_reduce(comm, g, label=label), land(s))

        return reduce_all
    rdt, device = model.precision.reduce, model.device
    fp32 = rdt == torch.float32

    def reduce(s: StepState) -> None:
        g = _with_carry(s, u)
        shard = land(s)  # fully written by the reduce
        out = shard if fp32 else torch.empty(shard.numel(), dtype=rdt, device=device)
        s.grad[u] = Reducing(reduce_scatter(comm, out, g if g.dim() == 1 else g.reshape(-1),
                                            label), shard)

    return reduce


def _with_carry(s: StepState, u: int) -> torch.Tensor:
    """The unit's unreduced gradient, plus what earlier micro-batches deferred (``carry``)."""
    g, carry = s.grad.pop(u), s.call.carry
    if carry and u in carry:
        g = carry.pop(u).add_(g)
    return g


def wait_reduce_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
                   memories: tuple[UnitMemory, ...]) -> Step:
    u, comm, label, memory = op.unit, model.comm, Label(schedule, op), memories[op.unit]
    replicate = comm.replicas > 1
    every = schedule.reduce == "all_reduce"
    stack, updates = schedule.units[u].role is Role.STACK, schedule.updates

    def wait_reduce(s: StepState) -> None:
        pending, shard = s.grad.pop(u)
        out = wait(pending)
        if every:  # this rank's chunk of each layer
            mine = out[:, comm.rank] if stack else out.view(comm.world_size, -1)[comm.rank]
            shard.view(mine.shape).copy_(mine)
        elif out is not shard:
            shard.copy_(out)
        if stack:
            memory.free_grad()
        # hybrid: sum the shard across replicas, waited at the end (or here, before its update)
        if replicate and s.call.reduces_replicas:
            summing = all_reduce(comm, shard, group=comm.replicate_group, label=label)
            if updates:
                wait(summing)
            else:
                s.replicating.append(summing)
        if updates:  # its update steps the parameters with it (``fz3.train_step``)
            s.grad[u] = Reduced(shard)

    return wait_reduce


def accumulate_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
                  memories: tuple[UnitMemory, ...]) -> Step:
    """The unit's flat gradient carried to the next micro-batch: the first taken over from
    its memory (``UnitMemory.hand_over_grad``), later ones added into it."""
    u, stack, memory = op.unit, schedule.units[op.unit].role is Role.STACK, memories[op.unit]

    def accumulate(s: StepState) -> None:
        g, carry = s.grad.pop(u), s.call.carry
        if u in carry:
            carry[u].add_(g)
            if stack:
                memory.free_grad()
        else:
            carry[u] = g
            if stack:
                memory.hand_over_grad()

    return accumulate


def result_lander(model: ShardedModel, schedule: Schedule, unit: Unit
                  ) -> Callable[[StepState], torch.Tensor]:
    """``land(state)``: where this rank's reduced gradient of ``unit`` lands: its rows of the
    part's gradient shard in the step's result, allocated at the part's first reduce (and
    split into rows once: one op for all the part's units); for a part in
    ``Schedule.join_grads``, the unit's own ``(k, shard)`` rows, joined into the part's shard
    after the backward (``joined``); with ``update`` ops, the unit's own rows, stepped and
    let go by its update (``update_op``)."""
    p, part, device = unit.part, model.parts[unit.part], model.device
    first, stop = unit.layers.start, unit.layers.stop
    if schedule.updates:  # its own, until its update (``fz3.train_step``): nothing is joined
        size = (stop - first if unit.role is Role.STACK else 1) * part.layout.shard_numel
        return lambda s: torch.empty(size, dtype=torch.float32, device=device)
    if p in schedule.join_grads:
        shape = (stop - first, part.layout.shard_numel)

        def own_rows(s: StepState) -> torch.Tensor:
            rows = s.results.setdefault(p, {})[first] = torch.empty(
                shape, dtype=torch.float32, device=device)
            return rows.view(-1)

        return own_rows
    stack = part.role is Role.STACK
    shape = (part.rows, part.layout.shard_numel) if stack else (part.layout.shard_numel,)

    def shard(s: StepState) -> Shard:
        grad = torch.empty(shape, dtype=torch.float32, device=device)
        got = s.results[p] = Shard(grad, grad.unbind(0) if stack else ())
        return got

    if unit.role is not Role.STACK:
        return lambda s: (s.results.get(p) or shard(s)).grad
    if stop - first == 1:
        return lambda s: (s.results.get(p) or shard(s)).rows[first]
    return lambda s: (s.results.get(p) or shard(s)).grad[first:stop].view(-1)


def update_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
              memory: UnitMemory) -> Step:
    """The unit's parameter shard (its layers of its part's) stepped with its reduced gradient
    shard by the call's optimizer (``Call.update``, ``fz3.train_step``), which lets it go."""
    u, unit = op.unit, schedule.units[op.unit]
    part, n = unit.part, model.parts[unit.part].layout.shard_numel
    stack = unit.role is Role.STACK
    layers = slice(unit.layers.start, unit.layers.stop) if stack else None

    def update(s: StepState) -> Frame | None:
        shard = s.grad.pop(u).shard
        grad = shard.view(-1, n) if stack else shard
        s.call.update(part, layers, grad)
        if s.call.frames:  # its gradient shard, and its parameter shard as stepped (an alias:
            # the given shards are emptied when the step ends, ``fz3.optim.base``)
            stepped = s.call.shards.parts[part]
            return Frame(index, op, None, grad, (stepped if layers is None else stepped[layers])
                         .detach(), None)
        return None

    return update


class Label(NamedTuple):
    """What a collective is, named only if it fails (no string is built on the hot path)."""

    schedule: Schedule
    op: Op

    def __str__(self) -> str:
        return self.schedule.describe(self.op)
