"""Schedules as data: the ops of one step, computed once, printed, validated, run.

A step touches *units*: what is gathered, computed and reduced at once. A unit is a whole
part of the model (the embedding stage ``pre``, the head ``post``, a part of tied
parameters) or ``layers_per_unit`` consecutive layers of a stack. ``Schedule.units`` lists
them in compute order; a schedule is a flat tuple of ``Op(kind, unit)`` over them, and what
each kind does is ``fz3.schedule.ops``' table.

``plan`` builds a schedule from a ``Policy``; ``validate`` checks any schedule, hand-made
ones included, before anything runs, and says which op is wrong and why; ``print`` shows it
as a table (an invalid one too, with the first bad op marked). This module is the planner;
the schedule itself, its check and its table are ``fz3.schedule.schedule``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Literal, Sequence

from .ops import Op, OpKind
from .saveable import Keep, Saveable, problem, recompute, save, selective
from .structure import PartShape, Role, check_structure, layers_only
from .schedule import REDUCES, Schedule, ScheduleError, Unit, compute_order, validate

ACTIVATIONS = ("recompute", "save", "save_unsharded", "selective")


def keep(ops: Iterable[Any]) -> Keep:
    """``Policy(activations=fz3.keep(ops=["mm", "bmm"]))``: selective recompute keeping the
    outputs of these ATen ops. Names as ``"mm"``, ``"aten.mm"`` or ``"aten.mm.default"``, or
    the ops themselves (``torch.ops.aten.mm``)."""
    names = []
    for op in ([ops] if isinstance(ops, str) else list(ops)):
        packet = getattr(op, "overloadpacket", op)  # an OpOverload's packet
        name = op if isinstance(op, str) else getattr(packet, "__name__", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"fz3.keep: {op!r} is not an op name; pass ATen names such as "
                            f"'mm' or ops such as torch.ops.aten.mm")
        parts = name.split(".")
        names.append(parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0])
    if not names:
        raise ValueError("fz3.keep(ops=[]) keeps nothing: use activations='recompute'")
    return Keep(frozenset(names))


@dataclass(frozen=True)
class Policy:
    """How to schedule a step. Every policy gives the same loss and gradients."""

    prefetch: int = 1  # gathers issued ahead of the compute that needs them; 0 = no overlap
    # False: keep units gathered from forward until their backward
    reshard_after_forward: bool = True
    # "selective": keep the heavy ops' outputs (``fz3.schedule.ops.HEAVY_OPS``), recompute the
    # rest; ``fz3.keep(ops=...)``, a rule of your own; or any predicate over a layer's forward
    # ops (``fz3.schedule.saveable``: True keeps the op's output; docs/memory.md)
    activations: Literal["recompute", "save", "save_unsharded", "selective"] | Saveable = \
        "recompute"
    layers_per_unit: int = 1  # consecutive layers of a stack gathered and reduced as one unit
    reduce: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    # parts kept gathered for the whole step (DeepSpeed's persistence)
    resident: tuple[str, ...] = ()
    # True: each stack unit's gradient rows are reduced into their own buffer and joined into
    # the part's shard after the backward (one copy of it), as FSDP2's ``.grad`` grows layer
    # by layer; False (default): the shard is allocated whole at the part's first reduce and
    # written in place. True lowers the peak where the activations alive at the start of the
    # backward outweigh a stack's gradient shard; it raises it to twice the shard where they
    # do not (``fz3.memory_plan`` says which; ``fz3.plan(memory=...)`` chooses by it)
    join_grads: bool = False

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch} must be >= 0 (0 means no overlap)")
        if self.layers_per_unit < 1:
            raise ValueError(f"layers_per_unit={self.layers_per_unit} must be >= 1")
        if not callable(self.activations) and self.activations not in ACTIVATIONS:
            raise ValueError(f"activations={self.activations!r}: use 'recompute', 'save', "
                             f"'save_unsharded', 'selective', fz3.keep(ops=[...]) or a "
                             f"predicate over a layer's forward ops")
        if callable(self.activations) and (why := problem(self.activations)) is not None:
            raise TypeError(why)
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce={self.reduce!r}: use 'reduce_scatter' or 'all_reduce'")
        if isinstance(self.resident, str):
            raise TypeError(f"resident={self.resident!r}: pass a tuple of part names, "
                            f"e.g. ('pre',)")

    @property
    def saves(self) -> Saveable:
        """``activations`` as a predicate (``fz3.schedule.saveable``)."""
        rule = self.activations
        return rule if callable(rule) else {"recompute": recompute, "save": save,
                                            "save_unsharded": save, "selective": selective}[rule]


def schedule_units(parts: Sequence[PartShape], layers_per_unit: int) -> tuple[Unit, ...]:
    """Units in compute order: each part whole, stacks split every ``layers_per_unit`` layers."""
    units: list[Unit] = []
    first: dict[int, int] = {}  # part -> its first unit
    for p, part in enumerate(parts):
        first[p] = len(units)
        if part.role is not Role.STACK:
            units.append(Unit(part.name, p, range(1), part.role))
            continue
        for a in range(0, part.rows, layers_per_unit):
            layers = range(a, min(a + layers_per_unit, part.rows))
            lo, hi = part.first + layers.start, part.first + layers.stop - 1
            units.append(Unit(f"{part.path or part.name}.{lo}" + (f"-{hi}" if hi > lo else ""),
                              p, layers, part.role))
    return tuple(u._replace(reads=tuple(first[r] for r in parts[u.part].reads)) for u in units)


def structure_of(model: Any) -> tuple[PartShape, ...]:
    """The parts of a ``ShardedModel``, a ``Workload`` (``.structure``), a number of layers, or
    a sequence of ``PartShape``."""
    if isinstance(model, int):
        return layers_only(model)
    parts = tuple(getattr(model, "structure", model))
    why = check_structure(parts)
    if why is not None:
        raise ValueError(f"cannot schedule these parts: {why}")
    return parts


def plan(model: Any, policy: Policy = Policy(), *, grad: bool = True) -> Schedule:
    """The schedule for ``policy`` on ``model`` (a ``ShardedModel``, a ``Workload``, a number
    of layers, or a sequence of ``PartShape``): prefetch ``policy.prefetch`` gathers ahead of
    compute (fetch current, prefetch next, then block, as DeepSpeed PR #1453 found), free a
    unit right after its last use, reduce each gradient as soon as it is complete and wait
    for it after the next one is issued."""
    parts = structure_of(model)
    unknown = sorted(set(policy.resident) - {p.name for p in parts})
    if unknown:
        raise ValueError(f"Policy(resident={policy.resident}): no part named {unknown}; parts are "
                         f"{[p.name for p in parts]}")
    units = schedule_units(parts, policy.layers_per_unit)
    saves = policy.saves if grad else recompute
    stays = policy.activations == "save_unsharded" or not policy.reshard_after_forward
    # save: every unit's; another predicate: a layer unit's (pre's and between's keep their
    # graph whatever their forward carries)
    steps = [Op(op.kind, op.unit, saves) if op.kind == OpKind.FORWARD and (
        saves is save or units[op.unit].role is Role.STACK) else op
        for op in compute_order(units, grad=grad)]
    resident = {u for u, unit in enumerate(units)
                if stays or parts[unit.part].name in policy.resident}
    spans = _residencies(steps, units, policy.prefetch, resident)
    # units by step: gathered from, gathered until, gradient complete after (built once: a
    # scan per step would make planning quadratic in the layers)
    waits, frees, complete = _by_step((first, u) for first, _, u in spans), \
        _by_step((last, u) for _, last, u in spans), \
        _by_step((at, u) for u, at in (_last_contributions(steps, units) if grad else {}).items())

    ops: list[Op] = []
    issued = 0  # spans [0, issued) have had their gather issued
    waiting: list[int] = []  # reduces issued by the previous compute op, waited after this one's
    for s, step in enumerate(steps):
        while issued < len(spans) and spans[issued][0] <= s + policy.prefetch:
            ops.append(Op(OpKind.GATHER, spans[issued][2]))
            issued += 1
        ops += [Op(OpKind.WAIT, u) for u in waits.get(s, ())]
        ops.append(step)
        ops += [Op(OpKind.FREE, u) for u in frees.get(s, ())]
        done = complete.get(s, [])
        if done:
            ops += [Op(OpKind.REDUCE, u) for u in done]
            ops += [Op(OpKind.WAIT_REDUCE, u) for u in waiting]
            waiting = done
    ops += [Op(OpKind.WAIT_REDUCE, u) for u in waiting]
    joined = frozenset(u.part for u in units if u.role is Role.STACK) \
        if policy.join_grads and grad else frozenset()
    return validate(Schedule(tuple(ops), units, policy.reduce, grad, join_grads=joined))


def _by_step(pairs) -> dict[int, list[int]]:
    """``(step, unit)`` pairs -> step: its units, in the pairs' order."""
    out: dict[int, list[int]] = {}
    for s, u in pairs:
        out.setdefault(s, []).append(u)
    return out


def _uses(steps: list[Op], units: Sequence[Unit]) -> dict[int, list[int]]:
    """Unit -> the compute steps that need it gathered (its own, and its readers')."""
    uses: dict[int, list[int]] = {}
    for s, op in enumerate(steps):
        for u in (op.unit, *units[op.unit].reads):
            uses.setdefault(u, []).append(s)
    return uses


def _residencies(steps: list[Op], units: Sequence[Unit], prefetch: int, resident: set[int]):
    """Spans ``(first step, last step, unit)`` during which a unit stays gathered, sorted."""
    spans = []
    for u, idx in _uses(steps, units).items():
        if u in resident:
            spans.append((idx[0], idx[-1], u))
            continue
        start = idx[0]
        for a, b in zip(idx, idx[1:]):
            # Reshard between uses, unless the re-gather would be issued right after the free
            # anyway (the last layer: its backward comes next).
            if b - prefetch > a + 1:
                spans.append((start, a, u))
                start = b
        spans.append((start, idx[-1], u))
    return sorted(spans)


def _last_contributions(steps: list[Op], units: Sequence[Unit]) -> dict[int, int]:
    """Unit -> the step after which its gradient is complete (its backward, its loss, or its
    last reader's backward)."""
    last: dict[int, int] = {}
    for s, op in enumerate(steps):
        if op.kind in (OpKind.BACKWARD, OpKind.LOSS):
            for u in (op.unit, *units[op.unit].reads):
                last[u] = s
    return last


def deferred(schedule: Schedule) -> Schedule:
    """``schedule`` with every reduce replaced by an ``accumulate``: the micro-batches before
    the last of a gradient accumulation with the ``defer`` policy (see ``fz3.accumulate``)."""
    if schedule.updates:
        raise ValueError("fz3.deferred takes a schedule without update ops (fz3.train_step's "
                         "steps the parameters; accumulation sums gradients first): pass the "
                         "schedule value_and_grad runs")
    ops = tuple(Op(OpKind.ACCUMULATE, op.unit) if op.kind == OpKind.REDUCE else op
                for op in schedule.ops if op.kind != OpKind.WAIT_REDUCE)
    return validate(replace(schedule, ops=ops))


def updating(schedule: Schedule, last: bool = False) -> Schedule:
    """``schedule`` with an ``update`` op right after each unit's ``wait_reduce`` (as is, if
    it has update ops already): ``fz3.train_step``'s, stepping each unit's parameters as soon
    as its gradient shard lands. ``last``: all of them after the schedule's last op instead,
    in the same order (an optimizer that steps nothing before the whole gradient has landed:
    ``chain(clip_by_global_norm, ...)``), so the memory plan keeps each unit's gradient to
    the end, as the step does; a hand-made schedule that updates before then is refused.
    Nothing is joined (``join_grads`` cleared: each unit's shard is a buffer of its own)."""
    if schedule.updates:
        kinds = [op.kind for op in schedule.ops]
        early = [i for i, k in enumerate(kinds) if k == OpKind.UPDATE
                 and any(k2 != OpKind.UPDATE for k2 in kinds[i:])]
        if last and early:
            raise ScheduleError(early[0], str(schedule.ops[early[0]]), "this optimizer steps "
                                "nothing before the whole gradient has landed (it scales it "
                                "first: clip_by_global_norm): put every update op after the "
                                "step's other ops, or pass a policy")
        return validate(schedule)
    updates = [Op(OpKind.UPDATE, op.unit) for op in schedule.ops
               if op.kind == OpKind.WAIT_REDUCE]
    ops = schedule.ops + tuple(updates) if last else tuple(
        o for op in schedule.ops for o in ((op, Op(OpKind.UPDATE, op.unit))
                                           if op.kind == OpKind.WAIT_REDUCE else (op,)))
    return validate(replace(schedule, ops=ops, join_grads=frozenset()))
