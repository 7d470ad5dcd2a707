"""The process groups a sharded model talks over, created the same way on every rank.

torch requires every rank of the default group to enter ``dist.new_group`` for every new
group, in the same order, with the same ranks: group names are a per-process counter, so a
rank that creates only its own row names it like another row on another rank (NCCL hangs;
gloo pairs the wrong ranks). ``comm_groups`` therefore creates the gradient group of *every*
row of the mesh on every rank, in row order, and keeps its own; gloo runs exactly this code,
so the tests cover what NCCL runs.

Why two groups over the same ranks: on one NCCL communicator, collectives serialize in launch
order even on different streams, so a reduce-scatter would queue behind the next all-gather
(Megatron-FSDP's runtime-schedule notes). A one-rank group moves nothing, so it gets no
second group (the same decision on every rank: rows of a mesh all have one size).

[Note: group lifetime]
The shard and replicate groups belong to the caller (its mesh or group). The gradient groups
are created by each ``fz3.shard`` call, collectively, and belong to that model: ``fz3.destroy
(model)`` frees them (every rank calls it, after the model's last collective), and
``dist.destroy_process_group()`` frees every group at the end of a job. fz3 keeps no cache of
groups: a module-level cache would outlive ``destroy_process_group`` and hand a re-initialized
job dead groups, and a cache the caller owns would be one more argument to ``shard``. Creating
one costs a store barrier and, on NCCL, a communicator built lazily at its first collective.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist

from .failures import gather_objects


class Groups(NamedTuple):
    """What ``Comm`` needs; the fields are named as in ``Comm``."""

    group: dist.ProcessGroup  # sharding group: all-gathers, the loss mean
    reduce_group: dist.ProcessGroup  # the same ranks, own communicator: gradient reductions
    rank: int  # this rank's index in ``group``
    world_size: int  # size of ``group``
    replicate_group: dist.ProcessGroup | None  # hybrid: this rank's column (same shard, other rows)
    replicas: int  # size of ``replicate_group`` (1: plain ZeRO-3)


def comm_groups(group: dist.ProcessGroup | None = None, mesh: Any = None) -> Groups:
    """The groups of a model sharded over ``group`` or ``mesh`` (default: the default group).

    Collective over the default group when the sharding group has 2+ ranks: every rank of the
    job must call it (each with its own row's group, or the same mesh). A 1-D mesh names the
    sharding group; a 2-D mesh ``(replicate, shard)`` shards along dim 1 and replicates along
    dim 0 (its groups come from the mesh, which created them on every rank).
    """
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(f"mesh has {mesh.ndim} dims {tuple(mesh.shape)}; fz3.shard takes a 1-D "
                         f"mesh (shard) or a 2-D mesh (replicate, shard) for hybrid sharding")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: launch with torchrun and call "
                           "dist.init_process_group (world size 1 works too)")
    replicate_group, replicas = None, 1
    if mesh is not None:
        if group is not None:
            raise ValueError("pass group= or mesh=, not both")
        group = mesh.get_group(mesh.ndim - 1)
        if mesh.ndim == 2:  # hybrid: shard inside dim 1, replicate across dim 0 (HSDP, ZeRO++ hpZ)
            replicate_group, replicas = mesh.get_group(0), mesh.size(0)
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    reduce_group = group if world == 1 else _own_row(group, _rows(group, mesh))
    return Groups(group, reduce_group, rank, world, replicate_group, replicas)


def _rows(group: dist.ProcessGroup, mesh: Any) -> list[list[int]]:
    """Every rank's sharding group (global ranks), in one order all ranks agree on."""
    mine = dist.get_process_group_ranks(group)
    if mesh is not None:
        return mesh.mesh.reshape(-1, len(mine)).tolist()
    if len(mine) == dist.get_world_size():
        return [sorted(mine)]
    # A sub-group the caller made: only the other ranks know theirs. One all-gather over the
    # job (every rank calls shard) gives every row, sorted by first rank.
    everyone = gather_objects(dist.group.WORLD, sorted(mine))
    rows = sorted({tuple(r) for r in everyone})
    for r, row in enumerate(everyone):
        clash = [list(o) for o in rows if r in o and list(o) != row]
        if r not in row or clash:
            raise ValueError(f"rank {r} shards over {row}, which the other ranks' groups "
                             f"contradict ({[list(o) for o in rows]}): give every rank the group "
                             f"of ranks it shards with, the same on each (or pass a DeviceMesh)")
    return [list(row) for row in rows]


def _own_row(group: dist.ProcessGroup, rows: list[list[int]]) -> dist.ProcessGroup:
    """Create one group per row, every row on every rank, in order; return this rank's."""
    me, mine = dist.get_rank(), None
    for row in rows:
        created = dist.new_group(row, group_desc="fz3_reduce")
        if me in row:
            mine = created
    own = sorted(dist.get_process_group_ranks(group))
    if mine is None or sorted(dist.get_process_group_ranks(mine)) != own:
        raise ValueError(f"rank {me}'s sharding group {own} is not a row of {rows}: pass the "
                         f"mesh's own group (mesh.get_group(-1))")
    return mine


def release(comm: Any) -> None:
    """Free what ``comm_groups`` created for one model (its gradient group) and stop its
    heartbeat. Every rank calls it after the model's last collective, in the same order
    (NCCL's communicator teardown was itself collective in some versions)."""
    if comm.heartbeat is not None:
        comm.heartbeat.stop()
    if comm.reduce_group is not comm.group:
        dist.destroy_process_group(comm.reduce_group)


def destroy(model: Any) -> None:
    """``fz3.destroy(model)``: free the process groups and the heartbeat thread ``fz3.shard``
    started for ``model`` (see [Note: group lifetime]); the model is unusable afterwards.
    Collective over the model's sharding group: every rank calls it, at the same point."""
    from .arrival import arrive

    # published as the rank's last call; arrive gets no beat: a rank that gave up on the
    # model's collectives may still come here ([Note: a rank that gave up] in arrival.py)
    if model.comm.heartbeat is not None:
        model.comm.heartbeat.inside("fz3.destroy")
    arrive(model.comm.group, "fz3.destroy", timeout=120.0)
    release(model.comm)


def refuse_destroyed(comm: Any, what: str) -> None:
    """Raise if ``fz3.destroy`` released the model ``comm`` belongs to (local, no collective)."""
    if comm.heartbeat is not None and comm.heartbeat.stopped:
        raise RuntimeError(f"{what}: this model was released by fz3.destroy(model): its process "
                           f"groups and heartbeat are gone. Shard the module again with "
                           f"fz3.shard to go on")
    if comm.abandoned:
        raise RuntimeError(f"{what}: this model gave up {len(comm.abandoned)} collectives when "
                           f"ranks were found absent (fz3.CollectiveMismatchError): its process "
                           f"group no longer pairs the ranks' collectives. Restart the job, or "
                           f"fz3.destroy it and shard the module again")
