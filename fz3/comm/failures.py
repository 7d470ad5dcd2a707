"""Failing loudly instead of hanging: agreement checks across ranks, and naming a lost rank.

A ZeRO-3 step is a fixed sequence of collectives on every rank; a rank that takes another
path (another model, another schedule, another step count, a different batch) or dies
leaves the others waiting in a collective that never completes. fz3 checks what it can up
front with one small all-gather (``collectives.differing_ranks``), and when a collective does
fail, reads the ranks' heartbeats in the rendezvous store to name the ones that are gone
(``liveness.py``).
"""

from __future__ import annotations

import torch.distributed as dist

from .compat import default_store
from .liveness import WINDOW_S, Liveness, interrupted_key, observe


class RankLostError(RuntimeError):
    """A collective failed. ``lost``: ranks known dead (their heartbeat stopped); empty when
    every rank is alive. ``unconfirmed``: ranks with no heartbeat to judge by (see
    ``fz3/comm/liveness.py``); a live rank is in neither list."""

    def __init__(self, message: str, lost: list[int], unconfirmed: list[int] | None = None):
        super().__init__(message)
        self.lost = lost
        self.unconfirmed = unconfirmed or []


class RankInterruptedError(RuntimeError):
    """Rank(s) ``ranks`` were interrupted (``KeyboardInterrupt`` from SIGINT, or the exception a
    SIGTERM handler raised) inside a collective fz3 call; every other rank raises this, naming
    them and the interrupt, instead of waiting or calling it a disk error or a lost rank. The
    interrupted rank raises its own interrupt."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self):
        return type(self), (str(self), self.ranks)


def is_interrupt(e: BaseException) -> bool:
    """An interrupt, not a failure: ``KeyboardInterrupt``, ``SystemExit`` (what
    ``sys.exit`` in a SIGTERM handler raises), any other non-``Exception``."""
    return not isinstance(e, Exception)


def record_interrupt(e: BaseException, what: str) -> None:
    """Say in the rendezvous store that this rank was interrupted by ``e`` inside ``what``, for
    the ranks that find it gone (``lost_error``) to name."""
    try:
        default_store().set(interrupted_key(dist.get_rank()), f"{type(e).__name__} during {what}")
    except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
        pass


def interrupted(ranks: list[int]) -> dict[int, str]:
    """The ranks among ``ranks`` that recorded an interrupt, with what they were doing."""
    st = default_store()
    return {r: st.get(interrupted_key(r)).decode() for r in ranks
            if st.check([interrupted_key(r)])}


def gather_objects(group: dist.ProcessGroup, obj: object) -> list[object]:
    """Every rank's ``obj`` (pickled: for setup and for saying what differs on an error path,
    never per step). **Collective** over ``group``."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def lost_error(group: dist.ProcessGroup, what: object, cause: BaseException,
               window_s: float = WINDOW_S) -> RankLostError | RankInterruptedError:
    """After ``what`` failed with ``cause``: watch the heartbeats of ``group``'s other ranks
    for up to ``window_s`` and name the ones that stopped (see [Note: heartbeat])."""
    me = dist.get_rank()
    peers = [r for r in dist.get_process_group_ranks(group) if r != me]
    seen: Liveness | None
    try:
        seen = observe(default_store(), peers, window_s)
    except Exception:  # noqa: BLE001 - the store itself is gone (it lived in a dead rank's process)
        seen = None
    first = str(cause).splitlines()[0][:300]
    if seen is not None:
        stopped = interrupted(peers)
        if stopped:
            shown = "; ".join(f"rank {r}: {said}" for r, said in stopped.items())
            return RankInterruptedError(f"rank {me}: {what} failed: rank(s) {sorted(stopped)} "
                                        f"were interrupted ({shown}). Cause: {first}",
                                        sorted(stopped))
    if seen is None:
        return RankLostError(
            f"rank {me}: {what} failed and the rendezvous store is unreachable, so the rank "
            f"hosting it (rank 0 without torchrun's agent store) is probably gone. Cause: "
            f"{first}", [])
    parts = []
    if seen.dead:
        parts.append(f"rank(s) {seen.dead} stopped responding (heartbeat stopped {window_s:.0f} s: "
                     f"died, or frozen)")
    if seen.unconfirmed:
        parts.append(f"rank(s) {seen.unconfirmed} are unconfirmed (no heartbeat ever seen: did "
                     f"they reach fz3.shard?)")
    if parts:
        alive = f"; alive: {seen.alive}" if seen.alive else ""
        msg = f"rank {me}: {what} failed: {'; '.join(parts)}{alive}. Cause: {first}"
    else:
        msg = (f"rank {me}: {what} failed while every rank is still alive (heartbeats moving): the "
               f"ranks issued different collectives (another model, schedule or batch on some "
               f"rank?), or one is hung past the process group's timeout. Cause: {first}")
    return RankLostError(msg, seen.dead, seen.unconfirmed)
