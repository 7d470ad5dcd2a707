"""Reviewer script: train_step vs value_and_grad + optim.step(donate=True), torch.equal per leaf."""
import sys, os, logging
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import optree, torch
import dist, fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, gpt


def leaves(t):
    return [x for x in optree.tree_leaves(t) if isinstance(x, torch.Tensor)]


def opts(model, names):
    F = fz3.optim
    sched = lambda t: 0.02 / t  # noqa
    all_ = {
        "muon": lambda: F.muon(model, lr=0.02),
        "muon_nonest": lambda: F.muon(model, lr=0.02, nesterov=False),
        "muon_sched": lambda: F.muon(model, lr=sched, weight_decay=0.0),
        "adamw_sched": lambda: F.adamw(lr=sched, weight_decay=0.1),
        "clip_adamw": lambda: F.chain(F.clip_by_global_norm(0.05, model), F.adamw(lr=1e-2)),
        "clip_adamw_big": lambda: F.chain(F.clip_by_global_norm(1e6, model), F.adamw(lr=1e-2)),
        "clip_muon": lambda: F.chain(F.clip_by_global_norm(0.05, model), F.muon(model, lr=0.02)),
        "clip_muon_nonest": lambda: F.chain(F.clip_by_global_norm(0.05, model),
                                            F.muon(model, lr=0.02, nesterov=False)),
        "clip_chain1": lambda: F.chain(F.clip_by_global_norm(0.05, model), F.chain(F.adamw(lr=1e-2))),
        "chain1_clip": lambda: F.chain(F.chain(F.clip_by_global_norm(0.05, model), F.adamw(lr=1e-2))),
    }
    return {n: all_[n]() for n in names}


def ranks(rank, world, cfg_kw, shard_kw, pol_kw, names, steps=3):
    mesh_shape = shard_kw.pop("_mesh", None)
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    module = gpt(cfg)
    fr = shard_kw.pop("_freeze", False)
    if fr == "many":
        for n, p in module.named_parameters():
            if any(k in "." + n for k in ("tok.", "pos.", ".attn.qkv.", ".ln1.")):
                p.requires_grad_(False)
    elif fr:
        module.pos.weight.requires_grad_(False)
    if mesh_shape:
        from torch.distributed.device_mesh import init_device_mesh
        shard_kw["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    if "precision" in shard_kw:
        shard_kw["precision"] = fz3.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
            if shard_kw["precision"] == "bf16" else shard_kw["precision"]
    model, params = shard_gpt(module, **shard_kw)
    pol = fz3.Policy(**pol_kw) if pol_kw else None
    out = {}
    vg = fz3.value_and_grad(model, pol, trace=False)
    for name, opt in opts(model, names).items():
        step = fz3.train_step(model, opt, pol, trace=False)
        a = optree.tree_map(torch.clone, params)
        a = (a, opt.init(a))
        b = optree.tree_map(torch.clone, a)
        ok = True
        for i in range(steps):
            batch = batches(cfg, world if not mesh_shape else world, step=i)[rank]
            la, g = vg(a[0], batch)
            a = fz3.optim.step(opt, g, a[1], a[0], donate=True)
            lb, *b = step(b[0], b[1], batch)
            ok &= bool(torch.equal(la, lb))
        la_, lb_ = leaves(a), leaves(b)
        bad = [j for j, (x, y) in enumerate(zip(la_, lb_)) if not torch.equal(x, y)]
        out[name] = (ok and not bad and len(la_) == len(lb_), step.each_unit, bad)
    return out


CFGS = {
    "w1": (1, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3), {}, {}),
    "w2": (2, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3), {}, {}),
    "w3": (3, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3), {}, {}),
    "w2k2": (2, dict(vocab=37, seq=8, dim=20, heads=4, layers=4, mlp_ratio=3), {}, dict(layers_per_unit=2)),
    "w3k2odd": (3, dict(vocab=37, seq=8, dim=20, heads=4, layers=5, mlp_ratio=3), {}, dict(layers_per_unit=2)),
    "w3k3": (3, dict(vocab=37, seq=8, dim=20, heads=4, layers=4, mlp_ratio=3), {}, dict(layers_per_unit=3)),
    "w2tie_frozen": (2, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3, tie=True),
                     dict(_freeze=True), {}),
    "w3tie": (3, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3, tie=True), {}, {}),
    "w2bf16": (2, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3), dict(precision="bf16"), {}),
    "w3frozen_many": (3, dict(vocab=37, seq=8, dim=36, heads=4, layers=3), dict(_freeze="many"), {}),
    "w2frozen_many_k2": (2, dict(vocab=37, seq=8, dim=36, heads=4, layers=4), dict(_freeze="many"),
                         dict(layers_per_unit=2)),
    "w4hybrid22": (4, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3, tie=True),
                   dict(_mesh=(2, 2)), {}),
    "w4hybrid22k2": (4, dict(vocab=37, seq=8, dim=20, heads=4, layers=4, mlp_ratio=3),
                   dict(_mesh=(2, 2)), dict(layers_per_unit=2, reduce="all_reduce")),
    "w3bf16k3": (3, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3, tie=True),
                 dict(precision="bf16", _freeze=True), dict(layers_per_unit=3)),
    "w2save_ar": (2, dict(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3), {},
                  dict(activations="save", reduce="all_reduce")),
}

if __name__ == "__main__":
    which = sys.argv[1].split(",")
    names = sys.argv[2].split(",")
    for w in which:
        world, cfg, sk, pk = CFGS[w]
        res = dist.run(world, ranks, cfg, dict(sk), pk, names, timeout=600)
        for n in names:
            vals = [r[n] for r in res]
            print(w, n, "OK" if all(v[0] for v in vals) else f"DIFF {vals}", "each_unit=%s" % vals[0][1], flush=True)
