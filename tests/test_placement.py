"""A user's own model, never silently wrong (issue 50): parameters placed by what each function
reads (``fz3.shard(example=...)``), a read outside a function's part raised by name in every
engine, and blocks in any container (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``).

Stand-ins for models nobody here wrote: litgpt's ``GPT`` (``lm_head`` registered before
``transformer``, read by ``post``: a wrong loss with no error before this change), timm's
``nn.Sequential`` of blocks, torchtitan's ``nn.ModuleDict`` of layers.

Reference: plain PyTorch autograd on the unsharded module over the concatenated batch, fp32
rtol 1e-5 / atol 1e-6, at world size 2 (one group of ranks runs every case)."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dist
import fz3
from fz3.sharding.unreachable import PartReadError
from reference import assert_close, fz3_said

V, D, L = 29, 12, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class HeadFirst(nn.Module):
    """litgpt's order: the head is registered before the embedding and the blocks."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(D, V, bias=False)
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(V, D)
        self.transformer.h = nn.ModuleList(Block() for _ in range(L))
        self.transformer.ln_f = nn.LayerNorm(D)
        self.spare = nn.Parameter(torch.ones(D))  # read by no function: stays where registered

    def forward(self, x, y):
        h = self.transformer.wte(x)
        for b in self.transformer.h:
            h = b(h)
        return F.cross_entropy(self.lm_head(self.transformer.ln_f(h)).flatten(0, 1), y.flatten())


def head_first_pre(m, b):
    return m.transformer.wte(b[0])


def head_first_post(m, h, b):
    return F.cross_entropy(m.lm_head(m.transformer.ln_f(h)).flatten(0, 1), b[1].flatten())


class Container(nn.Module):
    """timm's blocks in an ``nn.Sequential``, torchtitan's in an ``nn.ModuleDict``; ``scale``
    is read by pre and by post (not tied: one parameter, two readers)."""

    def __init__(self, kind: str):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.scale = nn.Parameter(torch.rand(D) + 0.5)
        blocks = [Block() for _ in range(L)]
        self.blocks = (nn.Sequential(*blocks) if kind == "sequential"
                       else nn.ModuleDict({f"layer_{i}": b for i, b in enumerate(blocks)}))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, x, y):
        h = self.embed(x) * self.scale
        h = self.blocks(h) if isinstance(self.blocks, nn.Sequential) else h
        if isinstance(self.blocks, nn.ModuleDict):
            for b in self.blocks.values():
                h = b(h)
        logits = self.head(self.norm(h) * self.scale)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def container_pre(m, b):
    return m.embed(b[0]) * m.scale


def container_post(m, h, b):
    return F.cross_entropy(m.head(m.norm(h) * m.scale).flatten(0, 1), b[1].flatten())


def _batch(rank: int, n: int = 2):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randint(0, V, (n, 7), generator=g), torch.randint(0, V, (n, 7), generator=g))


def _reference(module, world):
    m = copy.deepcopy(module)
    bs = [_batch(r) for r in range(world)]
    loss = m(*(torch.cat(t) for t in zip(*bs)))
    loss.backward()
    return float(loss.detach()), {n: torch.zeros_like(p) if p.grad is None else p.grad
                                  for n, p in m.named_parameters(remove_duplicate=False)}


def _check(module, model, params, rank, world, what, trace=True):
    want_loss, want = _reference(module, world)
    loss, grads = fz3.value_and_grad(model, trace=trace)(params, _batch(rank))
    losses = [torch.zeros(()) for _ in range(world)]
    torch.distributed.all_gather(losses, loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), torch.tensor(want_loss),
                               rtol=1e-5, atol=1e-6, msg=what)
    got = fz3.full_state_dict(model, grads)
    if rank == 0:
        assert_close(got, {n: g for n, g in want.items() if n in got}, what=what)
        assert set(got) == {n for n, p in module.named_parameters() if p.requires_grad}, what


def placement_ranks(rank, world, folder):
    torch.manual_seed(0)
    module = HeadFirst()
    before = {n: p.detach().clone() for n, p in module.state_dict().items()}
    # without example=: registration order puts lm_head in pre; post's read raises by name, in
    # every engine, on every rank (never the wrong loss it was)
    model, params = fz3.shard(module, "transformer.h", head_first_pre, head_first_post)
    assert model.parts[0].name == "pre" and "lm_head.weight" in [
        s.name for s in model.parts[0].layout.slots]
    for trace in (True, False):
        with pytest.raises(PartReadError, match=r"^post read parameter 'lm_head\.weight', which "
                           r"fz3\.shard placed in part 'pre'.*example=.*assign=\{'lm_head\.weight'"
                           r": 'post'\}"):
            fz3.value_and_grad(model, trace=trace)(params, _batch(rank))
    # with example=: the head goes to post, said in the parts table; numbers right
    with fz3_said() as said:
        model, params = fz3.shard(module, "transformer.h", head_first_pre, head_first_post,
                                  example=_batch(rank))
    post = model.parts[model.part_index("post")]
    assert [s.name for s in post.layout.slots] == ["lm_head.weight", "transformer.ln_f.weight",
                                                   "transformer.ln_f.bias"]
    assert "lm_head.weight: registered in pre, read by post" in str(model.parts)
    assert "spare" in [s.name for s in model.parts[0].layout.slots]  # nobody reads it
    if rank == 0:
        assert any("no function read 1 parameter" in s and "spare" in s for s in said), said
    for trace in (True, False):
        _check(module, model, params, rank, world, f"head first, trace={trace}", trace)
    # a checkpoint saved with the old placement is refused, naming the parameter and the
    # assign= that shards the model as it was saved (which then loads it)
    old, old_params = fz3.shard(module, "transformer.h", head_first_pre, head_first_post)
    fz3.save(folder, old, {"params": old_params})
    with pytest.raises(ValueError, match=r"holds 1 parameter\(s\) in another part than this model: "
                                         r"lm_head\.weight \(pre there, post here\).*"
                                         r"assign=\{'lm_head\.weight': 'pre'\}"):
        fz3.load(folder, model, {"params": params})
    back = fz3.load(folder, old, {"params": old_params})["params"]
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(old_params)))
    # the user's module is untouched and its own forward still runs
    assert all(torch.equal(before[n], t) for n, t in module.state_dict().items())
    module(*_batch(rank)).backward()

    # a parameter read by pre and by post: one shared part, its gradient summed
    for kind in ("sequential", "dict"):
        torch.manual_seed(1)
        module = Container(kind)
        blocks = module.blocks
        model, params = fz3.shard(module, "blocks", container_pre, container_post,
                                  example=_batch(rank))
        assert module.blocks is blocks and type(module.blocks) is type(blocks)
        names = [p.name for p in model.parts]
        assert names == ["pre", "blocks", "post", "tied:scale"], names
        _check(module, model, params, rank, world, f"{kind} container")
        module(*_batch(rank)).backward()  # its own forward, after fz3.shard
        state = fz3.module_state_dict(model, params)
        if rank == 0:
            assert set(state) == set(module.state_dict())
            key = "blocks.layer_1.fc.weight" if kind == "dict" else "blocks.1.fc.weight"
            torch.testing.assert_close(state[key], module.state_dict()[key], rtol=0, atol=0)
    # without example=, the same shared read raises (scale registered before the blocks: pre's)
    model, params = fz3.shard(Container("dict"), "blocks", container_pre, container_post)
    with pytest.raises(PartReadError, match=r"^post read parameter 'scale'"):
        fz3.value_and_grad(model)(params, _batch(rank))

    # a layer that reads a parameter outside the layers (through a module it keeps a plain
    # reference to) is refused at fz3.shard with example=, and raises at the step without
    class Reader(Block):
        def forward(self, h):
            return super().forward(h) + self.owner.table

    class Tabled(Container):
        def __init__(self):
            super().__init__("sequential")
            self.tables = nn.Module()
            self.tables.table = nn.Parameter(torch.zeros(D))
            self.blocks = nn.ModuleList(Reader() for _ in range(L))
            for b in self.blocks:
                object.__setattr__(b, "owner", self.tables)

    with pytest.raises(ValueError, match=r"layer blocks\.0 reads parameter 'tables\.table', which "
                                         r"is outside the layers.*as an extra"):
        fz3.shard(Tabled(), "blocks", container_pre, container_post, example=_batch(rank))
    model, params = fz3.shard(Tabled(), "blocks", container_pre, container_post,
                              assign={"scale": "pre"})
    with pytest.raises(PartReadError, match=r"^layer blocks\.0 read parameter 'tables\.table'"):
        fz3.value_and_grad(model, trace=False)(params, _batch(rank))

    # a read that the example's shapes do not take (a branch on the batch) still raises at the
    # step, naming the parameter
    def branchy_post(m, h, b):
        out = container_post(m, h, b)
        return out + m.embed.weight.sum() * 0 if b[0].shape[1] > 7 else out

    model, params = fz3.shard(Container("sequential"), "blocks", container_pre, branchy_post,
                              example=_batch(rank))
    fz3.value_and_grad(model)(params, _batch(rank))
    longer = tuple(torch.cat([t, t], 1) for t in _batch(rank))
    with pytest.raises(PartReadError, match=r"^post read parameter 'embed\.weight', which "
                                            r"fz3\.shard placed in part 'pre'"):
        fz3.value_and_grad(model)(params, longer)
    # one block object repeated (ALBERT's sharing) is refused by name, not run once
    shared = Container("sequential")
    shared.blocks = nn.ModuleList([shared.blocks[0]] * L)
    with pytest.raises(ValueError, match=r"blocks\.1\.norm\.weight is the same Parameter as "
                                         r"blocks\.0\.norm\.weight"):
        fz3.shard(shared, "blocks", container_pre, container_post)
    # a function that fails on the example is named, with the fix
    with pytest.raises(ValueError, match=r"ran pre on fake tensors of the example batch.*failed"):
        fz3.shard(Container("sequential"), "blocks", container_pre, container_post,
                  example=("not", "a batch"))
    return "ok"


def test_parameters_placed_by_use_and_any_container(tmp_path):
    assert dist.run(2, placement_ranks, str(tmp_path / "ckpt")) == ["ok", "ok"]


def test_a_placeholder_is_never_read_as_values():
    """The skeleton's placeholders: CPU ``linear`` with a meta weight returns garbage in torch
    2.13 (why meta placeholders were not enough); an ``Unreachable`` raises on any op that
    reads values, and ops of metadata only give unreachable tensors again."""
    from fz3.sharding.unreachable import Unreachable

    w = Unreachable(torch.empty(4, 3, device="meta"), "head.weight", "pre")
    x = torch.randn(2, 3)
    for read in (lambda: F.linear(x, w), lambda: x @ w.t(), lambda: w + 1, lambda: w.sum(),
                 lambda: w.clone(), lambda: x + torch.zeros_like(w)[0, :3]):
        with pytest.raises(PartReadError, match=r"read parameter 'head\.weight', which fz3\.shard "
                                                r"placed in part 'pre'"):
            read()
    for init in (torch.nn.init.normal_, torch.nn.init.trunc_normal_, torch.nn.init.orthogonal_):
        assert init(w) is w  # an initialiser (weights= runs HF's _init_weights) does nothing
    with pytest.raises(PartReadError):
        x @ w.t()[:, :2].unsqueeze(0)  # views stay unreachable
    assert w.shape == (4, 3) and w.dtype == torch.float32 and w.is_meta
    assert isinstance(w.detach(), Unreachable) and "head.weight" in repr(w)
    assert isinstance(copy.deepcopy(w), Unreachable)
