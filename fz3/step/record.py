"""What the executor did, op by op, recorded only when asked.

The executor calls ``start`` before and ``record`` after each op: host ``perf_counter_ns``
stamps, the number of layer units gathered, the bytes a collective moves and the bytes of
the buffers the executor owns. No string formatting and no device synchronisation: on CUDA
a timing event is recorded on the current stream per op boundary and read only when
``device_times`` is called, after the step.
"""

from __future__ import annotations

import contextlib
import time
from typing import Generator, NamedTuple

import torch

from ..schedule.ops import Op
from ..schedule.schedule import Schedule


class Event(NamedTuple):
    step: int
    index: int  # position in the schedule
    op: Op
    t_begin_ns: int  # host time the op began (issue time for collectives)
    t_end_ns: int
    live_units: int  # units gathered or in flight after the op
    nbytes: int  # gather / reduce: bytes of the full (unsharded) buffer; 0 otherwise
    gathered_bytes: int  # owned by the executor after the op: gathered parameter buffers
    grad_bytes: int  # unsharded flat gradients not yet reduced
    saved_bytes: int  # layer inputs kept for recompute


class Recorder:
    """Pass to ``fz3.value_and_grad(model, recorder=...)``; read ``events`` after the step."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._schedules: list[Schedule] = []
        self._cuda: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._device = torch.device("cpu")
        # steps that traced or compiled layers (the first, a new shape's): the summary and
        # the timeline leave them out, the Chrome trace marks them
        self.tracing: set[int] = set()

    def begin_step(self, schedule: Schedule, device: torch.device) -> None:
        self._schedules.append(schedule)
        self._device = device

    def mark_tracing(self) -> None:
        """The step being recorded traced or compiled layers."""
        self.tracing.add(len(self._schedules) - 1)

    def start(self) -> tuple[int, object]:
        ev = None
        if self._device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        return time.perf_counter_ns(), ev

    def record(self, index: int, start: tuple[int, object], live: int, nbytes: int,
               owned: tuple[int, int, int]) -> None:
        t0, ev0 = start
        t1 = time.perf_counter_ns()
        step = len(self._schedules) - 1
        self.events.append(Event(step, index, self._schedules[step].ops[index], t0, t1, live,
                                 nbytes, *owned))
        if ev0 is not None:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record()
            self._cuda.append((ev0, ev1))

    def schedule_of(self, step: int = -1) -> Schedule:
        """The schedule a recorded step ran (events name ops by unit index; it names units)."""
        return self._schedules[step]

    def step_events(self, step: int = -1) -> list[Event]:
        step = step % len(self._schedules)
        return [e for e in self.events if e.step == step]

    def device_times(self) -> list[tuple[float, float]] | None:
        """Per event, (begin, end) in ms on the device stream, relative to the first event;
        None on CPU. Synchronizes with the last event: call it after the step."""
        if not self._cuda:
            return None
        self._cuda[-1][1].synchronize()
        first = self._cuda[0][0]
        return [(first.elapsed_time(a), first.elapsed_time(b)) for a, b in self._cuda]


def observed(s, schedule: Schedule, steps: tuple, recorder, profiling: bool) -> Generator:
    """``fz3.step.executor.execute``'s loop over a lowered schedule's ``steps`` with a
    recorder (each op's time, bytes and live units) or a profiler running (each op a named
    range): it yields each step's frame, as that loop does. ``s``: the step's ``StepState``."""
    traced = s.call.traced
    # what the layers' traces and compilations were before: a step that made more is marked
    made = None if recorder is None or traced is None else traced.made
    if recorder is not None:
        recorder.begin_step(schedule, s.call.model.device)
    for index, (op, step) in enumerate(zip(schedule.ops, steps)):
        start = recorder.start() if recorder is not None else None
        with torch.profiler.record_function(f"fz3 {schedule.describe(op)}") if profiling \
                else contextlib.nullcontext():
            frame = step(s)
        if recorder is not None:
            recorder.record(index, start, len(s.params), s.moved_bytes(op), s.owned_bytes())
        if frame is not None:
            yield frame
            frame = None
    if made is not None and traced.made != made:
        recorder.mark_tracing()
