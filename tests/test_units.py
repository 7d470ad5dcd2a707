"""Units as a list (issue 13): layers of two kinds in one ModuleList, several stacks with code
between them, tied weights across units, resident units, and memory: the plan against the
live tensor bytes measured through a dispatch mode, the large-vocabulary bound on gathered
bytes, no transient copy of the gradients at the step's end.

Reference: plain PyTorch autograd on the unsharded module over the concatenated batch
(fp32, rtol 1e-5 / atol 1e-6)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from fz3.observe.live_bytes import LiveBytes
from reference import assert_close, batches, gpt, reference_grads

POLICIES = [fz3.Policy(), fz3.Policy(activations="save"), fz3.Policy(activations="save_unsharded", prefetch=2),
            fz3.Policy(layers_per_unit=2, reduce="all_reduce"), fz3.Policy(resident=("pre", "post"))]


class Layer(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, h, gate):
        return h + self.down(F.gelu(self.up(self.norm(h)))) * gate


class TwoTowers(nn.Module):
    """An embedding, an encoder of layers of two kinds ([A, A, B, B, B]: two stacks), a bridge
    between two ModuleLists that makes new extras for the decoder, and a head tied to the
    embedding (a part shared across units)."""

    def __init__(self, vocab=23, d=10, tie=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.gate = nn.Parameter(torch.rand(d))
        self.encoder = nn.ModuleList([Layer(d, 16), Layer(d, 16), Layer(d, 8), Layer(d, 8), Layer(d, 8)])
        self.bridge = nn.Linear(d, d)
        self.scaler = nn.Module()
        self.scaler.scale = nn.Parameter(torch.ones(d))  # in a submodule: registered between the stacks
        self.decoder = nn.ModuleList(Layer(d, 12) for _ in range(3))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, x, y):
        h, gate = prologue(self, (x, y))
        for layer in self.encoder:
            h = layer(h, gate)
        h, gate = bridge(self, h, (x, y))
        for layer in self.decoder:
            h = layer(h, gate)
        return epilogue(self, h, (x, y))


def prologue(m, batch):
    return m.emb(batch[0]), torch.sigmoid(m.gate)  # the gate carries gradient through every encoder layer


def bridge(m, h, batch):
    return torch.tanh(m.bridge(h)), m.scaler.scale * 0.5  # new extras for the decoder


def epilogue(m, h, batch):
    return F.cross_entropy(m.head(m.norm(h)).flatten(0, 1), batch[1].flatten())


def _batch(rank, vocab=23):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randint(0, vocab, (2, 7), generator=g), torch.randint(0, vocab, (2, 7), generator=g)


def towers_ranks(rank, world, tie):
    torch.manual_seed(0)
    module = TwoTowers(tie=tie)
    model, params = fz3.shard(module, ["encoder", "decoder"], prologue, epilogue, between=[bridge])
    names = [p.name for p in model.parts]
    want_parts = ["pre", "encoder[0:2]", "encoder[2:5]", "between.0", "decoder", "post"]
    assert names == want_parts + (["tied:emb.weight"] if tie else []), names
    bs = [_batch(r) for r in range(world)]
    ref_loss, want = reference_grads(module, bs)
    for policy in POLICIES:
        loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
        torch.testing.assert_close(loss, torch.tensor(ref_loss), rtol=1e-5, atol=1e-6)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, want, what=f"two towers tie={tie} {policy} world={world}")
    sd = fz3.module_state_dict(model, params)
    if rank == 0:
        fresh = TwoTowers(tie=tie)
        fresh.load_state_dict(sd, strict=True)
        assert torch.equal(fresh(*bs[0]), module(*bs[0]))
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_two_kinds_of_layers_two_stacks_tied_across_units(world):
    assert dist.run(world, towers_ranks, world != 3) == ["ok"] * world


def assignment_ranks(rank, world):
    class Late(nn.Module):  # registers its final norm before the stack: post uses it all the same
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(6)
            self.emb = nn.Embedding(11, 6)
            self.layers = nn.ModuleList(Layer(6, 8) for _ in range(2))
            self.head = nn.Linear(6, 11)

    def pre(m, b):
        return m.emb(b[0]), torch.ones(())

    def post(m, h, b):
        return F.cross_entropy(m.head(m.norm(h)).flatten(0, 1), b[1].flatten())

    torch.manual_seed(0)
    module = Late()
    b = _batch(rank, 11)
    model, params = fz3.shard(module, "layers", pre, post)  # norm counted as pre's: post cannot use it
    with pytest.raises(ValueError, match=r"post read parameter 'norm\.(weight|bias)', which fz3\.shard "
                                         r"placed in part 'pre'.*assign=\{'norm\.(weight|bias)': 'post'\}"):
        fz3.value_and_grad(model)(params, b)

    def pre_reads_the_head(m, b):  # an extra from post's head: pre is blamed, not a layer
        return m.emb(b[0]), m.head.weight.sum()

    model, params = fz3.shard(Late(), "layers", pre_reads_the_head, post,
                              assign={"norm": "post"})
    with pytest.raises(ValueError, match=r"^pre read parameter 'head\.weight', which fz3\.shard placed "
                                         r"in part 'post'.*assign=\{'head\.weight': 'pre'\}"):
        fz3.value_and_grad(model)(params, b)
    model, params = fz3.shard(module, "layers", pre, post, assign={"norm": "post"})
    assert [s.name for s in model.parts[model.part_index("post")].layout.slots] == ["norm.weight", "norm.bias",
                                                                                     "head.weight", "head.bias"]
    loss, _ = fz3.value_and_grad(model)(params, b)
    h = module.emb(b[0])
    for layer in module.layers:
        h = layer(h, torch.ones(()))
    torch.testing.assert_close(loss, post(module, h, b).detach(), rtol=1e-5, atol=1e-6)
    towers = TwoTowers()
    with pytest.raises(ValueError, match=r"parameter bridge.weight is registered between 'encoder' and 'decoder', "
                                         r"where no between function runs"):
        fz3.shard(towers, ["encoder", "decoder"], prologue, epilogue)
    with pytest.raises(ValueError, match=r"layers=\['decoder', 'encoder'\]: the stacks must be listed in the order"):
        fz3.shard(towers, ["decoder", "encoder"], prologue, epilogue, between=[bridge])
    with pytest.raises(ValueError, match=r"Policy\(resident=\('embedding',\)\): no part named \['embedding'\]"):
        fz3.plan(model, fz3.Policy(resident=("embedding",)))
    return "ok"


def test_assignment_and_its_errors():
    assert dist.run(1, assignment_ranks) == ["ok"]


class Biased(Layer):
    """T5's pattern: the first layer owns a table every layer's computation reads (the
    relative-position bias); ``pre`` computes from it and passes the result as an extra."""

    def __init__(self, d: int, hidden: int, table: bool):
        super().__init__(d, hidden)
        if table:
            self.table = nn.Parameter(torch.randn(d))

    def forward(self, h, bias):
        return super().forward(h, torch.ones(())) + bias


class BiasedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.layers = nn.ModuleList(Biased(6, 8, table=i == 0) for i in range(3))
        self.head = nn.Linear(6, 11)


def _biased_pre(m, b):
    return m.emb(b[0]), torch.tanh(m.layers[0].table)


def _biased_post(m, h, b):
    return F.cross_entropy(m.head(h).flatten(0, 1), b[1].flatten())


class ReadsTable(Biased):
    def forward(self, h, bias):
        return super().forward(h, bias) * self.table.sum()


def assigned_out_of_a_layer_ranks(rank, world):
    torch.manual_seed(0)
    module = BiasedNet()
    bs = [_batch(r, 11) for r in range(world)]
    # without assign=, block 0 differs from the others: two stacks
    model, _ = fz3.shard(module, "layers", _biased_pre, _biased_post)
    assert [p.rows for p in model.parts if p.role is fz3.Role.STACK] == [1, 2]
    model, params = fz3.shard(module, "layers", _biased_pre, _biased_post,
                              assign={"layers.0.table": "pre"})
    assert [p.rows for p in model.parts if p.role is fz3.Role.STACK] == [3], model.parts
    assert "layers.0.table" in [s.name for s in model.parts[model.part_index("pre")].layout.slots]

    def plain(m, b):
        h, bias = _biased_pre(m, b)
        for layer in m.layers:
            h = layer(h, bias)
        return _biased_post(m, h, b)

    ref_loss, want = reference_grads_of(module, plain, bs)
    for policy in (fz3.Policy(), fz3.Policy(activations="save")):
        loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
        torch.testing.assert_close(loss, torch.tensor(ref_loss), rtol=1e-5, atol=1e-6)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, want, what=f"assigned out of a layer, {policy}")
    # a layer that still reads the parameter assigned away is refused by name
    torch.manual_seed(0)
    reader = BiasedNet()
    reader.layers = nn.ModuleList(ReadsTable(6, 8, table=i == 0) for i in range(3))
    model, params = fz3.shard(reader, "layers", _biased_pre, _biased_post,
                              assign={"layers.0.table": "pre"})
    with pytest.raises(ValueError, match=r"layer layers\.0 read parameter 'layers\.0\.table', which "
                                         r"fz3\.shard placed in part 'pre'"):
        fz3.value_and_grad(model, trace=False)(params, bs[rank])
    return "ok"


def reference_grads_of(module, loss_fn, bs):
    """Plain autograd on the unsharded module over the concatenated batch: the mean loss and
    every parameter's gradient, by name."""
    module.zero_grad()
    x = torch.cat([b[0] for b in bs]), torch.cat([b[1] for b in bs])
    loss = loss_fn(module, x)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in module.named_parameters()}


def test_a_parameter_assigned_out_of_a_layer_leaves_it():
    """``assign=`` names a parameter inside a stack layer (issue 30: it was ignored): it moves
    to that part, the layers are compared without it, so they stack as one; loss and every
    gradient against plain autograd on the unsharded model (fp32 rtol 1e-5 / atol 1e-6)."""
    assert dist.run(2, assigned_out_of_a_layer_ranks) == ["ok"] * 2


# Memory.

BIG_VOCAB = GPTConfig(vocab=2048, seq=16, dim=32, heads=4, layers=4)  # embedding + head: 74% of parameters


def gathered_bound_ranks(rank, world):
    module = gpt(BIG_VOCAB)
    model, params = shard_gpt(module)
    share = sum(model.parts[model.part_index(n)].layout.numel for n in ("pre", "post")) / model.numel
    assert share >= 0.6, share
    batch = batches(BIG_VOCAB, world, per_rank=2)[rank]
    sched = fz3.plan(model, fz3.Policy())
    plan = fz3.memory_plan(model, sched, batch)
    unit_bytes = sorted((len(u.layers) * model.parts[u.part].layout.padded * 4 for u in sched.units), reverse=True)
    assert plan.gathered <= unit_bytes[0] + unit_bytes[1], (plan.gathered, unit_bytes[:3])
    everything = sum(p.rows * p.layout.padded for p in model.parts) * 4
    assert plan.gathered < 0.6 * everything  # not embedding + head + layers, as with one outer unit
    rec = fz3.Recorder()
    fz3.value_and_grad(model, sched, recorder=rec)(params, batch)
    assert max(e.gathered_bytes for e in rec.step_events()) == plan.gathered  # the executor agrees
    return "ok"


def test_large_vocabulary_gathers_at_most_two_units():
    assert dist.run(2, gathered_bound_ranks) == ["ok"] * 2


def plan_vs_live_ranks(rank, world):
    """The plan's transient peak (everything but params and optimizer state) against the peak of
    live tensor bytes the step allocates, tracked by a dispatch mode; and after the step only the
    returned gradient shards (and the loss) are left: nothing was copied at the end."""
    out = []
    small = GPTConfig(vocab=512, seq=32, dim=64, heads=4, layers=4)
    runs = [(small, None), (dataclasses.replace(BIG_VOCAB, tie=True), None)]
    if world == 1:  # computing in bf16 one rank's gathered buffers are its shards' casts
        runs.append((small, fz3.Precision(torch.bfloat16, torch.float32)))
    for cfg, precision in runs:
        model, params = shard_gpt(gpt(cfg), precision=precision or fz3.Precision())
        batch = batches(cfg, world, per_rank=4)[rank]
        for policy in POLICIES[:4]:
            sched = fz3.plan(model, policy)
            plan = fz3.memory_plan(model, sched, batch)
            # one rank gathers a copy too (fz3.step.memory): its gathered buffers are counted
            assert plan.gathered > 0, plan
            step = fz3.value_and_grad(model, sched)
            step(params, batch)  # warm: nothing cached on the first call is counted
            with LiveBytes(writes=True) as live:
                loss, grads = step(params, batch)
                # gloo keeps the tensors of its last completed collectives until later ones
                # complete: one more collective lets them go, so what is left is fz3's
                torch.distributed.barrier()
                left = live.mark()
            predicted = plan.peak - plan.params - plan.optimizer
            out.append((cfg.vocab, str(policy), predicted, live.peak))
            # The plan within 5% of what was measured: 0.3-3.3% under it here, every run
            # alike (LiveBytes tells storages apart by identity, not address). It failed at
            # 12% before a tied embedding's buffer was released while pre's graph held it.
            assert abs(predicted / live.peak - 1) <= 0.05, (cfg, policy, predicted, live.peak)
            # at the end: the gradient shards, written in place, and the loss (a few bytes)
            assert live.now - plan.grads < 64, (policy, live.now, plan.grads, left)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_memory_plan_matches_live_bytes(world):
    """At one rank nothing is gathered (``fz3.comm``): the plan counts no gathered buffers in
    fp32, and the casts in bf16."""
    out = dist.run(world, plan_vs_live_ranks, timeout=240)[0]
    assert len(out) == (12 if world == 1 else 8)
