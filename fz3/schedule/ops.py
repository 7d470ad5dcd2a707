"""What an op is and what it does: op kinds as an ``Enum``, and one table of what each kind
does to a unit's state. Everything that interprets a schedule without running it (the
validator, the memory model, the cost model, the trace lanes) is a fold over this table.

A unit has three independent pieces of state:

==============  ===============================================================
``params``      ``ABSENT -> GATHERING -> GATHERED -> ABSENT`` (gather, wait, free)
``activation``  ``NONE -> KEPT -> NONE``: a forward keeps what its predicate saves
                (``Op.saves``, ``fz3.schedule.saveable``: its input for ``recompute``,
                its residuals for ``save``, some of them for others) until its backward
``grad``        ``NONE -> UNREDUCED -> REDUCING -> REDUCED`` (backward, reduce,
                wait_reduce) ``-> APPLIED`` (update: ``fz3.train_step``'s optimizer
                stepped the unit's rows with its shard), or ``UNREDUCED -> CARRIED``
                (accumulate: summed into a buffer that the next micro-batch reduces)
==============  ===============================================================

A compute op needs its own unit ``GATHERED``, and also the units it *reads* (parts tied
across units, ``Role.SHARED``): for those, ``READ_TABLE`` says what the op does (a loss or a
backward adds a contribution to their gradient). Compute ops must also come in the compute
order (``fz3.schedule.schedule.compute_order``); that rule is global, not per unit, and
lives with the schedule.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

# (HEAVY_OPS: ``selective``'s ops, read from here too)
from .saveable import HEAVY_OPS, Saveable, name_of, recompute, save, selective  # noqa: F401

class Category(Enum):
    """What an op does, as the streams and lanes see it."""

    ISSUE = "issue"  # starts a collective (async)
    WAIT = "wait"  # blocks until a collective is done
    COMPUTE = "compute"  # runs the model's math
    LIFETIME = "lifetime"  # ends a buffer's life (free, accumulate)
    UPDATE = "update"  # steps parameters with their gradient (``fz3.train_step``'s optimizer)


class OpKind(str, Enum):
    """The kinds of op. A ``str`` enum: ``OpKind("gather")`` and ``Op("gather", 0)`` work."""

    GATHER = "gather"  # issue the all-gather of the unit's shards
    WAIT = "wait"  # block until the unit's gather is done
    FORWARD = "forward"  # compute the unit; keep what its predicate saves (``Op.saves``)
    # accepted where an op is made: ``Op("forward_save", u)`` is ``Op("forward", u, save)``
    FORWARD_SAVE = "forward_save"
    FORWARD_SELECTIVE = "forward_selective"  # ``Op("forward", u, selective)``
    LOSS = "loss"  # post + loss, and its vjp (the post unit)
    BACKWARD = "backward"  # vjp of the unit (recomputing it first after ``forward``)
    FREE = "free"  # release the unit's gathered parameters
    REDUCE = "reduce"  # issue the reduce-scatter (or all-reduce) of its flat gradient
    WAIT_REDUCE = "wait_reduce"  # block until its gradient shard is ready
    ACCUMULATE = "accumulate"  # add its flat gradient into a carried buffer instead
    UPDATE = "update"  # step the unit's parameter shard with its reduced gradient shard

    __hash__ = str.__hash__  # hash like the string, so "gather" and OpKind.GATHER are one key

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @property
    def category(self) -> Category:
        return _CATEGORY[self]


_CATEGORY = {
    OpKind.GATHER: Category.ISSUE, OpKind.REDUCE: Category.ISSUE,
    OpKind.WAIT: Category.WAIT, OpKind.WAIT_REDUCE: Category.WAIT,
    OpKind.FORWARD: Category.COMPUTE, OpKind.FORWARD_SAVE: Category.COMPUTE,
    OpKind.FORWARD_SELECTIVE: Category.COMPUTE,
    OpKind.LOSS: Category.COMPUTE, OpKind.BACKWARD: Category.COMPUTE,
    OpKind.FREE: Category.LIFETIME, OpKind.ACCUMULATE: Category.LIFETIME,
    OpKind.UPDATE: Category.UPDATE,
}
COMPUTE_KINDS = frozenset(k for k in OpKind if k.category is Category.COMPUTE)
FORWARD_KINDS = frozenset({OpKind.FORWARD})  # (a set: what reads it reads every forward)
# the kinds an op is still made with, and the predicate each stands for
_LEGACY = {OpKind.FORWARD_SAVE: save, OpKind.FORWARD_SELECTIVE: selective}
# wait -> the issue it ends
COMPLETES = {OpKind.WAIT: OpKind.GATHER, OpKind.WAIT_REDUCE: OpKind.REDUCE}


class _Op(NamedTuple):
    kind: OpKind
    unit: int  # index into the schedule's units (``Schedule.units``)
    # a forward's: what it keeps for its backward (``fz3.schedule.saveable``); None otherwise
    saves: Saveable | None = None


class Op(_Op):
    """One op of a schedule: ``kind``, ``unit`` and, for a forward only, ``saves``: the
    predicate it keeps by. ``Op("forward", u)`` recomputes (``saves=recompute``);
    ``Op("forward", u, save)``, or ``Op("forward_save", u)``, keeps the residuals."""

    __slots__ = ()

    def __new__(cls, kind: OpKind | str, unit: int, saves: Saveable | None = None) -> Op:
        if isinstance(kind, str) and kind in _LEGACY:
            # recompute: a planned forward's ``_replace(kind=...)`` carries its default along
            if saves is not None and saves is not recompute:
                raise ValueError(f"Op({str(kind)!r}, {unit}, {saves!r}): {kind} names its "
                                 f"predicate itself; write Op('forward', {unit}, saves)")
            kind, saves = OpKind.FORWARD, _LEGACY[kind]
        elif kind == OpKind.FORWARD and saves is None:
            saves = recompute
        return super().__new__(cls, kind, unit, saves)

    def __str__(self) -> str:
        return f"{self.kind} {self.unit}" + ("" if self.saves is None else
                                            f" ({name_of(self.saves)})")

    def __repr__(self) -> str:
        saves = "" if self.saves is None else f", {name_of(self.saves)}"
        return f"Op({str(self.kind)!r}, {self.unit!r}{saves})"

    def named(self) -> tuple:
        """The op as plain values (its predicate by name): what ranks compare."""
        return (str(self.kind), self.unit, None if self.saves is None else name_of(self.saves))


class Params(Enum):
    ABSENT = "absent"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Activation(Enum):
    NONE = "none"
    KEPT = "kept"


class Grad(Enum):
    NONE = "none"
    UNREDUCED = "unreduced"
    REDUCING = "reducing"
    REDUCED = "reduced"
    CARRIED = "carried"
    APPLIED = "applied"


class UnitState(NamedTuple):
    params: Params = Params.ABSENT
    activation: Activation = Activation.NONE
    grad: Grad = Grad.NONE


class Change(NamedTuple):
    """One field of ``UnitState``: the states it may be in before the op, and after."""

    field: str
    before: frozenset
    after: Enum | None  # None: left as it is (the op only needs it in ``before``)


def _c(field: str, before: set, after: Enum | None) -> Change:
    return Change(field, frozenset(before), after)


_GATHERED = _c("params", {Params.GATHERED}, Params.GATHERED)  # compute needs it, leaves it
# The table. A forward in a forward-only schedule keeps nothing (the fold skips KEPT there).
TABLE: dict[OpKind, tuple[Change, ...]] = {
    OpKind.GATHER: (_c("params", {Params.ABSENT}, Params.GATHERING),),
    OpKind.WAIT: (_c("params", {Params.GATHERING}, Params.GATHERED),),
    OpKind.FORWARD: (_GATHERED, _c("activation", {Activation.NONE}, Activation.KEPT)),
    OpKind.LOSS: (_GATHERED, _c("grad", {Grad.NONE}, Grad.UNREDUCED)),
    OpKind.BACKWARD: (_GATHERED, _c("activation", {Activation.KEPT}, Activation.NONE),
                      _c("grad", {Grad.NONE}, Grad.UNREDUCED)),
    OpKind.FREE: (_c("params", {Params.GATHERED}, Params.ABSENT),),
    OpKind.REDUCE: (_c("grad", {Grad.UNREDUCED}, Grad.REDUCING),),
    OpKind.WAIT_REDUCE: (_c("grad", {Grad.REDUCING}, Grad.REDUCED),),
    OpKind.ACCUMULATE: (_c("grad", {Grad.UNREDUCED}, Grad.CARRIED),),
    # its shard is written while no gather reads it (a resident unit's gathered copy may stay)
    OpKind.UPDATE: (_c("params", {Params.ABSENT, Params.GATHERED}, None),
                    _c("grad", {Grad.REDUCED}, Grad.APPLIED)),
}


_CONTRIBUTE = _c("grad", {Grad.NONE, Grad.UNREDUCED}, Grad.UNREDUCED)
# What a compute op does to a unit it reads (not its own): it needs it gathered, and a loss or
# a backward adds to its gradient, which stays unreduced until its last reader is done.
READ_TABLE: dict[OpKind, tuple[Change, ...]] = {
    OpKind.FORWARD: (_GATHERED,),
    OpKind.LOSS: (_GATHERED, _CONTRIBUTE), OpKind.BACKWARD: (_GATHERED, _CONTRIBUTE),
}


def transition(kind: OpKind, name: str, state: UnitState, *, grad: bool = True,
          read: bool = False) -> UnitState | str:
    """Unit ``name``'s state after an op of ``kind`` (``read``: an op of another unit that
    reads it), or the reason it cannot run (a string)."""
    new = state
    for change in (READ_TABLE if read else TABLE)[kind]:
        now = getattr(state, change.field)
        if now not in change.before:
            return _why(kind, change.field, now, name, read)
        if change.field in ("activation", "grad") and not grad or change.after is None:
            continue  # forward-only: nothing is kept for a backward, no gradient exists
        new = new._replace(**{change.field: change.after})
    return new


def _why(kind: OpKind, field: str, now: Enum, name: str, read: bool) -> str:
    if read and field == "grad":
        return (f"the gradient of {name} is {now.value} already: a reader's {kind} adds to it "
                f"after its reduce")
    if field == "params":
        if kind == OpKind.UPDATE:
            return (f"{name} is being gathered while its update writes its shard: wait its "
                    f"gather first")
        if kind == OpKind.GATHER:
            return (f"{name} is already "
                    f"{'being gathered' if now is Params.GATHERING else 'gathered'}")
        if kind == OpKind.WAIT:
            return f"no gather of {name} is in flight"
        if kind == OpKind.FREE:
            return f"{name} is not gathered (never gathered, not waited, or freed already)"
        why = "its gather was not waited" if now is Params.GATHERING else "it is not gathered"
        return f"{name} is used but {why}"
    if field == "activation":
        return f"{name} has no forward to take the backward of" if now is Activation.NONE else \
            f"{name} ran its forward twice"
    if kind == OpKind.WAIT_REDUCE:
        return f"no reduce of {name} is in flight"
    if kind == OpKind.UPDATE:
        return (f"the gradient of {name} is {now.value}: an update steps a unit's parameters "
                f"once, after its wait_reduce")
    if now is Grad.NONE:
        return f"the gradient of {name} does not exist yet (its backward has not run)"
    twice = "reduced twice" if kind == OpKind.REDUCE else "reduced or accumulated twice"
    return f"the gradient of {name} is {twice}"
