"""The layer-scan executor: one training step, top to bottom, as a schedule lowered once.

``lower`` makes one step per op of a validated schedule, with what does not change between
steps decided once (the unit, its shapes, dtypes, engine and collectives); ``execute`` runs
them in order, all sharing a ``StepState``; it yields a ``Frame`` after every compute op
(unless told no one reads them) and returns the ``Result``.
``fz3.value_and_grad`` drains it, ``fz3.step_through`` hands the frames to the user. Closing
it early drains every collective still in flight, so no rank is left inside one. The
compute steps follow: every unit runs through one protocol (``fz3.step.engine``), what its
engine is given and where its results go decided at lowering (``unit_io.py``); the steps
that move memory are ``movement.py``'s; each unit's memory, and its lifetime, ``memory.py``'s.

[Note: a new op kind]
It touches: ``fz3/schedule/ops.py`` (the ``OpKind`` enum and the state transition table),
one step maker (here, or in ``movement.py`` if it moves memory) and its entry in ``STEPS``,
the record it keeps in ``state.py`` if any, and ``fz3/schedule/footprint.py`` if it holds
memory (the memory plan and the cost model read that one fold).
"""

from __future__ import annotations

from typing import Any, Callable, Generator, NamedTuple

import torch

from .. import rng
from ..comm.failures import CollectiveMismatchError
from ..comm.collectives import all_reduce, wait
from ..schedule.ops import Op, OpKind
from ..schedule.structure import Role
from ..schedule.schedule import Schedule
from ..sharding import compute
from ..sharding.model import Params, ShardedModel
from .memory import UnitMemory, memories
from .record import observed
from .state import Call, Frame, Loss, Result, Step, StepState
from .movement import (accumulate_op, free_op, gather_op, reduce_op, update_op, wait_op,
                       wait_reduce_op)
from .unit_io import (add_gradients, apart, aux_cotangents, aux_units, detached, frame_of,
                      grad_lander, joined, output_lander, stacked_aux, unit_engine)


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
    memory = memories(model, schedule.units, all_reduce=schedule.reduce == "all_reduce",
                      handed_out=handed_out)
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
    memory, _ = unit_engine(model, schedule, op, memories)
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
