"""Gradient accumulation over k micro-batches, as a wrapper around the step (not a flag).

Two explicit policies, both equal to one step on the k micro-batches concatenated:

- ``reduce`` (default, memory-lean): every micro-batch runs the normal schedule, reducing
  its gradients; the shards are summed into an fp32 sharded accumulator. Extra memory: one
  gradient shard, ``4 P / N`` bytes. Communication: k reduces per unit.
- ``defer``: the first k-1 micro-batches replace each reduce with ``accumulate`` (the flat
  unsharded gradient is summed into a buffer carried across micro-batches); the last one
  adds the buffer in and reduces once. Extra memory: the whole unsharded gradient,
  ``P * bytes(reduce_dtype)`` per rank (N times the ``reduce`` policy's); communication: one
  reduce per unit, k times less.

Each micro-batch's backward is seeded with 1/k, so the result is the mean, not the sum.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import optree
import torch

from ..comm.collectives import all_reduce, wait
from .traced import TracedLayers
from .executor import execute, lower
from ..sharding.model import Params, ShardedModel
from ..schedule.planner import Policy, deferred
from ..schedule.schedule import Schedule
from .front import (check_call, check_in_sync, drain, layer_runner, prepare,
                    refuse_fixed_buffers, say_untraced_selective)


class Accumulate:
    """``f(params, micro_batches) -> (mean loss, grads)``."""

    def __init__(self, model: ShardedModel, schedule: Schedule, policy: Literal["reduce", "defer"],
                 traced: TracedLayers | None = None, check_sync: bool = True):
        if policy not in ("reduce", "defer"):
            raise ValueError(f"policy={policy!r}: use 'reduce' (sum reduced shards) or 'defer' "
                             f"(reduce once)")
        self.model, self.schedule, self.policy, self.traced = model, schedule, policy, traced
        self.deferred = deferred(schedule) if policy == "defer" else None
        # lowered once: the last micro-batch's program reduces, the others' (defer) accumulate
        self.programs = (lower(model, schedule),
                         None if self.deferred is None else lower(model, self.deferred))
        self.steps = 0  # calls so far, checked across ranks
        self.check_sync = check_sync

    def __call__(self, params: Params, micro_batches: Sequence[Any]) -> tuple[torch.Tensor, Params]:
        k = len(micro_batches)
        if k == 0:
            raise ValueError("micro_batches is empty; pass a sequence of k >= 1 batches")
        empty = check_call(self.model, params, *micro_batches, entry="fz3.accumulate's step")
        if self.check_sync:
            check_in_sync(self.model, self.steps, "fz3.accumulate's step", micro_batches, empty)
        self.steps += 1
        comm = self.model.comm
        losses, acc = [], None
        carry: dict[int, torch.Tensor] = {}
        for i, mb in enumerate(micro_batches):
            last = i == k - 1
            program = self.programs[0 if self.policy == "reduce" or last else 1]
            # Hybrid sharding: the reduce policy sums shards over micro-batches first and
            # across replicas once, below (FSDP2 keeps a partial reduce output the same way).
            result = drain(execute(self.model, program, params, mb, loss_scale=1.0 / k,
                                   carry=carry, reduce_replicas=self.policy == "defer",
                                   traced=self.traced, frames=False))
            losses.append(result.loss)
            # reduce: summed into acc, buffers this function received and owns; defer: the last
            acc = (result.grads if acc is None or self.policy == "defer"
                   else optree.tree_map(torch.Tensor.add_, acc, result.grads))
        if self.policy == "reduce" and comm.replicas > 1:
            pending = [all_reduce(comm, t, group=comm.replicate_group,
                                  label="accumulated gradient shards")
                       for t in optree.tree_leaves(acc)]
            for p in pending:
                wait(p)
        return torch.stack(losses).mean(), acc


def accumulate(model: ShardedModel, schedule: Schedule | Policy | None = None, *,
               policy: Literal["reduce", "defer"] = "reduce", compile: bool = False,
               strict: bool = False, trace: bool = True,
               check_sync: bool | None = None, fixed_buffers: object = None) -> Accumulate:
    """A step over k micro-batches: ``f(params, [batch_1, ..., batch_k]) -> (loss, grads)``;
    ``trace``/``compile``/``strict``/``check_sync`` as in ``fz3.value_and_grad`` (the check
    covers every micro-batch).
    **Collective**: the schedule is compared across ranks here; every rank must call it."""
    refuse_fixed_buffers(fixed_buffers, "fz3.accumulate")
    traced = layer_runner(model, trace=trace, compile=compile, strict=strict)
    sync = model.device.type == "cpu" if check_sync is None else check_sync
    sched = prepare(model, schedule, grad=True, entry="accumulate")
    say_untraced_selective(sched, traced)
    return Accumulate(model, sched, policy, traced, sync)
