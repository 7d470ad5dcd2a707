"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), reshardable.

``fz3.save(path, model, state)`` writes any pytree of training state: ``Params``-shaped
nodes (params, AdamW moments, gradients; a part that is None, as in Muon's momentum outside
stacks, is skipped) and ``Rest`` nodes (written as the ``Params`` they are part of, read back
compacted: ``fz3/sharding/matrices.py``) as DTensors, replicated tensors (a step count),
plain Python values (a loss-scale state) and, automatically, every rank's RNG state. Each
rank writes only its own shards; nothing is gathered.

Each unit's flat shard is a DTensor over the *unpadded* flat parameter vector, sharded on
its last dimension: rank r's real elements are exactly ``torch.chunk``'s r-th chunk (fz3 pads
only at the end), so DCP knows every element's global offset and a checkpoint written at
world size 4 loads at 2 or 3, and back.

Nothing is lost, and nothing wrong loads silently:
- ``save`` touches only its own files at ``path`` and claims it against another job's save
  (``owned.py``), writes ``path.partial`` and moves it into place only once it is complete on
  every rank; the outcome of each step is agreed by all ranks first, so a failure anywhere (disk
  full, permission, a bad path) raises the same ``fz3.CheckpointError`` on every rank with the
  cause, and a rank that dies is named (``fz3.RankLostError``): see ``commit.py``'s [Note:
  committing a save]. A tree donated to ``fz3.optim.step(..., donate=True)`` is refused before
  anything is written.
- Every rank loads the same checkpoint, or every rank raises (``agreement.py``).
- Every storage item's CRC-32 is recorded (``checksums.py``); ``load`` checks every byte it
  reads and ``fz3.verify_checkpoint(path)`` the whole checkpoint offline.
- ``path/fz3.json`` describes the model; loading a checkpoint of another model raises a
  ``ValueError`` naming what differs, a damaged one ``fz3.CheckpointDamagedError`` (a
  ``ValueError`` too) naming the file, on every rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .. import rng
from ..comm.arrival import DEFAULT_TIMEOUT_S, arrive
from ..comm.failures import is_interrupt, lost_error, record_interrupt
from ..comm.groups import refuse_destroyed
from ..comm.progress import Progress
from ..sharding.layout import FlatLayout
from ..sharding.matrices import Rest, expand, rest_of
from ..sharding.model import Params, ShardedModel
from ..sharding.params import is_donated
from .agreement import (Start, agree_found, agree_start, agree_unchanged, identity_now, look,
                        value_digests)
from .commit import agree, attempt, swap_in
from .durable import fsync_dir, write_durably
from .errors import failures_of, interrupt_failure, load_failure, save_failure
from .owned import new_save_id, release, resolve, take_path
from .verify import META, checksums_of, describe, meta_text

# torch.distributed.checkpoint and DTensor are imported where used: they take over a second
# to import, which every process importing fz3 would otherwise pay.


def save(path: str | os.PathLike, model: ShardedModel, state: Any, *,
         timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Write ``state`` (a pytree: dicts, lists, NamedTuples, ``Params``, tensors, values) to
    ``path`` (normalised: ``"ckpt/"`` is ``"ckpt"``; ``~`` is not expanded; a symlink is
    followed).

    ``path`` must hold nothing, an empty folder or an fz3 checkpoint (replaced); anything else
    (a file, other contents, an unmarked ``path.old``/``path.partial``) or another job's save in
    flight there is refused with ``FileExistsError`` naming it (``owned.py``); a key whose value
    differs between ranks with ``ValueError`` naming it: save those under a key per rank.

    **Collective**: every rank calls it. A rank that does not within ``timeout`` seconds makes
    the others raise ``fz3.CollectiveMismatchError`` naming it, before anything is written. A
    failure on any rank raises ``fz3.CheckpointError`` (or ``fz3.RankLostError`` for a dead
    rank, ``fz3.RankInterruptedError`` for an interrupted one) on every rank, and leaves the
    previous checkpoint at ``path`` as it was."""
    path = os.path.normpath(os.fspath(path))
    refuse_destroyed(model.comm, "fz3.save")
    flat = _flatten(model, state, "")  # refuses a donated tree, before anything is touched
    group = _everyone(model)
    arrive(group, "fz3.save", timeout, model.comm.heartbeat)
    try:
        _save(path, model, flat, group)
    except BaseException as e:
        if is_interrupt(e):
            record_interrupt(e, f"fz3.save({path!r})")
        raise


def _save(path: str, model: ShardedModel, flat: dict[str, Any],
          group: dist.ProcessGroup | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .dcp_io import ChecksumWriter

    # DCP's coordinator: rank 0 of the group
    rank0 = dist.get_rank(group) == 0 if group is not None else dist.get_rank() == 0
    folder = resolve(path)
    partial, save_id = folder + ".partial", new_save_id()
    # [Note: what a save may touch]: nothing of the user's; one save per path
    held, refused, failed = take_path(folder, save_id) if rank0 else (None, None, None)

    def drop_partial() -> None:
        if held is not None:
            release(held)

    try:
        agree_start(group, path, Start(folder, refused, failed, value_digests(flat)), flat)
    except BaseException:
        drop_partial()
        raise
    flat[f"rng.rank{dist.get_rank()}"] = rng.pack(rng.capture(model.device))
    writer = ChecksumWriter(partial)
    try:  # DCP agrees on its own outcome: a failure on any rank is raised on all of them
        with Progress(f"fz3.save({path!r})") as progress:  # one line on rank 0 when long
            dcp.save(flat, storage_writer=writer, process_group=group)
            progress.done = _nbytes(flat)
    except (Exception, CheckpointException) as e:
        failure = save_failure(group, path, "writing the data", e)
        drop_partial()
        raise failure from e
    # [Note: committing a save]: fz3.json, then the swap, each agreed by every rank
    keys = [k for k in flat if not k.startswith("rng.")]

    def write_meta() -> None:
        if writer.checksums is None:
            raise RuntimeError("DCP's coordinator recorded no checksums on this rank (fz3 took "
                               "another rank for the coordinator): a bug, please report it")
        meta = {**describe(model, keys), "save": save_id,
                "checksums": checksums_of(partial, writer.checksums)}
        write_durably(os.path.join(partial, META), meta_text(meta))
        fsync_dir(partial)

    agree(group, path, f"writing {META}", attempt(write_meta) if rank0 else None, drop_partial)
    agree(group, path, "moving the checkpoint into place",
          attempt(lambda: swap_in(folder, partial, save_id)) if rank0 else None, drop_partial)


def load(path: str | os.PathLike, model: ShardedModel, template: Any, *, restore_rng: bool = True,
         timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """Read a checkpoint into a new state shaped like ``template`` (built for this model and
    world size, e.g. ``{"params": params, "opt": opt.init(params), "step": 0}``), checking
    every byte read against the checksums recorded at save.

    Every rank reads the same checkpoint or none does ([Note: one checkpoint for every rank]
    in ``agreement.py``). A symlink is followed; fz3's marked backup ``path.old`` is read only
    when a save crashed mid-swap.

    **Collective**: every rank calls it (``timeout`` as in ``save``). Raises, on every rank:
    ``FileNotFoundError`` (no checkpoint), ``fz3.CheckpointDamagedError`` (a ``ValueError``:
    missing, truncated or changed bytes, naming the file, the item and the rank that read it),
    ``ValueError`` (another model, a template that does not fit),
    ``fz3.CheckpointMismatchError`` (ranks found different checkpoints, or it changed while
    loading)."""
    path = os.path.normpath(os.fspath(path))
    refuse_destroyed(model.comm, "fz3.load")
    arrive(_everyone(model), "fz3.load", timeout, model.comm.heartbeat)
    try:
        return _load(path, model, template, restore_rng)
    except BaseException as e:
        if is_interrupt(e):
            record_interrupt(e, f"fz3.load({path!r})")
        raise


def _load(path: str, model: ShardedModel, template: Any, restore_rng: bool) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .dcp_io import VerifyingReader

    group = _everyone(model)
    flat = _flatten(model, template, "", for_load=True)
    found, plan = look(path, model, flat)
    agree_found(group, path, found)
    assert plan is not None  # agree_found raised this rank's error otherwise
    where, meta = found.source, plan.meta
    rng_key = f"rng.rank{dist.get_rank()}"
    # ranks beyond the saved job keep their RNG state
    with_rng = restore_rng and dist.get_rank() < meta["ranks"]
    if with_rng:
        flat[rng_key] = rng.pack(rng.capture(model.device))
    reader = (dcp.FileSystemReader(where) if plan.sums is None
              else VerifyingReader(where, plan.sums, dist.get_rank()))
    try:
        with Progress(f"fz3.load({path!r})") as progress:  # one line on rank 0 when long
            dcp.load(flat, storage_reader=reader, process_group=group)
            progress.done = _nbytes(flat)
    except (Exception, CheckpointException) as e:  # DCP raises every rank's failure on all of them
        failed = failures_of(e)
        if failed is None:  # a collective broke: a rank is gone
            raise lost_error(group or dist.group.WORLD, f"fz3.load({path!r})", e) from e
        agree_unchanged(group, path, found, identity_now(where))  # a writer's swap, not damage
        if any(is_interrupt(x) for x in failed.values()):
            raise interrupt_failure(f"fz3.load({path!r})", failed) from e
        raise load_failure(where, failed) from e
    agree_unchanged(group, path, found, identity_now(where))
    if with_rng:
        rng.restore(rng.unpack(flat.pop(rng_key), model.device), model.device)
    return _unflatten(model, template, flat, "")


def _flatten(model: ShardedModel, x: Any, key: str, for_load: bool = False) -> dict[str, Any]:
    if not for_load:
        _refuse_donated(model, x, key)
    if isinstance(x, Rest):  # loaded into the full shards' shape, compacted by _unflatten
        x = expand(model, x)
    if isinstance(x, Params):
        return {f"{key}{part.name}": _dtensor(model, part.layout, t.reshape(part.rows, -1),
                                              for_load)
                for part, t in zip(model.parts, x.parts) if t is not None}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return _merge(model, zip(x._fields, x), key, for_load)
    if isinstance(x, dict):
        return _merge(model, x.items(), key, for_load)
    if isinstance(x, (list, tuple)):
        return _merge(model, enumerate(x), key, for_load)
    name = key.rstrip(".") or "state"
    return {name: x.clone() if for_load and isinstance(x, torch.Tensor) else x}


def _refuse_donated(model: ShardedModel, x: Any, key: str) -> None:
    """Params-shaped trees only (params, moments): a shard is never empty there, while a
    plain empty tensor elsewhere in the state is a legitimate value."""
    if not isinstance(x, (Params, Rest)):
        return
    for name, t in ((f"{key}{p.name}", t) for p, t in zip(model.parts, x.parts)):
        if is_donated(t):
            raise ValueError(f"fz3.save: state[{name!r}] was donated to fz3.optim.step(..., "
                             f"donate=True), which updated its buffers in place and returned new "
                             f"ones: save what it returned (params, opt_state = "
                             f"fz3.optim.step(opt, grads, opt_state, params, donate=True)). "
                             f"Nothing was written; the checkpoint at the path is untouched")


def _merge(model: ShardedModel, items, key: str, for_load: bool) -> dict[str, Any]:
    """``_flatten`` of each ``(field, item)``, keys prefixed ``key + field + "."``, merged."""
    return {k: v for f, item in items
            for k, v in _flatten(model, item, f"{key}{f}.", for_load).items()}


def _unflatten(model: ShardedModel, x: Any, flat: dict[str, Any], key: str) -> Any:
    if isinstance(x, Rest):
        return rest_of(model, _unflatten(model, expand(model, x), flat, key))
    if isinstance(x, Params):
        return Params(tuple(None if t is None
                            else _local(part.layout, flat[f"{key}{part.name}"]).reshape(t.shape)
                            for part, t in zip(model.parts, x.parts)))
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_unflatten(model, item, flat, f"{key}{f}.")
                         for f, item in zip(x._fields, x)))
    if isinstance(x, dict):
        return {f: _unflatten(model, item, flat, f"{key}{f}.") for f, item in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_unflatten(model, item, flat, f"{key}{i}.") for i, item in enumerate(x))
    return flat[key.rstrip(".") or "state"]


def _dtensor(model: ShardedModel, layout: FlatLayout, shards: torch.Tensor, for_load: bool):
    """(rows, shard) padded shards -> a DTensor over the unpadded (rows, numel), sharded on
    dim 1."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    real = _real(layout, model.rank)
    if for_load:
        local = torch.empty(shards.shape[0], real, dtype=shards.dtype, device=shards.device)
    else:
        local = shards[:, :real].contiguous()
    if model.mesh is not None and model.mesh.ndim == 2:  # hybrid: same shards in every row
        mesh, placements = model.mesh, [Replicate(), Shard(1)]
    else:
        mesh = DeviceMesh.from_group(model.comm.group, device_type=model.device.type)
        placements = [Shard(1)]
    shape = torch.Size([shards.shape[0], layout.numel])
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=(layout.numel, 1))


def _local(layout: FlatLayout, t: Any) -> torch.Tensor:
    """The DTensor's local chunk, padded back to (rows, shard) with zeros."""
    local = t.to_local()
    out = torch.zeros(local.shape[0], layout.shard_numel, dtype=local.dtype, device=local.device)
    out[:, : local.shape[1]] = local
    return out


def _real(layout: FlatLayout, rank: int) -> int:
    """Elements of rank's shard that are parameters, not padding (torch.chunk's split)."""
    return max(0, min(layout.shard_numel, layout.numel - rank * layout.shard_numel))


def _everyone(model: ShardedModel) -> dist.ProcessGroup | None:
    """The group that writes a checkpoint: the shard group, or every rank with hybrid sharding."""
    return model.comm.group if model.comm.replicas == 1 else None


def _nbytes(flat: dict[str, Any]) -> int:
    """This rank's tensor bytes in a flattened state (for the progress line)."""
    return sum(t.numel() * t.element_size() for t in flat.values() if isinstance(t, torch.Tensor))
