"""Where a step's time goes, on CPU gloo: the evidence behind benchmarks/README.md.

    python benchmarks/breakdown.py --config thin                # ~1 minute
    python benchmarks/breakdown.py --config fat --cprofile 15   # plus rank 0's top functions

Three jobs, one after the other, same model and batches as ``compare.py``:

- ``limit``: one process, plain PyTorch; forward+backward and AdamW timed apart.
- ``limit x2``: two such processes at once, no communication at all: what two ranks get
  from this machine's cores and memory before any collective runs (the contention floor).
- ``collectives``: world size 2, fz3's schedule with every compute op left out: its
  gathers, reduces and waits alone, in order (the bytes the step must move, on this network).
- ``fz3``: world size 2 with the given schedule; ``value_and_grad`` and the optimizer timed
  apart, and the step split by fz3's own ``Recorder`` into compute ops, time blocked in
  waits for collectives, and the rest (issuing collectives, frees, Python between ops).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from compare import CONFIGS, systems_for  # noqa: E402

COMPUTE = ("forward", "loss", "backward")
WAITS = ("wait", "wait_reduce")


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    import fz3
    import systems
    from fz3.models.gpt import GPTConfig
    from fz3.models import shard_gpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    c = dict(CONFIGS[spec["config"]])
    batch = c.pop("batch")
    cfg = GPTConfig(**c)
    cpu = torch.device("cpu")
    rec = fz3.Recorder()
    if spec["job"] in ("fz3", "collectives"):
        module = systems.build(cfg, cpu)
        model, params = shard_gpt(module, device=cpu)
        del module
        opt = fz3.optim.adamw(**systems.HP, weight_decay=systems.WD, mask=fz3.decay_mask(model))
        state = opt.init(params)
        vg = fz3.value_and_grad(model, fz3.Policy(**spec["policy"]), recorder=rec)
        vg_plain = fz3.value_and_grad(model, fz3.Policy(**spec["policy"]))
    else:  # plain PyTorch, no communication, whatever the world size
        plain = systems.plain(cfg, cpu)
    if spec["job"] == "collectives":
        return collectives_only(model, fz3.plan(model, fz3.Policy(**spec["policy"])), spec)
    fb, up, steps_t = [], [], []
    prof = cProfile.Profile() if spec["cprofile"] and rank == 0 else None
    timed_steps = range(spec["warmup"], spec["warmup"] + spec["steps"])
    profiled = range(timed_steps.stop, timed_steps.stop + (3 if spec["cprofile"] else 0))  # after, not timed
    for s in range(profiled.stop):
        b = systems.rank_batch(cfg, batch, s, rank, cpu)
        timed = s in timed_steps
        if prof and s in profiled:
            prof.enable()
        t0 = time.perf_counter()
        if spec["job"] == "fz3":
            loss, grads = (vg if timed else vg_plain)(params, b)  # record the timed steps only
            t1 = time.perf_counter()
            params, state = fz3.optim.step(opt, grads, state, params, donate=True)
        else:
            plain.forward_backward(b)
            t1 = time.perf_counter()
            plain.optimizer()
        t2 = time.perf_counter()
        if prof and s in profiled:
            prof.disable()
        if timed:
            fb.append(t1 - t0)
            up.append(t2 - t1)
            steps_t.append(t2 - t0)
    # means, so that the recorder's split (also means) adds up to fwd+bwd
    out = dict(step_ms=statistics.mean(steps_t) * 1e3, fwd_bwd_ms=statistics.mean(fb) * 1e3,
               optimizer_ms=statistics.mean(up) * 1e3)
    if rec.events:
        n = spec["steps"]
        split = {"compute_ms": 0.0, "blocked_ms": 0.0, "collectives": 0}
        for e in rec.events:
            ms = (e.t_end_ns - e.t_begin_ns) / 1e6
            if e.op.kind in COMPUTE:
                split["compute_ms"] += ms
            elif e.op.kind in WAITS:
                split["blocked_ms"] += ms
            elif e.op.kind in ("gather", "reduce"):
                split["collectives"] += 1
        out.update({k: v / n for k, v in split.items()})
        out["other_ms"] = out["fwd_bwd_ms"] - out["compute_ms"] - out["blocked_ms"]
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(spec["cprofile"])
        out["cprofile"] = buf.getvalue()
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def collectives_only(model, sched, spec: dict) -> None:
    """The schedule's collectives with fz3's own comm functions, on buffers of the units' sizes."""
    import torch
    import torch.distributed as dist

    from fz3.comm import collectives as c

    world = dist.get_world_size()
    size = {u: len(unit.layers) * model.parts[unit.part].layout.padded for u, unit in enumerate(sched.units)}
    times = []
    for s in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        pending = {}
        for kind, u, *_ in sched.ops:
            n = size[u]
            if kind == "gather":
                pending[kind, u] = c.all_gather(model.comm, torch.empty(n), torch.zeros(n // world))
            elif kind == "reduce" and sched.reduce == "all_reduce":
                pending[kind, u] = c.all_reduce(model.comm, torch.zeros(n))
            elif kind == "reduce":
                pending[kind, u] = c.reduce_scatter(model.comm, torch.empty(n // world), torch.zeros(n))
            elif kind in ("wait", "wait_reduce"):
                c.wait(pending.pop(("gather" if kind == "wait" else "reduce", u)))
        if s >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        ms = statistics.mean(times) * 1e3
        with open(spec["out"], "w") as f:
            json.dump(dict(step_ms=ms, fwd_bwd_ms=ms, optimizer_ms=0.0, blocked_ms=ms, compute_ms=0.0, other_ms=0.0,
                           collectives=sum(k in ("gather", "reduce") for k, *_ in sched.ops)), f)
    dist.destroy_process_group()


def launch(spec: dict, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=os.path.join(tmp, "r.json"))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.abspath(__file__), "--worker", json.dumps(spec)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"profile job {spec['job']} failed:\n{p.stderr[-3000:]}")
        with open(spec["out"]) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="thin", choices=sorted(CONFIGS))
    ap.add_argument("--policy", default="tuned", help="'tuned' (compare.py's whole-stack row), 'default', or JSON")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20 thin, 6 fat)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, help="print rank 0's top N functions by own time")
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if args.policy == "tuned":
        policy = systems_for(args.config, CONFIGS[args.config]["layers"])["fz3 whole stack"][1]["policy"]
    else:
        policy = {} if args.policy == "default" else json.loads(args.policy)
    spec = dict(config=args.config, steps=args.steps or (20 if args.config == "thin" else 6),
                warmup=args.warmup, cprofile=args.cprofile, policy=policy)
    rows = {"limit": launch(dict(spec, job="plain", cprofile=0), 1),
            "limit x2": launch(dict(spec, job="plain", cprofile=0), 2),
            "collectives": launch(dict(spec, job="collectives", cprofile=0), 2),
            "fz3": launch(dict(spec, job="fz3"), 2)}
    lim = rows["limit"]["step_ms"]
    print(f"`python benchmarks/breakdown.py {' '.join(sys.argv[1:])}`: {args.config} config, fz3 policy {policy}, "
          f"means of {spec['steps']} steps, rank 0\n")
    print("| job | step ms | x limit | fwd+bwd ms | optimizer ms | compute ops ms | blocked in waits ms | "
          "issue/free/Python ms | collectives/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        extra = (f"{r['compute_ms']:.1f} | {r['blocked_ms']:.1f} | {r['other_ms']:.1f} | {r['collectives']:.0f}"
                 if "compute_ms" in r else " | | | 0")
        print(f"| {name} | {r['step_ms']:.1f} | {r['step_ms'] / lim:.2f} | {r['fwd_bwd_ms']:.1f} | "
              f"{r['optimizer_ms']:.1f} | {extra} |")
    if args.cprofile:
        print("\nrank 0, fz3, cProfile of 3 more steps (not timed above), by own time:\n" + rows["fz3"]["cprofile"])


if __name__ == "__main__":
    main()
