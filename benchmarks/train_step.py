"""``fz3.train_step`` against ``fz3.value_and_grad`` + ``fz3.optim.step(..., donate=True)``
(issue 53): peak memory and time, same model, data, optimizer and policy, at world size 1
(or ``--world``), for fz3's AdamW (torch's fused kernel), Muon (``others``: the same AdamW)
and ``chain(clip_by_global_norm, adamw)``.

    python benchmarks/train_step.py                 # 5 interleaved repeats
    python benchmarks/train_step.py --repeats 1     # a smoke run
    python benchmarks/train_step.py --world 2 --only muon    # Muon across two ranks
    python benchmarks/train_step.py --small ...     # 1.6M parameters (slow bf16 matmul)

Each job runs in fresh processes (a rank each, one thread, gloo): a GPT whose parameters
are about 100 MB (25.4M fp32), the default policy; 2 warm-up steps (the first traces), then
``--steps`` timed steps. Reported per job (rank 0's): the step's live bytes beyond params
and optimizer state (the second step, under ``fz3.observe.live_bytes.LiveBytes``: every
storage it makes, while alive), the process's peak RSS after all steps (``ru_maxrss``: its
whole life, parameters, state and tracing included), and the median step time (forward,
backward and optimizer: in ``train_step`` they interleave). Each pair's two jobs alternate;
medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from fz3.models.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

CFG = GPTConfig(vocab=4096, seq=64, dim=512, heads=8, layers=8)  # 25.4M parameters
# --small: 1.6M parameters, for machines whose bf16 matmul is slow (Newton-Schulz's)
SMALL = GPTConfig(vocab=1024, seq=64, dim=128, heads=4, layers=8)
ADAM = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
# the like-for-like pairs: each optimizer's train_step against its value_and_grad + optim.step
PAIRS = (("value_and_grad+step", "train_step"), ("muon value_and_grad+step", "muon train_step"),
         ("clip value_and_grad+step", "clip train_step"))


def job(kind: str, steps: int, rank: int, cfg: GPTConfig) -> dict:
    import fz3
    from fz3.models import shard_gpt
    from fz3.observe.live_bytes import LiveBytes

    torch.manual_seed(0)
    model, params = shard_gpt(GPT(cfg))
    opt = fz3.optim.adamw(**ADAM, mask=fz3.decay_mask(model))
    if kind.startswith("muon"):
        opt = fz3.optim.muon(model, **MUON, others=fz3.optim.adamw(**ADAM))
    if kind.startswith("clip"):
        opt = fz3.optim.chain(fz3.optim.clip_by_global_norm(1.0, model), opt)
    grad_bytes = sum(p.numel() * 4 for p in params.parts)  # (params are donated below)
    box = [params, opt.init(params)]
    batch = synthetic_batch(cfg, 4, seed=rank)
    if kind.endswith("train_step"):
        step = fz3.train_step(model, opt)

        def run():
            _, box[0], box[1] = step(box[0], box[1], batch)
    else:
        vg = fz3.value_and_grad(model)

        def run():
            _, grads = vg(box[0], batch)
            box[0], box[1] = fz3.optim.step(opt, grads, box[1], box[0], donate=True)

    run()
    with LiveBytes() as live:
        run()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return dict(live_peak_mib=live.peak / 2**20, rss_peak_mib=resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, step_s=statistics.median(times),
        grad_mib=grad_bytes / 2**20)


def _rank(rank: int, store: str, kind: str, steps: int, out: str, world: int,
          cfg: GPTConfig) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    got = job(kind, steps, rank, cfg)  # rank 0's numbers
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()


def run(kind: str, steps: int, world: int, cfg: GPTConfig) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), kind, steps, out, world, cfg),
                 nprocs=world)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--only", choices=("adamw", "muon", "clip"), default=None)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pairs = [p for p in PAIRS if args.only is None or p[0].split()[0] == (
        args.only if args.only != "adamw" else "value_and_grad+step")]
    got: dict[str, list[dict]] = {k: [] for pair in pairs for k in pair}
    for r in range(args.repeats):
        for pair in pairs:
            for kind in pair if r % 2 == 0 else pair[::-1]:
                got[kind].append(run(kind, args.steps, args.world,
                                     SMALL if args.small else CFG))
                print(kind, got[kind][-1], flush=True)
    summary = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in got.items()}
    for base_kind, kind in pairs:
        base, mine = summary[base_kind], summary[kind]
        mine["ratios"] = {f: mine[f] / base[f] for f in ("live_peak_mib", "rss_peak_mib",
                                                         "step_s")}
        mine["live_saved_over_grad"] = (base["live_peak_mib"] - mine["live_peak_mib"]) / \
            base["grad_mib"]
    summary["versions"] = dict(torch=torch.__version__, python=sys.version.split()[0],
                               world=args.world, config=str(SMALL if args.small else CFG))
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary=summary, runs=got), f, indent=1)


if __name__ == "__main__":
    main()
