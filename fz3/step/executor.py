"""The layer-scan executor: one training step, top to bottom, as an interpreter of a Schedule.

``execute`` is a generator: it runs the schedule's ops in order and yields a ``Frame``
after every compute op; its return value is the ``Result``. ``fz3.value_and_grad`` drains
it, ``fz3.step_through`` hands the frames to the user. Closing it early drains every
collective still in flight, so no rank is left inside one.

Per unit, the buffers and their lifetimes:
- gather: a ``(world*n,)`` buffer in the compute dtype, alive until ``free``; a unit of k>1
  layers is copied once into ``(k, full)`` layer order (rank-major gather order otherwise).
- forward: keeps the unit's input (``forward``: recompute in backward) or its autograd
  graph (``forward_save``). A unit freed while its graph is alive keeps its buffer object
  with zero-sized storage (``released``) and is re-gathered into that same storage before
  its backward, as FSDP2 does with ``untyped_storage().resize_()``: the graph's saved views
  then see the re-gathered values.
- backward: one flat gradient ``(world, k, n)`` in rank-major order, alive until its reduce
  is waited; the gradient shards land in the step's fp32 gradient pytree.
"""

from __future__ import annotations

from typing import Any, Generator, NamedTuple

import torch

from ..comm.collectives import Pending, all_gather, all_reduce, reduce_scatter, wait
from ..schedule.schedule import OUTER, Op, Schedule
from ..sharding import compute as units
from ..sharding.model import Params, ShardedModel
from .record import Recorder, nbytes, owned_bytes, pending_bytes


class Frame(NamedTuple):
    """Yielded after each compute op. References only: building it costs nothing."""

    index: int  # position of the op in the schedule
    op: Op
    params: torch.Tensor  # the unit's gathered parameters: (outer.padded,) or (k, layer.padded)
    inputs: Any  # forward: the unit's input (the batch for outer); backward: gradient w.r.t. its output
    outputs: Any  # forward: its output (h, or (h, *extra) for pre; the loss for `loss`); backward: grad w.r.t. its input
    grad: torch.Tensor | None  # backward: the unit's full flat gradient before reduction, (world, k, n) or (padded,)


class Result(NamedTuple):
    loss: torch.Tensor  # () fp32, mean over ranks
    grads: Params | None  # shards of the gradient of the mean loss (None for forward-only)


class _Saved(NamedTuple):
    graph: bool  # True: out/leaves hold the forward graph; False: recompute from x with rng
    x: Any  # the unit's input: h (its autograd leaf for a graph), or the batch for outer
    out: Any  # graph only: the unit's output
    leaves: list  # graph only: parameter leaves (per layer for layer units)
    extras: tuple  # the extras the unit was called with (leaves at differentiable positions, graph only)
    rng: torch.Tensor | None  # recompute only: RNG state before the forward (dropout masks repeat)


def execute(model: ShardedModel, schedule: Schedule, params: Params, batch: Any,
            recorder: Recorder | None = None, *, loss_scale: float | torch.Tensor = 1.0,
            carry: dict[int, torch.Tensor] | None = None) -> Generator[Frame, None, Result]:
    """Run ``schedule`` on ``batch``. ``loss_scale`` multiplies the backward's seed (fp16
    loss scaling; 1/k for k accumulated micro-batches). ``carry``: unsharded flat gradients
    accumulated by ``accumulate`` ops, added in at the next ``reduce`` of each unit."""
    comm, dev = model.comm, model.device
    world, rank = comm.world_size, comm.rank
    everyone = world * comm.replicas  # ranks the loss is averaged over
    cdt, rdt = model.precision.compute, model.precision.reduce
    grad = schedule.grad
    num_layers = schedule.num_layers

    gathering: dict[int, Pending] = {}
    gathered: dict[int, torch.Tensor] = {}
    released: dict[int, tuple[torch.Tensor, Any]] = {}  # unit -> (buffer with empty storage, its version)
    saved: dict[int, _Saved] = {}
    flat_grads: dict[int, torch.Tensor] = {}
    reducing: dict[int, tuple[Pending, torch.Tensor]] = {}
    replicating: list[Pending] = []  # hybrid sharding: gradient shards being summed across replicas
    reduces = grad and any(k == "reduce" for k, _ in schedule.ops)  # False: a deferred micro-batch
    # Gradient shards, allocated unit by unit as their reduces are issued (as activations are
    # freed, like autograd's own .grad), joined into the (L, n) stack at the end.
    shards: dict[int, torch.Tensor] = {}
    h: torch.Tensor | None = None  # activation flowing forward
    extras: tuple = ()  # pre's extra outputs, passed to every layer
    dpos: list[int] = []  # which extras carry gradient
    g_h: torch.Tensor | None = None  # gradient flowing backward (w.r.t. h)
    g_extras: dict[int, torch.Tensor] = {}  # summed gradients w.r.t. differentiable extras
    post_grads: tuple = ()
    loss_pending: Pending | None = None
    rng_end = None
    if recorder is not None:
        recorder.begin_step(schedule, dev)

    try:
        for i, op in enumerate(schedule.ops):
            if recorder is not None:
                start = recorder.start()
            kind, u = op
            frame = None
            rows = None if u == OUTER else schedule.layer_range(u)

            if kind == "gather":
                # Cast before the gather: bf16 moves half the bytes (no-op in fp32).
                src = (params.outer if rows is None else params.layers[rows.start:rows.stop]).to(cdt)
                direct = rows is None or len(rows) == 1  # the gather buffer is the parameter buffer
                if direct and u in released:  # back into the storage the live graph saved views of
                    out = _regrow(released[u][0]).view(-1)
                else:
                    out = torch.empty(world * src.numel(), dtype=cdt, device=dev)
                gathering[u] = all_gather(comm, out, src.reshape(-1), op)

            elif kind == "wait":
                out = wait(gathering.pop(u))
                if rows is None:
                    buf = out
                elif len(rows) == 1:
                    buf = out.view(1, -1)
                elif u in released:  # rank-major (world, k, n) -> layer-major (k, world*n), in place
                    buf = _regrow(released[u][0])
                    buf.copy_(out.view(world, len(rows), -1).transpose(0, 1).reshape(buf.shape))
                else:
                    buf = out.view(world, len(rows), -1).transpose(0, 1).reshape(len(rows), -1)
                if u in released:
                    # The graph's saved views now hold the same values again; collectives and
                    # the copy bumped the version counter (gloo: when the work completes), which
                    # autograd would take for an in-place change. Restore it.
                    with released.pop(u)[1]:
                        pass
                gathered[u] = buf

            elif kind == "free":
                buf = gathered.pop(u)
                if u in saved and saved[u].graph:  # a live graph holds views of buf: free the storage only
                    released[u] = (_release(buf), torch.autograd._unsafe_preserve_version_counter(buf))

            elif kind in ("forward", "forward_save") and u == OUTER:
                # pre's graph is kept whenever gradients are wanted: it decides which extras
                # (rotary tables, masks, ...) carry gradient, and costs one activation.
                views = model.outer.views(gathered[u])
                lv = units.leaves(views) if grad else views
                with torch.set_grad_enabled(grad):
                    h0, ex0 = units.pre(model, lv, batch)
                dpos = units.differentiable(ex0)
                if grad:
                    saved[u] = _Saved(True, batch, (h0, ex0), lv, (), None)
                h, extras = h0.detach(), tuple(e.detach() if j in dpos else e for j, e in enumerate(ex0))
                frame = Frame(i, op, gathered[u], batch, (h, *extras), None)

            elif kind in ("forward", "forward_save"):
                x, views = h, units.layer_views(model.layer, gathered[u])
                if kind == "forward_save":
                    lv, xl, el = _layer_leaves(views, x, extras, dpos)
                    with torch.enable_grad():
                        out = units.layers(model, rows.start, lv, xl, el)
                    saved[u] = _Saved(True, xl, out, lv, el, None)
                    h = out.detach()
                else:
                    rng = _rng_state(dev) if grad else None
                    with torch.no_grad():
                        h = units.layers(model, rows.start, views, x, extras)
                    if grad:
                        saved[u] = _Saved(False, x, None, [], (), rng)
                frame = Frame(i, op, gathered[u], x, h, None)

            elif kind == "loss":
                views = model.outer.views(gathered[OUTER])
                if grad:
                    lv, hl = units.leaves(views), h.detach().requires_grad_()
                    with torch.enable_grad():
                        loss = units.post(model, lv, hl, batch)
                    # Seed 1/ranks: the reduces are sums over ranks, the loss a mean.
                    g = torch.autograd.grad(loss, [hl, *lv], torch.full_like(loss, 1.0 / everyone) * loss_scale,
                                            allow_unused=True)
                    g_h, post_grads = _or_zeros(g[0], hl), g[1:]
                    rng_end = _rng_state(dev)
                else:
                    with torch.no_grad():
                        loss = units.post(model, views, h, batch)
                loss_pending = all_reduce(comm, loss.detach().float() / everyone, group=comm.group,
                                          label="the loss's mean")
                frame = Frame(i, op, gathered[OUTER], h, loss, None)

            elif kind == "backward" and u == OUTER:
                s = saved.pop(u)
                (h0, ex0), lv = s.out, s.leaves
                outs = [(t, g) for t, g in [(h0, g_h)] + [(ex0[j], g_extras.get(j)) for j in dpos]
                        if t.requires_grad and g is not None]
                gs = (torch.autograd.grad([t for t, _ in outs], lv, [g for _, g in outs], allow_unused=True)
                      if outs else [None] * len(lv))
                total = [a if b is None else b if a is None else a + b for a, b in zip(gs, post_grads)]
                flat_grads[u] = units.flat_grads(model.outer, [total], h0)[0].to(rdt)
                frame = Frame(i, op, gathered[u], g_h, None, flat_grads[u])

            elif kind == "backward":
                s = saved.pop(u)
                if s.graph:
                    out, lv, xl, el = s.out, s.leaves, s.x, s.extras
                else:
                    views = units.layer_views(model.layer, gathered[u])
                    lv, xl, el = _layer_leaves(views, s.x, extras, dpos)
                    rng_now = _set_rng(dev, s.rng)
                    with torch.enable_grad():
                        out = units.layers(model, rows.start, lv, xl, el)
                    _set_rng(dev, rng_now)
                flat_params = [p for layer in lv for p in layer]
                g = torch.autograd.grad(out, [*flat_params, xl, *(el[j] for j in dpos)], g_h,
                                        allow_unused=True)
                n = len(flat_params)
                g_out = g_h
                g_h = _or_zeros(g[n], xl)
                for j, ge in zip(dpos, g[n + 1:]):
                    if ge is not None:
                        g_extras[j] = ge if j not in g_extras else g_extras[j] + ge
                per, k = len(model.layer.slots), len(lv)
                by_layer = [g[j * per:(j + 1) * per] for j in range(k)]
                if k == 1 or schedule.reduce == "all_reduce":
                    # One cat, layer-major (k, world, n), seen as (world, k, n): an all-reduce sums
                    # in any order, and for one layer the two orders are the same memory.
                    flat = units.flat_grads(model.layer, by_layer, out).view(k, world, -1).transpose(0, 1)
                else:  # the reduce-scatter hands rank r the r-th contiguous chunk: (world, k, n) in memory
                    flat = torch.stack([units.flat_grads(model.layer, [gj], out).view(world, -1) for gj in by_layer], 1)
                flat_grads[u] = flat.to(rdt)  # (world, k, n), each layer's (world, n) in rank order
                frame = Frame(i, op, gathered[u], g_out, g_h, flat_grads[u])

            elif kind == "accumulate":
                g = flat_grads.pop(u)
                carry[u] = g if u not in carry else carry[u].add_(g)

            elif kind == "reduce":
                g = flat_grads.pop(u)
                if carry and u in carry:  # gradients deferred from earlier micro-batches
                    g = carry.pop(u).add_(g)
                n = model.outer.shard_numel if rows is None else len(rows) * model.layer.shard_numel
                dest = shards[u] = torch.empty(n, dtype=torch.float32, device=dev)  # fully written by the reduce
                if schedule.reduce == "all_reduce":  # in place, on the layer-major memory of g
                    g = g if rows is None else g.transpose(0, 1).contiguous()  # (k, world, n): no copy
                    reducing[u] = (all_reduce(comm, g, label=op), dest)
                else:
                    out = dest.view(-1) if rdt == torch.float32 else torch.empty(dest.numel(), dtype=rdt, device=dev)
                    reducing[u] = (reduce_scatter(comm, out, g.contiguous().view(-1), op), dest)

            elif kind == "wait_reduce":
                p, dest = reducing.pop(u)
                out = wait(p)
                if schedule.reduce == "all_reduce":  # this rank's chunk of each layer
                    mine = out.view(world, -1)[rank] if rows is None else out[:, rank]
                    dest.view(mine.shape).copy_(mine)
                elif out.data_ptr() != dest.data_ptr():
                    dest.copy_(out)
                if comm.replicas > 1:  # hybrid sharding: sum the shard across replicas, waited at the end
                    replicating.append(all_reduce(comm, dest, group=comm.replicate_group, label=op))

            if recorder is not None:
                live = len(gathering) + len(gathered) - (OUTER in gathering or OUTER in gathered)
                moved = (nbytes(gathering[u].out) if kind == "gather" else
                         pending_bytes(reducing[u][0]) if kind == "reduce" else 0)
                owned = owned_bytes(gathering, gathered, flat_grads, reducing, saved)
                recorder.record(i, start, live, moved, owned)
            if frame is not None:
                yield frame

        loss = wait(loss_pending)
        loss_pending = None
        if comm.replicas > 1:
            loss = wait(all_reduce(comm, loss, group=comm.replicate_group, label="the loss's mean"))
        while replicating:
            wait(replicating.pop())
        if grad:
            _set_rng(dev, rng_end)  # as after plain autograd: the forward consumed the RNG, backward none
        if not reduces:
            return Result(loss, None)
        stack = [shards[u].view(len(schedule.layer_range(u)), -1) for u in range(schedule.num_units)]
        layers = stack[0] if len(stack) == 1 else torch.cat(stack) if stack else \
            torch.empty(0, model.layer.shard_numel, device=dev)
        return Result(loss, Params(shards[OUTER], layers))
    finally:
        # Normal end: nothing is left. Early close (step_through stopped, an error): finish what
        # this rank issued, so the collective sequence stays the same on every rank.
        for p in list(gathering.values()) + [p for p, _ in reducing.values()] + replicating + \
                ([loss_pending] if loss_pending is not None else []):
            wait(p)


def _layer_leaves(views, x, extras, dpos):
    """Autograd leaves for a layer unit: parameters (per layer), input, differentiable extras."""
    lv = [units.leaves(v) for v in views]
    xl = x.detach().requires_grad_()
    el = tuple(e.detach().requires_grad_() if j in dpos else e for j, e in enumerate(extras))
    return lv, xl, el


def _or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def _release(buf: torch.Tensor) -> torch.Tensor:
    buf.untyped_storage().resize_(0)
    return buf


def _regrow(buf: torch.Tensor) -> torch.Tensor:
    buf.untyped_storage().resize_(buf.numel() * buf.element_size())
    return buf


def _rng_state(dev: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()


def _set_rng(dev: torch.device, state: torch.Tensor) -> torch.Tensor:
    """Set the device's RNG state; return the state it replaces."""
    now = _rng_state(dev)
    if dev.type == "cuda":
        torch.cuda.set_rng_state(state, dev)
    else:
        torch.set_rng_state(state)
    return now
