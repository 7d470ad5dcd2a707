"""``fz3.optim.freeze``: the named parameters keep their values exactly; the others follow
``torch.optim.AdamW`` on the unsharded model whose frozen ones get no gradient (torch skips a
parameter whose ``.grad`` is None), next to a really frozen parameter (``requires_grad=False``).

One layer of a stack is named (``blocks.1.fc.weight``: the mask is per layer) and a parameter
of ``pre``. After Adam steps, elementwise closeness amplifies rounding, so the trained
parameters are compared by relative norm (1e-5, as ``test_training.py``); the frozen ones
bitwise. World size 3: uneven shards, the mask's slices must follow each rank's range."""

from __future__ import annotations

import pytest
import torch

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import assert_rel_norm, batches, concat, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)
FROZEN = {"blocks.1.fc.weight", "tok.weight"}


def freeze_ranks(rank, world, steps=3):
    module, ref = gpt(CFG), gpt(CFG)
    for m in (module, ref):
        m.pos.weight.requires_grad_(False)  # really frozen, next to the masked ones
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    model, params = shard_gpt(module)
    with pytest.raises(
        ValueError, match=r"\['blocks.9.fc.weight'\] name no parameter of the model"
    ):
        fz3.optim.freeze(model, {"blocks.9.fc.weight"})
    opt = fz3.optim.chain(
        fz3.optim.adamw(lr=1e-2, weight_decay=0.1), fz3.optim.freeze(model, FROZEN)
    )
    state = opt.init(params)
    torch_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    for s in range(steps):
        bs = batches(CFG, world, step=s)
        _, grads = fz3.value_and_grad(model)(params, bs[rank])
        params, state = fz3.optim.step(opt, grads, state, params, donate=True)
        torch_opt.zero_grad()
        ref(*concat(bs)).backward()
        for n, p in ref.named_parameters():
            if n in FROZEN:
                p.grad = None
        torch_opt.step()
    got = fz3.module_state_dict(model, params)
    if rank == 0:
        for n in FROZEN | {"pos.weight"}:
            assert torch.equal(got[n], before[n]), n
        trained = {
            n: p.detach() for n, p in ref.named_parameters() if n not in FROZEN | {"pos.weight"}
        }
        assert_rel_norm({n: got[n] for n in trained}, trained, 1e-5, what=f"freeze world={world}")
        assert all(not torch.equal(got[n], before[n]) for n in trained)
    return "ok"


def test_freeze_keeps_named_parameters_and_matches_torch():
    assert dist.run(3, freeze_ranks) == ["ok"] * 3
