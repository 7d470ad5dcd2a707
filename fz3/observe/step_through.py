"""Stepping through a step layer by layer: the executor's frames, with names."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Generator, NamedTuple

import optree
import torch

from ..comm.arrival import DEFAULT_TIMEOUT_S, arrive
from ..comm.collectives import all_reduce, wait
from ..optim.base import GradientTransformation, UnitStep
from ..optim.per_unit import per_unit, placement
from ..schedule.ops import FORWARD_KINDS, Op, OpKind
from ..schedule.saveable import cuts, name_of, recompute
from ..schedule.structure import Role
from ..schedule.planner import Policy
from ..schedule.schedule import Schedule
from ..sharding.model import Params, ShardedModel
from ..step.executor import execute, lower
from ..step.state import Frame, Result
from ..step.front import check_call, prepare, say_untraced_selective


class StepFrame(NamedTuple):
    """One compute op of a step, as ``fz3.step_through`` shows it. ``print(frame)`` shows
    shapes, dtypes and norms, never whole tensors."""

    phase: str  # "forward" | "loss" | "backward" | "update" | "done"
    unit: int | None  # the unit (index into the schedule's units); None for the final frame
    name: str  # the unit's name ("pre", "blocks.3", "post"); "" for the final frame
    op: Op | None
    index: int  # the op's position in the schedule (-1 for the final frame)
    # gathered parameters by original module name (views of the unit's gathered memory, a copy
    # of the shards at world size 1 too; each frame's its own: kept frames stay valid)
    params: dict[str, torch.Tensor]
    # forward: the unit's input (the batch for outer); backward: gradient w.r.t. its output
    inputs: Any
    # forward: its output (the loss for `loss`); backward: gradient w.r.t. its input; update
    # (``opt=``): inputs its reduced gradient shard, outputs its parameter shard as stepped
    outputs: Any
    # backward: the unit's full gradient before reduction, by name, with its contribution to
    # each tied (shared) parameter it reads under every name that parameter has (a tied
    # embedding's gradient is in the loss frame, from the head, and in pre's, from the lookup)
    grads: dict[str, torch.Tensor] | None
    loss: torch.Tensor | None = None  # the final frame: mean loss over ranks
    result: Params | None = None  # the final frame: gradient shards, identical to value_and_grad's
    # the final frame with ``opt=``: ``(params, opt_state)`` after the step (``result`` None)
    stepped: tuple | None = None

    def __repr__(self) -> str:
        if self.op is None:
            head = f"StepFrame({self.phase})"
        else:  # "forward model.layers.2 (op 15)"; what the op keeps where it is not recompute
            what = self.op.kind.value if self.op.saves is None else name_of(self.op.saves)
            kind = "" if what in (self.phase, "recompute") else f", {what}"
            head = f"StepFrame({self.phase} {self.name} (op {self.index}{kind}))"
        rows = [head]
        if self.phase == "done":
            rows.append(f"  loss    {_brief(self.loss)}")
            rows.append(f"  grads   {_brief(self.result)}" if self.stepped is None else
                        f"  params  {_brief(self.stepped[0])}")
            return "\n".join(rows)
        rows.append(f"  params  {len(self.params)} tensors, {_brief(list(self.params.values()))}")
        rows.append(f"  inputs  {_brief(self.inputs)}")
        rows.append(f"  outputs {_brief(self.outputs)}")
        if self.grads is not None:
            rows.append(f"  grads   {len(self.grads)} tensors, {_brief(list(self.grads.values()))}")
        return "\n".join(rows)

    __str__ = __repr__


def step_through(model: ShardedModel, params: Params, batch: Any,
                 schedule: Schedule | Policy | None = None, *, opt=None, opt_state: Any = None,
                 recorder=None, timeout: float = DEFAULT_TIMEOUT_S
                 ) -> Generator[StepFrame, None, None]:
    """Run one real step (the same executor as ``value_and_grad``), yielding a frame after
    every compute op and a final ``phase == "done"`` frame with the loss and gradients.
    ``opt``, ``opt_state`` (an ``fz3.optim`` transformation with a per-unit form, its state):
    ``fz3.train_step``'s step instead, an ``"update"`` frame after each unit's update, the
    final frame's ``stepped`` the new ``(params, opt_state)`` (both given ones donated; stopped
    after an update, they are given up, stepped in part).

    **Collective**: every rank must call it and iterate it alike. Stopping early (``break``,
    or ``close()`` on the generator) drains every collective of the schedule's ops this rank
    has in flight, so nothing is left half-done (an optimizer's own, Muon's exchanges, were
    issued alike on every rank and complete on their own; the trees are given up). **Every
    rank must stop at the same op**: decide from values that are equal on every rank (the op
    index, the loss, a statistic passed through ``fz3.any_rank``), never from a rank-local
    value alone. An early stop is checked like any collective call: a rank that stops while
    another goes on raises ``fz3.CollectiveMismatchError`` within ``timeout`` seconds, naming
    the ranks that did not stop, instead of waiting for them forever.
    """
    check_call(model, params, batch, entry="fz3.step_through")  # local, before any collective
    unit_step = None if opt is None else _unit_step(opt, params, opt_state)
    sched = prepare(model, schedule, grad=True, entry="step_through",
                    updates=None if unit_step is None else placement(opt))
    # through autograd (no traced programs): a forward whose predicate cuts programs runs as
    # recompute, said once, and its frames say so
    say_untraced_selective(sched, None)
    sched = replace(sched, ops=tuple(Op(op.kind, op.unit, recompute) if op.saves is not None
                                     and cuts(op.saves) else op for op in sched.ops))
    gen = execute(model, lower(model, sched, handed_out=True), params, batch, recorder,
                  update=None if unit_step is None else unit_step.update)
    try:
        while True:
            try:
                frame = next(gen)
            except StopIteration as stop:
                result: Result = stop.value
                stepped, unit_step = None if unit_step is None else unit_step.finish(), None
                yield StepFrame("done", None, "", None, -1, {}, None, None, None, result.loss,
                                result.grads, stepped)
                return
            try:
                yield describe(model, sched, frame)
            except GeneratorExit:  # stopped early: every rank must stop here too, or the drain
                arrive(model.comm.group, "fz3.step_through stop", timeout,  # would wait forever
                       model.comm.heartbeat)
                raise
    finally:
        gen.close()  # the executor drains its in-flight collectives
        if unit_step is not None:  # stopped before the end: params and state stepped in part
            unit_step.abandon()


def _unit_step(opt: GradientTransformation, params: Params, state: Any) -> UnitStep:
    """``opt``'s step a unit at a time, or a ValueError naming why not (local)."""
    unit_step = per_unit(opt, params, state)
    if unit_step is None:
        raise ValueError("fz3.step_through(opt=...): this optimizer has no per-unit form (a "
                         "chain of three or more, or a transformation of your own without "
                         "one): step through without opt= and call fz3.optim.step on the "
                         "final frame's gradients")
    return unit_step


def describe(model: ShardedModel, schedule: Schedule, f: Frame) -> StepFrame:
    """A ``Frame`` with names: parameters and gradients as ``{module name: tensor}`` (an
    ``update``'s shards, slices of parameters, unnamed)."""
    kind, u = f.op[:2]
    phase = "forward" if kind in FORWARD_KINDS else str(kind)
    unit = schedule.units[u]
    if kind == OpKind.UPDATE:
        return StepFrame(phase, u, unit.name, f.op, f.index, {}, f.inputs, f.outputs, None)
    part = model.parts[unit.part]
    stack = part.role is Role.STACK  # then (k, padded) buffers, a (world, k, n) gradient
    params, grads = {}, None if f.grad is None else {}
    for j, row in enumerate(unit.layers if stack else [0]):
        prefix = part.prefix(row)
        params.update(part.layout.named_views(f.params[j] if stack else f.params, prefix))
        if f.frozen is not None:
            params.update(part.frozen.named_views(f.frozen[j] if stack else f.frozen, prefix))
        if grads is not None:
            grad = f.grad[:, j].reshape(-1) if stack else f.grad
            grads.update(part.layout.named_views(grad, prefix))
    for r in unit.reads:  # a shared part a unit reads is shown with it, and its gradient
        layout = model.parts[schedule.units[r].part].layout  # contribution, by every name
        params.update(layout.named_views(f.reads[r]))
        if grads is not None and f.read_grads is not None:
            grads.update(layout.named_views(f.read_grads[r]))
    return StepFrame(phase, u, unit.name, f.op, f.index, params, f.inputs, f.outputs, grads)


def any_rank(model: ShardedModel, flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank: a collective decision.
    **Collective**: one all-reduce of one number over the sharding group."""
    t = torch.tensor([int(flag)], device=model.device)
    return bool(wait(all_reduce(model.comm, t, group=model.comm.group,
                                label="fz3.any_rank")).item())


def _brief(x: Any) -> str:
    """Shapes, dtypes and norms of the tensors in ``x``; other leaves by type."""
    leaves = optree.tree_leaves(x, none_is_leaf=True)
    if not leaves:
        return "()"
    parts = []
    for t in leaves[:4]:
        if isinstance(t, torch.Tensor):
            norm = (f" |{float(t.detach().float().norm()):.4g}|"
                    if t.is_floating_point() and t.numel() else "")
            parts.append(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}{norm}")
        else:
            parts.append("None" if t is None else type(t).__name__)
    more = f" +{len(leaves) - 4} more" if len(leaves) > 4 else ""
    return ", ".join(parts) + more
