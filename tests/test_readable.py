"""What a person reads (issue 29): the parts table, a frame's header, traces and summaries
that leave out the steps that traced layers. Each test reads the text as a person would.
(The examples' steady rate is in ``test_examples``; the check_sync and fz3.shard messages
in ``test_misuse`` and ``test_reliability``; CompileError's one line in ``test_compiled``.)"""

from __future__ import annotations

import json
import os
import re

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig, synthetic_batch
from reference import batches, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=16, heads=2, layers=3, tie=True)


def readable_ranks(rank, world, folder):
    model, params = shard_gpt(gpt(CFG))
    # the parts table: a header and one line per part, the tie and its readers named
    table = str(model.parts).splitlines()
    assert len(table) == 1 + len(model.parts), table
    assert table[0].split() == ["part", "role", "rows", "params/row", "trained", "frozen",
                                "shared"], table[0]
    tied = next(line for line in table if line.startswith("tied:"))
    assert tied.split()[:3] == ["tied:tok.weight", "shared", "1"], tied
    assert tied.endswith("read by pre, post"), tied
    blocks = next(line for line in table if line.startswith("blocks "))
    per_row = model.parts[model.part_index("blocks")].layout.numel
    assert f" {per_row:,} " in blocks and " 3 " in blocks, blocks
    assert repr(model.parts).startswith("(Part(name='pre'")  # the tuple's, for debugging
    # a frame's header: phase, unit name, op index (the kind where it differs)
    batch = batches(CFG, world)[rank]
    for policy, kind in ((fz3.Policy(), ""), (fz3.Policy(activations="save"), ", save")):
        frames = list(fz3.step_through(model, params, batch, policy))
        f = next(f for f in frames if f.phase == "forward" and f.name == "blocks.2")
        assert repr(f).splitlines()[0] == f"StepFrame(forward blocks.2 (op {f.index}{kind}))"
        b = next(f for f in frames if f.phase == "backward" and f.name == "blocks.2")
        assert repr(b).splitlines()[0] == f"StepFrame(backward blocks.2 (op {b.index}))"
    # traces: the step that traced (the first, and a new shape's) is marked in the Chrome
    # trace and left out of the summary, whose means are those of the other steps
    fresh, fparams = shard_gpt(gpt(CFG))
    path = os.path.join(folder, "t-{rank}.json")
    short = synthetic_batch(CFG, 2, seed=rank)
    short = tuple(t[:, :5] for t in short)
    with fz3.trace(path, png=os.path.join(folder, "t-{rank}.png")) as rec:
        step = fz3.value_and_grad(fresh, recorder=rec)
        for b in (batch, batch, batch, short, short):
            step(fparams, b)
    assert rec.tracing == {0, 3}, rec.tracing
    with open(path.format(rank=rank)) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "op"]
    assert {e["args"]["step"] for e in events if e["args"]["traced"]} == {0, 3}
    text = open(path.format(rank=rank) + ".txt").read().splitlines()
    assert text[0] == "per step, mean over 3 step(s); 2 step(s) that traced or compiled " \
                      "layers left out", text[0]
    compute = sum((e.t_end_ns - e.t_begin_ns) / 1e6 for e in rec.events
                  if e.step in (1, 2, 4) and e.op.kind in ("forward", "loss", "backward")
                  and e.op.unit == step.schedule.units.index(
                      next(u for u in step.schedule.units if u.name == "blocks.0")))
    row = next(line for line in text if line.startswith("blocks.0 "))
    assert abs(float(row.split()[1]) - compute / 3) < 2e-3, (row, compute / 3)
    return "ok"


def test_what_a_person_reads(tmp_path):
    assert dist.run(1, readable_ranks, str(tmp_path)) == ["ok"]


def messages_ranks(rank, world):
    """What changes what runs is a WARNING on the fz3 logger, printed by Python with no logging
    configured (its last-resort handler on stderr); said once (rank 0) where every rank would
    say it alike, with ``[rank r]`` where it follows from one rank's batch."""
    import contextlib
    import io
    import logging

    import torch

    from reference import LayerNet, fz3_said, layer_post, layer_pre
    from test_traced import ReadsHost

    root, logger = logging.getLogger(), logging.getLogger("fz3")
    assert not root.handlers and not logger.handlers and logger.level == logging.NOTSET
    torch.manual_seed(0)
    model, params = fz3.shard(LayerNet([ReadsHost() for _ in range(2)]), "layers", layer_pre, layer_post)
    b = (torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5)))
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):  # no configuration: Python's last resort prints it
        fz3.value_and_grad(model)(params, b)
    untraced = [line for line in printed.getvalue().splitlines() if "fz3:" in line]
    if rank == 0:
        assert len(untraced) == 1 and re.fullmatch(r"fz3: layer layers\.0 cannot be traced: .*; its "
                                                   r"layers run through autograd", untraced[0]), untraced
    else:
        assert untraced == [], untraced  # every rank's layers are alike: rank 0 says it
    # a new shape on rank 1 only (check_sync=False lets ranks' shapes differ): rank 1 says so
    gmodel, gparams = shard_gpt(gpt(CFG))
    step = fz3.value_and_grad(gmodel, check_sync=False)
    long = batches(CFG, world)[rank]
    step(gparams, long)
    with fz3_said(logging.WARNING) as said:
        step(gparams, tuple(t[:, :5] for t in long) if rank == 1 else long)
    if rank == 1:
        assert len(said) == 1 and said[0].startswith("[rank 1] fz3: blocks: layers traced again "
                                                      "for inputs of another shape"), said
    else:
        assert said == [], said
    assert not root.handlers and not logger.handlers  # fz3 added none, called no basicConfig
    return "ok"


def test_messages_that_change_what_runs_are_warnings_said_once_or_by_rank():
    assert dist.run(2, messages_ranks) == ["ok"] * 2
