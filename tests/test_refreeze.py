"""``fz3.refreeze`` between steps: train the head first, then everything, against plain PyTorch
doing the same (``torch.optim.AdamW`` over the head, then a new one over every parameter: fz3's
optimizer state is built again, so every trained parameter starts fresh).

World size 3 (uneven shards: a parameter crosses ranks in the new layout but not the old).
Phase 1 leaves the body bitwise unchanged; after both phases the weights match by relative norm
1e-5 (Adam amplifies rounding elementwise, as in ``test_training.py``). The new model's
gradients cover every parameter; the old model and params still work. A predicate that
splits a stack's layers is refused, naming two of them."""

from __future__ import annotations

import pytest
import torch

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import assert_close, assert_rel_norm, batches, concat, gpt, reference_grads

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)
HEAD = ("norm.", "head.")


def head_only(module):
    for n, p in module.named_parameters():
        p.requires_grad_(n.startswith(HEAD))
    return module


def refreeze_ranks(rank, world, steps=2):
    module, ref = head_only(gpt(CFG)), head_only(gpt(CFG))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    model, params = shard_gpt(module)
    opt = fz3.optim.adamw(lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    state = opt.init(params)
    for phase in range(2):
        if phase == 1:
            with pytest.raises(
                ValueError,
                match=r"trainable\('blocks.1.fc.weight'\) is True but "
                r"trainable\('blocks.0.fc.weight'\) is False \(stack blocks has one layout\)",
            ):
                fz3.refreeze(model, params, trainable=lambda n: n != "blocks.0.fc.weight")
            old_model, old_params = model, params
            model, params = fz3.refreeze(model, params, trainable=lambda n: True)
            state = opt.init(params)
            for p in ref.parameters():
                p.requires_grad_(True)
            torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(steps):
            bs = batches(CFG, world, step=10 * phase + s)
            _, grads = fz3.value_and_grad(model)(params, bs[rank])
            params, state = fz3.optim.step(opt, grads, state, params, donate=True)
            torch_opt.zero_grad()
            ref(*concat(bs)).backward()
            torch_opt.step()
        got = fz3.module_state_dict(model, params)
        if rank == 0 and phase == 0:
            for n, t in before.items():
                assert torch.equal(got[n], t) != n.startswith(HEAD), n
        if rank == 0:
            want = {n: p.detach() for n, p in ref.named_parameters()}
            assert_rel_norm({n: got[n] for n in want}, want, 1e-5, what=f"refreeze phase {phase}")
    trained = fz3.full_state_dict(model, grads)
    if rank == 0:
        assert set(trained) == set(before)
    fz3.value_and_grad(old_model)(old_params, bs[rank])  # the old model is unchanged
    return "ok"


def test_refreeze_head_then_everything_matches_torch():
    assert dist.run(3, refreeze_ranks) == ["ok"] * 3


def middle_frozen_ranks(rank, world):
    """Freezing parameters in the middle of each layer's layout reorders its slots (trained
    ones first, then frozen): the new model must bind every name to its new slot."""
    middle = ("ln2.bias", "attn.proj.weight")
    module = gpt(CFG)
    model, params = shard_gpt(module)
    model, params = fz3.refreeze(model, params, trainable=lambda n: not n.endswith(middle))
    bs = batches(CFG, world)
    loss, grads = fz3.value_and_grad(model)(params, bs[rank])
    for n, p in module.named_parameters():
        p.requires_grad_(not n.endswith(middle))
    want_loss, want = reference_grads(module, bs)
    got = fz3.full_state_dict(model, grads)
    if rank == 0:
        assert abs(float(loss) - want_loss) <= 1e-5 * abs(want_loss), (float(loss), want_loss)
        assert set(got) == {n for n, g in want.items() if g is not None}
        assert_close(got, {n: want[n] for n in got}, what="after freezing middle parameters")
    return "ok"


def test_refreeze_of_middle_parameters_rebinds_the_layers():
    assert dist.run(2, middle_frozen_ranks) == ["ok"] * 2
