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
