"""How a module's parameter names map to the names in a Hugging Face checkpoint folder
(``fz3.shard(..., weights=folder)``): a PEFT wrapper's base weights are looked up under the base
model's names (``peft_models.checkpoint_name``), and a model whose release renames weights on
load (``from_pretrained``: GPT-NeoX's ``embed_out`` is ``lm_head`` in transformers 5.24, and
``save_pretrained`` writes the old name back) is read under the checkpoint's names, renamed as
the release's own loader renames them; an MoE layer's stacked experts are read from the
checkpoint's per-expert tensors, concatenated (``EXPERTS``). Local: no collective."""

from __future__ import annotations

import sys
from functools import partial
from typing import Callable, Collection, Mapping

from torch import nn

from .peft_models import checkpoint_name, inner_model


# An MoE layer's experts, stacked in one tensor each in the model (transformers 5.x) and one
# tensor per expert on disk (the hub's layout, which save_pretrained writes back): the model's
# leaf -> the per-expert names it concatenates, expert by expert, per naming (Qwen-MoE and
# OLMoE's; Mixtral's w1, w3, w2)
EXPERTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
           "down_proj": (("down_proj",), ("w2",))}


def checkpoint_names(module: nn.Module, keys: Collection[str]
                     ) -> Callable[[str], str | tuple[str, ...]] | None:
    """``name -> the checkpoint's name`` (or the names of the tensors it concatenates) for
    the parameters and buffers of ``module`` in a checkpoint holding ``keys``, or None where
    every name is its own."""
    wrapped = inner_model(module)
    inner, path = wrapped if wrapped is not None else (module, None)
    renamed = {k: v for k, v in _loader_names(inner, keys).items() if k not in keys}
    if path is None and not renamed and not _has_experts(inner):
        return None
    return partial(_rename, path, renamed, frozenset(keys) | frozenset(renamed))


def _rename(path: str | None, renamed: Mapping[str, str], held: frozenset[str],
            name: str) -> str | tuple[str, ...]:
    base = name if path is None else checkpoint_name(path, name)
    if base not in held:
        joined = _experts(base, held)
        if joined is not None:
            return tuple(renamed.get(k, k) for k in joined)
    return renamed.get(base, base)


def _experts(name: str, held: frozenset[str]) -> tuple[str, ...] | None:
    """The per-expert names (after the loader's renaming) a stacked expert tensor ``name``
    concatenates, expert 0, 1, ... while the checkpoint holds them; None if it holds none."""
    head, _, leaf = name.rpartition(".")
    if not head.endswith("experts") or leaf not in EXPERTS:
        return None
    # Mixtral's experts keep their old module name on disk, which 5.24's loader renames first
    # and 5.0's merges under directly
    for where in (head, head.replace(".mlp.experts", ".block_sparse_moe.experts")):
        for names in EXPERTS[leaf]:
            found, e = [], 0
            while all(f"{where}.{e}.{n}.weight" in held for n in names):
                found += [f"{where}.{e}.{n}.weight" for n in names]
                e += 1
            if found:
                return tuple(found)
    return None


def _has_experts(model: nn.Module) -> bool:
    return any(n.rpartition(".")[2] in EXPERTS and ".experts." in f".{n}"
               for n, _ in model.named_parameters())


def _loader_names(model: nn.Module, keys: Collection[str]) -> dict[str, str]:
    """``{the model's name: the checkpoint's key}`` for each key the release's loader renames
    (``transformers.conversion_mapping``: its ``WeightRenaming`` transforms; what merges or
    splits tensors is not a name and cannot be read by slices, so it is left out and the
    parameter is reported missing)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return {}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a release without load-time renaming
        return {}
    renamings = [t for t in get_model_conversion_mapping(model)
                 if isinstance(t, WeightRenaming)]
    out = {}
    for key in keys:
        name = key
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        if name != key:
            out[name] = key
    return out
