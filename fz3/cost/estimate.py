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

from ..schedule.schedule import OUTER, Policy, Schedule, plan
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
    unit_overhead: float = 0.0  # host s of the executor's own work per compute op (leaves, joins, RNG)
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
                f"{self.exposed_comm_s:.3f} s, {self.memory_bytes / 2**30:.1f} GiB; limited by {self.limiter}")


def estimate(work: Workload, schedule: Schedule | Policy, cluster: Cluster, *, shard: int | None = None,
             replicas: int = 1) -> Estimate:
    """Predict one training step on ``cluster``: ``shard`` ranks per sharding group (default:
    every device, plain ZeRO-3), ``replicas`` groups (hybrid sharding)."""
    shard = shard or cluster.devices // replicas
    sched = schedule if isinstance(schedule, Schedule) else plan(work.num_layers, schedule)
    ranks_per_node = min(cluster.devices_per_node, shard * replicas)
    slow = max(1.0, ranks_per_node / cluster.cores_per_node) if cluster.cores_per_node else 1.0
    if cluster.cores_per_node and ranks_per_node > 1:
        slow *= cluster.contention
    spans_nodes = shard > cluster.devices_per_node

    def compute(w: Work) -> float:
        return slow * (w.flops / cluster.flops + w.bytes / cluster.mem_bw + w.ops * cluster.op_overhead)

    def ring(nbytes: float, g: int, spans: bool, passes: int = 1) -> float:
        if g <= 1:
            return slow * nbytes / cluster.mem_bw  # a local copy
        bw, lat = (cluster.inter_bw, cluster.inter_latency) if spans else (cluster.intra_bw, cluster.intra_latency)
        # latency as calibrated with this many ranks per node (scheduling delays included);
        # bytes move at the calibrated bandwidth, shared like compute when cores are oversubscribed
        return passes * ((g - 1) * lat + slow * (g - 1) / g * nbytes / bw)

    def unit_numel(u: int) -> int:
        return work.outer_numel if u == OUTER else len(sched.layer_range(u)) * work.layer_numel

    def layers_in(u: int) -> int:
        return 1 if u == OUTER else len(sched.layer_range(u))

    t_host = t_comp = 0.0
    queue = {"gather": 0.0, "reduce": 0.0}
    end: dict[tuple[str, int], float] = {}
    recompute: set[int] = set()
    comp_total = comm_total = exposed = sent = 0.0
    for kind, u in sched.ops:
        t_host += cluster.op_overhead * 3  # the executor's own Python per op
        if not cluster.overlap:  # one thread does everything
            t_comp += cluster.op_overhead * 3
        dur = 0.0
        if kind in ("forward", "forward_save", "loss", "backward"):
            k = layers_in(u)
            if kind == "loss":
                w = work.post
            elif u == OUTER:
                w = work.pre_fwd if kind != "backward" else work.pre_bwd
            elif kind == "backward":
                w = work.layer_bwd.scale(k) + (work.layer_fwd.scale(k) if u in recompute else Work())
            else:
                w = work.layer_fwd.scale(k)
                if kind == "forward":
                    recompute.add(u)
            dur = compute(w) + slow * (cluster.unit_overhead + (0 if u == OUTER else k * cluster.call_overhead))
            t_host += w.ops * cluster.op_overhead
            t_comp = max(t_comp, t_host) + dur
            comp_total += dur
        elif kind in ("gather", "reduce"):
            t_host += cluster.collective_overhead
            if not cluster.overlap:
                t_comp += slow * cluster.collective_overhead
            nbytes = unit_numel(u) * (work.param_bytes if kind == "gather" else work.grad_bytes)
            passes = 2 if kind == "reduce" and sched.reduce == "all_reduce" else 1
            dur = ring(nbytes, shard, spans_nodes, passes)
            sent += (shard - 1) / shard * nbytes * passes
            if kind == "reduce" and replicas > 1:  # the shard, all-reduced across replicas (across nodes)
                dur += ring(nbytes / shard, replicas, True, 2)
                sent += 2 * (replicas - 1) / replicas * nbytes / shard
            comm_total += dur
            if cluster.overlap:
                start = max(t_comp, t_host, queue[kind])
                queue[kind] = end[(kind, u)] = start + dur
            else:  # the same cores do it: it delays compute
                t_comp = max(t_comp, t_host) + dur
                end[(kind, u)] = t_comp
        elif kind in ("wait", "wait_reduce"):
            ready = end.pop(("gather" if kind == "wait" else "reduce", u), 0.0)
            exposed += max(0.0, ready - t_comp)
            t_comp = max(t_comp, ready)
    shard_numel = math.ceil(work.params / shard)
    opt = slow * shard_numel * 28 / cluster.mem_bw  # fused AdamW: read p, g, m, v; write p, m, v (fp32)
    step = max(t_comp, t_host) + opt
    model_flops = work.layer_fwd.flops * 3 * work.num_layers + work.post.flops + 3 * work.pre_fwd.flops
    hw_flops = model_flops + work.layer_fwd.flops * sum(layers_in(u) for u in recompute)
    peak = cluster.peak_flops or cluster.flops
    mem = _memory(work, sched, shard)
    limiter = _limiter(comp_total, exposed, t_host, step, spans_nodes, cluster)
    return Estimate(step, comp_total, comm_total, exposed, t_host, opt, work.tokens / step, model_flops / step / 1e12,
                    hw_flops / step / 1e12, model_flops / step / peak, sent, mem, limiter)


def _limiter(comp: float, exposed: float, host: float, step: float, spans: bool, c: Cluster) -> str:
    if host > 0.5 * step and host >= comp:
        return "host overhead (Python/launch per op)"
    if exposed > 0.1 * step:
        return f"communication ({'inter-node' if spans else 'intra-node'} bandwidth)"
    return "compute"


def _memory(work: Workload, sched: Schedule, shard: int) -> float:
    """Peak bytes per device: fp32 params, grads and 2 AdamW moments sharded, plus the
    schedule's gathered units, unreduced gradients and saved activations."""
    gathered = peak_t = 0.0
    kept = 0.0
    for kind, u in sched.ops:
        n = work.outer_numel if u == OUTER else len(sched.layer_range(u)) * work.layer_numel
        if kind == "gather":
            gathered += n * work.param_bytes
        elif kind == "free":
            gathered -= n * work.param_bytes
        elif kind == "forward" and u != OUTER:
            kept += work.act_bytes
        elif kind == "forward_save" and u != OUTER:
            kept += work.layer_graph_bytes * len(sched.layer_range(u))
        elif kind == "backward" and u != OUTER:
            kept -= work.act_bytes if work.act_bytes else 0
        peak_t = max(peak_t, gathered + kept + n * work.grad_bytes * (kind == "backward"))
    return 16 * work.params / shard + peak_t
