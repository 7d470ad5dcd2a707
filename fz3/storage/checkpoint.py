"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), reshardable.

``fz3.save(path, model, state)`` writes any pytree of training state: ``Params``-shaped
nodes (params, AdamW moments, gradients) as DTensors, replicated tensors (a step count),
plain Python values (a loss-scale state) and, automatically, every rank's RNG state. Each
rank writes only its own shards; nothing is gathered.

Each unit's flat shard is a DTensor over the *unpadded* flat parameter vector, sharded on
its last dimension: rank r's real elements are exactly ``torch.chunk``'s r-th chunk (fz3 pads
only at the end), so DCP knows every element's global offset and a checkpoint written at
world size 4 loads at 2 or 3, and back.

Nothing is lost on a crash: a save writes ``path.partial`` and renames it into place only
when every rank has finished; the previous checkpoint moves to ``path.old`` for the moment
of the swap, and ``load`` falls back to it if ``path`` is missing. ``path/fz3.json``
describes the model; loading a checkpoint of another model or a missing or damaged one
raises a ``ValueError`` naming the file and what differs, on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from .. import rng
from ..comm.arrival import DEFAULT_TIMEOUT_S, arrive
from ..sharding.layout import FlatLayout
from ..sharding.model import Params, ShardedModel
from .verify import META, check_model, check_template, describe, read_meta

# torch.distributed.checkpoint and DTensor are imported where used: they take over a second
# to import, which every process importing fz3 would otherwise pay.


def save(path: str, model: ShardedModel, state: Any, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Write ``state`` (a pytree: dicts, lists, NamedTuples, ``Params``, tensors, values) to
    ``path``.

    Collective: every rank calls it. A rank that does not within ``timeout`` seconds makes the
    others raise ``fz3.CollectiveMismatchError`` naming it, before anything is written."""
    import torch.distributed.checkpoint as dcp

    partial, old = path + ".partial", path + ".old"
    if dist.get_rank() == 0:  # a stale partial (an interrupted save); arrive is the barrier
        shutil.rmtree(partial, ignore_errors=True)
    arrive(_everyone(model), "fz3.save", timeout)
    flat = _flatten(model, state, "")
    flat[f"rng.rank{dist.get_rank()}"] = rng.pack(rng.capture(model.device))
    dcp.save(flat, checkpoint_id=partial, process_group=_everyone(model))
    # DCP's save returns on the coordinator only after every rank has written
    if dist.get_rank() == 0:
        with open(os.path.join(partial, META), "w") as f:
            json.dump(describe(model, [k for k in flat if not k.startswith("rng.")]), f, indent=1)
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    arrive(_everyone(model), "fz3.save's rename", timeout)  # no rank returns before it is done


def load(path: str, model: ShardedModel, template: Any, *, restore_rng: bool = True,
         timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """Read a checkpoint into a new state shaped like ``template`` (built for this model and
    world size, e.g. ``{"params": params, "opt": opt.init(params), "step": 0}``).

    Collective: every rank calls it (``timeout`` as in ``save``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    arrive(_everyone(model), "fz3.load", timeout)
    path = path if os.path.isdir(path) or not os.path.isdir(path + ".old") else path + ".old"
    meta, saved = read_meta(path)
    check_model(path, meta, model)
    flat = _flatten(model, template, "", for_load=True)
    check_template(path, meta, saved, flat, model)
    rng_key = f"rng.rank{dist.get_rank()}"
    # ranks beyond the saved job keep their RNG state
    with_rng = restore_rng and dist.get_rank() < meta["ranks"]
    if with_rng:
        flat[rng_key] = rng.pack(rng.capture(model.device))
    try:
        dcp.load(flat, checkpoint_id=path, process_group=_everyone(model))
    except (Exception, CheckpointException) as e:  # DCP raises every rank's failure on all of them
        raise ValueError(f"checkpoint {path} is damaged inside a file, or the storage failed: its "
                         f"files have their full length and fit the model and the template, yet "
                         f"reading them failed: {str(e)[:2000]}") from e
    if with_rng:
        rng.restore(rng.unpack(flat.pop(rng_key), model.device), model.device)
    return _unflatten(model, template, flat, "")


def _flatten(model: ShardedModel, x: Any, key: str, for_load: bool = False) -> dict[str, Any]:
    if isinstance(x, Params):
        return {f"{key}{part.name}": _dtensor(model, part.layout, t.reshape(part.rows, -1),
                                              for_load)
                for part, t in zip(model.parts, x.parts)}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return _merge(model, zip(x._fields, x), key, for_load)
    if isinstance(x, dict):
        return _merge(model, x.items(), key, for_load)
    if isinstance(x, (list, tuple)):
        return _merge(model, enumerate(x), key, for_load)
    name = key.rstrip(".") or "state"
    return {name: x.clone() if for_load and isinstance(x, torch.Tensor) else x}


def _merge(model: ShardedModel, items, key: str, for_load: bool) -> dict[str, Any]:
    """``_flatten`` of each ``(field, item)``, keys prefixed ``key + field + "."``, merged."""
    return {k: v for f, item in items
            for k, v in _flatten(model, item, f"{key}{f}.", for_load).items()}


def _unflatten(model: ShardedModel, x: Any, flat: dict[str, Any], key: str) -> Any:
    if isinstance(x, Params):
        return Params(tuple(_local(part.layout, flat[f"{key}{part.name}"]).reshape(t.shape)
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

