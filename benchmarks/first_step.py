"""The first step of a deep HF Llama (hidden 128, intermediate 256) on 2 ranks (gloo, 1 thread
per rank): 12 layers against 24, traced (the default) and ``trace=False``, each in fresh
processes (nothing traced before), repeated as interleaved rounds; medians. "once" is the
first step less the second (what only the first step pays: tracing, code generation, the
first calls' caches). Then, for the traced 24-layer model, where the first step's time goes
(cProfile cumulative seconds: profiling slows Python down, so read them as shares):

    python benchmarks/first_step.py --rounds 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STAGES = {"joint trace (make_fx, fake tensors)": "joint.py:.*\\(joint_trace\\)",
          "programs: partition": "partition.py:.*\\(partition\\)",
          "programs: python bindings (fast_ops)": "codegen.py:.*\\(fast_ops\\)",
          "programs: code generation": "codegen.py:.*\\(codegen\\)",
          "programs, all": "joint.py:.*\\(programs\\)"}


def _llama(layers: int):
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _rank(rank: int, port: int, layers: int, trace: bool, rows: int, profile: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import fz3

    model, params = fz3.shard(_llama(layers))
    ids = torch.randint(3, 256, (rows, 64), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids.clone()}
    step = fz3.value_and_grad(model, trace=trace)
    prof = cProfile.Profile() if profile else None
    dist.barrier()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    step(params, batch)
    if prof:
        prof.disable()
    t1 = time.perf_counter()
    step(params, batch)
    t2 = time.perf_counter()
    if rank == 0:
        stages = {}
        if prof:
            stats = pstats.Stats(prof, stream=io.StringIO())
            for name, pattern in STAGES.items():
                import re

                stages[name] = sum(v[3] for k, v in stats.stats.items()
                                   if re.search(pattern, f"{k[0]}:{k[1]}({k[2]})"))
            stages["first step (profiled)"] = t1 - t0
        out.put((t1 - t0, t2 - t1, stages))
    dist.destroy_process_group()


def run(layers: int, trace: bool, rows: int, profile: bool = False):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, layers, trace, rows, profile, out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=600)
    for p in procs:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(f"torch {torch.__version__}; HF Llama hidden 128, seq 64; 2 ranks; "
          f"medians of {args.rounds} interleaved rounds")
    for rows in args.rows:
        times: dict[tuple, list] = {}
        for _ in range(args.rounds):
            for trace in (True, False):
                for layers in (12, 24):
                    first, second, _ = run(layers, trace, rows)
                    times.setdefault((trace, layers), []).append((first, second))
        for trace in (True, False):
            med = {n: (statistics.median(f for f, _ in times[trace, n]),
                       statistics.median(s for _, s in times[trace, n])) for n in (12, 24)}
            once = {n: statistics.median(f - s for f, s in times[trace, n]) for n in (12, 24)}
            print(f"batch {rows}x64 trace={trace}: first step 12 layers {med[12][0]:.3f} s, "
                  f"24 layers {med[24][0]:.3f} s ({med[24][0] / med[12][0]:.3f}x); "
                  f"second step {med[12][1]:.3f} / {med[24][1]:.3f} s; once "
                  f"{once[12]:.3f} / {once[24]:.3f} s ({once[24] / once[12]:.3f}x)")
    _, _, stages = run(24, True, args.rows[0], profile=True)
    print("traced 24 layers, first step, cProfile cumulative s:")
    for name, secs in stages.items():
        print(f"  {name:<40} {secs:.3f}")


if __name__ == "__main__":
    main()
