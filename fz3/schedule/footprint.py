"""The one memory model: the bytes a schedule holds after each op, a fold over the op table.

Each unit's state (``fz3.schedule.ops``) decides what it holds: its gathered buffer while
``GATHERING`` or ``GATHERED``; what its forward kept while ``KEPT``; its unreduced flat
gradient while ``UNREDUCED`` or ``REDUCING``; its gradient shard from the reduce on. How many
bytes each of those is comes from ``Sizes``: ``fz3.memory_plan`` measures them on the model
and a batch, the cost model counts them in closed form (``fz3.cost``). Both read the same
fold, so they cannot disagree about what is alive when.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from .ops import Activation, Grad, Op, OpKind, Params, UnitState, apply
from .schedule import Schedule


class Sizes(Protocol):
    """Bytes per unit, as one rank holds them."""

    def gathered(self, u: int) -> int: ...  # the unit's gathered parameter buffer
    def unreduced(self, u: int) -> int: ...  # its flat gradient before the reduce
    def shard(self, u: int) -> int: ...  # its fp32 gradient shard, written by the reduce
    def kept(self, op: Op) -> tuple[int, int]: ...  # (input, graph) a forward op keeps
    def during(self, op: Op) -> int: ...  # what lives only while ``op`` runs


class OpBytes(NamedTuple):
    """What is alive after an op (``during``: inside it), in bytes."""

    gathered: int  # gathered (or in-flight) parameter buffers
    unreduced: int  # flat gradients not yet reduced
    inputs: int  # layer inputs kept for recompute
    graphs: int  # autograd graphs kept (forward_save, pre)
    shards: int  # gradient shards written so far
    during: int

    @property
    def peak(self) -> int:
        return sum(self)


def footprint(schedule: Schedule, sizes: Sizes) -> list[OpBytes]:
    """``OpBytes`` after each op of a valid schedule."""
    states: dict[int, UnitState] = {}
    kept: dict[int, tuple[int, int]] = {}
    totals = [0, 0, 0, 0, 0]
    out = []
    for op in schedule.ops:
        u = op.unit
        before = states.get(u, UnitState())
        after = apply(op.kind, u, before, grad=schedule.grad)
        assert not isinstance(after, str), f"footprint of an invalid schedule: {after}"
        if before.params is Params.ABSENT and after.params is not Params.ABSENT:
            totals[0] += sizes.gathered(u)
        elif before.params is not Params.ABSENT and after.params is Params.ABSENT:
            totals[0] -= sizes.gathered(u)
        if after.activation is Activation.KEPT and before.activation is Activation.NONE:
            kept[u] = sizes.kept(op)
            totals[2] += kept[u][0]
            totals[3] += kept[u][1]
        elif after.activation is Activation.NONE and before.activation is Activation.KEPT:
            inputs, graphs = kept.pop(u)
            totals[2] -= inputs
            totals[3] -= graphs
        if _holds_unreduced(after.grad) != _holds_unreduced(before.grad):
            totals[1] += sizes.unreduced(u) if _holds_unreduced(after.grad) else -sizes.unreduced(u)
        if op.kind == OpKind.REDUCE:
            totals[4] += sizes.shard(u)
        states[u] = after
        out.append(OpBytes(*totals, sizes.during(op)))
    return out


def _holds_unreduced(g: Grad) -> bool:
    return g in (Grad.UNREDUCED, Grad.REDUCING)
