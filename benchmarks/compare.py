"""fz3 vs FSDP2 vs DeepSpeed ZeRO-3 vs DDP vs the no-communication limit, on CPU gloo.

    python benchmarks/compare.py --quick          # thin config, fz3/FSDP2/limit, ~2 minutes
    python benchmarks/compare.py                  # everything; results into benchmarks/results/

Every system trains the same GPT (same seed, same synthetic batches, AdamW lr 1e-3, betas
(0.9, 0.95), weight decay 0.1 on matrices) for ``--steps`` steps at world size 2 (one
thread per rank) and reports the median step time after ``--warmup`` steps, tokens/s, peak
RSS per rank and the final loss. The limit is one process with the per-rank batch and no
communication. Each (system, repeat) is a fresh ``torchrun`` job and repeats are
interleaved across systems, so machine drift hits every system alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

CONFIGS = {
    # framework overhead dominates: many thin layers
    "thin": dict(vocab=256, seq=64, dim=64, heads=4, layers=24, batch=4),
    # compute dominates
    "fat": dict(vocab=256, seq=256, dim=512, heads=8, layers=4, batch=4),
}


def whole_stack(layers: int) -> dict:
    """fz3's whole-stack policy: every layer in one unit, gathered once for the step."""
    return dict(layers_per_unit=layers, activations="save_unsharded", reduce="all_reduce")


def systems_for(config: str, layers: int) -> dict[str, tuple[str, dict]]:
    """name -> (builder in systems.py, kwargs). Each fz3 policy has its like-for-like peer
    (``PAIRS``); fz3's policies are schedule knobs, nothing else."""
    return {
        "limit": ("plain", {}),
        "limit + AC": ("plain", {"ac": True}),  # each block checkpointed: recompute's limit
        "limit compiled": ("plain", {"compile_blocks": True}),
        "fz3 whole stack": ("fz3_system", {"policy": whole_stack(layers)}),
        "FSDP2 root only": ("fsdp2", {"root_only": True}),
        "fz3 save": ("fz3_system", {"policy": {"activations": "save"}}),
        "FSDP2": ("fsdp2", {}),
        "fz3 recompute": ("fz3_system", {"policy": {}}),
        "FSDP2 + AC": ("fsdp2", {"ac": True}),
        "fz3 save compiled": ("fz3_system", {"policy": {"activations": "save"}, "compile": True}),
        "FSDP2 compiled": ("fsdp2", {"compile_blocks": True}),
        "DeepSpeed ZeRO-3": ("deepspeed_zero3", {}),
        "DDP": ("ddp", {}),
    }


# (fz3 system, its like-for-like peer): the same memory policy on both sides
PAIRS = [("fz3 whole stack", "FSDP2 root only"), ("fz3 save", "FSDP2"), ("fz3 recompute", "FSDP2 + AC"),
         ("fz3 save compiled", "FSDP2 compiled")]
# (system, its no-communication limit with the same checkpointing)
LIMITS = [("fz3 save", "limit"), ("FSDP2", "limit"), ("fz3 recompute", "limit + AC"),
          ("FSDP2 + AC", "limit + AC"), ("DeepSpeed ZeRO-3", "limit")]


def worker(args: argparse.Namespace) -> None:
    """One rank of one run: build the system, time the steps, write a JSON line (rank 0)."""
    import torch
    import torch.distributed as dist

    import fz3
    import systems
    from fz3.models.gpt import GPTConfig

    torch.set_num_threads(1)
    spec = json.loads(args.worker)
    if spec["builder"] == "deepspeed_zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    c = {**CONFIGS[spec["config"]], **spec.get("override", {})}
    batch = c.pop("batch")
    cfg = GPTConfig(**c)
    kw = dict(spec["kwargs"])
    if "policy" in kw:
        kw["policy"] = fz3.Policy(**kw["policy"])
    system = getattr(systems, spec["builder"])(cfg, torch.device("cpu"), **kw)
    times, fbs, opts, loss = [], [], [], None
    for s in range(spec["warmup"] + spec["steps"]):
        b = systems.rank_batch(cfg, batch, s, rank, torch.device("cpu"))
        t0 = time.perf_counter()
        loss = system.forward_backward(b)
        t1 = time.perf_counter()
        system.optimizer()
        if s >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
            fbs.append(t1 - t0)
            opts.append(time.perf_counter() - t1)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])  # MiB
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    mean_loss = torch.tensor([float(loss)], dtype=torch.float64)  # fz3 returns it; others: rank-local
    dist.all_reduce(mean_loss)
    loss = float(mean_loss) / dist.get_world_size()
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(dict(step_s=statistics.median(times), fwd_bwd_s=statistics.median(fbs),
                           optimizer_s=statistics.median(opts), loss=float(loss), rss_mib=float(rss),
                           tokens_per_step=batch * cfg.seq * dist.get_world_size()), f)
    dist.destroy_process_group()


def launch(config: str, name: str, builder: str, kwargs: dict, args: argparse.Namespace,
           override: dict | None = None, nproc: int | None = None) -> dict:
    nproc = nproc or (1 if name.startswith("limit") else args.world)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        spec = json.dumps(dict(config=config, builder=builder, kwargs=kwargs, steps=args.steps,
                               warmup=args.warmup, out=out, override=override or {}))
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.abspath(__file__), "--worker", spec]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if p.returncode != 0 or not os.path.exists(out):
            return dict(error=(p.stderr or p.stdout)[-2000:])
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="thin only; limit (also + AC), fz3 save/recompute and "
                                                          "their FSDP2 peers; 1 repeat")
    ap.add_argument("--configs", default="thin,fat")
    ap.add_argument("--systems", default=None, help="comma-separated subset of system names")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20 thin, 6 fat)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--scaling", action="store_true", help="thin config: step time vs layers and vs world size")
    ap.add_argument("--report", metavar="JSON", help="rewrite the table and chart from a saved compare.json")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        sys.argv[1:] = saved["argv"]
        args = ap.parse_args(saved["argv"] + ["--out", args.out])
        return write_report(saved["results"], args)
    if args.scaling:
        return scaling(args)
    if args.quick:
        args.configs, args.repeats = "thin", 1
        args.systems = args.systems or "limit,limit + AC,fz3 save,FSDP2,fz3 recompute,FSDP2 + AC"
        args.steps = args.steps or 10
    want = set(args.systems.split(",")) if args.systems else None

    results: dict[str, dict[str, list[dict]]] = {}
    for config in args.configs.split(","):
        steps = args.steps or (20 if config == "thin" else 6)
        runs = {n: s for n, s in systems_for(config, CONFIGS[config]["layers"]).items()
                if want is None or n in want}
        results[config] = {n: [] for n in runs}
        for r in range(args.repeats):
            for name, (builder, kwargs) in runs.items():
                ns = argparse.Namespace(**{**vars(args), "steps": steps})
                res = launch(config, name, builder, kwargs, ns)
                results[config][name].append(res)
                msg = res.get("error", "").splitlines()[-1:] if "error" in res else \
                    [f"{res['step_s'] * 1e3:8.1f} ms/step  loss {res['loss']:.5f}  rss {res['rss_mib']:.0f} MiB"]
                print(f"[{config} repeat {r + 1}/{args.repeats}] {name:18s} {msg[0] if msg else 'failed'}", flush=True)

    if args.quick:
        print("\n" + summarize(results, args))
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump(dict(results=results, argv=sys.argv[1:], date=str(datetime.date.today())), f, indent=1)
    write_report(results, args)


def write_report(results: dict, args: argparse.Namespace) -> None:
    report = summarize(results, args)
    print("\n" + report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(report + "\n")
    plot(results, os.path.join(args.out, "compare.png"))


def scaling(args: argparse.Namespace) -> None:
    """fz3 (tuned thin schedule) and the limit: step time vs layers (world 2) and vs world size (24 layers)."""
    steps = args.steps or 10
    ns = argparse.Namespace(**{**vars(args), "steps": steps})
    points = [("layers", L, 2) for L in (8, 16, 32)] + [("world", 24, w) for w in (1, 2, 4)]
    rows: dict[tuple, list] = {}
    for r in range(args.repeats):
        for axis, layers, world in points:
            for name, builder, kw, nproc in (("fz3", "fz3_system", {"policy": whole_stack(layers)}, world),
                                             ("limit", "plain", {}, 1)):
                if name == "limit" and axis == "world" and world != 1:
                    continue
                res = launch("thin", name, builder, kw, ns, override={"layers": layers}, nproc=nproc)
                rows.setdefault((axis, layers, world, name), []).append(res)
                print(f"[scaling {r + 1}/{args.repeats}] {name} layers={layers} world={world} "
                      f"{res.get('step_s', float('nan')) * 1e3:.1f} ms", flush=True)
    lines = [f"`python benchmarks/compare.py {' '.join(sys.argv[1:])}` on {datetime.date.today()}: thin config "
             f"(hidden 64, seq 64, micro-batch 4 per rank), fz3 with one unit for all layers, medians of "
             f"{args.repeats}; this machine has 2 cores, so world 4 runs 2 ranks per core", "",
             "| axis | layers | world | fz3 s/step | limit s/step (1 process) | fz3 / limit | fz3 ms per layer |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for axis, layers, world in points:
        fz = _median(rows[(axis, layers, world, "fz3")], "step_s")
        lim_key = (axis, layers, 1 if axis == "world" else world, "limit")
        lim = _median(rows.get(lim_key, rows.get(("world", layers, 1, "limit"), [])), "step_s")
        lines.append(f"| {axis} | {layers} | {world} | {fz:.4f} | {lim:.4f} | {fz / lim:.2f} | {fz / layers * 1e3:.2f} |")
    report = "\n".join(lines)
    print("\n" + report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scaling.md"), "w") as f:
        f.write(report + "\n")
    _plot_scaling(rows, points, os.path.join(args.out, "scaling.png"))


def _plot_scaling(rows: dict, points: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, axis, key in ((a, "layers", 1), (b, "world", 2)):
        pts = [p for p in points if p[0] == axis]
        xs = [p[key] for p in pts]
        ax.plot(xs, [_median(rows[(*p, "fz3")], "step_s") for p in pts], "o-", label="fz3")
        if axis == "layers":
            ax.plot(xs, [_median(rows[(*p, "limit")], "step_s") for p in pts], "s--", label="limit")
        ax.set_xlabel("layers (world 2)" if axis == "layers" else "world size (24 layers)")
        ax.set_ylabel("s/step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def summarize(results: dict, args: argparse.Namespace) -> str:
    import torch

    try:
        import deepspeed

        ds = deepspeed.__version__
    except Exception:  # noqa: BLE001 - optional
        ds = "not installed"
    lines = [f"`python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}` on "
             f"{datetime.date.today()}, torch {torch.__version__}, deepspeed {ds}, world size {args.world} "
             f"(gloo, 1 thread per rank), medians of {args.repeats} interleaved repeats", ""]
    for config, by_system in results.items():
        c = CONFIGS[config]
        lines += [f"### {config}: {c['layers']} layers, hidden {c['dim']}, seq {c['seq']}, micro-batch {c['batch']}",
                  "", "| system | s/step | fwd+bwd s | optimizer s | tokens/s | x limit | x limit, paired | "
                      "peak RSS/rank MiB | final loss |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        limit = _median(by_system.get("limit", []), "step_s")
        limits = by_system.get("limit", [])
        for name, runs in by_system.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                lines.append(f"| {name} | failed | | | | | | | |")
                continue
            step = _median(ok, "step_s")
            tps = ok[0]["tokens_per_step"] / step
            ratio = step / limit if limit else float("nan")
            # each repeat's run against the limit run just before it: robust to the machine's drift
            paired = [r["step_s"] / lr["step_s"] for r, lr in zip(runs, limits) if "error" not in r | lr]
            pr = statistics.median(paired) if paired else float("nan")
            lines.append(f"| {name} | {step:.4f} | {_median(ok, 'fwd_bwd_s'):.4f} | {_median(ok, 'optimizer_s'):.4f} "
                         f"| {tps:.0f} | {ratio:.2f} | {pr:.2f} | {_median(ok, 'rss_mib'):.0f} | {ok[-1]['loss']:.5f} |")
        lines += _paired(by_system, PAIRS, "Like for like (the same memory policy on both sides): fz3 / its "
                                           "peer", ("fz3", "peer"))
        lines += _paired(by_system, LIMITS, "Against the no-communication limit with the same checkpointing "
                                            "(recompute's: each block checkpointed)", ("system", "limit"))
        lines.append("")
    return "\n".join(lines)


def _paired(by_system: dict, pairs: list[tuple[str, str]], title: str, heads: tuple[str, str]) -> list[str]:
    """A table of ``mine / theirs`` for each pair both ran: medians of the per-repeat ratios
    (each repeat's runs were made one after the other)."""
    lines = ["", f"{title}, medians of the paired per-repeat ratios", "",
             f"| {heads[0]} | {heads[1]} | step | fwd+bwd | optimizer | peak RSS |", "|---|---|---:|---:|---:|---:|"]
    for mine, theirs in pairs:
        both = [(x, y) for x, y in zip(by_system.get(mine, []), by_system.get(theirs, []))
                if "error" not in x | y]
        if not both:
            continue
        ratio = {k: statistics.median(x[k] / y[k] for x, y in both)
                 for k in ("step_s", "fwd_bwd_s", "optimizer_s", "rss_mib")}
        lines.append(f"| {mine} | {theirs} | {ratio['step_s']:.2f} | {ratio['fwd_bwd_s']:.2f} | "
                     f"{ratio['optimizer_s']:.2f} | {ratio['rss_mib']:.2f} |")
    return lines if len(lines) > 5 else []


def _median(runs: list[dict], key: str) -> float:
    vals = [r[key] for r in runs if "error" not in r]
    return statistics.median(vals) if vals else float("nan")


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (config, by_system) in zip(axes[0], results.items()):
        limit = _median(by_system.get("limit", []), "step_s")
        names = [n for n, runs in by_system.items() if any("error" not in r for r in runs)]
        ratios = [_median(by_system[n], "step_s") / limit for n in names]
        ax.barh(names, ratios, color=["tab:green" if n.startswith("fz3") else "tab:gray" for n in names])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(f"{config}: step time / limit (lower is better)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
