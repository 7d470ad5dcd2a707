"""Training features against plain PyTorch: gradient accumulation (both policies), global-norm
clipping chained with AdamW, tied weights updated on every rank with uneven shards, bf16
compute and fp16 with dynamic loss scaling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dist
import fz3
from fz3.models.gpt import GPTConfig
from fz3.models import shard_gpt
from reference import (assert_close, assert_rel_norm, batches, concat, gpt, low_precision_grads,
                       reference_grads)

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)


def accumulation_ranks(rank, world):
    module = gpt(CFG)
    model, params = shard_gpt(module)
    k = 3
    micro = [batches(CFG, world, step=s) for s in range(k)]  # micro[s][r]
    ref_loss, ref = reference_grads(module, [mb for s in range(k) for mb in micro[s]])
    for policy in ("reduce", "defer"):
        for sched in (fz3.Policy(), fz3.Policy(layers_per_unit=2, activations="save", reduce="all_reduce")):
            loss, grads = fz3.accumulate(model, sched, policy=policy)(params, [micro[s][rank] for s in range(k)])
            assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (policy, float(loss), ref_loss)
            got = fz3.full_state_dict(model, grads)
            if rank == 0:
                assert_close(got, ref, what=f"accumulate {policy} {sched}")
    with pytest.raises(ValueError, match="policy='sum'"):
        fz3.accumulate(model, policy="sum")
    return "ok"


def clip_ranks(rank, world, steps=4):
    """clip_by_global_norm(0.05) then AdamW vs clip_grad_norm_ + torch.optim.AdamW; tied weights,
    uneven shards at world 3: every rank's slice of the tied weight must move."""
    cfg = dataclasses.replace(CFG, tie=True)
    module = gpt(cfg)
    model, params = shard_gpt(module)
    ref = gpt(cfg)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt = fz3.optim.chain(fz3.optim.clip_by_global_norm(0.05, model),
                          fz3.optim.adamw(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1))
    state = opt.init(params)
    step = fz3.value_and_grad(model)
    first = params
    for s in range(steps):
        bs = batches(cfg, world, step=s)
        _, grads = step(params, bs[rank])
        params, state = fz3.optim.step(opt, grads, state, params, donate=(s % 2 == 1))
        torch_opt.zero_grad()
        ref(*concat(bs)).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(state[0].norm, norm, rtol=1e-5, atol=0)
        assert float(norm) > 0.05  # the clip was active
        torch_opt.step()
    got = fz3.full_state_dict(model, params)
    if rank == 0:
        assert_rel_norm(got, {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}, 1e-5,
                        what=f"clip+adamw world={world}")
    # the tied weight (its own shared part) changed on every rank, including the last, shorter shard
    tied = model.part_index("tied:tok.weight")
    n = model.parts[tied].layout.shard_numel
    real = max(0, min(n, model.parts[tied].layout.numel - rank * n))
    assert real > 0 and not torch.equal(first.parts[tied][:real], params.parts[tied][:real])
    return "ok"


def precision_ranks(rank, world):
    module = gpt(CFG)
    bs = batches(CFG, world)
    ref_loss, ref = reference_grads(module, bs)
    bf16 = low_precision_grads(module, bs, torch.bfloat16)
    want = {torch.float32: 4, torch.bfloat16: 2}  # bytes per element the reduce moves
    for reduce in (torch.float32, torch.bfloat16):
        model, params = shard_gpt(module, precision=fz3.Precision(torch.bfloat16, reduce))
        rec = fz3.Recorder()
        loss, grads = fz3.value_and_grad(model, recorder=rec)(params, bs[rank])
        # The reduce dtype, seen in what the reduces moved: each moves its unit's full
        # (unsharded, padded) gradient, so one step moves every unit once.
        moved = sum(e.nbytes for e in rec.events if e.op.kind == "reduce")
        assert moved == sum(p.rows * p.layout.padded for p in model.parts) * want[reduce]
        got = fz3.full_state_dict(model, grads)
        if rank != 0:
            continue
        if reduce == torch.float32:
            # The same bf16 products as plain autograd in bf16 per rank, summed in fp32: only
            # the order of the sum over ranks differs (measured: equal). A bf16 reduce rounds
            # each sum to 8 bits (2^-9 ~ 2e-3 relative; measured 2.8e-3 and up): 1e-5 sees it.
            assert_rel_norm(got, bf16, 1e-5, what="bf16 compute, fp32 reduce")
            # Against the fp32 model: bf16 compute noise only (measured 1.2e-2 at world 2; a
            # few dozen roundings of 2^-9 in sequence). It cannot tell the reduce dtype apart.
            assert_rel_norm(got, ref, 3e-2, what="bf16 vs fp32")
            # The loss is forward only, so the reduce dtype cannot change it: a mean of fp32
            # cross-entropies of bf16 logits whose roundings average out (measured 1.3e-5).
            assert abs(float(loss) - ref_loss) <= 5e-4 * abs(ref_loss)
        else:  # the check above fails on a bf16 reduce, or it could not fail
            with pytest.raises(AssertionError, match="relative norm error"):
                assert_rel_norm(got, bf16, 1e-5)

    # fp16 with dynamic loss scaling: 2**40 overflows fp16 (max 65504), so the first steps
    # are skipped with the scale halved each time, until a step is finite.
    model16, params16 = shard_gpt(module, precision=fz3.Precision(torch.float16, torch.float32))
    opt = fz3.optim.adamw(lr=1e-3)
    state = opt.init(params16)
    ls = fz3.optim.LossScale(scale=2.0**40, growth_interval=2)
    step = fz3.value_and_grad(model16)
    history, first, gathered = [], None, False
    for s in range(40):
        before = params16
        loss, grads = step(params16, bs[rank], loss_scale=ls.scale)
        grads, ls, finite = fz3.optim.unscale(grads, ls, model16)
        history.append((finite, ls.scale))
        if finite:
            if not gathered:  # every rank takes this branch together: `finite` is agreed
                first, gathered = fz3.full_state_dict(model16, grads), True
            params16, state = fz3.optim.step(opt, grads, state, params16)
        else:
            assert params16 is before
        if sum(f for f, _ in history) >= 3:
            break
    n_skip = next(i for i, (f, _) in enumerate(history) if f)  # the skips before the first finite step
    skipped = [sc for _, sc in history[:n_skip]]
    assert n_skip > 0 and skipped == [2.0 ** (39 - i) for i in range(n_skip)], history
    after = [sc for _, sc in history[n_skip:]]
    assert after[0] == skipped[-1] and after[1] == 2 * after[0], history  # raised after 2 good steps
    assert int(state.count) == 3
    if rank == 0:  # unscaled fp16 gradients match fp32: 11 mantissa bits, ~5e-4 per rounding
        assert_rel_norm(first, ref, 1e-2, what="fp16 unscaled")
    return "ok"


@pytest.mark.parametrize("world", [2])
def test_gradient_accumulation(world):
    assert dist.run(world, accumulation_ranks) == ["ok"] * world


def test_clip_chained_with_adamw_tied_uneven():
    assert dist.run(3, clip_ranks) == ["ok"] * 3


def test_mixed_precision():
    assert dist.run(2, precision_ranks) == ["ok"] * 2
