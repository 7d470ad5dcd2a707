"""Reviewer probes: placement of chain(chain(clip, adamw)); step_through frames under clip;
step_through stopped with Muon exchanges in flight, then train_step goes on."""
import sys, os
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import optree, torch
import dist, fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from fz3.observe.live_bytes import LiveBytes
from reference import batches, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3)


def leaves(t):
    return [x for x in optree.tree_leaves(t) if isinstance(x, torch.Tensor)]


def placement_and_memory(rank, world):
    cfg = GPTConfig(vocab=64, seq=8, dim=96, heads=4, layers=8)
    model, params = shard_gpt(gpt(cfg))
    F = fz3.optim
    batch = batches(cfg, world)[rank]
    out = {}
    for name, opt in (("clip", F.chain(F.clip_by_global_norm(1e-3, model), F.adamw(lr=1e-3))),
                      ("wrapped", F.chain(F.chain(F.clip_by_global_norm(1e-3, model),
                                                  F.adamw(lr=1e-3))))):
        step = fz3.train_step(model, opt, trace=False)
        kinds = [o.kind for o in step.schedule.ops]
        n = len(step.schedule.units)
        last = all(k == "update" for k in kinds[-n:])
        b = (optree.tree_map(torch.clone, params), opt.init(params))
        for _ in range(2):
            with LiveBytes() as lb:
                _, *b = step(b[0], b[1], batch)
        plan = fz3.memory_plan(model, step.schedule, batch, trace=False)
        out[name] = dict(per_unit_last=opt.per_unit_last, updates_last=last,
                         measured=lb.peak, plan=plan.peak - plan.params - plan.optimizer)
    return out


def frames_under_clip(rank, world):
    model, params = shard_gpt(gpt(CFG))
    F = fz3.optim
    opt = F.chain(F.clip_by_global_norm(float(os.environ.get("MAXN", "1e-3")), model), F.adamw(lr=1e-2))
    batch = batches(CFG, world)[rank]
    st = (optree.tree_map(torch.clone, params), opt.init(params))
    frames = list(fz3.step_through(model, st[0], batch, opt=opt, opt_state=st[1]))
    ups = [f for f in frames if f.phase == "update"]
    # what value_and_grad says the reduced gradient is
    _, grads = fz3.value_and_grad(model, trace=False)(optree.tree_map(torch.clone, params), batch)
    g = grads.parts
    res = []
    sched = fz3.train_step(model, opt, trace=False).schedule
    for f in ups:
        u = sched.units[f.unit]
        want = g[u.part] if u.role.name != "STACK" else g[u.part][u.layers.start:u.layers.stop]
        res.append(bool(torch.equal(f.inputs.reshape(want.shape), want)))
    return res, float(frames[-1].stepped[1][0].norm)


def stop_then_go_on(rank, world):
    """step_through(opt=muon) stopped after the 2nd stack update (exchanges in flight); then
    train_step on fresh trees must still equal value_and_grad + optim.step."""
    model, params = shard_gpt(gpt(CFG))
    opt = fz3.optim.muon(model, lr=0.02)
    batch = batches(CFG, world)[rank]
    st = (optree.tree_map(torch.clone, params), opt.init(params))
    n = 0
    for f in fz3.step_through(model, st[0], batch, opt=opt, opt_state=st[1]):
        if f.phase == "update":
            n += 1
            if n == 3:
                break
    step = fz3.train_step(model, opt, trace=False)
    vg = fz3.value_and_grad(model, trace=False)
    a = (optree.tree_map(torch.clone, params), opt.init(params))
    b = optree.tree_map(torch.clone, a)
    for i in range(2):
        bt = batches(CFG, world, step=i)[rank]
        _, g = vg(a[0], bt)
        a = fz3.optim.step(opt, g, a[1], a[0], donate=True)
        _, *b = step(b[0], b[1], bt)
    return all(torch.equal(x, y) for x, y in zip(leaves(a), leaves(b)))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "mem":
        print(dist.run(1, placement_and_memory, timeout=600))
    elif what == "frames":
        print(dist.run(2, frames_under_clip, timeout=600))
    elif what == "stop":
        print(dist.run(3, stop_then_go_on, timeout=600))


def delayed(rank, world):
    import dataclasses
    model, params = shard_gpt(gpt(CFG))
    model = dataclasses.replace(model, comm=dataclasses.replace(model.comm, delay_s=0.01))
    F = fz3.optim
    out = {}
    for name, opt in (("muon", F.muon(model, lr=0.02)),
                      ("clip_muon", F.chain(F.clip_by_global_norm(0.05, model), F.muon(model, lr=0.02))),
                      ("clip_clip_adamw", F.chain(F.clip_by_global_norm(0.05, model),
                                                  F.chain(F.clip_by_global_norm(0.04, model), F.adamw(lr=1e-2))))):
        step = fz3.train_step(model, opt, trace=False)
        vg = fz3.value_and_grad(model, trace=False)
        a = (optree.tree_map(torch.clone, params), opt.init(params))
        b = optree.tree_map(torch.clone, a)
        for i in range(2):
            bt = batches(CFG, world, step=i)[rank]
            _, g = vg(a[0], bt)
            a = fz3.optim.step(opt, g, a[1], a[0], donate=True)
            _, *b = step(b[0], b[1], bt)
        out[name] = (all(torch.equal(x, y) for x, y in zip(leaves(a), leaves(b))), step.each_unit,
                     opt.per_unit_last)
    return out


if __name__ == "__main__" and sys.argv[1] == "delay":
    print(dist.run(3, delayed, timeout=600))
