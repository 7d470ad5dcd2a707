"""Per-layer host overhead, the CPU proxy of a host-bound GPU step (any session can run it).

    python benchmarks/host_overhead.py               # ~3 minutes on 2 cores (compiles included)
    python benchmarks/host_overhead.py --repeats 7 --out benchmarks/results/host_overhead.md

A GPT so small its compute is negligible (hidden 16, seq 8, batch 1), world size 1 on gloo,
one thread. Each system runs forward+backward (no optimizer) at 48 and at 8 layers; the
per-layer cost is the difference over 40 layers, so the embedding, the head and the
loss, the same for everyone, drop out. Systems: plain eager, plain with each block
``torch.compile``d, plain with each block checkpointed (``recompute``'s twin), FSDP2
(``fully_shard`` per block), and fz3's policies eager and compiled (``compile=True``), traced
(the default) and, for ``save``, not (``trace=False``). Repeats are interleaved across
systems and the medians reported, as the machine drifts. At world size 1 fz3 gathers
nothing (its layers compute on the shards, ``fz3/comm``) and FSDP2's collectives go through
gloo. With ``--loop`` each system's optimizer step (fused AdamW, fz3's with ``donate=True``)
runs untimed after each timed forward+backward, as in a training loop: fz3 then gets new
parameter tensors every call (aliases of the donated memory), the others the same ones.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

CFG = dict(vocab=32, seq=8, dim=16, heads=2)
DEEP, SHALLOW = 48, 8


def systems():
    whole = lambda layers: dict(layers_per_unit=layers, activations="save_unsharded")  # noqa: E731
    return {
        "plain eager": ("plain", {}),
        "plain compiled": ("plain", {"compile_blocks": True}),
        "plain + AC": ("plain", {"ac": True}),  # recompute's twin: each block checkpointed
        "FSDP2 per block": ("fsdp2", {}),
        "fz3 save": ("fz3", {"policy": {"activations": "save"}}),
        "fz3 save (not traced)": ("fz3", {"policy": {"activations": "save"}, "trace": False}),
        "fz3 recompute": ("fz3", {"policy": {}}),
        "fz3 whole stack": ("fz3", {"whole": whole}),
        "fz3 save compiled": ("fz3", {"policy": {"activations": "save"}, "compile": True}),
        "fz3 recompute compiled": ("fz3", {"policy": {}, "compile": True}),
        "fz3 whole stack compiled": ("fz3", {"whole": whole, "compile": True}),
    }


def build(kind: str, kwargs: dict, layers: int):
    """One system (its ``forward_backward(batch)`` and ``optimizer()``) at ``layers`` layers."""
    import torch

    import fz3
    import systems as s
    from fz3.models.gpt import GPTConfig

    cfg = GPTConfig(**CFG, layers=layers)
    cpu = torch.device("cpu")
    if kind == "plain":
        return s.plain(cfg, cpu, **kwargs)
    if kind == "fsdp2":
        return s.fsdp2(cfg, cpu, **kwargs)
    policy = fz3.Policy(**(kwargs["whole"](layers) if "whole" in kwargs else kwargs["policy"]))
    return s.fz3_system(cfg, cpu, policy=policy, compile=kwargs.get("compile", False),
                        trace=kwargs.get("trace", True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    ap.add_argument("--systems", default=None, help="comma-separated subset of the systems")
    ap.add_argument("--loop", action="store_true",
                    help="run each system's optimizer step (untimed) after each timed call")
    args = ap.parse_args()
    chosen = {n: v for n, v in systems().items() if args.systems is None or n in args.systems.split(",")}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    import torch
    import torch.distributed as dist

    import systems as s
    from fz3.models.gpt import GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    batch = s.rank_batch(GPTConfig(**CFG, layers=1), 1, 0, 0, torch.device("cpu"))
    built = {(name, L): build(kind, kw, L) for name, (kind, kw) in chosen.items() for L in (DEEP, SHALLOW)}
    per_layer: dict[str, list[float]] = {name: [] for name in chosen}
    deep: dict[str, list[float]] = {name: [] for name in chosen}
    for r in range(args.repeats):
        for name in chosen:
            t_deep, t_shallow = (s.median_time(
                lambda: built[name, L].forward_backward(batch), args.steps,
                between=built[name, L].optimizer if args.loop else None) for L in (DEEP, SHALLOW))
            per_layer[name].append((t_deep - t_shallow) / (DEEP - SHALLOW) * 1e6)
            deep[name].append(t_deep * 1e3)
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in per_layer.items()),
              flush=True)
    plain = statistics.median(per_layer["plain eager"]) if "plain eager" in per_layer else float("nan")
    lines = [f"`python benchmarks/host_overhead.py {' '.join(sys.argv[1:])}` on {datetime.date.today()}, torch "
             f"{torch.__version__}, world size 1 (gloo), 1 thread; forward+backward of a GPT of hidden 16, seq 8, "
             f"{'in a training loop (optimizer untimed), ' if args.loop else ''}"
             f"batch 1; per layer = (t({DEEP} layers) - t({SHALLOW} layers)) / {DEEP - SHALLOW}; medians of "
             f"{args.repeats} interleaved repeats", "",
             "| system | us per layer | x plain eager | ms per step at 48 layers |", "|---|---:|---:|---:|"]
    for name, vals in per_layer.items():
        us = statistics.median(vals)
        lines.append(f"| {name} | {us:.0f} | {us / plain:.2f} | {statistics.median(deep[name]):.1f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
