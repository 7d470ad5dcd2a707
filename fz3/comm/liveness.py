"""Which ranks are alive, from a heartbeat each rank keeps in the rendezvous store.

[Note: heartbeat]
``fz3.shard`` starts a ``Heartbeat``: a daemon thread that adds 1 to the store key
``fz3/heartbeat/<restart>/<rank>`` every ``PERIOD_S``, whatever the rank's main thread is
doing (computing, sleeping, blocked in a collective or in another rank's late arrival).
Cost: one store ``add`` per period per rank, a round trip to the store's host with the GIL
released; nothing on the training thread. Lifetime: owned by the model's ``Comm``; it stops
at ``fz3.destroy(model)``, when the ``Comm`` is garbage-collected, or when the store stops
answering (process group destroyed, store host gone); a daemon thread never delays exit.
With its beat it publishes where the rank is in its fz3 calls on the model (a ``Place``:
step calls entered, the last call entered), when that changed: at most one ``set`` a beat,
nothing on the training thread (a step call replaces one tuple); and when stopped on purpose
it marks the place ``ended``, so a rank whose process exited after its last step is told from
one that died (``out_of_step.py``).
``<restart>`` is torchrun's restart count, so a restarted job never reads its previous
attempt's counters.

A reporter decides from change, never from presence: it reads every peer's counter, watches
up to ``WINDOW_S``, and calls a rank
- alive: its counter moved,
- dead: its counter exists and did not move for the whole window (the heartbeat stopped:
  the process died, or is frozen),
- unconfirmed: it has no counter (it never reached ``fz3.shard``, or cannot write the store).
Each report reads fresh values, so nothing an earlier incident saw can make a dead rank look
alive in a later one (the ``fz3/alive/<rank>`` flags this replaces stayed set forever, and a
live rank that reached the error path more than 3 s late was called lost).
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import NamedTuple

import torch.distributed as dist

from .compat import default_store

PERIOD_S = 0.5  # between beats
WINDOW_S = 3.0  # a counter that did not move for this long (6 beats) is a stopped heartbeat


def restart_key() -> str:
    """The launcher's restart count: store keys of one incarnation of the job never meet the
    next one's."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def heartbeat_key(rank: int) -> str:
    return f"fz3/heartbeat/{restart_key()}/{rank}"


def interrupted_key(rank: int) -> str:
    """Set by a rank interrupted (``KeyboardInterrupt``, ``SystemExit``) inside a collective
    fz3 call: what it was doing, for the others to name instead of a lost rank."""
    return f"fz3/interrupted/{restart_key()}/{rank}"


def place_key(rank: int, model: int) -> str:
    """Where the rank is in its fz3 calls on its ``model``-th sharded model (numbered in
    ``fz3.shard`` order, the same on every rank): a ``Place``, published by the heartbeat."""
    return f"fz3/place/{restart_key()}/{rank}/{model}"


def gave_up_key(rank: int, model: int) -> str:
    """Set when the rank stopped waiting in a collective of that model (absent ranks): where
    it waited."""
    return f"fz3/gave_up/{restart_key()}/{rank}/{model}"


def gave_up_count_key(model: int) -> str:
    """How many ranks set their ``gave_up_key`` for ``model``: one read tells a rank waiting to
    arrive whether to look for them."""
    return f"fz3/gave_up/{restart_key()}/{model}/count"


class Place(NamedTuple):
    """Where a rank is in the sequence of fz3 calls it made on one model: how many step calls
    (``value_and_grad``'s, ``apply``, ``accumulate``'s, ``step_through``) it entered, and the
    last collective fz3 call it entered (``last``: a step call's name when ``in_step``, else a
    call such as ``fz3.save`` made after step call ``calls``). ``ended``: its heartbeat
    stopped on purpose (``fz3.destroy``, the model dropped, the process exiting)."""

    calls: int = 0
    last: str = ""
    in_step: bool = False
    ended: bool = False

    def __str__(self) -> str:
        if self.in_step:
            said = f"{self.last} call {self.calls}"
        elif self.last:
            said = f"{self.last} after step call {self.calls}"
        else:
            said = f"no fz3 call after step call {self.calls}"
        return said + (", then ended (fz3.destroy or its process exited)" if self.ended else "")


class Heartbeat:
    """This process's heartbeat while its owner lives (see [Note: heartbeat]). With each beat
    it also publishes where this rank is in its fz3 calls on the model (a ``Place``: step
    calls ``entered``, the last call entered), so a rank left waiting in a collective can tell
    which ranks are elsewhere (``fz3/comm/out_of_step.py``)."""

    def __init__(self, period_s: float = PERIOD_S) -> None:
        self._stop = threading.Event()
        # read by the thread: a list it shares, not self; one slot, replaced whole (atomic)
        self._place = [Place()]
        key = heartbeat_key(dist.get_rank())
        # this process's models, numbered in creation order (the same on every rank)
        self.model = default_store().add(f"fz3/models/{restart_key()}/{dist.get_rank()}", 1)
        self._thread = threading.Thread(target=_beat,
                                        args=(default_store(), key, period_s, self._stop,
                                              self._place, place_key(dist.get_rank(), self.model)),
                                        name=f"fz3-heartbeat-{key}", daemon=True)
        # The thread holds the event, not self: dropping the owner stops the thread. A
        # finalizer also runs at interpreter exit, before daemon threads are frozen: a thread
        # left inside a store call while the process tears down aborted a rank (SIGABRT).
        self._halt = weakref.finalize(self, _halt, self._stop, self._thread)
        self._thread.start()

    def stop(self) -> None:
        self._halt()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def place(self) -> Place:
        """Where this rank is now (exact; the store's copy lags by up to one ``PERIOD_S``)."""
        return self._place[0]

    def entered(self, what: str) -> None:
        """This rank entered one more step call, ``what`` (a Python add and a tuple: free on
        the hot path; the thread publishes it with its next beat)."""
        self._place[0] = Place(self._place[0].calls + 1, what, True)

    def inside(self, what: str) -> None:
        """This rank entered the collective call ``what`` (``fz3.save``, ...), not a step
        call: published as its last call, the step count unchanged."""
        self._place[0] = Place(self._place[0].calls, what, False)


def _halt(stop: threading.Event, thread: threading.Thread) -> None:
    """Stop the beating thread and wait for it (at most one store call and a moment)."""
    stop.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=5.0)


def _beat(st: dist.Store, key: str, period_s: float, stop: threading.Event,
          place: list[Place] | None = None, place_at: str = "") -> None:
    published = None
    while True:
        try:
            st.add(key, 1)
            if place is not None and place[0] != published:
                published = place[0]
                st.set(place_at, json.dumps(published))
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read the beat
            return
        if stop.wait(period_s):
            break
    if place is not None:  # stopped on purpose: say so, for ranks that wait for this one
        try:
            st.set(place_at, json.dumps(place[0]._replace(ended=True)))
        except Exception:  # noqa: BLE001 - the store is gone
            pass


class Liveness(NamedTuple):
    alive: list[int]  # counter moved during the window
    dead: list[int]  # counter stopped: known dead (or frozen)
    unconfirmed: list[int]  # no counter ever written


def observe(st: dist.Store, ranks: list[int], window_s: float = WINDOW_S) -> Liveness:
    """Watch ``ranks``' heartbeats for up to ``window_s`` from now (less once every counter
    moved)."""
    start = read(st, ranks)
    alive: set[int] = set()
    deadline = time.monotonic() + window_s
    while True:
        now = read(st, [r for r in ranks if r not in alive])
        alive |= {r for r, v in now.items() if v is not None and v != start.get(r)}
        if len(alive) == len(ranks) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    rest = [r for r in ranks if r not in alive]
    last = read(st, rest)
    return Liveness(sorted(alive), sorted(r for r in rest if last[r] is not None),
                    sorted(r for r in rest if last[r] is None))


def places(st: dist.Store, ranks: list[int], model: int) -> dict[int, Place | None]:
    """Each rank's published ``Place`` on ``model`` (None: none published), fresh within one
    ``PERIOD_S``."""
    keys = {r: place_key(r, model) for r in ranks}
    return {r: Place(*json.loads(st.get(k))) if st.check([k]) else None for r, k in keys.items()}


def read(st: dist.Store, ranks: list[int]) -> dict[int, int | None]:
    """Each rank's heartbeat counter, None where it has none (``add(k, 0)`` would create it)."""
    return {r: st.add(heartbeat_key(r), 0) if st.check([heartbeat_key(r)]) else None for r in ranks}
