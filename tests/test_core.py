"""fz3 core against plain PyTorch autograd on the unsharded model, in real gloo processes.

Reference: ``GPT(cfg)(tokens, targets)`` with ``loss.backward()`` over the concatenation of
every rank's batch. fz3's loss is the mean over ranks of per-rank mean losses; with equal
per-rank batch sizes that is the reference's mean. Tolerance: fp32 rtol 1e-5, atol 1e-6
(summation order differs between one big batch and per-rank batches plus a reduce).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dist
import fz3
from fz3.models.gpt import GPTConfig
from fz3.models import shard_gpt
from reference import (assert_close, assert_rel_norm, batches, clone, concat, gpt, padding_is_zero,
                       reference_grads, sharded_grads)

# Sizes chosen so no unit divides evenly by 2, 3 or 4 ranks (padding is exercised).
UNEVEN = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)
# Rows wide enough that the fused AdamW steps a layer's decayed and undecayed elements as
# separate slices (fz3.optim.adamw.SLICE_MIN_ELEMENTS), while the head still takes the
# masked pass: both paths against torch.
WIDE = GPTConfig(vocab=64, seq=8, dim=128, heads=4, layers=2)
POLICIES = [
    fz3.Policy(),
    fz3.Policy(prefetch=0),
    fz3.Policy(prefetch=2),
    fz3.Policy(activations="save"),
    fz3.Policy(activations="save_unsharded"),
    fz3.Policy(reshard_after_forward=False),
    fz3.Policy(layers_per_unit=2),
    fz3.Policy(layers_per_unit=2, activations="save", reduce="all_reduce"),
    fz3.Policy(layers_per_unit=3, prefetch=0, reduce="all_reduce"),
]


def with_delay(model: fz3.ShardedModel, delay_s: float) -> fz3.ShardedModel:
    """Rank r sleeps r*delay_s before every collective: a use before its wait reads garbage."""
    return dataclasses.replace(model, comm=dataclasses.replace(model.comm, delay_s=delay_s))


def check_equal_to_reference(rank, world, delay, cfg, policies):
    module = gpt(cfg)
    model, params = shard_gpt(module)
    model = with_delay(model, delay)
    bs = batches(cfg, world)
    ref_loss, ref = reference_grads(module, bs)
    for policy in policies:
        loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
        assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (policy, float(loss), ref_loss)
        got = sharded_grads(model, grads)
        if rank == 0:
            assert_close(got, ref, what=f"{policy} world={world}")
        assert padding_is_zero(model, grads, rank), "gradient padding is not zero"
    fwd = fz3.apply(model, params, bs[rank])
    assert abs(float(fwd) - ref_loss) <= 1e-5 * abs(ref_loss)


def check_adamw(rank, world, delay, steps=10, cfg=UNEVEN):
    """10 fz3 AdamW steps vs torch.optim.AdamW (decay on matrices only) on the plain model,
    through the pure path (update + apply_updates) and the donating fused path side by side."""
    module = gpt(cfg)
    model, params = shard_gpt(module)
    model = with_delay(model, delay)
    ref = gpt(cfg)
    decay = [p for n, p in ref.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in ref.named_parameters() if p.dim() < 2]
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)  # the example hyperparameters
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], **hp)
    opt = fz3.optim.adamw(**hp, weight_decay=0.1, mask=fz3.decay_mask(model))
    state = opt.init(params)
    fused_params = clone(params)
    fused_state = opt.init(fused_params)
    step = fz3.value_and_grad(model)
    for s in range(steps):
        bs = batches(cfg, world, step=s)
        before = clone(params).parts
        loss, grads = step(params, bs[rank])
        updates, new_state = opt.update(grads, state, params)
        new_params = fz3.optim.apply_updates(params, updates)
        assert all(torch.equal(a, b) for a, b in zip(before, params.parts)), "update mutated params"
        params, state = new_params, new_state
        _, fused_grads = step(fused_params, bs[rank])
        fused_params, fused_state = fz3.optim.step(opt, fused_grads, fused_state, fused_params, donate=True)
        torch_opt.zero_grad()
        ref(*concat(bs)).backward()
        torch_opt.step()
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for what, p in (("pure", params), ("fused", fused_params)):
        got = fz3.full_state_dict(model, p)
        if rank == 0:
            if world == 1:
                assert_close(got, want, what=f"adamw {what} world=1")
            else:
                # Adam turns sign flips of near-zero gradient elements (summation order differs
                # with the world size) into lr-sized elementwise differences: compare norms.
                assert_rel_norm(got, want, 1e-5, what=f"adamw {what} world={world}")
    assert int(state.count) == steps and int(fused_state.count) == steps
    assert padding_is_zero(model, fused_params, rank), "parameter padding is not zero after fused steps"


def check_state_dict_roundtrip(rank, world):
    cfg = dataclasses.replace(UNEVEN, tie=True)
    module = gpt(cfg)
    model, params = shard_gpt(module)
    sd = fz3.module_state_dict(model, params)
    if rank == 0:
        fresh = gpt(cfg, seed=123)
        fresh.load_state_dict(sd, strict=True)
        assert fresh.head.weight is fresh.tok.weight
        x, y = batches(cfg, 1)[0]
        torch.testing.assert_close(fresh(x, y), module(x, y), rtol=0, atol=0)
        assert set(sd) == set(module.state_dict())


def check_dropout_world1(rank, world):
    """Recompute replays the forward's dropout masks: equal to plain autograd, same seed."""
    cfg = dataclasses.replace(UNEVEN, dropout=0.2)
    module = gpt(cfg).train()
    model, params = shard_gpt(module)
    bs = batches(cfg, 1)
    for policy in (fz3.Policy(), fz3.Policy(activations="save"), fz3.Policy(layers_per_unit=2)):
        torch.manual_seed(7)
        ref_loss, ref = reference_grads(module, bs)
        after_ref = torch.get_rng_state()
        torch.manual_seed(7)
        loss, grads = fz3.value_and_grad(model, policy)(params, bs[0])
        assert torch.equal(torch.get_rng_state(), after_ref), "RNG state differs from plain autograd's"
        assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
        assert_close(sharded_grads(model, grads), ref, what=f"dropout {policy}")


def check_one_rank_computes_on_its_shards(rank, world):
    """One rank gathers a copy of its shards (or their cast to the compute dtype) into each
    unit's memory (``fz3.step.memory``). The step still equals plain autograd, writes nothing
    into the parameters, and never frees their memory, also where a kept graph (``trace=False``
    with ``save``, a tied embedding read by pre's and post's graphs) has its buffer released."""
    cfg = dataclasses.replace(UNEVEN, tie=True)
    module = gpt(cfg)
    model, params = shard_gpt(module)
    bs = batches(cfg, 1)
    ref_loss, ref = reference_grads(module, bs)
    before = clone(params)
    whole = fz3.Policy(layers_per_unit=cfg.layers, activations="save_unsharded")
    for policy in (fz3.Policy(), fz3.Policy(activations="save"), whole,
                   fz3.Policy(layers_per_unit=2, activations="save")):
        for trace in (True, False):
            loss, grads = fz3.value_and_grad(model, policy, trace=trace)(params, bs[0])
            assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (policy, trace)
            assert_close(sharded_grads(model, grads), ref, what=f"one rank {policy} {trace}")
            assert all(torch.equal(a, b) for a, b in zip(params.parts, before.parts)), policy
    stack = params.parts[model.part_index("blocks")]
    frames = [f for f in fz3.step_through(model, params, bs[0], fz3.Policy(activations="save"))
              if f.phase == "forward" and f.name.startswith("blocks.")]
    assert len(frames) == cfg.layers
    for f in frames:  # a copy of the shard (the unit's own memory, fz3.step.memory)
        assert all(t.untyped_storage().data_ptr() != stack.untyped_storage().data_ptr()
                   for t in f.params.values()), f.name
    # computing in bf16, the buffers are casts: freed (and released under a graph) as usual
    low = fz3.Precision(torch.bfloat16, torch.float32)
    model16, params16 = shard_gpt(module, precision=low)
    kept = clone(params16)
    for trace in (True, False):
        fz3.value_and_grad(model16, fz3.Policy(activations="save"), trace=trace)(params16, bs[0])
        assert all(torch.equal(a, b) for a, b in zip(params16.parts, kept.parts)), trace


def core_ranks(rank, world, delay):
    # Every policy at 2 and 3 ranks; at 1 and 4 (and with delays) a representative few.
    check_equal_to_reference(rank, world, delay, UNEVEN, POLICIES if world in (2, 3) and not delay else POLICIES[::2])
    check_equal_to_reference(rank, world, delay, dataclasses.replace(UNEVEN, layers=1), POLICIES[:4])
    check_equal_to_reference(rank, world, delay, dataclasses.replace(UNEVEN, tie=True), POLICIES[:2])
    check_adamw(rank, world, delay)
    if world == 1:
        check_adamw(rank, world, delay, steps=3, cfg=WIDE)
    check_state_dict_roundtrip(rank, world)
    if world == 1:
        check_dropout_world1(rank, world)
        check_one_rank_computes_on_its_shards(rank, world)
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_core_equals_plain_pytorch(world):
    assert dist.run(world, core_ranks, 0.0) == ["ok"] * world


@pytest.mark.parametrize("world", [3])
def test_core_with_delay_before_every_collective(world):
    """A missing wait fails this: rank r>0 issues every collective late, so rank 0 would read
    an unfilled buffer if it used one before waiting."""
    assert dist.run(world, core_ranks, 0.003) == ["ok"] * world
