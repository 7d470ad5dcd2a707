"""Every rank reads the same checkpoint and writes one state: what each rank found at a path,
or holds under a key, agreed in one small collective (``gather_objects``) before a load's
read or a save's write, and again after a load's read.

[Note: one checkpoint for every rank]
Each rank resolves the path itself (``owned.resolve``: symlinks followed, a relative path read
against its own working directory) and looks: the checkpoint it would read (the folder, or
its marked backup ``folder.old``) and its identity (``fz3.json``'s save id and CRC:
``verify.identity``), or the error it met. One all-gather of these small records, then on
every rank alike: go when every rank found the same checkpoint; the rank's own error when
every rank met the same one (``FileNotFoundError``: nothing there); else
``CheckpointMismatchError`` naming each rank and what it saw. After DCP's read each rank looks
at the identity again and the ranks agree once more: a checkpoint replaced during the read (a
writer's swap between the first look and a rank's read) raises "changed while loading" on
every rank, whatever the read itself met. So a reader racing a writer gets the old or the
new checkpoint whole on every rank, or that error: never a mix, never one rank in DCP's read
while another raised. Cost: two all-gathers of a few hundred bytes per load.
"""

from __future__ import annotations

import json
import os
import pickle
import zlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..comm.failures import gather_objects, lost_error
from ..sharding.model import ShardedModel
from .errors import CheckpointError, CheckpointMismatchError
from .owned import resolve
from .verify import (META, check_model, check_template, identity, read_meta,
                     recorded_checksums, source)


class Found(NamedTuple):
    """What one rank found at a checkpoint path."""

    folder: str  # the path resolved: absolute, symlinks followed
    source: str  # the folder it would read: ``folder`` or its marked backup ``folder.old``
    identity: str  # verify.identity of its fz3.json ("" with an error)
    error: BaseException | None  # what stopped this rank before reading


def _gather(group: dist.ProcessGroup | None, what: str, mine: Any) -> list[Any]:
    group = group or dist.group.WORLD
    try:
        return gather_objects(group, mine)
    except RuntimeError as e:
        raise lost_error(group, what, e) from e


def agree_found(group: dist.ProcessGroup | None, path: str, found: Found) -> None:
    """Raise on every rank unless every rank found the same checkpoint (see [Note: one
    checkpoint for every rank]). **Collective** over ``group`` (None: every rank)."""
    rows: list[Found] = _gather(group, f"fz3.load({path!r})", found)
    folders = {f.folder for f in rows}
    if len(folders) > 1:
        shown = ", ".join(f"rank {r}: {f.folder}" for r, f in enumerate(rows))
        raise CheckpointMismatchError(
            f"fz3.load({path!r}): the ranks resolved the path to different folders ({shown}): "
            f"started from different working directories with a relative path? Pass an "
            f"absolute path", path, list(range(len(rows))))
    errors = {(type(f.error), str(f.error)) for f in rows}
    if found.error is not None and len(errors) == 1:
        raise found.error  # the same on every rank (nothing there, damage, another model)
    if len(errors) == 1 and len({(f.source, f.identity) for f in rows}) == 1:
        return
    shown = "; ".join(f"rank {r}: {_seen(f)}" for r, f in enumerate(rows))
    raise CheckpointMismatchError(
        f"fz3.load({path!r}): the ranks did not all find the same checkpoint ({shown}). Nothing "
        f"was loaded: every rank must see one checkpoint at the path (node-local copies that "
        f"differ? another job saving here?)", path,
        [r for r, f in enumerate(rows) if (f.source, f.identity, f.error) !=
         (rows[0].source, rows[0].identity, rows[0].error)])


def _seen(f: Found) -> str:
    if f.error is not None:
        return f"{type(f.error).__name__}: {str(f.error)[:300]}"
    return f"checkpoint {f.identity} in {f.source}"


def agree_unchanged(group: dist.ProcessGroup | None, path: str, found: Found, now: str) -> None:
    """After the read: raise on every rank if any rank finds another checkpoint at
    ``found.source`` now (``now``: its identity, or what stopped it reading it).
    **Collective** over ``group``."""
    rows: list[str] = _gather(group, f"fz3.load({path!r})", now)
    changed = {r: n for r, n in enumerate(rows) if n != found.identity}
    if changed:
        shown = "; ".join(f"rank {r}: {n}" for r, n in changed.items())
        raise CheckpointMismatchError(
            f"fz3.load({path!r}): checkpoint {found.source} changed while loading (another job "
            f"saving here?): every rank found {found.identity} before the read, and after it "
            f"{shown}. Nothing was loaded: load again", path, sorted(changed))


class Plan(NamedTuple):
    """What a rank found it will read (``look``)."""

    found: Found
    meta: dict
    sums: Any  # recorded_checksums


def look(path: str, model: ShardedModel, flat: dict[str, Any]) -> tuple[Found, Plan | None]:
    """What this rank finds at ``path``: the checkpoint it would read into ``flat`` and its
    identity, or the error it meets (no collective)."""
    folder = resolve(path)
    try:
        where = source(folder)
        meta, saved = read_meta(where)
        check_model(where, meta, model)
        check_template(where, meta, saved, flat, model)
        sums = recorded_checksums(where, meta, warn=model.is_root)
    except Exception as e:  # noqa: BLE001 - every rank hears of every rank's error
        return Found(folder, "", "", e), None
    found = Found(folder, where, identity(meta), None)
    return found, Plan(found, meta, sums)


def identity_now(folder: str) -> str:
    """The identity of the checkpoint in ``folder`` now, or what stops reading it."""
    try:
        with open(os.path.join(folder, META)) as f:
            return identity(json.load(f))
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


# --- a save: one folder, and one value under each key -------------------------------------------

_PLAIN = (int, float, bool, str, bytes, complex, type(None))


def value_digests(flat: dict[str, Any]) -> dict[str, str | None]:
    """Each value of a save's flattened state that DCP writes once for every rank (a plain
    tensor or a Python value: not a sharded DTensor) as a short comparable text; None for an
    object fz3 compares only when another rank holds the same key (``pickled_digests``)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, str | None] = {}
    for key, v in flat.items():
        if isinstance(v, DTensor):
            continue
        if isinstance(v, torch.Tensor):
            data = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[key] = f"tensor {list(v.shape)} {v.dtype} crc32 {zlib.crc32(data):08x}"
        elif type(v) in _PLAIN:
            text = repr(v)
            crc = zlib.crc32(text.encode())
            out[key] = text if len(text) <= 60 else f"{text[:50]}... crc32 {crc:08x}"
        else:
            out[key] = None
    return out


def pickled_digests(flat: dict[str, Any], keys: list[str]) -> dict[str, str]:
    """``keys``' values as ``type, crc32 of their pickle`` (what DCP would write)."""
    out = {}
    for key in keys:
        try:
            out[key] = f"{type(flat[key]).__name__} crc32 {zlib.crc32(pickle.dumps(flat[key])):08x}"
        except Exception as e:  # noqa: BLE001 - DCP will meet it too: compare the failure
            out[key] = f"{type(flat[key]).__name__} (cannot be pickled: {e})"
    return out


class Start(NamedTuple):
    """One rank's view before a save writes anything."""

    folder: str  # the path resolved
    refused: str | None  # rank 0: why the path may not be written (owned.refusal, a claim)
    failed: str | None  # rank 0: a failure claiming it (an OSError's cause)
    values: dict[str, str | None]  # value_digests


def agree_start(group: dist.ProcessGroup | None, path: str, start: Start,
                flat: dict[str, Any]) -> None:
    """Raise the same error on every rank unless every rank resolved ``path`` to the same
    folder, rank 0 claimed it, and every key held by several ranks holds one value.
    **Collective** over ``group`` (a second small all-gather only when ranks hold objects
    under one key that only their pickles can compare)."""
    what = f"fz3.save({path!r})"
    rows: list[Start] = _gather(group, what, start)
    if len({s.folder for s in rows}) > 1:
        shown = ", ".join(f"rank {r}: {s.folder}" for r, s in enumerate(rows))
        raise ValueError(f"{what}: the ranks resolved the path to different folders ({shown}): "
                         f"started from different working directories with a relative path? "
                         f"Pass an absolute path. Nothing was written")
    if rows[0].refused is not None:
        raise FileExistsError(f"{what} refused: {rows[0].refused}. Nothing was written")
    if rows[0].failed is not None:
        raise CheckpointError(f"{what} failed claiming the path on rank(s) [0]: {rows[0].failed}"
                              f". Nothing was written; fix the path or its permissions", path, [0])
    held: dict[str, list[int]] = {}
    for r, s in enumerate(rows):
        for key in s.values:
            held.setdefault(key, []).append(r)
    shared = sorted(k for k, ranks in held.items() if len(ranks) > 1)
    digests = [{k: s.values[k] for k in shared if k in s.values} for s in rows]
    opaque = [k for k in shared if all(d.get(k, "") is None for d in digests)]
    if opaque:  # objects under one key on several ranks: compare what DCP would write
        pickled = _gather(group, what, pickled_digests(flat, [k for k in opaque if k in flat]))
        for d, p in zip(digests, pickled):
            d.update(p)
    for key in shared:
        values = {r: digests[r][key] for r in held[key]}
        if len(set(values.values())) > 1:
            shown = "; ".join(f"rank {r}: {v if v is not None else 'an object'}"
                              for r, v in values.items())
            raise ValueError(
                f"{what}: state[{key!r}] differs between ranks ({shown}); a checkpoint holds one "
                f"value per key, so all but one rank's would be lost. Save a per-rank value under "
                f"a key per rank ({{f'{key}.rank{{rank}}': value}}, and the same key in the "
                f"template), or make it equal on every rank. Nothing was written")
