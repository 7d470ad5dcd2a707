"""Gradient shards joined after the backward (``Policy(join_grads=True)``,
``Schedule.join_grads``): each stack unit's reduce lands in rows of its own, joined into the
part's ``(L, shard)`` gradient shard once every reduce is waited, instead of the whole shard
allocated at the part's first reduce.

References: the same step with the shard allocated whole (itself tested against plain
autograd), bit for bit: the reduces are the same collectives on the same values, only where
they land differs. Memory: the plan against the step's live bytes (5%, as
``tests/test_traced_memory.py``), and the planned and live peaks against the default's on an
activation-heavy model (joining lowers them) and a thin one (joining raises them)."""

from __future__ import annotations

import optree
import pytest
import torch

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig, synthetic_batch
from reference import assert_close, batches, fz3_said, gpt, reference_grads
from test_traced import same_as_untraced

CFG = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=4, dropout=0.2)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def _both(model, params, batch, joined: fz3.Policy):
    """One step joined, one not, from the same seed: loss and gradients bitwise equal."""
    torch.manual_seed(1)
    loss, grads = fz3.value_and_grad(model, joined)(params, batch)
    torch.manual_seed(1)
    plain = fz3.Policy(**{**joined.__dict__, "join_grads": False})
    want_loss, want = fz3.value_and_grad(model, plain)(params, batch)
    assert torch.equal(loss, want_loss) and _same(grads, want), joined
    blocks = model.part_index("blocks")
    got, shard = grads.parts[blocks], want.parts[blocks]
    assert got.shape == shard.shape == (CFG.layers, shard.shape[1]) and got.is_contiguous()


def same_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG))
    bs = batches(CFG, world)
    for kw in ({}, {"activations": "save"}, {"activations": "selective"},
               {"layers_per_unit": 2}, {"layers_per_unit": 3, "prefetch": 2},
               {"reduce": "all_reduce"}):
        policy = fz3.Policy(join_grads=True, **kw)
        _both(model, params, bs[rank], policy)
        same_as_untraced(model, policy, params, bs[rank])
    # against plain autograd on the unsharded model (dropout off: the same draws there too)
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": 0.0})
    plain, plain_params = shard_gpt(gpt(cfg))
    ref_loss, want = reference_grads(gpt(cfg), bs)
    loss, grads = fz3.value_and_grad(plain, fz3.Policy(join_grads=True))(plain_params, bs[rank])
    torch.testing.assert_close(loss.item(), ref_loss, rtol=1e-5, atol=1e-6)
    full = fz3.full_state_dict(plain, grads)  # collective
    if rank == 0:
        assert_close(full, want, what="join_grads vs plain")
    # reduced in bf16: each unit's rows cast back into its own buffer
    low, low_params = shard_gpt(gpt(CFG), precision=fz3.Precision(reduce_dtype=torch.bfloat16))
    _both(low, low_params, bs[rank], fz3.Policy(join_grads=True))
    # accumulated: both policies sum the joined shards
    micro = batches(CFG, world, per_rank=1)
    for how in ("reduce", "defer"):
        runs = []
        for join in (True, False):
            torch.manual_seed(1)
            step = fz3.accumulate(model, fz3.Policy(join_grads=join), policy=how)
            runs.append(step(params, [bs[rank], micro[rank]]))
        (loss, grads), (want_loss, want) = runs
        assert torch.equal(loss, want_loss) and _same(grads, want), how
    return str(fz3.plan(model, fz3.Policy(join_grads=True))).splitlines()[1]


def test_joined_gradients_are_bitwise_those_of_the_whole_shard():
    """Recompute, save, selective, 2- and 3-layer units, all-reduce, bf16 reduce, both
    accumulations, traced and trace=False; and against plain autograd."""
    header = dist.run(2, same_ranks, timeout=300)[0]
    assert header == "gradient shards joined after the backward: blocks.0 .. blocks.3", header


HEAVY = GPTConfig(vocab=32, seq=64, dim=32, heads=2, layers=4)  # activations >> parameters
THIN = GPTConfig(vocab=32, seq=4, dim=96, heads=2, layers=8)  # parameters >> activations


def memory_ranks(rank, world):
    from fz3.observe.live_bytes import LiveBytes

    out = {}
    for name, cfg, per_rank in (("heavy", HEAVY, 8), ("thin", THIN, 1)):
        model, params = shard_gpt(gpt(cfg))
        batch = synthetic_batch(cfg, per_rank, seed=rank)
        for join in (False, True):
            sched = fz3.plan(model, fz3.Policy(join_grads=join))
            plan = fz3.memory_plan(model, sched, batch)
            step = fz3.value_and_grad(model, sched)
            step(params, batch)  # warm: nothing cached on the first call is counted
            with LiveBytes(writes=True) as live:
                step(params, batch)
            predicted = plan.peak - plan.params - plan.optimizer
            assert abs(predicted / live.peak - 1) <= 0.05, (name, join, predicted, live.peak)
            out[name, join] = (plan.peak, live.peak)
    return out


def test_joining_lowers_the_peak_where_activations_outweigh_the_shard():
    """Planned and live peaks, one rank, recompute: lower joined on the activation-heavy model
    (its blocks' whole shard was alive beside the last layer's recomputed activations),
    higher on the thin one (the rows and the joined shard, twice its eight layers' shard, are
    alive together at the end; not joined, the shard beside one gathered unit)."""
    got = dist.run(1, memory_ranks, timeout=300)[0]
    for what in (0, 1):  # planned, live
        assert got["heavy", True][what] < got["heavy", False][what], got
        assert got["thin", True][what] > got["thin", False][what], got


def budget_ranks(rank, world):
    """The budget planner takes whichever of join / not has the lower planned peak, and says
    which in its INFO line."""
    out = []
    for cfg, per_rank in ((HEAVY, 8), (THIN, 1)):
        model, params = shard_gpt(gpt(cfg))
        batch = synthetic_batch(cfg, per_rank, seed=rank)
        peaks = {join: fz3.memory_plan(model, fz3.plan(model, fz3.Policy(join_grads=join)),
                                       batch).peak for join in (False, True)}
        with fz3_said() as said:
            chosen = fz3.plan(model, memory=min(peaks.values()), batch=batch, params=params)
        assert fz3.memory_plan(model, chosen, batch).peak <= min(peaks.values())
        line = [m for m in said if "fz3.plan: memory=" in m][-1]
        out.append((bool(chosen.join_grads), line.split("gradient shards ")[1][:6]))
    return out


def test_the_budget_planner_joins_where_that_fits_more():
    assert dist.run(1, budget_ranks, timeout=300) == [[(True, "joined"), (False, "whole;")]]


def test_join_grads_is_refused_where_there_is_no_stack_gradient():
    sched = fz3.plan(4, fz3.Policy(join_grads=True))
    assert sched.join_grads == {1}
    assert sched.fingerprint != fz3.plan(4).fingerprint
    assert fz3.plan(4, fz3.Policy(join_grads=True), grad=False).join_grads == frozenset()
    with pytest.raises(fz3.ScheduleError, match=r"join_grads=\[0\]: only the gradients of "
                                                r"stack parts \(\[1\]\)"):
        fz3.validate(fz3.Schedule(sched.ops, sched.units, join_grads={0}))
    forward = fz3.plan(4, grad=False)
    with pytest.raises(fz3.ScheduleError, match=r"of a training schedule \(grad=True\)"):
        fz3.validate(fz3.Schedule(forward.ops, forward.units, grad=False, join_grads={1}))
