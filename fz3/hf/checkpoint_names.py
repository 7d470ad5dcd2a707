"""How a module's parameter names map to the names in a Hugging Face checkpoint folder
(``fz3.shard(..., weights=folder)``), as the installed release's own loader maps them:

- a PEFT wrapper's base weights are looked up under the base model's names
  (``peft_models.checkpoint_name``);
- a weight the release renames on load (``from_pretrained``: GPT-NeoX's ``embed_out`` is
  ``lm_head`` in transformers 5.24, and ``save_pretrained`` writes the old name back) is read
  under the checkpoint's name (the loader's ``WeightRenaming``s);
- a tensor the loader stacks from per-tensor pieces (an MoE layer's experts: one tensor per
  expert on disk, the hub's layout; the loader's ``WeightConverter``s that merge a module list
  along a new first dimension, then perhaps concatenate along rows) is read from those pieces,
  in the order the stacked tensor flattens (expert 0's pieces, expert 1's, ...). A converter
  of another kind cannot be read by slices: the parameter is then reported missing by name.

Local: no collective."""

from __future__ import annotations

import sys
from functools import partial
from typing import Callable, Collection, Mapping, Sequence

from torch import nn

from .peft_models import checkpoint_name, inner_model

Joins = Sequence[tuple[str, tuple[str, ...]]]  # (target, per-piece source patterns with "*")


def checkpoint_names(module: nn.Module, keys: Collection[str]
                     ) -> Callable[[str], str | tuple[str, ...]] | None:
    """``name -> the checkpoint's name`` (or the names of the tensors it concatenates) for
    the parameters and buffers of ``module`` in a checkpoint holding ``keys``, or None where
    every name is its own."""
    wrapped = inner_model(module)
    inner, path = wrapped if wrapped is not None else (module, None)
    renamings, joins = _loader_transforms(inner)
    renamed = {k: v for k, v in _renamed(renamings, keys).items() if k not in keys}
    if path is None and not renamed and not joins:
        return None
    return partial(_rename, path, renamed, frozenset(keys) | frozenset(renamed), tuple(joins))


def _rename(path: str | None, renamed: Mapping[str, str], held: frozenset[str], joins: Joins,
            name: str) -> str | tuple[str, ...]:
    base = name if path is None else checkpoint_name(path, name)
    if base not in held:
        pieces = _pieces(base, held, joins)
        if pieces is not None:
            return tuple(renamed.get(k, k) for k in pieces)
    return renamed.get(base, base)


def _pieces(name: str, held: frozenset[str], joins: Joins) -> tuple[str, ...] | None:
    """The names (after the loader's renaming) of the pieces a stacked ``name`` is made of,
    piece 0, 1, ... while the checkpoint holds them; None if no join makes it."""
    for target, sources in joins:
        if not name.endswith(target):
            continue
        prefix, found, e = name[: len(name) - len(target)], [], 0
        while all(prefix + s.replace("*", str(e)) in held for s in sources):
            found += [prefix + s.replace("*", str(e)) for s in sources]
            e += 1
        if found:
            return tuple(found)
    return None


def _loader_transforms(model: nn.Module) -> tuple[list, Joins]:
    """The release's load-time ``WeightRenaming``s for ``model``, and its stacking converters
    as ``(target, sources)``; none for a model that is not a transformers one, or a release
    without load-time conversion."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    transforms = get_model_conversion_mapping(model)
    joins = [(t.target_patterns[0], tuple(t.source_patterns)) for t in transforms
             if isinstance(t, WeightConverter) and len(t.target_patterns) == 1
             and _stacks(t.operations)]
    return [t for t in transforms if isinstance(t, WeightRenaming)], joins


def _stacks(operations) -> bool:
    """Whether a converter only stacks its pieces: a module list merged along a new first
    dimension, then perhaps concatenated along rows (what ``_pieces``' order flattens to)."""
    kinds = [(type(o).__name__, getattr(o, "dim", None)) for o in operations]
    return kinds in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def _renamed(renamings: list, keys: Collection[str]) -> dict[str, str]:
    """``{the model's name: the checkpoint's key}`` for each key the renamings change."""
    out = {}
    for key in keys:
        name = key
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        if name != key:
            out[name] = key
    return out
