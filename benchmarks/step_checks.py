"""What the per-step agreement check costs: the thin config at world size 2 (gloo, 1 thread per
rank), ``fz3.value_and_grad(model)`` (``check_sync=True``, the default: one all-gather of a few
integers per step) against ``check_sync=False``, as interleaved blocks; medians per step.

    python benchmarks/step_checks.py --steps 100 --pairs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, steps: int, pairs: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import fz3
    from fz3.models import shard_gpt
    from fz3.models.gpt import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab=256, seq=64, dim=64, heads=4, layers=24)  # compare.py's "thin"
    torch.manual_seed(0)
    model, params = shard_gpt(GPT(cfg))
    batch = synthetic_batch(cfg, 4, seed=rank)
    fns = {True: fz3.value_and_grad(model), False: fz3.value_and_grad(model, check_sync=False)}
    for f in fns.values():
        for _ in range(3):
            f(params, batch)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(pairs):
        for checked in ((True, False) if i % 2 == 0 else (False, True)):  # ABBA
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[checked](params, batch)
            times[checked].append((time.perf_counter() - t0) / steps)
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--port", type=int, default=29531)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_rank, args=(args.port, args.steps, args.pairs, q), nprocs=2,
                       start_method="spawn")
    med = q.get()
    on, off = med[True], med[False]
    print(f"torch {torch.__version__}, thin, world 2, {args.pairs} interleaved blocks of "
          f"{args.steps} steps: check_sync=True {on * 1e3:.2f} ms/step, False {off * 1e3:.2f} "
          f"ms/step, the check {(on - off) * 1e6:+.0f} us ({(on - off) / off * 100:+.2f}%)")


if __name__ == "__main__":
    main()
