"""What the executor did, op by op, recorded only when asked.

The executor calls ``record`` once per op with two ``perf_counter_ns`` stamps and the number
of layer units gathered or in flight after it: no string formatting, no device synchronisation.
"""

from __future__ import annotations

from typing import NamedTuple

from .schedule import Op, Schedule


class Event(NamedTuple):
    step: int
    index: int  # position in the schedule
    op: Op
    t_begin_ns: int  # host time the op began (issue time for collectives)
    t_end_ns: int
    live_units: int  # layer units gathered or in flight after the op (the outer unit is resident)


class Recorder:
    """Pass to ``fz3.value_and_grad(model, recorder=...)``; read ``events`` after the step."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._schedules: list[Schedule] = []

    def begin_step(self, schedule: Schedule) -> None:
        self._schedules.append(schedule)

    def record(self, index: int, t0: int, t1: int, live: int) -> None:
        step = len(self._schedules) - 1
        self.events.append(Event(step, index, self._schedules[step].ops[index], t0, t1, live))

    def step_events(self, step: int = -1) -> list[Event]:
        step = step % len(self._schedules)
        return [e for e in self.events if e.step == step]
