"""fz3/comm: heartbeats that tell a dead rank from a late one."""

from __future__ import annotations

import torch.distributed as tdist


def test_liveness_is_read_from_change_per_incident():
    """A counter that moves is alive, one that stopped is dead, none is unconfirmed; and a
    second incident reads afresh: rank 2, alive in the first, is dead in the second (the
    ``fz3/alive/<rank>`` flags this replaced stayed set, so it would have looked alive)."""
    import threading

    from fz3.comm.liveness import Liveness, _beat, heartbeat_key, observe

    st = tdist.HashStore()
    st.add(heartbeat_key(1), 7)  # rank 1 beat 7 times, then died
    stop = threading.Event()
    beating = threading.Thread(target=_beat, args=(st, heartbeat_key(2), 0.05, stop), daemon=True)
    beating.start()
    assert observe(st, [1, 2, 3], window_s=0.5) == Liveness([2], [1], [3])
    stop.set()
    beating.join()
    assert observe(st, [1, 2, 3], window_s=0.5) == Liveness([], [1, 2], [3])
