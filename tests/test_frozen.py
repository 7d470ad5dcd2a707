"""Frozen parameters (requires_grad=False) anywhere in a unit: gathered with it, never reduced,
no gradient shard and no optimizer state; stored in the compute dtype. Reference: plain
autograd on the unsharded module (fp32, rtol 1e-5 / atol 1e-6) for the trained parameters."""

from __future__ import annotations

import pytest
import torch

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import assert_close, batches, gpt, reference_grads

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)


def freeze(module, names=("tok.", "pos.", ".attn.qkv.", ".ln1.")):
    for n, p in module.named_parameters():
        if any(k in "." + n for k in names):
            p.requires_grad_(False)
    return module


def frozen_ranks(rank, world):
    module = freeze(gpt(CFG))
    model, params = shard_gpt(module)
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert model.frozen[model.part_index("pre")] is not None and model.parts[0].layout.numel == 0
    bs = batches(CFG, world)
    _, want = reference_grads(module, bs)
    want = {n: g for n, g in want.items() if n in trained}
    opt = fz3.optim.adamw(lr=1e-2)
    state = opt.init(params)
    frozen_before = [None if t is None else t.clone() for t in model.frozen]
    for policy in (fz3.Policy(), fz3.Policy(activations="save"), fz3.Policy(layers_per_unit=2, reduce="all_reduce")):
        loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert set(got) == trained
            assert_close(got, want, what=f"frozen {policy} world={world}")
    for _ in range(2):
        _, grads = fz3.value_and_grad(model)(params, bs[rank])
        params, state = fz3.optim.step(opt, grads, state, params, donate=True)
    # frozen weights are bitwise unchanged; the state dict of params has every weight
    assert all(a is None or torch.equal(a, b) for a, b in zip(frozen_before, model.frozen))
    sd = fz3.module_state_dict(model, params)
    if rank == 0:
        assert set(sd) == set(module.state_dict())
        torch.testing.assert_close(sd["tok.weight"], module.tok.weight.detach(), rtol=0, atol=0)
    return "ok"


@pytest.mark.parametrize("world", [1, 3])
def test_frozen_parameters_equal_plain_autograd(world):
    assert dist.run(world, frozen_ranks) == ["ok"] * world


def memory_ranks(rank, world):
    """A model whose frozen weights are 99% of it: gradient and optimizer bytes per rank under
    2% of full fine-tuning's; frozen shards in the compute dtype (bf16: half the bytes)."""
    cfg = GPTConfig(vocab=64, seq=8, dim=64, heads=4, layers=2)
    full = gpt(cfg)
    frozen = gpt(cfg)
    for n, p in frozen.named_parameters():
        p.requires_grad_(n.endswith("ln2.bias"))  # 2 x 64 trained elements of ~120k
    batch = batches(cfg, world)[rank]
    plans = {}
    for name, module in (("full", full), ("frozen", frozen)):
        model, params = shard_gpt(module, precision=fz3.Precision(torch.bfloat16, torch.float32))
        plans[name] = fz3.memory_plan(model, fz3.plan(model), batch)
        if name == "frozen":
            assert all(t is None or t.dtype == torch.bfloat16 for t in model.frozen)
            loss, grads = fz3.value_and_grad(model)(params, batch)
            assert sum(t.numel() for t in grads.parts) * 4 == plans[name].grads
    grad_opt = {k: p.grads + p.optimizer for k, p in plans.items()}
    assert grad_opt["frozen"] < 0.02 * grad_opt["full"], grad_opt
    return "ok"


def test_memory_scales_with_what_is_trained():
    assert dist.run(2, memory_ranks) == ["ok"] * 2


def frozen_low_precision_ranks(rank, world):
    """Frozen weights stored in bf16 beside trained ones cast to it, in pre (``tok``) and in
    the layers (``qkv``): at one rank a unit's gathered buffers are the cast and the frozen
    shard itself, which no ``free`` may release (a step function keeps the buffers it
    gathers into at more ranks: ``fz3.step.executor.free_op``), also where a graph holds
    them (pre's; the layers' with ``trace=False`` and ``save``). Three steps of each policy
    equal a new step function's bit for bit, and the frozen shards stay unchanged."""
    model, params = shard_gpt(freeze(gpt(CFG), names=("tok.", ".attn.qkv.")),
                              precision=fz3.Precision(torch.bfloat16, torch.float32))
    b = batches(CFG, world)[rank]
    frozen_before = [None if t is None else t.clone() for t in model.frozen]
    for policy, trace in ((fz3.Policy(activations="save"), True),
                          (fz3.Policy(activations="save"), False), (fz3.Policy(), True)):
        step = fz3.value_and_grad(model, policy, trace=trace)
        for _ in range(3):
            loss, grads = step(params, b)
            want_loss, want = fz3.value_and_grad(model, policy, trace=trace)(params, b)
            assert torch.equal(loss, want_loss), (policy, trace)
            assert all(torch.equal(g, w) for g, w in zip(grads.parts, want.parts))
            assert all(a is None or torch.equal(a, t) for a, t in zip(frozen_before,
                                                                       model.frozen))
    return "ok"


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_shards_in_low_precision_survive_steps(world):
    assert dist.run(world, frozen_low_precision_ranks) == ["ok"] * world
