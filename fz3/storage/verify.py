"""What ``fz3.load`` refuses before it reads a byte of data, on every rank alike, each with
the file or key and what differs: a damaged checkpoint (missing, truncated or unreadable
files, a ``fz3.json`` or ``.metadata`` that changed since the save), one saved from another
model, and a template that does not fit what was saved (another structure, shape, dtype, or a
device that is not the model's); and ``fz3.verify_checkpoint``, which checks every byte of a
checkpoint against its checksums offline.

Told apart because the fixes differ: a damaged checkpoint (``CheckpointDamagedError``, a
``ValueError`` too) needs the previous one; another model's needs another path; a wrong
template needs building like the saved state. DCP would report the last as a read failure, or
worse, silently cast a float64 or meta template.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..compare import first_difference
from ..sharding.model import ShardedModel
from .checksums import (ALGORITHM, checksum_table, crc_of_bytes, crc_of_range, damage_message,
                        mismatches)
from .errors import CheckpointDamagedError
from .owned import META, backup_of, resolve

DCP_META = ".metadata"

log = logging.getLogger(__name__)


def source(folder: str) -> str:
    """The folder a load of ``folder`` reads: ``folder``, or fz3's marked backup of it when a
    save crashed between its renames (``owned.py``); ``FileNotFoundError`` if neither."""
    if os.path.isdir(folder):
        return folder
    old = folder + ".old"
    if backup_of(old, folder) is not None and not os.path.lexists(folder):
        return old
    beside = (f"; {old} exists but is not fz3's backup of it (no mark): to load it, name it"
              if os.path.lexists(old) else "")
    what = "a file, not a checkpoint folder" if os.path.lexists(folder) else "nothing"
    raise FileNotFoundError(f"no checkpoint at {folder}: {what} is there{beside}. Check the "
                            f"path, or save one first")


def describe(model: ShardedModel, keys: list[str]) -> dict:
    """What ``path/fz3.json`` says about the model a checkpoint was saved from: its parts and
    their trained parameters (what a checkpoint holds; frozen ones are the model's)."""
    parts = [{"name": p.name, "role": p.role.value, "rows": p.rows,
              "slots": [[list(s.names), list(s.shape)] for s in p.layout.slots]}
             for p in model.parts]
    return {"world_size": model.world_size, "ranks": dist.get_world_size(), "parts": parts,
            "keys": keys}


def meta_text(meta: dict) -> str:
    """``fz3.json``'s text: ``meta`` with a CRC-32 of itself, which ``read_meta`` checks."""
    meta = {k: v for k, v in meta.items() if k != "crc32"}
    return json.dumps({**meta, "crc32": _self_crc(meta)}, indent=1)


def identity(meta: dict) -> str:
    """Which checkpoint ``fz3.json`` describes: its save's id (none before ids were recorded)
    and the CRC-32 of its content (which holds every storage item's CRC-32)."""
    rest = {k: v for k, v in meta.items() if k != "crc32"}
    return f"save {meta.get('save', '?')} crc32 {_self_crc(rest):08x}"


def _self_crc(meta: dict) -> int:
    return crc_of_bytes(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())


def checksums_of(path: str, checksums: list[list[Any]]) -> dict:
    """``fz3.json``'s ``checksums`` entry: every storage item's CRC-32 and the ``.metadata``
    file's (written before this is)."""
    meta_file = os.path.join(path, DCP_META)
    return {"algorithm": ALGORITHM, "items": checksums,
            "metadata": crc_of_range(meta_file, 0, os.path.getsize(meta_file))}


def read_meta(path: str) -> tuple[dict, Any]:
    """``(fz3.json, DCP's Metadata)``, once every file the checkpoint needs is there in full."""
    import torch.distributed.checkpoint as dcp

    file = os.path.join(path, META)
    for needed in (file, os.path.join(path, ".metadata")):
        if not os.path.isfile(needed):
            raise CheckpointDamagedError(f"checkpoint {path} is incomplete: {needed} is missing "
                                         f"(an interrupted save?)", path)
    try:
        with open(file) as f:
            meta = json.load(f)
        _check_metadata_sums(path, meta)  # before unpickling: a damaged pickle can do anything
        saved = dcp.FileSystemReader(path).read_metadata()
    except CheckpointDamagedError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoding failure of the two metadata files
        raise CheckpointDamagedError(f"checkpoint {path} is damaged: its metadata ({META}, "
                                     f".metadata) cannot be read: {type(e).__name__}: {e}",
                                     path) from e
    # Every data file DCP's metadata refers to must be there, long enough: a damaged or
    # truncated checkpoint is named here, on every rank, before any rank starts reading.
    need: dict[str, int] = {}
    for info in saved.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        data = os.path.join(path, rel)
        have = os.path.getsize(data) if os.path.isfile(data) else -1
        if have < size:
            state = "is missing" if have < 0 else f"has {have} bytes, {size} expected (truncated)"
            raise CheckpointDamagedError(f"checkpoint {path} is damaged: {data} {state}", path)
    return meta, saved


def _check_metadata_sums(path: str, meta: dict) -> None:
    """``fz3.json`` and ``.metadata`` are the bytes the save wrote (when it recorded sums)."""
    rest = {k: v for k, v in meta.items() if k != "crc32"}
    if ("crc32" in meta) != ("checksums" in meta):  # one flipped bit in a key's name
        raise CheckpointDamagedError(f"checkpoint {path} is damaged: {os.path.join(path, META)} "
                                     f"has one of 'crc32' and 'checksums' without the other",
                                     path)
    if "crc32" in meta and _self_crc(rest) != meta["crc32"]:
        raise CheckpointDamagedError(f"checkpoint {path} is damaged: {os.path.join(path, META)} "
                                     f"changed after the save (its crc32 does not match)", path)
    sums = meta.get("checksums")
    if sums is None:
        return
    if sums.get("algorithm") != ALGORITHM:
        raise CheckpointDamagedError(f"checkpoint {path}: its checksums are "
                                     f"{sums.get('algorithm')!r}, which this fz3 cannot check (it "
                                     f"knows {ALGORITHM!r}): load it with the fz3 that saved it",
                                     path)
    file = os.path.join(path, DCP_META)
    if crc_of_range(file, 0, os.path.getsize(file)) != sums["metadata"]:
        raise CheckpointDamagedError(f"checkpoint {path} is damaged: {file} changed after the save "
                                     f"(its crc32 does not match the one in {META})", path)


def recorded_checksums(path: str, meta: dict, warn: bool = True) -> dict | None:
    """The ``{(file, offset, length): crc}`` a checkpoint recorded, or None (with one log line
    where ``warn``) for a checkpoint saved before fz3 recorded them: it loads, unverified."""
    if "checksums" not in meta:
        if warn:
            log.warning("fz3: checkpoint %s has no checksums (saved by an fz3 before they were "
                        "recorded): its bytes cannot be verified", path)
        return None
    return checksum_table(meta["checksums"])


class CheckpointReport(NamedTuple):
    """What ``fz3.verify_checkpoint`` checked."""

    path: str
    files: int  # data files (.distcp)
    items: int  # storage items, each checked whole
    bytes: int  # data bytes checked
    verified: bool  # False: the checkpoint predates checksums; nothing could be checked


def verify_checkpoint(path: str) -> CheckpointReport:
    """Check every byte of the checkpoint at ``path`` against the checksums its save recorded,
    offline: no model, no process group (not collective). Raises ``CheckpointDamagedError``
    naming every damaged item (file, byte range, key) and ``FileNotFoundError`` if there is no
    checkpoint; a checkpoint saved before checksums gives ``verified=False`` and one log line."""
    path = source(resolve(path))  # as load: fz3's marked backup after a crash mid-swap
    meta, saved = read_meta(path)
    spans = {(info.relative_path, info.offset, info.length): index.fqn
             for index, info in saved.storage_data.items()}
    files = len({rel for rel, _, _ in spans})
    size = sum(length for _, _, length in spans)
    table = recorded_checksums(path, meta)
    if table is None:
        return CheckpointReport(path, files, len(spans), 0, False)
    bad = mismatches(path, spans, table)
    if bad:
        raise CheckpointDamagedError(damage_message(path, bad, "it has"), path)
    return CheckpointReport(path, files, len(spans), size, True)


def check_model(path: str, meta: dict, model: ShardedModel) -> None:
    where = os.path.join(path, META)
    if "parts" not in meta:
        raise ValueError(f"checkpoint {path} was written by an fz3 before the unit list (an outer "
                         f"unit and one layer stack); this fz3 cannot read that layout: export the "
                         f"weights with that version (fz3.export) and shard the module again "
                         f"({where})")
    mine = describe(model, [])["parts"]
    _check_placement(path, meta["parts"], mine)
    diff = first_difference([(p["name"], p["role"], p["rows"]) for p in meta["parts"]],
                            [(p["name"], p["role"], p["rows"]) for p in mine])
    if diff is not None:
        i, there, here = diff
        raise ValueError(f"checkpoint {path} has other parts than the model: part #{i} is "
                         f"{_part(there)} there and {_part(here)} here ({where})")
    for theirs, ours in zip(meta["parts"], mine):
        diff = first_difference(theirs["slots"], ours["slots"])
        if diff is not None:
            i, there, here = diff
            raise ValueError(f"checkpoint {path} was saved from another model: part "
                             f"{theirs['name']} parameter #{i} is {_slot(there)} there and "
                             f"{_slot(here)} here ({where})")


def _check_placement(path: str, theirs: list[dict], mine: list[dict]) -> None:
    """Parameters outside the stacks that sit in another part here than in the checkpoint
    (placed by use with ``example=``, or another ``assign=``): named, with the ``assign=``
    that shards the model as the checkpoint was saved."""
    def part_of(parts: list[dict]) -> dict[str, str]:
        return {names[0]: p["name"] for p in parts if p["role"] != "stack"
                for names, _ in p["slots"]}

    there, here = part_of(theirs), part_of(mine)
    moved = sorted(n for n in there.keys() & here.keys() if there[n] != here[n]
                   and not there[n].startswith("tied:") and not here[n].startswith("tied:"))
    if moved:
        shown = ", ".join(f"{n} ({there[n]} there, {here[n]} here)" for n in moved[:8])
        assign = {n: there[n] for n in moved}
        raise ValueError(f"checkpoint {path} holds {len(moved)} parameter(s) in another part than "
                         f"this model: {shown}. Shard the model as it was saved "
                         f"(fz3.shard(..., assign={assign!r}), without example=), load, and carry "
                         f"the weights over with fz3.export; or train on from the old placement "
                         f"({os.path.join(path, META)})")


def _part(p) -> str:
    return "nothing" if p is None else f"{p[0]} ({p[1]}, {p[2]} rows)"


def check_template(path: str, meta: dict, saved: Any, flat: dict[str, Any],
                   model: ShardedModel) -> None:
    """Every key of the flattened template exists in the checkpoint with the same kind
    (tensor or value), shape and dtype, and its tensors can hold data on the model's device."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    missing = sorted(set(flat) - set(saved.state_dict_metadata))
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} has no {missing[:5]}{more}; it holds "
                         f"{meta['keys'][:8]}: build the template with the same structure as the "
                         f"saved state")
    fix = "build the template like the saved state (from this model's params and opt.init(params))"
    for key, value in flat.items():
        md = saved.state_dict_metadata[key]
        is_tensor = isinstance(value, torch.Tensor)
        if isinstance(md, TensorStorageMetadata) != is_tensor:
            there = "a tensor" if isinstance(md, TensorStorageMetadata) else "a Python value"
            raise ValueError(f"checkpoint {path} does not fit the template: {key} is {there} there "
                             f"and of type {type(value).__name__} in the template; {fix}")
        if not is_tensor:
            continue
        there, here = (list(md.size), md.properties.dtype), (list(value.shape), value.dtype)
        if there != here:
            raise ValueError(f"checkpoint {path} does not fit the template: {key} is "
                             f"{_tensor(*there)} there and {_tensor(*here)} in the template; {fix}")
        device = value.to_local().device if isinstance(value, DTensor) else value.device
        sharded = isinstance(value, DTensor)
        if device.type == "meta" or (sharded and device != model.device):
            want = f"the model's device {model.device}" if sharded else "a real device"
            raise ValueError(f"checkpoint {path}: the template's {key} is on {device}, not on "
                             f"{want}; {fix}")


def _tensor(size: list[int], dtype: torch.dtype) -> str:
    return f"{size} {str(dtype).removeprefix('torch.')}"


def _slot(s) -> str:
    return "nothing" if s is None else f"{s[0][0]} {s[1]}"
