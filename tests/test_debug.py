"""step_through (layer-by-layer frames, early stop on every rank) and non-finite detection.

References: the plain GPT run block by block on the rank's own batch (activations), plain
autograd over the concatenated batch (gradients: the frames' unreduced gradients summed over
ranks), and value_and_grad itself (the final frame must be identical, bit for bit).
"""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch
import torch.distributed as tdist

import dist
import fz3
from fz3.models.gpt import GPTConfig
from fz3.models import shard_gpt
from fz3.observe.live_bytes import LiveBytes
from fz3.schedule.saveable import recompute
from reference import assert_close, batches, fz3_said, gpt, reference_grads

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)


def step_through_ranks(rank, world):
    module = gpt(CFG)
    model, params = shard_gpt(module)
    bs = batches(CFG, world)
    x, y = bs[rank]
    ref_loss, ref = reference_grads(module, bs)
    with torch.no_grad():  # the plain model's activations, block by block, on this rank's batch
        acts = [module.embed(x)]
        for b in module.blocks:
            acts.append(b(acts[-1]))

    for policy in (fz3.Policy(), fz3.Policy(layers_per_unit=2, activations="save")):
        frames = list(fz3.step_through(model, params, bs[rank], policy))
        sched = fz3.plan(model, policy)
        compute = [op for op in sched.ops if op.kind in ("forward", "forward_save", "loss", "backward")]
        assert [f.op for f in frames[:-1]] == compute
        summed: dict[str, torch.Tensor] = {}
        for f in frames[:-1]:
            if f.phase == "forward" and f.name.startswith("blocks"):
                last = sched.units[f.unit].layers[-1]
                torch.testing.assert_close(f.outputs, acts[last + 1], rtol=1e-5, atol=1e-6)
                assert all(n.startswith(f"blocks.{i}.") for n in f.params for i in [int(n.split(".")[1])])
            if f.phase == "forward" and f.name == "pre":
                torch.testing.assert_close(f.outputs[0], acts[0], rtol=1e-5, atol=1e-6)
                assert "tok.weight" in f.params
            if f.phase in ("backward", "loss"):  # the loss op holds the post unit's gradient
                for n, g in f.grads.items():
                    summed[n] = g.clone()
        for g in summed.values():  # unreduced gradients of loss_r / world: their sum is the reference
            tdist.all_reduce(g)
        if rank == 0:
            assert_close({n: summed[n] for n in ref}, ref, what=f"step_through grads {policy}")
        done = frames[-1]
        assert done.phase == "done"
        loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
        assert torch.equal(done.loss, loss) and all(torch.equal(a, b) for a, b in zip(done.result.parts, grads.parts))

    # through autograd, selective runs as recompute: said once, and its frames say so
    with fz3_said(logging.WARNING) as said:
        frames = list(fz3.step_through(model, params, bs[rank],
                                       fz3.Policy(activations="selective")))
    assert {f.op.saves for f in frames[:-1] if f.phase == "forward"} == {recompute}
    assert len(said) == (rank == 0) and all("selective run as recompute" in m for m in said), said

    # A tied embedding (a shared part): its gradient is in every frame that computes some,
    # the loss's (from the head) and pre's (from the lookup), by both its names; the frames'
    # contributions summed are the reference gradient, as the README's NaN hunt needs.
    tied = gpt(dataclasses.replace(CFG, tie=True))
    tmodel, tparams = shard_gpt(tied)
    _, tref = reference_grads(tied, bs)
    summed, seen = {}, {}
    for f in fz3.step_through(tmodel, tparams, bs[rank]):
        for n, g in (f.grads or {}).items():
            summed[n] = summed[n] + g if n in summed else g.clone()
            seen.setdefault(n, []).append(f.name)
    assert seen["tok.weight"] == seen["head.weight"] == ["post", "pre"], seen
    for g in summed.values():
        tdist.all_reduce(g)
    if rank == 0:
        assert_close({n: summed[n] for n in tref}, tref, what="step_through grads, tied")

    # Stop early, on every rank at the same op: nothing hangs and the next step is right.
    for stop_at in ("forward", "backward"):
        for f in fz3.step_through(model, params, bs[rank]):
            if f.phase == stop_at and f.name == "blocks.1":
                break
        loss, grads = fz3.value_and_grad(model)(params, bs[rank])
        assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    assert fz3.any_rank(model, rank == world - 1) is True
    assert fz3.any_rank(model, False) is False
    return "ok"


def nonfinite_ranks(rank, world):
    module = gpt(CFG)
    with torch.no_grad():
        module.tok.weight[5] = float("nan")  # only batches containing token 5 go bad
    model, params = shard_gpt(module)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(6, CFG.vocab, (2, CFG.seq), generator=g)
    if rank == 0:
        x[0, 3] = 5
    step = fz3.value_and_grad(model, check_finite=True)
    with pytest.raises(fz3.NonFiniteError, match=r"first appeared in the forward of pre, op \d+ .* on ranks \[0\]"):
        step(params, (x, x))
    clean = torch.randint(6, CFG.vocab, (2, CFG.seq), generator=g)
    loss, _ = step(params, (clean, clean))  # a finite step passes the check
    assert torch.isfinite(loss)

    # The check keeps nothing of a frame but its flag: the step's peak of live bytes is the
    # unchecked step's (it kept every frame, each with its unit's unreduced gradient and
    # gathered buffer, to the step's end: one more model gradient and more)
    wide = GPTConfig(vocab=37, seq=8, dim=64, heads=4, layers=6)
    wmodel, wparams = shard_gpt(gpt(wide))
    peaks = {}
    for check in (False, True):
        step = fz3.value_and_grad(wmodel, check_finite=check)
        step(wparams, (clean, clean))  # warm: nothing made on the first call is counted
        with LiveBytes(writes=True) as live:
            step(wparams, (clean, clean))
        peaks[check] = live.peak
    # at most one unit's unreduced gradient more (the check's own transients while it reads
    # one frame: measured 145 KB here; keeping every frame cost 807 KB, the model's gradient
    # shard being 594 KB a rank)
    unit = 4 * max(p.layout.padded for p in wmodel.parts)
    assert peaks[True] - peaks[False] < unit, (peaks, unit)

    # A non-finite weight in a layer: every rank sees it first in that layer's forward.
    module2 = gpt(CFG)
    with torch.no_grad():
        module2.blocks[1].fc.weight[0, 0] = float("inf")
    model2, params2 = shard_gpt(module2)
    with pytest.raises(fz3.NonFiniteError, match=r"forward of blocks.1, op \d+ .* on ranks " + re.escape(str(list(range(world))))):
        fz3.value_and_grad(model2, check_finite=True)(params2, (clean, clean))
    return "ok"


@pytest.mark.parametrize("world", [2])
def test_step_through(world):
    assert dist.run(world, step_through_ranks) == ["ok"] * world


def test_nonfinite_named_consistently():
    assert dist.run(2, nonfinite_ranks) == ["ok"] * 2


def lone_stop_ranks(rank, world):
    """Rank 1 stops stepping through after the first layer's forward, rank 0 goes on: rank 1
    names rank 0 within the timeout instead of draining forever."""
    module = gpt(CFG)
    model, params = shard_gpt(module)
    b = batches(CFG, world)[rank]
    if rank == 1:
        frames = fz3.step_through(model, params, b, timeout=3)
        for f in frames:
            if f.name == "blocks.0":
                break
        # close() raises what the early stop found (a dropped generator's errors are only printed)
        with pytest.raises(fz3.CollectiveMismatchError, match=r"fz3.step_through stop is collective: ranks \[0\] "
                                                                r"did not call it"):
            frames.close()
        return "named"
    try:
        for _ in fz3.step_through(model, params, b):
            pass
    except (fz3.RankLostError, RuntimeError):
        return "lost"  # its next collective found rank 1 gone
    return "finished?!"


def test_a_lone_early_stop_is_named():
    out = dist.run(2, lone_stop_ranks, timeout=120, env={"FZ3_TEST_PG_TIMEOUT": "10"})
    assert out == ["lost", "named"], out  # rank 0 also notices: its next collective finds rank 1 gone
