"""Models of other libraries, opt-in (``.ci/hf-zoo`` installs them ``--no-deps`` and runs this
file; not collected by the README's test command): litgpt's ``GPT`` as its users write it,
at world size 2 against plain autograd on the unsharded model over the concatenated batch
(fp32, rtol 1e-5 / atol 1e-6), traced and not.

litgpt's ``GPT`` registers ``lm_head`` before ``transformer``: without ``example=`` the head
lands in ``pre`` and ``post``'s read of it is refused by name (before issue 50 the loss was
wrong, with no error); with ``example=`` it is placed in ``post``. Its blocks take
``(x, cos, sin)``: ``pre`` passes the rotary tables as extras. A library missing here is
skipped by name. (timm's ``VisionTransformer`` needs torchvision, whose wheel for this torch
on PyPI does not import on a CPU-only torch: ``tests/test_placement.py`` stands in for its
``nn.Sequential`` of blocks.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dist
import fz3


def _litgpt():
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as e:
        pytest.skip(f"litgpt is not installed ({e})")
    torch.manual_seed(0)
    return GPT(Config(n_layer=3, n_embd=32, n_head=4, n_query_groups=2, vocab_size=50,
                      padded_vocab_size=64, block_size=16, bias=False))


def litgpt_pre(m, b):
    t = b[0].shape[1]
    return m.transformer.wte(b[0]), m.cos[:t].unsqueeze(0), m.sin[:t].unsqueeze(0)


def litgpt_post(m, h, b):
    logits = m.lm_head(m.transformer.ln_f(h))
    return F.cross_entropy(logits.flatten(0, 1), b[1].flatten())


def _batch(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)


def litgpt_ranks(rank, world):
    module = _litgpt()
    bs = [_batch(r) for r in range(world)]
    ref = copy.deepcopy(module)
    x, y = (torch.cat(t) for t in zip(*bs))
    want = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    want.backward()
    model, params = fz3.shard(module, "transformer.h", litgpt_pre, litgpt_post)
    with pytest.raises(fz3.PartReadError, match=r"post read parameter 'lm_head\.weight'"):
        fz3.value_and_grad(model)(params, bs[rank])
    model, params = fz3.shard(module, "transformer.h", litgpt_pre, litgpt_post,
                              example=bs[rank])
    for trace in (True, False):
        loss, grads = fz3.value_and_grad(model, trace=trace)(params, bs[rank])
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        torch.testing.assert_close(mean / world, want.detach(), rtol=1e-5, atol=1e-6)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            for n, p in ref.named_parameters():
                torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{n} trace={trace}: {m}")
    return "ok"


def test_litgpt_gpt_as_its_users_write_it():
    _litgpt()
    assert dist.run(2, litgpt_ranks, timeout=300) == ["ok", "ok"]
