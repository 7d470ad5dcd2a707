"""Models that are not the GPT: pre returning extras (differentiable and not), blocks that
return tuples (``call_layer=``), buffers, modules owning no parameters, tied weights in the outer
unit, a one-layer stack. Reference: plain autograd on the unsharded module over the
concatenated batch (fp32, rtol 1e-5, atol 1e-6)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dist
import fz3
from reference import assert_close


class Block(nn.Module):
    """Returns (h, aux) like many HF blocks; uses a mask, a differentiable gate and a buffer."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.act = nn.GELU()  # owns no parameters
        self.norm = nn.LayerNorm(d)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, h, mask, gate):
        y = self.act(self.lin(self.norm(h))) * gate
        return h + self.scale * y.masked_fill(~mask, 0.0), y.sum()


class Net(nn.Module):
    def __init__(self, vocab=29, d=22, layers=3, tie=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.gate = nn.Parameter(torch.randn(d))
        self.ident = nn.Identity()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.out = nn.Linear(d, vocab, bias=False)
        if tie:
            self.out.weight = self.emb.weight
        self.register_buffer("positions", torch.arange(16).float() / 16)

    def prologue(self, x):
        h = self.ident(self.emb(x)) + self.positions[: x.shape[1], None]
        mask = (x % 3 != 0)[..., None]
        gate = torch.sigmoid(self.gate)  # depends on a parameter: gradient flows through every layer
        return h, mask, gate

    def epilogue(self, h, y):
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    def forward(self, x, y):
        h, mask, gate = self.prologue(x)
        for b in self.blocks:
            h, _ = b(h, mask, gate)
        return self.epilogue(h, y)


def _pre(m, batch):
    return m.prologue(batch[0])


def _post(m, h, batch):
    return m.epilogue(h, batch[1])


def _layer(block, h, mask, gate):
    return block(h, mask, gate)[0]


def _batch(rank, vocab=29):
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, vocab, (2, 9), generator=g), torch.randint(0, vocab, (2, 9), generator=g)


def models_ranks(rank, world):
    for layers, tie in ((3, True), (1, False)):
        torch.manual_seed(0)
        net = Net(layers=layers, tie=tie)
        model, params = fz3.shard(net, layers="blocks", pre=_pre, post=_post, call_layer=_layer)
        bs = [_batch(r) for r in range(world)]
        ref = Net(layers=layers, tie=tie)
        ref.load_state_dict(net.state_dict())
        ref_loss = ref(*(torch.cat(t) for t in zip(*bs)))
        ref_loss.backward()
        want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
        for policy in (fz3.Policy(), fz3.Policy(activations="save"), fz3.Policy(layers_per_unit=2, prefetch=2)):
            loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
            got = fz3.full_state_dict(model, grads)
            if rank == 0:
                assert_close(got, want, what=f"Net(layers={layers}, tie={tie}) {policy}")
        sd = fz3.module_state_dict(model, params)
        if rank == 0:
            fresh = Net(layers=layers, tie=tie)
            fresh.load_state_dict(sd, strict=True)
            assert torch.equal(fresh(*bs[0]), net(*bs[0]))
    return "ok"


@pytest.mark.parametrize("world", [1, 3])
def test_extras_tuples_buffers_ties(world):
    assert dist.run(world, models_ranks) == ["ok"] * world
