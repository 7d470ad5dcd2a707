"""``fz3.optim.muon`` against ``torch.optim.Muon`` (stack matrices) + ``torch.optim.AdamW`` (the
rest), step by step, at world sizes 1, 2 and 3 (uneven shards, matrices crossing shard
boundaries), plain and after ``clip_by_global_norm``, with a really frozen parameter; its
donate path against its update path; its state saved at world size 2 and loaded at 3; a 3-D
expert parameter with a rank owning no matrix; and what it refuses.

Step by step: before each step the reference takes fz3's own parameters and gradients,
gathered to full tensors, and steps once, its state carried from its previous step; fz3's
parameters after its step must be within a relative norm of the reference's. Comparing free
runs is not possible: bf16 Newton-Schulz turns a last-bit difference of a reduced gradient into
~5e-3 after 3 steps even when both are right (issue 53), while the bugs this test is for (no
Nesterov, momentum not sharded right, a slice sent to the wrong place) are off by 1e-2 or
more after one step. Tolerances: 1e-6 at world size 1, 1e-4 at 2 and 3 (issue 53's); the
errors seen are below 1e-7 at every size (the update's last-bit rounding differs from torch's).
Gradients come from ``value_and_grad(trace=False)``: tracing would cost seconds per rank and
this tests the optimizer.
"""

from __future__ import annotations

import copy
import os
import pickle

import optree
import pytest
import torch

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from fz3.optim.newton_schulz import flops
from fz3.optim.owners import plan
from fz3.schedule.structure import Role
from fz3.sharding.matrices import expand, matrix_runs
from fz3.sharding.parts import partition
from reference import LayerNet, batches, fz3_said, gpt, layer_post, layer_pre

CFG = GPTConfig(vocab=37, seq=8, dim=20, heads=4, layers=3, mlp_ratio=3)  # matrices cross
# the shard boundaries at world sizes 2 and 3
HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
TOL = {1: 1e-6, 2: 1e-4, 3: 1e-4}


class Reference:
    """torch.optim.Muon over the stack's matrices (each expert of a 3-D one its own tensor)
    and torch.optim.AdamW over the rest of an unsharded copy; ``step(params, grads, norm)``
    loads fz3's full tensors, clips with fz3's norm if given, and steps once."""

    def __init__(self, module, stack, clip=None, masked=False, lr=None):
        self.clip, self.lr, self.steps = clip, lr, 0  # lr: Muon's schedule, if any
        named = {n: p for n, p in copy.deepcopy(module).named_parameters() if p.requires_grad}
        self.matrices = {n: [p] if p.dim() == 2 else [e.clone() for e in p.detach()]
                         for n, p in named.items() if n.startswith(stack + ".") and p.dim() > 1}
        self.rest = {n: p for n, p in named.items() if n not in self.matrices}
        self.muon = torch.optim.Muon([e for ps in self.matrices.values() for e in ps], **HP)
        decays = [p for p in self.rest.values() if p.dim() > 1 or not masked]
        self.adam = torch.optim.AdamW([  # masked: fz3.decay_mask's rule, matrices decay
            {"params": decays},
            {"params": [p for p in self.rest.values() if all(p is not q for q in decays)],
             "weight_decay": 0.0}], **ADAM)

    def step(self, params: dict, grads: dict, norm=None) -> dict:
        # torch.nn.utils.clip_grad_norm_'s coefficient, from fz3's norm (fp32, as torch's)
        coef = 1.0 if norm is None else (self.clip / (norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for n, ps in [*self.matrices.items(), *((n, [p]) for n, p in self.rest.items())]:
                full, grad = params[n].reshape(-1, *ps[0].shape), grads[n] * coef
                for p, value, g in zip(ps, full, grad.reshape(full.shape)):
                    p.copy_(value)
                    p.grad = g.clone()
        self.steps += 1
        if self.lr is not None:
            self.muon.param_groups[0]["lr"] = self.lr(self.steps)
        self.muon.step()
        self.adam.step()
        out = {n: torch.stack([p.detach() for p in ps]).reshape(params[n].shape)
               for n, ps in self.matrices.items()}
        return {**out, **{n: p.detach().clone() for n, p in self.rest.items()}}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _matrices_equal(model, a, b) -> bool:
    """Bitwise equality of two params trees on every stack part's matrix columns."""
    return all(torch.equal(a.parts[i][:, lo:hi], b.parts[i][:, lo:hi])
               for i, part in enumerate(model.parts) if part.role is Role.STACK
               for lo, hi in matrix_runs(part, model.rank))


def _steps(rank, model, params, opt, ref, batch_of, steps=3):
    """``steps`` steps, each checked against ``ref``, and the donate path bitwise against the
    update path on the matrices (steps go on from one, then the other). Returns the worst
    relative error (rank 0; 0.0 elsewhere) and the final params and state."""
    state, worst = opt.init(params), 0.0
    value_and_grad = fz3.value_and_grad(model, trace=False)
    for s in range(steps):
        _, grads = value_and_grad(params, batch_of(s))
        full_p, full_g = fz3.module_state_dict(model, params), fz3.full_state_dict(model, grads)
        copies = optree.tree_map(torch.clone, (state, params))
        updates, new_state = opt.update(grads, state, params)
        new = fz3.optim.apply_updates(params, updates)
        donated, donated_state = fz3.optim.step(opt, grads, *copies, donate=True)
        assert _matrices_equal(model, new, donated), "the donate path differs from the update path"
        norm = new_state[0].norm if ref.clip else None
        got = fz3.module_state_dict(model, new)
        if rank == 0:
            if ref.clip:
                want_norm = torch.nn.utils.get_total_norm(list(full_g.values()))
                assert _rel(norm, want_norm) <= 1e-5, (float(norm), float(want_norm))
            want = ref.step(full_p, full_g, norm)
            errors = {n: _rel(got[n], want[n]) for n in want}
            worst = max(worst, *errors.values())
            assert worst <= TOL[model.world_size], (s, {n: e for n, e in errors.items()
                                                        if e > 1e-7})
        params, state = (donated, donated_state) if s % 2 else (new, new_state)
    return worst, params, state


def _full(model, tree) -> dict | None:
    """A Params-shaped tree (None parts as zeros) or a Rest (expanded) gathered to rank 0."""
    if isinstance(tree, fz3.optim.Rest):
        tree = expand(model, tree)
    return fz3.full_state_dict(model, fz3.Params(tuple(
        torch.zeros(p.layout.shard_numel) if t is None else t
        for p, t in zip(model.parts, tree.parts))))


def _state_full(model, state) -> dict:
    return {"momentum": _full(model, state.momentum), "mu": _full(model, state.others.mu),
            "nu": _full(model, state.others.nu)}


def gpt_ranks(rank, world, folder):
    module = gpt(CFG)
    module.pos.weight.requires_grad_(False)  # really frozen: no gradient, no state
    model, params = shard_gpt(module)
    mask = fz3.optim.rest_of(model, fz3.decay_mask(model))  # no decay for norms and biases
    muon = fz3.optim.muon(model, **HP, others=fz3.optim.adamw(**ADAM, mask=mask))
    batch_of = lambda s: batches(CFG, world, step=s)[rank]  # noqa: E731
    worst, params, state = _steps(rank, model, params, muon,
                                  Reference(module, "blocks", masked=True), batch_of)
    momentum = [t for t in state.momentum.parts if t is not None]
    matrices = sum(p.rows * s.numel for p in model.parts for s in p.layout.slots
                   if p.role is Role.STACK and len(s.shape) == 2)
    share = sum(t.numel() for t in momentum) / (matrices / world)
    assert share <= 1.2, share
    layout = str(optree.tree_structure(state))
    if world == 2:  # saved here, loaded at world size 3 (load_ranks)
        fz3.save(os.path.join(folder, "muon"), model, {"params": params, "opt": state})
        full = _state_full(model, state)
        if rank == 0:
            pickle.dump(full, open(os.path.join(folder, "muon.full"), "wb"))
    clip = fz3.optim.chain(fz3.optim.clip_by_global_norm(0.5, model), muon)
    worst_clip, _, _ = _steps(rank, model, params, clip,
                              Reference(module, "blocks", 0.5, masked=True), batch_of)
    return worst, worst_clip, layout


def load_ranks(rank, world, folder):
    """World size 3 reads the state world size 2 saved: the same full tensors, and a step."""
    module = gpt(CFG)
    module.pos.weight.requires_grad_(False)
    model, params = shard_gpt(module)
    muon = fz3.optim.muon(model, **HP, others=fz3.optim.adamw(
        **ADAM, mask=fz3.optim.rest_of(model, fz3.decay_mask(model))))
    loaded = fz3.load(os.path.join(folder, "muon"), model,
                      {"params": params, "opt": muon.init(params)})
    got = _state_full(model, loaded["opt"])
    if rank == 0:
        want = pickle.load(open(os.path.join(folder, "muon.full"), "rb"))
        for kind in want:
            for n in want[kind]:
                assert torch.equal(got[kind][n], want[kind][n]), (kind, n)
    assert int(loaded["opt"].count) == 3
    _, grads = fz3.value_and_grad(model, trace=False)(loaded["params"], batches(CFG, 3)[rank])
    fz3.optim.step(muon, grads, loaded["opt"], loaded["params"], donate=True)
    return "ok"


class Experts(torch.nn.Module):
    """A layer with a 3-D parameter (2 experts of 6x6) and a norm."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 6, 6) * 0.4)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, h):
        return h + torch.tanh(self.norm(h) @ self.w[0]) @ self.w[1]


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.k = torch.nn.Parameter(torch.zeros(1, 1, 2, 3))

    def forward(self, h):
        return h * self.k.sum()


def experts_ranks(rank, world):
    """Experts orthogonalized one matrix each, said once; at world size 3 rank 2 owns no
    matrix and still takes part; a schedule for lr; fz3.optim.freeze after muon; and what
    muon refuses, on every rank."""
    torch.manual_seed(0)
    net = LayerNet([Experts()])
    model, params = fz3.shard(net, "layers", layer_pre, layer_post)
    schedule = {**HP, "lr": lambda t: 0.02 / t}
    with fz3_said() as said:
        muon = fz3.optim.muon(model, **schedule, others=fz3.optim.adamw(**ADAM))
    assert said == (["fz3.optim.muon: layers.*.w [2, 6, 6] orthogonalized per expert (one "
                     "matrix per leading index)"] if rank == 0 else []), said
    owners = plan(model.parts, world, 5).owners
    assert len(owners) == 2 and (world < 3 or 2 not in owners), owners

    def batch_of(s):
        g = torch.Generator().manual_seed(100 * s + rank)
        return torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g)

    worst, params, _ = _steps(rank, model, params, muon,
                              Reference(net, "layers", lr=schedule["lr"]), batch_of)
    frozen = fz3.optim.chain(muon, fz3.optim.freeze(model, {"layers.0.w", "head.bias"}))
    _, grads = fz3.value_and_grad(model, trace=False)(params, batch_of(0))
    before = fz3.module_state_dict(model, params)
    mine = optree.tree_map(torch.clone, params)  # donated: the fused step, named ones put back
    after = fz3.module_state_dict(model, fz3.optim.step(frozen, grads, frozen.init(mine),
                                                        mine, donate=True)[0])
    if rank == 0:
        assert [n for n in before if torch.equal(before[n], after[n])] == ["layers.0.w",
                                                                          "head.bias"]
    for layer, what in ((Conv(), r"layers.0.k is \[1, 1, 2, 3\]: Muon orthogonalizes 2-D"),
                        (torch.nn.LayerNorm(6), r"the layer stack layers has no 2-D parameter")):
        bad, _ = fz3.shard(LayerNet([layer, copy.deepcopy(layer)]), "layers", layer_pre,
                           layer_post)
        with pytest.raises(ValueError, match=what):
            fz3.optim.muon(bad)
    other, other_params = fz3.shard(LayerNet([Experts(), Experts()]), "layers", layer_pre,
                                    layer_post)
    with pytest.raises(ValueError, match=r"momentum of part layers is \[2, .*, this model's is "
                                         r"\[1, "):
        muon.update(grads, fz3.optim.muon(other).init(other_params), params)
    _absent(rank)
    return worst


def _absent(rank):
    """A rank that never calls ``update`` is named by the others (not a hang until the process
    group's timeout); last: the model that waited is unusable after."""
    from fz3.comm.compat import default_store

    model, params = fz3.shard(LayerNet([Experts()]), "layers", layer_pre, layer_post, timeout=1)
    muon = fz3.optim.muon(model)
    grads = optree.tree_map(torch.ones_like, params)
    if rank == 1:
        default_store().wait(["test/muon/absent"])
        return
    # (a rank may see the other waiting rank give up first: then it names both, that one as
    # gave up waiting; rank 1 is named on every rank as the one that made no call)
    with pytest.raises(fz3.CollectiveMismatchError, match=r"ranks \[[0-9, ]*1[0-9, ]*\] did not "
                                                          r"come within 1 s.*rank 1: no fz3 call "
                                                          r"after"):
        muon.update(grads, muon.init(params), params)
    if rank == 0:
        default_store().set("test/muon/absent", "1")


def test_muon_matches_torch_at_world_sizes_1_2_3(tmp_path):
    errors = {w: dist.run(w, gpt_ranks, str(tmp_path)) for w in (1, 2, 3)}
    for w, ranks in errors.items():
        assert len({layout for _, _, layout in ranks}) == 1, f"world {w}: state structures differ"
        print(f"world {w}: worst relative error {ranks[0][0]:.2g}, after clipping "
              f"{ranks[0][1]:.2g}")
    assert dist.run(3, load_ranks, str(tmp_path)) == ["ok"] * 3


def test_muon_experts_and_refusals():
    print("worst relative error", dist.run(3, experts_ranks)[0])


def test_owner_plan_balances_and_moves_every_slice_once():
    """The plan alone (no ranks): at world sizes 1-8, no rank's Newton-Schulz FLOPs exceed
    1.1x the mean plus one matrix; every element of every matrix is in exactly one slice; what
    each rank sends to another is what that one expects; each owner assembles its matrices
    from all it receives. The test model's matrices cross shard boundaries at sizes 2 and 3."""
    wide = GPTConfig(vocab=37, seq=8, dim=48, heads=4, layers=5)
    tested = gpt(CFG)  # test_muon_matches_torch_at_world_sizes_1_2_3's model
    for module, path in ((tested, "blocks"), (gpt(wide), "blocks"),
                         (LayerNet([Experts() for _ in range(3)]), "layers")):
        for world in range(1, 9):
            p = plan(partition(module, [path], world, between=[]).parts, world, 5)
            biggest = max(flops(m.shape, 5) for m in p.matrices)
            assert max(p.flops) <= 1.1 * sum(p.flops) / world + biggest, (world, p.flops)
            slices: dict[int, list] = {}
            for r, ex in enumerate(p.exchange(q) for q in range(world)):
                assert [p.exchange(q).recv_sizes[r] for q in range(world)] == list(ex.send_sizes)
                assert sorted(ex.assemble) == list(range(len(ex.runs)))
                assert sum(ex.runs) == sum(n * a * b for (a, b), n in ex.groups)
                for piece in ex.send:
                    slices.setdefault(piece.matrix, []).append(piece)
            for m, matrix in enumerate(p.matrices):
                spans = sorted((q.offset, q.offset + q.stop - q.first) for q in slices[m])
                ends = [0] + [hi for _, hi in spans]
                assert [lo for lo, _ in spans] == ends[:-1] and ends[-1] == matrix.shape[0] * \
                    matrix.shape[1], (world, matrix.name, spans)
            if module is tested and world in (2, 3):
                assert any(len(v) > 1 for v in slices.values()), "no matrix crosses a boundary"
            # one unit's exchange (train_step's per-unit update): its layers' matrices, their
            # owners the whole plan's, rows from the unit's first; units of 2 layers cover all
            parts = partition(module, [path], world, between=[]).parts
            stack = next(i for i, part in enumerate(parts) if part.role is Role.STACK)
            units = [p.only(stack, slice(a, min(a + 2, parts[stack].rows)))
                     for a in range(0, parts[stack].rows, 2)]
            assert [(m.name, o) for u in units for m, o in zip(u.matrices, u.owners)] == \
                [(m.name, o) for m, o in zip(p.matrices, p.owners) if m.part == stack]
            assert all(0 <= q.row < 2 for u in units for pieces in u.pieces
                       for q in pieces.values())
            assert all(sum(u.exchange(q).send_sizes) == sum(u.exchange(r).recv_sizes[q]
                                                            for r in range(world))
                       for u in units for q in range(world))
