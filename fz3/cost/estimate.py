"""A cost model: what a schedule should take on a cluster this machine cannot hold.

``estimate(workload, schedule, cluster)`` plays the schedule's ops through a small
discrete-event simulation: a compute stream, one stream per collective kind (all-gathers and
reduce-scatters use separate communicators) and the host issuing ops. Each op's duration
comes from counts, not guesses:

- compute: FLOPs, bytes touched and ATen ops of ``pre``, one layer and ``post``
  (``fz3/workload.py``); time = flops / rate + bytes / memory bandwidth + ops x per-op
  overhead (+ one call overhead per layer for ``functional_call``).
- communication: a ring collective over g ranks moves (g-1)/g of the full buffer through
  each rank: time = (g-1) x latency + (g-1)/g x bytes / bandwidth, with the intra-node
  numbers when the group fits in a node and the inter-node ones when it spans nodes.
- the optimizer: elementwise over the local shard, memory-bound.

A cluster that cannot overlap communication with compute (``overlap=False``: a CPU whose
cores all compute) adds each collective to the compute stream; ranks beyond a node's cores
share them (time x ranks / cores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..schedule.footprint import footprint
from ..schedule.ops import COMPLETES, Category, Op, OpKind
from ..schedule.structure import Role
from ..schedule.planner import Policy, plan
from ..schedule.schedule import Schedule
from .workload import Work, Workload


@dataclass(frozen=True)
class Cluster:
    """Per-device rates and the network. Bandwidths are what one device can push (bus
    bandwidth, as nccl-tests reports it); ``inter_bw`` is the node's network bandwidth that a
    ring crossing nodes is limited by."""

    nodes: int
    devices_per_node: int
    flops: float  # sustained FLOP/s per device for this kind of work
    mem_bw: float  # bytes/s of device memory
    memory: float  # bytes per device
    intra_bw: float  # bytes/s, inside a node
    inter_bw: float  # bytes/s, across nodes
    intra_latency: float = 5e-6  # s per ring step
    inter_latency: float = 20e-6
    op_overhead: float = 5e-6  # host s per ATen op (launch / dispatch)
    call_overhead: float = 30e-6  # host s per layer call (functional_call)
    # host s per ATen op of a traced layer program (fz3's default, ``fz3.step.joint``): no
    # autograd engine, no functional_call. None: layers cost as eager (op_overhead, calls)
    traced_op_overhead: float | None = None
    # host s of the executor's own work per compute op (leaves, joins, RNG)
    unit_overhead: float = 0.0
    collective_overhead: float = 0.0  # host s to issue and wait one async collective, network aside
    overlap: bool = True  # communication runs beside compute (GPUs); False: it takes the same cores
    cores_per_node: int = 0  # CPU: ranks beyond this share cores (0: one device per rank)
    peak_flops: float = 0.0  # datasheet peak, for MFU (0: use ``flops``)
    contention: float = 1.0  # CPU: compute slowdown when every core of a node computes at once

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


class Estimate(NamedTuple):
    step_s: float
    compute_s: float  # compute stream busy time
    comm_s: float  # sum of collective durations
    exposed_comm_s: float  # time the compute stream waited for communication
    host_s: float  # host time issuing ops
    optimizer_s: float
    tokens_per_s: float  # per device
    model_tflops: float  # per device: 6N-style model FLOPs (no recompute) / step
    hardware_tflops: float  # per device, recompute included
    mfu: float
    comm_bytes: float  # bytes each device sends per step
    memory_bytes: float  # predicted peak per device
    limiter: str

    def row(self) -> str:
        return (f"{self.step_s:.3f} s/step, {self.model_tflops:.1f} model TFLOPS/device "
                f"({self.hardware_tflops:.1f} with recompute), MFU {self.mfu:.2f}, exposed comm "
                f"{self.exposed_comm_s:.3f} s, {self.memory_bytes / 2**30:.1f} GiB; "
                f"limited by {self.limiter}")


def estimate(work: Workload, schedule: Schedule | Policy, cluster: Cluster, *,
             shard: int | None = None, replicas: int = 1) -> Estimate:
    """Predict one training step on ``cluster``: ``shard`` ranks per sharding group (default:
    every device, plain ZeRO-3), ``replicas`` groups (hybrid sharding)."""
    shard = shard or cluster.devices // replicas
    sched = schedule if isinstance(schedule, Schedule) else plan(work, schedule)
    t = _Timeline(work, sched, cluster, shard, replicas)
    for op in sched.ops:
        t.run(op)
    # fused AdamW: read p, g, m, v; write p, m, v
    opt = t.slow * math.ceil(work.params / shard) * 28 / cluster.mem_bw
    step = max(t.t_comp, t.t_host) + opt
    model_flops = sum(p.rows * (p.fwd.flops + p.bwd.flops) for p in work.parts)
    hw_flops = model_flops + sum(work.parts[sched.units[u].part].fwd.flops * t.layers_in(u)
                                 for u in t.recompute)
    peak = cluster.peak_flops or cluster.flops
    limiter = _limiter(t.comp_total, t.exposed, t.t_host, step, t.spans_nodes)
    return Estimate(step, t.comp_total, t.comm_total, t.exposed, t.t_host, opt, work.tokens / step,
                    model_flops / step / 1e12, hw_flops / step / 1e12, model_flops / step / peak,
                    t.sent, memory_bytes(work, sched, shard), limiter)


class _Timeline:
    """A discrete-event simulation of one step: the host issuing ops, a compute stream, one
    stream per collective kind. Each op advances it by its ``Category``."""

    def __init__(self, work: Workload, sched: Schedule, cluster: Cluster, shard: int,
                 replicas: int):
        self.work, self.sched, self.c = work, sched, cluster
        self.shard, self.replicas = shard, replicas
        ranks_per_node = min(cluster.devices_per_node, shard * replicas)
        slow = max(1.0, ranks_per_node / cluster.cores_per_node) if cluster.cores_per_node else 1.0
        if cluster.cores_per_node and ranks_per_node > 1:
            slow *= cluster.contention
        self.slow, self.spans_nodes = slow, shard > cluster.devices_per_node
        self.t_host = self.t_comp = 0.0
        self.queue = {OpKind.GATHER: 0.0, OpKind.REDUCE: 0.0}  # when each collective stream is free
        self.end: dict[tuple[OpKind, int], float] = {}
        # a forward keeping by any predicate but recompute is costed as save (docs/memory.md)
        self.recompute = sched.recomputed()
        self.comp_total = self.comm_total = self.exposed = self.sent = 0.0

    def layers_in(self, u: int) -> int:
        return len(self.sched.units[u].layers)

    def run(self, op: Op) -> None:
        c = self.c
        self.t_host += c.op_overhead * 3  # the executor's own Python per op
        if not c.overlap:  # one thread does everything
            self.t_comp += c.op_overhead * 3
        category = op.kind.category
        if category is Category.COMPUTE:
            self._compute(op)
        elif category is Category.ISSUE:
            self._issue(op)
        elif category is Category.WAIT:
            ready = self.end.pop((COMPLETES[op.kind], op.unit), 0.0)
            self.exposed += max(0.0, ready - self.t_comp)
            self.t_comp = max(self.t_comp, ready)

    def _compute(self, op: Op) -> None:
        c, u, k = self.c, op.unit, self.layers_in(op.unit)
        unit = self.sched.units[u]
        part = self.work.parts[unit.part]
        stack = unit.role is Role.STACK
        if op.kind == OpKind.BACKWARD:
            w = part.bwd.scale(k) + (part.fwd.scale(k) if u in self.recompute else Work())
        else:
            w = part.fwd.scale(k)
        traced = stack and c.traced_op_overhead is not None
        per_op = c.traced_op_overhead if traced else c.op_overhead
        dur = self.slow * (w.flops / c.flops + w.bytes / c.mem_bw + w.ops * per_op)
        dur += self.slow * (c.unit_overhead + (k * c.call_overhead if stack and not traced else 0))
        self.t_host += w.ops * per_op
        self.t_comp = max(self.t_comp, self.t_host) + dur
        self.comp_total += dur

    def _issue(self, op: Op) -> None:
        c, shard, gather = self.c, self.shard, op.kind == OpKind.GATHER
        self.t_host += c.collective_overhead
        if not c.overlap:
            self.t_comp += self.slow * c.collective_overhead
        unit = self.sched.units[op.unit]
        elements = len(unit.layers) * self.work.parts[unit.part].numel
        nbytes = elements * (self.work.param_bytes if gather else self.work.grad_bytes)
        passes = 2 if not gather and self.sched.reduce == "all_reduce" else 1
        # one rank gathers fp32 shards in place (fz3.comm): no copy
        in_place = gather and shard == 1 and self.work.param_bytes == 4
        dur = 0.0 if in_place else self._ring(nbytes, shard, self.spans_nodes, passes)
        self.sent += (shard - 1) / shard * nbytes * passes
        # the shard, all-reduced across replicas (across nodes)
        if not gather and self.replicas > 1:
            dur += self._ring(nbytes / shard, self.replicas, True, 2)
            self.sent += 2 * (self.replicas - 1) / self.replicas * nbytes / shard
        self.comm_total += dur
        if c.overlap:
            start = max(self.t_comp, self.t_host, self.queue[op.kind])
            self.queue[op.kind] = self.end[(op.kind, op.unit)] = start + dur
        else:  # the same cores do it: it delays compute
            self.t_comp = max(self.t_comp, self.t_host) + dur
            self.end[(op.kind, op.unit)] = self.t_comp

    def _ring(self, nbytes: float, g: int, spans: bool, passes: int = 1) -> float:
        """A ring collective over ``g`` ranks moves (g-1)/g of the buffer through each rank."""
        c = self.c
        if g <= 1:
            return self.slow * nbytes / c.mem_bw  # a local copy
        bw, lat = (c.inter_bw, c.inter_latency) if spans else (c.intra_bw, c.intra_latency)
        # latency as calibrated with this many ranks per node (scheduling delays included);
        # bytes move at the calibrated bandwidth, shared like compute when cores are oversubscribed
        return passes * ((g - 1) * lat + self.slow * (g - 1) / g * nbytes / bw)


def _limiter(comp: float, exposed: float, host: float, step: float, spans: bool) -> str:
    if host > 0.5 * step and host >= comp:
        return "host overhead (Python/launch per op)"
    if exposed > 0.1 * step:
        return f"communication ({'inter-node' if spans else 'intra-node'} bandwidth)"
    return "compute"


class WorkloadSizes:
    """``fz3.schedule.footprint.Sizes`` of a ``Workload`` on ``shard`` ranks: the memory plan's
    model, with counted sizes instead of measured ones."""

    def __init__(self, work: Workload, sched: Schedule, shard: int):
        self.work, self.sched, self.ranks = work, sched, shard
        self.recomputes = sched.recomputed()  # any other predicate: counted as save

    def _elements(self, u: int) -> int:
        unit = self.sched.units[u]
        return len(unit.layers) * self.work.parts[unit.part].numel

    def gathered(self, u: int) -> int:
        if self.ranks == 1 and self.work.param_bytes == 4:
            return 0  # one rank gathers fp32 shards in place (fz3.comm): nothing is allocated
        return self._elements(u) * self.work.param_bytes

    def unreduced(self, u: int) -> int:
        return self._elements(u) * self.work.grad_bytes

    def part_shard(self, part: int) -> int:
        p = self.work.parts[part]
        return p.rows * math.ceil(p.numel / self.ranks) * 4

    def input_bytes(self, u: int) -> int:
        return int(self.work.parts[self.sched.units[u].part].input_bytes)

    def graph_bytes(self, u: int) -> int:
        return int(self.work.parts[self.sched.units[u].part].graph_bytes)

    def during(self, op: Op) -> int:
        unit = self.sched.units[op.unit]
        part = self.work.parts[unit.part]
        reads = sum(self.gathered(v) for v in (op.unit, *unit.reads))
        if op.kind == OpKind.LOSS:
            return int(part.graph_bytes) + reads
        if op.kind != OpKind.BACKWARD:
            return 0
        k = len(unit.layers) if op.unit in self.recomputes else 0
        return int(part.graph_bytes * k) + reads


def memory_bytes(work: Workload, sched: Schedule, shard: int, optimizer_states: int = 2) -> float:
    """Peak bytes per device: fp32 params and optimizer state sharded, plus the schedule's
    transient bytes op by op (``fz3.schedule.footprint``, the memory plan's own fold), which
    include the gradient shards as the reduces write them."""
    per_op = footprint(sched, WorkloadSizes(work, sched, shard))
    return (4 * (1 + optimizer_states) * work.params / shard
            + max((b.peak for b in per_op), default=0))
