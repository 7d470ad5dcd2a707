"""Collectives as plain functions: each issues one asynchronous collective and returns a
``Pending``; ``wait`` is a separate call, placed where the data is needed.

[Note: streams and lifetimes]
On CUDA (NCCL) an ``async_op=True`` collective runs on the process group's own NCCL stream,
which first waits for the work already queued on the current (compute) stream; ``wait``
makes the current stream wait for the collective, without blocking the host. So a gather
issued before layer i computes runs concurrently with it, and nothing here calls
``torch.cuda.synchronize``. The tensors a collective reads or writes are kept alive by the
``Pending`` until its ``wait``: after that every later use on the compute stream is ordered
after the collective, so dropping them is safe. On gloo the collective runs on gloo's
threads and ``wait`` blocks the host: the same code, the same order.

All-gathers and reduce-scatters use two process groups over the same ranks where the
backend serializes one group's collectives (NCCL): a reduce-scatter of layer i+1 then does
not queue behind the all-gather of layer i-1 in backward.

[Note: a rank that never comes]
On gloo, ``wait`` waits at most ``comm.step_timeout`` (``fz3.shard``'s ``timeout=``) at a
time. When it passes, the ranks' published places (the step calls each entered and its last
fz3 call, ``liveness.py``) say whether a rank is elsewhere: one that entered fewer or more
step calls, or is in another call (``fz3.save``), and the ranks waiting raise
``fz3.CollectiveMismatchError`` naming where each rank is (``out_of_step.py``). If every rank
is in the same call, someone is merely slow: ``wait`` waits again, and the process group's
own timeout stays the bound for a rank hung inside the call (``RankLostError``). A
collective that fails (a peer's process exited) names the ranks out of step the same way. Cost: none
while ranks arrive in time (``Work.wait(timeout)`` costs what ``Work.wait()`` does). NCCL's
``wait`` does not block the host, so there the process group's timeout stays the only bound.
"""

from __future__ import annotations

import datetime
import functools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from .arrival import absent_error
from .compat import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, GATHER, REDUCE_SCATTER, SUM,
                     SUM_SCATTER, TO_ALL)
from .failures import lost_error
from .liveness import Heartbeat



@dataclass(frozen=True, eq=False)
class Comm:
    """The sharding group and how to talk to it. Built once by ``fz3.shard`` from
    ``groups.comm_groups`` (which says who creates and frees each group)."""

    group: dist.ProcessGroup  # all-gathers (and the loss mean)
    reduce_group: dist.ProcessGroup  # reduce-scatters / all-reduces of gradients
    rank: int
    world_size: int
    replicate_group: dist.ProcessGroup | None = None  # hybrid sharding: all-reduce across replicas
    replicas: int = 1  # size of replicate_group (1: plain ZeRO-3)
    # debug: rank r sleeps r*delay_s before each collective (catches missing waits)
    delay_s: float = 0.0
    heartbeat: Heartbeat | None = None  # this process's liveness signal (liveness.py)
    local_copies: bool = True  # a group of one rank copies locally (False: through the backend)
    # gloo: how long a wait lasts before the absent ranks are looked for ([Note: a rank that
    # never comes]); None: wait as the process group does
    step_timeout: datetime.timedelta | None = None
    # Collectives given up on when ranks were found absent: kept, never waited for, so gloo
    # never writes into freed memory if those ranks come later (the model is unusable then).
    abandoned: list = field(default_factory=list)

    @functools.cached_property
    def local(self) -> bool:
        """A group of one rank whose collectives are done here, without the backend (a copy,
        or nothing): an all-gather into no given buffer hands back the shard itself."""
        return self.world_size == 1 and self.local_copies

    def _delay(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s * self.rank)


class Pending(NamedTuple):
    """An issued collective: ``out`` is valid only after ``wait``; ``keep`` lives until then."""

    work: object  # torch.distributed Work, or None when it ran synchronously
    out: torch.Tensor
    keep: torch.Tensor | None
    group: dist.ProcessGroup | None = None  # for naming a lost rank if it fails
    label: object = None  # what it is, str()-ed only on failure (the executor passes its Op)
    comm: Comm | None = None  # its model's: what bounds a wait, whom to name if ranks never come

    @property
    def is_input(self) -> bool:
        """Whether the result is the caller's input itself, not memory of its own (an
        all-gather over one rank into no given buffer: [Note: a group of one rank])."""
        return self.out is self.keep


# [Note: a group of one rank]
# A collective over one rank is a copy (all-gather, reduce-scatter) or nothing (all-reduce).
# It is done here, in the same stream order a collective would be, without the process
# group's own host work per call (about 50-80 us on gloo, tens of us on NCCL): a one-GPU run
# of fz3 pays for no communication. An all-gather into no given buffer is not even a copy:
# the shard is the whole buffer. The executor always gives one (each unit's memory,
# ``fz3.step.memory``): a one-rank run copies its shards, as FSDP2 does. The executor above
# runs the same code at any size.


def all_gather(comm: Comm, out: torch.Tensor | None, shard: torch.Tensor,
               label: object = "all-gather") -> Pending:
    """Issue ``out (world*n,) <- concat over ranks of shard (n,)``. ``out`` None: a new
    buffer, or in a group of one rank the shard itself (no copy: the caller must not write
    into the result)."""
    comm._delay()
    if comm.local:
        return Pending(None, shard if out is None else out.copy_(shard), shard, comm.group,
                       label)
    if out is None:
        out = shard.new_empty(comm.world_size * shard.numel())
    work = _issue(comm, comm.group, label, getattr(comm.group, ALL_GATHER), out, shard, GATHER)
    return Pending(work, out, shard, comm.group, label, comm)


def reduce_scatter(comm: Comm, out: torch.Tensor, full: torch.Tensor,
                   label: object = "reduce-scatter") -> Pending:
    """Issue ``out (n,) <- sum over ranks of full[rank*n:(rank+1)*n]`` (full: (world*n,))."""
    comm._delay()
    if comm.local:
        return Pending(None, out.copy_(full), full, comm.reduce_group, label)
    work = _issue(comm, comm.reduce_group, label, getattr(comm.reduce_group, REDUCE_SCATTER), out,
                  full, SUM_SCATTER)
    return Pending(work, out, full, comm.reduce_group, label, comm)


def all_reduce(comm: Comm, t: torch.Tensor, *, group: dist.ProcessGroup | None = None,
               label: object = "all-reduce") -> Pending:
    """Issue an in-place sum of ``t`` over ``group`` (default: the gradient group)."""
    comm._delay()
    group = group or comm.reduce_group
    size = comm.replicas if group is comm.replicate_group else comm.world_size
    if size == 1 and comm.local_copies:
        return Pending(None, t, None, group, label)
    work = _issue(comm, group, label, getattr(group, ALL_REDUCE), [t], SUM)
    return Pending(work, t, None, group, label, comm)


def all_to_all(comm: Comm, out: torch.Tensor, send: torch.Tensor, out_sizes: list[int],
               send_sizes: list[int], label: object = "all-to-all") -> Pending:
    """Issue ``out <- every rank's run for this rank``, in rank order: ``send`` (1-D) is cut
    into runs of ``send_sizes`` (one per rank, in rank order, zeros allowed), the i-th going to
    rank i; ``out`` (1-D) receives rank j's run for this rank as its j-th run of
    ``out_sizes[j]`` elements. Collective over the gradient group (every rank calls it, an
    owner of nothing with zero sizes); a group of one rank copies."""
    comm._delay()
    if comm.local:
        return Pending(None, out.copy_(send), send, comm.reduce_group, label)
    group = comm.reduce_group
    work = _issue(comm, group, label, getattr(group, ALL_TO_ALL), out, send, out_sizes,
                  send_sizes, TO_ALL)
    return Pending(work, out, send, comm.reduce_group, label, comm)


def wait(p: Pending) -> torch.Tensor:
    """Block (gloo) or make the current stream wait (NCCL) until ``p`` is done; return its output.

    A failure (a peer died, or hung past the process group's timeout) raises
    ``fz3.RankLostError`` naming the ranks that are gone; a rank that never entered this call
    ``fz3.CollectiveMismatchError`` once the comm's ``step_timeout`` passed ([Note: a rank
    that never comes])."""
    if p.work is None:
        return p.out
    bound = p.comm.step_timeout if p.comm is not None else None
    while True:
        try:
            if bound is None:
                p.work.wait()
            else:
                p.work.wait(bound)
            return p.out
        except RuntimeError as e:
            if bound is None or not _timed_out(e):
                beat = p.comm.heartbeat if p.comm is not None else None
                raise lost_error(p.group, p.label, e, beat=beat) from e
        absent = absent_error(p.group, p.label, bound.total_seconds(), p.comm.heartbeat)
        if absent is not None:
            p.comm.abandoned.append(p)  # gloo may still write into its buffers: keep them
            raise absent


def differing_ranks(comm: Comm, values: list[int], device: torch.device,
                    label: str) -> tuple[list[int], torch.Tensor]:
    """One all-gather of ``values`` (equal length on every rank) over ``comm.group``: the
    ranks whose values differ from rank 0's, and every rank's row (CPU). **Collective**; a
    rank that is gone is named (``RankLostError``), one that never comes too (``wait``)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = wait(all_gather(comm, None, mine, label=label)).view(comm.world_size, -1).cpu()
    return [r for r in range(comm.world_size) if not torch.equal(rows[r], rows[0])], rows


def _timed_out(e: RuntimeError) -> bool:
    """gloo's own words when ``Work.wait(timeout)`` passes its timeout (not the process
    group's: 'Timed out waiting ... for recv operation')."""
    return "Operation timed out" in str(e)


def _issue(comm: Comm, pg: dist.ProcessGroup, label: object, fn, *args):
    try:
        return fn(*args)
    except RuntimeError as e:
        raise lost_error(pg, label, e, beat=comm.heartbeat) from e
