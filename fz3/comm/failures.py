"""Failing loudly instead of hanging: agreement checks across ranks, and naming a lost rank.

A ZeRO-3 step is a fixed sequence of collectives on every rank; a rank that takes another
path (another model, another schedule, another step count, a different batch) or dies
leaves the others waiting in a collective that never completes. fz3 checks what it can up
front with one small all-gather (``collectives.differing_ranks``), and when a collective does
fail, reads the ranks' heartbeats in the rendezvous store to name the ones that are gone
(``liveness.py``).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from .compat import default_store
from .liveness import (PERIOD_S, WINDOW_S, Heartbeat, Liveness, Place, interrupted_key, observe,
                       places)
from .out_of_step import apart


class RankLostError(RuntimeError):
    """A collective failed. ``lost``: ranks known dead (their heartbeat stopped); empty when
    every rank is alive. ``unconfirmed``: ranks with no heartbeat to judge by (see
    ``fz3/comm/liveness.py``); a live rank is in neither list."""

    def __init__(self, message: str, lost: list[int], unconfirmed: list[int] | None = None):
        super().__init__(message)
        self.lost = lost
        self.unconfirmed = unconfirmed or []


class CollectiveMismatchError(RuntimeError):
    """Not every rank made the same collective call: ``missing`` ranks did not call it within
    the timeout (they are alive, running other code, or in another fz3 call: the message says
    where each rank is), or ``calls`` shows what each rank called. A rank that is dead
    instead raises ``RankLostError``."""

    def __init__(self, message: str, missing: list[int], calls: dict[int, str] | None = None):
        super().__init__(message)
        self.missing = missing
        self.calls = calls or {}


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
               window_s: float = WINDOW_S, beat: Heartbeat | None = None
               ) -> RankLostError | RankInterruptedError | CollectiveMismatchError:
    """After ``what`` failed with ``cause``: watch the heartbeats of ``group``'s other ranks
    for up to ``window_s`` and name the ones that stopped (see [Note: heartbeat]). With the
    model's heartbeat ``beat`` (a collective of a step), ranks in another fz3 call are named
    where they are (``out_of_step.py``): a rank that ended after fewer step calls (its process
    exited) gives ``CollectiveMismatchError``, the others' step ahead named, not a lost rank."""
    me = dist.get_rank()
    peers = [r for r in dist.get_process_group_ranks(group) if r != me]
    seen: Liveness | None
    ended: list[int] = []
    try:
        if beat is not None:  # a rank that ended on purpose has nothing left to watch
            ended = [r for r, p in places(default_store(), peers, beat.model).items()
                     if p is not None and p.ended]
        seen = observe(default_store(), [r for r in peers if r not in ended], window_s)
    except Exception:  # noqa: BLE001 - the store itself is gone (it lived in a dead rank's process)
        seen = None
    first = str(cause).splitlines()[0][:300]
    if seen is None:
        return RankLostError(
            f"rank {me}: {what} failed and the rendezvous store is unreachable, so the rank "
            f"hosting it (rank 0 without torchrun's agent store) is probably gone. Cause: "
            f"{first}", [])
    stopped = interrupted(peers)
    if stopped:
        shown = "; ".join(f"rank {r}: {said}" for r, said in stopped.items())
        return RankInterruptedError(f"rank {me}: {what} failed: rank(s) {sorted(stopped)} were "
                                    f"interrupted ({shown}). Cause: {first}", sorted(stopped))
    away = None
    if beat is not None:
        found = _places_now(peers, beat)
        away = apart(me, {**found, me: beat.place})
        ended += [r for r in seen.dead if (p := found.get(r)) is not None and p.ended]
        seen = seen._replace(dead=[r for r in seen.dead if r not in ended])
    if away is not None and not seen.dead:
        return CollectiveMismatchError(
            f"rank {me}: {what} failed: {away.text}. Every rank must make the same fz3 calls in "
            f"the same order (a loop bound or a skipped batch that differs by rank?). Cause: "
            f"{first}", away.ranks)
    parts = []
    if seen.dead:
        parts.append(f"rank(s) {seen.dead} stopped responding (heartbeat stopped {window_s:.0f} s: "
                     f"died, or frozen)")
    if seen.unconfirmed:
        parts.append(f"rank(s) {seen.unconfirmed} are unconfirmed (no heartbeat ever seen: did "
                     f"they reach fz3.shard?)")
    steps = f" ({away.text})" if away is not None else ""
    if parts:
        alive = f"; alive: {seen.alive}" if seen.alive else ""
        msg = f"rank {me}: {what} failed: {'; '.join(parts)}{alive}{steps}. Cause: {first}"
    else:
        msg = (f"rank {me}: {what} failed while every rank is still alive (heartbeats moving): the "
               f"ranks issued different collectives (another model, schedule or batch on some "
               f"rank?), or one is hung past the process group's timeout. Cause: {first}")
    return RankLostError(msg, seen.dead, seen.unconfirmed)


def _places_now(peers: list[int], beat: Heartbeat) -> dict[int, Place | None]:
    """The peers' places on ``beat``'s model; read again after one beat when some rank looks
    elsewhere than this one (a place lags its rank by up to ``PERIOD_S``)."""
    found = places(default_store(), peers, beat.model)
    if apart(dist.get_rank(), {**found, dist.get_rank(): beat.place}) is not None:
        time.sleep(PERIOD_S)
        found = places(default_store(), peers, beat.model)
    return found
