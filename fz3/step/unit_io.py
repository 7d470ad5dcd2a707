"""What a unit's function is called with, and where its results go.

The executor's steps (``fz3/step/executor.py``) decide when a unit runs; these functions
say how: which shards it gathers, which tensors (views of its gathered buffers) its function
gets, which autograd leaves stand for them, and where its gradients and outputs land (its
unreduced gradient, the shared units it reads, the step's result, the ``Frame``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch

from ..schedule.ops import Op
from ..schedule.saveable import Saveable, recompute, save
from ..schedule.schedule import Schedule, Unit
from ..schedule.structure import Role
from ..sharding.model import ShardedModel
from . import shapes
from .engine import AutogradLayers, Produced, Stage, StagePieces
from .state import AuxCotangent, Frame, Loss, Shard, StepState


def stage_pieces(s: StepState, u: int) -> StagePieces:
    """A pre, between or post unit's gathered memory (``fz3.step.engine.StagePieces``): its
    trained buffer and those of the shared units it reads, and the views its function takes
    (``fz3.sharding.model.layouts``' order: each unit's trained, then frozen, parameters)."""
    units = (u, *s.call.schedule.units[u].reads)

    def views(trained: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        out = []
        for i, v in enumerate(units):
            part = s.call.model.parts[s.call.schedule.units[v].part]
            out += part.layout.views(s.params[v].buffer if trained is None else trained[i])
            if part.frozen is not None:
                out += part.frozen.views(s.params[v].frozen)
        return out

    return StagePieces(tuple(s.params[v].buffer for v in units), views)


def stage_engine(model: ShardedModel, unit: Unit) -> Callable[[Loss], Stage]:
    """What runs a pre, between or post unit, given the step's loss function (post's; the
    others' are made here, once)."""
    if unit.role is Role.POST:
        return lambda loss: Stage(loss.fn, Role.POST, "post" if loss.fn is model.post
                                  else "the loss function", loss.has_aux)
    stage = Stage(model.functions[unit.part], unit.role, unit.name)
    return lambda loss: stage


def layer_engine(model: ShardedModel, unit: Unit, saves: Saveable = save
                 ) -> Callable[[Any, torch.Tensor, Produced], Any]:
    """``find(traced, x, produced)``: what runs a layer unit on ``x`` and its producer's
    extras ``produced`` (``fz3.step.engine``'s protocol): its traced programs
    (``fz3.step.programs.Layers``, cut by ``saves``; ``recompute`` runs ``save``'s), or, for
    layers that cannot be traced and with ``trace=False`` (``traced`` None), autograd (made
    here, once; its ``saves`` is ``save``). On the per-layer path: a dict lookup."""
    cut = save if saves is recompute else saves
    part, first, stop = unit.part, unit.layers.start, unit.layers.stop
    autograd = AutogradLayers(model.functions[part][first:stop], model.parts[part], first,
                              model.writes_input, model.layer_aux)

    def find(traced, x: torch.Tensor, produced: Produced):
        if traced is not None:
            layers = traced.layers(part, first, stop, x, produced.traced, cut)
            if layers is not None:
                return layers
        return autograd

    return find


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
    stack, in compute order (each unit's activation record lets them go; forward-only, it
    goes). A ValueError names the first unit whose aux differs from its stack's first."""
    out, grad = [], s.call.schedule.grad
    for units in stacks:
        kept = [s.activation.pop(u) for u in units]
        s.activation.update((u, k._replace(aux=None)) for u, k in zip(units, kept) if grad)
        auxes = [k.aux for k in kept]
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
    releases that memory (``fz3.step.memory``) before the loss, the layers or the caller
    read them."""
    held = {b.untyped_storage().data_ptr() for v in units
            for b in (s.params[v].buffer, s.params[v].frozen) if b is not None}
    return optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and
                           t.untyped_storage().data_ptr() in held else t, tree, none_is_leaf=True)


def aux_cotangents(s: StepState, stacks: list[list[int]],
                   grads: Sequence[torch.Tensor | None]) -> None:
    """The loss's gradients of the stacks' aux outputs, split back into each unit's rows
    (views), its grad record until its backward; none where the loss did not use them."""
    for units, g in zip(stacks, grads):
        if g is None:
            continue
        for u in units:
            layers = s.call.schedule.units[u].layers
            s.grad[u] = AuxCotangent(g[layers.start:layers.stop])


def add_gradients(s: StepState, u: int, grads, leaves: Sequence[torch.Tensor]
                  ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
    """Flat gradients of a single unit and of the shared units it reads (``stage_pieces``' order)
    -> the unit's unreduced gradient, and contributions added into the shared units'; with
    frames on, this unit's contribution to each shared unit (a copy: the sum goes on)."""
    call, table = s.call, s.grad
    reads = call.schedule.units[u].reads
    own, mine = None, {} if call.frames and reads else None
    for v, g, leaf in zip((u, *reads), grads, leaves):
        flat = or_zeros(g, leaf).to(call.model.precision.reduce)
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


def result_lander(model: ShardedModel, schedule: Schedule, unit: Unit
                  ) -> Callable[[StepState], torch.Tensor]:
    """``land(state)``: where this rank's reduced gradient of ``unit`` lands: its rows of the
    part's gradient shard in the step's result, allocated at the part's first reduce (and
    split into rows once: one op for all the part's units); for a part in
    ``Schedule.join_grads``, the unit's own ``(k, shard)`` rows, joined into the part's shard
    after the backward (``joined``); with ``update`` ops, the unit's own rows, stepped and
    let go by its update (``fz3.step.movement.update_op``)."""
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
    if grad is not None:
        grad = shapes.frame_grad(unit, grad, call.model.world_size)
    gathered = s.params[op.unit]
    return Frame(index, op, gathered.buffer, inputs, outputs, grad,
                 {r: s.params[r].buffer for r in reads} if reads else None, gathered.frozen,
                 read_grads)


def detached(aux: Any) -> Any:
    return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux,
                           none_is_leaf=True)


def or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g
