"""The layer-scan executor: one training step, top to bottom, as an interpreter of a Schedule.

``execute`` runs the schedule's ops in order, one short handler per op kind, all sharing a
``StepState``; it yields a ``Frame`` after every compute op and returns the ``Result``.
``fz3.value_and_grad`` drains it, ``fz3.step_through`` hands the frames to the user. Closing
it early drains every collective still in flight, so no rank is left inside one. The
handlers follow, in the order a step meets them; the buffer lifetimes are noted below.

[Note: buffer lifetimes, per unit]
- gather: a ``(world*n,)`` buffer in the compute dtype, alive until ``free``; a unit of k>1
  layers is copied once into ``(k, full)`` layer order (rank-major gather order otherwise).
- forward: keeps the unit's input (``forward``: recompute in backward, with the RNG state
  it started from) or its autograd graph (``forward_save``). A unit freed while its graph
  is alive keeps its buffer object with zero-sized storage (``Released``) and is re-gathered
  into that same storage before its backward, as FSDP2 does with ``untyped_storage().resize_()``:
  the graph's saved views then see the re-gathered values.
- backward: one flat gradient ``(world, k, n)`` in rank-major order, alive until its reduce
  is waited; the fp32 gradient shard it reduces into is allocated at the reduce (as
  activations are freed, like autograd's own ``.grad``).
- loss: the mean over ranks is all-reduced as soon as it exists and waited at the end.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import optree
import torch

from .. import rng
from ..comm.collectives import all_gather, all_reduce, reduce_scatter, wait
from ..schedule.ops import OUTER, Op, OpKind
from ..schedule.schedule import Schedule
from ..sharding import compute
from ..sharding.model import Params, ShardedModel
from .state import Frame, Loss, Reducing, Result, Saved, StepState, nbytes, pending_bytes, regrow, release


def execute(model: ShardedModel, schedule: Schedule, params: Params, batch: Any, recorder=None, *,
            loss: Loss | None = None, loss_scale: float | torch.Tensor = 1.0,
            carry: dict[int, torch.Tensor] | None = None,
            reduce_replicas: bool = True) -> Generator[Frame, None, Result]:
    """Run ``schedule`` on ``batch``. ``loss``: the function the ``loss`` op runs (default:
    the model's ``post``). ``loss_scale`` multiplies the backward's seed (fp16 loss scaling;
    1/k for k accumulated micro-batches). ``carry``: unsharded flat gradients accumulated by
    ``accumulate`` ops, added in at the next ``reduce`` of each unit. ``reduce_replicas``
    (hybrid sharding): sum the gradient shards across replicas (False: the caller does it
    once for several micro-batches). ``recorder``: a ``fz3.Recorder``, or None (no cost)."""
    state = StepState(model, schedule, params, batch, loss or Loss(model.post), loss_scale, carry,
                      reduce_replicas)
    if recorder is not None:
        recorder.begin_step(schedule, model.device)
    try:
        with compute.mode(model):
            for index, op in enumerate(schedule.ops):
                start = recorder.start() if recorder is not None else None
                frame = HANDLERS[op.kind](state, op, index)
                if recorder is not None:
                    recorder.record(index, start, state.live_units(), _moved(state, op), state.owned_bytes())
                if frame is not None:
                    yield frame
            return _finish(state)
    finally:
        state.drain(wait)


# The handlers, in the order a step meets them: (state, op, index) -> Frame | None.


def _gather(s: StepState, op: Op, index: int) -> None:
    u, m = op.unit, s.model
    rows = None if u == OUTER else s.schedule.layer_range(u)
    # Cast before the gather: bf16 moves half the bytes (no-op in fp32).
    shard = (s.params.outer if rows is None else s.params.layers[rows.start:rows.stop]).to(m.precision.compute)
    direct = rows is None or len(rows) == 1  # the gather buffer is the parameter buffer
    if direct and u in s.released:  # back into the storage the live graph saved views of
        out = regrow(s.released[u].buffer).view(-1)
    else:
        out = torch.empty(m.world_size * shard.numel(), dtype=m.precision.compute, device=m.device)
    s.gathering[u] = all_gather(m.comm, out, shard.reshape(-1), op)


def _wait(s: StepState, op: Op, index: int) -> None:
    u, world = op.unit, s.model.world_size
    out = wait(s.gathering.pop(u))
    rows = None if u == OUTER else s.schedule.layer_range(u)
    if rows is None:
        buf = out
    elif len(rows) == 1:
        buf = out.view(1, -1)
    elif u in s.released:  # rank-major (world, k, n) -> layer-major (k, world*n), in place
        buf = regrow(s.released[u].buffer)
        buf.copy_(out.view(world, len(rows), -1).transpose(0, 1).reshape(buf.shape))
    else:
        buf = out.view(world, len(rows), -1).transpose(0, 1).reshape(len(rows), -1)
    if u in s.released:
        # The graph's saved views now hold the same values again; collectives and the copy
        # bumped the version counter (gloo: when the work completes), which autograd would
        # take for an in-place change. Restore it.
        with s.released.pop(u).version:
            pass
    s.gathered[u] = buf


def _forward(s: StepState, op: Op, index: int) -> Frame:
    return _forward_outer(s, op, index) if op.unit == OUTER else _forward_layers(s, op, index)


def _forward_outer(s: StepState, op: Op, index: int) -> Frame:
    # pre's graph is kept whenever gradients are wanted: it decides which extras (rotary
    # tables, masks, ...) carry gradient, and costs one activation.
    grad = s.schedule.grad
    views = s.model.outer.views(s.gathered[OUTER])
    params = compute.leaves(views) if grad else views
    with torch.set_grad_enabled(grad):
        h, extras = compute.run_pre(s.model, params, s.batch)
    s.grad_positions = compute.differentiable(extras)
    if grad:
        s.saved[OUTER] = Saved(True, s.batch, (h, extras), params, (), None)
    s.h = h.detach()
    s.extras = tuple(e.detach() if j in s.grad_positions else e for j, e in enumerate(extras))
    return Frame(index, op, s.gathered[OUTER], s.batch, (s.h, *s.extras), None)


def _forward_layers(s: StepState, op: Op, index: int) -> Frame:
    u, x = op.unit, s.h
    first = s.schedule.layer_range(u).start
    views = compute.layer_views(s.model.layer, s.gathered[u])
    if op.kind == OpKind.FORWARD_SAVE:
        params, x_leaf, extras = compute.layer_leaves(views, x, s.extras, s.grad_positions)
        with torch.enable_grad():
            out = compute.run_layers(s.model, first, params, x_leaf, extras)
        s.saved[u] = Saved(True, x_leaf, out, params, extras, None)
        s.h = out.detach()
    else:
        before = rng.capture(s.model.device) if s.schedule.grad else None
        with torch.no_grad():
            s.h = compute.run_layers(s.model, first, views, x, s.extras)
        if s.schedule.grad:
            s.saved[u] = Saved(False, x, None, [], (), before)
    return Frame(index, op, s.gathered[u], x, s.h, None)


def _loss(s: StepState, op: Op, index: int) -> Frame:
    views = s.model.outer.views(s.gathered[OUTER])
    fn, has_aux = s.loss_fn
    if s.schedule.grad:
        params, h = compute.leaves(views), s.h.detach().requires_grad_()
        with torch.enable_grad():
            loss, aux = compute.run_loss(s.model, fn, has_aux, params, h, s.batch)
        # Seed 1/ranks: the reduces are sums over ranks, the loss a mean.
        seed = torch.full_like(loss, 1.0 / _ranks(s)) * s.loss_scale
        g = torch.autograd.grad(loss, [h, *params], seed, allow_unused=True)
        s.grad_h, s.head_grads = _or_zeros(g[0], h), g[1:]
        s.rng_after = rng.capture(s.model.device)
    else:
        with torch.no_grad():
            loss, aux = compute.run_loss(s.model, fn, has_aux, views, s.h, s.batch)
    s.loss, s.aux = loss.detach(), _detached(aux)
    s.loss_mean = all_reduce(s.model.comm, s.loss.float() / _ranks(s), group=s.model.comm.group,
                             label="the loss's mean")
    return Frame(index, op, s.gathered[OUTER], s.h, loss, None)


def _backward(s: StepState, op: Op, index: int) -> Frame:
    return _backward_outer(s, op, index) if op.unit == OUTER else _backward_layers(s, op, index)


def _backward_layers(s: StepState, op: Op, index: int) -> Frame:
    u, model = op.unit, s.model
    saved = s.saved.pop(u)
    first = s.schedule.layer_range(u).start
    if saved.graph:
        out, params, x_leaf, extras = saved.out, saved.leaves, saved.x, saved.extras
    else:  # recompute from the saved input, replaying the forward's RNG
        params, x_leaf, extras = compute.layer_leaves(compute.layer_views(model.layer, s.gathered[u]), saved.x, s.extras,
                                                       s.grad_positions)
        now = rng.swap(saved.rng, model.device)
        with torch.enable_grad():
            out = compute.run_layers(model, first, params, x_leaf, extras)
        rng.restore(now, model.device)
    flat_params = [p for layer in params for p in layer]
    wrt = [*flat_params, x_leaf, *(extras[j] for j in s.grad_positions)]
    g = torch.autograd.grad(out, wrt, s.grad_h, allow_unused=True)
    n = len(flat_params)
    grad_out, s.grad_h = s.grad_h, _or_zeros(g[n], x_leaf)
    for j, ge in zip(s.grad_positions, g[n + 1:]):
        if ge is not None:
            s.grad_extras[j] = ge if j not in s.grad_extras else s.grad_extras[j] + ge
    s.unreduced[u] = compute.layer_flat_grad(model.layer, model.world_size, g[:n], len(params), out,
                                             by_layer=s.schedule.reduce == "all_reduce").to(model.precision.reduce)
    return Frame(index, op, s.gathered[u], grad_out, s.grad_h, s.unreduced[u])


def _backward_outer(s: StepState, op: Op, index: int) -> Frame:
    saved = s.saved.pop(OUTER)
    (h, extras), params = saved.out, saved.leaves
    outputs = [(h, s.grad_h)] + [(extras[j], s.grad_extras.get(j)) for j in s.grad_positions]
    outputs = [(t, g) for t, g in outputs if t.requires_grad and g is not None]
    grads = torch.autograd.grad([t for t, _ in outputs], params, [g for _, g in outputs],
                                allow_unused=True) if outputs else [None] * len(params)
    total = [a if b is None else b if a is None else a + b for a, b in zip(grads, s.head_grads)]
    s.unreduced[OUTER] = compute.flat_grads(s.model.outer, [total], h)[0].to(s.model.precision.reduce)
    return Frame(index, op, s.gathered[OUTER], s.grad_h, None, s.unreduced[OUTER])


def _free(s: StepState, op: Op, index: int) -> None:
    u = op.unit
    buf = s.gathered.pop(u)
    saved = s.saved.get(u)
    if saved is not None and saved.graph:  # a live graph holds views of buf: free the storage only
        s.released[u] = release(buf)


def _reduce(s: StepState, op: Op, index: int) -> None:
    u, m = op.unit, s.model
    g = s.unreduced.pop(u)
    if s.carry and u in s.carry:  # gradients deferred from earlier micro-batches
        g = s.carry.pop(u).add_(g)
    rows = None if u == OUTER else s.schedule.layer_range(u)
    n = s.schedule.unit_elements(u, m.outer.shard_numel, m.layer.shard_numel)
    shard = s.shards[u] = torch.empty(n, dtype=torch.float32, device=m.device)  # fully written by the reduce
    if s.schedule.reduce == "all_reduce":  # in place, on the layer-major memory of g
        g = g if rows is None else g.transpose(0, 1).contiguous()  # (k, world, n): no copy
        s.reducing[u] = Reducing(all_reduce(m.comm, g, label=op), shard)
    else:
        rdt = m.precision.reduce
        out = shard if rdt == torch.float32 else torch.empty(n, dtype=rdt, device=m.device)
        s.reducing[u] = Reducing(reduce_scatter(m.comm, out, g.contiguous().view(-1), op), shard)


def _wait_reduce(s: StepState, op: Op, index: int) -> None:
    u, comm = op.unit, s.model.comm
    pending, shard = s.reducing.pop(u)
    out = wait(pending)
    if s.schedule.reduce == "all_reduce":  # this rank's chunk of each layer
        mine = out.view(comm.world_size, -1)[comm.rank] if u == OUTER else out[:, comm.rank]
        shard.view(mine.shape).copy_(mine)
    elif out.data_ptr() != shard.data_ptr():
        shard.copy_(out)
    if comm.replicas > 1 and s.reduces_replicas:  # hybrid: sum the shard across replicas, waited at the end
        s.replicating.append(all_reduce(comm, shard, group=comm.replicate_group, label=op))


def _accumulate(s: StepState, op: Op, index: int) -> None:
    g = s.unreduced.pop(op.unit)
    s.carry[op.unit] = g if op.unit not in s.carry else s.carry[op.unit].add_(g)


HANDLERS: dict[OpKind, Callable[[StepState, Op, int], Frame | None]] = {
    OpKind.GATHER: _gather, OpKind.WAIT: _wait, OpKind.FORWARD: _forward, OpKind.FORWARD_SAVE: _forward,
    OpKind.LOSS: _loss, OpKind.BACKWARD: _backward, OpKind.FREE: _free, OpKind.REDUCE: _reduce,
    OpKind.WAIT_REDUCE: _wait_reduce, OpKind.ACCUMULATE: _accumulate,
}


def _finish(s: StepState) -> Result:
    comm = s.model.comm
    loss = wait(s.loss_mean)
    s.loss_mean = None
    if comm.replicas > 1:
        loss = wait(all_reduce(comm, loss, group=comm.replicate_group, label="the loss's mean"))
    while s.replicating:
        wait(s.replicating.pop())
    if s.schedule.grad:
        rng.restore(s.rng_after, s.model.device)  # as after plain autograd: forward drew, backward none
    if not s.shards:  # forward-only, or a deferred micro-batch
        return Result(loss, None, s.aux)
    layer_shards = [s.shards[u].view(len(s.schedule.layer_range(u)), -1) for u in range(s.schedule.num_units)]
    layers = layer_shards[0] if len(layer_shards) == 1 else torch.cat(layer_shards) if layer_shards else \
        torch.empty(0, s.model.layer.shard_numel, device=s.model.device)
    return Result(loss, Params(s.shards[OUTER], layers), s.aux)


# Helpers of the handlers.


def _ranks(s: StepState) -> int:
    """Ranks the loss is averaged over (every replica's too, with hybrid sharding)."""
    return s.model.world_size * s.model.comm.replicas


def _moved(s: StepState, op: Op) -> int:
    """Bytes a collective op moves (the full, unsharded buffer); 0 for other ops."""
    if op.kind == OpKind.GATHER:
        return nbytes(s.gathering[op.unit].out)
    if op.kind == OpKind.REDUCE:
        return pending_bytes(s.reducing[op.unit].pending)
    return 0


def _detached(aux: Any) -> Any:
    return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux, none_is_leaf=True)


def _or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g
