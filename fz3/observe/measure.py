"""``fz3.measure_memory``: what one real step holds, measured, in the terms ``fz3.memory_plan``
plans (``MemoryPlan.step_peak``, and per op for ``MemoryPlan.plot``), so the two compare like
with like.

It runs one step of the step function (a copy of it with a ``fz3.Recorder``, so each op's
time span is known) under ``LiveBytes`` (``fz3/observe/live_bytes.py``): every storage a op
makes, from the op that made it until it is gone, including the regrown storage of gathered
buffers kept between steps, not the parameters it only reads. On every device these are live
tensor bytes, not an allocator's figures: no allocator statistic is read or reset, so a
user's ``torch.cuda.max_memory_allocated`` stays theirs. (Allocator slack, kernels'
workspaces and temporaries inside one kernel are not seen; the plan does not count them
either.) Tested on the CPU (``tests/test_units.py``); not yet run on a GPU.
"""

from __future__ import annotations

import copy
import time
from typing import Any, NamedTuple

import torch.distributed as dist

from ..sharding.model import Params
from ..step.record import Recorder
from ..step.value_and_grad import ValueAndGrad
from .live_bytes import LiveBytes


class Measured(NamedTuple):
    """One step's live bytes beyond those alive before it."""

    step_peak: int  # the most at any moment (compare ``MemoryPlan.step_peak``)
    per_op: tuple[int, ...]  # the most during each op of the schedule, in its order
    after: int  # what is left when the step returns (its gradient shards, the loss)


class _Timeline(LiveBytes):
    """``LiveBytes`` that also notes (host time, live bytes) at every op."""

    def __init__(self) -> None:
        super().__init__(writes=True)
        self.samples: list[tuple[int, int]] = []

    def _count(self) -> None:
        super()._count()
        self.samples.append((time.perf_counter_ns(), self.now))


def measure_memory(step: ValueAndGrad, params: Params, batch: Any, **kwargs: Any) -> Measured:
    """One step of ``step`` (``fz3.value_and_grad``'s, called as ``step(params, batch,
    **kwargs)``) on this rank, measured. Run it after the step's first call (which traces the
    layers), on the same batch shapes as the plan's. **Collective**, as the step is: every rank
    calls it. The step's result is dropped; ``params`` are not changed."""
    rec = Recorder()
    measured = copy.copy(step)  # the same programs and buffers; records into ``rec``
    measured.recorder = rec
    with _Timeline() as live:
        result = measured(params, batch, **kwargs)
        # gloo keeps its last collectives' tensors until later ones complete: one more lets
        # them go, so what is left is the step's own
        if dist.is_initialized():
            dist.barrier(group=step.model.comm.group)
        live.mark()
        after = live.now
    del result
    # LiveBytes counts from zero: what was alive before the step is not in it
    per_op = []
    events = sorted(rec.events, key=lambda e: e.index)
    samples, i, last = live.samples, 0, 0
    for e in events:
        most = last
        while i < len(samples) and samples[i][0] <= e.t_end_ns:
            if samples[i][0] >= e.t_begin_ns:
                most = max(most, samples[i][1])
            last = samples[i][1]
            i += 1
        per_op.append(max(most, last))
    return Measured(live.peak, tuple(per_op), after)
