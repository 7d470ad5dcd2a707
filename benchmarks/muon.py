"""Muon on flat shards (issue 53 item 3): each rank's Newton-Schulz FLOPs, the step's time
against one process of ``torch.optim.Muon``, the bytes each rank sends per step against the
matrices' shard bytes, and FSDP2 with ``torch.optim.Muon`` on DTensor shards.

    python benchmarks/muon.py               # 5 interleaved repeats of each job
    python benchmarks/muon.py --quick       # 1 repeat: a smoke run

Counted (no processes): for world sizes 1-8 (and 2-64 for a 6.5B GPT of Llama-7B's width,
built on the meta device), from ``fz3.optim.owners.plan`` on the model's layouts: the largest
rank's Newton-Schulz FLOPs against the mean (issue 53's bound: 1.1x the mean plus one
matrix) and the bytes it sends in the two all-to-alls (bf16 slices, its own slices not
counted) against 4x the matrix elements in its shard (the matrices' fp32 shard bytes).

Timed (CPU, gloo, one thread per process; 2 cores here, shared): the busiest rank's
Newton-Schulz at world sizes 1, 2, 4, 8, timed alone in one process; then the optimizer step
alone, on the gradients of one ``value_and_grad`` step, repeated. ``torch``: one process,
``torch.optim.Muon`` over the stack's matrices and ``torch.optim.AdamW`` (fused) over the rest;
``fz3 w=N``: ``fz3.optim.step(fz3.optim.muon(...), ..., donate=True)`` at world size N (and
rank 0's Newton-Schulz in the same job); ``fsdp2 w=2``: ``fully_shard`` per block and at the
root, ``torch.optim.Muon`` given the DTensor matrices: its collectives in one step, its
distance to one process of ``torch.optim.Muon`` on the same full tensors, its step time.
Each job a fresh set of processes, jobs interleaved; medians over repeats of each job's
median step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from fz3.models.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

CFG = GPTConfig(vocab=2048, seq=64, dim=256, heads=4, layers=4)
# counted only, built on the meta device: a 6.5B GPT (fused qkv, MLP 4x) of Llama-7B's width
BIG = GPTConfig(vocab=32000, seq=4096, dim=4096, heads=32, layers=32)
TRAIN_STEP_CFG = GPTConfig(vocab=4096, seq=64, dim=512, heads=8, layers=8)  # train_step.py's
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAM = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)


def counts(cfg: GPTConfig, worlds=range(1, 9), device: str = "cpu") -> list[dict]:
    """Per world size: the largest rank's NS FLOPs / the mean, the bound, and the largest
    rank's bytes sent per step / its matrices' fp32 shard bytes."""
    from fz3.optim.newton_schulz import flops
    from fz3.optim.owners import plan
    from fz3.sharding.matrices import matrix_runs
    from fz3.sharding.parts import partition

    torch.manual_seed(0)
    with torch.device(device):
        module = GPT(cfg)
    out = []
    for world in worlds:
        parts = partition(module, ["blocks"], world, between=[]).parts
        p = plan(parts, world, 5)
        mean = sum(p.flops) / world
        biggest = max(flops(m.shape, 5) for m in p.matrices)
        sent = [2 * sum(s for d, s in enumerate(ex.send_sizes) if d != r)
                + 2 * sum(s for h, s in enumerate(ex.recv_sizes) if h != r)
                for r, ex in enumerate(p.exchange(q) for q in range(world))]
        shard = [4 * sum(part.rows * (b - a) for part in parts if part.role.value == "stack"
                         for a, b in matrix_runs(part, r)) for r in range(world)]
        out.append(dict(world=world, matrices=len(p.matrices), flops_max_over_mean=max(p.flops)
                        / mean, bound=(1.1 * mean + biggest) / mean, bytes_sent_max=max(sent),
                        shard_bytes=max(shard), sent_over_shard=max(s / b for s, b in
                                                                    zip(sent, shard))))
    return out


def unit_paths(cfg: GPTConfig, worlds=(2, 3, 4, 8)) -> list[dict]:
    """Per world size, counted: the Newton-Schulz critical path of ``fz3.train_step``'s
    per-unit Muon (one layer a unit, last layer first) against ``optim.step``'s (the busiest
    rank's total, one exchange): ``waited`` each unit's exchange waited in its own update
    (each unit then costs its busiest rank: the sum over units), ``in_flight`` as
    ``muon._per_unit`` runs it (each update sends its own unit, then orthogonalizes the unit
    before's share, then waits for the one before that), with no backward between updates
    to hide behind (the worst case)."""
    from fz3.optim.newton_schulz import flops
    from fz3.optim.owners import plan
    from fz3.sharding.parts import partition

    with torch.device("meta"):
        module = GPT(cfg)
    out = []
    for world in worlds:
        parts = partition(module, ["blocks"], world, between=[]).parts
        stack = next(i for i, p in enumerate(parts) if p.role.value == "stack")
        whole = plan(parts, world, 5)
        units = []  # per unit, last layer first: per rank its NS FLOPs
        for layer in reversed(range(parts[stack].rows)):
            u = whole.only(stack, slice(layer, layer + 1))
            load = [0] * world
            for m, r in zip(u.matrices, u.owners):
                load[r] += flops(m.shape, 5)
            units.append(load)
        t, sent, back = [0.0] * world, {}, {}  # per rank its clock; per unit issue times
        for k in range(len(units) + 2):  # the updates, then finish's two rounds
            if k < len(units):  # its own unit sent first
                sent[k] = list(t)
            if k - 1 in sent:  # then the unit before orthogonalized (once all ranks sent it)
                back[k - 1] = [max(t[r], max(sent[k - 1])) + units[k - 1][r] for r in range(world)]
                t = list(back[k - 1])
            if k - 2 in back:  # then the one before that landed (once every owner sent it)
                t = [max(x, max(back[k - 2])) for x in t]
        best = max(whole.flops)
        out.append(dict(world=world, waited=sum(max(u) for u in units) / best,
                        in_flight=max(t) / best))
    return out


def ns_alone(cfg: GPTConfig, worlds, steps: int) -> dict[int, float]:
    """Per world size: the seconds of Newton-Schulz of its busiest rank's owned batches, timed
    here in one process, one after another (a rank's compute without the others contending
    for the cores)."""
    from fz3.optim.newton_schulz import orthogonalize
    from fz3.optim.owners import plan
    from fz3.sharding.parts import partition

    torch.manual_seed(0)
    module = GPT(cfg)
    out = {}
    for world in worlds:
        p = plan(partition(module, ["blocks"], world, between=[]).parts, world, 5)
        busiest = max(range(world), key=lambda r: p.flops[r])
        owned = [torch.randn(n, *shape).bfloat16() for shape, n in p.exchange(busiest).groups]
        out[world] = _median_step(lambda: [orthogonalize(x, (3.4445, -4.775, 2.0315), 5, 1e-7)
                                           for x in owned], steps)
    return out


def _grads(module, rank, world):
    batch = synthetic_batch(CFG, 4 * world, seed=0)
    return tuple(t.chunk(world)[rank] for t in batch)


def _median_step(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def torch_job(steps: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = GPT(CFG)
    module(*synthetic_batch(CFG, 4, seed=0)).backward()
    muon = [p for n, p in module.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    rest = [p for n, p in module.named_parameters() if not (n.startswith("blocks.") and p.dim()
                                                            == 2)]
    opts = torch.optim.Muon(muon, **MUON), torch.optim.AdamW(rest, fused=True, **ADAM)
    return dict(step_s=_median_step(lambda: [o.step() for o in opts], steps))


def fz3_job(rank: int, world: int, steps: int) -> dict:
    import fz3
    from fz3.models import shard_gpt
    from fz3.optim.newton_schulz import orthogonalize
    from fz3.optim.owners import plan

    torch.manual_seed(0)
    model, params = shard_gpt(GPT(CFG))
    _, grads = fz3.value_and_grad(model, trace=False)(params, _grads(None, rank, world))
    opt = fz3.optim.muon(model, **MUON, others=fz3.optim.adamw(**ADAM))
    box = [params, opt.init(params)]

    def step():
        box[0], box[1] = fz3.optim.step(opt, grads, box[1], box[0], donate=True)

    ex = plan(model.parts, world, 5).exchange(rank)
    owned = [torch.randn(n, *shape).bfloat16() for shape, n in ex.groups]
    ns = lambda: [orthogonalize(x, (3.4445, -4.775, 2.0315), 5, 1e-7) for x in owned]  # noqa
    return dict(step_s=_median_step(step, steps), ns_s=_median_step(ns, steps))


def fsdp2_job(rank: int, world: int, steps: int) -> dict:
    """FSDP2 + torch.optim.Muon on the DTensor parameters: what happens, and if it steps,
    how far from one process of torch.optim.Muon on the same full tensors."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    module = GPT(CFG)
    plain = {n: p.detach().clone() for n, p in module.named_parameters()}
    for block in module.blocks:
        fully_shard(block)
    fully_shard(module)
    module(*_grads(None, rank, world)).backward()
    named = dict(module.named_parameters())
    muon = {n: p for n, p in named.items() if n.startswith("blocks.") and p.dim() == 2}
    opt = torch.optim.Muon(list(muon.values()), **MUON)
    grads = {n: p.grad.full_tensor() for n, p in muon.items()}
    try:
        with CommDebugMode() as comms:
            opt.step()
    except Exception as e:  # noqa: BLE001 - what happens is the result
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    collectives = sum(comms.get_comm_counts().values())
    ref = {n: plain[n].clone().requires_grad_() for n in muon}
    for n, p in ref.items():
        p.grad = grads[n]
    torch.optim.Muon(list(ref.values()), **MUON).step()
    rel = max(float((muon[n].full_tensor() - ref[n]).norm() / ref[n].norm()) for n in muon)
    return dict(rel_error_vs_torch=rel, collectives_per_step=collectives,
                matrices=len(muon), step_s=_median_step(opt.step, steps))


def _rank(rank: int, world: int, store: str, kind: str, steps: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = (fz3_job if kind == "fz3" else fsdp2_job)(rank, world, steps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def run(kind: str, world: int, steps: int) -> dict:
    """One job in fresh processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        if kind == "torch":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=_torch_process, args=(steps, q))
            p.start()
            result = q.get()
            p.join()
            return result
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), kind, steps, out), nprocs=world)
        with open(out) as f:
            return json.load(f)


def _torch_process(steps: int, q) -> None:
    q.put(torch_job(steps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    repeats, steps = (1, 2) if a.quick else (a.repeats, a.steps)
    print(f"model: GPT {CFG}")
    for row in unit_paths(CFG) + unit_paths(TRAIN_STEP_CFG):
        print(f"counted train_step critical path w={row['world']}: each unit waited "
              f"{row['waited']:.2f}x optim.step's, in flight {row['in_flight']:.2f}x")
    table = counts(CFG)
    big = counts(BIG, (2, 4, 8, 16, 32, 64), device="meta")
    for row in table + big:
        print(f"counted w={row['world']}: {row['matrices']} matrices; NS FLOPs max/mean "
              f"{row['flops_max_over_mean']:.3f} (bound {row['bound']:.3f}); bytes sent "
              f"{row['bytes_sent_max'] / 2**20:.2f} MiB = {row['sent_over_shard']:.2f}x the "
              f"matrices' fp32 shard ({row['shard_bytes'] / 2**20:.2f} MiB)")
    torch.set_num_threads(1)
    alone = ns_alone(CFG, (1, 2, 4, 8), steps)
    print("Newton-Schulz of the busiest rank, alone: "
          + ", ".join(f"w={w} {t * 1e3:.1f} ms" for w, t in alone.items()))
    jobs = [("torch", 1), ("fz3", 1), ("fz3", 2), ("fsdp2", 2)]
    results: dict[str, list[dict]] = {f"{k} w={w}": [] for k, w in jobs}
    for _ in range(repeats):  # interleaved
        for kind, world in jobs:
            results[f"{kind} w={world}"].append(run(kind, world, steps))
    summary = {}
    for name, rs in results.items():
        if "error" in rs[0]:
            summary[name] = rs[0]
        else:
            summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{name}: {summary[name]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"counts": table, "counts_big": big, "ns_alone_s": alone, "timed": summary,
                       "repeats": repeats, "steps": steps},
                      f, indent=1)


if __name__ == "__main__":
    main()
