"""Export consolidated weights with the original module's names, one unit at a time.

``fz3.export(path, model, params)`` gathers one unit (the outer unit, then each layer)
into one reused buffer, rank 0 writes it to its own file and drops its host copy before
the next: the extra memory is one unit (two on rank 0, with the host copy), never the
whole model. The files follow Hugging Face's sharded layout
(``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``; with
``format="torch"`` or without safetensors installed, ``pytorch_model-*.bin`` and its
index), so ``from_pretrained(path)`` reads an exported HF model (its ``config.json`` is
written too); ``fz3.read_export(path)`` returns a state dict for
``load_state_dict(strict=True)``.

Tied parameters are stored once, under their first name; the index's ``fz3_aliases``
records the other names.
"""

from __future__ import annotations

import json
import os
from typing import Literal, NamedTuple, Protocol

import torch

from ..comm.arrival import DEFAULT_TIMEOUT_S, arrive
from ..comm.groups import refuse_destroyed
from ..comm.progress import Progress
from ..sharding.model import Params, ShardedModel
from ..sharding.params import check_tree
from .gather import Gathered, own_buffers, unit_shards


class ExportReport(NamedTuple):
    files: list[str]  # written by rank 0 (empty on other ranks)
    peak_bytes: int  # the most this rank held at once: one gathered unit (+ host copies on rank 0)
    model_bytes: int  # the whole model, for comparison


class Rewrite(Protocol):
    """How an export's tensors become another model's (a PEFT model's, as its base model with
    LoRA merged: ``fz3.hf.peft_merge``): built before any collective, so it refuses on every
    rank."""

    def name(self, name: str) -> str | None:
        """The written name of a tensor's name (None: not written under its own name)."""

    def take(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One unit's tensors in; what to write now out (it may hold some for a later unit)."""

    def finish(self) -> None:
        """Every tensor taken was handed back (raises otherwise)."""


def export(path: str | os.PathLike, model: ShardedModel, params: Params, *,
           format: Literal["safetensors", "torch"] | None = None,
           timeout: float = DEFAULT_TIMEOUT_S, rewrite: Rewrite | None = None) -> ExportReport:
    """Write the consolidated weights (and persistent buffers) under ``path``; ``rewrite``
    (``fz3.export`` passes one for a PEFT model) renames and merges them.

    **Collective**: one all-gather per unit; every rank calls it. A rank of the sharding group
    that does not within ``timeout`` seconds makes the others raise
    ``fz3.CollectiveMismatchError`` naming it, before ``path`` is created."""
    path = os.path.normpath(os.fspath(path))
    refuse_destroyed(model.comm, "fz3.export")
    check_tree(model, params, "params")
    arrive(model.comm.group, "fz3.export", timeout, model.comm.heartbeat)
    fmt = format or ("safetensors" if _has_safetensors() else "torch")
    rank0 = model.is_root
    units = unit_shards(model, params, frozen=True)
    n = len(units)
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if rank0:
        os.makedirs(path, exist_ok=True)
    weight_map, aliases, files, peak, total = {}, {}, [], 0, 0
    gathered_units = Gathered(model, units)
    # No enumerate: it keeps its last result tuple (this unit's copies) until the next unit's
    # gather has run. Comprehensions below: no loop variable outlives the unit either.
    k = -1
    progress = Progress(f"fz3.export({path!r})", model.numel * 4)  # rank 0 writes, when long
    for unit, gathered in gathered_units:
        k += 1
        held = gathered_units.buffer_bytes
        if rank0:
            tensors = {unit.prefix + s.name: t for s, t in gathered}
            aliases.update({unit.prefix + alias: unit.prefix + s.name for s, _ in gathered
                            for alias in s.names[1:]})
            if k == 0:
                tensors.update(own_buffers(model))
            tensors = tensors if rewrite is None else rewrite.take(tensors)
            written = sum(t.numel() * t.element_size() for t in tensors.values())
            held += written
            name = f"{stem}-{k + 1:05d}-of-{n:05d}.{ext}"
            if tensors:
                _write(os.path.join(path, name), tensors, fmt)
                files.append(name)
            weight_map.update({t: name for t in tensors})
            total += written
            progress.advance(written)
            del tensors
        peak = max(peak, held)
        del gathered  # before the next unit's copies: one unit of them at a time
    progress.close()
    if rank0:
        _write_index(model, path, f"{stem}.{ext}.index.json", rewrite, aliases,
                     {"metadata": {"total_size": total, "format": fmt}, "weight_map": weight_map})
    return ExportReport(files, peak, model.numel * 4)


def _write_index(model: ShardedModel, path: str, name: str, rewrite: Rewrite | None,
                 aliases: dict[str, str], index: dict) -> None:
    """Rank 0: the index (tied names as ``fz3_aliases``, renamed by ``rewrite``) and the
    model's config, where it has one."""
    if rewrite is not None:
        rewrite.finish()
        aliases = {rewrite.name(a): rewrite.name(t) for a, t in aliases.items()
                   if rewrite.name(a) is not None}
    with open(os.path.join(path, name), "w") as f:
        json.dump({**index, "fz3_aliases": aliases}, f, indent=1)
    config = getattr(model.skeleton, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(path)


def read_export(path: str) -> dict[str, torch.Tensor]:
    """The exported state dict, tied names included (for ``load_state_dict(strict=True)``)."""
    for stem, ext in (("model", "safetensors"), ("pytorch_model", "bin")):
        index_file = os.path.join(path, f"{stem}.{ext}.index.json")
        if os.path.exists(index_file):
            break
    else:
        raise FileNotFoundError(f"no model.safetensors.index.json or "
                                f"pytorch_model.bin.index.json in {path}")
    with open(index_file) as f:
        index = json.load(f)
    sd: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        sd.update(_read(os.path.join(path, name), ext))
    for alias, target in index.get("fz3_aliases", {}).items():
        sd[alias] = sd[target]
    return sd


def _write(file: str, tensors: dict[str, torch.Tensor], fmt: str) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, file, metadata={"format": "pt"})
    else:
        torch.save(tensors, file)


def _read(file: str, ext: str) -> dict[str, torch.Tensor]:
    if ext == "safetensors":
        from safetensors.torch import load_file

        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True
