"""``value_and_grad`` and ``apply``: the step functions, prepared once, run through the
executor."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..schedule.planner import Policy
from ..schedule.schedule import Schedule
from ..sharding.model import Params, ShardedModel
from .traced import TracedLayers
from .executor import execute, lower
from .finite import drain_checking_finite
from .front import (check_call, check_in_sync, drain, layer_runner, loss_of, prepare,
                    refuse_fixed_buffers, say_untraced_selective)


class ValueAndGrad:
    """``f(params, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``);
    ``f.schedule`` is the schedule it runs."""

    def __init__(self, model: ShardedModel, schedule: Schedule, *,
                 loss: Callable[..., Any] | None = None, has_aux: bool = False, recorder=None,
                 check_finite: bool = False, check_sync: bool | None = None,
                 traced: TracedLayers | None = None):
        self.model, self.schedule, self.recorder = model, schedule, recorder
        # once: every call runs its steps, into the same memory (``fz3.step.memory``)
        self.program = lower(model, schedule)
        self.traced = traced
        self.loss = loss_of(model, loss, has_aux)
        self.check_finite = check_finite
        self.check_sync = model.device.type == "cpu" if check_sync is None else check_sync
        self.steps = 0  # calls so far (checked across ranks with check_sync)

    def __call__(self, params: Params, batch: Any, *, loss_scale: float | torch.Tensor = 1.0):
        """``loss_scale`` multiplies the gradients, not the loss (fp16 loss scaling)."""
        return self.run(params, batch, loss_scale, entry="value_and_grad's step")

    def run(self, params: Params, batch: Any, loss_scale: float | torch.Tensor = 1.0, *,
            update: Callable[[int, slice | None, torch.Tensor], None] | None = None,
            entry: str) -> tuple:
        """The step; a schedule with ``update`` ops (``fz3.train_step``'s) steps each unit's
        parameters with ``update`` and returns no gradients. **Collective**: every rank."""
        if self.schedule.updates != (update is not None):  # local, before any collective
            raise ValueError(f"{entry}: a schedule with update ops runs only with the "
                             f"optimizer's per-unit step (fz3.train_step), and only it")
        empty = check_call(self.model, params, batch, entry=entry)
        if self.check_sync:
            check_in_sync(self.model, self.steps, entry, [batch], empty)
        self.steps += 1
        gen = execute(self.model, self.program, params, batch, self.recorder, loss=self.loss,
                      loss_scale=loss_scale, traced=self.traced, frames=self.check_finite,
                      update=update)
        result = (drain_checking_finite(self.model, self.schedule, gen) if self.check_finite
                  else drain(gen))
        value = (result.loss, result.aux) if self.loss.has_aux else result.loss
        return value, result.grads


def value_and_grad(model: ShardedModel, schedule: Schedule | Policy | None = None, *,
                   loss: Callable[..., Any] | None = None, has_aux: bool = False, recorder=None,
                   check_finite: bool = False, check_sync: bool | None = None,
                   compile: bool = False, strict: bool = False, cuda_graphs: bool = False,
                   trace: bool = True, fixed_buffers: object = None) -> ValueAndGrad:
    """``f(params, batch) -> (loss, grads)``: the mean loss over ranks and this rank's shards
    of its gradient, same pytree structure as ``params``.

    ``schedule``: a ``Schedule`` (validated here, before anything runs), a ``Policy`` to
    plan one from, or None for the default policy. It is computed once, here, and compared
    across ranks. **Collective**: one small all-gather; every rank must call this.
    ``loss``: ``loss(m, h, batch)`` with ``post``'s signature (``loss(m, h, batch, aux)`` for
    a model sharded with ``layer_aux``), run instead of ``post``;
    ``has_aux=True``: it returns ``(loss, aux)`` and the step returns ``((loss, aux),
    grads)``, ``aux`` being this rank's own value, detached (as ``jax.value_and_grad``).
    ``recorder``: collects every op's timestamps (``fz3.Recorder``). ``check_finite``: raise
    ``fz3.NonFiniteError`` on every rank, naming the first unit and phase where activations
    or gradients stopped being finite (one extra read per activation, one collective per step).
    ``check_sync`` (default: on for CPU models): before each step, one all-gather of a few
    integers checks that every rank is at the same step with batches of the same shapes and
    dtypes, none empty (0 rows, or no labelled token for a Hugging Face adapter); raises on
    every rank instead of running on (the loss would not be the global mean) or hanging.
    ``check_sync=False`` lets batches of different shapes run (the loss is then the mean of
    per-rank means). On CUDA it is off unless asked for: reading its result syncs the device
    once a step (not yet measured on a GPU). A rank that never comes is named once a wait
    passes ``fz3.shard``'s ``timeout`` (gloo), either way.
    Training or eval mode is the model's (``model.eval()`` is a copy in eval mode).
    ``trace`` (default): each stack's layers run as programs traced once from the layer's
    function (``fz3.step.traced``: forward and backward ATen ops called directly, no autograd
    engine, autograd's results bit for bit unless an input is laid out otherwise than traced,
    a loss's transposed gradient of h, say: it is copied first, ``fz3.step.programs``); the
    layer's Python runs only while tracing, as with ``jax.jit``. ``trace=False`` runs it on
    every call (breakpoints, prints); a layer that cannot be traced runs that way anyway
    (``f.traced.failed`` says why).
    ``compile``: each stack's traced programs are compiled by inductor, once for every layer
    that shares them; a layer that cannot be traced runs through autograd (one warning), and
    a program inductor fails on runs as Python with a warning, or raises
    ``fz3.CompileError`` with ``strict``. ``compile`` needs ``trace``.
    ``fixed_buffers=``: refused with a ``TypeError`` (every step writes into the same memory
    now, ``fz3.step.memory``). ``cuda_graphs=True``
    raises ``NotImplementedError``: graph capture awaits a GPU measurement of the traced
    engine.
    """
    return step_function(model, schedule, "value_and_grad", loss=loss, has_aux=has_aux,
                         recorder=recorder, check_finite=check_finite, check_sync=check_sync,
                         compile=compile, strict=strict, cuda_graphs=cuda_graphs, trace=trace,
                         fixed_buffers=fixed_buffers)


def step_function(model: ShardedModel, schedule: Schedule | Policy | None, entry: str, *,
                  loss=None, has_aux: bool = False, recorder=None, check_finite: bool = False,
                  check_sync: bool | None = None, compile: bool = False, strict: bool = False,
                  cuda_graphs: bool = False, trace: bool = True, fixed_buffers: object = None,
                  updates: str | None = None) -> ValueAndGrad:
    """``value_and_grad``'s step for ``entry``, its schedule with ``update`` ops where
    ``updates`` asks for them (``prepare``'s; ``fz3.train_step``). **Collective**
    (``prepare``)."""
    refuse_fixed_buffers(fixed_buffers, f"fz3.{entry}")
    if cuda_graphs:
        raise NotImplementedError(
            "cuda_graphs=True: capturing the layers as CUDA graphs awaits a GPU measurement of "
            "the traced engine (benchmarks/gpu_check.py --part speed); until then pass "
            "compile=True, whose inductor programs have no Python between their kernels")
    traced = layer_runner(model, trace=trace, compile=compile, strict=strict)
    sched = prepare(model, schedule, grad=True, entry=entry, updates=updates)
    say_untraced_selective(sched, traced)
    return ValueAndGrad(model, sched, loss=loss, has_aux=has_aux, recorder=recorder,
                        check_finite=check_finite, check_sync=check_sync, traced=traced)


def apply(model: ShardedModel, params: Params, batch: Any, *,
          schedule: Schedule | Policy | None = None, loss: Callable[..., Any] | None = None,
          has_aux: bool = False, recorder=None, compile: ValueAndGrad | bool = False,
          trace: bool = True, output: str | None = None):
    """The mean loss over ranks, forward only: no graph, no gradients, units freed after use.
    ``loss``/``has_aux`` as in ``value_and_grad`` (returns ``(loss, aux)`` with ``has_aux``).
    ``output="logits"`` (a model with a built-in adapter, ``model.outputs``): returns this
    rank's ``(B, T, V)`` logits instead, as the model's own forward computes them (not
    sharded: ``B * T * V`` values on every rank), no loss.
    ``trace``/``compile`` as in ``value_and_grad``; ``compile`` may also be a
    ``value_and_grad`` step, whose traced and compiled layers are then shared (new ones each
    call would trace and compile again).
    **Collective**: every rank must call it (the schedule is compared across ranks first)."""
    if output is not None:  # local: refused before any collective
        loss, has_aux = _output(model, output, loss, has_aux), True
    if isinstance(compile, ValueAndGrad):
        traced = compile.traced
    else:  # local too: refused options fail before the call is counted (check_call)
        traced = layer_runner(model, trace=trace, compile=compile, strict=False)
    check_call(model, params, batch, entry="fz3.apply", labels=output is None)
    sched = prepare(model, schedule, grad=False, entry="apply")
    result = drain(execute(model, lower(model, sched), params, batch, recorder,
                           loss=loss_of(model, loss, has_aux), traced=traced, frames=False))
    if output is not None:
        return result.aux
    return (result.loss, result.aux) if has_aux else result.loss


def _output(model: ShardedModel, output: str, loss, has_aux: bool) -> Callable[..., Any]:
    """``apply``'s loss function for ``output=``: a zero loss, the output as its aux."""
    if loss is not None or has_aux:
        raise ValueError(f"fz3.apply(output={output!r}) returns that output; it takes no loss= "
                         f"or has_aux= (pass one or the other)")
    if output not in model.outputs:
        raise ValueError(f"fz3.apply(output={output!r}): this model has outputs "
                         f"{sorted(model.outputs) or 'none'} (the built-in Hugging Face adapters "
                         f"give 'logits'); for another model pass loss=lambda m, h, batch: "
                         f"(torch.zeros(()), what_you_want(m, h)) with has_aux=True")
    fn = model.outputs[output]

    def out(m, h, batch, *layer_aux):  # the layers' aux outputs (``layer_aux``): unused
        return h.new_zeros(()).float(), fn(m, h, batch)

    return out
