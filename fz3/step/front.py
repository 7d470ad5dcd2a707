"""The public step functions: ``value_and_grad`` and ``apply``, thin wrappers over the executor."""

from __future__ import annotations

import hashlib
from typing import Any, Generator

import optree

import torch

from .executor import Result, execute
from ..comm.failures import differing_ranks, gather_objects
from ..sharding.model import Params, ShardedModel
from .record import Recorder
from ..schedule.schedule import Policy, Schedule, plan, validate


class ValueAndGrad:
    """``f(params, batch) -> (loss, grads)``; ``f.schedule`` is the schedule it runs."""

    def __init__(self, model: ShardedModel, schedule: Schedule, recorder: Recorder | None, check_finite: bool,
                 check_sync: bool):
        self.model, self.schedule, self.recorder = model, schedule, recorder
        self.check_finite, self.check_sync = check_finite, check_sync
        self.steps = 0  # calls so far (checked across ranks with check_sync)

    def __call__(self, params: Params, batch: Any, *, loss_scale: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, Params]:
        """``loss_scale`` multiplies the gradients, not the loss (fp16 loss scaling)."""
        check_params(self.model, params)
        check_batch(self.model, batch)
        if self.check_sync:
            check_in_sync(self.model, self.steps, batch)
        self.steps += 1
        gen = execute(self.model, self.schedule, params, batch, self.recorder, loss_scale=loss_scale)
        if self.check_finite:
            from ..observe.step_through import drain_checking_finite

            loss, grads = drain_checking_finite(self.model, self.schedule, gen)
        else:
            loss, grads = drain(gen)
        return loss, grads


def value_and_grad(model: ShardedModel, schedule: Schedule | Policy | None = None, *,
                   recorder: Recorder | None = None, check_finite: bool = False,
                   check_sync: bool = False) -> ValueAndGrad:
    """``f(params, batch) -> (loss, grads)``: the mean loss over ranks and this rank's shards
    of its gradient, same pytree structure as ``params``.

    ``schedule``: a ``Schedule`` (validated here, before anything runs), a ``Policy`` to
    plan one from, or None for the default policy. The schedule is computed once, here, and
    checked to be the same on every rank (one small all-gather; every rank must call this).
    ``recorder``: collects every op's timestamps (``fz3.Recorder``). ``check_finite``: raise
    ``fz3.NonFiniteError`` on every rank, naming the first unit and phase where activations
    or gradients stopped being finite (one extra read per activation, one collective per step).
    ``check_sync`` (debugging): before each step, one all-gather checks that every rank is at
    the same step with batches of the same shapes and dtypes; raises instead of hanging.
    """
    sched = check_schedule(model, schedule, grad=True)
    differ = differing_ranks(model.comm.group, list(sched.fingerprint()), model.device)
    if differ:
        raise ValueError(f"ranks {differ} planned a different schedule than rank 0 (policy, layers per unit or a "
                         f"hand-made schedule differ); every rank must run the same schedule or the step hangs")
    return ValueAndGrad(model, sched, recorder, check_finite, check_sync)


def check_batch(model: ShardedModel, batch: Any) -> None:
    """Every tensor in the batch lives on the model's device (local, before any collective)."""
    leaves, _, paths = _leaves_with_paths(batch)
    for path, t in zip(paths, leaves):
        if isinstance(t, torch.Tensor) and t.device != model.device:
            raise TypeError(f"batch{path} is on {t.device}, the model on {model.device}: move the batch to "
                            f"{model.device} (e.g. batch = optree.tree_map(lambda t: t.to('{model.device}'), batch))")


def check_in_sync(model: ShardedModel, step: int, batch: Any) -> None:
    """One all-gather: same step count and same batch shapes/dtypes on every rank."""
    leaves, spec, paths = _leaves_with_paths(batch)
    sig = [(p, tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else (p, repr(type(t)))
           for p, t in zip(paths, leaves)]
    digest = hashlib.sha256(repr((str(spec), sig)).encode()).digest()[:8]
    differ = differing_ranks(model.comm.group, [step, *digest], model.device)
    if not differ:
        return
    everyone = gather_objects(model.comm.group, (step, sig))
    r = differ[0]
    (s0, sig0), (sr, sigr) = everyone[0], everyone[r]
    if s0 != sr:
        raise RuntimeError(f"ranks {differ} are at another step than rank 0 (rank 0 at call {s0}, rank {r} at call "
                           f"{sr}): some rank skipped or repeated a step; every rank must call the step equally often")
    first = next((a, b) for a, b in zip(sig0 + [None] * len(sigr), sigr + [None] * len(sig0)) if a != b)
    raise ValueError(f"ranks {differ} have batches shaped unlike rank 0's: rank 0 has {first[0]}, rank {r} has "
                     f"{first[1]}. fz3's loss is the mean of per-rank mean losses, the global mean only when every "
                     f"rank's batch has the same shape: pad or drop the last batch")


def _leaves_with_paths(tree: Any) -> tuple[list, Any, list[str]]:
    paths, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return leaves, spec, ["".join(f"[{k!r}]" for k in p) for p in paths]


def apply(model: ShardedModel, params: Params, batch: Any, *, schedule: Schedule | Policy | None = None,
          recorder: Recorder | None = None) -> torch.Tensor:
    """The mean loss over ranks, forward only: no graph, no gradients, units freed after use."""
    sched = check_schedule(model, schedule, grad=False)
    check_params(model, params)
    return drain(execute(model, sched, params, batch, recorder)).loss


def drain(gen: Generator[Any, None, Result]) -> Result:
    """Run the executor to the end; return its ``Result``."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def check_schedule(model: ShardedModel, schedule: Schedule | Policy | None, *, grad: bool) -> Schedule:
    if schedule is None or isinstance(schedule, Policy):
        return plan(model.num_layers, schedule or Policy(), grad=grad)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be an fz3.Schedule or fz3.Policy, got {type(schedule).__name__}")
    if schedule.num_layers != model.num_layers:
        raise ValueError(f"schedule.num_layers={schedule.num_layers} but the model has {model.num_layers} "
                         f"layers; build it with fz3.plan(model, policy)")
    if schedule.grad != grad:
        raise ValueError(f"schedule.grad={schedule.grad}: {'value_and_grad' if grad else 'apply'} needs a "
                         f"{'training' if grad else 'forward-only'} schedule (fz3.plan(..., grad={grad}))")
    return validate(schedule)


def check_params(model: ShardedModel, params: Params) -> None:
    """Cheap shape/dtype/device checks, before any collective runs."""
    want = {"outer": (model.outer.shard_numel,), "layers": (model.num_layers, model.layer.shard_numel)}
    for name, shape in want.items():
        t = getattr(params, name, None)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"params.{name} is {type(t).__name__}; pass the Params that fz3.shard returned")
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != model.device:
            raise ValueError(f"params.{name} is {list(t.shape)} {t.dtype} on {t.device}; this model's shards "
                             f"are {list(shape)} torch.float32 on {model.device} (world size {model.world_size}). "
                             f"Use the params from this model's fz3.shard, or fz3.load to reshard")
