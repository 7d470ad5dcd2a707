"""Failing loudly instead of hanging: agreement checks across ranks, and naming a lost rank.

A ZeRO-3 step is a fixed sequence of collectives on every rank; a rank that takes another
path (another model, another schedule, another step count, a different batch) or dies
leaves the others waiting in a collective that never completes. fz3 checks what it can up
front with one small all-gather, and when a collective does fail, asks the process
group's store which ranks are still there before raising.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .compat import all_gather_into


class RankLostError(RuntimeError):
    """A collective failed; ``lost`` are the ranks that did not answer (empty: none was lost)."""

    def __init__(self, message: str, lost: list[int]):
        super().__init__(message)
        self.lost = lost


def differing_ranks(group: dist.ProcessGroup, values: list[int], device: torch.device) -> list[int]:
    """One all-gather of ``values`` (equal length on every rank): the ranks whose values differ from rank 0's."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    all_gather_into(everyone, mine, group=group)
    rows = everyone.view(world, -1).cpu()
    return [r for r in range(world) if not torch.equal(rows[r], rows[0])]


def gather_objects(group: dist.ProcessGroup, obj: object) -> list[object]:
    """Every rank's ``obj`` (pickled): only on the error path, to say what differs."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def lost_error(group: dist.ProcessGroup, what: object, cause: BaseException, grace_s: float = 3.0) -> RankLostError:
    """After ``what`` failed with ``cause``: mark this rank alive in the store, wait ``grace_s``
    for the others to do the same, and name the ranks that never did."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    lost: list[int] | None
    try:
        store = dist.distributed_c10d._get_default_store()  # the rendezvous store outlives the group
        store.set(f"fz3/alive/{me}", "1")
        deadline = time.monotonic() + grace_s
        while True:
            alive = [r for r in ranks if store.check([f"fz3/alive/{r}"])]
            if len(alive) == len(ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        lost = [r for r in ranks if r not in alive]
    except Exception:  # noqa: BLE001 - the store itself is gone (it lived in a dead rank's process)
        lost = None
    first = str(cause).splitlines()[0][:300]
    if lost:
        msg = (f"rank {me}: {what} failed because rank(s) {lost} stopped responding (died, or hung past the "
               f"process group's timeout). Cause: {first}")
    elif lost is None:
        msg = (f"rank {me}: {what} failed and the rendezvous store is unreachable, so the rank hosting it "
               f"(rank 0 without torchrun's agent store) is probably gone. Cause: {first}")
    else:
        msg = (f"rank {me}: {what} failed while every rank is still alive: the ranks issued different "
               f"collectives (another model, schedule or batch on some rank?). Cause: {first}")
    return RankLostError(msg, lost or [])
