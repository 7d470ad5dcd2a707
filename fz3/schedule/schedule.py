"""A schedule as data, and the check that it can run: ``Unit``, ``Schedule``, the compute
order every schedule follows, and ``walk``, which plays a schedule through
``fz3.schedule.ops``' table and stops at the first op that cannot run.

``validate`` raises that op's ``ScheduleError``; ``print(schedule)`` shows the walk as a
table (an invalid schedule too, with the first bad op marked). The table lives here, beside
the walk, so that dependencies point one way: ``fz3.schedule.planner`` builds
on this module and this module knows nothing of policies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple, Sequence

from ..compare import fingerprint
from .ops import (COMPUTE_KINDS, FORWARD_KINDS, Grad, Op, OpKind, Params, UnitState,
                  transition)
from .saveable import Keep, name_of, problem, recompute, selective
from .structure import FORWARD_ROLES, Role

REDUCES = ("reduce_scatter", "all_reduce")


class Unit(NamedTuple):
    """One unit of a schedule: layers ``layers`` of the model's part ``part``."""

    name: str  # "pre", "blocks.0", "blocks.2-3", "post", "tied:tok.weight"
    part: int  # index into the model's parts
    # the part's layers (rows of its buffers) in this unit; range(0, 1) for a part that is not
    # a stack
    layers: range
    role: Role
    reads: tuple[int, ...] = ()  # units (of shared parts) whose parameters its compute also uses


class ScheduleError(ValueError):
    """A schedule that cannot run: names the op index, the op and the reason (``index`` and
    ``op`` are None for a bad field of the schedule itself)."""

    def __init__(self, index: int | None, op: str | None, reason: str, *, end: bool = False):
        where = ("end of schedule" if end
                 else f"op {index} ({op})" if op is not None else "its fields")
        super().__init__(f"invalid schedule at {where}: {reason}")
        self.index, self.op, self.reason = index, op, reason


@dataclass(frozen=True)
class Schedule:
    ops: tuple[Op, ...]
    units: tuple[Unit, ...]
    reduce: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    grad: bool = True  # False: a forward-only schedule (fz3.apply)
    # units gathered at once, resident ones aside
    max_live_units: int = field(default=0, compare=False)
    # legacy: what a ``selective`` forward keeps here, ATen op names (its ops then carry
    # ``Keep(keep)``); None: each forward's own predicate
    keep: frozenset[str] | None = None
    # stack parts whose gradient shard is not allocated whole at their first reduce: each unit's
    # rows are reduced into a buffer of their own, joined into the part's shard after the
    # backward (one copy; less memory where activations outweigh the shard, see ``Policy``)
    join_grads: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        # Kinds given as strings become OpKind members; unknown ones stay for validate to name.
        ops = tuple(Op(OpKind(op[0]) if op[0] in _KIND_VALUES else op[0], *op[1:])
                    for op in self.ops)
        if self.keep is not None:
            if isinstance(self.keep, str) or not all(isinstance(k, str) for k in self.keep):
                raise TypeError(f"keep={self.keep!r}: pass ATen op names, as "
                                f"Op('forward', u, fz3.keep(ops=[...])) takes them")
            object.__setattr__(self, "keep", frozenset(self.keep))
            ops = tuple(op._replace(saves=Keep(self.keep)) if op.saves is selective else op
                        for op in ops)
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "join_grads", frozenset(self.join_grads))

    @functools.cached_property
    def producers(self) -> dict[int, int]:
        """Layer unit -> the pre or between unit whose extras it takes: the last one whose
        forward runs before its own (computed once per schedule)."""
        out, last = {}, -1
        for op in self.ops:
            if op.kind in FORWARD_KINDS:
                if self.units[op.unit].role in (Role.PRE, Role.BETWEEN):
                    last = op.unit
                elif self.units[op.unit].role is Role.STACK:
                    out[op.unit] = last
        return out

    @property
    def post(self) -> int:
        """The unit the loss op runs on."""
        return next(u for u, unit in enumerate(self.units) if unit.role is Role.POST)

    def recomputed(self) -> set[int]:
        """Layer units whose backward recomputes their forward (their forward's predicate is
        ``recompute``: it keeps the input)."""
        return {op.unit for op in self.ops
                if op.saves is recompute and self.units[op.unit].role is Role.STACK}

    @functools.cached_property
    def updates(self) -> bool:
        """It steps the parameters (``update`` ops: ``fz3.train_step``'s)."""
        return any(op.kind == OpKind.UPDATE for op in self.ops)

    def describe(self, op: Op) -> str:
        """``"forward blocks.0"``: the op with its unit's name."""
        kind, u = op[0], op[1]
        name = (self.units[u].name if isinstance(u, int) and 0 <= u < len(self.units)
                else f"unit {u}")
        return f"{kind} {name}"

    def fingerprint(self) -> bytes:
        units = [(u.name, u.part, u.layers.start, u.layers.stop, u.role.value, u.reads)
                 for u in self.units]
        joined = (("join_grads", sorted(self.join_grads)),) if self.join_grads else ()
        # ops by value, a predicate by its name (``saveable.name_of``): equal on every rank
        return fingerprint(([op.named() for op in self.ops], units, self.reduce, self.grad,
                            *joined))

    def __str__(self) -> str:
        walked = walk(self)
        head = (f"Schedule: {len(self.ops)} ops over {len(self.units)} units, "
                f"reduce={self.reduce}, at most {max(walked.live, default=0)} units gathered")
        for rule in dict.fromkeys(op.saves for op in self.ops if isinstance(op.saves, Keep)):
            head += f"\n{name_of(rule)} keeps the outputs of: {', '.join(sorted(rule.ops))}"
        if self.join_grads:
            head += "\ngradient shards joined after the backward: " + ", ".join(
                _span(self.units, p) for p in sorted(self.join_grads))
        rows = [head, f"{'#':>4}  {'op':<19} {'unit':<18} gathered"]
        for i, op in enumerate(self.ops):
            name = self.describe(op).split(" ", 1)[1]
            live = str(walked.live[i]) if i < len(walked.live) else "?"
            mark = f"  <- {walked.error.reason}" if walked.error and walked.error.index == i else ""
            layer = op.saves is not None and self.units[op[1]].role is Role.STACK
            kind = str(op[0]) + (f" ({name_of(op.saves)})" if layer else "")  # others: all
            rows.append(f"{i:>4}  {kind:<19} {name:<18} {live}{mark}")
        if walked.error is not None and (walked.error.index is None
                                         or walked.error.index >= len(self.ops)):
            rows.append(f"invalid: {walked.error}")
        return "\n".join(rows)


_KIND_VALUES = {k.value for k in OpKind}


def _span(units: Sequence[Unit], part: int) -> str:
    """A part's units by name: ``"blocks.0 .. blocks.3"``."""
    names = [u.name for u in units if u.part == part] or [f"part {part}"]
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def compute_order(units: Sequence[Unit], *, grad: bool) -> list[Op]:
    """The compute ops every schedule runs, in this order (``forward`` standing for either
    forward kind): forward of every unit that has one, in order; loss; backward in reverse."""
    forward = [u for u, unit in enumerate(units) if unit.role in FORWARD_ROLES]
    post = [u for u, unit in enumerate(units) if unit.role is Role.POST]
    order = [*(Op(OpKind.FORWARD, u) for u in forward), *(Op(OpKind.LOSS, u) for u in post)]
    if grad:
        order += [Op(OpKind.BACKWARD, u) for u in reversed(forward)]
    return order


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` can run; return it with ``max_live_units`` filled in.

    Raises ``ScheduleError`` naming the first bad op: a compute before its gather was
    waited, a freed unit used, compute out of order, a gradient never reduced, ...
    """
    walked = walk(schedule)
    if walked.error is not None:
        raise walked.error
    return replace(schedule, max_live_units=max(walked.live, default=0))


class Walk(NamedTuple):
    live: list[int]  # units gathered or in flight after each op, up to the first error
    error: ScheduleError | None


def walk(s: Schedule) -> Walk:
    """Play the schedule through ``fz3.schedule.ops``' tables and the compute order; stop at
    the first op that cannot run. Never raises: the error is returned (printing uses it)."""
    live: list[int] = []
    error = _field_error(s)
    if error is not None:
        return Walk(live, error)
    states = {u: UnitState() for u in range(len(s.units))}
    order = compute_order(s.units, grad=s.grad)
    done = 0
    gathered: set[int] = set()  # units not ABSENT; only an op's own unit and reads change
    for i, op in enumerate(s.ops):
        reason, done = _step(s, op, states, order, done)
        if reason is not None:
            return Walk(live, ScheduleError(i, s.describe(op), reason))
        for u in (op.unit, *s.units[op.unit].reads):
            if states[u].params is Params.ABSENT:
                gathered.discard(u)
            else:
                gathered.add(u)
        live.append(len(gathered))
    reason = _end_reason(s, states, order, done)
    return Walk(live, None if reason is None
                else ScheduleError(len(s.ops), None, reason, end=True))


def _field_error(s: Schedule) -> ScheduleError | None:
    if s.reduce not in REDUCES:
        return ScheduleError(None, None,
                             f"reduce={s.reduce!r}: use 'reduce_scatter' or 'all_reduce'")
    if not all(isinstance(u, Unit) for u in s.units):
        return ScheduleError(None, None, "units must be fz3.schedule.Unit entries "
                                         "(take them from fz3.plan(model))")
    for u in s.units:
        if len(u.layers) == 0 and u.role is not Role.STACK:
            return ScheduleError(None, None, f"unit {u.name!r} has no layers")
        bad = [r for r in u.reads
               if not 0 <= r < len(s.units) or s.units[r].role is not Role.SHARED]
        if bad:
            return ScheduleError(None, None,
                                 f"unit {u.name!r} reads {bad}, which are not shared units")
    stacks = {u.part for u in s.units if u.role is Role.STACK}
    if not set(s.join_grads) <= stacks or s.join_grads and (not s.grad or s.updates):
        return ScheduleError(None, None, f"join_grads={sorted(s.join_grads)}: only the "
                                         f"gradients of stack parts ({sorted(stacks)}) of a "
                                         f"training schedule (grad=True) without update ops "
                                         f"(each unit's is stepped and let go) can be joined")
    roles = [u.role for u in s.units]
    if roles.count(Role.POST) != 1 or (roles and roles[0] is not Role.PRE):
        return ScheduleError(None, None, f"units must start with the pre unit and hold one "
                                         f"post unit; roles are {[r.value for r in roles]}")
    return None


def _step(s: Schedule, op: Op, states: dict[int, UnitState], order: list[Op], done: int):
    """``(reason it cannot run or None, compute ops done)`` after trying ``op``."""
    kind, u = op[0], op[1]
    if not isinstance(kind, OpKind):
        return f"unknown op kind {kind!r}; kinds are {', '.join(k.value for k in OpKind)}", done
    if u not in states:
        return f"unit {u} does not exist (units: 0..{len(s.units) - 1})", done
    name = s.units[u].name
    if kind == OpKind.LOSS and s.units[u].role is not Role.POST:
        return (f"loss runs on the post unit ({s.units[s.post].name}, unit {s.post}), "
                f"not {name}"), done
    if (kind == OpKind.FORWARD) != (op.saves is not None):
        return (f"saves={op.saves!r}: a forward carries a predicate (fz3.schedule.saveable), "
                f"no other op does"), done
    if op.saves is not None and (why := problem(op.saves)) is not None:
        return why, done
    if kind == OpKind.FORWARD and op.saves is not recompute and not s.grad:
        return (f"{kind} ({name_of(op.saves)}) keeps activations for a backward; a "
                f"forward-only schedule has none", done)
    if kind in (OpKind.REDUCE, OpKind.ACCUMULATE, OpKind.UPDATE) and not s.grad:
        return "a forward-only schedule has no gradients to reduce", done
    if kind == OpKind.GATHER and states[u].grad is Grad.APPLIED:
        return (f"{name} is gathered after its update: the step would compute with parameters "
                f"it has already stepped"), done
    if kind in COMPUTE_KINDS:
        if done >= len(order) or order[done][:2] != (kind, u):
            expected = ("nothing (all compute is done)" if done >= len(order)
                        else s.describe(order[done]))
            return f"compute out of order: expected {expected}", done
        done += 1
        for r in s.units[u].reads:
            new = transition(kind, s.units[r].name, states[r], grad=s.grad, read=True)
            if isinstance(new, str):
                return new, done
            states[r] = new
    new = transition(kind, name, states[u], grad=s.grad)
    if isinstance(new, str):
        return new, done
    states[u] = new
    return None, done


def _end_reason(s: Schedule, states: dict[int, UnitState], order: list[Op],
                done: int) -> str | None:
    def names(us) -> str:
        return ", ".join(s.units[u].name for u in sorted(us))

    if done < len(order):
        return f"compute incomplete: {s.describe(order[done])} never runs"
    gathering = [u for u, st in states.items() if st.params is Params.GATHERING]
    if gathering:
        return f"gathers never waited: {names(gathering)}"
    gathered = [u for u, st in states.items() if st.params is Params.GATHERED]
    if gathered:
        return f"units never freed: {names(gathered)}"
    if s.grad:
        done_with = (Grad.APPLIED,) if s.updates else (Grad.REDUCED, Grad.CARRIED)
        missing = [u for u, st in states.items() if st.grad not in done_with]
        if missing and s.updates and all(states[u].grad is Grad.REDUCED for u in missing):
            return f"gradients never applied (no update op): {names(missing)}"
        if missing:
            waiting = all(states[u].grad is Grad.REDUCING for u in missing)
            return f"gradients {'never waited' if waiting else 'never reduced'}: {names(missing)}"
    return None
