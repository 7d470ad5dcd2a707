"""A per-layer auxiliary output in the scan (``fz3.shard(..., layer_aux=True)``): each layer
returns ``(h, aux)``, the stack's aux outputs reach the loss stacked ``(layers, *shape)``, one
tensor per stack, and their gradient flows back into each layer's backward as a second
cotangent (``fz3/step/engine.py``, [Note: the unit protocol]).

Reference: plain autograd on the unsharded model, each rank's batch on its own (the loss is
not a mean over tokens of the aux, so a rank's loss is its own batch's, as under DDP), the
gradient of the mean over ranks; fp32 rtol 1e-5 / atol 1e-6. Traced against untraced: bit for
bit (the same ops, as in ``test_traced``). World size 2, under recompute, save and selective,
one and two layers per unit, with a stack of two kinds (two stacks, aux of two shapes), a
loss that ignores the aux, ``has_aux``, ``fz3.apply``, ``step_through`` and dropout inside
the layers."""

from __future__ import annotations

import optree
import pytest
import torch
from torch import nn

import dist
import fz3
from reference import assert_close

POLICIES = (fz3.Policy(), fz3.Policy(activations="save"), fz3.Policy(activations="selective"),
            fz3.Policy(layers_per_unit=2), fz3.Policy(activations="save", layers_per_unit=2))


class Routed(nn.Module):
    """A layer with a router: h and, as its aux, per-expert probability sums (they have a
    gradient) and routed-token counts (they have none); dropout in training."""

    def __init__(self, width: int, experts: int):
        super().__init__()
        self.router, self.mlp = nn.Linear(width, experts), nn.Linear(width, width)
        self.drop = nn.Dropout(0.25)

    def forward(self, h):
        probs = torch.softmax(self.router(h), dim=-1)
        chosen = probs.argmax(dim=-1, keepdim=True)
        counts = (chosen == torch.arange(probs.shape[-1])).float().sum(dim=(0, 1))
        return h + self.drop(torch.tanh(self.mlp(h))), torch.cat([probs.sum(dim=(0, 1)), counts])


class Net(nn.Module):
    """Four routed layers of 3 experts, then two of 2 (two stacks, aux of two shapes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Routed(8, 3) for _ in range(4)] +
                                    [Routed(8, 2) for _ in range(2)])
        self.head = nn.Linear(8, 1)


def pre(m, x):
    return m.embed(x)


def post(m, h, x, aux):
    """A loss with a product of the stacks' statistics (not a sum over layers)."""
    first, second = aux
    assert first.shape == (4, 6) and second.shape == (2, 4), (first.shape, second.shape)
    balance = (first[:, :3].sum(0) * first[:, 3:].sum(0)).sum() + (second[:, :2] ** 2).sum()
    return m.head(h).pow(2).mean() + 0.01 * balance


def ignores_aux(m, h, x, aux):
    return m.head(h).pow(2).mean()


def with_terms(m, h, x, aux):
    loss = post(m, h, x, aux)
    return loss, {"first": aux[0].detach()}


def plain(net: Net, x: torch.Tensor, loss=post):
    """The unsharded net in plain PyTorch: its loss on ``x``, and each stack's stacked aux."""
    h, auxes = pre(net, x), []
    for layer in net.layers:
        h, a = layer(h)
        auxes.append(a)
    aux = (torch.stack(auxes[:4]), torch.stack(auxes[4:]))
    return loss(net, h, x, aux), aux


def batch(rank: int) -> torch.Tensor:
    return torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(10 + rank))


def reference(world: int, loss=post):
    """Eval mode (no dropout): the mean over ranks of each rank's loss, its gradients."""
    net = Net().eval()
    total = 0.0
    for r in range(world):
        value = plain(net, batch(r), loss)[0] / world
        value.backward()
        total += float(value)
    # a parameter only the aux reads has no gradient when the loss ignores it: zeros in fz3
    return total, {n: torch.zeros_like(p) if p.grad is None else p.grad
                   for n, p in net.named_parameters()}


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def aux_ranks(rank, world):
    model, params = fz3.shard(Net(), "layers", pre, post, layer_aux=True)
    assert len([p for p in model.parts if p.name.startswith("layers")]) == 2
    evaluated = model.eval()
    x = batch(rank)
    want_loss, want = reference(world)
    for policy in POLICIES:
        step = fz3.value_and_grad(evaluated, policy)
        loss, grads = step(params, x)
        assert step.traced.failed == {}, (policy, step.traced.failed)
        torch.testing.assert_close(float(loss), want_loss, rtol=1e-5, atol=1e-6)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, want, what=str(policy))
        # in training (dropout, replayed by recompute): traced equals untraced bit for bit
        torch.manual_seed(3)
        traced = fz3.value_and_grad(model, policy)(params, x)
        torch.manual_seed(3)
        untraced = fz3.value_and_grad(model, policy, trace=False)(params, x)
        assert _same(traced, untraced), policy
    # a loss that ignores the aux: no cotangent reaches the layers (zeros in their backward)
    ignored_loss, ignored = reference(world, ignores_aux)
    for trace in (True, False):
        loss, grads = fz3.value_and_grad(evaluated, loss=ignores_aux, trace=trace)(params, x)
        torch.testing.assert_close(float(loss), ignored_loss, rtol=1e-5, atol=1e-6)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, ignored, what=f"ignores aux, trace={trace}")
    # has_aux: the loss's own aux beside the layers'; apply: forward only, the same loss
    net = Net().eval()
    with torch.no_grad():
        local, stacked = plain(net, x)
    (loss, terms), _ = fz3.value_and_grad(evaluated, loss=with_terms, has_aux=True)(params, x)
    torch.testing.assert_close(terms["first"], stacked[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(float(fz3.apply(evaluated, params, x)), want_loss, rtol=1e-5,
                               atol=1e-6)
    # step_through: a layer unit's forward frame shows its aux, its backward frame the aux's
    # cotangent beside h's
    frames = list(fz3.step_through(evaluated, params, x, fz3.Policy(activations="save")))
    forward = [f for f in frames if f.phase == "forward" and f.name.startswith("layers")]
    backward = [f for f in frames if f.phase == "backward" and f.name.startswith("layers")]
    assert torch.allclose(forward[0].outputs[1][0], stacked[0][0], rtol=1e-5, atol=1e-6)
    assert all(isinstance(f.inputs, tuple) and f.inputs[1] is not None for f in backward)
    return "ok"


def test_layer_aux_outputs_reach_the_loss_and_their_gradient_the_layers():
    assert dist.run(2, aux_ranks, timeout=300) == ["ok"] * 2


def misuse_ranks(rank, world):
    """A layer that returns h alone under ``layer_aux=True``, and one returning a pair
    without it: a TypeError naming the layer and the fix, on every rank."""
    model, params = fz3.shard(Net(), "layers", pre, post, layer_aux=True,
                              call_layer=lambda layer, h: layer(h)[0])
    with pytest.raises(TypeError, match=r"layer layers\.0 returned Tensor; with layer_aux=True "
                                        r"every layer returns \(h, aux\)"):
        fz3.value_and_grad(model, trace=False)(params, batch(rank))
    model, params = fz3.shard(Net(), "layers", pre, lambda m, h, x: m.head(h).mean())
    with pytest.raises(TypeError, match=r"layer layers\.0 returned tuple, not a tensor; .*"
                                        r"pass layer_aux=True to fz3\.shard"):
        fz3.value_and_grad(model, trace=False)(params, batch(rank))
    return "ok"


def test_a_layer_that_does_not_return_what_layer_aux_says_is_named():
    assert dist.run(2, misuse_ranks, timeout=120) == ["ok"] * 2


def test_layer_aux_needs_no_copy_of_a_plain_loss():
    """The reference itself: the product loss differs from the per-layer sum (a layer that
    returned h alone could not express it), and the net's two stacks return aux of two
    shapes, so the tests above cannot pass with the aux dropped or mixed up."""
    net = Net().eval()
    x = batch(0)
    loss, (first, second) = plain(net, x)
    assert first.shape == (4, 6) and second.shape == (2, 4)
    assert not torch.allclose(loss, plain(net, x, ignores_aux)[0])
    per_layer = sum((a[:3] * a[3:]).sum() for a in first)
    assert not torch.allclose((first[:, :3].sum(0) * first[:, 3:].sum(0)).sum(), per_layer)


def memory_plan_ranks(rank, world):
    """The memory plan and ``fz3.apply(output=...)``-style losses run on a model whose layers
    return aux outputs (post is called with them)."""
    model, params = fz3.shard(Net(), "layers", pre, post, layer_aux=True)
    plan = fz3.memory_plan(model, fz3.plan(model), batch(rank))
    assert plan.peak > 0
    return "ok"


def test_the_memory_plan_runs_post_with_the_layers_aux():
    assert dist.run(2, memory_plan_ranks, timeout=120) == ["ok"] * 2


class Scaled(nn.Module):
    """A layer whose aux output is a view of its own parameter (its scale, as statistics)."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp, self.scale = nn.Linear(width, width), nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, h):
        return h + torch.tanh(self.mlp(h)) * self.scale, self.scale.view(-1)


class ScaledNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Scaled(8) for _ in range(3)])
        self.head = nn.Linear(8, 1)


def scaled_post(m, h, x, aux):
    (scales,) = aux
    return m.head(h).pow(2).mean() + 0.1 * (scales.sum(0) ** 2).sum()


def aux_of_a_parameter_ranks(rank, world):
    """Reference: plain autograd on ``ScaledNet``, the mean over ranks of each one's loss."""
    net = ScaledNet()
    total = 0.0
    for r in range(world):
        h, auxes = pre(net, batch(r)), []
        for layer in net.layers:
            h, a = layer(h)
            auxes.append(a)
        value = scaled_post(net, h, batch(r), (torch.stack(auxes),)) / world
        value.backward()
        total += float(value)
    want = {n: p.grad for n, p in net.named_parameters()}
    model, params = fz3.shard(ScaledNet(), "layers", pre, scaled_post, layer_aux=True)
    for policy in (fz3.Policy(), fz3.Policy(activations="save")):
        results = []
        for trace in (True, False):
            step = fz3.value_and_grad(model, policy, trace=trace)
            for _ in range(2):  # the second step reuses the first's kept buffers
                loss, grads = step(params, batch(rank))
                torch.testing.assert_close(float(loss), total, rtol=1e-5, atol=1e-6)
                got = fz3.full_state_dict(model, grads)  # (collective)
                if rank == 0:
                    assert_close(got, want, what=f"{policy}, trace={trace}")
            results.append((loss, grads))
        assert _same(*results), policy
    return "ok"


def test_an_aux_viewing_a_parameter_outlives_the_units_buffer():
    """A layer's aux that views its parameter waits for the loss after its unit's gathered
    buffer is freed (at two ranks the storage is released and kept for the next gather,
    ``fz3.step.executor.free_op``): it is copied off first (``fz3.step.unit_io.apart``).
    Without the copy the loss read released memory (a crash, with or without tracing)."""
    assert dist.run(2, aux_of_a_parameter_ranks, timeout=180) == ["ok"] * 2
