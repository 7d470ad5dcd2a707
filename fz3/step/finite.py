"""Finding where values stopped being finite: a way to drain the executor that looks at
every compute op's outputs, then agrees across ranks on the first bad one."""

from __future__ import annotations

from typing import Generator

import optree
import torch

from ..comm.collectives import all_gather, wait
from ..schedule.ops import Op
from ..schedule.schedule import Schedule
from ..sharding.model import ShardedModel
from .state import Frame, Result


class NonFiniteError(FloatingPointError):
    """NaN or Inf appeared; names the first op (over all ranks) where it did."""


def drain_checking_finite(model: ShardedModel, schedule: Schedule,
                          gen: Generator[Frame, None, Result]) -> Result:
    """Run the executor to the end, noting after every compute op whether its outputs (and in
    backward its gradients) are all finite, in flags kept on the device (no sync per op: one
    read of each activation); then one all-gather of those flags, so every rank raises the
    same ``NonFiniteError`` naming the first op and the ranks where it happened.
    **Collective** (one all-gather per step)."""
    # (op, index) of each flag, never the frame: a frame holds its unit's unreduced gradient
    # and gathered buffer, and keeping every one kept a whole model's worth to the step's end
    ops: list[tuple[Op, int]] = []
    flags: list[torch.Tensor] = []
    while True:
        try:
            f = next(gen)
        except StopIteration as stop:
            result: Result = stop.value
            break
        tensors = [t for t in optree.tree_leaves(f.outputs, none_is_leaf=True)
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if f.grad is not None:
            tensors.append(f.grad)
        ok = (torch.stack([torch.isfinite(t).all() for t in tensors]).all() if tensors
              else torch.tensor(True))
        ops.append((f.op, f.index))
        flags.append(ok)
        del f, tensors  # the frame goes now: only its op and flag are kept
    if not flags:
        return result
    mine = (~torch.stack(flags)).to(torch.int32).to(model.device)  # 1 where non-finite
    out = torch.empty(model.world_size * mine.numel(), dtype=torch.int32, device=model.device)
    bad = wait(all_gather(model.comm, out, mine,
                          label="the non-finite check")).view(model.world_size, -1).cpu()
    if bool(bad.any()):
        first = int(bad.any(dim=0).nonzero()[0])
        ranks = bad[:, first].nonzero().flatten().tolist()
        op, index = ops[first]
        kind, name = schedule.describe(op).split(" ", 1)
        raise NonFiniteError(f"non-finite values first appeared in the {kind} of {name}, "
                             f"op {index} of the schedule, on ranks {ranks}")
    return result
