"""Each unit's memory (``fz3.step.memory``, issue 52 item 1): made once when the schedule is
lowered, the same tensor objects every step, their storage released between steps.

- At world size 2 (gloo), over policies, units of one and two layers, frozen parameters,
  ``trace=False`` and a bf16 reduce: every step's result equals the first, bit for bit; each
  unit's ``Pieces`` are the same objects in every step, and hold no storage between steps; in
  a steady step (a dispatch mode sees every ATen op's output, a recorder files it under its op)
  the ops that move memory allocate nothing but the result's gradient shards (and a bf16
  reduce's output), and a traced backward no gradient of a unit's size.
- The layers' parameter views are made once (counted): a steady step makes none.
- What outlives ``free`` keeps its values: a loss's aux output that is a parameter's view.
- ``fixed_buffers=`` is refused, naming the fix.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=4)
# (activations, layers_per_unit, trace, frozen, reduce dtype)
CASES = [("save", 1, True, False, None), ("recompute", 2, True, True, None),
         ("save", 1, True, True, torch.bfloat16), ("save", 2, False, False, None)]
MOVES = {"gather", "wait", "free", "reduce", "wait_reduce"}


class Allocations(TorchDispatchMode):
    """Each ATen op's outputs on storage none of its inputs has, as (numel, op)."""

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


def _freeze(module):
    for n, p in module.named_parameters():
        if ".attn.qkv." in n or ".ln1." in n:
            p.requires_grad_(False)
    return module


def _objects(step) -> list[int]:
    """Ids of every tensor of each unit's memory."""
    return [id(t) for m in step.program.memory for t in _tensors(tuple(m.pieces))]


def memory_ranks(rank, world):
    out = []
    for activations, k, trace, frozen, reduce in CASES:
        module = _freeze(gpt(CFG)) if frozen else gpt(CFG)
        model, params = shard_gpt(module, precision=fz3.Precision(reduce_dtype=reduce))
        mode = Allocations()
        recorder = ByOp(mode)
        step = fz3.value_and_grad(model, fz3.Policy(activations=activations, layers_per_unit=k),
                                  trace=trace, check_sync=False, recorder=recorder)
        case = (activations, k, trace, frozen, reduce)
        b = batches(CFG, world)[rank]
        results, objects = [], []
        for i in range(3):
            with mode if i == 2 else contextlib.nullcontext():  # (the third: steady)
                results.append(step(params, b))
            objects.append(_objects(step))
            assert all(t.untyped_storage().nbytes() == 0 for m in step.program.memory
                       for t in _tensors(tuple(m.pieces))), case
        assert objects[0] == objects[1] == objects[2], case
        for loss, grads in results[1:]:
            assert torch.equal(loss, results[0][0]), case
            assert all(torch.equal(g, w) for g, w in zip(grads.parts, results[0][1].parts)), case
        shards = {p.rows * p.layout.shard_numel for p in model.parts}  # the result's
        ops = step.schedule.ops
        moved = [(ops[i].kind.value, n, f) for i, made in recorder.by_op.items() for n, f in made
                 if ops[i].kind.value in MOVES and n not in shards]
        # (a bf16 reduce's output is new each step)
        assert all(kind == "reduce" and reduce is not None and f == "aten.empty.memory_format"
                   for kind, n, f in moved), (case, moved)
        unit = world * k * model.parts[model.part_index("blocks")].layout.shard_numel
        grads = [f for i, made in recorder.by_op.items() for n, f in made
                 if ops[i].kind.value == "backward" and n == unit]
        assert not trace or grads == [], (case, grads)
        out.append(case)
    return len(out)


def test_each_unit_keeps_its_memory_objects():
    assert dist.run(2, memory_ranks, timeout=300) == [len(CASES)] * 2


def views_ranks(rank, world):
    """How often a steady step makes the layers' parameter views (``fz3.step.views``)."""
    from fz3.step import views

    cfg = GPTConfig(vocab=37, seq=8, dim=16, heads=2, layers=4)
    b = batches(cfg, world)[rank]
    made, make = [0], views.RowViews.make

    def counting(self, row):
        made[0] += 1
        return make(self, row)

    views.RowViews.make = counting  # the test's own spy, undone below
    out = {}
    try:
        for frozen in (False, True):
            module = gpt(cfg)
            model, params = shard_gpt(_freeze(module) if frozen else module)
            for activations, k in (("save", 1), ("recompute", 2)):
                f = fz3.value_and_grad(model, fz3.Policy(activations=activations,
                                                         layers_per_unit=k), check_sync=False)
                f(params, b)
                made[0] = 0
                f(params, b)
                out[frozen, activations, k] = made[0]
    finally:
        views.RowViews.make = make
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_parameter_views_are_made_once(world):
    got = dist.run(world, views_ranks)[0]
    assert set(got.values()) == {0}, got


def aux_view_ranks(rank, world):
    """A loss's aux that is a view of a post parameter: it keeps its values after the step,
    which releases the post unit's memory (copied first, ``unit_io.apart``)."""
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


def test_fixed_buffers_is_refused():
    for entry in (fz3.value_and_grad, fz3.accumulate):
        with pytest.raises(TypeError, match=r"fixed_buffers=True\): buffers are fixed by "
                                            r"design now .* drop the argument"):
            entry(None, fixed_buffers=True)  # (refused before the model is read)
