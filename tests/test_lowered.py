"""The schedule lowered once (issue 26, item 1): ``fz3.step.executor.lower`` makes one step per
op when the step function is made, and a steady step runs those steps without reading the
schedule again.

The per-layer Python call counts of a steady step, bounded here from issue 26 to issue 52, are
a measurement now: ``benchmarks/host_calls.py`` (its docstring holds their history)."""

from __future__ import annotations

import dist
import fz3
import fz3.step.value_and_grad as vg
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, gpt


def lowered_ranks(rank, world):
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=3)
    model, params = shard_gpt(gpt(cfg))
    b = batches(cfg, world)[rank]
    made = []
    lower = vg.lower

    def counting(model, schedule):
        made.append(schedule)
        return lower(model, schedule)

    vg.lower = counting  # the test's own spy, undone below
    try:
        step = fz3.value_and_grad(model, fz3.Policy(activations="save"))
        losses = [float(step(params, b)[0]) for _ in range(3)]
    finally:
        vg.lower = lower
    program = step.program
    assert made == [step.schedule], made  # once, when the step function was made
    assert program.schedule is step.schedule
    assert len(program.steps) == len(step.schedule.ops)
    assert losses[0] == losses[1] == losses[2]
    return "ok"


def test_value_and_grad_lowers_its_schedule_once():
    assert dist.run(2, lowered_ranks, timeout=240) == ["ok"] * 2
