"""What a unit's function is called with, and where its results go.

The executor's steps (``fz3/step/executor.py``) decide when a unit runs; these functions
say how: its engine and what it is given (``fz3.step.engine``), which tensors (views of its
gathered buffers) its function gets, and where its outputs and gradients land (the layers
after it, the loss, its unreduced gradient, the shared units it reads, the ``Frame``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch

from ..schedule.ops import Op
from ..schedule.saveable import Saveable, recompute, save
from ..schedule.schedule import Schedule, Unit
from ..schedule.structure import Role
from ..sharding import compute
from ..sharding.model import ShardedModel
from .engine import INFER, REPLAY, SAVED, AutogradUnit, Produced, or_zeros
from .state import Call, Frame, Loss, Shard, StepState


def unit_memory(schedule: Schedule, op: Op, memories: tuple) -> Any:
    """What a unit's engine is given as its memory: a layer unit's ``UnitMemory``; any other
    unit's, with those of the shared units it reads (``Unit.reads``' order), as a tuple."""
    unit = schedule.units[op.unit]
    if unit.role is Role.STACK:
        return memories[op.unit]
    return tuple(memories[v] for v in (op.unit, *unit.reads))


def unit_engine(model: ShardedModel, schedule: Schedule, op: Op, memories: tuple
                ) -> tuple[Any, Callable[[Call, Any, Any], Any]]:
    """``(memory, find)``: its ``unit_memory`` and ``find(call, h, second) -> its engine``
    (``fz3.step.engine``'s protocol). A layer unit's: its traced programs
    (``fz3.step.programs.Layers``, cut by ``op.saves``; ``recompute`` runs ``save``'s), or
    for layers that cannot be traced and with ``trace=False``, autograd (its predicate
    ``save`` or run as recompute); on the per-layer path, a dict lookup. Any other unit's:
    autograd over its and the shared units' memories it reads (the loss's made from the
    call's loss function)."""
    unit, grad, memory = schedule.units[op.unit], schedule.grad, unit_memory(schedule, op,
                                                                             memories)
    if unit.role is Role.STACK:
        return memory, _layers(model, unit, op.saves, grad)
    parts = [model.parts[schedule.units[v].part] for v in (op.unit, *unit.reads)]

    def trained(memory: tuple) -> tuple:
        return tuple(m.pieces.buffer for m in memory)

    def views(memory: tuple, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """(``fz3.sharding.model.layouts``' order: each unit's trained, then frozen, ones)"""
        out = []
        for part, m, b in zip(parts, memory, buffers):
            out += part.layout.views(b)
            if part.frozen is not None:
                out += part.frozen.views(m.pieces.frozen)
        return out

    mode = SAVED if grad else INFER
    if unit.role is Role.POST:
        return memory, lambda call, h, batch: AutogradUnit(
            _loss(model, call.loss_fn), trained, views, mode, model.device)
    binding, pre = model.functions[unit.part], unit.role is Role.PRE

    def run(tensors: list, inputs: tuple) -> tuple:
        h, batch = inputs
        h, extras = compute.run_stage(binding, tensors, (batch,) if pre else (h, batch),
                                      unit.name)
        return (h, *extras)

    engine = AutogradUnit(run, trained, views, mode, model.device)
    return memory, lambda call, h, batch: engine


def _loss(model: ShardedModel, loss: Loss) -> Callable:
    name = "post" if loss.fn is model.post else "the loss function"

    def run(tensors: list, inputs: tuple) -> tuple:
        out = compute.run_loss(loss.fn, loss.has_aux, tensors, *inputs[:2], name, inputs[2])
        if torch.is_grad_enabled() and not out[0].requires_grad:
            raise RuntimeError(f"{name} returned a loss that does not require grad (it was "
                               f"detached, or computed from no parameter and not from h): "
                               f"there is nothing to differentiate")
        return out

    return run


def _layers(model: ShardedModel, unit: Unit, saves: Saveable, grad: bool) -> Callable:
    """``unit_engine``'s ``find`` for a layer unit."""
    cut = save if saves is recompute else saves
    p, first, stop = unit.part, unit.layers.start, unit.layers.stop
    part, bindings = model.parts[p], model.functions[p][first:stop]

    def views(memory, buffers: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        frozen, (buffer,) = memory.pieces.frozen, buffers
        # one row is a view whose backward is free, unbind's stacks the rows'
        rows = (buffer.view(-1),) if buffer.shape[0] == 1 else buffer.unbind(0)
        return [part.layout.views(row) + ([] if frozen is None else
                                          part.frozen.views(frozen[j]))
                for j, row in enumerate(rows)]

    def run(tensors: list, inputs: tuple) -> tuple:
        h, produced = inputs
        h, aux = compute.run_layers(bindings, tensors, h, produced.extras, part.path,
                                    part.first + first, model.writes_input, model.layer_aux)
        return (h,) if aux is None else (h, aux)

    replays = REPLAY if grad else INFER
    autograd = AutogradUnit(run, lambda memory: (memory.pieces.buffer,), views,
                            SAVED if saves is save else replays, model.device)
    mode, last = SAVED if saves is not recompute else replays, [None, None]

    def find(call: Call, h: torch.Tensor, produced: Produced):
        if call.traced is not None:
            layers = call.traced.layers(p, first, stop, h, produced.traced, cut)
            if layers is not None:
                if mode == SAVED:
                    return layers
                if layers is not last[0]:  # (made once per programs: ``Layers`` cut by save)
                    last[:] = layers, layers._replace(mode=mode)
                return last[1]
        return autograd

    return find


def output_lander(model: ShardedModel, schedule: Schedule, op: Op
                  ) -> Callable[[StepState, tuple, Any], Any] | None:
    """``land(state, outputs, residuals) -> the frame's outputs``: where a unit's outputs
    after h go (a pre or between unit's extras, as the layers take them; a layer unit's aux
    outputs, until the loss), h set apart from its memory too; None: it has no others."""
    u, unit = op.unit, schedule.units[op.unit]
    if unit.role is Role.STACK:
        if not model.layer_aux:
            return None

        def land_aux(s: StepState, outputs: tuple, residuals: Any) -> tuple:
            aux = s.outputs[u] = apart(outputs[1], s, (u,))
            return s.h, aux

        return land_aux
    reads = (u, *unit.reads)

    def land(s: StepState, outputs: tuple, residuals: Any) -> tuple:
        positions = compute.differentiable((outputs if residuals is None
                                            else residuals.outputs)[1:])
        s.h, extras = apart((outputs[0], outputs[1:]), s, reads)
        traced = s.call.traced
        s.outputs[u] = Produced(extras, positions,
                                None if traced is None else traced.extras(extras, positions))
        return (s.h, *extras)

    return land


def grad_lander(schedule: Schedule, op: Op, memory: Any
                ) -> Callable[[StepState, tuple], tuple]:
    """``land(state, param_grads) -> (its unreduced gradient, read_grads)``: a layer unit's
    into its memory (``UnitMemory.unreduced``); any other's by ``add_gradients``."""
    u = op.unit
    if schedule.units[u].role is not Role.STACK:
        return lambda s, grads: add_gradients(s, u, grads)

    def land(s: StepState, grads: tuple) -> tuple:
        s.grad[u] = unreduced = memory.unreduced(grads[0])
        return unreduced, None

    return land


def aux_units(schedule: Schedule) -> list[list[int]]:
    """Per stack part, in compute order: its layer units, in layer order (whose aux outputs
    ``stacked_aux`` joins and ``aux_cotangents`` splits)."""
    by_part: dict[int, list[int]] = {}
    for u, unit in enumerate(schedule.units):
        if unit.role is Role.STACK:
            by_part.setdefault(unit.part, []).append(u)
    return [sorted(us, key=lambda u: schedule.units[u].layers.start)
            for _, us in sorted(by_part.items())]


def stacked_aux(s: StepState, stacks: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """The layers' aux outputs as the loss takes them: one ``(layers, *shape)`` tensor per
    stack, in compute order (out of each unit's outputs record). A ValueError names the first
    unit whose aux differs from its stack's first."""
    out = []
    for units in stacks:
        auxes = [s.outputs.pop(u) for u in units]
        for u, a in zip(units, auxes):
            if a.shape[1:] != auxes[0].shape[1:] or a.dtype != auxes[0].dtype:
                unit = s.call.schedule.units[u]
                raise ValueError(f"{unit.name} returned aux outputs of shape {list(a.shape[1:])}"
                                 f" {a.dtype}, the first layers of its stack "
                                 f"{list(auxes[0].shape[1:])} {auxes[0].dtype}: the layers of "
                                 f"a stack return aux outputs of one shape and dtype")
        out.append(auxes[0] if len(auxes) == 1 else torch.cat(auxes))
    return tuple(out)


def apart(tree: Any, s: StepState, units: Sequence[int]) -> Any:
    """``tree``'s tensors, each copied where it views the gathered memory of one of ``units``
    (a layer's aux output or an extra that is a parameter's view, a loss's aux): ``free``
    releases it before they are read ([Note: a unit's memory])."""
    held = {b.untyped_storage().data_ptr() for v in units
            for b in (s.params[v].buffer, s.params[v].frozen) if b is not None}
    return optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and
                           t.untyped_storage().data_ptr() in held else t, tree, none_is_leaf=True)


def aux_cotangents(s: StepState, stacks: list[list[int]],
                   grads: Sequence[torch.Tensor | None]) -> None:
    """The loss's gradients of the stacks' aux outputs, split back into each unit's rows
    (views): the cotangent of its output 1, its grad record until its backward; none where
    the loss did not use them."""
    for units, g in zip(stacks, grads or ()):
        if g is None:
            continue
        for u in units:
            layers = s.call.schedule.units[u].layers
            s.grad[u] = {1: g[layers.start:layers.stop]}


def add_gradients(s: StepState, u: int, grads: tuple
                  ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
    """Flat gradients of a single unit and of the shared units it reads (``Unit.reads``' order;
    None: zeros)
    -> the unit's unreduced gradient, and contributions added into the shared units'; with
    frames on, this unit's contribution to each shared unit (a copy: the sum goes on)."""
    call, table = s.call, s.grad
    reads = call.schedule.units[u].reads
    own, mine = None, {} if call.frames and reads else None
    for v, g in zip((u, *reads), grads):
        flat = or_zeros(g, s.params[v].buffer).to(call.model.precision.reduce)
        if v == u:
            own = table[u] = flat
            continue
        if mine is not None:
            mine[v] = flat.clone()
        if v in table:
            table[v].add_(flat)
        else:
            table[v] = flat
    return own, mine


def joined(s: StepState, parts: int) -> tuple[torch.Tensor, ...]:
    """Each part's gradient shard in the step's result; a ``join_grads`` part's reduced rows
    joined into its ``(L, shard)`` shard in layer order (one copy, the rows freed as it goes)."""
    return tuple(r.grad if isinstance(r, Shard) else torch.cat([r[f] for f in sorted(r)])
                 for r in (s.results.pop(p) for p in range(parts)))


def frame_of(s: StepState, op: Op, index: int, inputs: Any, outputs: Any,
             grad: torch.Tensor | None, read_grads: dict[int, torch.Tensor] | None = None
             ) -> Frame | None:
    """What a compute op yields: references to the unit's buffers, inputs and outputs (None
    when the step makes no frames); ``read_grads``: its gradient contributions to the shared
    units it reads."""
    call = s.call
    if not call.frames:
        return None
    unit = call.schedule.units[op.unit]
    reads = unit.reads
    if grad is not None and grad.dim() == 1 and unit.role is Role.STACK:  # (world, k, n)
        grad = grad.view(call.model.world_size, 1, -1)
    gathered = s.params[op.unit]
    return Frame(index, op, gathered.buffer, inputs, outputs, grad,
                 {r: s.params[r].buffer for r in reads} if reads else None, gathered.frozen,
                 read_grads)


def detached(aux: Any) -> Any:
    return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux,
                           none_is_leaf=True)
