"""``fz3.train_step``: forward, backward and the optimizer as one schedule.

The schedule is ``value_and_grad``'s with an ``update`` op after each unit's ``wait_reduce``
(``fz3.schedule.planner.updating``): a unit's reduced gradient shard lands in a buffer of its
own, its parameter rows are stepped with it by the optimizer's per-unit form
(``GradientTransformation.per_unit``, ``fz3.optim.base.UnitStep``) and it is let go, so the
model's whole fp32 gradient shard is never alive at once, and each update runs while the
layers below are still in their backward (``adamw``; ``muon``, whose stack units' matrices
go to their owners as each lands and come back orthogonalized over the next two updates).
``chain(clip_by_global_norm, opt)`` needs the whole gradient's norm first: its update ops
follow the backward, each unit's gradient kept until then, then scaled and stepped a unit at
a time (``fz3.optim.base.after_scaling``: the whole gradient alive once, not twice as in
``optim.step``). ``chain(opt, freeze(...))`` steps per unit and puts the frozen elements
back at the end. An optimizer without a per-unit form (a longer chain), and
``check_finite`` (it raises after the step), run the step as ``value_and_grad`` then
``fz3.optim.step(..., donate=True)``, said once. Either way the
result is bit for bit that of ``value_and_grad`` followed by ``fz3.optim.step(...,
donate=True)`` (``fz3.optim.aligned``, ``fz3.optim.base.row_norms``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .comm.say import once
from .optim.base import GradientTransformation, give_up, step
from .optim.checks import refuse_donated_tree
from .optim.per_unit import per_unit, placement
from .schedule.planner import Policy
from .schedule.schedule import Schedule
from .sharding.model import Params, ShardedModel
from .step.value_and_grad import ValueAndGrad, step_function

log = logging.getLogger(__name__)


class TrainStep:
    """``step(params, opt_state, batch) -> (loss, params, opt_state)`` (``loss`` is ``(loss,
    aux)`` with ``has_aux``); ``params`` and ``opt_state`` are donated (as with
    ``fz3.optim.step(..., donate=True)``): use the returned ones. A step that raises after
    some unit was stepped gives them up too (stepped in part: load a checkpoint); one that
    raises before keeps them. ``step.schedule``: the schedule it runs; ``step.each_unit``:
    whether the optimizer steps a unit at a time (else after the backward)."""

    def __init__(self, model: ShardedModel, opt: GradientTransformation, steps: ValueAndGrad,
                 each_unit: bool):
        self.model, self.opt, self.steps, self.each_unit = model, opt, steps, each_unit
        self.schedule = steps.schedule

    def __call__(self, params: Params, opt_state: Any, batch: Any, *,
                 loss_scale: float | torch.Tensor = 1.0) -> tuple[Any, Params, Any]:
        """**Collective**, as ``value_and_grad``'s step: every rank calls it. ``loss_scale``
        is refused: fp16 loss scaling checks the whole gradient before any update, and skips
        the step on overflow (``value_and_grad(...)(params, batch, loss_scale=)``, then
        ``fz3.optim.unscale`` and ``fz3.optim.step``)."""
        if not (isinstance(loss_scale, (int, float)) and loss_scale == 1.0):  # local
            raise ValueError(f"fz3.train_step's step(loss_scale={loss_scale!r}): a loss-scaled "
                             f"step is checked for overflow on the whole gradient and skipped "
                             f"before any update; use value_and_grad(model)(params, batch, "
                             f"loss_scale=...), fz3.optim.unscale and fz3.optim.step")
        if not self.each_unit:
            refuse_donated_tree(params, "params")  # before the step's collectives
            refuse_donated_tree(opt_state, "optimizer state")
            value, grads = self.steps.run(params, batch, loss_scale, entry="train_step")
            # (fails after its checks, a step written in part is given up there)
            new = step(self.opt, grads, opt_state, params, donate=True)
            # (an optimizer without an in-place path leaves the trees as they were: gone too)
            return value, give_up(params, new[0]), give_up(opt_state, new[1])
        unit_step = per_unit(self.opt, params, opt_state)  # refuses donated trees, locally
        try:
            value, _ = self.steps.run(params, batch, loss_scale, update=unit_step.update,
                                      entry="train_step")
            params, opt_state = unit_step.finish()  # (collective: Muon's last exchanges land)
        except BaseException:
            unit_step.abandon()
            raise
        return value, params, opt_state


def train_step(model: ShardedModel, opt: GradientTransformation,
               schedule_or_policy: Schedule | Policy | None = None, *,
               loss: Callable[..., Any] | None = None, has_aux: bool = False, recorder=None,
               check_finite: bool = False, check_sync: bool | None = None,
               compile: bool = False, strict: bool = False, trace: bool = True) -> TrainStep:
    """One training step of ``model`` with the optimizer ``opt`` (see the module's docstring).
    ``schedule_or_policy`` and the options are ``fz3.value_and_grad``'s; a hand-made schedule
    may place the ``update`` ops itself (each after its unit's ``wait_reduce``; none before a
    unit's last gather), else one follows each ``wait_reduce``. ``check_finite`` needs the
    step to end before anything is stepped: it runs the optimizer after the backward.
    **Collective**: the schedule is compared across ranks; every rank must call it."""
    if not isinstance(opt, GradientTransformation):
        raise TypeError(f"fz3.train_step takes an fz3.optim transformation (fz3.optim.adamw("
                        f"...), say), got {type(opt).__name__}")
    why = _after_backward(opt, check_finite)
    if why is not None:
        if isinstance(schedule_or_policy, Schedule) and schedule_or_policy.updates:
            raise ValueError(f"the schedule holds update ops, but {why}: pass it without them")
        once(log, logging.WARNING, f"fz3.train_step: {why}: the optimizer steps after the "
             f"backward, the whole gradient shard alive at once (as value_and_grad + "
             f"fz3.optim.step)")
    steps = step_function(model, schedule_or_policy, "train_step", loss=loss, has_aux=has_aux,
               recorder=recorder, check_finite=check_finite, check_sync=check_sync,
               compile=compile, strict=strict, trace=trace,
               updates=placement(opt) if why is None else None)
    return TrainStep(model, opt, steps, why is None)


def _after_backward(opt: GradientTransformation, check_finite: bool) -> str | None:
    """Why the optimizer must step after the backward, or None (a unit at a time)."""
    if opt.per_unit is None:
        return ("the optimizer has no per-unit form (a chain of three or more, or a "
                "transformation of your own without one)")
    if check_finite:
        return "check_finite raises after the step, before anything is stepped"
    return None
