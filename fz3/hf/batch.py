"""What a batch for a built-in Hugging Face adapter must be, checked before any collective.

Pure and local: it reads keys, types, dtypes and shapes only (no values, so no device sync),
so a bad batch fails on the rank that has it, with what the adapter expects, instead of
after the whole forward or as a ``RankLostError`` on the other ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

EXPECTED = ("a dict with input_ids (B, T) torch.long, labels (B, T) torch.long (-100 where no "
            "loss) and optionally attention_mask (B, T) bool or integer (1 = token, 0 = padding)")
REQUIRED = ("input_ids", "labels")
OPTIONAL = ("attention_mask",)


def check_batch(model: str, batch: Any, shifted: bool = True, labels: bool = True) -> str | None:
    """Raise TypeError/ValueError, naming ``model`` (the adapter's class name) and ``EXPECTED``,
    unless ``batch`` is a mapping with exactly the keys, dtypes and equal (B, T) shapes above.
    Returns why the batch has nothing to learn from (no labelled token: every label -100, or
    only the first of each row where the labels are ``shifted`` as a causal LM's are), else
    None; read on the host for CPU batches only (a device batch would cost a sync).
    ``labels=False`` (an output, no loss: ``fz3.apply(..., output=)``): labels are optional."""
    where = f"fz3's {model} adapter takes {EXPECTED}"
    if not isinstance(batch, Mapping):
        raise TypeError(f"{where}; got a {type(batch).__name__}. Name the fields: "
                        f"{{'input_ids': ids, 'labels': labels}}")
    required = REQUIRED if labels else REQUIRED[:1]
    missing = [k for k in required if k not in batch]
    if missing:
        raise ValueError(f"{where}; the batch has no {missing} (keys: {sorted(batch)})")
    extra = sorted(set(batch) - set(REQUIRED) - set(OPTIONAL))
    if extra:
        raise ValueError(f"{where}; the batch also has {extra}, which the adapter would ignore: "
                         f"remove them")
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}; batch[{key!r}] is a {type(value).__name__}: "
                            f"make it a torch.Tensor")
    for key in (k for k in REQUIRED if k in batch):
        if batch[key].dtype != torch.long:
            raise TypeError(f"{where}; batch[{key!r}] is {batch[key].dtype}: "
                            f"convert it with .long()")
    mask = batch.get("attention_mask")
    if mask is not None and (mask.dtype.is_floating_point or mask.dtype.is_complex):
        raise TypeError(f"{where}; batch['attention_mask'] is {mask.dtype}: pass the 0/1 padding "
                        f"mask as .long() or .bool() (additive float masks are not taken)")
    shape = batch["input_ids"].shape
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"{where}; batch['input_ids'] has shape {tuple(shape)}: it must be (B, T) "
                         f"with B, T >= 1 (one sequence: ids[None])")
    for key, value in batch.items():
        if value.shape != shape:
            raise ValueError(f"{where}; batch[{key!r}] has shape {tuple(value.shape)} but "
                             f"input_ids has {tuple(shape)}: they must be equal")
    if "labels" not in batch or not labels:
        return None
    given = batch["labels"]
    if given.device.type != "cpu":
        return None
    scored = given[:, 1:] if shifted else given
    if bool((scored != -100).any()):
        return None
    where = " after the first token of each row (a causal LM predicts the next one)"
    where = where if shifted else ""
    return f"no labelled token{where}: every label is -100"


def example(config: Any, seq: int = 8) -> dict:
    """A batch of one row of ``seq`` tokens for ``config``'s vocabulary, as the adapters take
    it: what ``fz3.shard`` runs a built-in adapter's functions on (fake tensors of it: shapes
    only) to place each parameter by what reads it."""
    ids = torch.arange(seq).remainder(config.vocab_size).unsqueeze(0)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
