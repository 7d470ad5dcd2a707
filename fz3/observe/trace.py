"""Traces: a recorded step as Chrome-trace JSON (Perfetto, chrome://tracing), a per-unit text
summary and an optional PNG timeline (``fz3.observe.plot``).

    with fz3.trace("step-{rank}.json") as rec:
        fz3.value_and_grad(model, recorder=rec)(params, batch)

Lanes: ``compute`` (forward / loss / backward), ``waits`` (time blocked in ``wait`` and
``wait_reduce``), ``issue`` (issuing collectives, freeing), and ``in flight`` (each
collective from its issue to the end of its wait). One event per op in the first three. On
CUDA a ``device`` lane shows each op's span on the stream, from timing events read after
the step (no synchronisation inside it).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import defaultdict
from typing import Iterator

import torch.distributed as dist

from ..schedule.ops import COMPLETES, Category, OpKind
from ..step.record import Event, Recorder
from .plot import pyplot, timeline_picture

log = logging.getLogger(__name__)
LANES = {"compute": 0, "waits": 1, "issue": 2, "in flight": 3, "device": 4}
LANE_OF = {Category.COMPUTE: "compute", Category.WAIT: "waits", Category.ISSUE: "issue",
           Category.LIFETIME: "issue", Category.UPDATE: "compute"}


@contextlib.contextmanager
def trace(path: str, *, png: str | None = None) -> Iterator[Recorder]:
    """Record the steps run inside; on exit write the Chrome trace to ``path`` (``{rank}`` in
    it is replaced by the rank; without it only rank 0 writes), the summary to ``path + .txt``
    and, with ``png``, a timeline picture (``fz3.observe.plot``; it needs matplotlib, checked
    here, before any step: ``ImportError`` naming ``fz3[plot]``)."""
    if png:
        pyplot()
    rec = Recorder()
    yield rec
    rank = dist.get_rank() if dist.is_initialized() else 0
    if "{rank}" not in path and rank != 0:
        return
    out = path.format(rank=rank)
    chrome = chrome_trace(rec, rank)
    with open(out, "w") as f:
        json.dump(chrome, f)
    with open(out + ".txt", "w") as f:
        f.write(trace_summary(rec) + "\n")
    if png:
        timeline_picture(chrome, png.format(rank=rank), rank, LANES)
    log.info("wrote trace %s", out)


def chrome_trace(rec: Recorder, rank: int = 0) -> dict:
    events = rec.events
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = events[0].t_begin_ns
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    out = [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
           for name, tid in LANES.items()]
    issued: dict[tuple[int, str, int], Event] = {}
    for e in events:
        kind, u = e.op[:2]
        lane = LANE_OF[OpKind(kind).category]
        out.append({"name": rec.schedule_of(e.step).describe(e.op), "cat": "op", "ph": "X",
                    "pid": rank, "tid": LANES[lane],
                    "ts": us(e.t_begin_ns), "dur": max((e.t_end_ns - e.t_begin_ns) / 1e3, 0.001),
                    "args": {"step": e.step, "index": e.index, "live_units": e.live_units,
                             "bytes": e.nbytes,
                             "gathered_bytes": e.gathered_bytes, "grad_bytes": e.grad_bytes,
                             "saved_bytes": e.saved_bytes,
                             # a step that traced or compiled layers (not a steady one)
                             "traced": e.step in rec.tracing}})
        if OpKind(kind).category is Category.ISSUE:
            issued[(e.step, kind, u)] = e
        elif kind in COMPLETES:
            start = issued.pop((e.step, COMPLETES[kind], u), None)
            if start is not None:
                out.append({"name": rec.schedule_of(e.step).describe(start.op), "cat": "inflight",
                            "ph": "X", "pid": rank,
                            "tid": LANES["in flight"], "ts": us(start.t_begin_ns),
                            "dur": (e.t_end_ns - start.t_begin_ns) / 1e3,
                            "args": {"bytes": start.nbytes, "traced": e.step in rec.tracing}})
    device = rec.device_times()
    if device:
        for e, (b, end) in zip(events, device):
            out.append({"name": rec.schedule_of(e.step).describe(e.op), "cat": "device", "ph": "X",
                        "pid": rank, "tid": LANES["device"],
                        "ts": b * 1e3, "dur": (end - b) * 1e3,
                        "args": {"traced": e.step in rec.tracing}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def trace_summary(rec: Recorder) -> str:
    """Per unit: host time computing, time blocked waiting for its collectives, bytes moved;
    a mean over the steps that traced or compiled nothing (if any did not)."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    order: dict[str, tuple[int, int]] = {}
    recorded = {e.step for e in rec.events}
    steady = recorded - rec.tracing or recorded
    for e in (e for e in rec.events if e.step in steady):
        kind, u = e.op[:2]
        ms = (e.t_end_ns - e.t_begin_ns) / 1e6
        name = rec.schedule_of(e.step).units[u].name
        order.setdefault(name, (e.step, u))
        r = rows[name]
        category = OpKind(kind).category
        if category in (Category.COMPUTE, Category.UPDATE):  # (the optimizer's, per unit)
            r[0] += ms
        elif category is Category.WAIT:
            r[1] += ms
        r[2] += e.nbytes / 2**20
    steps = len(steady) or 1
    width = max([10, *(len(n) for n in rows)])
    left = len(recorded - steady)
    note = (f"; {left} step(s) that traced or compiled layers left out" if left else
            "; every step traced or compiled layers: not steady" if rec.tracing else "")
    lines = [f"per step, mean over {steps} step(s){note}",
             f"{'unit':<{width}} {'compute ms':>11} {'blocked ms':>11} {'moved MiB':>10}"]
    for name in sorted(rows, key=order.get):
        c, w, b = (x / steps for x in rows[name])
        lines.append(f"{name:<{width}} {c:>11.3f} {w:>11.3f} {b:>10.2f}")
    tot = [sum(r[i] for r in rows.values()) / steps for i in range(3)]
    lines.append(f"{'total':<{width}} {tot[0]:>11.3f} {tot[1]:>11.3f} {tot[2]:>10.2f}")
    return "\n".join(lines)
