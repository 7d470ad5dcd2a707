"""Bit-for-bit results of a few test models under every policy, to compare two checkouts of fz3.

    PYTHONPATH=/path/to/a python benchmarks/bitwise.py --out /tmp/a.pt   # ~1-2 min per world size
    PYTHONPATH=/path/to/b python benchmarks/bitwise.py --out /tmp/b.pt
    python benchmarks/bitwise.py --compare /tmp/a.pt /tmp/b.pt          # one line per case

Runs the GPT (``fz3.models.gpt``), a tied-embedding GPT and a model with per-layer aux outputs
(``layer_aux``) at world sizes 1 and 2 (gloo, on 127.0.0.1), under ``save``, ``recompute``,
``selective``, a mixed plan, ``join_grads``, two layers per unit with an all-reduce,
``accumulate`` (both policies), bf16 compute and hybrid sharding (world 2), each traced and with
``trace=False``; two AdamW steps each. Saves every loss, gradient and parameter by case, on
rank 0 (each rank's own shards, by rank). ``--compare`` says which cases differ (``torch.equal``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch import nn

import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab=37, seq=8, dim=16, heads=2, layers=4)
POLICIES = {
    "save": fz3.Policy(activations="save"),
    "recompute": fz3.Policy(activations="recompute"),
    "selective": fz3.Policy(activations="selective"),
    "mixed": fz3.Policy(activations=fz3.keep(ops=("mm",)), layers_per_unit=2),
    "k2_all_reduce": fz3.Policy(layers_per_unit=2, reduce="all_reduce"),
    "join_grads": fz3.Policy(join_grads=True),
    "no_reshard": fz3.Policy(reshard_after_forward=False),
}


class Routed(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.router, self.mlp = nn.Linear(width, 3), nn.Linear(width, width)

    def forward(self, h):
        probs = torch.softmax(self.router(h), dim=-1)
        return h + torch.tanh(self.mlp(h)), probs.sum(dim=(0, 1))


class AuxNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.layers = nn.ModuleList([Routed(8) for _ in range(4)])


def aux_pre(m, x):
    return m.embed(x)


def aux_post(m, h, x, aux):
    return m.head(h).pow(2).mean() + 0.01 * (aux[0] ** 2).sum()


def models(precision=None):
    """(name, model, params, batch maker) per test model."""
    torch.manual_seed(0)
    gpt = GPT(CFG)
    torch.manual_seed(0)
    tied = GPT(GPTConfig(**{**CFG.__dict__, "tie": True}))
    kw = {} if precision is None else {"precision": precision}
    out = [("gpt",) + shard_gpt(gpt, **kw), ("tied",) + shard_gpt(tied, **kw)]
    model, params = fz3.shard(AuxNet(), "layers", aux_pre, aux_post, layer_aux=True,
                              assign={"head.weight": "post", "head.bias": "post"}, **kw)
    out.append(("aux", model, params))
    return out


def batch(name: str, rank: int, step: int):
    if name == "aux":
        return torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    return synthetic_batch(CFG, 2, 100 * step + rank)


def run_case(model, params, name, rank, step_fn):
    opt = fz3.optim.adamw(lr=1e-2)
    state = opt.init(params)
    got = []
    for step in range(2):
        loss, grads = step_fn(params, step)
        params, state = fz3.optim.step(opt, grads, state, params)
        got.append((loss.detach().clone(), [g.clone() for g in grads.parts],
                    [p.clone() for p in params.parts]))
    return got


def ranks(rank, world, store, out):
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for precision in (None, fz3.Precision(torch.bfloat16, torch.float32)):
        for name, model, params in models(precision):
            if precision is not None and name == "aux":  # (its batch is fp32: not a bf16 model)
                continue
            policies = dict(POLICIES)
            if precision is not None:  # bf16: two policies are enough
                policies = {k: policies[k] for k in ("save", "recompute")}
            for pname, policy in policies.items():
                for trace in (True, False):
                    f = fz3.value_and_grad(model, policy, trace=trace, check_sync=False)
                    key = (name, "bf16" if precision else "fp32", pname, trace)
                    try:
                        results[key] = run_case(model, params, name, rank,
                                                lambda p, s: f(p, batch(name, rank, s)))
                    except Exception as e:  # noqa: BLE001 - reported, compared as a result
                        results[key] = repr(e)
            if precision is None:
                for acc in ("reduce", "defer"):
                    for trace in (True, False):
                        f = fz3.accumulate(model, fz3.Policy(), policy=acc, trace=trace,
                                           check_sync=False)
                        key = (name, "fp32", f"accumulate_{acc}", trace)
                        results[key] = run_case(model, params, name, rank, lambda p, s: f(
                            p, [batch(name, rank, s), batch(name, rank, s + 7)]))
    if world == 2:  # hybrid: two replicas of one shard each
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model, params = shard_gpt(GPT(CFG), mesh=mesh)
        for pname in ("save", "recompute"):
            for trace in (True, False):
                f = fz3.value_and_grad(model, POLICIES[pname], trace=trace, check_sync=False)
                results[("gpt", "hybrid", pname, trace)] = run_case(
                    model, params, "gpt", rank, lambda p, s: f(p, batch("gpt", rank, s)))
    torch.save(results, out.format(rank=rank))
    tdist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        a, b = (torch.load(p) for p in args.compare)
        for key in sorted(a, key=str):
            same = _equal(a[key], b.get(key))
            print(("same " if same else "DIFF ") + " ".join(map(str, key)))
        return
    print("fz3 from", fz3.__file__, file=sys.stderr)
    everything = {}
    for world in map(int, args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r{rank}.pt")
            mp.start_processes(ranks, args=(world, os.path.join(tmp, "store"), out),
                               nprocs=world, start_method="spawn")
            for r in range(world):
                for key, value in torch.load(out.format(rank=r)).items():
                    everything[(world, r, *key)] = value
    torch.save(everything, args.out)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and \
            all(_equal(x, y) for x, y in zip(a, b))
    return a == b


if __name__ == "__main__":
    main()
