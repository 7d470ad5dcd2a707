"""What a unit's function is called with, and where its results go.

The executor's handlers (``fz3/step/executor.py``) decide when a unit runs; these functions
say how: which shards it gathers, which tensors (views of its gathered buffers) its function
gets, which autograd leaves stand for them, and where its gradients and outputs land (its
unreduced gradient, the shared units it reads, the step's result, the ``Frame``).
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..schedule.ops import Op
from ..schedule.structure import Role
from ..sharding import compute
from .state import Frame, StepState


def gather_pieces(s: StepState, unit) -> list[tuple[bool, torch.Tensor]]:
    """What a unit gathers: its trained shard, cast to the compute dtype before the gather (bf16
    moves half the bytes), and its frozen shard (stored in that dtype already), if any. A
    unit of one layer gathers its row (1-D), of k layers its ``(k, shard)`` rows."""
    frozen = s.model.frozen[unit.part]
    if unit.role is Role.STACK:
        rows = unit.rows
        if len(rows) == 1:  # the part's rows, split once per step: one op for all its units
            trained = _shard_rows(s, unit.part)[rows.start]
            frozen = None if frozen is None else frozen[rows.start]
        else:
            trained = s.params.parts[unit.part][rows.start:rows.stop]
            frozen = None if frozen is None else frozen[rows.start:rows.stop]
    else:
        trained = s.params.parts[unit.part]
    compute_dtype = s.model.precision.compute
    pieces = [(False, trained if trained.dtype == compute_dtype else trained.to(compute_dtype))]
    return pieces if frozen is None else [*pieces, (True, frozen)]


def _shard_rows(s: StepState, part: int) -> tuple[torch.Tensor, ...]:
    rows = s.shard_rows.get(part)
    if rows is None:
        rows = s.shard_rows[part] = s.params.parts[part].unbind(0)
    return rows


def grad_leaves(s: StepState, u: int) -> list[torch.Tensor]:
    """Autograd leaves aliasing the trained buffers of a single unit and of the shared units it
    reads: their gradients are the flat gradients."""
    return [compute.leaf(s.gathered[v, False]) for v in (u, *s.schedule.units[u].reads)]


def call_tensors(s: StepState, u: int, leaves: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """What a single unit's function is called with (``fz3.sharding.model.layouts``' order):
    views of the trained buffers (of ``leaves`` when given) and of the frozen ones."""
    out = []
    for i, v in enumerate((u, *s.schedule.units[u].reads)):
        part = s.model.parts[s.schedule.units[v].part]
        out += part.layout.views(s.gathered[v, False] if leaves is None else leaves[i])
        if part.frozen is not None:
            out += part.frozen.views(s.gathered[v, True])
    return out


def run_layers(s: StepState, u: int, buffer: torch.Tensor, x, extras) -> torch.Tensor:
    """A unit of k layers on ``x``, their parameters views of ``buffer`` (k, padded)."""
    unit = s.schedule.units[u]
    part = s.model.parts[unit.part]
    frozen = s.gathered.get((u, True))
    first = unit.rows.start
    fns = s.model.functions[unit.part][first:unit.rows.stop]
    if s.graphs is not None and frozen is None:
        return s.graphs(unit.part, u, fns[0], buffer[0], x, extras)
    writes = s.model.writes_input
    if s.compiled is not None:
        for j, row in enumerate(_rows(buffer)):
            name = compute.LayerName(part.path, part.first + first + j)

            def layer(h: torch.Tensor, j: int = j, row: torch.Tensor = row) -> torch.Tensor:
                return s.compiled(unit.part, part, fns[j], row,
                                  None if frozen is None else frozen[j], h, extras, name)

            x = compute.guarded(writes, fns[0], x, name, layer) if j == 0 else layer(x)
        return x
    rows = [part.layout.views(row) + ([] if frozen is None else part.frozen.views(frozen[j]))
            for j, row in enumerate(_rows(buffer))]
    return compute.run_layers(fns, rows, x, extras, part.path, part.first + first, writes)


def traced_layers(s: StepState, u: int, x: torch.Tensor):
    """The traced programs of a layer unit on ``x`` and its producer's extras
    (``fz3.step.traced.Layers``), or None: it runs through autograd (or ``compiled``,
    ``graphs``)."""
    if s.traced is None or s.graphs is not None:
        return None
    unit = s.schedule.units[u]
    return s.traced.layers(unit.part, unit.rows.start, unit.rows.stop, x,
                           traced_extras(s, s.producer))


def traced_extras(s: StepState, producer: int):
    """The extras of ``producer`` (a pre or between unit) as traced programs take them
    (``fz3.step.traced.Extras``), made at the first layer that reads them in this step."""
    extras = s.traced_extras.get(producer)
    if extras is None:
        extras = s.traced_extras[producer] = s.traced.extras(
            s.extras.get(producer, ()), s.grad_positions.get(producer, []))
    return extras


def run_traced(s: StepState, u: int, layers, x: torch.Tensor, extras: tuple, *,
               keep: bool) -> tuple[torch.Tensor, list | None]:
    """A unit's layers as traced programs on ``x`` and the extras' tensors: ``(h, each layer's
    residuals)`` with ``keep`` (their forward programs), ``(h, None)`` without (their
    inference programs)."""
    frozen = s.gathered.get((u, True))
    # No autograd here: the programs get gathered buffers, detached activations and detached
    # extras (``StepState.extras``), none of which requires grad, so nothing records a graph.
    residuals = []
    for j, (programs, row) in enumerate(zip(layers.programs, s.rows[u])):
        params = (row,) if frozen is None else (row, frozen[j])
        if keep:
            out = programs.forward(*params, x, *extras)
            x = out[0]
            residuals.append(out[1:])
        else:
            x = programs.inference(*params, x, *extras)[0]
    return x, (residuals if keep else None)


def backward_traced(s: StepState, u: int, layers, residuals: list,
                    grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """A unit's layers' backward programs, last layer first: the gradient of its buffer
    (``(padded,)`` for one layer, ``(k, padded)`` for k), of its input, and of each
    differentiable extra (summed over layers). Empties ``residuals``: each is freed inside
    its program after its last use."""
    rows, frozen = s.rows[u], s.gathered.get((u, True))
    k = len(layers.programs)
    grads: list = [None] * k
    extras: list = []
    for j in reversed(range(k)):  # no autograd (see run_traced)
        params = [rows[j]] if frozen is None else [rows[j], frozen[j]]
        out = layers.programs[j].backward([*params, *residuals.pop(), grad_h])
        grads[j], grad_h = out[0], out[1]
        extras = list(out[2:]) if not extras else [a + b for a, b in zip(extras, out[2:])]
    return (grads[0] if k == 1 else torch.stack(grads)), grad_h, extras


def _rows(buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows of a (k, padded) buffer (an autograd leaf: rows are views of it); one row as a
    view, whose backward is free (unbind's stacks the rows' gradients into a new buffer)."""
    return (buffer.view(-1),) if buffer.shape[0] == 1 else buffer.unbind(0)


def add_gradients(s: StepState, u: int, grads, leaves: list[torch.Tensor]) -> torch.Tensor:
    """Flat gradients of a single unit and of the shared units it reads (``grad_leaves``' order)
    -> the unit's unreduced gradient, and contributions added into the shared units'."""
    own = None
    for v, g, leaf in zip((u, *s.schedule.units[u].reads), grads, leaves):
        flat = or_zeros(g, leaf).to(s.model.precision.reduce)
        if v == u:
            own = s.unreduced[u] = flat
        elif v in s.unreduced:
            s.unreduced[v].add_(flat)
        else:
            s.unreduced[v] = flat
    return own


def result_shard(s: StepState, unit) -> torch.Tensor:
    """Where this rank's reduced gradient of ``unit`` lands: its rows of the part's gradient
    shard in the step's result, allocated at the part's first reduce (and split into rows
    once: one op for all the part's units)."""
    rows = s.grad_rows.get(unit.part)
    if rows is None:
        part = s.model.parts[unit.part]
        shape = ((part.rows, part.layout.shard_numel) if part.role is Role.STACK
                 else (part.layout.shard_numel,))
        grads = s.grads[unit.part] = torch.empty(shape, dtype=torch.float32,
                                                 device=s.model.device)
        rows = s.grad_rows[unit.part] = grads.unbind(0) if part.role is Role.STACK else ()
    if unit.role is not Role.STACK:
        return s.grads[unit.part]
    first = unit.rows.start
    return rows[first] if len(unit.rows) == 1 else s.grads[unit.part][first:unit.rows.stop].view(-1)


def frame_of(s: StepState, op: Op, index: int, inputs: Any, outputs: Any,
             grad: torch.Tensor | None) -> Frame | None:
    """What a compute op yields: references to the unit's buffers, inputs and outputs (None
    when the step makes no frames)."""
    if not s.frames:
        return None
    unit = s.schedule.units[op.unit]
    reads = unit.reads
    if grad is not None and grad.dim() == 1 and unit.role is Role.STACK:
        grad = grad.view(s.model.world_size, 1, -1)  # a one-layer unit's, kept flat
    return Frame(index, op, s.gathered[op.unit, False], inputs, outputs, grad,
                 {r: s.gathered[r, False] for r in reads} if reads else None,
                 s.gathered.get((op.unit, True)))


def detached(aux: Any) -> Any:
    return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux,
                           none_is_leaf=True)


def or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g
