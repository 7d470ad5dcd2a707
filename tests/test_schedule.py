"""Schedules as data: planning, printing, validation (no processes), and running policies and
hand-made orders against the plain model with the executor's recorded events (gloo)."""

from __future__ import annotations

import dataclasses

import pytest

import dist
import fz3
from fz3 import Op
from fz3.schedule.structure import layers_only
from fz3.models.gpt import GPTConfig
from fz3.models import shard_gpt
from reference import assert_close, batches, gpt, reference_grads, sharded_grads

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=4)


def test_plan_validates_for_every_policy():
    for prefetch in (0, 1, 2, 5):
        for act in ("recompute", "save", "save_unsharded"):
            for k in (1, 2, 3, 4):
                for reshard in (True, False):
                    p = fz3.Policy(prefetch=prefetch, activations=act, layers_per_unit=k, reshard_after_forward=reshard)
                    s = fz3.plan(4, p)
                    assert len(s.units) == 2 + -(-4 // k)  # pre, the layer units, post
                    if reshard and act != "save_unsharded":
                        assert s.max_live_units <= prefetch + 1, (p, s.max_live_units)
                    fz3.plan(4, p, grad=False)


def test_print_is_a_table():
    text = str(fz3.plan(3, fz3.Policy()))
    lines = text.splitlines()
    assert lines[0].startswith("Schedule: ") and "over 5 units" in lines[0]
    assert lines[1].split() == ["#", "op", "unit", "gathered"]
    assert any("forward" in line and "layers.2" in line for line in lines)
    assert len(lines) == 2 + len(fz3.plan(3, fz3.Policy()).ops)


def test_default_order_fetch_current_prefetch_next_then_block():
    ops = fz3.plan(3, fz3.Policy()).ops  # units: pre 0, layers.0-2 as 1-3, post 4
    for i in range(1, 3):  # gather(i+1) is issued before forward(i), and after wait(i)'s gather
        assert ops.index(Op("gather", i + 1)) < ops.index(Op("forward", i))
    # the reduce of layer 2 is waited only after layer 1's backward was issued
    assert ops.index(Op("wait_reduce", 3)) > ops.index(Op("backward", 2))


def _errors(ops, **kw):
    units = fz3.plan(kw.pop("layers", 1)).units
    with pytest.raises(fz3.ScheduleError) as e:
        fz3.validate(fz3.Schedule(tuple(ops), units, **kw))
    return e.value


def _good(layers=1):
    return list(fz3.plan(layers, fz3.Policy(prefetch=0)).ops)


def test_validator_names_the_op_and_reason():
    ops = _good()  # units: pre 0, layers.0 1, post 2
    i = ops.index(Op("wait", 1))
    bad = ops[:i] + ops[i + 1:]  # forward of layers.0 before its gather was waited
    e = _errors(bad)
    assert e.op == "forward layers.0" and "not waited" in e.reason and f"op {e.index}" in str(e)

    i = ops.index(Op("forward", 1))
    e = _errors(ops[:i] + [Op("free", 1)] + ops[i:])  # freed, then used
    assert e.op == "forward layers.0" and "not gathered" in e.reason

    e = _errors([o for o in ops if o != Op("reduce", 1) and o != Op("wait_reduce", 1)])
    assert e.index == len(ops) - 2 and "never reduced" in e.reason and "layers.0" in e.reason

    e = _errors([o for o in ops if o != Op("wait_reduce", 0)])
    assert "never waited" in e.reason

    last_free = len(ops) - 1 - ops[::-1].index(Op("free", 0))  # pre is freed after forward and backward
    e = _errors(ops[:last_free] + ops[last_free + 1:])
    assert "never freed" in e.reason

    e = _errors([Op("gather", 0), Op("gather", 0)])
    assert e.index == 1 and "already being gathered" in e.reason

    e = _errors([Op("wait", 1)])
    assert "no gather" in e.reason

    e = _errors([Op("gather", 7)])
    assert "does not exist" in e.reason

    e = _errors([Op("gather", 0), Op("wait", 0), Op("reduce", 0)])
    assert "does not exist yet" in e.reason

    e = _errors([Op("jump", 0)])
    assert "unknown op kind" in e.reason

    e = _errors(_good(2)[:3] + [Op("gather", 2), Op("wait", 2), Op("forward", 2)], layers=2)
    assert "out of order" in e.reason and "forward layers.0" in e.reason

    e = _errors([Op("gather", 0), Op("wait", 0), Op("forward_save", 0)], grad=False)
    assert "forward-only" in e.reason

    e = _errors(ops[:ops.index(Op("loss", 2))] + [Op("loss", 1)])
    assert "loss runs on the post unit (post, unit 2), not layers.0" in e.reason


class OneLayer:
    """Only what check_schedule reads of a model: its parts."""

    structure = parts = layers_only(1)


def test_value_and_grad_validates_before_running():
    bad = fz3.Schedule((Op("gather", 0),), fz3.plan(1).units)
    with pytest.raises(fz3.ScheduleError):
        fz3.step.front.check_schedule(OneLayer, bad, grad=True)
    with pytest.raises(ValueError, match=r"the schedule's units \['pre', 'layers.0', 'layers.1', 'post'\] are not "
                                         r"this model's parts \['pre', 'layers', 'post'\]"):
        fz3.step.front.check_schedule(OneLayer, fz3.plan(2), grad=True)
    with pytest.raises(ValueError, match="forward-only"):
        fz3.step.front.check_schedule(OneLayer, fz3.plan(1), grad=False)


def _hand_made(model) -> list[fz3.Schedule]:
    """Orders no policy produces: everything gathered up front and reduced at the very end;
    a mix of recompute and saved layers; layers freed late."""
    units = fz3.plan(model).units  # pre 0, blocks.0..L-1 as 1..L, post L+1
    L = len(units) - 2
    layers, post = list(range(1, L + 1)), L + 1
    up_front = ([Op("gather", u) for u in range(L + 2)] + [Op("wait", 0), Op("forward", 0)]
                + [x for u in layers for x in (Op("wait", u), Op("forward", u))]
                + [Op("wait", post), Op("loss", post)] + [Op("backward", u) for u in reversed(layers)]
                + [Op("backward", 0)] + [Op("free", u) for u in range(L + 2)]
                + [Op("reduce", u) for u in [post, 0, *layers]] + [Op("wait_reduce", u) for u in [*layers, 0, post]])
    mixed = []
    for op in fz3.plan(model, fz3.Policy(prefetch=2)).ops:
        mixed.append(Op("forward_save", op.unit) if op.kind == "forward" and op.unit % 2 == 1 else op)
    return [fz3.validate(fz3.Schedule(tuple(up_front), units)), fz3.validate(fz3.Schedule(tuple(mixed), units))]


def schedule_ranks(rank, world):
    module = gpt(CFG)
    model, params = shard_gpt(module)
    bs = batches(CFG, world)
    ref_loss, ref = reference_grads(module, bs)
    for sched in _hand_made(model):
        loss, grads = fz3.value_and_grad(model, sched)(params, bs[rank])
        assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
        got = sharded_grads(model, grads)
        if rank == 0:
            assert_close(got, ref, what="hand-made schedule")

    # The recorded events follow the schedule: one event per op, gather(i+1) issued before
    # forward(i) begins, and never more layer units alive than the schedule says.
    for policy in (fz3.Policy(), fz3.Policy(prefetch=2), fz3.Policy(prefetch=0, activations="save")):
        rec = fz3.Recorder()
        step = fz3.value_and_grad(model, policy, recorder=rec)
        step(params, bs[rank])
        events = rec.step_events()
        assert [e.op for e in events] == list(step.schedule.ops)
        assert all(a.t_end_ns <= b.t_begin_ns for a, b in zip(events, events[1:]))
        begin: dict = {}
        for e in events:  # first occurrence: the forward's gather, not the backward's re-gather
            begin.setdefault(e.op, e.t_begin_ns)
        if policy.prefetch:  # units: pre 0, blocks.i as i+1, post
            for i in range(1, CFG.layers):
                assert begin[Op("gather", i + 1)] < begin[Op("forward", i)]
        assert max(e.live_units for e in events) <= policy.prefetch + 1
        assert max(e.live_units for e in events) == step.schedule.max_live_units
    return "ok"


@pytest.mark.parametrize("world", [2])
def test_hand_made_schedules_and_recorded_order(world):
    assert dist.run(world, schedule_ranks) == ["ok"] * world


def test_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="prefetch=-1"):
        fz3.Policy(prefetch=-1)
    with pytest.raises(ValueError, match="activations='keep'"):
        fz3.Policy(activations="keep")
    with pytest.raises(ValueError, match="layers_per_unit=0"):
        fz3.Policy(layers_per_unit=0)
    with pytest.raises(ValueError, match="reduce='all_gather'"):
        fz3.Policy(reduce="all_gather")
    with pytest.raises(TypeError, match="resident='pre'"):
        fz3.Policy(resident="pre")
    assert dataclasses.replace(fz3.Policy(), prefetch=3).prefetch == 3
