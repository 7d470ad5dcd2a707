"""Ranks out of step: naming where each rank is when they are not in the same fz3 call.

A collective pairs the ranks' calls by order alone: a rank that made one step call more than
the others (a loop bound or a skipped batch that differs by rank) has its extra call paired
with whatever the others call next, and a rank in ``fz3.save`` waits for ranks that are in a
step. What tells them apart is where each rank is: its ``Place`` on the model (the step calls
it entered, the last fz3 call it entered), which its heartbeat publishes (``liveness.py``).
Ranks read the places only where they already wait: a collective's wait past ``fz3.shard``'s
``timeout`` (``arrival.absent_error``), a collective that failed (``failures.lost_error``),
``arrive`` past its ``timeout`` or once another rank gave up (``arrival.arrive``). Cost: two
store round trips per rank of the group (``places``), on those paths only; nothing while the
ranks are in step (a step call replaces one tuple; the heartbeat thread publishes it).

Every rank that raises says the same thing: "rank 1 is on its step call 3 while ranks [0] are
on call 2 (the last fz3 call each rank entered: rank 0: fz3.save after step call 2; rank 1:
value_and_grad's step call 3)".
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from .liveness import Place, gave_up_count_key, gave_up_key


class Apart(NamedTuple):
    """Ranks not where this rank is (``ranks``), and the sentence that names where each is."""

    ranks: list[int]
    text: str


def apart(me: int, places: dict[int, Place | None],
          gave_up: dict[int, str] | None = None) -> Apart | None:
    """The ranks of ``places`` in another fz3 call than rank ``me`` (another step call count,
    another last call, ended, or gave up waiting: ``gave_up`` maps a rank to where it waited),
    named; None when every rank with a place is where ``me`` is. A rank with no place (it
    published none) is not judged."""
    gave_up = gave_up or {}
    mine = places[me]
    assert mine is not None, "this rank's own place is always known"
    away = sorted(r for r, p in places.items() if r != me and p is not None and (
        (p.calls, p.last, p.in_step) != (mine.calls, mine.last, mine.in_step) or p.ended
        or r in gave_up))
    if not away:
        return None
    return Apart(away, f"{steps_apart(places)} ({where(places, gave_up)})")


def steps_apart(places: dict[int, Place | None]) -> str:
    """``"rank 1 is on its step call 3 while ranks [0] are on call 2"`` (highest count first),
    or, every rank on the same count, that their last calls differ."""
    by_calls: dict[int, list[int]] = {}
    for r, p in sorted(places.items()):
        if p is not None:
            by_calls.setdefault(p.calls, []).append(r)
    if len(by_calls) == 1:
        (calls, _), = by_calls.items()
        return f"the ranks' last fz3 calls differ, each after step call {calls}"
    (top, first), *rest = sorted(by_calls.items(), reverse=True)
    lead = (f"rank {first[0]} is on its step call {top}" if len(first) == 1 else
            f"ranks {first} are on step call {top}")
    others = [f"ranks {ranks} are on call {calls}" for calls, ranks in rest]
    return f"{lead} while {' and '.join(others)}"


def where(places: dict[int, Place | None], gave_up: dict[int, str] | None = None) -> str:
    """``"the last fz3 call each rank entered: rank 0: fz3.save after step call 2; rank 1:
    value_and_grad's step call 3"``, with where a rank gave up waiting."""
    gave_up = gave_up or {}
    said = []
    for r, p in sorted(places.items()):
        there = str(p) if p is not None else "none published (did it reach fz3.shard?)"
        if r in gave_up:
            there += f" (gave up waiting in {gave_up[r]})"
        said.append(f"rank {r}: {there}")
    return "the last fz3 call each rank entered: " + "; ".join(said)


def give_up(st: dist.Store, me: int, model: int, waited_in: str) -> None:
    """Say in the store that this rank stopped waiting in ``waited_in``, a collective of
    ``model``: ranks still waiting for it (in a collective, or to arrive) learn it instead of
    waiting their whole timeout."""
    st.set(gave_up_key(me, model), waited_in)
    st.add(gave_up_count_key(model), 1)


def given_up(st: dist.Store, ranks: list[int], model: int) -> dict[int, str]:
    """The ranks among ``ranks`` that gave up waiting in a collective of ``model``, with where."""
    return {r: st.get(gave_up_key(r, model)).decode() for r in ranks
            if st.check([gave_up_key(r, model)])}
