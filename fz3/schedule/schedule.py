"""Schedules as data: the ops of one step, computed once, printed, validated, run.

A step touches units: the outer unit (``OUTER``, every parameter outside the layer stack:
embeddings, final norm, head; gathered before ``pre`` and kept until ``pre``'s backward,
as FSDP2 keeps its root) and the layer units ``0..U-1`` (``layers_per_unit`` consecutive
layers each). A schedule is a flat tuple of ``Op(kind, unit)``:

==============  ==============================================================
``gather u``    issue the all-gather of u's shards (async)
``wait u``      block until u's gather is done; u's parameters are usable
``forward u``   compute u (``pre`` for OUTER); keep only the unit's input, so
                its backward recomputes it (activation checkpointing)
``forward_save u`` compute u and keep its autograd graph (no recompute)
``loss``        ``post`` + loss, and its vjp (needs OUTER)
``backward u``  vjp of u (after recomputing it, if it ran ``forward``)
``free u``      release u's gathered parameters
``reduce u``    issue the reduce-scatter (or all-reduce) of u's flat gradient
``wait_reduce u`` block until u's gradient shard is ready
``accumulate u`` add u's flat gradient into a carried unsharded buffer instead of
                reducing it (gradient accumulation, ``defer`` policy)
==============  ==============================================================

``plan`` builds a schedule from a ``Policy``; ``validate`` checks any schedule, hand-made
ones included, before anything runs, and says which op is wrong and why.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

OUTER = -1
KINDS = ("gather", "wait", "forward", "forward_save", "loss", "backward", "free", "reduce", "wait_reduce",
         "accumulate")


class Op(NamedTuple):
    kind: str
    unit: int = OUTER

    def __str__(self) -> str:
        return self.kind if self.kind == "loss" else f"{self.kind} {unit_name(self.unit)}"


def unit_name(u: int) -> str:
    return "outer" if u == OUTER else f"layers.{u}"


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
        if self.activations not in ("recompute", "save", "save_unsharded"):
            raise ValueError(f"activations={self.activations!r}: use 'recompute', 'save' or 'save_unsharded'")
        if self.reduce not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"reduce={self.reduce!r}: use 'reduce_scatter' or 'all_reduce'")


class ScheduleError(ValueError):
    """A schedule that cannot run: names the op index, the op and the reason."""

    def __init__(self, index: int, op: Op | None, reason: str):
        where = f"op {index} ({op})" if op is not None else "end of schedule"
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

    @property
    def num_units(self) -> int:
        return -(-self.num_layers // self.layers_per_unit)

    def layer_range(self, u: int) -> range:
        k = self.layers_per_unit
        return range(u * k, min((u + 1) * k, self.num_layers))

    def fingerprint(self) -> bytes:
        text = repr((self.ops, self.num_layers, self.layers_per_unit, self.reduce, self.grad))
        return hashlib.sha256(text.encode()).digest()[:8]

    def __str__(self) -> str:
        live = _simulate(self)
        head = (f"Schedule: {len(self.ops)} ops, {self.num_layers} layers in {self.num_units} units "
                f"of {self.layers_per_unit}, reduce={self.reduce}, at most {max(live, default=0)} layer units gathered")
        rows = [head, f"{'#':>4}  {'op':<12} {'unit':<10} {'layers':<9} gathered"]
        for i, (op, n) in enumerate(zip(self.ops, live)):
            r = self.layer_range(op.unit) if op.unit != OUTER and op.kind != "loss" else None
            span = "" if r is None else f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"
            unit = "" if op.kind == "loss" else unit_name(op.unit)
            rows.append(f"{i:>4}  {op.kind:<12} {unit:<10} {span:<9} {n}")
        return "\n".join(rows)


def plan(num_layers: int, policy: Policy = Policy(), *, grad: bool = True) -> Schedule:
    """The schedule for ``policy``: prefetch ``policy.prefetch`` gathers ahead of compute
    (fetch current, prefetch next, then block, as DeepSpeed PR #1453 found), free a unit
    right after its last use, reduce each gradient as soon as it exists and wait for it
    after the next one is issued.

    ``num_layers`` may also be a ``ShardedModel`` (its ``num_layers`` is used).
    """
    num_layers = getattr(num_layers, "num_layers", num_layers)
    k = policy.layers_per_unit
    units = -(-num_layers // k)
    save = policy.activations != "recompute"
    keep = policy.activations == "save_unsharded" or not policy.reshard_after_forward
    fwd = "forward_save" if save and grad else "forward"

    # The compute steps, in order, and the unit each one needs gathered.
    steps = [Op(fwd, OUTER)] + [Op(fwd, u) for u in range(units)] + [Op("loss", OUTER)]
    if grad:
        steps += [Op("backward", u) for u in reversed(range(units))] + [Op("backward", OUTER)]

    # Residencies: spans of steps during which a unit stays gathered.
    uses: dict[int, list[int]] = {}
    for s, op in enumerate(steps):
        uses.setdefault(op.unit, []).append(s)
    spans: list[tuple[int, int, int]] = []  # (first step, last step, unit)
    for u, idx in uses.items():
        if u == OUTER or keep:
            spans.append((idx[0], idx[-1], u))
            continue
        start = idx[0]
        for a, b in zip(idx, idx[1:]):
            # Reshard between forward and backward, unless the re-gather would be issued
            # right after the free anyway (the last layer: its backward comes next).
            if b - policy.prefetch > a + 1:
                spans.append((start, a, u))
                start = b
        spans.append((start, idx[-1], u))
    spans.sort()

    ops: list[Op] = []
    issued = 0  # spans [0, issued) have had their gather issued
    last_reduce: int | None = None
    for s, step in enumerate(steps):
        while issued < len(spans) and spans[issued][0] <= s + policy.prefetch:
            ops.append(Op("gather", spans[issued][2]))
            issued += 1
        if any(first == s and u == step.unit for first, _, u in spans):
            ops.append(Op("wait", step.unit))
        ops.append(step)
        if any(last == s and u == step.unit for _, last, u in spans):
            ops.append(Op("free", step.unit))
        if step.kind == "backward":
            ops.append(Op("reduce", step.unit))
            if last_reduce is not None:
                ops.append(Op("wait_reduce", last_reduce))
            last_reduce = step.unit
    if last_reduce is not None:
        ops.append(Op("wait_reduce", last_reduce))
    return validate(Schedule(tuple(ops), num_layers, k, policy.reduce, grad))


def deferred(schedule: Schedule) -> Schedule:
    """``schedule`` with every reduce replaced by an ``accumulate``: the micro-batches before
    the last of a gradient accumulation with the ``defer`` policy (see ``fz3.accumulate``)."""
    ops = tuple(Op("accumulate", op.unit) if op.kind == "reduce" else op
                for op in schedule.ops if op.kind != "wait_reduce")
    return validate(Schedule(ops, schedule.num_layers, schedule.layers_per_unit, schedule.reduce, schedule.grad))


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` can run; return it with ``max_live_units`` filled in.

    Raises ``ScheduleError`` naming the first bad op: a compute before its gather was
    waited, a freed unit used, layers out of order, a gradient never reduced, ...
    """
    live = _simulate(schedule)
    return Schedule(schedule.ops, schedule.num_layers, schedule.layers_per_unit, schedule.reduce,
                    schedule.grad, max(live, default=0))


def _simulate(s: Schedule) -> list[int]:
    """Run the schedule's state machine; return the number of layer units gathered (or in
    flight) after each op. The outer unit is resident, gathered for the whole step."""
    units = s.num_units
    if s.reduce not in ("reduce_scatter", "all_reduce"):
        raise ScheduleError(0, None, f"reduce={s.reduce!r}: use 'reduce_scatter' or 'all_reduce'")
    valid_units = {OUTER, *range(units)}
    gathering: set[int] = set()
    gathered: set[int] = set()
    saved: set[int] = set()  # units whose forward kept a graph or an input, awaiting backward
    graph: set[int] = set()  # of those, units that kept their graph (forward_save)
    # Compute order: forward OUTER, forward 0..U-1, loss, backward U-1..0, backward OUTER.
    order = [("forward", OUTER)] + [("forward", u) for u in range(units)] + [("loss", OUTER)]
    if s.grad:
        order += [("backward", u) for u in reversed(range(units))] + [("backward", OUTER)]
    done = 0
    backed: set[int] = set()
    reducing: set[int] = set()
    reduced: set[int] = set()
    live: list[int] = []

    for i, op in enumerate(s.ops):
        kind, u = op

        def fail(reason: str) -> None:
            raise ScheduleError(i, op, reason)

        if kind not in KINDS:
            fail(f"unknown op kind {kind!r}; kinds are {', '.join(KINDS)}")
        if u not in valid_units:
            fail(f"unit {u} does not exist (units: outer=-1 and 0..{units - 1})")
        if kind == "gather":
            if u in gathering or u in gathered:
                fail(f"{unit_name(u)} is already {'being gathered' if u in gathering else 'gathered'}")
            gathering.add(u)
        elif kind == "wait":
            if u not in gathering:
                fail(f"no gather of {unit_name(u)} is in flight")
            gathering.remove(u)
            gathered.add(u)
        elif kind == "free":
            if u not in gathered:
                fail(f"{unit_name(u)} is not gathered (never gathered, not waited, or freed already)")
            gathered.remove(u)
        elif kind in ("forward", "forward_save", "loss", "backward"):
            step = ("forward" if kind == "forward_save" else kind, OUTER if kind == "loss" else u)
            if kind == "loss" and u != OUTER:
                fail("loss belongs to the outer unit; write Op('loss')")
            if done >= len(order) or order[done] != step:
                want = "nothing (all compute is done)" if done >= len(order) else _describe(order[done])
                fail(f"compute out of order: expected {want}")
            if kind == "forward_save" and not s.grad:
                fail("forward_save keeps a graph for a backward; a forward-only schedule has none")
            if u not in gathered:
                why = "its gather was not waited" if u in gathering else "it is not gathered"
                fail(f"{unit_name(u)} is used but {why}")
            done += 1
            if kind in ("forward", "forward_save") and s.grad:
                saved.add(u)
                if kind == "forward_save":
                    graph.add(u)
            if kind == "backward":
                saved.discard(u)
                graph.discard(u)
                backed.add(u)
        elif kind == "reduce":
            if not s.grad:
                fail("a forward-only schedule has no gradients to reduce")
            if u not in backed:
                fail(f"the gradient of {unit_name(u)} does not exist yet (its backward has not run)")
            if u in reducing or u in reduced:
                fail(f"the gradient of {unit_name(u)} is reduced twice")
            reducing.add(u)
        elif kind == "wait_reduce":
            if u not in reducing:
                fail(f"no reduce of {unit_name(u)} is in flight")
            reducing.remove(u)
            reduced.add(u)
        elif kind == "accumulate":
            if u not in backed:
                fail(f"the gradient of {unit_name(u)} does not exist yet (its backward has not run)")
            if u in reducing or u in reduced:
                fail(f"the gradient of {unit_name(u)} is reduced or accumulated twice")
            reduced.add(u)
        live.append(len((gathering | gathered) - {OUTER}))

    end = len(s.ops)
    if done < len(order):
        raise ScheduleError(end, None, f"compute incomplete: {_describe(order[done])} never runs")
    if gathering:
        raise ScheduleError(end, None, f"gathers never waited: {_names(gathering)}")
    if gathered:
        raise ScheduleError(end, None, f"units never freed: {_names(gathered)}")
    if s.grad and len(reduced) < units + 1:
        missing = valid_units - reduced
        what = "never waited" if missing <= reducing else "never reduced"
        raise ScheduleError(end, None, f"gradients {what}: {_names(missing)}")
    return live


def _describe(step: tuple[str, int]) -> str:
    kind, u = step
    return "loss" if kind == "loss" else f"{kind} {unit_name(u)}"


def _names(units: set[int]) -> str:
    return ", ".join(unit_name(u) for u in sorted(units))
