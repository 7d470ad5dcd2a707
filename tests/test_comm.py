"""fz3/comm: process groups created the same way on every rank, arrival checks for calls a
rank can skip, and heartbeats that tell a dead rank from a late one."""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch.distributed.device_mesh import init_device_mesh

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=2)


def groups_ranks(rank, world):
    """Three shard calls: twice on one (2, 2) mesh, once on row groups the caller made. Per
    call: how many groups this rank created, the name and ranks of its gradient group, and
    whether fz3.destroy freed it."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rows = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]
    calls = []
    for how in (dict(mesh=mesh), dict(mesh=mesh), dict(group=rows[rank // 2])):
        before = tdist.distributed_c10d.get_pg_count()
        model, params = shard_gpt(gpt(CFG), **how)
        made = tdist.distributed_c10d.get_pg_count() - before
        group = model.comm.reduce_group
        loss, _ = fz3.value_and_grad(model)(params, batches(CFG, world)[rank])  # the groups work
        assert torch.isfinite(loss)
        fz3.destroy(model)
        try:
            tdist.get_process_group_ranks(group)
            freed = False
        except (KeyError, ValueError, RuntimeError):
            freed = True
        calls.append((made, group.group_name, tdist.get_process_group_ranks(model.comm.group),
                      freed))
    return calls


def test_every_rank_creates_every_row_group_in_order():
    """torch names groups by a per-process counter: a rank that created only its own row
    would give row [2, 3] the name rank 0 gave row [0, 1] (NCCL hangs on that)."""
    out = dist.run(4, groups_ranks, timeout=60)
    for call in range(3):
        made = {r: out[r][call][0] for r in range(4)}
        assert set(made.values()) == {2}, f"groups created per rank (one per row): {made}"
        names = {}
        for r in range(4):
            _, name, row, freed = out[r][call]
            assert freed, f"rank {r}: fz3.destroy left the gradient group {name} alive"
            names.setdefault(name, set()).add(tuple(row))
        assert all(len(rows) == 1 for rows in names.values()), f"one name, two rows: {names}"
        by_row = {rows.pop(): int(name) for name, rows in names.items()}
        assert by_row[(2, 3)] == by_row[(0, 1)] + 1, f"rows not created in order: {by_row}"


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


def test_a_place_is_published_and_marked_ended_when_the_heartbeat_stops():
    """The heartbeat publishes where its rank is (step calls entered, last call) and, stopped
    on purpose (fz3.destroy, the model dropped, the interpreter's exit), marks it ended: a rank
    whose process exited after its last step is told from one that died."""
    import threading
    import time

    from fz3.comm.liveness import Place, _beat, heartbeat_key, place_key, places

    st = tdist.HashStore()
    here = [Place(2, "value_and_grad's step", True)]
    stop = threading.Event()
    beating = threading.Thread(target=_beat, args=(st, heartbeat_key(0), 0.01, stop, here, place_key(0, 1)),
                               daemon=True)
    beating.start()
    here[0] = Place(2, "fz3.save", False)  # the main thread enters fz3.save after step call 2
    deadline = time.monotonic() + 5
    while places(st, [0], 1)[0] != here[0]:
        assert time.monotonic() < deadline, places(st, [0], 1)
        time.sleep(0.01)
    assert places(st, [0, 1], 1) == {0: Place(2, "fz3.save", False, False), 1: None}
    stop.set()
    beating.join()
    assert places(st, [0], 1)[0] == Place(2, "fz3.save", False, True)
    assert str(places(st, [0], 1)[0]) == "fz3.save after step call 2, then ended (fz3.destroy or its process exited)"


def test_ranks_out_of_step_are_named_where_each_is():
    """The sentence every rank raises: the highest step count first, each rank's last call,
    where a rank gave up; ranks in this rank's own call are not named."""
    from fz3.comm.liveness import Place
    from fz3.comm.out_of_step import apart

    step = "value_and_grad's step"
    at = {0: Place(2, "fz3.save"), 1: Place(3, step, True), 2: Place(3, step, True), 3: None}
    assert apart(1, at, {2: "gather pre"}) == (
        [0, 2], "ranks [1, 2] are on step call 3 while ranks [0] are on call 2 (the last fz3 call each rank "
                "entered: rank 0: fz3.save after step call 2; rank 1: value_and_grad's step call 3; rank 2: "
                "value_and_grad's step call 3 (gave up waiting in gather pre); rank 3: none published (did it "
                "reach fz3.shard?))")
    assert apart(1, {**at, 0: Place(3, step, True)}) is None  # every rank in call 3: merely slow
    assert apart(0, {0: Place(1, "fz3.apply", True), 1: Place(1, step, True)}).text.startswith(
        "the ranks' last fz3 calls differ, each after step call 1 (the last fz3 call each rank entered: "
        "rank 0: fz3.apply call 1; rank 1: value_and_grad's step call 1)")
    three = {0: Place(4, step, True), 1: Place(2, step, True), 2: Place(3, step, True)}
    assert apart(2, three).text.startswith("rank 0 is on its step call 4 while ranks [2] are on call 3 and "
                                           "ranks [1] are on call 2 (")


def arrival_ranks(rank, world, calls):
    from fz3.comm.arrival import arrive

    for i in range(calls):
        tdist.barrier()  # ranks leave a collective together and race into the check
        arrive(None, f"call {i}", timeout=10)
    return "ok"


def test_arrivals_in_quick_succession_stay_in_step():
    """Many calls, each right after a collective: the last rank's "go" can land
    between another rank's count and its next look at the decision; that rank must not take
    the call for one it missed (it did, and waited in the next call while the others went on)."""
    assert dist.run(3, arrival_ranks, 600, timeout=60) == ["ok"] * 3
