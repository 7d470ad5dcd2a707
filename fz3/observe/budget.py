"""``fz3.plan(model, memory=bytes, batch=batch)``: the fastest schedule found whose planned
peak fits a memory budget, choosing per layer unit among ``save``, ``selective`` and
``recompute`` (and the prefetch depth).

How it chooses:
- sizes: each part measured once on the batch (``fz3.observe.activations``, under both
  partitions), so a candidate's planned peak is a fold over its ops (``plan_of``), not a run;
- times: steps run on the model itself, at most 2 per mode (the second is timed): every unit
  recomputing, then, for each stack, its units all ``selective`` and all ``save``. The time a
  mode saves over recompute, per layer of that stack, is what upgrading one of its layers
  saves. Times are the slowest rank's, so every rank chooses the same;
- search: from recompute everywhere (prefetch 1, or 0 when only that fits), upgrade one unit
  at a time (recompute -> selective -> save, a stack's last layers first: their activations
  live the shortest), always the upgrade that saves the most time per byte of planned peak
  among those that still fit, until none fits or saves time. A greedy search over a
  knapsack: what it returns fits, and is the fastest only when savings add up per layer.

**Collective**: the timed steps are; every rank must call it with batches of one shape.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..comm.collectives import differing_ranks
from ..schedule.ops import HEAVY_OPS, Op, OpKind
from ..schedule.planner import Policy, plan as plan_policy
from ..schedule.schedule import Schedule, validate
from ..schedule.structure import Role
from ..sharding.model import Params, ShardedModel
from ..step.traced import TracedLayers
from ..step.value_and_grad import value_and_grad
from .activations import activation_sizes
from .memory import MemoryPlan, failed_parts, plan_of, selective_sizes

log = logging.getLogger(__name__)
MiB = 2**20
UPGRADES = {OpKind.FORWARD: (OpKind.FORWARD_SELECTIVE, OpKind.FORWARD_SAVE),
            OpKind.FORWARD_SELECTIVE: (OpKind.FORWARD_SAVE,), OpKind.FORWARD_SAVE: ()}


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
    act, selective = activation_sizes(model, batch, traced), selective_sizes(
        model, batch, traced, HEAVY_OPS)
    failed = failed_parts(model, traced)

    def peak(s: Schedule) -> MemoryPlan:
        return plan_of(model, s, act, selective, failed)

    bases = [plan_policy(model, Policy(prefetch=p)) for p in (1, 0)]
    fits = [b for b in bases if peak(b).peak <= memory]
    if not fits:
        least = min(peak(b).peak for b in bases)
        raise ValueError(
            f"fz3.plan: memory={memory / MiB:.1f} MiB is below the smallest planned peak "
            f"{least / MiB:.1f} MiB (recompute everywhere, prefetch 0) of this model on this "
            f"batch; a smaller micro-batch, more ranks (smaller shards) or a larger budget "
            f"would fit")
    base = fits[0]
    prefetch = 1 if base is bases[0] else 0
    params = params if params is not None else _zeros(model)
    saves = _savings(model, base, params, batch, failed)
    kinds = {op.unit: op.kind for op in base.ops if op.kind in UPGRADES
             and base.units[op.unit].role is Role.STACK}
    chosen, planned = base, peak(base)
    while True:
        best = None
        for u, kind in _candidates(base, kinds):
            gain = (saves[base.units[u].part][kind] - saves[base.units[u].part][kinds[u]]) \
                * len(base.units[u].layers)
            if gain <= 0:
                continue
            trial = _with(base, {**kinds, u: kind})
            cost = peak(trial).peak
            if cost > memory:
                continue
            rate = gain / max(cost - planned.peak, 1)
            if best is None or rate > best[0]:
                best = (rate, u, kind, trial, cost)
        if best is None:
            break
        _, u, kind, chosen, _ = best
        kinds[u] = kind
        planned = peak(chosen)
    _say(chosen, kinds, planned, memory, saves, prefetch)
    return chosen


def _candidates(base: Schedule, kinds: dict[int, OpKind]) -> list[tuple[int, OpKind]]:
    """Per stack part and current kind, its last unit of that kind, with each upgrade."""
    last: dict[tuple[int, OpKind], int] = {}
    for u, kind in kinds.items():
        last[base.units[u].part, kind] = max(u, last.get((base.units[u].part, kind), -1))
    return [(u, up) for (_, kind), u in last.items() for up in UPGRADES[kind]]


def _with(base: Schedule, kinds: dict[int, OpKind]) -> Schedule:
    ops = tuple(Op(kinds[op.unit], op.unit) if op.kind in UPGRADES and op.unit in kinds
                else op for op in base.ops)
    return validate(Schedule(ops, base.units, base.reduce, base.grad, keep=HEAVY_OPS))


def _savings(model: ShardedModel, base: Schedule, params: Params, batch: Any,
             failed: set[int]) -> dict[int, dict[OpKind, float]]:
    """Seconds a layer of each stack part saves per step under each kind, against recompute:
    from steps timed on the model (the slowest rank's), 0 where it saves nothing."""
    stacks = sorted({base.units[u].part for u in range(len(base.units))
                     if base.units[u].role is Role.STACK})
    modes = [{}] + [{p: k} for p in stacks for k in (OpKind.FORWARD_SELECTIVE,
                                                      OpKind.FORWARD_SAVE)
                    if not (k == OpKind.FORWARD_SELECTIVE and p in failed)]
    times = []
    for mode in modes:
        kinds = {u: mode[unit.part] for u, unit in enumerate(base.units) if unit.part in mode}
        step = value_and_grad(model, _with(base, kinds))
        for _ in range(2):  # the first traces
            start = time.perf_counter()
            step(params, batch)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            elapsed = time.perf_counter() - start
        times.append(round(elapsed * 1e6))
    _, rows = differing_ranks(model.comm, times, model.device, "fz3.plan's timings")
    slowest = rows.max(dim=0).values.tolist()  # microseconds, per mode
    out = {p: {OpKind.FORWARD: 0.0, OpKind.FORWARD_SELECTIVE: 0.0, OpKind.FORWARD_SAVE: 0.0}
           for p in stacks}
    for mode, t in zip(modes[1:], slowest[1:]):
        (p, kind), = mode.items()
        out[p][kind] = max(slowest[0] - t, 0) * 1e-6 / max(model.parts[p].rows, 1)
    return out


def _zeros(model: ShardedModel) -> Params:
    return Params(tuple(torch.zeros(p.rows, p.layout.shard_numel, device=model.device)
                        if p.role is Role.STACK else
                        torch.zeros(p.layout.shard_numel, device=model.device)
                        for p in model.parts))


def _say(chosen: Schedule, kinds: dict[int, OpKind], planned: MemoryPlan, memory: int,
         saves: dict[int, dict[OpKind, float]], prefetch: int) -> None:
    """One INFO line: what it chose, per kind, with the planned peak and time saved."""
    names = {"forward": "recompute", "forward_selective": "selective", "forward_save": "save"}
    by_kind: dict[str, list[str]] = {}
    saved = 0.0
    for u, kind in kinds.items():
        unit = chosen.units[u]
        by_kind.setdefault(names[kind.value], []).append(unit.name)
        saved += saves[unit.part][kind] * len(unit.layers)
    log.info("fz3.plan: memory=%.1f MiB: %s; prefetch %d; planned peak %.1f MiB, %.1f ms "
             "per step saved over recompute", memory / MiB,
             "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(by_kind.items())), prefetch,
             planned.peak / MiB, saved * 1e3)
