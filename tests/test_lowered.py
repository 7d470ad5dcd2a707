"""The schedule lowered once (issue 26, item 1): ``fz3.step.executor.lower`` makes one step per
op when the step function is made, and a steady step runs those steps without reading the
schedule again. What is measured is the per-layer Python work of the executor: calls into
fz3's own functions per layer in a steady step (``sys.setprofile``), the difference between a
16- and an 8-layer model over 8. Counts, not times: they are the same on every machine.

The bounds are this code's counts. Before the lowering (the interpreter of ``f30f498``) the
same counts were 67 (``save``) and 71 (``recompute``) calls per layer at world size 1, 70 and
74 at world size 2. The lowered step made 37/40 and 40/43 (a first version made 29: it
inlined the project's helpers, ``or_zeros``, ``frame_of``'s check, the carry and the debug
delay, into the steps; they came back for one copy of each, at about 0.2 us a call). The
arena (``fz3.step.arena``, off here) adds no call when off. Keeping a row's parameter views
while the row lives (``fz3.step.views.RowViews``: a Python ``__call__`` per program call,
a ``_forget`` per row gone) raised them to 40/44 and 44/48; each reuse saves a C++ call
making a dozen views (38-42 us here): a layer's backward after its forward at one rank, a
recompute's backward, a fixed buffer's every step (``benchmarks/HISTORY.md``, ninth stop).
A row's ``forget`` (``fz3.step.views``, a weak reference's callback) runs when gloo lets go
of its last collective's tensors, sometimes in the next step, so it is not counted with the
rest: its count varied by more than half a call a layer between runs (44.625 seen against
the bound of 44 on ``3c81967``, whose bounds counted it); it is bounded apart, by the rows a
layer gathers in two steps (one per gather: two a step). Without it, the counts were 39/43 at world
size 1 and 42/46 at world size 2 on ``3c81967``. Then (tenth stop) recompute's backward ran
a layer's forward and backward as one program (``Programs.recompute``; ``Layers.recompute``
called where ``Layers.forward`` was) and one rank kept its parameter rows while the shards
live (``fz3.step.shapes.ShardRows``; this test calls the step on the same parameters, as a
loop with an optimizer does not): 39/42 and 42/45. Then (twelfth stop) a step function kept
a one-layer unit's gathered buffer objects between its gathers, their storage released at
``free`` and regrown by the next gather (``fz3.step.movement.free_op``), so a program's
parameter views of them are kept at two ranks too: 48/51 at world size 2 (a regrow and a
release a gather: 6 calls a layer, ~1 us) where each gather had made its views again (a
dozen views, ~25 us here, ``benchmarks/HISTORY.md``), and no ``forget`` any more (2 a layer,
counted apart). Then (issue 52) each unit's memory (``fz3.step.memory``) made one rank gather
a copy too and every gather, wait and free call it: 43/46 at world size 1, 46/49 at 2. A
change that makes the per-layer
path do more fails here: measure it with
``benchmarks/host_overhead.py`` (interleaved A/B pairs) and raise the bound in the same
change if it is worth it."""

from __future__ import annotations

import collections
import os
import sys

import dist
import fz3
import fz3.step.value_and_grad as vg
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, gpt

# per layer, steady step: (world size, policy) -> the most fz3 calls allowed
BOUNDS = {(1, "save"): 43, (1, "recompute"): 46, (2, "save"): 46, (2, "recompute"): 49}
FORGET = "step/views.py:forget"  # counted apart (see above)
# fz3's own folder: a frame counts when its file lies under it. A substring such as '/fz3/' also
# matched torch's files in a clone named fz3 with its .venv inside (44 calls against 42).
PACKAGE = os.path.dirname(os.path.abspath(fz3.__file__)) + os.sep


def _policy(name: str) -> fz3.Policy:
    return fz3.Policy() if name == "recompute" else fz3.Policy(activations=name)


def _fz3_calls(step, params, batch) -> collections.Counter:
    """Calls into functions defined in fz3's files during one call of ``step``, by function."""
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(PACKAGE):
            counts[f"{path[len(PACKAGE):]}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        step(params, batch)
    finally:
        sys.setprofile(None)
    return counts


def calls_ranks(rank, world, policy):
    per_layers = {}
    for layers in (8, 16):
        cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=layers)
        model, params = shard_gpt(gpt(cfg))
        b = batches(cfg, world)[rank]
        step = fz3.value_and_grad(model, _policy(policy), check_sync=False)
        step(params, b)  # traces
        step(params, b)
        per_layers[layers] = _fz3_calls(step, params, b)
    more = per_layers[16] - per_layers[8]
    forgets = more.pop(FORGET, 0) / 8
    return sum(more.values()) / 8, {k: v / 8 for k, v in more.most_common(12)}, forgets


def test_a_steady_step_makes_few_python_calls_per_layer():
    for (world, policy), bound in BOUNDS.items():
        per_layer, top, forgets = dist.run(world, calls_ranks, policy, timeout=300)[0]
        assert per_layer <= bound, (
            f"world size {world}, {policy}: {per_layer} calls into fz3 per layer in a steady step, "
            f"the bound is {bound} (the most frequent: {top}); see this file's docstring")
        # one rank gathers no row; two gather into the same row objects every step: none dies
        assert forgets == 0, (world, policy, forgets)


def lowered_ranks(rank, world):
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=3)
    model, params = shard_gpt(gpt(cfg))
    b = batches(cfg, world)[rank]
    made = []
    lower = vg.lower

    def counting(model, schedule):
        made.append(schedule)
        return lower(model, schedule)

    vg.lower = counting  # the test's own spy, undone below
    try:
        step = fz3.value_and_grad(model, fz3.Policy(activations="save"))
        losses = [float(step(params, b)[0]) for _ in range(3)]
    finally:
        vg.lower = lower
    program = step.program
    assert made == [step.schedule], made  # once, when the step function was made
    assert program.schedule is step.schedule
    assert len(program.steps) == len(step.schedule.ops)
    assert losses[0] == losses[1] == losses[2]
    return "ok"


def test_value_and_grad_lowers_its_schedule_once():
    assert dist.run(2, lowered_ranks, timeout=240) == ["ok"] * 2
