"""The public step functions: ``value_and_grad`` and ``apply``, thin wrappers over the executor."""

from __future__ import annotations

from typing import Any, Generator

import torch

from .executor import Result, execute
from .model import Params, ShardedModel
from .record import Recorder
from .schedule import Policy, Schedule, plan, validate


class ValueAndGrad:
    """``f(params, batch) -> (loss, grads)``; ``f.schedule`` is the schedule it runs."""

    def __init__(self, model: ShardedModel, schedule: Schedule, recorder: Recorder | None, check_finite: bool):
        self.model, self.schedule, self.recorder, self.check_finite = model, schedule, recorder, check_finite

    def __call__(self, params: Params, batch: Any, *, loss_scale: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, Params]:
        """``loss_scale`` multiplies the gradients, not the loss (fp16 loss scaling)."""
        check_params(self.model, params)
        gen = execute(self.model, self.schedule, params, batch, self.recorder, loss_scale=loss_scale)
        if self.check_finite:
            from .debug import drain_checking_finite

            loss, grads = drain_checking_finite(self.model, self.schedule, gen)
        else:
            loss, grads = drain(gen)
        return loss, grads


def value_and_grad(model: ShardedModel, schedule: Schedule | Policy | None = None, *,
                   recorder: Recorder | None = None, check_finite: bool = False) -> ValueAndGrad:
    """``f(params, batch) -> (loss, grads)``: the mean loss over ranks and this rank's shards
    of its gradient, same pytree structure as ``params``.

    ``schedule``: a ``Schedule`` (validated here, before anything runs), a ``Policy`` to
    plan one from, or None for the default policy. The schedule is computed once, here.
    ``recorder``: collects every op's timestamps (``fz3.Recorder``). ``check_finite``: raise
    ``fz3.NonFiniteError`` on every rank, naming the first unit and phase where activations
    or gradients stopped being finite (one extra read per activation, one collective per step).
    """
    return ValueAndGrad(model, check_schedule(model, schedule, grad=True), recorder, check_finite)


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
