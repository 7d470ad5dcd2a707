"""What issuing a collective costs the host: torch's Python functions against the process
group's method that fz3 calls (``fz3.comm.compat``).

    python benchmarks/collective_issue.py             # ~10 s: one rank through gloo
    python benchmarks/collective_issue.py --ranks 2   # ~30 s: two ranks on 127.0.0.1

Each rank issues an all-gather and a reduce-scatter of one layer of ``host_overhead.py``'s
GPT (hidden 16: 3,280 fp32 values a rank) and waits for it, both ways interleaved, 15 rounds
of 500 each; rank 0 prints the median and least microseconds per issue+wait. At one rank through
the backend (as ``Comm(local_copies=False)`` runs) the transport costs little and the
difference is the host time torch's Python layer adds per collective; at two ranks on this
machine gloo's own cost (hundreds of us, two processes on two cores) hides it. On NCCL the
wait does not block the host, so the issue is most of what a collective costs it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fz3.comm.compat import ALL_GATHER, GATHER, REDUCE_SCATTER, SUM_SCATTER  # noqa: E402

N, CALLS, ROUNDS = 3280, 500, 15


def rank_main(rank: int, port: int, ranks: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    group = dist.new_group(list(range(ranks)))
    shard, full = torch.randn(N), torch.empty(ranks * N)
    ways = {
        "all-gather, torch's function": lambda: dist.all_gather_single(
            full, shard, group=group, async_op=True).wait(),
        "all-gather, fz3 (the group's method)": lambda: getattr(group, ALL_GATHER)(
            full, shard, GATHER).wait(),
        "reduce-scatter, torch's function": lambda: dist.reduce_scatter_single(
            shard, full, group=group, async_op=True).wait(),
        "reduce-scatter, fz3 (the group's method)": lambda: getattr(
            group, REDUCE_SCATTER)(shard, full, SUM_SCATTER).wait(),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(ROUNDS):
        for name, fn in ways.items():
            for _ in range(100):
                fn()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            times[name].append((time.perf_counter() - start) / CALLS * 1e6)
    if rank == 0:
        print(f"torch {torch.__version__}, gloo, {ranks} rank(s), {N} fp32 a rank; us per issue+wait, "
              f"median (and least) of {ROUNDS} interleaved rounds of {CALLS}")
        print("| collective | us (median) | us (least) |\n|---|---:|---:|")
        for name, vals in times.items():
            print(f"| {name} | {statistics.median(vals):.1f} | {min(vals):.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1)
    n = ap.parse_args().ranks
    mp.spawn(rank_main, args=(29561, n), nprocs=n)
