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
  "differ:..." when ranks called different things, or "abandon:..." by the first rank whose
  timeout passed. Whoever wins then advances ``epoch`` and only then writes ``<epoch>/done``:
  every rank waits for ``done``, so none reads the old epoch after returning.
- A rank arriving at an instance that is already decided (it came after the others gave
  up) joins the next one, so one skipped call does not poison every later one. Once counted
  (``count`` <= ranks) a rank abides by the decision: the last rank may decide "go" between
  another's count and its next look, and that rank is in it.
- The last rank of a "go" deletes the previous instance's keys: every rank has arrived at
  this one, so none is still reading the last.
Cost: about 6 store round trips per rank per call (one more per poll while waiting).
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from ..compare import fingerprint
from .compat import default_store
from .failures import RankLostError
from .liveness import PERIOD_S, WINDOW_S, entered_calls, gave_up_key, observe, restart_key

DEFAULT_TIMEOUT_S = 120.0


class CollectiveMismatchError(RuntimeError):
    """Not every rank made the same collective call: ``missing`` ranks did not call it within
    the timeout (they are alive, running other code), or ``calls`` shows what each rank called.
    A rank that is dead instead raises ``RankLostError``."""

    def __init__(self, message: str, missing: list[int], calls: dict[int, str] | None = None):
        super().__init__(message)
        self.missing = missing
        self.calls = calls or {}


def arrive(group: dist.ProcessGroup | None, what: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until every rank of ``group`` (default: every rank) has called ``arrive(group,
    what)``, at most ``timeout`` seconds; see [Note: arrival keys]. Raises on every rank that
    called: ``CollectiveMismatchError`` (ranks missing or calling something else) or
    ``RankLostError`` (the missing ranks are dead)."""
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
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
        decision = _wait_done(st, inst, deadline)
        if decision is None:  # timed out: give up this instance for everyone, unless decided
            missing = [r for r in ranks if not st.check([f"{inst}/call/{r}"])]
            if missing:
                _decide(st, base, inst, "abandon:" + json.dumps(missing))
            # everyone arrived: the last one is deciding; or another rank's verdict won
            late = _wait_done(st, inst, time.monotonic() + 10.0)
            decision = late or "abandon:" + json.dumps(missing)
        _act(decision, what, timeout, st)
        return


def _decide(st: dist.Store, base: str, inst: str, verdict: str) -> bool:
    """Set the instance's decision if none is set; the winner advances the epoch, then
    publishes ``done``. True if ``verdict`` won."""
    won = st.compare_set(f"{inst}/decision", "", verdict).decode() == verdict
    if won:
        st.add(f"{base}/epoch", 1)
        st.set(f"{inst}/done", verdict)
    return won


def _wait_done(st: dist.Store, inst: str, deadline: float) -> str | None:
    pause = 0.001
    while not st.check([f"{inst}/done"]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return st.get(f"{inst}/done").decode()


def _forget(st: dist.Store, inst: str, ranks: list[int]) -> None:
    for key in ["count", "decision", "done", *(f"call/{r}" for r in ranks)]:
        st.delete_key(f"{inst}/{key}")


def _act(decision: str, what: str, timeout: float, st: dist.Store) -> None:
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
    missing = info
    seen = observe(st, missing, WINDOW_S)
    if missing and seen.dead == missing:
        raise RankLostError(f"{what} is collective: ranks {missing} did not call it within "
                            f"{timeout:g} s and their heartbeat stopped: they are dead", missing)
    state = [f"ranks {seen.alive} are alive, running other code"] if seen.alive else []
    state += [f"ranks {seen.dead} are dead (heartbeat stopped)"] if seen.dead else []
    state += [f"ranks {seen.unconfirmed} have no heartbeat"] if seen.unconfirmed else []
    raise CollectiveMismatchError(
        f"{what} is collective: ranks {missing} did not call it within {timeout:g} s "
        f"({'; '.join(state) or 'no rank missing?'}). Call it on every rank, not only on rank "
        f"0 (timeout= sets how long ranks may be apart)", missing)


def absent_error(group: dist.ProcessGroup | None, what: object, waited_s: float,
                 model: int) -> CollectiveMismatchError | None:
    """After waiting ``waited_s`` in a collective of ``what`` (of the process's ``model``-th
    model): the error naming the ranks that entered fewer step calls than this one (they are
    elsewhere), more (they went on without it), or that gave up this model's collectives; None
    when every rank is in the same call. Reads the counts once every rank's heartbeat has
    published its own. A rank that raises here says so in the store first, so ranks still
    waiting with it learn it at their own timeout instead of waiting on."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me, st = dist.get_rank(), default_store()
    gave_up = [r for r in ranks if r != me and st.check([gave_up_key(r, model)])]
    time.sleep(2 * PERIOD_S)
    calls = entered_calls(st, ranks, model)
    mine = calls.get(me)
    if mine is None:
        return None
    behind = sorted(r for r, c in calls.items() if c is not None and c < mine)
    ahead = sorted(r for r, c in calls.items() if c is not None and c > mine)
    if not (behind or ahead or gave_up):
        return None
    shown = ", ".join(f"rank {r}: {calls[r]}" for r in ranks)
    if behind:
        say = f"ranks {behind} did not enter this step call within {waited_s:g} s"
    elif ahead:
        say = (f"ranks {ahead} entered more step calls than rank {me} and did not come to "
               f"this collective within {waited_s:g} s (they went on after an error?)")
    else:
        say = f"ranks {gave_up} gave up this model's collectives (they named absent ranks)"
    st.set(gave_up_key(me, model), say)
    return CollectiveMismatchError(
        f"{what}: {say} (step calls entered, by rank: {shown}): they are running other code. "
        f"Every rank must make the same fz3 calls in the same order (fz3.shard(timeout=) sets "
        f"how long ranks may be apart)", behind or ahead or gave_up)
