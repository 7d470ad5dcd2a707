"""Fixed buffers against new ones per step (``value_and_grad(..., fixed_buffers=True)``):
the thin config at world size 2 (24 layers of hidden 64, batch 4 per rank), both ranks
through ``tests/dist.py`` (gloo on 127.0.0.1, one thread each).

    python benchmarks/fixed_buffers.py            # ~30 s; prints one line of medians

Each step function is warmed 3 steps, then the functions run 20 timed steps interleaved, in
alternating order; seconds per step, rank 0's medians. ``--no-fixed`` times the default
functions only (to compare two trees, which may lack the keyword).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import dist  # noqa: E402  (tests/dist.py: real gloo ranks)


def ranks(rank: int, world: int, fixed: bool) -> dict:
    import fz3
    import reference
    from fz3.models import shard_gpt
    from fz3.models.gpt import GPTConfig

    cfg = GPTConfig(vocab=256, seq=64, dim=64, heads=4, layers=24)
    model, params = shard_gpt(reference.gpt(cfg))
    batch = reference.batches(cfg, world, per_rank=4)[rank]
    steps = {}
    for name, policy in (("save", fz3.Policy(activations="save")), ("recompute", fz3.Policy())):
        steps[name] = fz3.value_and_grad(model, policy, check_sync=False)
        if fixed:
            steps[name + " fixed"] = fz3.value_and_grad(model, policy, check_sync=False,
                                                        fixed_buffers=True)
    for f in steps.values():
        for _ in range(3):
            f(params, batch)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(20):
        for k in (list(steps) if i % 2 == 0 else list(reversed(steps))):
            t = time.perf_counter()
            steps[k](params, batch)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-fixed", action="store_true", help="the default functions only")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(dist.run(2, ranks, not args.no_fixed, timeout=900)[0])


if __name__ == "__main__":
    main()
