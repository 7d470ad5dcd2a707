"""Schedules as data: the ops of one step, computed once, printed, validated, run.

A step touches units: the outer unit (``OUTER``, every parameter outside the layer stack:
embeddings, final norm, head; gathered before ``pre`` and kept until ``pre``'s backward,
as FSDP2 keeps its root) and the layer units ``0..U-1`` (``layers_per_unit`` consecutive
layers each). A schedule is a flat tuple of ``Op(kind, unit)``; what each kind does is
``fz3.schedule.ops``' table.

``plan`` builds a schedule from a ``Policy``; ``validate`` checks any schedule, hand-made
ones included, before anything runs, and says which op is wrong and why; ``print`` shows it
as a table (an invalid one too, with the first bad op marked).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from ..compare import fingerprint
from .ops import COMPUTE_KINDS, OUTER, Grad, Op, OpKind, Params, UnitState, apply, unit_name

REDUCES = ("reduce_scatter", "all_reduce")
ACTIVATIONS = ("recompute", "save", "save_unsharded")


@dataclass(frozen=True)
class Policy:
    """How to schedule a step. Every policy gives the same loss and gradients."""

    prefetch: int = 1  # gathers issued ahead of the compute that needs them; 0 = no overlap
    reshard_after_forward: bool = True  # False: keep layer units gathered until their backward
    activations: Literal["recompute", "save", "save_unsharded"] = "recompute"
    layers_per_unit: int = 1  # consecutive layers gathered and reduced as one unit
    reduce: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch} must be >= 0 (0 means no overlap)")
        if self.layers_per_unit < 1:
            raise ValueError(f"layers_per_unit={self.layers_per_unit} must be >= 1")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations={self.activations!r}: use 'recompute', 'save' or "
                             f"'save_unsharded'")
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce={self.reduce!r}: use 'reduce_scatter' or 'all_reduce'")


class ScheduleError(ValueError):
    """A schedule that cannot run: names the op index, the op and the reason (``index`` and
    ``op`` are None for a bad field of the schedule itself)."""

    def __init__(self, index: int | None, op: Op | None, reason: str, *, end: bool = False):
        where = "end of schedule" if end else f"op {index} ({op})" if op is not None else "its fields"
        super().__init__(f"invalid schedule at {where}: {reason}")
        self.index, self.op, self.reason = index, op, reason


@dataclass(frozen=True)
class Schedule:
    ops: tuple[Op, ...]
    num_layers: int
    layers_per_unit: int = 1
    reduce: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    grad: bool = True  # False: a forward-only schedule (fz3.apply)
    max_live_units: int = field(default=0, compare=False)  # layer units gathered at once (validate fills it)

    def __post_init__(self) -> None:
        # Kinds given as strings become OpKind members; unknown ones stay for validate to name.
        ops = tuple(Op(OpKind(op[0]) if op[0] in _KIND_VALUES else op[0], *op[1:]) for op in self.ops)
        object.__setattr__(self, "ops", ops)

    @property
    def num_units(self) -> int:
        return -(-self.num_layers // self.layers_per_unit) if self.layers_per_unit >= 1 else 0

    def layer_range(self, u: int) -> range:
        k = self.layers_per_unit
        return range(u * k, min((u + 1) * k, self.num_layers))

    def unit_elements(self, u: int, outer: int, layer: int) -> int:
        """Elements of unit ``u`` given the outer unit's and one layer's element counts."""
        return outer if u == OUTER else len(self.layer_range(u)) * layer

    def fingerprint(self) -> bytes:
        return fingerprint((self.ops, self.num_layers, self.layers_per_unit, self.reduce, self.grad))

    def __str__(self) -> str:
        walked = walk(self)
        most = max(walked.live, default=0)
        head = (f"Schedule: {len(self.ops)} ops, {self.num_layers} layers in {self.num_units} units "
                f"of {self.layers_per_unit}, reduce={self.reduce}, at most {most} layer units gathered")
        rows = [head, f"{'#':>4}  {'op':<12} {'unit':<10} {'layers':<9} gathered"]
        for i, op in enumerate(self.ops):
            kind, u = op[0], op[1]
            r = self.layer_range(u) if isinstance(u, int) and u >= 0 and kind != OpKind.LOSS else None
            span = "" if not r else f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"
            unit = "" if kind == OpKind.LOSS else unit_name(u)
            live = str(walked.live[i]) if i < len(walked.live) else "?"
            mark = f"  <- {walked.error.reason}" if walked.error and walked.error.index == i else ""
            rows.append(f"{i:>4}  {str(kind):<12} {unit:<10} {span:<9} {live}{mark}")
        if walked.error is not None and (walked.error.index is None or walked.error.index >= len(self.ops)):
            rows.append(f"invalid: {walked.error}")
        return "\n".join(rows)


_KIND_VALUES = {k.value for k in OpKind}


def compute_order(num_units: int, *, grad: bool) -> list[Op]:
    """The compute ops every schedule runs, in this order (``forward`` standing for either
    forward kind): forward outer, forward 0..U-1, loss, backward U-1..0, backward outer."""
    order = [Op(OpKind.FORWARD, OUTER), *(Op(OpKind.FORWARD, u) for u in range(num_units)),
             Op(OpKind.LOSS, OUTER)]
    if grad:
        order += [*(Op(OpKind.BACKWARD, u) for u in reversed(range(num_units))), Op(OpKind.BACKWARD, OUTER)]
    return order


def plan(num_layers, policy: Policy = Policy(), *, grad: bool = True) -> Schedule:
    """The schedule for ``policy``: prefetch ``policy.prefetch`` gathers ahead of compute
    (fetch current, prefetch next, then block, as DeepSpeed PR #1453 found), free a unit
    right after its last use, reduce each gradient as soon as it exists and wait for it
    after the next one is issued.

    ``num_layers`` may also be a ``ShardedModel`` (its ``num_layers`` is used).
    """
    num_layers = getattr(num_layers, "num_layers", num_layers)
    k = policy.layers_per_unit
    save = policy.activations != "recompute"
    keep = policy.activations == "save_unsharded" or not policy.reshard_after_forward
    fwd = OpKind.FORWARD_SAVE if save and grad else OpKind.FORWARD
    steps = [Op(fwd, op.unit) if op.kind == OpKind.FORWARD else op
             for op in compute_order(-(-num_layers // k), grad=grad)]
    spans = _residencies(steps, policy.prefetch, keep)

    ops: list[Op] = []
    issued = 0  # spans [0, issued) have had their gather issued
    last_reduce: int | None = None
    for s, step in enumerate(steps):
        while issued < len(spans) and spans[issued][0] <= s + policy.prefetch:
            ops.append(Op(OpKind.GATHER, spans[issued][2]))
            issued += 1
        if any(first == s and u == step.unit for first, _, u in spans):
            ops.append(Op(OpKind.WAIT, step.unit))
        ops.append(step)
        if any(last == s and u == step.unit for _, last, u in spans):
            ops.append(Op(OpKind.FREE, step.unit))
        if step.kind == OpKind.BACKWARD:
            ops.append(Op(OpKind.REDUCE, step.unit))
            if last_reduce is not None:
                ops.append(Op(OpKind.WAIT_REDUCE, last_reduce))
            last_reduce = step.unit
    if last_reduce is not None:
        ops.append(Op(OpKind.WAIT_REDUCE, last_reduce))
    return validate(Schedule(tuple(ops), num_layers, k, policy.reduce, grad))


def _residencies(steps: list[Op], prefetch: int, keep: bool) -> list[tuple[int, int, int]]:
    """Spans ``(first step, last step, unit)`` during which a unit stays gathered, sorted."""
    uses: dict[int, list[int]] = {}
    for s, op in enumerate(steps):
        uses.setdefault(op.unit, []).append(s)
    spans = []
    for u, idx in uses.items():
        if u == OUTER or keep:
            spans.append((idx[0], idx[-1], u))
            continue
        start = idx[0]
        for a, b in zip(idx, idx[1:]):
            # Reshard between forward and backward, unless the re-gather would be issued
            # right after the free anyway (the last layer: its backward comes next).
            if b - prefetch > a + 1:
                spans.append((start, a, u))
                start = b
        spans.append((start, idx[-1], u))
    return sorted(spans)


def deferred(schedule: Schedule) -> Schedule:
    """``schedule`` with every reduce replaced by an ``accumulate``: the micro-batches before
    the last of a gradient accumulation with the ``defer`` policy (see ``fz3.accumulate``)."""
    ops = tuple(Op(OpKind.ACCUMULATE, op.unit) if op.kind == OpKind.REDUCE else op
                for op in schedule.ops if op.kind != OpKind.WAIT_REDUCE)
    return validate(Schedule(ops, schedule.num_layers, schedule.layers_per_unit, schedule.reduce,
                             schedule.grad))


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` can run; return it with ``max_live_units`` filled in.

    Raises ``ScheduleError`` naming the first bad op: a compute before its gather was
    waited, a freed unit used, layers out of order, a gradient never reduced, ...
    """
    walked = walk(schedule)
    if walked.error is not None:
        raise walked.error
    return Schedule(schedule.ops, schedule.num_layers, schedule.layers_per_unit, schedule.reduce,
                    schedule.grad, max(walked.live, default=0))


class Walk(NamedTuple):
    live: list[int]  # layer units gathered or in flight after each op, up to the first error
    error: ScheduleError | None
    states: dict[int, UnitState]  # every unit's state after the last op walked


def walk(s: Schedule) -> Walk:
    """Play the schedule through ``fz3.schedule.ops.TABLE`` and the compute order; stop at
    the first op that cannot run. Never raises: the error is returned (printing uses it)."""
    live: list[int] = []
    error = _field_error(s)
    if error is not None:
        return Walk(live, error, {})
    units = s.num_units
    states = {u: UnitState() for u in (OUTER, *range(units))}
    order = compute_order(units, grad=s.grad)
    done = 0
    for i, op in enumerate(s.ops):
        reason, done = _step(s, op, states, order, done)
        if reason is not None:
            return Walk(live, ScheduleError(i, op, reason), states)
        live.append(sum(st.params is not Params.ABSENT for u, st in states.items() if u != OUTER))
    end = len(s.ops)
    reason = _end_reason(s, states, order, done)
    return Walk(live, None if reason is None else ScheduleError(end, None, reason, end=True), states)


def _field_error(s: Schedule) -> ScheduleError | None:
    if s.reduce not in REDUCES:
        return ScheduleError(None, None, f"reduce={s.reduce!r}: use 'reduce_scatter' or 'all_reduce'")
    if s.layers_per_unit < 1:
        return ScheduleError(None, None, f"layers_per_unit={s.layers_per_unit} must be >= 1")
    if s.num_layers < 0:
        return ScheduleError(None, None, f"num_layers={s.num_layers} must be >= 0")
    return None


def _step(s: Schedule, op: Op, states: dict[int, UnitState], order: list[Op], done: int):
    """``(reason it cannot run or None, compute ops done)`` after trying ``op``."""
    kind, u = op[0], op[1]
    if not isinstance(kind, OpKind):
        return f"unknown op kind {kind!r}; kinds are {', '.join(k.value for k in OpKind)}", done
    if u not in states:
        return f"unit {u} does not exist (units: outer=-1 and 0..{s.num_units - 1})", done
    if kind == OpKind.LOSS and u != OUTER:
        return "loss belongs to the outer unit; write Op('loss')", done
    if kind == OpKind.FORWARD_SAVE and not s.grad:
        return "forward_save keeps a graph for a backward; a forward-only schedule has none", done
    if kind in (OpKind.REDUCE, OpKind.ACCUMULATE) and not s.grad:
        return "a forward-only schedule has no gradients to reduce", done
    if kind in COMPUTE_KINDS:
        want = Op(OpKind.FORWARD if kind == OpKind.FORWARD_SAVE else kind, u)
        if done >= len(order) or order[done] != want:
            expected = "nothing (all compute is done)" if done >= len(order) else str(order[done])
            return f"compute out of order: expected {expected}", done
        done += 1
    new = apply(kind, u, states[u], grad=s.grad)
    if isinstance(new, str):
        return new, done
    states[u] = new
    return None, done


def _end_reason(s: Schedule, states: dict[int, UnitState], order: list[Op], done: int) -> str | None:
    def names(us) -> str:
        return ", ".join(unit_name(u) for u in sorted(us))

    if done < len(order):
        return f"compute incomplete: {order[done]} never runs"
    gathering = [u for u, st in states.items() if st.params is Params.GATHERING]
    if gathering:
        return f"gathers never waited: {names(gathering)}"
    gathered = [u for u, st in states.items() if st.params is Params.GATHERED]
    if gathered:
        return f"units never freed: {names(gathered)}"
    if s.grad:
        missing = [u for u, st in states.items() if st.grad not in (Grad.REDUCED, Grad.CARRIED)]
        if missing:
            waiting = all(states[u].grad is Grad.REDUCING for u in missing)
            return f"gradients {'never waited' if waiting else 'never reduced'}: {names(missing)}"
    return None
