"""Measuring this machine for the cost model (``fz3.cost``): run once, inside a process group.

Local rates are measured on rank 0 alone while the others wait (so ranks do not disturb
each other's timings), then shared; the interference of every rank computing at once, and
the collectives' bandwidth and in-step latency, are measured with every rank taking part.
Each number is the fastest of several repeats: this kind of machine is noisy, and noise
only ever adds time.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from ..comm.compat import ALL_GATHER, GATHER
from ..comm.groups import destroy
from ..schedule.ops import COMPUTE_KINDS
from ..schedule.planner import Policy
from ..sharding.binding import Binding
from ..sharding.layout import FlatLayout
from ..sharding.model import Params, ShardedModel
from ..step.joint import trace
from ..step.programs import below_autograd
from ..step.value_and_grad import value_and_grad
from .estimate import Cluster, Workload, estimate
from .workload import OpCounter


class Probe(NamedTuple):
    """A model of the kind to be predicted, too small for its FLOPs or bytes to matter: what
    per-op and per-unit host overheads are measured on. ``block(block_input)`` is one layer;
    ``shard(group)`` builds the sharded model on a group and ``batch`` is its input."""

    block: torch.nn.Module
    block_input: torch.Tensor
    shard: Callable[[Any], tuple[ShardedModel, Params]]
    batch: Any


def calibrate_cpu(probe: Probe, group: Any = None, repeats: int = 5,
                  network: Cluster | None = None) -> Cluster:
    """A one-node ``Cluster`` for this CPU machine: one device per rank, no overlap of
    communication with compute (the cores are all computing), the machine's core count.
    **Collective** over ``group`` (default: the world).

    ``network``: take the collectives' bandwidth and latency and the cores' interference from
    an earlier calibration (they need a group of 2 or more ranks) and measure only the local
    rates, which drift with the machine's load."""
    group = dist.group.WORLD if group is None else group  # (its methods issue collectives)
    world = dist.get_world_size(group)
    rate, mem_bw, op, call, traced = _from_rank0(group, 5, lambda: _local_rates(probe, repeats))
    bw, lat, contention = mem_bw, 1e-6, 1.0
    if network is not None:
        bw, lat, contention = network.intra_bw, network.intra_latency, network.contention
    elif world > 1:
        bw, lat = _gather_rates(group, world, repeats)
        contention = _contention(group, repeats)
    # rank 0 alone on a group of its own (every rank creates it; rank 0 frees it)
    single = dist.new_group(dist.get_process_group_ranks(group)[:1])
    (collective,) = _from_rank0(group, 1, lambda: [_collective_overhead(single, repeats)])
    cluster = Cluster(nodes=1, devices_per_node=world, flops=rate, mem_bw=mem_bw, memory=0.0,
                      intra_bw=bw, inter_bw=bw, intra_latency=lat, inter_latency=lat,
                      op_overhead=op, call_overhead=max(call, op), traced_op_overhead=traced,
                      unit_overhead=0.0,
                      collective_overhead=collective, overlap=False,
                      cores_per_node=os.cpu_count() or 1, contention=contention)
    # the executor's own time: what the step takes beyond what this cluster predicts
    (unit,) = _from_rank0(group, 1, lambda: [_unit_overhead(probe, single, cluster, repeats)])
    if dist.get_rank(group) == 0:
        dist.destroy_process_group(single)
    return dataclasses.replace(cluster, unit_overhead=unit)


def _from_rank0(group: Any, n: int, measure: Callable[[], list[float]]) -> list[float]:
    """``measure()`` (``n`` numbers) run on rank 0 of ``group`` alone while the others wait,
    then shared. **Collective**: one all-reduce over ``group``."""
    value = torch.zeros(n, dtype=torch.float64)
    if dist.get_rank(group) == 0:
        value[:] = torch.tensor(measure(), dtype=torch.float64)
    dist.all_reduce(value, group=group)
    return value.tolist()


def _time(fn: Callable[[], Any], n: int) -> float:
    """The fastest of ``n`` runs after a warm-up: on a shared machine noise only adds time,
    so the minimum is the reproducible statistic."""
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _local_rates(probe: Probe, repeats: int) -> list[float]:
    """[matmul FLOP/s, copy bytes/s, s per eager op, s per functional_call, s per op of a
    traced layer program] of one thread.

    Every sample runs ~0.1 s, the time scale of a training step, so that the minimum over
    samples sees the same machine a step sees (short samples dodge slow periods that steps
    cannot)."""
    a, b = torch.randn(512, 512), torch.randn(512, 2048)
    sa, sb = torch.randn(64, 64), torch.randn(64, 256)
    t_big = _time(lambda: [a @ b for _ in range(4)], repeats) / 4
    t_small = _time(lambda: [sa @ sb for _ in range(2000)], repeats) / 2000
    f_big, f_small = 2 * 512 * 512 * 2048, 2 * 64 * 64 * 256
    rate = (f_big - f_small) / max(t_big - t_small, 1e-9)  # t = flops / rate + launch
    x, y = torch.randn(8 << 20), torch.empty(8 << 20)
    mem_bw = 2 * x.numel() * 4 / (_time(lambda: [y.copy_(x) for _ in range(10)], repeats) / 10)
    # Per-op overhead as eager PyTorch pays it (module calls, autograd): the probe's block,
    # forward and backward, time / counted ops.
    tiny = probe.block
    xs = probe.block_input.detach().requires_grad_()

    def tiny_step():
        torch.autograd.grad(tiny(xs).sum(), [xs, *tiny.parameters()])

    cnt = OpCounter()
    with cnt.phase("tiny"):
        tiny_step()
    op = _time(lambda: [tiny_step() for _ in range(200)], repeats) / 200 / cnt.work["tiny"].ops
    block = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(6)])
    params = {"m." + k: v for k, v in block.named_parameters()}
    one, bound = torch.ones(1), _Identity(block)
    call = _time(lambda: [torch.func.functional_call(bound, params, (one,), tie_weights=False)
                          for _ in range(1000)], repeats) / 1000
    # The same block as traced programs (how fz3 runs layers by default), per op
    named = list(tiny.named_parameters())
    layout = FlatLayout.build([((n,), p) for n, p in named], 1)
    binding = Binding(lambda m, h: m(h), tiny, [layout])
    row = torch.cat([p.detach().reshape(-1) for _, p in named])
    h = probe.block_input.detach()
    programs = trace(lambda r, frozen, x: binding(layout.views(r), (x,)), [row, h], False, [])
    seed = torch.ones_like(h)

    def traced_step():  # a new gather's row each step: its parameter views made once
        r, made = row.view(-1), {}
        with below_autograd():  # as ``Layers`` runs them
            out = programs.forward(r, h, made=made)
            programs.backward([r, *out[1:], seed], made=made)

    traced = _time(lambda: [traced_step() for _ in range(200)], repeats) / 200 / \
        cnt.work["tiny"].ops
    return [rate, mem_bw, op, call, traced]


def _collective_overhead(single: Any, repeats: int) -> float:
    """Host time to issue an async all-gather and wait for it, with no network: this rank
    alone on a one-rank group."""
    src, out = torch.randn(64), torch.empty(64)
    return _time(lambda: [getattr(single, ALL_GATHER)(out, src, GATHER).wait()
                          for _ in range(500)], repeats) / 500


def _unit_overhead(probe: Probe, single: Any, cluster: Cluster, repeats: int) -> float:
    """The executor's own host time per compute op: the probe model (its math negligible) on a
    one-rank group, its step time minus what ``cluster`` predicts without it, per compute op."""
    model, params = probe.shard(single)
    step = value_and_grad(model, Policy())
    t = _time(lambda: [step(params, probe.batch) for _ in range(10)], repeats) / 10
    predicted = estimate(Workload.from_model(model, probe.batch), step.schedule, cluster,
                         shard=1).step_s
    destroy(model)
    computes = sum(op.kind in COMPUTE_KINDS for op in step.schedule.ops)
    return max(t - predicted, 0.0) / computes


def _gather_rates(group: Any, world: int, repeats: int) -> tuple[float, float]:
    """(bytes/s, s per ring step) of all-gathers: bandwidth from large ones, latency from
    small async ones issued before a little compute and waited after it, as in a step."""
    sizes, times = [], []
    for n in (1 << 18, 1 << 20):
        src, out = torch.randn(n), torch.empty(world * n)
        dist.barrier(group)
        times.append(_time(lambda: getattr(group, ALL_GATHER)(out, src, GATHER).wait(), repeats))
        sizes.append((world - 1) * n * 4)
    bw = (sizes[1] - sizes[0]) / max(times[1] - times[0], 1e-9)
    # Latency as a step sees it: a small async all-gather issued before ~1 ms of compute and
    # waited after it. On busy cores its thread waits to be scheduled, so this is mostly
    # scheduling delay; the median, not the minimum, is what a step pays on average.
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    src, out, k = torch.randn(64), torch.empty(world * 64), 10
    # The compute alone is timed the same way, beside each sample and under the same sharing
    # of cores (a minimum would catch it running alone, and charge the sharing to latency,
    # which the model already counts as slower compute).
    alone, together = [], []
    for _ in range(max(repeats, 9)):  # medians of scheduling delays need samples
        dist.barrier(group)
        t0 = time.perf_counter()
        for _ in range(k):
            a @ b
        alone.append((time.perf_counter() - t0) / k)
        dist.barrier(group)
        t0 = time.perf_counter()
        for _ in range(k):
            w = getattr(group, ALL_GATHER)(out, src, GATHER)
            a @ b
            w.wait()
        together.append((time.perf_counter() - t0) / k)
    lat = max((statistics.median(together) - statistics.median(alone)) / (world - 1), 1e-7)
    agreed = torch.tensor([bw, lat], dtype=torch.float64)
    dist.all_reduce(agreed, group=group)
    return tuple((agreed / world).tolist())  # type: ignore[return-value]


def _contention(group: Any, repeats: int) -> float:
    """Compute time with every rank computing / with rank 0 computing alone (caches, memory
    bandwidth and turbo are shared)."""
    a, b = torch.randn(512, 512), torch.randn(512, 2048)
    x, y = torch.randn(4 << 20), torch.empty(4 << 20)

    def mix():
        for _ in range(4):
            a @ b
            y.copy_(x)

    alone = _time(mix, repeats) if dist.get_rank(group) == 0 else 0.0
    dist.barrier(group)
    shared = _time(mix, repeats)
    ratio = torch.tensor([shared / alone if alone else 0.0])
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX, group=group)
    # time-sharing is counted apart
    per_core = max(1.0, dist.get_world_size(group) / (os.cpu_count() or 1))
    return max(1.0, float(ratio) / per_core)


class _Identity(torch.nn.Module):
    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        return x
