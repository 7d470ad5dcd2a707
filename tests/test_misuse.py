"""Misuse refused, never a crash or a silent run, in real gloo ranks (each a process of its
own, so a SIGSEGV inside a kernel is a failed rank, not a lost test run): optimizer state
that does not fit the params, a step some rank never calls, batches of different shapes or
empty, a destroyed model, gradients mixed with weights. Each failed on the code before."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3, tie=True)
FIX = r"build the state for these params with opt.init\(params\)"


def foreign_state_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG))
    other, oparams = shard_gpt(gpt(dataclasses.replace(CFG, dim=40)))
    opt = fz3.optim.adamw(lr=1e-2, weight_decay=0.1)
    _, grads = fz3.value_and_grad(model)(params, batches(CFG, world)[rank])
    foreign = opt.init(oparams)
    want = rf"the optimizer state's first moment \(mu\) part #0 is \[\d+\] float32 on cpu, the params' part #0 is \[\d+\] float32 on cpu \(named by model.parts\[0\].name.*{FIX}"
    for call in (lambda: fz3.optim.step(opt, grads, foreign, params, donate=True),  # was SIGSEGV
                 lambda: fz3.optim.step(opt, grads, foreign, params),
                 lambda: opt.update(grads, foreign, params)):
        with pytest.raises(ValueError, match=want):
            call()
    clipped = fz3.optim.chain(fz3.optim.clip_by_global_norm(1.0, model), opt)
    with pytest.raises(ValueError, match=want):
        fz3.optim.step(clipped, grads, clipped.init(oparams), params, donate=True)
    with pytest.raises(ValueError, match=r"the gradients part #0 is .* the params' part #0"):
        fz3.optim.step(opt, fz3.value_and_grad(other)(oparams, batches(CFG, world)[rank])[1],
                       opt.init(params), params, donate=True)
    with pytest.raises(TypeError, match=rf"the optimizer state is tuple, adamw's is an AdamWState: {FIX}"):
        opt.update(grads, clipped.init(params), params)
    with pytest.raises(ValueError, match=r"the updates part #0 is .*pass the updates that opt.update returned"):
        fz3.optim.apply_updates(params, opt.update(fz3.value_and_grad(other)(oparams, batches(CFG, world)[rank])[1],
                                                   opt.init(oparams), oparams)[0])
    masked = fz3.optim.adamw(lr=1e-2, weight_decay=0.1, mask=fz3.decay_mask(other))
    with pytest.raises(ValueError, match=r"the weight-decay mask part #0 is .*does not broadcast"):
        fz3.optim.step(masked, grads, masked.init(params), params, donate=True)
    # a donated state, through update (it named neither donate=True nor the state)
    new_params, new_state = fz3.optim.step(opt, grads, opt.init(params), params, donate=True)
    with pytest.raises(ValueError, match=r"the optimizer state's first moment \(mu\) was donated to "
                                         r"fz3.optim.step\(..., donate=True\)"):
        opt.update(grads, opt.init(params)._replace(mu=params), new_params)
    with pytest.raises(ValueError, match=r"the updates was donated .*: use the updates that it returned"):
        fz3.optim.apply_updates(new_params, params)  # said "use the the updates"
    # after refreeze the old state no longer fits: it broadcast a [1] shard to [N], or ran the
    # fused kernel on buffers of other sizes
    head = lambda n: not n.startswith("blocks.")  # noqa: E731 - the blocks' part changes shape
    frozen_model, frozen_params = fz3.refreeze(model, new_params, trainable=head)
    old = new_state  # built for the params before refreeze
    _, fgrads = fz3.value_and_grad(frozen_model)(frozen_params, batches(CFG, world)[rank])
    for donate in (False, True):
        with pytest.raises(ValueError, match=rf"part #\d is \[\d+(, \d+)?\] float32 on cpu, the params' part #\d is .*{FIX}"):
            fz3.optim.step(opt, fgrads, old, frozen_params, donate=donate)
    fz3.optim.step(opt, fgrads, opt.init(frozen_params), frozen_params, donate=True)  # the fix works
    return "ok"


def test_optimizer_state_checked_against_the_params():
    assert dist.run(2, foreign_state_ranks) == ["ok"] * 2


def absent_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG), timeout=3)
    step = fz3.value_and_grad(model)
    b = batches(CFG, world)[rank]
    step(params, b)
    # and one whose step has no check before its collectives: the absence is found by a wait
    bare_model, bare_params = shard_gpt(gpt(CFG), timeout=3)
    bare = fz3.value_and_grad(bare_model, check_sync=False)
    bare(bare_params, b)
    # rank 1 goes elsewhere while rank 0 steps on shapes already seen (it hung for gloo's 30 min)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(fz3.CollectiveMismatchError, match=r"ranks \[1\] did not come within 3 s: rank 0 is on its "
                                                              r"step call 2 while ranks \[1\] are on call 1") as e:
            step(params, b)
        took = time.monotonic() - t0
        assert e.value.missing == [1] and 3 <= took < 9, (e.value.missing, took)
        # its collectives no longer pair up with rank 1's: the model refuses to go on
        with pytest.raises(RuntimeError, match=r"this model gave up 1 collectives when ranks were found absent"):
            step(params, b)  # (the check's all-gather)
        # the gathers in flight when the first wait gave up (3: 5aefd37 counted the same), each
        # once: the waited one is not counted again by the step's abandon (4 when it was)
        with pytest.raises(fz3.CollectiveMismatchError, match=r"ranks \[1\] did not come within 3 s"):
            bare(bare_params, b)
        with pytest.raises(RuntimeError, match=r"this model gave up 3 collectives when ranks were found absent"):
            bare(bare_params, b)
    else:
        time.sleep(16)  # "running other code", alive
    return "ok"


def test_a_step_some_rank_never_calls_names_it():
    assert dist.run(2, absent_ranks, timeout=120) == ["ok"] * 2


def placed(model, rank, last):
    """Wait until ``rank`` has published that its last fz3 call on ``model`` is ``last``: the
    interleaving a case needs, forced (the other rank is in that call before this one goes on)."""
    from fz3.comm.compat import default_store
    from fz3.comm.liveness import places

    deadline = time.monotonic() + 20
    while (p := places(default_store(), [rank], model.comm.heartbeat.model)[rank]) is None or p.last != last:
        assert time.monotonic() < deadline, f"rank {rank} never published {last!r} (last: {p})"
        time.sleep(0.05)


def out_of_step_ranks(rank, world, folder):
    import os

    import torch.distributed as tdist

    # Each case shards over a group of its own: a rank's abandoned collective stays pending in
    # its model's group (its ranks no longer pair up there), never in the next case's.
    fresh = lambda timeout: shard_gpt(gpt(CFG), timeout=timeout, group=tdist.new_group([0, 1]))  # noqa: E731
    b = batches(CFG, world)[rank]
    # 1. Rank 1 makes a step call more than rank 0 (3 against 2) and rank 0 saves: both raise
    # within seconds (save's own timeout is 120 s), naming rank 1 as a step ahead and what each
    # called. Rank 1's extra step had waited in its check, then blamed rank 0; rank 0 waited in
    # save's arrival for 120 s and called rank 1 "alive, running other code".
    model, params = fresh(1)
    step = fz3.value_and_grad(model)
    for _ in range(2):
        step(params, b)
    ahead = (r"rank 1 is on its step call 3 while ranks \[0\] are on call 2 \(the last fz3 call each rank entered: "
             r"rank 0: fz3.save after step call 2; rank 1: value_and_grad's step call 3")
    t0 = time.monotonic()
    if rank == 0:
        with pytest.raises(fz3.CollectiveMismatchError, match=r"fz3.save is collective: ranks \[1\] will not call it "
                                                              r"\(they gave up waiting in another collective of the "
                                                              r"model\): " + ahead) as e:
            fz3.save(os.path.join(folder, "ckpt"), model, {"params": params})
    else:
        placed(model, 0, "fz3.save")
        with pytest.raises(fz3.CollectiveMismatchError, match=r"value_and_grad's step's check that the ranks agree: "
                                                              r"ranks \[0\] did not come within 1 s: " + ahead) as e:
            step(params, b)
    took = time.monotonic() - t0
    assert e.value.missing == [1 - rank] and took < 15, (e.value.missing, took)
    assert os.listdir(folder) == []
    # 2. The other way round, without check_sync (a GPU's default): rank 0 a step ahead, its
    # wait in the executor's first gather; rank 1 in fz3.export.
    model, params = fresh(1)
    step = fz3.value_and_grad(model, check_sync=False)
    step(params, b)
    ahead = (r"rank 0 is on its step call 2 while ranks \[1\] are on call 1 \(the last fz3 call each rank entered: "
             r"rank 0: value_and_grad's step call 2( \(gave up waiting in gather pre\))?; rank 1: fz3.export after step "
             r"call 1")
    if rank == 0:
        placed(model, 1, "fz3.export")
        with pytest.raises(fz3.CollectiveMismatchError, match=r"gather \S+: ranks \[1\] did not come within 1 s: " + ahead):
            step(params, b)
    else:
        with pytest.raises(fz3.CollectiveMismatchError, match=r"fz3.export is collective: ranks \[0\] will not call it .*: " + ahead):
            fz3.export(os.path.join(folder, "export"), model, params)
    # 3. Rank 1 makes a step call more and rank 0's process ends: rank 1 names itself a step
    # ahead, not rank 0 lost (it called rank 0 "stopped responding": died, or frozen). Its wait
    # is bounded by the process group alone here, so only rank 0's exit ends it.
    model, params = fresh(600)
    step = fz3.value_and_grad(model)
    step(params, b)
    if rank == 0:
        # The process exits: its interpreter's exit stops the heartbeat (weakref.finalize);
        # the harness's ranks leave by os._exit, which skips that, so stop it as exit would.
        model.comm.heartbeat.stop()
        return "ok"
    with pytest.raises(fz3.CollectiveMismatchError, match=r"rank 1: value_and_grad's step's check that the ranks agree "
                                                          r"failed: rank 1 is on its step call 2 while ranks \[0\] are on "
                                                          r"call 1 \(the last fz3 call each rank entered: rank 0: "
                                                          r"value_and_grad's step call 1") as e:
        step(params, b)
    assert e.value.missing == [0]
    return "ok"


def test_ranks_out_of_step_are_named_where_they_are(tmp_path):
    """A rank a step ahead is named as such on every rank, and each rank is told what the
    others called (a step against fz3.save or fz3.export), within seconds, in both wait paths
    (a step's collective, a call's arrival) and when the other rank's process ended."""
    assert dist.run(2, out_of_step_ranks, str(tmp_path), timeout=60) == ["ok"] * 2


def shapes_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG), timeout=5)
    step = fz3.value_and_grad(model)
    full = batches(CFG, world, per_rank=2)[rank]
    step(params, full)
    short = tuple(t[:1] for t in full) if rank == 1 else full  # a short last batch on rank 1
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"ranks \[1\] have batches shaped unlike rank 0's \(rank 0: batch\[0\] \[2, 8\] "
                                         r"int64, batch\[1\] \[2, 8\] int64; rank 1: batch\[0\] \[1, 8\] int64, "
                                         r"batch\[1\] \[1, 8\] int64\).*pad or drop the "
                                         r"last batch"):
        step(params, short)
    assert time.monotonic() - t0 < 5  # decided as soon as both arrived
    fz3.value_and_grad(model, check_sync=False)(params, short)  # opted out: runs, as before
    empty = tuple(t[:0] for t in full) if rank == 0 else full
    with pytest.raises(ValueError, match=r"ranks \[0\] have an empty batch \(rank 0: 0 rows\).*the loss would be NaN"):
        step(params, empty)
    acc = fz3.accumulate(model)
    acc(params, [full, full])
    with pytest.raises(ValueError, match=r"ranks \[0\] have an empty batch \(rank 0: 0 rows\)"):
        acc(params, [full, empty])
    loss, grads = step(params, full)  # every rank still in step
    assert torch.isfinite(loss)
    return "ok"


def test_batches_of_other_shapes_or_empty_raise_on_every_rank():
    assert dist.run(2, shapes_ranks, timeout=120) == ["ok"] * 2


def destroyed_ranks(rank, world, folder):
    model, params = shard_gpt(gpt(CFG))
    step = fz3.value_and_grad(model)
    b = batches(CFG, world)[rank]
    step(params, b)
    fz3.destroy(model)
    for what, call in (("value_and_grad's step", lambda: step(params, b)),
                       ("fz3.apply", lambda: fz3.apply(model, params, b)),
                       ("fz3.save", lambda: fz3.save(f"{folder}/ckpt", model, {"params": params})),
                       ("fz3.export", lambda: fz3.export(f"{folder}/exp", model, params)),
                       ("fz3.full_state_dict", lambda: fz3.full_state_dict(model, params))):
        with pytest.raises(RuntimeError, match=rf"{what}: this model was released by fz3.destroy\(model\)"):
            call()
    return "ok"


def test_a_destroyed_model_refuses_every_call(tmp_path):
    """A step after fz3.destroy ran and returned results on every rank."""
    assert dist.run(2, destroyed_ranks, str(tmp_path)) == ["ok"] * 2


def grads_only_ranks(rank, world):
    module = gpt(CFG)
    for n, p in module.named_parameters():
        p.requires_grad_(not n.startswith("blocks.0."))
    trained = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    model, params = shard_gpt(module)
    _, grads = fz3.value_and_grad(model)(params, batches(CFG, world)[rank])
    got = fz3.full_state_dict(model, grads)
    whole = fz3.module_state_dict(model, params)
    with pytest.raises(TypeError, match=r"buffers=False\) is gone.*fz3.module_state_dict\(model, params\)"):
        fz3.full_state_dict(model, grads, buffers=False)
    if rank == 0:
        assert set(got) == trained, sorted(set(got) ^ trained)  # it held frozen weights too
        fresh = gpt(CFG, seed=3)
        fresh.load_state_dict(whole, strict=True)
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), module.state_dict().values()))
    return "ok"


def test_gradients_are_never_mixed_with_weights():
    assert dist.run(2, grads_only_ranks) == ["ok"] * 2


def unlabelled_ranks(rank, world):
    from test_hf import batch as hf_batch, build as hf_build

    for family, why in (("llama", r"no labelled token after the first token of each row"),
                        ("roberta", r"no labelled token: every label is -100")):
        module = hf_build(family, False)
        model, params = fz3.shard(module)
        step = fz3.value_and_grad(model)
        b = hf_batch(family, rank, module.config.vocab_size)
        step(params, b)
        if rank == 1:  # every label -100 (a causal LM's first one too: it is never predicted)
            b = {**b, "labels": torch.full_like(b["labels"], -100)}
            if family == "llama":
                b["labels"][:, 0] = b["input_ids"][:, 0]
        with pytest.raises(ValueError, match=rf"ranks \[1\] have an empty batch \(rank 1: {why}"):
            step(params, b)  # NaN loss on every rank, finite gradients: half a step applied
    return "ok"


def test_a_hugging_face_batch_without_labelled_tokens_raises_on_every_rank():
    assert dist.run(2, unlabelled_ranks) == ["ok"] * 2
