"""The layer-scan executor: one training step, top to bottom, as an interpreter of a Schedule.

``execute`` runs the schedule's ops in order, one short handler per op kind, all sharing a
``StepState``; it yields a ``Frame`` after every compute op (unless told no one reads them)
and returns the ``Result``.
``fz3.value_and_grad`` drains it, ``fz3.step_through`` hands the frames to the user. Closing
it early drains every collective still in flight, so no rank is left inside one. The
compute handlers follow, in the order a step meets them (a layer unit's compute goes through
the layer protocol, ``fz3.step.engine``); those that move memory are ``movement.py``'s;
what they call a unit's function with, and where its results go, is ``unit_io.py``'s. The
buffer lifetimes are noted below.

[Note: a new op kind]
It touches: ``fz3/schedule/ops.py`` (the ``OpKind`` enum and the state transition table),
one handler (here, or in ``movement.py`` if it moves memory) and its entry in ``HANDLERS``,
the record it keeps in ``state.py`` if any, and ``fz3/schedule/footprint.py`` if it holds
memory (the memory plan and the cost model read that one fold).

[Note: buffer lifetimes, per unit]
- gather: a ``(world*k*n,)`` buffer in the compute dtype, alive until ``free``; a unit of k>1
  layers is copied once into ``(k, full)`` layer order (rank-major gather order otherwise).
  At world size 1 it is the shard itself (or its cast to the compute dtype): nothing is
  copied, and ``free`` never releases the parameters' own storage (``Pieces.owned``, from the
  collective's result: ``Pending.is_input``).
- forward: keeps the unit's input (``forward``: recompute in backward, with the RNG state
  it started from) or its autograd graph (``forward_save``); traced layers
  (``fz3.step.traced``) keep their programs' residuals instead of a graph, as a rule none
  of them a view of the gathered buffer (their backward re-reads the re-gathered one; one
  that does is held like a graph). A unit freed while its graph is alive keeps its buffer
  object with zero-sized storage (``Released``) and is re-gathered
  into that same storage before its backward, as FSDP2 does with ``untyped_storage().resize_()``:
  the graph's saved views then see the re-gathered values.
- backward (and loss, for the post unit): one flat gradient ``(world, k, n)`` in rank-major
  order (one layer's kept ``(world*n,)``, the same memory), alive until its reduce is
  waited. A unit of tied parameters (a shared part) gets its flat gradient from its first
  reader's loss or backward; later readers add into it; it is reduced after the last one.
- reduce: writes this rank's fp32 shard straight into the step's result: the part's whole
  gradient shard is allocated at the first reduce of any of its units (as activations are
  freed, like autograd's own ``.grad``), and nothing is copied at the end of the step. A
  part in ``Schedule.join_grads`` has each unit's rows reduced into a buffer of its own
  instead, joined into its shard (one copy) once every reduce is waited.
- loss: the mean over ranks is all-reduced as soon as it exists and waited at the end.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import torch

from .. import rng
from ..comm.arrival import CollectiveMismatchError
from ..comm.collectives import all_reduce, wait
from ..schedule.ops import Op, OpKind
from ..schedule.structure import Role
from ..schedule.schedule import Schedule
from ..sharding import compute
from ..sharding.model import Params, ShardedModel
from . import shapes
from .engine import Produced
from .state import Frame, Kept, Loss, Recompute, Result, StepState
from .movement import (accumulate_op, free_op, gather_op, reduce_op, wait_op,
                       wait_reduce_op)
from .unit_io import (add_gradients, aux_cotangents, aux_units, detached, frame_of, joined,
                      layer_engine, or_zeros, stacked_aux, stage_engine, stage_pieces)


def execute(model: ShardedModel, schedule: Schedule, params: Params, batch: Any, recorder=None,
            *, loss: Loss | None = None, loss_scale: float | torch.Tensor = 1.0,
            carry: dict[int, torch.Tensor] | None = None, reduce_replicas: bool = True,
            traced=None, frames: bool = True) -> Generator[Frame, None, Result]:
    """Run ``schedule`` on ``batch``. ``loss``: the function the ``loss`` op runs (default:
    the model's ``post``). ``loss_scale`` multiplies the backward's seed (fp16 loss scaling;
    1/k for k accumulated micro-batches). ``carry``: unsharded flat gradients accumulated by
    ``accumulate`` ops, added in at the next ``reduce`` of each unit. ``reduce_replicas``
    (hybrid sharding): sum the gradient shards across replicas (False: the caller does it
    once for several micro-batches). ``recorder``: a ``fz3.Recorder``, or None (no cost).
    ``traced``: a ``fz3.step.traced.TracedLayers`` whose programs run the layers (without the
    autograd engine), or None (autograd: ``fz3.step.engine``). ``frames=False``: no ``Frame``
    is made or yielded (a caller that only drains the step)."""
    state = StepState(model, schedule, params, batch, loss or Loss(model.post), loss_scale,
                      carry, reduce_replicas, traced=traced, frames=frames)
    # what the layers' traces and compilations were before: a step that made more is marked
    made = None
    if recorder is not None:
        recorder.begin_step(schedule, model.device)
        made = None if traced is None else traced.made
    # With a profiler running (torch.profiler), each op is a named range in its trace; without
    # one this costs a check per step, nothing per op.
    profiling = torch.autograd._profiler_enabled()
    try:
        with compute.mode(model):
            for index, op in enumerate(schedule.ops):
                start = recorder.start() if recorder is not None else None
                if profiling:
                    with torch.profiler.record_function(f"fz3 {schedule.describe(op)}"):
                        frame = HANDLERS[op.kind](state, op, index)
                else:
                    frame = HANDLERS[op.kind](state, op, index)
                if recorder is not None:
                    recorder.record(index, start, state.live_units(), state.moved_bytes(op),
                                    state.owned_bytes())
                if frame is not None:
                    yield frame
                    # the frame holds the unit's buffer: not past the next op (a free)
                    frame = None
            if made is not None and traced.made != made:
                recorder.mark_tracing()
            return _finish(state)
    except CollectiveMismatchError:  # ranks are absent: waiting for the rest would hang
        state.abandon(state.model.comm.abandoned)
        raise
    finally:
        state.drain(wait)


# The compute handlers, in the order a step meets them: (state, op, index) -> Frame | None;
# those that move memory are fz3.step.movement's.


def _forward(s: StepState, op: Op, index: int) -> Frame:
    role = s.schedule.units[op.unit].role
    return _forward_layers(s, op, index) if role is Role.STACK else _forward_stage(s, op, index)


def _forward_stage(s: StepState, op: Op, index: int) -> Frame:
    """pre, or a between function, through ``Stage`` (``fz3.step.engine``): its graph kept
    whenever gradients are wanted."""
    u = op.unit
    engine, memory = stage_engine(s, u), stage_pieces(s, u)
    x = None if s.schedule.units[u].role is Role.PRE else s.h
    if s.schedule.grad:
        (h, extras), graph = engine.forward(memory, x, s.batch)
        s.saved[u] = Kept(x=graph.x, engine=engine, residuals=graph)
        x = graph.x
    else:
        h, extras = engine.inference(memory, x, s.batch)
    positions = compute.differentiable(extras)
    s.h = h.detach()
    produced = s.produced[u] = Produced(compute.detach_extras(extras, positions, grad=False),
                                        positions)
    return frame_of(s, op, index, s.batch if x is None else x, (s.h, *produced.extras), None)


def _forward_layers(s: StepState, op: Op, index: int) -> Frame:
    """A layer unit through the layer protocol (``fz3.step.engine``): ``forward_save`` keeps
    its residuals, ``forward_selective`` its traced programs' heavy ops' outputs (a unit that
    is not traced runs as ``forward``); ``forward`` keeps its input and RNG state, to run
    ``forward`` again in backward (recompute). Its layers' aux outputs (``layer_aux``) wait
    for the loss."""
    u, x = op.unit, s.h
    extras = s.produced[s.schedule.producers[u]]
    selective = op.kind == OpKind.FORWARD_SELECTIVE
    engine = layer_engine(s, u, x, extras, s.schedule.keep if selective else None)
    if op.kind == OpKind.FORWARD_SAVE or selective and engine.keep is not None:
        s.h, aux, residuals = engine.forward(s.gathered[u], x, extras)
        s.saved[u] = Kept(x=x, engine=engine, residuals=residuals)
    else:
        before = rng.capture(s.model.device) if s.schedule.grad else None
        s.h, aux = engine.inference(s.gathered[u], x, extras)
        if s.schedule.grad:
            s.saved[u] = Recompute(x=x, engine=engine, rng=before)
    if aux is None:
        return frame_of(s, op, index, x, s.h, None)
    s.layer_aux[u] = aux
    return frame_of(s, op, index, x, (s.h, aux), None)


def _loss(s: StepState, op: Op, index: int) -> Frame:
    """post, or the given loss function, through ``Stage``: with gradients its backward runs
    at once, seeded 1/ranks (the reduces are sums over ranks, the loss a mean). The layers'
    aux outputs (``layer_aux``) are its fourth argument, one tensor per stack; their
    gradients go to the layers' backwards."""
    u = op.unit
    engine, memory = stage_engine(s, u), stage_pieces(s, u)
    grad, h_in = None, s.h
    stacks = aux_units(s) if s.model.layer_aux else None
    layer_aux = None if stacks is None else stacked_aux(s, stacks)
    if s.schedule.grad:
        (loss, aux), graph = engine.forward(memory, s.h, s.batch, layer_aux)
        s.h = None  # the last layer's output: no op after the loss reads it (its frame's only)
        seed = torch.full_like(loss, 1.0 / _ranks(s)) * s.loss_scale
        g_trained, g_h, g_aux = engine.backward(memory, graph, seed, None)
        s.grad_h = or_zeros(g_h, graph.x)
        if stacks is not None:
            aux_cotangents(s, stacks, g_aux)
        grad = add_gradients(s, u, g_trained, graph.leaves)
        s.rng_after = rng.capture(s.model.device)
    else:
        loss, aux = engine.inference(memory, s.h, s.batch, layer_aux)
    s.loss, s.aux = loss.detach(), detached(aux)
    s.loss_mean = all_reduce(s.model.comm, s.loss.float() / _ranks(s), group=s.model.comm.group,
                             label="the loss's mean")
    return frame_of(s, op, index, h_in if layer_aux is None else (h_in, layer_aux), loss, grad)


def _backward(s: StepState, op: Op, index: int) -> Frame:
    role = s.schedule.units[op.unit].role
    return _backward_layers(s, op, index) if role is Role.STACK else _backward_stage(s, op, index)


def _backward_layers(s: StepState, op: Op, index: int) -> Frame:
    u, model = op.unit, s.model
    saved = s.saved.pop(u)
    engine, memory = saved.engine, s.gathered[u]
    extras = s.produced[s.schedule.producers[u]]
    if isinstance(saved, Kept):
        residuals = saved.residuals
    else:  # recompute, replaying the forward's RNG
        # Nothing after the loss draws but recompute, which sets its own state; _finish
        # leaves the RNG as plain autograd would (rng_after), so none is kept here.
        rng.restore(saved.rng, model.device)
        # (not ``_, residuals = ...``: a name would hold the recomputed output meanwhile)
        residuals = engine.forward(memory, saved.x, extras)[2]
    g_aux = s.grad_aux.pop(u, None) if s.grad_aux else None
    g_buffer, g_x, g_extras = engine.backward(memory, residuals, s.grad_h, g_aux, extras)
    del residuals
    grad_out, s.grad_h = s.grad_h, or_zeros(g_x, saved.x)
    for j, ge in zip(extras.positions, g_extras):
        if ge is not None:
            extras.grads[j] = ge if j not in extras.grads else extras.grads[j] + ge
    g_buffer = or_zeros(g_buffer, memory.buffer)
    flat = shapes.flat_grad(s.schedule.units[u], g_buffer, model.world_size,
                            by_layer=s.schedule.reduce == "all_reduce")
    reduce = model.precision.reduce
    s.unreduced[u] = flat if flat.dtype == reduce else flat.to(reduce)
    if s.model.layer_aux:
        grad_out = (grad_out, g_aux)
    return frame_of(s, op, index, grad_out, s.grad_h, s.unreduced[u])


def _backward_stage(s: StepState, op: Op, index: int) -> Frame:
    u = op.unit
    saved = s.saved.pop(u)
    # its extras' summed cotangents go with their record: nothing after it reads them
    g_trained, g_x, _ = saved.engine.backward(stage_pieces(s, u), saved.residuals, s.grad_h,
                                              s.produced.pop(u))
    grad_out = s.grad_h
    between = s.schedule.units[u].role is Role.BETWEEN
    if between:
        s.grad_h = or_zeros(g_x, saved.x)
    flat = add_gradients(s, u, g_trained, saved.residuals.leaves)
    return frame_of(s, op, index, grad_out, s.grad_h if between else None, flat)


HANDLERS: dict[OpKind, Callable[[StepState, Op, int], Frame | None]] = {
    OpKind.GATHER: gather_op, OpKind.WAIT: wait_op, OpKind.FORWARD: _forward,
    OpKind.FORWARD_SAVE: _forward, OpKind.FORWARD_SELECTIVE: _forward,
    OpKind.LOSS: _loss, OpKind.BACKWARD: _backward, OpKind.FREE: free_op,
    OpKind.REDUCE: reduce_op, OpKind.WAIT_REDUCE: wait_reduce_op,
    OpKind.ACCUMULATE: accumulate_op,
}


def _finish(s: StepState) -> Result:
    comm = s.model.comm
    loss = wait(s.loss_mean)
    s.loss_mean = None
    if comm.replicas > 1:
        loss = wait(all_reduce(comm, loss, group=comm.replicate_group, label="the loss's mean"))
    while s.replicating:
        wait(s.replicating.pop())
    if s.joining:
        joined(s)
    if s.schedule.grad:
        # as after plain autograd: forward drew, backward none
        rng.restore(s.rng_after, s.model.device)
    if not s.grads:  # forward-only, or a deferred micro-batch
        return Result(loss, None, s.aux)
    return Result(loss, Params(tuple(s.grads[p] for p in range(len(s.model.parts)))), s.aux)


def _ranks(s: StepState) -> int:
    """Ranks the loss is averaged over (every replica's too, with hybrid sharding)."""
    return s.model.world_size * s.model.comm.replicas
