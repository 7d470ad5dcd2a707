"""Arrival checks: a collective call that a rank can skip raises instead of hanging.

``arrive(group, "fz3.save", timeout)`` returns once every rank of ``group`` has called
``arrive`` for the same thing; otherwise, after ``timeout`` seconds, every rank that did call
raises, naming the ones that did not. Calls like ``fz3.save`` or ``fz3.export`` invite being
made on rank 0 only (the habit DDP and Hugging Face teach); without this the caller waits in
the first collective for the process group's timeout (30 minutes on gloo).

[Note: arrival keys]
Everything lives in the rendezvous store under ``fz3/arrive/<restart>/<ranks digest>/``:
- ``epoch``: how many calls on these ranks have been decided. A call reads it once and uses
  instance ``<epoch>``; so a second call can never see the first one's keys.
- ``<epoch>/call/<rank>``: what that rank called; ``<epoch>/count``: how many have.
- ``<epoch>/decision``: set once, by ``compare_set``, to "go" by the last rank to arrive,
  "differ:..." when ranks called different things, "gave_up:..." by a rank that saw a
  missing one give up waiting in the model's collectives (it will not come: [Note: a rank
  that gave up]), or "abandon:..." by the first rank whose timeout passed. Whoever wins then
  advances ``epoch`` and only then writes ``<epoch>/done``: every rank waits for ``done``, so
  none reads the old epoch after returning.
- A rank arriving at an instance that is already decided (it came after the others gave
  up) joins the next one, so one skipped call does not poison every later one. Once counted
  (``count`` <= ranks) a rank abides by the decision: the last rank may decide "go" between
  another's count and its next look, and that rank is in it.
- The last rank of a "go" deletes the previous instance's keys: every rank has arrived at
  this one, so none is still reading the last.
Cost: about 6 store round trips per rank per call (one more per poll while waiting).

[Note: a rank that gave up]
A rank in ``fz3.save`` may wait for one that is in a step call (it ran one step more): that
rank gives up at its own ``fz3.shard(timeout=)`` and says so in the store
(``out_of_step.give_up``); its model then refuses every further call, ``fz3.save`` included,
so it will never arrive. With the model's heartbeat (``beat``), a waiting rank reads the
model's count of ranks that gave up once every ``PERIOD_S`` (one store round trip, only while
it waits), and when it moved looks whether a missing rank is among them: the instance is
decided "gave_up", and every rank in it raises at once, naming where each rank is, instead of
at its own timeout. ``fz3.destroy`` passes no ``beat``: a rank that gave up may still call it.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import torch.distributed as dist

from ..compare import fingerprint
from .compat import default_store
from .failures import CollectiveMismatchError, RankLostError
from .liveness import (PERIOD_S, WINDOW_S, Heartbeat, Place, gave_up_count_key, observe, places,
                       restart_key)
from .out_of_step import apart, give_up, given_up

DEFAULT_TIMEOUT_S = 120.0


def arrive(group: dist.ProcessGroup | None, what: str, timeout: float = DEFAULT_TIMEOUT_S,
           beat: Heartbeat | None = None) -> None:
    """Wait until every rank of ``group`` (default: every rank) has called ``arrive(group,
    what)``, at most ``timeout`` seconds; see [Note: arrival keys]. Raises on every rank that
    called: ``CollectiveMismatchError`` (ranks missing or calling something else) or
    ``RankLostError`` (the missing ranks are dead). ``beat``: the model's heartbeat: ``what``
    is published as this rank's last call on the model, errors say where each rank is
    (``out_of_step.py``), and a missing rank that gave up on the model ends the wait at once
    ([Note: a rank that gave up])."""
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    if beat is not None:
        beat.inside(what)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me, st = dist.get_rank(), default_store()
    base = f"fz3/arrive/{restart_key()}/{fingerprint(ranks).hex()}"
    deadline = time.monotonic() + timeout
    while True:
        epoch = st.add(f"{base}/epoch", 0)
        inst = f"{base}/{epoch}"
        if st.check([f"{inst}/decision"]):
            _wait_done(st, inst, deadline + 10.0)  # decided without us: take the next one
            continue
        st.set(f"{inst}/call/{me}", what)  # before counting: the last to count reads them all
        count = st.add(f"{inst}/count", 1)
        if count > len(ranks):
            _wait_done(st, inst, deadline + 10.0)
            continue
        # Counted: the decision, whatever it is, is this rank's too; never re-check it here.
        if count == len(ranks):
            calls = dict(zip(ranks, (v.decode() for v in st.multi_get(
                [f"{inst}/call/{r}" for r in ranks]))))
            verdict = "go" if set(calls.values()) == {what} else "differ:" + json.dumps(calls)
            if _decide(st, base, inst, verdict) and verdict == "go" and epoch > 0:
                _forget(st, f"{base}/{epoch - 1}", ranks)

        def look() -> None:  # [Note: a rank that gave up]
            if beat is None or st.add(gave_up_count_key(beat.model), 0) == 0:
                return
            missing = [r for r in ranks if not st.check([f"{inst}/call/{r}"])]
            quit = given_up(st, missing, beat.model)
            if quit:
                _decide(st, base, inst, "gave_up:" + json.dumps(sorted(quit)))

        decision = _wait_done(st, inst, deadline, look)
        if decision is None:  # timed out: give up this instance for everyone, unless decided
            missing = [r for r in ranks if not st.check([f"{inst}/call/{r}"])]
            if missing:
                _decide(st, base, inst, "abandon:" + json.dumps(missing))
            # everyone arrived: the last one is deciding; or another rank's verdict won
            late = _wait_done(st, inst, time.monotonic() + 10.0)
            decision = late or "abandon:" + json.dumps(missing)
        _act(decision, what, timeout, st, ranks, beat)
        return


def _decide(st: dist.Store, base: str, inst: str, verdict: str) -> bool:
    """Set the instance's decision if none is set; the winner advances the epoch, then
    publishes ``done``. True if ``verdict`` won."""
    won = st.compare_set(f"{inst}/decision", "", verdict).decode() == verdict
    if won:
        st.add(f"{base}/epoch", 1)
        st.set(f"{inst}/done", verdict)
    return won


def _wait_done(st: dist.Store, inst: str, deadline: float,
               look: Callable[[], None] | None = None) -> str | None:
    """The instance's decision once ``done``; None at ``deadline``. ``look`` runs once every
    ``PERIOD_S`` of the wait (it may decide)."""
    pause, looked = 0.001, time.monotonic()
    while not st.check([f"{inst}/done"]):
        now = time.monotonic()
        if now >= deadline:
            return None
        if look is not None and now - looked >= PERIOD_S:
            look()
            looked = now
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return st.get(f"{inst}/done").decode()


def _forget(st: dist.Store, inst: str, ranks: list[int]) -> None:
    for key in ["count", "decision", "done", *(f"call/{r}" for r in ranks)]:
        st.delete_key(f"{inst}/{key}")


def _act(decision: str, what: str, timeout: float, st: dist.Store, ranks: list[int],
         beat: Heartbeat | None) -> None:
    if decision == "go":
        return
    kind, _, detail = decision.partition(":")
    info = json.loads(detail)
    if kind == "differ":
        calls = {int(r): c for r, c in info.items()}
        shown = ", ".join(f"rank {r} called {c}" for r, c in calls.items())
        raise CollectiveMismatchError(
            f"{what} is collective and the ranks called different ones: {shown}. Every rank must "
            f"make the same fz3 calls in the same order", [], calls)
    missing: list[int] = info
    if kind == "gave_up":
        quit, found = _where(st, ranks, missing, what, beat)
        raise CollectiveMismatchError(
            f"{what} is collective: ranks {missing} will not call it (they gave up waiting in "
            f"another collective of the model){_steps(found, quit)}. Every rank must make the "
            f"same fz3 calls in the same order (a loop bound or a skipped batch that differs by "
            f"rank?)", missing)
    seen = observe(st, missing, WINDOW_S)  # first: a missing rank that beat has its place out
    quit, found = _where(st, ranks, missing, what, beat)
    ended = [r for r in seen.dead if (p := found.get(r)) is not None and p.ended]
    dead = [r for r in seen.dead if r not in ended]
    if missing and dead == missing:
        raise RankLostError(f"{what} is collective: ranks {missing} did not call it within "
                            f"{timeout:g} s and their heartbeat stopped: they are "
                            f"dead{_steps(found, quit)}", missing)
    state = [f"ranks {seen.alive} are alive, running other code"] if seen.alive else []
    state += [f"ranks {dead} are dead (heartbeat stopped)"] if dead else []
    state += [f"ranks {ended} ended (fz3.destroy or their process exited)"] if ended else []
    state += [f"ranks {seen.unconfirmed} have no heartbeat"] if seen.unconfirmed else []
    raise CollectiveMismatchError(
        f"{what} is collective: ranks {missing} did not call it within {timeout:g} s "
        f"({'; '.join(state) or 'no rank missing?'}){_steps(found, quit)}. Call it on every "
        f"rank, not only on rank 0 (timeout= sets how long ranks may be apart)", missing)


def _where(st: dist.Store, ranks: list[int], missing: list[int], what: str,
           beat: Heartbeat | None) -> tuple[dict[int, str], dict[int, Place | None]]:
    """The missing ranks that gave up on the model (where they waited), and every rank's
    place; empty without ``beat``. A rank that called ``what`` but has not published it yet
    (it came within the last beat) is read again after one ``PERIOD_S``."""
    if beat is None:
        return {}, {}
    me = dist.get_rank()
    found = {**places(st, ranks, beat.model), me: beat.place}
    if any((p := found[r]) is not None and p.last != what for r in ranks if r not in missing):
        time.sleep(PERIOD_S)
        found = {**places(st, ranks, beat.model), me: beat.place}
    return given_up(st, missing, beat.model), found


def _steps(found: dict[int, Place | None], quit: dict[int, str]) -> str:
    """``": <where each rank is>"`` when some rank is elsewhere than this one, else ``""``."""
    away = apart(dist.get_rank(), found, quit) if found else None
    return f": {away.text}" if away is not None else ""


def absent_error(group: dist.ProcessGroup | None, what: object, waited_s: float,
                 beat: Heartbeat | None) -> CollectiveMismatchError | None:
    """After waiting ``waited_s`` in a collective of ``what`` (of the model whose heartbeat is
    ``beat``): the error naming the ranks that are not in this rank's fz3 call (fewer or more
    step calls entered, another last call, ended, or gave up waiting: ``out_of_step.py``);
    None when every rank is in the same call. Reads the places once every rank's heartbeat
    has published its own. A rank that raises here says so in the store first
    (``give_up``), so ranks still waiting with it, in a collective or to arrive, learn it."""
    if beat is None:
        return None
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me, st = dist.get_rank(), default_store()
    time.sleep(2 * PERIOD_S)
    found = {**places(st, ranks, beat.model), me: beat.place}
    away = apart(me, found, given_up(st, [r for r in ranks if r != me], beat.model))
    if away is None:
        return None
    give_up(st, me, beat.model, str(what))
    return CollectiveMismatchError(
        f"{what}: ranks {away.ranks} did not come within {waited_s:g} s: {away.text}. Every "
        f"rank must make the same fz3 calls in the same order (a loop bound or a skipped batch "
        f"that differs by rank?); fz3.shard(timeout=) sets how long ranks may be apart",
        away.ranks)
