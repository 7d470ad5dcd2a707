"""Stepping through a step layer by layer, and finding where values stopped being finite.

Both consume the executor's frames (``fz3.executor.Frame``); neither changes what it runs.
"""

from __future__ import annotations

from typing import Any, Generator, NamedTuple

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather, wait
from ..step.executor import Frame, Result, execute
from ..sharding.layout import FlatLayout
from ..sharding.model import Params, ShardedModel
from ..step.record import Recorder
from ..schedule.schedule import OUTER, Op, Policy, Schedule, unit_name


class StepFrame(NamedTuple):
    """One compute op of a step, as ``fz3.step_through`` shows it."""

    phase: str  # "forward" | "loss" | "backward" | "done"
    unit: int | None  # OUTER (-1) or the layer unit; None for the final frame
    op: Op | None
    index: int  # the op's position in the schedule (-1 for the final frame)
    params: dict[str, torch.Tensor]  # gathered parameters by original module name (views: clone to keep)
    inputs: Any  # forward: the unit's input (the batch for outer); backward: gradient w.r.t. its output
    outputs: Any  # forward: its output (the loss for `loss`); backward: gradient w.r.t. its input
    grads: dict[str, torch.Tensor] | None  # backward: the unit's full gradient before reduction, by name
    loss: torch.Tensor | None = None  # the final frame: mean loss over ranks
    result: Params | None = None  # the final frame: gradient shards, identical to value_and_grad's


def step_through(model: ShardedModel, params: Params, batch: Any, schedule: Schedule | Policy | None = None, *,
                 recorder: Recorder | None = None) -> Generator[StepFrame, None, None]:
    """Run one real step (the same executor as ``value_and_grad``), yielding a frame after
    every compute op and a final ``phase == "done"`` frame with the loss and gradients.

    Stopping early (``break``, or ``close()`` on the generator) drains every collective this
    rank has in flight, so nothing is left half-done. **Every rank must stop at the same op**:
    a rank that stops earlier issues fewer collectives than the others, which then wait for
    it forever. Decide from values that are equal on every rank (the op index, the loss, a
    statistic passed through ``any_rank``), never from a rank-local value alone.
    """
    from ..step.front import check_params, check_schedule

    sched = check_schedule(model, schedule, grad=True)
    check_params(model, params)
    gen = execute(model, sched, params, batch, recorder)
    try:
        while True:
            try:
                frame = next(gen)
            except StopIteration as stop:
                result: Result = stop.value
                yield StepFrame("done", None, None, -1, {}, None, None, None, result.loss, result.grads)
                return
            yield describe(model, sched, frame)
    finally:
        gen.close()  # the executor drains its in-flight collectives


def describe(model: ShardedModel, schedule: Schedule, f: Frame) -> StepFrame:
    """A ``Frame`` with names: parameters and gradients as ``{module name: tensor}``."""
    kind, u = f.op
    phase = "forward" if kind.startswith("forward") else kind
    if u == OUTER or kind == "loss":
        params = model.outer.named_views(f.params)
        grads = None if f.grad is None else model.outer.named_views(f.grad)
    else:
        rows = schedule.layer_range(u)
        params, grads = {}, None if f.grad is None else {}
        for j, i in enumerate(rows):
            prefix = f"{model.layers_path}.{i}."
            params.update(_prefixed(model.layer, f.params[j], prefix))
            if f.grad is not None:  # (world, k, n) rank-major -> layer j's (padded,)
                grads.update(_prefixed(model.layer, f.grad[:, j].reshape(-1), prefix))
    return StepFrame(phase, u, f.op, f.index, params, f.inputs, f.outputs, grads)


def _prefixed(layout: FlatLayout, flat: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + n: v for n, v in layout.named_views(flat).items()}


def any_rank(model: ShardedModel, flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank: a collective decision (one all-reduce)."""
    t = torch.tensor([int(flag)], device=model.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=model.comm.group)
    return bool(t.item())


class NonFiniteError(FloatingPointError):
    """NaN or Inf appeared; names the first op (over all ranks) where it did."""


def drain_checking_finite(model: ShardedModel, schedule: Schedule, gen: Generator[Frame, None, Result]) -> Result:
    """Run the executor to the end, noting after every compute op whether its outputs (and in
    backward its gradients) are all finite; then one all-gather of those flags, so every rank
    raises the same ``NonFiniteError`` naming the first op and the ranks where it happened.

    The flags stay on the device during the step (no sync per op): the check costs one read
    of each activation and one small collective per step.
    """
    ops: list[Frame] = []
    flags: list[torch.Tensor] = []
    while True:
        try:
            f = next(gen)
        except StopIteration as stop:
            result: Result = stop.value
            break
        tensors = [t for t in _tensors(f.outputs) if t.is_floating_point()]
        if f.grad is not None:
            tensors.append(f.grad)
        ok = torch.stack([torch.isfinite(t).all() for t in tensors]).all() if tensors else torch.tensor(True)
        ops.append(f)
        flags.append(ok)
    if not flags:
        return result
    mine = (~torch.stack(flags)).to(torch.int32).to(model.device)  # 1 where non-finite
    everyone = wait(all_gather(model.comm, torch.empty(model.world_size * mine.numel(), dtype=torch.int32,
                                                       device=model.device), mine))
    bad = everyone.view(model.world_size, -1).cpu()
    if bool(bad.any()):
        first = int(bad.any(dim=0).nonzero()[0])
        ranks = bad[:, first].nonzero().flatten().tolist()
        f = ops[first]
        what = "loss" if f.op.kind == "loss" else f"{f.op.kind} of {unit_name(f.op.unit)}"
        layers = "" if f.op.unit == OUTER or f.op.kind == "loss" else \
            f" (layers {list(schedule.layer_range(f.op.unit))})"
        raise NonFiniteError(f"non-finite values first appeared in the {what}{layers}, op {f.index} of the "
                             f"schedule, on ranks {ranks}")
    return result


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []
