"""Reliability: ranks that disagree raise instead of hanging, a dead rank is named, bad
input is refused before collectives, runs are deterministic, and fuzzed shapes match the
plain model. Every test ends within its timeout (the harness kills hung ranks)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import time

import pytest
import torch
import torch.distributed as tdist
from hypothesis import given, settings
from hypothesis import strategies as st

import dist
import fz3
from fz3.models.gpt import GPTConfig, post, pre
from fz3.models import shard_gpt
from reference import assert_close, batches, gpt, reference_grads

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)


def disagreement_ranks(rank, world):
    # Different models on different ranks: every rank raises, naming ranks and parameter.
    for change, want in ((dict(layers=4), r"rank 0 has part blocks stack rows 3, rank 1 has part blocks stack rows 4"),
                         (dict(dim=40), r"rank 0 has tok.weight \[37, 36\] float32, rank 1 has tok.weight \[37, 40\]"),
                         (None, r"rank 0 has tok.weight \[37, 36\] float32, rank 1 has tok.weight \[37, 36\] "
                                r"float64")):
        m = gpt(CFG if rank == 0 or change is None else dataclasses.replace(CFG, **change))
        if change is None and rank == 1:
            m = m.double()
        with pytest.raises(ValueError, match=r"ranks \[1\] built a different model than rank 0: " + want):
            shard_gpt(m)
    model, params = shard_gpt(gpt(CFG))
    # Different schedules: value_and_grad refuses on every rank before anything runs.
    with pytest.raises(ValueError, match=r"ranks \[1\] planned a different schedule"):
        fz3.value_and_grad(model, fz3.Policy(prefetch=1 + rank))
    # check_sync (the default): another step count, or batches of another shape, raise instead
    # of hanging or running on.
    step = fz3.value_and_grad(model, check_sync=True)
    bs = batches(CFG, world)
    step(params, bs[rank])
    if rank == 1:
        step.steps += 3  # as if rank 1 had run three steps rank 0 never ran
    with pytest.raises(RuntimeError, match=r"rank 1 is on its step call 5 while ranks \[0\] are on call 2 \(calls of this "
                                           r"step function\)"):
        step(params, bs[rank])
    step = fz3.value_and_grad(model, check_sync=True)
    short = tuple(t[:1] for t in bs[rank]) if rank == 1 else bs[rank]
    with pytest.raises(ValueError, match=r"ranks \[1\] have batches shaped unlike rank 0's \(rank 0: batch\[0\] \[2, 8\] "
                                         r"int64, batch\[1\] \[2, 8\] int64; rank 1: batch\[0\] \[1, 8\] int64, "
                                         r"batch\[1\] \[1, 8\] int64\).*pad or drop"):
        step(params, short)
    # A batch on another device is refused locally, before any collective.
    with pytest.raises(TypeError, match=r"batch\[0\] is on meta, the model on cpu: move the batch"):
        fz3.value_and_grad(model)(params, (bs[rank][0].to("meta"), bs[rank][1]))
    # Float token ids fail inside pre on every rank alike: no rank is left in a collective.
    with pytest.raises(RuntimeError, match="indices"):
        fz3.value_and_grad(model)(params, (bs[rank][0].float(), bs[rank][1]))
    loss, _ = fz3.value_and_grad(model)(params, bs[rank])  # the group still works
    assert torch.isfinite(loss)
    # A step call rank 1 entered and left before its first collective (counted on the model,
    # whatever the step function) makes it a step ahead at the next step's check.
    if rank == 1:
        model.comm.heartbeat.entered("fz3.apply")
    with pytest.raises(RuntimeError, match=r"rank 1 is on its step call 7 while ranks \[0\] are on call 6 \(step "
                                           r"calls on this model"):
        fz3.value_and_grad(model)(params, bs[rank])
    return "ok"


def test_disagreeing_ranks_raise_everywhere():
    assert dist.run(2, disagreement_ranks, timeout=120) == ["ok"] * 2


def wrapped_ranks(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    with pytest.raises(TypeError, match=r"DistributedDataParallel wrapper; pass the plain module \(ddp.module\)"):
        fz3.shard(DistributedDataParallel(gpt(CFG)), "blocks", pre, post)
    with pytest.raises(TypeError, match=r"DistributedDataParallel wrapper"):  # not "no adapter"
        fz3.shard(DistributedDataParallel(gpt(CFG)))
    m = gpt(CFG)
    fully_shard(m)
    with pytest.raises(TypeError, match=r"already sharded by FSDP \(FSDPGPT.*before fully_shard"):
        fz3.shard(m, "blocks", pre, post)
    # post touching a layer's parameter (outside the outer unit) is named
    model, params = fz3.shard(gpt(CFG), "blocks", pre, lambda m, h, b: (h.sum() + m.blocks[0].fc.weight.sum()))
    with pytest.raises(ValueError, match=r"post read parameter 'blocks\.0\.fc\.weight', which fz3\.shard "
                                         r"placed in part 'blocks'"):
        fz3.value_and_grad(model)(params, batches(CFG, 1)[0])
    # a loss with nothing to differentiate is refused, not trained on zero gradients
    model, params = fz3.shard(gpt(CFG), "blocks", pre, lambda m, h, b: h.sum().detach())
    with pytest.raises(RuntimeError, match=r"post returned a loss that does not require grad"):
        fz3.value_and_grad(model)(params, batches(CFG, 1)[0])
    return "ok"


def test_wrapped_modules_and_uncovered_parameters():
    assert dist.run(1, wrapped_ranks) == ["ok"]


def dying_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG))
    bs = batches(CFG, world)
    fz3.value_and_grad(model)(params, bs[rank])
    t0 = time.monotonic()
    try:
        for f in fz3.step_through(model, params, bs[rank]):
            if rank == 1 and f.phase == "backward" and f.unit == 1:
                os._exit(3)  # killed in the middle of the backward
        return "finished?!"
    except fz3.RankLostError as e:
        first = (str(e), e.lost, time.monotonic() - t0)
    try:  # the agreement check a new step function starts with names the dead rank too
        fz3.value_and_grad(model)
        out = "agreed?!"
    except fz3.RankLostError as e:
        out = (*first, str(e), e.lost)
    # A survivor that returns stops its heartbeat: the other may still be judging liveness
    # (a wait drained after the first error looks again), so both stay until both are done.
    # The store's own timeout is FZ3_TEST_PG_TIMEOUT's 30 s, which a survivor on a loaded
    # machine has outwaited here (CI, "Wait timeout"); the test's 90 s bounds the whole run.
    import datetime

    from fz3.comm.compat import default_store

    default_store().set(f"test/dying/done/{rank}", "1")
    default_store().wait([f"test/dying/done/{r}" for r in (0, 2)], datetime.timedelta(seconds=80))
    return out


def test_dead_rank_is_named_in_bounded_time():
    t0 = time.monotonic()
    out = dist.run(3, dying_ranks, may_die=frozenset({1}), timeout=90, env={"FZ3_TEST_PG_TIMEOUT": "30"})
    assert out[1] is None
    for rank in (0, 2):
        msg, lost, took, agree_msg, agree_lost = out[rank]
        assert lost == [1], msg
        assert f"rank {rank}: " in msg and "rank(s) [1] stopped responding" in msg
        assert took < 30
        assert agree_lost == [1] and "value_and_grad's schedule check failed" in agree_msg, agree_msg
    assert time.monotonic() - t0 < 90


def late_ranks(rank, world):
    """Rank 1 dies between steps; rank 2 is alive but 10 s late into the next step."""
    from fz3.comm.compat import default_store as store

    model, params = shard_gpt(gpt(CFG))
    bs = batches(CFG, world)
    step = fz3.value_and_grad(model)
    step(params, bs[rank])
    tdist.barrier()
    if rank == 1:
        os._exit(3)
    if rank == 2:
        time.sleep(10)
    t0 = time.monotonic()
    try:
        step(params, bs[rank])
        return "finished?!"
    except fz3.RankLostError as e:
        out = (str(e), e.lost, e.unconfirmed, time.monotonic() - t0)
    st = store()  # rank 0 stays alive until rank 2 has judged it (an exited rank 0 is dead)
    st.add("test/late/reported", 1)
    deadline = time.monotonic() + 30
    while st.add("test/late/reported", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return out


def test_late_rank_is_not_reported_lost():
    """The reporter used to call every rank lost that reached fz3's error path more than 3 s
    after it (lost=[1, 2] here); heartbeats tell the late rank 2 from the dead rank 1."""
    out = dist.run(3, late_ranks, may_die=frozenset({1}), timeout=60, env={"FZ3_TEST_PG_TIMEOUT": "30"})
    assert out[1] is None
    for rank in (0, 2):
        msg, lost, unconfirmed, took = out[rank]
        assert (lost, unconfirmed) == ([1], []), f"rank {rank}: {msg}"
        assert "rank(s) [1] stopped responding" in msg and took < 20, (rank, took, msg)


def optimizer_dying_ranks(rank, world):
    """Rank 1 dies after its backward: clipping and the overflow check raise RankLostError."""
    model, params = shard_gpt(gpt(CFG))
    _, grads = fz3.value_and_grad(model)(params, batches(CFG, world)[rank])
    if rank == 1:
        os._exit(3)
    out = []
    for collective in (lambda: fz3.optim.clip_by_global_norm(1.0, model).update(grads, None),
                       lambda: fz3.optim.unscale(grads, fz3.optim.LossScale(), model)):
        with pytest.raises(fz3.RankLostError) as e:
            collective()
        out.append(e.value.lost)
    return out


def test_dead_rank_in_optimizer_collectives_is_named():
    """clip_by_global_norm and unscale issued their own dist.all_reduce: a dead peer gave a
    bare gloo error (or a hang) there instead of RankLostError naming it."""
    out = dist.run(2, optimizer_dying_ranks, may_die=frozenset({1}), timeout=60,
                   env={"FZ3_TEST_PG_TIMEOUT": "20"})
    assert out == [[[1], [1]], None]


def determinism_ranks(rank, world):
    torch.manual_seed(1234 + rank)
    cfg = dataclasses.replace(CFG, dropout=0.1)
    model, params = shard_gpt(gpt(cfg))
    opt = fz3.optim.adamw(lr=1e-3, weight_decay=0.1)
    state = opt.init(params)
    step, losses = fz3.value_and_grad(model), []
    for s in range(10):
        loss, grads = step(params, batches(cfg, world, step=s)[rank])
        params, state = fz3.optim.step(opt, grads, state, params)
        losses.append(float(loss))
    return pickle.dumps((losses, [t.clone() for t in params.parts]))


def test_two_runs_are_bitwise_identical():
    a = dist.run(2, determinism_ranks)
    b = dist.run(2, determinism_ranks)
    for x, y in zip(a, b):
        (la, pa), (lb, pb) = pickle.loads(x), pickle.loads(y)
        assert la == lb and all(torch.equal(u, v) for u, v in zip(pa, pb))


# Fuzzed shapes. Hypothesis draws each example in the test process and sends it to ranks
# that stay up for the whole search (dist.Pool), so every rank runs the same example and
# starting ranks is paid once per world size; shrinking a failure runs on the same ranks.
CASES = st.tuples(  # layers, heads, head_dim, vocab, seq, tie, policy
    st.integers(1, 6), st.sampled_from([1, 2, 3]), st.integers(1, 7), st.integers(5, 53),
    st.integers(1, 9), st.booleans(), st.sampled_from([fz3.Policy(), fz3.Policy(activations="save", prefetch=2),
                                    fz3.Policy(layers_per_unit=2, reduce="all_reduce")]))


def fuzz_case(rank, world, case):
    layers, heads, head_dim, vocab, seq, tie, policy = case
    cfg = GPTConfig(vocab=vocab, seq=seq, dim=heads * head_dim, heads=heads, layers=layers, tie=tie)
    module = gpt(cfg)
    model, params = shard_gpt(module)
    bs = batches(cfg, world)
    ref_loss, ref = reference_grads(module, bs)
    loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
    got = fz3.full_state_dict(model, grads)
    fz3.destroy(model)  # every rank gets here: the asserts below are local
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss) + 1e-6
    if rank == 0:
        assert_close(got, ref, what=f"fuzz {cfg} {policy} world={world}")


# No world 4 since 69f1e70 made it 50 fresh examples per world, not 4 fixed: time (4 ranks share 2 cores).
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fuzzed_shapes_equal_plain_model(world):
    """50 fresh examples per run (not derandomized: each run searches further), health checks
    on; a failure is shrunk to the smallest case that fails."""
    with dist.Pool(world) as pool:
        @settings(max_examples=50, deadline=None)
        @given(case=CASES)
        def check(case):
            pool.run(fuzz_case, case)

        check()
