"""Bad input fails at fz3.shard / before any collective, with the value and the fix named."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import dist
import fz3
from fz3.models.gpt import GPT, GPTConfig, post, pre
from fz3.models import shard_gpt

CFG = GPTConfig(vocab=31, seq=8, dim=16, heads=2, layers=2)


def _raises(exc, match, fn, *args, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def error_ranks(rank, world):
    torch.manual_seed(0)
    m = GPT(CFG)
    _raises(ValueError, r"layers='stack' does not name a submodule.*containers of blocks in it: \['blocks'\]",
            fz3.shard, m, "stack", pre, post)
    _raises(TypeError, r"layers='norm' is a LayerNorm, not a container of blocks", fz3.shard, m, "norm", pre, post)
    _raises(TypeError, "needs layers=, pre= and post=", fz3.shard, m, "blocks")
    _raises(TypeError, "no built-in adapter for GPT; layer containers in it: 'blocks' .*pass layers='blocks'", fz3.shard, m)

    odd = GPT(CFG)  # layers of two kinds are no longer refused: each run becomes a stack (test_units.py)
    odd.blocks[1].fc = nn.Linear(CFG.dim, 3 * CFG.dim)
    assert [p.name for p in fz3.shard(odd, "blocks", pre, post)[0].parts] == \
        ["pre", "blocks[0:1]", "blocks[1:2]", "post"]

    shared = GPT(CFG)
    shared.blocks[0].fc.weight = shared.blocks[1].fc.weight
    _raises(ValueError, "blocks.1.fc.weight is the same Parameter as blocks.0.fc.weight; layers of a stack must not share", fz3.shard, shared, "blocks", pre, post)

    cross = GPT(CFG)
    cross.alias = cross.blocks[0].fc  # a layer's weight now also lives outside the stack
    _raises(ValueError, r"parameter \('blocks.0.fc.weight', 'alias.weight'\) is used both inside 'blocks' and outside",
            fz3.shard, cross, "blocks", pre, post)

    frozen = GPT(CFG)  # frozen parameters are no longer refused: they are a unit's second part
    frozen.pos.weight.requires_grad_(False)
    fmodel, _ = fz3.shard(frozen, "blocks", pre, post)
    assert [s.name for s in fmodel.parts[0].frozen.slots] == ["pos.weight"]

    model, params = shard_gpt(m)
    x = torch.randint(0, CFG.vocab, (2, CFG.seq))
    step = fz3.value_and_grad(model)
    pre_, blocks, post_ = params.parts
    wrong = fz3.Params((pre_, blocks[:1], post_))
    _raises(ValueError, r"params of part blocks is \[1, \d+\] torch.float32 on cpu; this model's shards are "
            r"\[2, \d+\]", step, wrong, (x, x))
    _raises(ValueError, r"params of part pre is .* torch.float64", step,
            fz3.Params((pre_.double(), blocks, post_)), (x, x))
    strided = torch.empty(blocks.shape[1], blocks.shape[0]).t()  # the same shape, transposed
    _raises(ValueError, r"params of part blocks are not contiguous \(strides \(1, 2\) for shape "
            r"\[2, \d+\]\): pass contiguous shards", step, fz3.Params((pre_, strided, post_)), (x, x))
    _raises(TypeError, r"params is Params of 2 parts; pass the Params that fz3.shard returned for this model "
            r"\(or a tree shaped like it: 3 parts, \['pre', 'blocks', 'post'\]\)", step, fz3.Params((pre_, blocks)),
            (x, x))

    bad_post, _ = fz3.shard(m, "blocks", pre, lambda m_, h, b: h.sum(-1))
    _raises(TypeError, r"post must return a scalar loss tensor, got Tensor of shape \[2, 8\]",
            fz3.value_and_grad(bad_post), params, (x, x))

    class Tupled(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.GRU(4, 4, batch_first=True) for _ in range(2))

    tupled, tparams = fz3.shard(Tupled(), "blocks", lambda m_, b: b, lambda m_, h, b: h.sum())
    _raises(TypeError, r"layer blocks.0 returned tuple, not a tensor; pass call_layer=lambda layer, h, \*extra: layer\(h",
            fz3.value_and_grad(tupled), tparams, torch.zeros(1, 3, 4))
    return "ok"


def test_bad_input_raises_with_the_fix():
    assert dist.run(1, error_ranks) == ["ok"]


def test_policy_and_schedule_types():
    with pytest.raises(TypeError, match="schedule must be an fz3.Schedule or fz3.Policy, got str"):
        fz3.step.front.check_schedule(dataclasses.make_dataclass("M", [("num_layers", int)])(1), "fast", grad=True)
