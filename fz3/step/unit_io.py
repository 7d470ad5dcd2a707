"""What a unit's function is called with, and where its results go.

The executor's handlers (``fz3/step/executor.py``) decide when a unit runs; these functions
say how: which shards it gathers, which tensors (views of its gathered buffers) its function
gets, which autograd leaves stand for them, and where its gradients and outputs land (its
unreduced gradient, the shared units it reads, the step's result, the ``Frame``).
"""

from __future__ import annotations

from typing import Any, Sequence

import optree
import torch

from ..schedule.ops import Op
from ..schedule.structure import Role
from . import shapes
from .engine import AutogradLayers, Produced, Stage, StagePieces
from .state import Frame, StepState


def gather_pieces(s: StepState, unit) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """What a unit gathers: its trained shard, cast to the compute dtype before the gather (bf16
    moves half the bytes), its frozen shard (stored in that dtype already) or None, and
    whether the trained one is a cast (the step's own memory). A unit of one layer gathers
    its row (1-D), of k layers its ``(k, shard)`` rows."""
    # the part's rows, split once per step: one op for all its units
    trained, frozen = shapes.gathered_shards(unit, s.params.parts[unit.part],
                                             s.model.frozen[unit.part],
                                             lambda: _shard_rows(s, unit.part))
    compute_dtype = s.model.precision.compute
    if trained.dtype == compute_dtype:
        return trained, frozen, False
    return trained.to(compute_dtype), frozen, True


def _shard_rows(s: StepState, part: int) -> tuple[torch.Tensor, ...]:
    rows = s.shard_rows.get(part)
    if rows is None:
        rows = s.shard_rows[part] = s.params.parts[part].unbind(0)
    return rows


def stage_pieces(s: StepState, u: int) -> StagePieces:
    """A pre, between or post unit's gathered memory (``fz3.step.engine.StagePieces``): its
    trained buffer and those of the shared units it reads, and the views its function takes
    (``fz3.sharding.model.layouts``' order: each unit's trained, then frozen, parameters)."""
    units = (u, *s.schedule.units[u].reads)

    def views(trained: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        out = []
        for i, v in enumerate(units):
            part = s.model.parts[s.schedule.units[v].part]
            out += part.layout.views(s.gathered[v].buffer if trained is None else trained[i])
            if part.frozen is not None:
                out += part.frozen.views(s.gathered[v].frozen)
        return out

    return StagePieces(tuple(s.gathered[v].buffer for v in units), views)


def stage_engine(s: StepState, u: int) -> Stage:
    """What runs a pre, between or post unit (post: the step's loss function)."""
    unit = s.schedule.units[u]
    if unit.role is Role.POST:
        fn, has_aux = s.loss_fn
        return Stage(fn, Role.POST, "post" if fn is s.model.post else "the loss function",
                     has_aux)
    return Stage(s.model.functions[unit.part], unit.role, unit.name)


def layer_engine(s: StepState, u: int, x: torch.Tensor, produced: Produced,
                 keep: frozenset[str] | None = None):
    """What runs a layer unit on ``x`` and its producer's extras ``produced``
    (``fz3.step.engine``'s protocol): its traced programs (``fz3.step.programs.Layers``; with
    ``keep``, selective recompute's), or, for layers that cannot be traced and with
    ``trace=False``, autograd (``keep`` None: it has no selective form). On the per-layer
    path: once traced, a dict lookup."""
    unit = s.schedule.units[u]
    if s.traced is not None:
        if produced.traced is None:  # at the first layer that reads them in this step
            produced.traced = s.traced.extras(produced.extras, produced.positions)
        layers = s.traced.layers(unit.part, unit.layers.start, unit.layers.stop, x,
                                 produced.traced, keep)
        if layers is not None:
            return layers
    part = s.model.parts[unit.part]
    return AutogradLayers(s.model.functions[unit.part][unit.layers.start:unit.layers.stop], part,
                          unit.layers.start, s.model.writes_input, s.model.layer_aux)


def aux_units(s: StepState) -> list[list[int]]:
    """Per stack part, in compute order: its layer units, in layer order (whose aux outputs
    ``stacked_aux`` joins and ``aux_cotangents`` splits)."""
    by_part: dict[int, list[int]] = {}
    for u, unit in enumerate(s.schedule.units):
        if unit.role is Role.STACK:
            by_part.setdefault(unit.part, []).append(u)
    return [sorted(us, key=lambda u: s.schedule.units[u].layers.start)
            for _, us in sorted(by_part.items())]


def stacked_aux(s: StepState, stacks: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """The layers' aux outputs as the loss takes them: one ``(layers, *shape)`` tensor per
    stack, in compute order (each unit's record emptied). A ValueError names the first unit
    whose aux differs from its stack's first."""
    out = []
    for units in stacks:
        auxes = [s.layer_aux.pop(u) for u in units]
        for u, a in zip(units, auxes):
            if a.shape[1:] != auxes[0].shape[1:] or a.dtype != auxes[0].dtype:
                unit = s.schedule.units[u]
                raise ValueError(f"{unit.name} returned aux outputs of shape {list(a.shape[1:])}"
                                 f" {a.dtype}, the first layers of its stack "
                                 f"{list(auxes[0].shape[1:])} {auxes[0].dtype}: the layers of "
                                 f"a stack return aux outputs of one shape and dtype")
        out.append(auxes[0] if len(auxes) == 1 else torch.cat(auxes))
    return tuple(out)


def aux_cotangents(s: StepState, stacks: list[list[int]],
                   grads: Sequence[torch.Tensor | None]) -> None:
    """The loss's gradients of the stacks' aux outputs, split back into each unit's rows
    (views) for its backward; none where the loss did not use them."""
    for units, g in zip(stacks, grads):
        if g is None:
            continue
        for u in units:
            layers = s.schedule.units[u].layers
            s.grad_aux[u] = g[layers.start:layers.stop]


def add_gradients(s: StepState, u: int, grads, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """Flat gradients of a single unit and of the shared units it reads (``stage_pieces``' order)
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
    once: one op for all the part's units); for a part in ``Schedule.join_grads``, the unit's
    own ``(k, shard)`` rows, joined into the part's shard after the backward (``joined``)."""
    part = s.model.parts[unit.part]
    if unit.part in s.schedule.join_grads:
        rows = s.joining.setdefault(unit.part, {})[unit.layers.start] = torch.empty(
            (len(unit.layers), part.layout.shard_numel), dtype=torch.float32,
            device=s.model.device)
        return rows.view(-1)
    rows = s.grad_rows.get(unit.part)
    if rows is None:
        shape = ((part.rows, part.layout.shard_numel) if part.role is Role.STACK
                 else (part.layout.shard_numel,))
        grads = s.grads[unit.part] = torch.empty(shape, dtype=torch.float32,
                                                 device=s.model.device)
        rows = s.grad_rows[unit.part] = grads.unbind(0) if part.role is Role.STACK else ()
    if unit.role is not Role.STACK:
        return s.grads[unit.part]
    return shapes.result_rows(unit, s.grads[unit.part], rows)


def joined(s: StepState) -> None:
    """Each ``join_grads`` part's reduced rows joined into its ``(L, shard)`` gradient shard in
    the step's result, in layer order (one copy; the rows are freed as it returns)."""
    for part, rows in s.joining.items():
        s.grads[part] = torch.cat([rows[first] for first in sorted(rows)])
    s.joining.clear()


def frame_of(s: StepState, op: Op, index: int, inputs: Any, outputs: Any,
             grad: torch.Tensor | None) -> Frame | None:
    """What a compute op yields: references to the unit's buffers, inputs and outputs (None
    when the step makes no frames)."""
    if not s.frames:
        return None
    unit = s.schedule.units[op.unit]
    reads = unit.reads
    if grad is not None:
        grad = shapes.frame_grad(unit, grad, s.model.world_size)
    gathered = s.gathered[op.unit]
    return Frame(index, op, gathered.buffer, inputs, outputs, grad,
                 {r: s.gathered[r].buffer for r in reads} if reads else None, gathered.frozen)


def detached(aux: Any) -> Any:
    return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux,
                           none_is_leaf=True)


def or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g
