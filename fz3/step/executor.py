"""The layer-scan executor: one training step, top to bottom, as a schedule lowered once.

``lower`` makes one step per op of a validated schedule, with what does not change between
steps decided once (the unit, its shapes, dtypes, engine, collective and memory); ``execute``
runs them in order, all sharing a ``StepState``; it yields a ``Frame`` after every compute
op and update (unless told no one reads them) and returns the ``Result``.
``fz3.value_and_grad`` drains it, ``fz3.step_through`` hands the frames to the user. Closing
it early drains every collective still in flight, so no rank is left inside one.

Every op's step is made here, ``(model, schedule, op, index, memories) -> step``, in the order
a step meets them: the compute steps (every unit through one protocol, ``fz3.step.engine``;
what its engine is given and where its results go decided at lowering, ``unit_io.py``), then
the steps that move memory (gather, wait, free, reduce, wait_reduce, accumulate) and the
optimizer's update. Each unit's memory, and its lifetime: ``memory.py``.

[Note: a new op kind]
It touches: ``fz3/schedule/ops.py`` (the ``OpKind`` enum and the state transition table),
one step maker here and its entry in ``STEPS``, the record it keeps in ``state.py`` if any,
and ``fz3/schedule/footprint.py`` if it holds memory (the memory plan and the cost model read
that one fold).
"""

from __future__ import annotations

from typing import Any, Callable, Generator, NamedTuple

import torch

from .. import rng
from ..comm.failures import CollectiveMismatchError
from ..comm.collectives import all_gather, all_reduce, reduce_scatter, wait
from ..schedule.ops import Op, OpKind
from ..schedule.structure import Role
from ..schedule.schedule import Schedule, Unit
from ..sharding import compute
from ..sharding.model import Params, ShardedModel
from .memory import UnitMemory
from .record import observed
from .state import (Call, Frame, Gathering, Loss, Reduced, Reducing, Result, Shard, Step,
                    StepState)
from .unit_io import (add_gradients, apart, aux_cotangents, aux_units, detached, frame_of,
                      grad_lander, joined, output_lander, stacked_aux, unit_engine,
                      unit_memory)


class Program(NamedTuple):
    """A schedule lowered for one model (``lower``): one step per op, in the schedule's order
    (``steps[i]`` runs ``schedule.ops[i]``), and each unit's memory, kept between steps."""

    schedule: Schedule
    steps: tuple[Step, ...]
    memory: tuple[UnitMemory, ...]  # by unit (``fz3.step.memory``)


def lower(model: ShardedModel, schedule: Schedule, *, handed_out: bool = False) -> Program:
    """``schedule`` (validated) as steps made once for ``model``: each op's unit, shapes,
    dtypes, engine, collective and memory decided here, so a step runs its ops without
    reading op kinds or the schedule. Local; the same program runs any batch.
    ``handed_out``: its buffers may outlive the step (``step_through``'s frames:
    ``UnitMemory.free``)."""
    every = schedule.reduce == "all_reduce"
    memory = tuple(UnitMemory(model, unit, all_reduce=every, handed_out=handed_out)
                   for unit in schedule.units)
    return Program(schedule, tuple(STEPS[op.kind](model, schedule, op, index, memory)
                                   for index, op in enumerate(schedule.ops)), memory)


def execute(model: ShardedModel, program: Program, params: Params, batch: Any, recorder=None,
            *, loss: Loss | None = None, loss_scale: float | torch.Tensor = 1.0,
            carry: dict[int, torch.Tensor] | None = None, reduce_replicas: bool = True,
            traced=None, frames: bool = True, update=None) -> Generator[Frame, None, Result]:
    """Run ``program`` (``lower``) on ``batch``. ``loss``: the function the ``loss`` op runs
    (default: the model's ``post``). ``loss_scale`` multiplies the backward's seed (fp16 loss
    scaling; 1/k for k accumulated micro-batches). ``carry``: unsharded flat gradients
    accumulated by ``accumulate`` ops, added in at the next ``reduce`` of each unit.
    ``reduce_replicas`` (hybrid sharding): sum the gradient shards across replicas (False:
    the caller does it once for several micro-batches). ``recorder``: a ``fz3.Recorder``, or
    None (no cost). ``traced``: a ``fz3.step.traced.TracedLayers`` whose programs run the
    layers (without the autograd engine), or None (autograd). ``frames=False``: no ``Frame``
    is made or yielded (a caller that only drains the step). ``update``: what the schedule's
    ``update`` ops step each unit's parameters with (``fz3.train_step``'s optimizer)."""
    schedule = program.schedule
    state = StepState(Call(model, schedule, params, batch, loss or Loss(model.post), loss_scale,
                           carry, reduce_replicas, traced, frames, update))
    # With a profiler running, each op is a named range in its trace; else a check per step.
    profiling = torch.autograd._profiler_enabled()
    try:
        with compute.mode(model):
            if recorder is None and not profiling:
                for step in program.steps:
                    frame = step(state)
                    if frame is not None:
                        yield frame
                        frame = None  # it holds the unit's buffer: not past the next op
            else:
                yield from observed(state, schedule, program.steps, recorder, profiling)
            return _finish(state)
    except BaseException as e:
        if isinstance(e, CollectiveMismatchError):  # ranks are absent: waiting would hang
            state.abandon(model.comm.abandoned)
        raise
    finally:
        state.drain(wait)


# The compute steps: (model, schedule, op, index, memories) -> step.


def _forward(model: ShardedModel, schedule: Schedule, op: Op, index: int,
             memories: tuple[UnitMemory, ...]) -> Step:
    """A unit's forward, keeping what its engine's mode keeps (for a layer unit its op's
    predicate, ``Op.saves``, ``fz3.schedule.saveable``)."""
    u, producer, grad = op.unit, schedule.producers.get(op.unit), schedule.grad
    memory, find = unit_engine(model, schedule, op, memories)
    land = output_lander(model, schedule, op)

    def forward(s: StepState) -> Frame | None:
        h = s.h  # (None for pre)
        second = s.call.batch if producer is None else s.outputs[producer]
        engine = find(s.call, h, second)
        outputs, residuals = engine.forward(memory, (h, second))
        if grad or residuals is not None:
            s.activation[u] = (engine, residuals)
        s.h = outputs[0]
        return frame_of(s, op, index, second if h is None else h,
                        s.h if land is None else land(s, outputs, residuals), None)

    return forward


def _loss(model: ShardedModel, schedule: Schedule, op: Op, index: int,
          memories: tuple[UnitMemory, ...]) -> Step:
    """post, or the given loss function: with gradients its backward runs at once, seeded
    1/ranks (the reduces are sums over ranks, the loss a mean). The layers' aux outputs
    (``layer_aux``, one tensor per stack) are its fourth argument."""
    u, grad, ranks, comm = op.unit, schedule.grad, _ranks(model), model.comm
    memory, find = unit_engine(model, schedule, op, memories)
    reads = (u, *schedule.units[u].reads)
    stacks = aux_units(schedule) if model.layer_aux else None

    def loss_(s: StepState) -> Frame:
        call, h = s.call, s.h
        g, read_grads = None, None
        layer_aux = None if stacks is None else stacked_aux(s, stacks)
        engine = find(call, h, call.batch)
        (loss, aux), residuals = engine.forward(memory, (h, call.batch, layer_aux))
        if grad:
            s.h = None  # the last layer's output: no op after the loss reads it (its frame's)
            seed = torch.full_like(loss, 1.0 / ranks) * call.loss_scale
            params, (s.grad_h, _, g_aux) = engine.backward(memory, residuals, (seed, None))
            aux_cotangents(s, stacks or (), g_aux)
            g, read_grads = add_gradients(s, u, params)
            s.rng_after = rng.capture(model.device)
        s.loss, s.aux = loss, apart(detached(aux), s, reads)
        s.loss_mean = all_reduce(comm, s.loss.float() / ranks, group=comm.group,
                                 label="the loss's mean")
        return frame_of(s, op, index, h if layer_aux is None else (h, layer_aux), loss, g,
                        read_grads)

    return loss_


def _backward(model: ShardedModel, schedule: Schedule, op: Op, index: int,
              memories: tuple[UnitMemory, ...]) -> Step:
    """A unit's backward: the cotangents of its outputs are h's (``grad_h``) and its grad
    record's (by output position: its extras' sums, which the layers after it add into; a
    layer unit's aux outputs', from the loss); the gradients of the extras it was given are
    summed into its producer's record."""
    u, producer = op.unit, schedule.producers.get(op.unit)
    memory = unit_memory(schedule, op, memories)
    land = grad_lander(schedule, op, memory)
    pair = model.layer_aux and schedule.units[u].role is Role.STACK  # frames: (g, g_aux)

    def backward(s: StepState) -> Frame | None:
        engine, residuals = s.activation.pop(u)
        g, record = s.grad_h, s.grad.pop(u, None)
        cotangents = (g,) if record is None else (g, *map(record.get, range(1, max(record) + 1)))
        params, (s.grad_h, g_extras) = engine.backward(memory, residuals, cotangents)
        s.outputs.pop(u, None)  # a pre or between unit's extras: nothing else reads them
        if g_extras:
            sums = s.grad.setdefault(producer, {})
            for j, ge in zip(s.outputs[producer].positions, g_extras):
                if ge is not None:
                    sums[j + 1] = ge if j + 1 not in sums else sums[j + 1] + ge
        grad, read_grads = land(s, params)
        return frame_of(s, op, index, (g, record and record.get(1)) if pair else g, s.grad_h,
                        grad, read_grads)

    return backward


# The steps that move memory, and the update.


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
    """The unit's gathered parameters released (``UnitMemory.free``)."""
    u, memory = op.unit, memories[op.unit]

    def free(s: StepState) -> None:
        if s.params.pop(u, None) is not None:
            memory.free()

    return free


def reduce_op(model: ShardedModel, schedule: Schedule, op: Op, index: int,
              memories: tuple[UnitMemory, ...]) -> Step:
    """This rank's shard of the unit's flat gradient (plus what earlier micro-batches carried)
    into where the step's result holds it, or a buffer of its own with update ops
    (``result_lander``)."""
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
    """The unit's reduce waited (its chunk copied into the shard where the reduce is an
    all-reduce, or in another dtype), a stack unit's gradient memory released, and with hybrid
    sharding the shard's sum across replicas issued (waited here before an update)."""
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
        if replicate and s.call.reduce_replicas:
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
              memories: tuple[UnitMemory, ...]) -> Step:
    """The unit's parameter shard (its layers of its part's) stepped with its reduced gradient
    shard by the call's optimizer (``Call.update``, ``fz3.train_step``); the shard's buffer goes
    with its record (a frame may still hold it)."""
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


# Each op kind's step maker: the one table a new op kind adds to (``lower`` reads it).
STEPS: dict[OpKind, Callable[[ShardedModel, Schedule, Op, int, Any], Step]] = {
    OpKind.GATHER: gather_op, OpKind.WAIT: wait_op, OpKind.FORWARD: _forward,
    OpKind.LOSS: _loss, OpKind.BACKWARD: _backward, OpKind.FREE: free_op,
    OpKind.REDUCE: reduce_op, OpKind.WAIT_REDUCE: wait_reduce_op,
    OpKind.ACCUMULATE: accumulate_op, OpKind.UPDATE: update_op,
}


def _finish(s: StepState) -> Result:
    model, comm = s.call.model, s.call.model.comm
    loss = wait(s.loss_mean)
    s.loss_mean = None
    if comm.replicas > 1:
        loss = wait(all_reduce(comm, loss, group=comm.replicate_group, label="the loss's mean"))
    while s.replicating:
        wait(s.replicating.pop())
    if s.call.schedule.grad:
        # as after plain autograd: forward drew, backward none
        rng.restore(s.rng_after, model.device)
    if not s.results:  # forward-only, or a deferred micro-batch
        return Result(loss, None, s.aux)
    return Result(loss, Params(joined(s, len(model.parts))), s.aux)


def _ranks(model: ShardedModel) -> int:
    """Ranks the loss is averaged over (every replica's too, with hybrid sharding)."""
    return model.world_size * model.comm.replicas
