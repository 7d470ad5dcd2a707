"""``fz3.memory_plan``: per-rank bytes of a schedule, by category, before step 1.

Persistent: the fp32 shards of params, grads and optimizer state (``optimizer_states``
copies: 2 for AdamW). Transient, op by op, from the one memory model
(``fz3.schedule.footprint``): gathered parameter buffers, unreduced flat gradients, layer
inputs kept for recompute (these three are the executor's own buffers; it reports the same
numbers through ``fz3.Recorder``) and autograd graphs kept by units whose forward saves and by
``pre`` (measured once on the given batch, ``fz3.observe.activations``; for traced layers,
their programs' residuals).

Not counted: the allocator's slack and rounding, kernels' workspaces, and whatever the
user's code holds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..schedule.footprint import footprint
from ..schedule.ops import FORWARD_KINDS, Op, OpKind
from ..schedule.saveable import Saveable, cuts, recompute
from ..schedule.schedule import Schedule
from ..schedule.structure import Role
from ..sharding.model import ShardedModel
from ..step.traced import TracedLayers
from .activations import PartActivations, activation_sizes
from .plot import memory_picture

if TYPE_CHECKING:
    from .measure import Measured

MiB = 2**20


class MemoryPlan(NamedTuple):
    # sharded fp32 parameters (trained ones), and the frozen ones' shards in their dtype
    params: int
    # sharded fp32 gradients (a part's allocated at its first reduce, returned as they are)
    grads: int
    optimizer: int  # sharded optimizer state
    gathered: int  # peak gathered parameter buffers
    unsharded_grads: int  # peak unreduced flat gradients
    saved_inputs: int  # peak layer inputs kept for recompute
    # peak autograd graphs kept (units that save, pre) and recomputed (during backward)
    graphs: int
    # persistent + the largest transient total at any op (gradient shards included as allocated)
    peak: int
    # (gathered, unsharded grads, saved inputs, graphs) after each op
    per_op: tuple[tuple[int, int, int, int], ...]
    # each op as the schedule prints it ("gather blocks.0"), and the most the step holds
    # beyond the persistent bytes during it (what ``fz3.measure_memory`` measures per op)
    labels: tuple[str, ...] = ()
    during_op: tuple[int, ...] = ()

    @property
    def persistent(self) -> int:
        """What lives between steps: the params' and optimizer state's shards."""
        return self.params + self.optimizer

    @property
    def step_peak(self) -> int:
        """The most a step holds beyond what lives between steps (its gradient shards
        included): ``fz3.measure_memory(...).step_peak`` measures the same."""
        return self.peak - self.persistent

    def plot(self, path: str, measured: "Measured | None" = None) -> None:
        """A picture of memory over the step's ops (``path``, a PNG): planned, and measured
        when given (``fz3.measure_memory``), each unit's gather, free and reduce marked.
        Needs matplotlib (``pip install 'fz3[plot]'``), else ``ImportError`` naming it."""
        memory_picture(path, self.labels, self.during_op, self.persistent,
                       measured.per_op if measured is not None else None,
                       f"planned peak {self.peak / MiB:.2f} MiB per rank"
                       + (f", measured {(self.persistent + measured.step_peak) / MiB:.2f}"
                          if measured is not None else ""))

    def __str__(self) -> str:
        rows = [("sharded params", self.params), ("sharded grads", self.grads),
                ("optimizer state", self.optimizer), ("gathered units (peak)", self.gathered),
                ("unreduced gradients (peak)", self.unsharded_grads),
                ("saved layer inputs (peak)", self.saved_inputs),
                ("autograd graphs (peak)", self.graphs),
                ("peak per rank", self.peak)]
        return "\n".join(f"{name:<28} {b / MiB:10.2f} MiB" for name, b in rows)


class ModelSizes:
    """``fz3.schedule.footprint.Sizes`` of a sharded model on one batch."""

    def __init__(self, model: ShardedModel, schedule: Schedule, act: tuple[PartActivations, ...],
                 cut: dict[Saveable, tuple[PartActivations, ...] | None] | None = None):
        """``act``: each part's sizes; ``cut``: its layers' under programs cut by each
        predicate other than save and recompute (``cut_sizes``), which a unit whose forward
        carries that predicate keeps instead."""
        self.model, self.schedule, self.act = model, schedule, act
        chosen = {op.unit: (cut or {}).get(op.saves) for op in schedule.ops
                  if op.saves is not None and cuts(op.saves)}
        # by unit: the sizes it runs with
        self.unit_act = [chosen[u][unit.part] if chosen.get(u) is not None else act[unit.part]
                         for u, unit in enumerate(schedule.units)]
        self.csize = torch.empty((), dtype=model.precision.compute).element_size()
        self.rsize = torch.empty((), dtype=model.precision.reduce).element_size()
        self.fsize = torch.empty((), dtype=model.precision.frozen).element_size()
        # The shared units whose flat gradient a backward (or the loss op) creates, as their
        # first reader in the step: the totals after the op hold that gradient, and so does
        # the working set measured on the reading part.
        self.creates: dict[Op, tuple[int, ...]] = {}
        seen: set[int] = set()
        for op in schedule.ops:
            if op.kind in (OpKind.BACKWARD, OpKind.LOSS):
                new = tuple(r for r in schedule.units[op.unit].reads if r not in seen)
                seen.update(new)
                self.creates[op] = self.creates.get(op, ()) + new

    def _elements(self, u: int) -> int:
        unit = self.schedule.units[u]
        return len(unit.layers) * self.model.parts[unit.part].layout.padded

    def gathered(self, u: int) -> int:
        unit = self.schedule.units[u]
        frozen = self.model.parts[unit.part].frozen
        # one rank gathers a copy too (``fz3.step.memory``)
        return self._elements(u) * self.csize + (len(unit.layers) * frozen.padded * self.fsize
                                                 if frozen else 0)

    def unreduced(self, u: int) -> int:
        return self._elements(u) * self.rsize

    def part_shard(self, part: int) -> int:
        p = self.model.parts[part]
        return p.rows * p.layout.shard_numel * 4

    def input_bytes(self, u: int) -> int:
        return self.act[self.schedule.units[u].part].input

    def graph_bytes(self, u: int) -> int:
        return self.unit_act[u].graph

    def during(self, op: Op) -> int:
        """What lives only inside ``op`` beyond what the totals after it hold, measured on one
        row: a forward's temporaries (beyond its graph, if it keeps one); for a backward (and
        the loss op) its graphs, kept or recomputed (``kept`` counts a kept graph only up to
        the op), and working set, or the per-parameter gradients waiting for the join into
        one flat gradient; for the loss op its input too."""
        unit = self.schedule.units[op.unit]
        act, k = self.unit_act[op.unit], len(unit.layers)
        if op.kind in FORWARD_KINDS:
            # a forward that keeps its graph (any predicate but recompute; pre's and
            # between's with gradients): its temporaries beyond the graph, which the totals
            # after it hold
            keeps = op.saves is not recompute or (self.schedule.grad
                                                  and unit.role is not Role.STACK)
            return max(act.kept - act.graph, 0) if keeps else act.forward
        if op.kind not in (OpKind.BACKWARD, OpKind.LOSS):
            return 0
        # Peak inside: the graphs (k of them) and the backward's working set, before the join;
        # or, at the join, every row's per-parameter gradients beside the flat gradient, which
        # the totals after the op already hold.
        before_join = (act.train + (k - 1) * act.graph - self.unreduced(op.unit)
                       - sum(self.unreduced(r) for r in self.creates.get(op, ())))
        if op.kind is OpKind.LOSS:  # its input, the last layer's output, which no unit keeps
            before_join += act.input
        return max(before_join, k * self.model.parts[unit.part].layout.padded * self.csize)


def memory_plan(model: ShardedModel, schedule: Schedule, batch: Any, *,
                optimizer_states: int = 2, trace: bool = True) -> MemoryPlan:
    """Predict this rank's memory for ``schedule`` on batches shaped like ``batch``.

    Within an op it also counts what lives only during it (``ModelSizes.during``), measured
    on one row of each part: temporaries, graphs, per-parameter gradients before the join.
    ``trace``: the engine the step runs (``fz3.value_and_grad``'s ``trace``, on by default):
    a layer it traces is measured by its programs, its kept "graph" being its residuals,
    known from the trace (``fz3.observe.activations.traced_sizes``; the programs are kept
    for the step); ``trace=False``, and a layer that cannot be traced, by autograd. With
    ``compile=True`` the traced programs are measured as Python (inductor's fused kernels
    allocate fewer temporaries: the plan errs high there).
    """
    traced = TracedLayers(model) if trace else None
    act = activation_sizes(model, batch, traced)
    cut = cut_sizes(model, batch, traced, [op.saves for op in schedule.ops if op.saves])
    return plan_of(model, schedule, act, cut, failed_parts(model, traced), optimizer_states)


def cut_sizes(model: ShardedModel, batch: Any, traced: TracedLayers | None,
              predicates: list[Saveable]) -> dict[Saveable, tuple[PartActivations, ...] | None]:
    """Each part's sizes under the programs each predicate other than save and recompute cuts
    (what it keeps: the residuals of those programs, ``traced_sizes``); None untraced: a unit
    carrying it runs as recompute."""
    return {p: None if traced is None else activation_sizes(model, batch, traced, saves=p)
            for p in dict.fromkeys(predicates) if cuts(p)}


def failed_parts(model: ShardedModel, traced: TracedLayers | None) -> set[int]:
    """Parts whose layers run through autograd (all, untraced)."""
    return {i for i, p in enumerate(model.parts) if traced is None or p.name in traced.failed}


def plan_of(model: ShardedModel, schedule: Schedule, act: tuple[PartActivations, ...],
            cut: dict[Saveable, tuple[PartActivations, ...] | None], failed: set[int],
            optimizer_states: int = 2) -> MemoryPlan:
    """``memory_plan`` from measured sizes (``activation_sizes``; ``cut``: ``cut_sizes``,
    ``failed``: parts whose layers run through autograd): a unit of a part that is not traced
    whose forward carries a predicate other than save runs, so is planned, as recompute."""
    ops = tuple(Op(OpKind.FORWARD, op.unit) if op.saves is not None and cuts(op.saves)
                and (cut.get(op.saves) is None or schedule.units[op.unit].part in failed)
                else op for op in schedule.ops)
    schedule = replace(schedule, ops=ops)
    sizes = ModelSizes(model, schedule, act, cut)
    per_op = footprint(schedule, sizes)
    shard_bytes = sum(p.rows * p.layout.shard_numel for p in model.parts) * 4
    frozen_bytes = sum(t.numel() * t.element_size() for t in model.frozen if t is not None)
    peak_transient = max((b.peak for b in per_op), default=0)
    persistent = frozen_bytes + (shard_bytes * (1 + optimizer_states) if schedule.grad
                                 else shard_bytes)
    col = lambda f: max((getattr(b, f) for b in per_op), default=0)  # noqa: E731
    during_graphs = max((len(schedule.units[op.unit].layers) * sizes.unit_act[op.unit].graph
                         for op in schedule.ops if op.kind in (OpKind.BACKWARD, OpKind.LOSS)),
                        default=0)
    return MemoryPlan(
        params=shard_bytes + frozen_bytes,
        # returned by the step (with update ops each unit's shard is freed by its update)
        grads=shard_bytes if schedule.grad and not schedule.updates else 0,
        optimizer=optimizer_states * shard_bytes if schedule.grad else 0,
        gathered=col("gathered"),
        unsharded_grads=col("unreduced"),
        saved_inputs=col("inputs"),
        graphs=max(col("graphs"), during_graphs),
        peak=persistent + peak_transient,
        per_op=tuple((b.gathered, b.unreduced, b.inputs, b.graphs) for b in per_op),
        labels=tuple(schedule.describe(op) for op in schedule.ops),
        during_op=tuple(b.peak for b in per_op),
    )
