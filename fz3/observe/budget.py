"""``fz3.plan(model, memory=bytes, batch=batch)``: the fastest schedule found whose planned
peak fits a memory budget, choosing per layer unit among ``save``, ``selective`` and
``recompute``, which parts that are not stacks stay gathered for the step (``resident``),
and the prefetch depth.

How it chooses:
- sizes: each part measured once on the batch (``fz3.observe.activations``, under both
  partitions), so a candidate's planned peak is a fold over its ops (``plan_of``), not a run;
- times: steps run on the model itself, at most 2 per mode (the second is timed): every unit
  recomputing, then, for each stack, its units all ``selective`` and all ``save``, and (with
  more than one rank: one rank's gather is a local copy) each other part resident. The time
  a mode saves over recompute, per layer of that stack, is what upgrading one of its layers
  saves.
  Times are the slowest rank's, so every rank chooses the same;
- gradient shards: every candidate is planned both ways (``Policy.join_grads``), and the one
  with the lower planned peak is taken (joining costs one copy of the shard a step);
- search: from recompute everywhere (prefetch 1, or 0 when only that fits), take one upgrade
  at a time (a unit from recompute to selective or save, or selective to save, a stack's
  last layers first: their activations live the shortest; or a part made resident), always
  the one that saves the most time per byte of planned peak among those that still fit,
  until none fits or saves time. A greedy search over a
  knapsack: what it returns fits, and is the fastest only when savings add up per layer.

**Collective**: the timed steps are; every rank must call it with batches of one shape.
"""

from __future__ import annotations

import logging
from logging import WARNING
import time
from dataclasses import replace
from typing import Any

import torch

from ..comm.collectives import differing_ranks
from ..comm.say import once
from ..schedule.ops import Op, OpKind
from ..schedule.saveable import Saveable, name_of, recompute, save, selective
from ..schedule.planner import Policy, plan as plan_policy
from ..schedule.schedule import Schedule, validate
from ..schedule.structure import Role
from ..sharding.model import Params, ShardedModel
from ..step.traced import TracedLayers
from ..step.value_and_grad import value_and_grad
from .activations import activation_sizes
from .memory import cut_sizes, failed_parts, plan_of

log = logging.getLogger(__name__)
MiB = 2**20
UPGRADES = {recompute: (selective, save), selective: (save,), save: ()}  # a unit's predicate


def plan(model: Any, policy: Policy | None = None, *, grad: bool = True,
         memory: int | None = None, batch: Any = None, params: Params | None = None) -> Schedule:
    """The schedule for ``policy`` (``fz3.schedule.planner.plan``); or, with ``memory``
    (bytes per rank; it excludes ``policy``), the fastest one found whose planned peak
    (``fz3.memory_plan``) fits it, on batches shaped like ``batch``, timed on ``params``
    (default: zeros shaped like the model's shards). See the module's docstring; with
    ``memory``, **collective**."""
    if memory is None:
        if batch is not None or params is not None:
            raise TypeError("fz3.plan: batch= and params= go with memory=; plan a policy "
                            "with fz3.plan(model, policy)")
        return plan_policy(model, Policy() if policy is None else policy, grad=grad)
    if policy is not None:
        raise TypeError("fz3.plan(memory=...) chooses the policy itself; pass a policy or a "
                        "memory budget, not both")
    if not isinstance(model, ShardedModel) or batch is None or not grad:
        raise TypeError("fz3.plan(memory=...) needs a sharded model and batch=, and plans a "
                        "training step (grad=True): fz3.plan(model, memory=bytes, "
                        "batch=batch)")
    return fit(model, int(memory), batch, params)


def fit(model: ShardedModel, memory: int, batch: Any, params: Params | None) -> Schedule:
    """``plan``'s search (the module's docstring)."""
    traced = TracedLayers(model)
    act, cut = activation_sizes(model, batch, traced), cut_sizes(model, batch, traced,
                                                                 [selective])
    failed = failed_parts(model, traced)

    def peak(s: Schedule) -> int:
        return plan_of(model, s, act, cut, failed).peak

    def lowest(make) -> Schedule:
        """``make(join)`` with gradient shards joined or not, whichever plans the lower peak
        (ties: not joined, which copies nothing)."""
        return min((make(join) for join in (False, True)), key=peak)

    bases = [lowest(lambda join, p=p: plan_policy(model, Policy(prefetch=p, join_grads=join)))
             for p in (1, 0)]
    fits = [b for b in bases if peak(b) <= memory]
    if not fits:
        raise ValueError(
            f"fz3.plan: memory={memory / MiB:.1f} MiB is below the smallest planned peak "
            f"{min(peak(b) for b in bases) / MiB:.1f} MiB (recompute everywhere, prefetch 0) "
            f"of this model on this batch; a smaller micro-batch, more ranks (smaller shards) "
            f"or a larger budget would fit")
    prefetch = 1 if fits[0] is bases[0] else 0

    def build(resident: frozenset[str], kinds: dict[int, Saveable]) -> Schedule:
        return lowest(lambda join: _with(plan_policy(model, Policy(
            prefetch=prefetch, join_grads=join, resident=tuple(sorted(resident)))), kinds))

    params = params if params is not None else _zeros(model)
    saves = _savings(model, build, params, batch, failed)
    chosen, resident, kinds = search(fits[0], build, peak, memory, saves)
    _say(chosen, kinds, resident, peak(chosen), memory, saves, prefetch)
    return chosen


def search(start: Schedule, build, peak, memory: int, saves: dict
           ) -> tuple[Schedule, frozenset[str], dict[int, Saveable]]:
    """The greedy search from ``start`` (recompute everywhere, nothing resident): ``build
    (resident, kinds) -> Schedule``, ``peak(schedule) -> bytes``, ``saves`` as ``_savings``
    measures them. Returns the schedule, its resident parts and its layer units' predicates."""
    resident, kinds = frozenset(), {u: recompute for u, unit in enumerate(start.units)
                                    if unit.role is Role.STACK}
    chosen = start
    while True:
        best = None  # (time saved per byte, resident, kinds, schedule)
        for trial_resident, trial_kinds, gain in _candidates(chosen, resident, kinds, saves):
            trial = build(trial_resident, trial_kinds)
            cost = peak(trial)
            if gain > 0 and cost <= memory:
                rate = gain / max(cost - peak(chosen), 1)
                if best is None or rate > best[0]:
                    best = (rate, trial_resident, trial_kinds, trial)
        if best is None:
            return chosen, resident, kinds
        _, resident, kinds, chosen = best


def _candidates(base: Schedule, resident: frozenset[str], kinds: dict[int, Saveable],
                saves: dict) -> list[tuple[frozenset, dict, float]]:
    """The next upgrades, each with the seconds it saves: per stack part and current kind,
    its last unit of that kind to each better kind; each part not yet resident, made so."""
    last: dict[tuple[int, Saveable], int] = {}
    for u, kind in kinds.items():
        last[base.units[u].part, kind] = max(u, last.get((base.units[u].part, kind), -1))
    out = []
    for (part, kind), u in last.items():
        for up in UPGRADES[kind]:
            gain = (saves[part][up] - saves[part][kind]) * len(base.units[u].layers)
            out.append((resident, {**kinds, u: up}, gain))
    for name, gain in saves["resident"].items():
        if name not in resident:
            out.append((resident | {name}, kinds, gain))
    return out


def _with(base: Schedule, kinds: dict[int, Saveable]) -> Schedule:
    ops = tuple(Op(op.kind, op.unit, kinds[op.unit]) if op.kind == OpKind.FORWARD
                and op.unit in kinds else op for op in base.ops)
    return validate(replace(base, ops=ops))


def _savings(model: ShardedModel, build, params: Params, batch: Any, failed: set[int]) -> dict:
    """Seconds each choice saves per step against recompute everywhere, from steps timed on
    the model (the slowest rank's), 0 where it saves nothing: ``saves[part][kind]`` per
    layer of a stack part, ``saves["resident"][name]`` for keeping a part that is not a
    stack gathered (only with other ranks to gather from)."""
    parts = model.parts
    stacks = [p for p, part in enumerate(parts) if part.role is Role.STACK]
    modes: list[tuple[frozenset, dict]] = [(frozenset(), {})]
    modes += [(frozenset(), {p: k}) for p in stacks
              for k in (selective, save) if not (k is selective and p in failed)]
    if model.world_size > 1:
        modes += [(frozenset({part.name}), {}) for part in parts if part.role is not Role.STACK]
    units = build(frozenset(), {}).units  # every choice has the same units
    times = [_timed(model, build(resident, {u: by_part[unit.part] for u, unit in
                                            enumerate(units) if unit.part in by_part}),
                    params, batch) for resident, by_part in modes]
    _, rows = differing_ranks(model.comm, times, model.device, "fz3.plan's timings")
    slowest = rows.max(dim=0).values.tolist()  # microseconds, per mode
    out: dict = {p: {k: 0.0 for k in UPGRADES} for p in stacks}
    out["resident"] = {}
    for (resident, by_part), t in zip(modes[1:], slowest[1:]):
        saved = max(slowest[0] - t, 0) * 1e-6
        if resident:
            out["resident"][next(iter(resident))] = saved
        else:
            (p, kind), = by_part.items()
            out[p][kind] = saved / max(parts[p].rows, 1)
    return out


def _timed(model: ShardedModel, schedule: Schedule, params: Params, batch: Any) -> int:
    """Microseconds of the second of two steps (the first traces)."""
    step = value_and_grad(model, schedule)
    for _ in range(2):
        start = time.perf_counter()
        step(params, batch)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        elapsed = time.perf_counter() - start
    return round(elapsed * 1e6)


def _zeros(model: ShardedModel) -> Params:
    return Params(tuple(torch.zeros(p.rows, p.layout.shard_numel, device=model.device)
                        if p.role is Role.STACK else
                        torch.zeros(p.layout.shard_numel, device=model.device)
                        for p in model.parts))


def _say(chosen: Schedule, kinds: dict[int, Saveable], resident: frozenset[str], peak: int,
         memory: int, saves: dict, prefetch: int) -> None:
    """One WARNING, from rank 0 (every rank chose alike: the times compared are the slowest
    rank's): what it chose, per kind, with the planned peak and time saved."""
    by_kind: dict[str, list[str]] = {}
    saved = sum(saves["resident"].get(name, 0.0) for name in resident)
    for u, kind in kinds.items():
        unit = chosen.units[u]
        by_kind.setdefault(name_of(kind), []).append(unit.name)
        saved += saves[unit.part][kind] * len(unit.layers)
    once(log, WARNING, "fz3.plan: memory=%.1f MiB: %s; resident: %s; prefetch %d; gradient "
         "shards %s; planned peak %.1f MiB, %.1f ms per step saved over recompute", memory / MiB,
             "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(by_kind.items())),
             ", ".join(sorted(resident)) or "none", prefetch,
             "joined" if chosen.join_grads else "whole", peak / MiB, saved * 1e3)
