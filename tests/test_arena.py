"""Fixed buffers (issue 26, item 2; ``fz3.step.arena``): a step function's gathers, k-layer
copies, one-layer units' unreduced gradients and low-precision reduces write into buffers
made at their first use and reused every step at the same addresses. Checked at world size 2
(gloo), over policies, units of one and two layers, frozen parameters and a bf16 reduce:

- each step's result is plain autograd's (fp32 rtol 1e-5 / atol 1e-6) and the same bit for bit
  in steps 1-3 (slots reused; what the last step left in them never leaks in);
- from the second step on, every fixed buffer keeps its address (``data_ptr``) and the arena
  its size (an address alone proves little: malloc hands a freed block back);
- in a steady step (a dispatch mode sees every ATen op's output, a recorder files it under its
  op), the ops that move memory allocate nothing but the result's gradient shards and the
  gathers of units whose graphs hold their buffers past ``free`` (pre's; with ``trace=False``
  and ``save``, the layers'); a one-layer unit's traced backward allocates no gradient of its
  size (the arena's Note says what stays allocated);
- the layers' parameter views are made once per gathered row, never again for a one-layer
  unit's fixed buffer (counted).

At 3 ranks, with padding: a bf16 step, prefetch 2 over two-layer units, an all-reduce, no
resharding, each bitwise equal to new buffers. And ``Arena.plan`` over 216 planned schedules
against what the ops mean: no two buffers alive at once share one.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from fz3.schedule.structure import Role
from reference import assert_close, batches, gpt, reference_grads, sharded_grads

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=4)
# (activations, layers_per_unit, trace, frozen, reduce dtype)
CASES = [("save", 1, True, False, None), ("recompute", 1, True, False, None),
         ("save", 2, True, False, None), ("recompute", 2, True, True, None),
         ("save", 1, True, True, torch.bfloat16), ("save", 1, False, False, None),
         ("recompute", 2, False, False, None)]


class Allocations(TorchDispatchMode):
    """Each ATen op's outputs on storage none of its inputs has, as (numel, op), by schedule op
    (``ByOp`` closes each op's list)."""

    def __init__(self):
        super().__init__()
        self.pending: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        self.pending += [(t.numel(), str(func)) for t in _tensors(out)
                         if t.untyped_storage().data_ptr() not in inputs]
        return out


class ByOp(fz3.Recorder):
    """A recorder that files ``mode``'s allocations under the op that made them."""

    def __init__(self, mode: Allocations):
        super().__init__()
        self.mode, self.by_op = mode, {}

    def record(self, index, *args):
        super().record(index, *args)
        self.by_op[index], self.mode.pending = self.mode.pending, []


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


MOVES = {"gather", "wait", "free", "reduce", "wait_reduce"}


def _freeze(module):
    for n, p in module.named_parameters():
        if ".attn.qkv." in n or ".ln1." in n:
            p.requires_grad_(False)
    return module


def _addresses(arena) -> list[int]:
    return [b.tensor.data_ptr() for made in arena.kinds.values() for b in made
            if b.tensor is not None]


def arena_ranks(rank, world):
    out = []
    for activations, k, trace, frozen, reduce in CASES:
        module = gpt(CFG)
        if frozen:
            _freeze(module)
        model, params = shard_gpt(module, precision=fz3.Precision(reduce_dtype=reduce))
        bs = batches(CFG, world)
        _, want = reference_grads(module, bs)
        want = {n: g for n, g in want.items() if dict(module.named_parameters())[n].requires_grad}
        mode = Allocations()
        recorder = ByOp(mode)
        step = fz3.value_and_grad(model, fz3.Policy(activations=activations, layers_per_unit=k),
                                  trace=trace, check_sync=False, recorder=recorder,
                                  fixed_buffers=True)
        results = {p: p.rows * p.layout.shard_numel for p in model.parts}  # gradient shards
        stack = [u for u in step.schedule.units if u.role is Role.STACK][0]
        grads, addresses, sizes = [], [], []
        for i in range(3):
            if i < 2:  # the first step traces (not under a dispatch mode)
                _, g = step(params, bs[rank])
            else:
                with mode:
                    _, g = step(params, bs[rank])
            grads.append(sharded_grads(model, g))
            addresses.append(_addresses(step.arena))
            sizes.append(step.arena.nbytes())
        # what the steady step's ops that move memory allocated, but for the result's shards
        ops = step.schedule.ops
        moved = [(ops[i].kind.value, n, f) for i, made in recorder.by_op.items() for n, f in made
                 if ops[i].kind.value in MOVES and n not in results.values()]
        compute = sum(len(made) for i, made in recorder.by_op.items()
                      if ops[i].kind.value not in MOVES)
        case = (f"{activations}, {k} layer(s) a unit, trace={trace}, frozen={frozen}, "
                f"reduce {reduce}")
        if rank == 0:
            # bf16 reduce: each rank's gradient is rounded to bf16 before the sum
            tol = dict(rtol=2e-2, atol=2e-3) if reduce is not None else {}
            assert_close(grads[0], want, what=case, **tol)
            for g in grads[1:]:
                assert all(torch.equal(g[n], grads[0][n]) for n in want), case
        holds = not trace and activations == "save"  # autograd graphs hold their gathers
        assert holds or addresses[1] == addresses[2] and addresses[1], (case, addresses)
        # The only gathers that allocate: pre's, whose autograd graph (the embedding's) holds
        # its buffer past its free; with trace=False and save, each layer unit's too but the
        # last's (its backward follows its forward, no free between).
        pre = world * model.parts[model.part_index("pre")].layout.shard_numel
        layer = world * k * model.parts[stack.part].layout.shard_numel
        want_moved = [("gather", pre)] + [("gather", layer)] * (holds * (CFG.layers // k - 1))
        assert sorted((kind, n) for kind, n, _ in moved) == sorted(want_moved), (case, moved)
        # A one-layer unit's traced backward writes its unreduced gradient into a fixed buffer;
        # its gradient is made anew where autograd makes it, stacked for k layers, or cast.
        made = [f for i, done in recorder.by_op.items() for n, f in done
                if ops[i].kind.value == "backward" and n == layer]
        fixed = trace and k == 1 and reduce is None
        assert (made == []) == fixed, (case, made)
        assert sizes[1] == sizes[2] > 0, (case, sizes)
        out.append((case, moved, compute, len(addresses[2]), sizes[2]))
    assert fz3.value_and_grad(model).arena is None  # opt-in: nothing kept between steps
    return out


def accumulate_ranks(rank, world):
    """``fz3.accumulate`` with fixed buffers (its two programs share them; the deferred one's
    carried gradients are not fixed): bitwise the same as without, over two calls."""
    model, params = shard_gpt(gpt(CFG))
    micro = [batches(CFG, world, step=i)[rank] for i in range(3)]
    sizes = {}
    for policy in ("reduce", "defer"):
        want = [sharded_grads(model, fz3.accumulate(model, policy=policy)(params, micro)[1])
                for _ in range(2)]
        f = fz3.accumulate(model, policy=policy, fixed_buffers=True)
        got = [sharded_grads(model, f(params, micro)[1]) for _ in range(2)]
        sizes[policy] = f.arena.nbytes()
        assert sizes[policy] > 0
        for g, w in zip(got, want):
            assert rank != 0 or all(torch.equal(g[n], w[n]) for n in w), policy
    # the deferred program (no fixed gradients: they are carried) reuses the other's buffers
    assert sizes["defer"] <= sizes["reduce"], sizes
    return "ok"


PADDED = GPTConfig(vocab=37, seq=8, dim=35, heads=5, layers=4)  # a layer's 15,050 pad at 3 ranks
# (policy, precision): what the cases above leave out
VARIANTS = [(fz3.Policy(activations="save"), fz3.Precision(torch.bfloat16, torch.bfloat16)),
            (fz3.Policy(activations="recompute", prefetch=2, layers_per_unit=2), fz3.Precision()),
            (fz3.Policy(activations="save", reduce="all_reduce"), fz3.Precision()),
            (fz3.Policy(activations="save", reshard_after_forward=False), fz3.Precision())]


def variants_ranks(rank, world):
    """At 3 ranks, with padding: a bf16 step (its fixed gradient in bf16), prefetch 2 over
    two-layer units, an all-reduce, no resharding. Each step function with fixed buffers
    returns what the same one without returns, bit for bit, over 3 steps, and from the
    second on its buffers keep their addresses."""
    model, params = shard_gpt(gpt(PADDED))
    layout = model.parts[model.part_index("blocks")].layout
    assert layout.padded > layout.numel, layout  # padded
    out = []
    for policy, precision in VARIANTS:
        model, params = shard_gpt(gpt(PADDED), precision=precision)
        plain = fz3.value_and_grad(model, policy, check_sync=False)
        fixed = fz3.value_and_grad(model, policy, check_sync=False, fixed_buffers=True)
        addresses = []
        for i in range(3):
            b = batches(PADDED, world, step=i)[rank]
            (want_loss, want), (loss, got) = plain(params, b), fixed(params, b)
            assert torch.equal(loss, want_loss), (policy, i)
            assert all(torch.equal(g, w) for g, w in zip(got.parts, want.parts)), (policy, i)
            addresses.append(_addresses(fixed.arena))
        assert addresses[1] == addresses[2] and addresses[1], (policy, addresses)
        out.append(len(addresses[2]))
    return out


def test_fixed_buffers_variants_match_new_buffers():
    got = dist.run(3, variants_ranks, timeout=300)
    assert got[0] == got[1] == got[2], got


def views_ranks(rank, world):
    """How often a steady step makes the layers' parameter views (``fz3.step.views``, one C++
    call each): never for one-layer units, whose gathers write into the same tensor objects
    every step (a fixed buffer, or one whose storage ``free`` released:
    ``fz3.step.movement.free_op``; one rank computes on its shard's rows), once per gather for
    units of two layers (their rows are new each wait; a frozen row is one more)."""
    from fz3.step import views

    cfg = GPTConfig(vocab=37, seq=8, dim=16, heads=2, layers=6)
    b = batches(cfg, world)[rank]
    made = [0]
    call = views.Views.__call__

    def counting(self, row):
        made[0] += 1
        return call(self, row)

    views.Views.__call__ = counting  # the test's own spy, undone below
    out = {}
    try:
        for frozen in (False, True):
            module = gpt(cfg)
            model, params = shard_gpt(_freeze(module) if frozen else module)
            for activations, k in (("save", 1), ("recompute", 1), ("save", 2)):
                for fixed in (False, True):
                    f = fz3.value_and_grad(model, fz3.Policy(activations=activations,
                                                             layers_per_unit=k),
                                           check_sync=False, fixed_buffers=fixed)
                    f(params, b)
                    f(params, b)
                    made[0] = 0
                    f(params, b)
                    out[frozen, activations, k, fixed] = made[0]
    finally:
        del views.Views.__call__
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_fixed_rows_make_their_views_once(world):
    """At one rank a one-layer unit computes on its row of the parameter shard, the same
    tensor every call on the same parameters (``fz3.step.shapes.ShardRows``; a training
    loop's too: ``test_a_training_loop_keeps_the_parameter_rows``); at two, it gathers into
    the same tensor every step, so with or without fixed buffers a steady step makes none of
    its views. Units of two layers make theirs once per gather (their rows are arranged anew
    at each wait, at any world size)."""
    got = dist.run(world, views_ranks)[0]
    gathered = 2 * 6 - 2  # two-layer units' gathers a step: forward's and backward's
    want = {}
    for frozen in (False, True):
        for activations, k in (("save", 1), ("recompute", 1), ("save", 2)):
            rows = gathered * (2 if frozen else 1)
            want[frozen, activations, k, False] = 0 if k == 1 else rows
            want[frozen, activations, k, True] = 0 if k == 1 else rows
    assert got == want, got


def kept_rows_ranks(rank, world):
    """A step function keeps its parameter shards' rows (``fz3.step.shapes.ShardRows``) while
    the shards live: a write into the parameters in place (the optimizer's) is seen by the
    next step, bit for bit what a new step function gives; new parameters are split again,
    and the old ones' memory is freed (the rows are of a detached alias)."""
    import gc

    import optree
    from torch.multiprocessing.reductions import StorageWeakRef

    cfg = GPTConfig(vocab=37, seq=8, dim=16, heads=2, layers=3)
    b = batches(cfg, world)[rank]
    model, params = shard_gpt(gpt(cfg))
    f = fz3.value_and_grad(model, fz3.Policy(activations="save"), check_sync=False)
    f(params, b)
    with torch.no_grad():
        for shard in params.parts:
            shard.mul_(0.5)
    for got, want in zip(optree.tree_leaves(f(params, b)), optree.tree_leaves(
            fz3.value_and_grad(model, fz3.Policy(activations="save"))(params, b))):
        assert torch.equal(got, want)
    def fresh(params):  # what a new step function gives
        return optree.tree_leaves(fz3.value_and_grad(model, fz3.Policy(activations="save"))(
            params, b))

    # new parameters while the old ones live: split again
    kept = params
    params = optree.tree_map(lambda t: t.clone() * 2, params)
    for got, want in zip(optree.tree_leaves(f(params, b)), fresh(params)):
        assert torch.equal(got, want)
    # the parameters whose rows the step function keeps, gone: their memory is freed at
    # once, not at the next step
    stack = next(i for i, p in enumerate(model.parts) if p.rows > 1)
    old = StorageWeakRef(params.parts[stack].untyped_storage())
    params = optree.tree_map(lambda t: t.clone() * 3, params)
    del kept
    gc.collect()
    assert old.expired(), "the step function's rows kept the parameters' memory"
    for got, want in zip(optree.tree_leaves(f(params, b)), fresh(params)):
        assert torch.equal(got, want)
    return "ok"


def test_a_step_keeps_the_parameter_rows_while_they_live():
    assert dist.run(1, kept_rows_ranks) == ["ok"]


def loop_rows_ranks(rank, world):
    """A training loop at one rank: ``fz3.optim.step(..., donate=True)`` returns new tensor
    objects on the same memory every step, and the step function recognises them
    (``fz3.step.shapes.ShardRows``): a steady step makes none of the layers' parameter views,
    and each step is bit for bit what a new step function gives on the same parameters."""
    from fz3.step import views

    cfg = GPTConfig(vocab=37, seq=8, dim=16, heads=2, layers=4)
    b = batches(cfg, world)[rank]
    model, params = shard_gpt(gpt(cfg))
    opt = fz3.optim.adamw(lr=1e-2)
    state = opt.init(params)
    made, call = [0], views.Views.__call__

    def counting(self, row):
        made[0] += 1
        return call(self, row)

    out = []
    for activations in ("save", "recompute"):
        f = fz3.value_and_grad(model, fz3.Policy(activations=activations), check_sync=False)
        for step in range(3):
            want = fz3.value_and_grad(model, fz3.Policy(activations=activations),
                                      check_sync=False)(params, b)
            views.Views.__call__ = counting  # the test's own spy, undone below
            try:
                made[0] = 0
                loss, grads = f(params, b)
            finally:
                del views.Views.__call__
            assert torch.equal(loss, want[0]), (activations, step)
            assert all(torch.equal(g, w) for g, w in zip(grads.parts, want[1].parts)), step
            params, state = fz3.optim.step(opt, grads, state, params, donate=True)
        out.append(made[0])  # the third step's
    return out


def test_a_training_loop_keeps_the_parameter_rows():
    assert dist.run(1, loop_rows_ranks) == [[0, 0]]


def test_shard_rows_own_nothing_and_follow_the_memory():
    """``ShardRows`` unit by unit: a new alias of the same memory gets the same rows; other
    memory (a copy, or the same tensor object pointed at other memory with ``set_``) is split
    again and read where it now is; the rows keep no memory alive, except ``owning=True``'s
    (``step_through``'s, whose frames may outlive the parameters)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from fz3.observe.live_bytes import LiveBytes
    from fz3.step.shapes import ShardRows

    shard = torch.arange(12.0).view(3, 4)
    rows = ShardRows()
    first = rows.get(0, shard)
    assert [r.tolist() for r in first] == shard.tolist()
    alias = shard.detach()  # what fz3.optim.step(..., donate=True) returns
    assert rows.get(0, alias) is first
    alias.set_(shard.clone().mul_(2))  # the same object on other memory (the old one alive)
    assert [r.tolist() for r in rows.get(0, alias)] == (2 * shard).tolist()
    copy = shard.clone()
    assert [r.tolist() for r in rows.get(0, copy)] == shard.tolist()
    memory = StorageWeakRef(copy.untyped_storage())  # the memory whose rows it holds now
    del copy
    assert memory.expired(), "ShardRows kept the shard's memory alive"
    ones = torch.ones(2, 3)
    for writes in (False, True):
        with LiveBytes(writes=writes) as live:  # the alias owns nothing: no memory counted
            ShardRows().get(0, ones)
        assert live.peak == 0, (writes, live.peak)
    owned, owning = torch.ones(2, 3), ShardRows(owning=True)
    memory = StorageWeakRef(owned.untyped_storage())
    owning.get(0, owned)
    del owned
    assert not memory.expired()


def aux_view_ranks(rank, world):
    """A loss's aux that is a view of a post parameter (gathered at two ranks): it stays
    valid after the step, which keeps only stack units' buffer objects between steps, not
    the post unit's (``fz3.step.movement.free_op``)."""
    cfg = GPTConfig(vocab=37, seq=8, dim=16, heads=2, layers=2)
    module = gpt(cfg)
    want = module.norm.weight.detach().clone()
    model, params = shard_gpt(module)
    b = batches(cfg, world)[rank]

    def loss(m, h, batch):
        return m.loss(h, batch[1]), m.norm.weight

    f = fz3.value_and_grad(model, fz3.Policy(activations="save"), loss=loss, has_aux=True)
    auxes = [f(params, b)[0][1] for _ in range(2)]
    assert all(torch.equal(aux, want) for aux in auxes), auxes
    return "ok"


def test_an_aux_viewing_a_parameter_outlives_the_step():
    assert dist.run(2, aux_view_ranks) == ["ok"] * 2


def _held(schedule, plan) -> list[tuple[object, int, int, str]]:
    """Each fixed buffer ``plan`` hands out, with the ops it must live over, from what the ops
    mean (not from the arena's own books): a gather's outputs until the unit's next free (a
    k-layer unit's through its wait, whose copies then live until the free), a backward's
    gradient and a reduce's output until the unit's next wait_reduce."""
    ops, out = schedule.ops, []

    def next_op(i, u, kinds):
        return next(j for j in range(i + 1, len(ops)) if ops[j].unit == u and ops[j].kind in kinds)

    for i, fixed in plan.items():
        op, k = ops[i], len(schedule.units[ops[i].unit].layers)
        if op.kind in ("gather", "wait"):
            # (the wait copies the rank-major gather into the layer-major: both alive in it)
            end = next_op(i, op.unit, ("wait",)) + 1 if op.kind == "gather" and k > 1 else \
                next_op(i, op.unit, ("free",))
            out += [(f, i, end, op.kind.value) for f in fixed[:2] if f is not None]
        elif op.kind in ("backward", "reduce"):
            buffer = fixed.grad if op.kind == "backward" else fixed.reduced
            out.append((buffer, i, next_op(i, op.unit, ("wait_reduce",)), op.kind.value))
        else:
            assert op.kind == "free" and fixed[2:] == (None, None), (op, fixed)
    return out


def plans_ranks(rank, world):
    """``Arena.plan`` over 216 planned schedules: no two buffers alive at once are one, and
    the arena holds of each size and dtype exactly the most alive at once."""
    from fz3.step.arena import Arena

    checked = 0
    for precision in (fz3.Precision(), fz3.Precision(torch.bfloat16, torch.bfloat16),
                      fz3.Precision(reduce_dtype=torch.bfloat16)):
        for frozen in (False, True):
            module = gpt(PADDED)
            model, _ = shard_gpt(_freeze(module) if frozen else module, precision=precision)
            for activations in ("save", "recompute"):
                for prefetch, k in ((0, 1), (1, 1), (2, 1), (3, 1), (1, 2), (2, 2)):
                    for reshard, reduce in ((True, "reduce_scatter"), (False, "reduce_scatter"),
                                            (True, "all_reduce")):
                        sched = fz3.plan(model, fz3.Policy(
                            activations=activations, prefetch=prefetch, layers_per_unit=k,
                            reshard_after_forward=reshard, reduce=reduce))
                        arena = Arena(model)
                        held = _held(sched, arena.plan(sched))
                        case = (precision, frozen, activations, prefetch, k, reshard, reduce)
                        for a, (f, i, end, what) in enumerate(held):
                            for g, j, end2, what2 in held[a + 1:]:
                                # alive at once: each starts before the other ends
                                assert f is not g or end <= j or end2 <= i, \
                                    (case, what, i, end, what2, j, end2)
                        for made in arena.kinds.values():
                            peak = max(sum(1 for f, i, end, _ in held if f in made and
                                           i <= t < end) for t in range(len(sched.ops)))
                            assert len(made) == peak, (case, len(made), peak)
                        checked += 1
    return checked


def test_fixed_buffer_plans_never_share_a_live_buffer():
    assert dist.run(2, plans_ranks)[0] == 216


def test_accumulate_with_fixed_buffers():
    assert dist.run(2, accumulate_ranks, timeout=240) == ["ok"] * 2


def test_gathers_and_reduces_reuse_fixed_buffers():
    got = dist.run(2, arena_ranks, timeout=300)
    for case, moved, compute, slots, nbytes in got[0]:
        print(f"{case}: {slots} slots, {nbytes} bytes; steady step: {len(moved)} allocations "
              f"moving memory, {compute} in compute ops")
        assert {f for _, _, f in moved} == {"aten.empty.memory_format"}, (case, moved)
