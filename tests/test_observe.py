"""Memory plan vs the executor's own accounting, and Chrome traces of a recorded step.

The plan's gathered / unreduced-gradient / saved-input bytes must equal, op by op, what the
executor reports for the buffers it owns (they are computed from the same layouts, so
equality, not 10%). The plan's autograd-graph estimate is checked within 10% against an
independent count: ``saved_tensors_hooks`` around the real forward of the step.
"""

from __future__ import annotations

import json
import os

import torch

import dist
import fz3
from fz3.models.gpt import GPTConfig
from fz3.models import shard_gpt
from fz3.schedule import saveable
from reference import batches, gpt

CFG = GPTConfig(vocab=37, seq=16, dim=36, heads=4, layers=4)
POLICIES = [fz3.Policy(), fz3.Policy(prefetch=2), fz3.Policy(activations="save"),
            fz3.Policy(activations="save_unsharded"), fz3.Policy(layers_per_unit=2, reduce="all_reduce")]


def memory_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG))
    batch = batches(CFG, world, per_rank=3)[rank]
    for policy in POLICIES:
        sched = fz3.plan(model, policy)
        plan = fz3.memory_plan(model, sched, batch)
        rec = fz3.Recorder()
        fz3.value_and_grad(model, sched, recorder=rec)(params, batch)
        owned = [(e.gathered_bytes, e.grad_bytes, e.saved_bytes) for e in rec.step_events()]
        assert owned == [p[:3] for p in plan.per_op], policy
        assert max(e.live_units for e in rec.events) <= sched.max_live_units
        assert plan.params == sum(t.numel() for t in params.parts) * 4 == plan.grads
        assert plan.optimizer == 2 * plan.params and plan.peak > plan.params * 4
        assert "peak per rank" in str(plan)

        # Graph bytes, counted independently: storages autograd saves during the forward ops,
        # excluding the gathered parameter buffers.
        measured = 0
        gen = fz3.step_through(model, params, batch, sched)
        while True:
            seen: dict[int, int] = {}

            def pack(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                f = next(gen)
            if f.phase == "loss":
                gen.close()
                break
            if f.op.saves is saveable.save or f.name == "pre":
                param_ptrs = {v.untyped_storage().data_ptr() for v in f.params.values()}
                measured += sum(b for p, b in seen.items() if p not in param_ptrs)
        kept = plan.per_op[sched.ops.index(fz3.Op("loss", sched.post)) - 1][3]  # graphs alive when forward ends
        assert abs(kept - measured) <= 0.1 * measured, (policy, kept, measured)
    return "ok"


def trace_ranks(rank, world, folder):
    model, params = shard_gpt(gpt(CFG))
    batch = batches(CFG, world)[rank]
    path = os.path.join(folder, "trace-{rank}.json")
    step_fn = None
    with fz3.trace(path, png=os.path.join(folder, "timeline-{rank}.png")) as rec:
        step_fn = fz3.value_and_grad(model, recorder=rec)
        for _ in range(2):
            step_fn(params, batch)
    return len(step_fn.schedule.ops)


def test_memory_plan_matches_accounting():
    assert dist.run(2, memory_ranks) == ["ok"] * 2


def test_chrome_trace(tmp_path):
    n_ops = dist.run(2, trace_ranks, str(tmp_path))[0]
    for rank in range(2):
        with open(tmp_path / f"trace-{rank}.json") as f:
            trace = json.load(f)
        evs = trace["traceEvents"]
        lanes = {e["args"]["name"] for e in evs if e["ph"] == "M"}
        assert {"compute", "waits", "issue", "in flight"} <= lanes
        ops = [e for e in evs if e.get("cat") == "op"]
        assert len(ops) == 2 * n_ops  # one event per op, two steps
        assert all(e["pid"] == rank and e["dur"] > 0 and "live_units" in e["args"] for e in ops)
        inflight = [e for e in evs if e.get("cat") == "inflight"]
        assert len(inflight) == 2 * sum(1 for e in ops[:n_ops] if e["name"].split()[0] in ("gather", "reduce"))
        assert all(e["args"]["bytes"] > 0 for e in inflight)
        text = (tmp_path / f"trace-{rank}.json.txt").read_text()
        assert "pre" in text and "post" in text and "blocks.3" in text and "blocked ms" in text
        assert (tmp_path / f"timeline-{rank}.png").stat().st_size > 1000


def test_trace_summary_without_events():
    assert "total" in fz3.trace_summary(fz3.Recorder())
    assert fz3.chrome_trace(fz3.Recorder()) == {"traceEvents": [], "displayTimeUnit": "ms"}
