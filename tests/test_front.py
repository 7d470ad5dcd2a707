"""The front door (``fz3/step/front.py``): every entry point prepares a step the same way, and
what the redesign added to it: loss functions with auxiliaries (JAX's ``has_aux``) and
train/eval per model copy. References: plain PyTorch autograd on the unsharded GPT over the
concatenated batch (fp32, rtol 1e-5 / atol 1e-6); auxiliaries against the plain model on the
rank's own batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import dist
import fz3
from fz3 import Op
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import assert_close, batches, concat, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)


# Schedules that used to crash instead of saying what is wrong (no processes needed).


def test_a_unit_of_no_layers_is_named_not_a_zero_division():
    # Before the unit list, Schedule(..., layers_per_unit=0) raised ZeroDivisionError; units
    # are data now, and a unit holding no rows is named as a bad field.
    plan = fz3.plan(2)
    empty = tuple(u._replace(layers=range(0)) for u in plan.units)
    with pytest.raises(fz3.ScheduleError, match=r"at its fields: unit 'pre' has no layers"):
        fz3.validate(fz3.Schedule(plan.ops, empty))
    assert "unit 'pre' has no layers" in str(fz3.Schedule(plan.ops, empty))  # printing does not raise
    with pytest.raises(ValueError, match=r"layers_per_unit=0 must be >= 1"):
        fz3.Policy(layers_per_unit=0)


def test_bad_reduce_field_is_named_as_a_field():
    with pytest.raises(fz3.ScheduleError) as e:
        fz3.validate(fz3.Schedule(fz3.plan(1).ops, fz3.plan(1).units, reduce="ring"))
    assert "at its fields: reduce='ring'" in str(e.value) and "end of schedule" not in str(e.value)
    assert e.value.index is None and e.value.op is None


def test_printing_an_invalid_schedule_shows_it_and_marks_the_bad_op():
    plan = fz3.plan(2, fz3.Policy(prefetch=0))
    ops = list(plan.ops)
    i = ops.index(Op("wait", 1))
    bad = fz3.Schedule(tuple(ops[:i] + ops[i + 1:]), plan.units)
    text = str(bad)
    lines = text.splitlines()
    assert len(lines) == 2 + len(bad.ops)
    marked = [line for line in lines if "<-" in line]
    assert len(marked) == 1 and "forward" in marked[0] and "its gather was not waited" in marked[0]
    # after the bad op the state is unknown: shown as "?"
    assert lines[-1].rstrip().endswith("?")
    one = fz3.plan(1)
    end_bad = fz3.Schedule(tuple(o for o in one.ops if o != Op("free", 2)), one.units)
    assert "invalid: invalid schedule at end of schedule: units never freed: post" in str(end_bad)


def test_op_kinds_are_an_enum_with_categories():
    assert Op("gather", 0) == Op(fz3.OpKind.GATHER, 0) and hash(Op("gather", 0)) == hash(Op(fz3.OpKind.GATHER, 0))
    assert fz3.Schedule((Op("gather", 0),), fz3.plan(1).units).ops[0].kind is fz3.OpKind.GATHER
    assert {k.category for k in fz3.OpKind} == set(fz3.Category)
    assert fz3.OpKind.WAIT_REDUCE.category is fz3.Category.WAIT and str(fz3.OpKind.FREE) == "free"


# Every entry point: the same preparation (schedule agreement, params and batch checks).


def entry_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG))
    bs = batches(CFG, world)
    b = bs[rank]
    default = fz3.plan(model)
    with pytest.raises(ValueError, match=r"schedule op \d+ is accumulate: a schedule from fz3.deferred is run "
                                         r"only inside fz3.accumulate"):
        fz3.value_and_grad(model, fz3.deferred(default))
    mine = fz3.Policy(prefetch=1 + rank)  # ranks disagree
    entries = {
        "value_and_grad": lambda s=None, p=params, bb=b: fz3.value_and_grad(model, s)(p, bb),
        "apply": lambda s=None, p=params, bb=b: fz3.apply(model, p, bb, schedule=s),
        "accumulate": lambda s=None, p=params, bb=b: fz3.accumulate(model, s)(p, [bb, bb]),
        "step_through": lambda s=None, p=params, bb=b: list(fz3.step_through(model, p, bb, s)),
    }
    for entry, run in entries.items():
        with pytest.raises(ValueError, match=rf"ranks \[1\] planned a different schedule than rank 0 for {entry}"):
            run(mine)
        refusal = "apply needs a forward-only schedule" if entry == "apply" else r"schedule op \d+ is accumulate"
        with pytest.raises(ValueError, match=refusal):
            run(fz3.deferred(default))
        wrong = fz3.Params((params.parts[0], params.parts[1][:1], params.parts[2]))
        with pytest.raises(ValueError, match=r"params of part blocks is \[1, \d+\] torch.float32 on cpu"):
            run(None, wrong)
        with pytest.raises(TypeError, match=r"batch\[0\] is on meta, the model on cpu"):
            run(None, params, (b[0].to("meta"), b[1]))
        run()  # and the group still works: nothing was left half-issued
    return "ok"


def test_every_entry_point_checks_the_same_things():
    assert dist.run(2, entry_ranks, timeout=120) == ["ok"] * 2


# Loss functions with auxiliaries.


def _loss_with_aux(m, h, batch):
    logits = m.head(m.norm(h))
    per_token = F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), reduction="none")
    accuracy = (logits.argmax(-1) == batch[1]).float().mean()
    return per_token.mean() + 0.01 * h.square().mean(), {"accuracy": accuracy, "per_token": per_token}


def _plain(module, x, y):
    h = module.embed(x)
    for block in module.blocks:
        h = block(h)
    return _loss_with_aux(module, h, (x, y))


def aux_ranks(rank, world):
    module = gpt(CFG)
    model, params = shard_gpt(module)
    bs = batches(CFG, world)
    ref = gpt(CFG)
    ref_loss, _ = _plain(ref, *concat(bs))
    ref_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    with torch.no_grad():
        _, mine = _plain(module, *bs[rank])
    for policy in (fz3.Policy(), fz3.Policy(activations="save", layers_per_unit=2)):
        (loss, aux), grads = fz3.value_and_grad(model, policy, loss=_loss_with_aux, has_aux=True)(params, bs[rank])
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        assert set(aux) == {"accuracy", "per_token"} and not aux["per_token"].requires_grad
        torch.testing.assert_close(aux["accuracy"], mine["accuracy"], rtol=0, atol=0)  # this rank's own
        torch.testing.assert_close(aux["per_token"], mine["per_token"], rtol=1e-5, atol=1e-6)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, want, what=f"loss with aux {policy}")
    loss, aux = fz3.apply(model, params, bs[rank], loss=_loss_with_aux, has_aux=True)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux["accuracy"], mine["accuracy"], rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"loss function must return a scalar loss tensor, got tuple.*has_aux=True"):
        fz3.value_and_grad(model, loss=_loss_with_aux)(params, bs[rank])
    with pytest.raises(TypeError, match=r"has_aux=True and must return \(loss, aux\), got Tensor"):
        fz3.value_and_grad(model, has_aux=True)(params, bs[rank])
    return "ok"


def test_loss_function_with_aux():
    assert dist.run(2, aux_ranks, timeout=120) == ["ok"] * 2


# Train and eval per model copy.


def mode_ranks(rank, world):
    cfg = dataclasses.replace(CFG, dropout=0.3)
    module = gpt(cfg).train()
    model, params = shard_gpt(module)
    evaluation = model.eval()
    assert model.training and not evaluation.training and evaluation.skeleton is model.skeleton
    train_step, eval_step = fz3.value_and_grad(model), fz3.value_and_grad(evaluation)
    b = batches(cfg, 1)[0]
    plain_eval, plain_train = gpt(cfg).eval(), gpt(cfg).train()
    want_eval = plain_eval(*b)
    for _ in range(2):  # interleaved: neither changes the other
        loss, _ = eval_step(params, b)
        torch.testing.assert_close(loss, want_eval.detach(), rtol=1e-5, atol=1e-6)
        torch.manual_seed(5)
        loss, grads = train_step(params, b)
        torch.manual_seed(5)
        torch.testing.assert_close(loss, plain_train(*b).detach(), rtol=1e-5, atol=1e-6)
        assert fz3.apply(evaluation, params, b).item() == pytest.approx(want_eval.item(), rel=1e-5)
    assert model.skeleton.training  # the shared skeleton is as it was
    return "ok"


def test_train_and_eval_are_model_copies():
    assert dist.run(1, mode_ranks) == ["ok"]


# Donated params and optimizer state (as with JAX's donate_argnums).


def donation_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG))
    b = batches(CFG, world)[rank]
    opt = fz3.optim.adamw(lr=1e-3, weight_decay=0.1)
    step = fz3.value_and_grad(model)
    state = opt.init(params)
    kept = fz3.optim.step(opt, step(params, b)[1], state, params)  # pure: nothing is given up
    _, grads = step(params, b)
    new_params, new_state = fz3.optim.step(opt, grads, state, params, donate=True)
    for a, c in zip(new_params.parts, kept[0].parts):  # the same step (the fused kernel orders ops its own way)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"params were donated to fz3.optim.step\(\.\.\., donate=True\).*use the "
                                         r"params it returned"):
        step(params, b)
    with pytest.raises(ValueError, match=r"optimizer state was donated to fz3.optim.step\(\.\.\., "
                                         r"donate=True\).*use the optimizer state that it returned"):
        fz3.optim.step(opt, grads, state, new_params)
    loss, grads = step(new_params, b)  # the returned ones work
    fz3.optim.step(opt, grads, new_state, new_params, donate=True)
    return "ok"


def test_donated_params_and_state_cannot_be_used_again():
    assert dist.run(1, donation_ranks) == ["ok"]


def profiler_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG))
    step = fz3.value_and_grad(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(params, batches(CFG, world)[rank])
    names = {e.name for e in prof.events()}
    want = {f"fz3 {op}" for op in ("gather blocks.0", "forward blocks.2", "loss post", "backward pre",
                                    "reduce blocks.1", "wait_reduce pre")}
    assert want <= names, sorted(n for n in names if n.startswith("fz3"))[:10]
    return "ok"


def test_ops_are_named_ranges_in_profiler_traces():
    assert dist.run(1, profiler_ranks) == ["ok"]
