"""``fz3.train_step``: the optimizer in the schedule.

Its step equals ``value_and_grad`` followed by ``fz3.optim.step(..., donate=True)`` bit for
bit: per unit for AdamW, Muon and a freeze chain (an ``update`` op after each
``wait_reduce``; Muon's exchanges in flight across updates), per unit after the backward for
a clipping chain (it needs the whole gradient's norm first), after the backward for a
longer chain. AdamW's per-unit form
is checked against its fused whole-tree step here too, in one process, on moments as a few
steps leave them (the CPU kernel's scalar tail rounds ``exp_avg_sq`` otherwise than its
vector loop: rows stepped as tensors of their own differ in the last bit, ``fz3.optim.aligned``).
"""

from __future__ import annotations

import logging
import random

import optree
import pytest
import torch

import dist
import fz3
from fz3 import Op
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from fz3.observe.live_bytes import LiveBytes
from fz3.optim.adamw import SLICE_MIN_ELEMENTS
from fz3.sharding.model import Params
from fz3.optim.freeze import keep_mask
from fz3.optim.per_unit import placement
from reference import batches, fz3_said, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3)


def _leaves(tree) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _masks(kind: str, rows: int, n: int, g: torch.Generator):
    if kind == "none":
        return None
    if kind == "shared":  # decay_mask's (1, n): the masked pass for short rows, slices for long
        return Params((torch.rand(1, n, generator=g) > 0.5, torch.rand(37, generator=g) > 0.5))
    return Params((torch.rand(rows, n, generator=g) > 0.5, torch.ones(37, dtype=torch.bool)))


def test_adamw_per_unit_is_its_fused_step_bit_for_bit():
    rnd, g = random.Random(0), torch.Generator().manual_seed(0)
    # (3, 0): a rank whose shard of a Muon stack's rest is empty (its mask has no elements)
    for rows, n in [(6, 1037), (5, 3), (4, 16), (3, 2 * SLICE_MIN_ELEMENTS + 7), (3, 0)]:
        for kind in ("none", "shared", "per_row"):
            params = Params((torch.randn(rows, n, generator=g), torch.randn(37, generator=g)))
            opt = fz3.optim.adamw(lr=lambda t: 1e-2 / t, weight_decay=0.1,
                                  mask=_masks(kind, rows, n, g))
            state = fz3.optim.AdamWState(torch.tensor(4), *(optree.tree_map(
                lambda p: torch.rand(p.shape, generator=g) * s, params) for s in (0.1, 0.01)))
            whole = optree.tree_map(torch.clone, (params, state))
            units = optree.tree_map(torch.clone, (params, state))
            for _ in range(2):
                grads = optree.tree_map(lambda p: torch.randn(p.shape, generator=g), params)
                whole = fz3.optim.step(opt, grads, whole[1], whole[0], donate=True)
                cuts = sorted(rnd.sample(range(1, rows), rnd.randint(0, rows - 1)))
                spans = list(zip([0, *cuts], [*cuts, rows]))
                rnd.shuffle(spans)  # any order the schedule lands them in
                step = fz3.optim.per_unit(opt, *units)
                for a, b in spans:
                    step.update(0, slice(a, b), grads.parts[0][a:b].clone())
                step.update(1, None, grads.parts[1].clone())
                units = step.finish()
            for x, y in zip(_leaves(whole), _leaves(units)):
                assert torch.equal(x, y), (rows, n, kind, spans)
    for n in (5, 16):  # 16: whole 16-element chunks, nothing left pending by the kernel's tasks
        zeros = Params((torch.zeros(4, n),))
        step = fz3.optim.per_unit(fz3.optim.adamw(), zeros, fz3.optim.adamw().init(zeros))
        step.update(0, slice(0, 2), torch.zeros(2, n))
        with pytest.raises(ValueError, match=r"leaf 0's layers \[1\] stepped twice"):
            step.update(0, slice(1, 2), torch.zeros(1, n))
        with pytest.raises(RuntimeError, match=r"leaves \[0\] were not stepped whole"):
            step.finish()


def test_update_ops_are_validated_and_printed():
    sched = fz3.schedule.planner.updating(fz3.plan(2, fz3.Policy()))
    ops = list(sched.ops)
    for u in range(len(sched.units)):
        assert ops.index(Op("update", u)) == ops.index(Op("wait_reduce", u)) + 1
    assert "update" in str(sched) and sched.updates
    last = fz3.schedule.planner.updating(fz3.plan(2, fz3.Policy()), last=True)  # clip first
    n = len(last.units)
    assert [o.kind for o in last.ops[-n:]] == ["update"] * n and last.ops[:-n] == tuple(
        o for o in ops if o.kind != "update")
    with pytest.raises(fz3.ScheduleError, match="steps nothing before the whole gradient"):
        fz3.schedule.planner.updating(sched, last=True)
    bad = [o for o in ops if o != Op("update", 1)]
    with pytest.raises(fz3.ScheduleError, match=r"never applied \(no update op\): layers.0"):
        fz3.validate(fz3.Schedule(tuple(bad), sched.units))
    i = ops.index(Op("wait_reduce", 1))
    early = ops[:i] + [Op("update", 1)] + [o for o in ops[i:] if o != Op("update", 1)]
    with pytest.raises(fz3.ScheduleError, match="reducing: an update steps a unit's"):
        fz3.validate(fz3.Schedule(tuple(early), sched.units))
    again = ops + [Op("gather", 1)]
    with pytest.raises(fz3.ScheduleError, match="layers.0 is gathered after its update"):
        fz3.validate(fz3.Schedule(tuple(again), sched.units))
    with pytest.raises(ValueError, match="only fz3.train_step runs them"):
        fz3.step.front.check_schedule(_TwoLayers, sched, grad=True)
    i = ops.index(Op("update", 1))
    gathering = ops[:i] + [Op("gather", 1)] + ops[i:]
    with pytest.raises(fz3.ScheduleError, match="layers.0 is being gathered while its update"):
        fz3.validate(fz3.Schedule(tuple(gathering), sched.units))
    joined = fz3.plan(2, fz3.Policy(join_grads=True))
    assert joined.join_grads and not fz3.schedule.planner.updating(joined).join_grads
    with pytest.raises(ValueError, match="fz3.deferred takes a schedule without update ops"):
        fz3.deferred(sched)


class _TwoLayers:
    """Only what check_schedule reads of a model: its parts."""

    structure = parts = fz3.schedule.structure.layers_only(2)


def _optimizers(model, policy=None):
    # k2: a mask of each layer's own (the fc weights of every layer undecayed)
    mask = (fz3.decay_mask(model) if policy != "k2" else
            keep_mask(model, lambda name: name.endswith("fc.weight")))
    return {"adamw": fz3.optim.adamw(lr=1e-2, weight_decay=0.1, mask=mask),
            "muon": fz3.optim.muon(model, lr=0.02),
            "clip": fz3.optim.chain(fz3.optim.clip_by_global_norm(0.05, model),
                                    fz3.optim.adamw(lr=1e-2)),
            "freeze": fz3.optim.chain(fz3.optim.adamw(lr=1e-2, weight_decay=0.1),
                                      fz3.optim.freeze(model, {"blocks.1.fc.weight",
                                                               "tok.weight"})),
            # no per-unit form (a longer chain): after the backward, said once
            "chain3": fz3.optim.chain(fz3.optim.clip_by_global_norm(0.05, model),
                                      fz3.optim.clip_by_global_norm(0.04, model),
                                      fz3.optim.adamw(lr=1e-2))}


def _equal_to_value_and_grad_then_step(rank: int, world: int) -> dict:
    model, params = shard_gpt(gpt(CFG))
    out = {}
    for policy in (None, "save", "k2"):  # k2: two layers a unit (a Muon exchange of both),
        # all-reduced, through autograd (tracing costs seconds a step function)
        pol = policy and fz3.Policy(**({"layers_per_unit": 2, "reduce": "all_reduce"}
                                       if policy == "k2" else {"activations": policy}))
        trace = policy != "k2"
        vg = fz3.value_and_grad(model, pol, trace=trace)
        for name, opt in _optimizers(model, policy).items():
            if policy == "k2" and name in ("chain3", "freeze"):
                continue
            with fz3_said(logging.WARNING) as said:
                step = fz3.train_step(model, opt, pol, trace=trace)
            assert (rank == 0 and name == "chain3") == any("no per-unit form" in m for m in said)
            a = optree.tree_map(torch.clone, params)
            a = (a, opt.init(a))
            b = optree.tree_map(torch.clone, a)
            for i in range(2):  # the second with moments and momentum not zero
                batch = batches(CFG, world, step=i)[rank]
                loss_a, grads = vg(a[0], batch)
                a = fz3.optim.step(opt, grads, a[1], a[0], donate=True)
                loss_b, *b = step(b[0], b[1], batch)
                assert torch.equal(loss_a, loss_b), (policy, name, i)
            same = all(torch.equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))
            out[policy, name] = same, step.each_unit
    donated = optree.tree_map(torch.clone, params)
    step = fz3.train_step(model, _optimizers(model)["adamw"], trace=False)
    state = step.opt.init(donated)
    batch = batches(CFG, world)[rank]
    through = optree.tree_map(torch.clone, (params, state))
    want = step(donated, state, batch)[1:]
    with pytest.raises(ValueError, match="donate"):
        step(donated, state, batch)
    with pytest.raises(ValueError, match="loss-scaled step is checked for overflow"):
        step(*want, batch, loss_scale=1024.0)  # refused locally, the trees kept
    out["step_through"] = _stepped_through(model, step, through, batch, want)
    out["in_flight"] = _muon_in_flight(model, params, batch)
    return out


def _muon_in_flight(model, params, batch) -> tuple[list, list]:
    """Under Muon a stack unit's exchange is in flight while the units below run their
    backward: its matrices are written by the second update after its own (the first sends
    the orthogonalized slices back), the last ones when the step finishes. Per update frame,
    the stack layers whose rows have changed, and those that should have."""
    opt = fz3.optim.muon(model, lr=0.02)
    units = fz3.train_step(model, opt, trace=False).schedule.units  # step_through's
    start = optree.tree_map(torch.clone, params)
    stack = next(i for i, p in enumerate(model.parts) if p.role.name == "STACK")
    live, before = start.parts[stack], start.parts[stack].clone()  # stepped in place
    seen, want, updated = [], [], []  # updated: per update so far, the stack layers it sent
    for f in fz3.step_through(model, start, batch, opt=opt, opt_state=opt.init(start)):
        if f.phase == "update":
            u = units[f.unit]
            updated.append(list(u.layers) if u.part == stack else [])
            seen.append([j for j in range(live.shape[0]) if not torch.equal(live[j], before[j])])
            want.append(sorted(j for layers in updated[:-2] for j in layers))
    return seen, want


def _stepped_through(model, step, start, batch, want) -> bool:
    """step_through(opt=) shows an update frame right where each update op is, and ends with
    train_step's parameters and state; stopped after an update, its trees are given up."""
    frames = list(fz3.step_through(model, *start[:1], batch, opt=step.opt, opt_state=start[1]))
    updates = [f.index for f in frames if f.phase == "update"]
    sched = frames[-1].stepped is not None and step.schedule
    assert updates == [i for i, op in enumerate(sched.ops) if op.kind == "update"], updates
    assert all(f.inputs.shape == f.outputs.shape for f in frames if f.phase == "update")
    same = all(torch.equal(x, y) for x, y in zip(_leaves(want), _leaves(frames[-1].stepped)))
    again = optree.tree_map(torch.clone, frames[-1].stepped)
    for f in fz3.step_through(model, again[0], batch, opt=step.opt, opt_state=again[1]):
        if f.phase == "update":
            break  # every rank at the same op
    with pytest.raises(ValueError, match="donate"):
        step(again[0], again[1], batch)
    return same


def test_train_step_is_value_and_grad_then_step_bit_for_bit():
    for result in dist.run(2, _equal_to_value_and_grad_then_step):
        assert result.pop("step_through")
        seen, want = result.pop("in_flight")
        assert seen == want and any(seen) and len(want[-1]) < CFG.layers, (seen, want)
        assert result == {(p, n): (True, n != "chain3") for p in (None, "save", "k2")
                          for n in ("adamw", "muon", "clip", "freeze", "chain3")
                          if p != "k2" or n not in ("chain3", "freeze")}


def _peaks(rank: int, world: int) -> dict[str, tuple]:
    cfg = GPTConfig(vocab=64, seq=8, dim=96, heads=4, layers=8)
    model, params = shard_gpt(gpt(cfg))
    adamw = fz3.optim.adamw(lr=1e-3)
    batch = batches(cfg, world)[rank]
    out = {}
    for name, opt in (("adamw", adamw), ("clip", fz3.optim.chain(
            fz3.optim.clip_by_global_norm(1e-3, model), adamw))):
        vg, step = fz3.value_and_grad(model), fz3.train_step(model, opt)
        a = (optree.tree_map(torch.clone, params), opt.init(params))
        b = optree.tree_map(torch.clone, a)
        for _ in range(2):  # the first traces; the second is measured
            with LiveBytes() as before:
                _, grads = vg(a[0], batch)
                a = fz3.optim.step(opt, grads, a[1], a[0], donate=True)
                del grads
            with LiveBytes() as after:
                _, *b = step(b[0], b[1], batch)
        plans = [fz3.memory_plan(model, s.schedule, batch) for s in (vg, step)]
        out[name] = (before.peak, after.peak, sum(p.numel() * 4 for p in params.parts),
                     *(p.peak - p.params - p.optimizer for p in plans))
    # a one-transformation chain keeps the clip chain's placement: its update ops after the
    # backward, as its step keeps every unit's gradient to the end (the plan counts them)
    wrapped = fz3.optim.chain(fz3.optim.chain(fz3.optim.clip_by_global_norm(1e-3, model), adamw))
    frozen = fz3.optim.chain(wrapped, fz3.optim.freeze(model, {"tok.weight"}))
    out["wrapped"] = placement(wrapped), placement(frozen)
    return out


def test_train_step_holds_no_whole_gradient():
    """Live bytes of a step beyond params and optimizer state (issue 53: at most those of
    value_and_grad + optim.step minus half the fp32 gradient; 27% of them here, 8 layers); the
    memory plan's saving equals the measured one (within 5%; 8 bytes apart here). Clipped,
    the whole gradient is alive once, not twice."""
    peaks = dist.run(1, _peaks)[0]
    assert peaks.pop("wrapped") == ("last", "last")
    before, after, grad_bytes, plan_before, plan_after = peaks["adamw"]
    assert after <= before - grad_bytes / 2, (before, after, grad_bytes)
    saved, planned = before - after, plan_before - plan_after
    assert abs(planned / saved - 1) <= 0.05, (saved, planned)
    # chain(clip, adamw): each unit's gradient kept to the end and scaled in place, where
    # optim.step's update path makes a clipped copy of the whole gradient (0.99 of it here)
    before, after, grad_bytes, _, plan_after = peaks["clip"]
    assert after <= before - grad_bytes / 2, (before, after, grad_bytes)
    assert plan_after >= after, (plan_after, after)  # the plan counts them to the end
