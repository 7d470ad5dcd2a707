"""The one memory model: the bytes a schedule holds after each op, a fold over the op table.

Each unit's state (``fz3.schedule.ops``) decides what it holds: its gathered buffer while
``GATHERING`` or ``GATHERED``; what its forward kept while ``KEPT``; its unreduced flat
gradient while ``UNREDUCED`` or ``REDUCING``. A part's gradient shard (all its rows, where
the step returns it) exists from the first reduce of any of its units on; for a part in
``Schedule.join_grads``, each unit's rows from its own reduce on, and the whole shard beside
them while they are joined, after the last op; with ``update`` ops (``fz3.train_step``),
each unit's rows from its reduce to its update. How many
bytes each of those is comes from ``Sizes``: ``fz3.memory_plan`` measures them on the model
and a batch, the cost model counts them in closed form (``fz3.cost``). Both read the same
fold, so they cannot disagree about what is alive when.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from .ops import (COMPUTE_KINDS, Activation, Grad, Op, OpKind, Params, UnitState,
                  transition)
from .saveable import recompute
from .schedule import Schedule, Unit
from .structure import Role


class Sizes(Protocol):
    """Bytes per unit, as one rank holds them."""

    def gathered(self, u: int) -> int: ...  # the unit's gathered parameter buffer
    def unreduced(self, u: int) -> int: ...  # its flat gradient before the reduce
    def part_shard(self, part: int) -> int: ...  # a part's fp32 gradient shard, all its rows
    def input_bytes(self, u: int) -> int: ...  # one layer's input (h), kept for recompute
    def graph_bytes(self, u: int) -> int: ...  # one row's autograd graph (a layer's, or pre's)
    def during(self, op: Op) -> int: ...  # what lives only while ``op`` runs


class OpBytes(NamedTuple):
    """What is alive after an op (``during``: inside it), in bytes."""

    gathered: int  # gathered (or in-flight) parameter buffers
    unreduced: int  # flat gradients not yet reduced
    inputs: int  # layer inputs kept for recompute
    graphs: int  # autograd graphs or residuals kept (a forward saving some, pre)
    shards: int  # gradient shards allocated so far
    during: int

    @property
    def peak(self) -> int:
        return sum(self)


def footprint(schedule: Schedule, sizes: Sizes) -> list[OpBytes]:
    """``OpBytes`` after each op of a valid schedule."""
    states = {u: UnitState() for u in range(len(schedule.units))}
    kept: dict[int, tuple[int, int]] = {}
    allocated: set[int] = set()
    rows: dict[int, int] = {}  # a part's layers (its units' share of its shard)
    for unit in schedule.units:
        rows[unit.part] = rows.get(unit.part, 0) + len(unit.layers)
    totals = [0, 0, 0, 0, 0]
    out = []
    for op in schedule.ops:
        touched = ([(r, True) for r in schedule.units[op.unit].reads]
                   if op.kind in COMPUTE_KINDS else [])
        for u, read in touched + [(op.unit, False)]:
            before = states[u]
            after = transition(op.kind, schedule.units[u].name, before, grad=schedule.grad,
                               read=read)
            assert not isinstance(after, str), f"footprint of an invalid schedule: {after}"
            states[u] = after
            _account(totals, sizes, op, u, before, after, kept, schedule)
        unit = schedule.units[op.unit]
        own = sizes.part_shard(unit.part) // rows[unit.part] * len(unit.layers)
        if op.kind == OpKind.UPDATE:  # its own rows' buffer, freed by its update
            totals[4] -= own
        elif op.kind == OpKind.REDUCE and (schedule.updates or unit.part in schedule.join_grads):
            totals[4] += own
        elif op.kind == OpKind.REDUCE and unit.part not in allocated:
            allocated.add(unit.part)
            totals[4] += sizes.part_shard(unit.part)
        out.append(OpBytes(*totals, sizes.during(op)))
    joined = sum(sizes.part_shard(p) for p in schedule.join_grads)
    if joined and out:  # the joined shards beside their units' rows, after the last op
        out[-1] = out[-1]._replace(during=max(out[-1].during, joined))
    return out


def _account(totals: list[int], sizes: Sizes, op: Op, u: int, before: UnitState, after: UnitState,
             kept: dict[int, tuple[int, int]], schedule: Schedule) -> None:
    if (before.params is Params.ABSENT) != (after.params is Params.ABSENT):
        totals[0] += sizes.gathered(u) if before.params is Params.ABSENT else -sizes.gathered(u)
    if before.activation is Activation.NONE and after.activation is Activation.KEPT:
        kept[u] = _kept(schedule.units[u], op, sizes)
        totals[2] += kept[u][0]
        totals[3] += kept[u][1]
    elif before.activation is Activation.KEPT and after.activation is Activation.NONE:
        inputs, graphs = kept.pop(u)
        totals[2] -= inputs
        totals[3] -= graphs
    if _holds_unreduced(after.grad) != _holds_unreduced(before.grad):
        totals[1] += sizes.unreduced(u) if _holds_unreduced(after.grad) else -sizes.unreduced(u)


def _kept(unit: Unit, op: Op, sizes: Sizes) -> tuple[int, int]:
    """``(input, graph)`` bytes a forward keeps: pre's and between's graphs are kept whenever
    gradients are wanted; a layer unit keeps its k layers' residuals (what its predicate saves,
    ``Op.saves``: ``Sizes.graph_bytes`` are measured under it) or its input (``recompute``)."""
    if unit.role is not Role.STACK:
        return 0, sizes.graph_bytes(op.unit)
    if op.saves is not recompute:  # residuals, per layer
        return 0, sizes.graph_bytes(op.unit) * len(unit.layers)
    return sizes.input_bytes(op.unit), 0


def _holds_unreduced(g: Grad) -> bool:
    return g in (Grad.UNREDUCED, Grad.REDUCING)
