"""Pretrained weights straight into this rank's shards, without a full model on any rank.

``fz3.shard(module, ..., weights=folder)`` with ``module`` built on the ``meta`` device and a
Hugging Face checkpoint in ``folder`` (``model.safetensors``, or ``model.safetensors.index.json``
and the files it names, as ``save_pretrained`` writes them): every parameter the checkpoint
has is read from it, the others are taken from the module (which must hold them for real:
new LoRA weights, say). A rank's shard of a flat buffer is a contiguous range of the
part's concatenated, flattened parameters, so for each parameter overlapping that range only
the rows covering it are read (safetensors' ``get_slice`` reads lazily, from a memory map):
one slice at a time, straight into the shard. Peak host memory: the rank's shards plus one
slice (at most the rank's range of one parameter and two rows around it); ``Pretrained.
bytes_read`` counts what was read.

Buffers on the meta device are made real on fz3's skeleton (the module is not changed):
read from the checkpoint when it has them (persistent ones), else computed by the module's own
init: a Hugging Face model's ``_init_weights`` on the buffer's module, which is what
``from_pretrained`` runs for buffers a checkpoint does not hold (rotary ``inv_freq``,
RoBERTa's ``position_ids``). Other buffers must be real already (build the module under
``accelerate.init_empty_weights()``, which puts only parameters on the meta device).

Nothing here communicates.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterable

import torch
from torch import nn

from ..comm.progress import Progress


# a module's name -> its name in the checkpoint, or the names of the tensors it is the
# concatenation of, flattened in that order (an MoE layer's stacked experts: one tensor per
# expert on disk); None: the same name
Rename = Callable[[str], str | tuple[str, ...]] | None
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Pretrained:
    """A Hugging Face safetensors checkpoint, read lazily, tensor slice by tensor slice;
    ``bytes_read`` counts the bytes of the tensor slices read so far. ``fz3.shard(module,
    weights=Pretrained(folder))`` reads through it (``weights=folder`` makes one)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.files = _weight_map(self.folder)  # checkpoint name -> file
        self._open: dict[str, object] = {}  # file -> safe_open handle
        self.bytes_read = 0
        # a line (or a tqdm bar) on rank 0 while a long read goes on
        self.progress = Progress(f"fz3.shard(weights={self.folder!r})")

    def find(self, names: Iterable[str], rename: Rename) -> str | tuple[str, ...] | None:
        """The checkpoint's name (or names, concatenated) for the first of a parameter's
        ``names`` it holds, or None."""
        for name in names:
            key = rename(name) if rename else name
            if all(k in self.files for k in ((key,) if isinstance(key, str) else key)):
                return key
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def numel(self, key: str | tuple[str, ...]) -> int:
        keys = (key,) if isinstance(key, str) else key
        return sum(math.prod(self.shape(k)) for k in keys)

    def read_joined(self, keys: tuple[str, ...], start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the concatenation of tensors ``keys`` flattened: only
        the rows of each that cover them are read."""
        out, offset = [], 0
        for key in keys:
            n = math.prod(self.shape(key))
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                out.append(self.read(key, lo - offset, hi - offset))
            offset += n
        return torch.cat(out) if len(out) != 1 else out[0]

    def read(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``key`` flattened, (end - start,): only the rows
        (first-dimension slices) covering them are read."""
        shape = self.shape(key)
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        if not shape:  # a scalar
            t = self._slice(key)[...].reshape(-1)
            self.bytes_read += t.numel() * t.element_size()
            return t[start:end]
        first, last = start // row, -(-end // row)
        rows = self._slice(key)[first:last].reshape(-1)
        self.bytes_read += rows.numel() * rows.element_size()
        self.progress.advance(rows.numel() * rows.element_size())
        return rows[start - first * row : end - first * row]

    def _slice(self, key: str):
        from safetensors import safe_open

        file = self.files[key]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.folder, file), framework="pt")
        return self._open[file].get_slice(key)


def _weight_map(folder: str) -> dict[str, str]:
    index, single = os.path.join(folder, INDEX), os.path.join(folder, SINGLE)
    if os.path.isfile(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: SINGLE for k in f.keys()}
    found = sorted(os.listdir(folder)) if os.path.isdir(folder) else "no such folder"
    raise FileNotFoundError(
        f"weights={folder!r} has no {SINGLE} nor {INDEX} (found: {found}); save the "
        f"checkpoint with save_pretrained(folder) (safetensors: .bin files cannot be "
        f"read a slice at a time)"
    )


def piece(source: Pretrained, rename: Rename, part, row: int, slot, param: torch.Tensor,
          elements: slice) -> torch.Tensor:
    """Elements ``elements`` of parameter ``slot`` of row ``row`` of ``part``: read from
    ``source`` if it holds the parameter (under ``rename(name)``), else sliced from the
    module's (real) parameter ``param``. ``fz3.shard(weights=...)`` fills shards with it."""
    names, shape, start, end = ([part.prefix(row) + n for n in slot.names], slot.shape,
                                elements.start, elements.stop)
    key = source.find(names, rename)
    if isinstance(key, tuple):
        # one tensor per expert (E, or E pairs), each of the stacked tensor's (rows, ...) split
        # evenly between a pair: (E, 2I, H) from E pairs of (I, H)
        per = len(key) // shape[0] if shape and len(key) % shape[0] == 0 else 0
        want = None if not per or shape[1] % per else (shape[1] // per, *shape[2:])
        got = [source.shape(k) for k in key]
        if want is None or any(g != want for g in got):
            raise ValueError(
                f"checkpoint {source.folder} holds {names[0]} as {len(key)} tensors ({key[0]} "
                f"{list(got[0])}, ...); the module's is {list(shape)}, which fz3 reads from "
                f"per-expert tensors of shape {want and list(want)}: build the module from the "
                f"checkpoint's config"
            )
        return source.read_joined(key, start, end)
    if key is not None:
        if source.shape(key) != tuple(shape):
            raise ValueError(
                f"checkpoint {source.folder} has {key} of shape {list(source.shape(key))}; the "
                f"module's {names[0]} is {list(shape)}: build the module from the checkpoint's "
                f"config"
            )
        return source.read(key, start, end)
    if param.is_meta:
        looked = sorted({rename(n) if rename else n for n in names})
        raise ValueError(
            f"parameter {names[0]} is on the meta device and checkpoint {source.folder} has no "
            f"{looked}: initialize it before fz3.shard (new LoRA weights of a PEFT model built on "
            f"the meta device: fz3.hf.init_lora(model)), or, if it is tied to a weight the "
            f"checkpoint holds (an LM head), tie it first (model.tie_weights(), as "
            f"from_pretrained does)"
        )
    return param.detach().reshape(-1)[start:end]


def materialize_buffers(
    skeleton: nn.Module, source: Pretrained, rename: Rename, device: torch.device
) -> None:
    """Make every meta buffer of ``skeleton`` (fz3's own copy of the module) real on ``device``:
    from the checkpoint if it holds it, else by the owning Hugging Face model's
    ``_init_weights``."""
    owners = {name: m for name, m in skeleton.named_modules() if hasattr(m, "_init_weights")}
    for module_name, module in skeleton.named_modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if not buf.is_meta:
                continue
            full = f"{module_name}.{name}" if module_name else name
            key = source.find([full], rename)
            if isinstance(key, tuple):  # only stacked experts are joined, never a buffer
                raise ValueError(f"buffer {full} would be read from {len(key)} tensors of "
                                 f"checkpoint {source.folder}: fz3 joins parameters only")
            if key is not None:
                setattr(
                    module,
                    name,
                    source.read(key, 0, buf.numel()).view(buf.shape).to(device, buf.dtype),
                )
                continue
            setattr(module, name, _unset(buf, device))
            owner = max((o for o in owners if _inside(module_name, o)), key=len, default=None)
            if owner is not None:
                with torch.no_grad():
                    owners[owner]._init_weights(module)
            if owner is None or _still_unset(getattr(module, name)):
                raise ValueError(
                    f"buffer {full} is on the meta device, checkpoint {source.folder} does not "
                    f"hold it and no Hugging Face _init_weights computes it: build the module with "
                    f"real buffers (e.g. under accelerate.init_empty_weights(), which puts only "
                    f"parameters on the meta device)"
                )


def _inside(module_name: str, owner: str) -> bool:
    return owner == "" or module_name == owner or module_name.startswith(owner + ".")


def _unset(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real buffer filled with a value no init leaves everywhere (NaN; the smallest integer)."""
    if buf.dtype.is_floating_point or buf.dtype.is_complex:
        return torch.full(buf.shape, float("nan"), dtype=buf.dtype, device=device)
    if buf.dtype == torch.bool:
        return torch.zeros(buf.shape, dtype=buf.dtype, device=device)
    return torch.full(buf.shape, torch.iinfo(buf.dtype).min, dtype=buf.dtype, device=device)


def _still_unset(buf: torch.Tensor) -> bool:
    if buf.dtype.is_floating_point or buf.dtype.is_complex:
        return bool(torch.isnan(buf).any())
    if buf.dtype == torch.bool:
        return False
    return bool((buf == torch.iinfo(buf.dtype).min).all()) and buf.numel() > 0
