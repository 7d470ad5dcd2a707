"""The layer-scan executor: one training step, top to bottom, as a schedule lowered once.

``lower`` makes one step per op of a validated schedule, with what does not change between
steps decided once (the unit, its shapes, dtypes, engine and collectives); ``execute`` runs
them in order, all sharing a ``StepState``; it yields a ``Frame`` after every compute op
(unless told no one reads them) and returns the ``Result``.
``fz3.value_and_grad`` drains it, ``fz3.step_through`` hands the frames to the user. Closing
it early drains every collective still in flight, so no rank is left inside one. The
compute steps follow, in the order a step meets them (a layer unit's compute goes through
the layer protocol, ``fz3.step.engine``); those that move memory are ``movement.py``'s;
what they call a unit's function with, and where its results go, is ``unit_io.py``'s; each
unit's memory, and its lifetime, is ``memory.py``'s.

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
from .engine import Produced
from .memory import UnitMemory, memories
from .record import observed
from .state import Call, Frame, Kept, Loss, Result, Step, StepState
from .movement import (accumulate_op, free_op, gather_op, reduce_op, update_op, wait_op,
                       wait_reduce_op)
from .unit_io import (add_gradients, apart, aux_cotangents, aux_units, detached, frame_of,
                      joined, layer_engine, or_zeros, stacked_aux, stage_engine, stage_pieces)


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
    return Program(schedule, tuple(STEPS[op.kind](model, schedule, op, index, memory[op.unit])
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


# The compute steps, in the order a step meets them: (model, schedule, op, index, memory) ->
# step; those that move memory are fz3.step.movement's.


def _forward_stage(model: ShardedModel, schedule: Schedule, op: Op, index: int,
                   memory: UnitMemory) -> Step:
    """pre, or a between function, through ``Stage`` (``fz3.step.engine``): its graph kept
    whenever gradients are wanted."""
    u, grad, reads = op.unit, schedule.grad, (op.unit, *schedule.units[op.unit].reads)
    engine, pre = stage_engine(model, schedule.units[u]), schedule.units[u].role is Role.PRE

    def forward_stage(s: StepState) -> Frame:
        call = s.call
        stage, pieces = engine(call.loss_fn), stage_pieces(s, u)
        x = None if pre else s.h
        if grad:
            (h, extras), graph = stage.forward(pieces, x, call.batch)
            s.activation[u] = Kept(x=graph.x, engine=stage, residuals=graph)
            x = graph.x
        else:
            h, extras = stage.inference(pieces, x, call.batch)
        positions = compute.differentiable(extras)
        s.h, extras = apart((h.detach(), compute.detach_extras(extras, positions, grad=False)),
                            s, reads)
        traced = None if call.traced is None else call.traced.extras(extras, positions)
        s.extras[u] = Produced(extras, positions, traced)
        return frame_of(s, op, index, call.batch if x is None else x, (s.h, *extras), None)

    return forward_stage


def _forward_layers(model: ShardedModel, schedule: Schedule, op: Op, index: int,
                    memory: UnitMemory) -> Step:
    """A layer unit through the layer protocol (``fz3.step.engine``), keeping what the op's
    predicate saves (``Op.saves``, ``fz3.schedule.saveable``): the residuals of programs cut
    by it (``save``'s: autograd's); ``recompute`` keeps its input and RNG state, to run
    ``forward`` again in backward, and so does an engine not cut by the predicate (autograd
    given neither save nor recompute). Its layers' aux outputs (``layer_aux``) wait for the
    loss."""
    u, producer, grad, device = op.unit, schedule.producers[op.unit], schedule.grad, model.device
    saves = op.saves
    find = layer_engine(model, schedule.units[u], saves)

    def forward_layers(s: StepState) -> Frame | None:
        x, extras = s.h, s.extras[producer]
        engine = find(s.call.traced, x, extras)
        # its programs were cut by this predicate (``unit_io.layer_engine``): they keep what it
        # saves; else (recompute, or autograd given a predicate it cannot cut) recompute
        if engine.saves == saves:
            s.h, aux, residuals = engine.forward(s.params[u], x, extras)
            aux = aux if aux is None else apart(aux, s, (u,))
            s.activation[u] = Kept(x, engine, residuals, None, aux)
        else:
            before = rng.capture(device) if grad else None
            s.h, aux = engine.inference(s.params[u], x, extras)
            aux = aux if aux is None else apart(aux, s, (u,))
            if grad or aux is not None:  # forward-only: its aux outputs alone
                s.activation[u] = Kept(x if grad else None, engine, None, before, aux)
        return frame_of(s, op, index, x, s.h if aux is None else (s.h, aux), None)

    return forward_layers


def _loss(model: ShardedModel, schedule: Schedule, op: Op, index: int,
          memory: UnitMemory) -> Step:
    """post, or the given loss function, through ``Stage``: with gradients its backward runs
    at once, seeded 1/ranks (the reduces are sums over ranks, the loss a mean). The layers'
    aux outputs (``layer_aux``, one tensor per stack) are its fourth argument."""
    u, grad, ranks = op.unit, schedule.grad, _ranks(model)
    engine, comm = stage_engine(model, schedule.units[u]), model.comm
    reads = (u, *schedule.units[u].reads)
    stacks = aux_units(schedule) if model.layer_aux else None

    def loss_(s: StepState) -> Frame:
        call = s.call
        stage, pieces = engine(call.loss_fn), stage_pieces(s, u)
        g, read_grads, h_in = None, None, s.h
        layer_aux = None if stacks is None else stacked_aux(s, stacks)
        if grad:
            (loss, aux), graph = stage.forward(pieces, s.h, call.batch, layer_aux)
            s.h = None  # the last layer's output: no op after the loss reads it (its frame's)
            seed = torch.full_like(loss, 1.0 / ranks) * call.loss_scale
            g_trained, g_h, g_aux = stage.backward(pieces, graph, seed, None)
            s.grad_h = or_zeros(g_h, graph.x)
            if stacks is not None:
                aux_cotangents(s, stacks, g_aux)
            g, read_grads = add_gradients(s, u, g_trained, graph.leaves)
            s.rng_after = rng.capture(model.device)
        else:
            loss, aux = stage.inference(pieces, s.h, call.batch, layer_aux)
        s.loss, s.aux = loss.detach(), apart(detached(aux), s, reads)
        s.loss_mean = all_reduce(comm, s.loss.float() / ranks, group=comm.group,
                                 label="the loss's mean")
        return frame_of(s, op, index, h_in if layer_aux is None else (h_in, layer_aux), loss, g,
                        read_grads)

    return loss_


def _backward_layers(model: ShardedModel, schedule: Schedule, op: Op, index: int,
                     memory: UnitMemory) -> Step:
    u, producer, device, layer_aux = op.unit, schedule.producers[op.unit], model.device, \
        model.layer_aux

    def backward_layers(s: StepState) -> Frame | None:
        saved = s.activation.pop(u)
        engine, pieces, extras = saved.engine, s.params[u], s.extras[producer]
        g_aux = s.grad.pop(u, None)  # before its backward, only its aux cotangent, if any
        if g_aux is not None:
            g_aux = g_aux.g
        into = memory.grad_into()
        if saved.residuals is not None:
            g_buffer, g_x, g_extras = engine.backward(pieces, saved.residuals, s.grad_h, g_aux,
                                                      extras, into)
        else:  # recompute, replaying the forward's RNG
            # Nothing after the loss draws but recompute, which sets its own state; _finish
            # leaves the RNG as plain autograd would (rng_after), so none is kept here.
            rng.restore(saved.rng, device)
            g_buffer, g_x, g_extras = engine.recompute(pieces, saved.x, s.grad_h, g_aux, extras,
                                                       into)
        grad_out, s.grad_h = s.grad_h, or_zeros(g_x, saved.x)
        for j, ge in zip(extras.positions, g_extras):
            if ge is not None:  # summed in the producer's grad record until its backward
                sums = s.grad.setdefault(producer, {})
                sums[j] = ge if j not in sums else sums[j] + ge
        s.grad[u] = unreduced = memory.unreduced(g_buffer)
        return frame_of(s, op, index, (grad_out, g_aux) if layer_aux else grad_out, s.grad_h,
                        unreduced)

    return backward_layers


def _backward_stage(model: ShardedModel, schedule: Schedule, op: Op, index: int,
                    memory: UnitMemory) -> Step:
    u = op.unit
    between = schedule.units[u].role is Role.BETWEEN

    def backward_stage(s: StepState) -> Frame | None:
        saved = s.activation.pop(u)
        # its extras and their summed cotangents (its grad record) go: nothing else reads them
        g_trained, g_x, _ = saved.engine.backward(stage_pieces(s, u), saved.residuals,
                                                  s.grad_h, s.extras.pop(u),
                                                  s.grad.pop(u, None))
        grad_out = s.grad_h
        if between:
            s.grad_h = or_zeros(g_x, saved.x)
        flat, read_grads = add_gradients(s, u, g_trained, saved.residuals.leaves)
        return frame_of(s, op, index, grad_out, s.grad_h if between else None, flat, read_grads)

    return backward_stage


def _by_role(layers: Callable, stage: Callable) -> Callable:
    """A compute op's step maker: ``layers`` for a stack unit, ``stage`` for the others."""
    def make(model: ShardedModel, schedule: Schedule, op: Op, index: int,
             memory: UnitMemory) -> Step:
        stack = schedule.units[op.unit].role is Role.STACK
        return (layers if stack else stage)(model, schedule, op, index, memory)

    return make


_forward, _backward = (_by_role(_forward_layers, _forward_stage),
                       _by_role(_backward_layers, _backward_stage))
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
