"""What a person sees (issue 54): ``fz3.measure_memory`` against ``fz3.memory_plan``, the memory
and timeline pictures, their ``ImportError`` without matplotlib, ``fz3.Meter`` and the progress
lines of long loads and exports. Reference for memory: ``LiveBytes`` (``tests/test_units.py``
checks the plan against it the same way, within 5%)."""

from __future__ import annotations

import logging
import os
import sys

import pytest

import dist
import fz3
from fz3.comm.progress import Progress
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, fz3_said, gpt

CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=3)


def pictures_ranks(rank, world, folder):
    model, params = shard_gpt(gpt(CFG))
    batch = batches(CFG, world, per_rank=4)[rank]
    for policy in (fz3.Policy(activations="save"),):
        schedule = fz3.plan(model, policy)
        plan = fz3.memory_plan(model, schedule, batch)
        step = fz3.value_and_grad(model, schedule)
        step(params, batch)  # traces
        got = fz3.measure_memory(step, params, batch)
        # like with like: the plan's step peak within 5% of the measured one (as test_units)
        assert abs(plan.step_peak / got.step_peak - 1) <= 0.05, (policy, plan.step_peak, got)
        assert len(got.per_op) == len(plan.labels) == len(plan.during_op) == len(schedule.ops)
        assert max(got.per_op) == got.step_peak and got.after >= plan.grads, got
        assert plan.labels[0] == "gather pre" or world == 1, plan.labels[:3]
    png = os.path.join(folder, f"memory-{rank}.png")
    plan.plot(png, got)
    assert os.path.getsize(png) > 10_000
    # the timeline: the steps that traced left out (a new model's first step traces)
    fresh, fparams = shard_gpt(gpt(CFG))
    timeline = os.path.join(folder, "timeline-{rank}.png")
    with fz3.trace(os.path.join(folder, "t-{rank}.json"), png=timeline) as rec:
        step = fz3.value_and_grad(fresh, recorder=rec)
        for _ in range(3):
            step(fparams, batch)
    assert rec.tracing == {0} and os.path.getsize(timeline.format(rank=rank)) > 10_000
    # without matplotlib: an ImportError naming the extra, before any step; the rest works
    saved = sys.modules.get("matplotlib")
    sys.modules["matplotlib"] = None  # import matplotlib now raises ImportError
    try:
        with pytest.raises(ImportError, match=r"pip install 'fz3\[plot\]'"):
            plan.plot(png, got)
        with pytest.raises(ImportError, match=r"fz3\[plot\]"):
            with fz3.trace(os.path.join(folder, "u-{rank}.json"), png=timeline):
                raise AssertionError("trace(png=) without matplotlib must refuse before the block")
        fz3.value_and_grad(model)(params, batch)
    finally:
        sys.modules["matplotlib"] = saved
    return "ok"


def test_memory_measured_as_planned_and_drawn(tmp_path):
    assert dist.run(2, pictures_ranks, str(tmp_path), timeout=300) == ["ok"] * 2


def test_the_meter_times_the_first_step_apart():
    meter = fz3.Meter(flops_per_token=6e6, peak_flops=1e12)
    assert meter.rate() is None and meter.line().startswith("first step 0.00 s")
    meter.tick(100)  # the first step: timed apart, its tokens not in the rate
    assert meter.first_s is not None and meter.rate() is None and meter.mfu() is None
    assert "(traces the layers; not in the rate)" in meter.line("tokens")
    meter.tick(100)
    meter.tick(100)
    assert meter.steps == 2 and meter.items == 200
    assert meter.rate() == pytest.approx(200 / (meter.now - meter.t_steady))
    assert meter.mfu() == pytest.approx(meter.rate() * 6e6 / 1e12)
    line = meter.line("tokens")
    assert " tokens/s " in line and " ms/step  peak " in line and " MiB  MFU " in line, line
    assert meter.peak_bytes() > 2**20  # this process's peak RSS, in bytes


def test_progress_is_one_line_per_interval_without_a_terminal(monkeypatch):
    """Not a terminal (pytest's capture, a log file): INFO lines on rank 0, one per ``every``
    seconds and one at the end, never a carriage return; silent when the work is short."""
    clock = iter(range(0, 1000, 3))  # each reading 3 s after the last
    monkeypatch.setattr("fz3.comm.progress.time.perf_counter", lambda: float(next(clock)))
    with fz3_said(logging.INFO) as said:
        with Progress("fz3.export('x')", total=10 * 2**20, after=2.0, every=10.0) as p:
            for _ in range(8):
                p.advance(2**20)
    assert said == ["fz3.export('x'): 1 of 10 MiB in 3 s (0 MiB/s)",
                    "fz3.export('x'): 5 of 10 MiB in 15 s (0 MiB/s)",
                    "fz3.export('x'): done, 8 of 10 MiB in 27 s (0 MiB/s)"], said
    assert not any("\r" in line for line in said)
    monkeypatch.setattr("fz3.comm.progress.time.perf_counter", lambda: 0.0)
    with fz3_said(logging.INFO) as said:
        with Progress("fz3.save('y')") as p:
            p.advance(2**20)
    assert said == []  # short: nothing said
