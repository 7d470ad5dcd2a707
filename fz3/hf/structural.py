"""The built-in template matched by structure: a Hugging Face ``...ForCausalLM`` whose
``model_type`` is none of the tested families' (``adapters.TYPED``) is followed when what it
holds and what its forwards read are what transformers' decoder template does, whatever its
type is called.

What the model must hold (``match``, read from its modules, never from ``model_type``):

- the model with the head holds its base model (``base_model_prefix``) and its head
  (``get_output_embeddings``), nothing else with weights;
- the base model holds the embedding (``get_input_embeddings``), one ``nn.ModuleList`` of
  ``config.num_hidden_layers`` layers, at most one final norm, rotary tables (a module with an
  ``inv_freq`` buffer, called ``rotary(h, position_ids)``) and dropouts, nothing else;
- each layer takes its hidden states and no required argument but ``attention_mask``,
  ``position_ids`` and ``position_embeddings`` (passed by name, or through ``**kwargs``);
- the config keys the base model's and the head's ``forward`` read (``config.x``, or
  ``self.x`` set from ``config.x`` in ``__init__``) are ones the template applies
  (``FOLLOWED``): masks by ``config.layer_types`` (full and sliding layers, each layer's type
  read from its ``layer_idx``) or by ``config.sliding_window``, Granite's
  ``embedding_multiplier`` and ``logits_scaling``, Cohere's ``logit_scale``, a
  ``final_logit_softcapping``, Starcoder2's ``embedding_dropout``; an MoE block runs as any
  layer (``output_router_logits`` must be off: the router's loss is followed for the tested
  MoE families only). Any other key those forwards read (a ``scale_emb``, a
  ``dim_model_base``) is refused by name.

A match is then verified (``fz3.hf.verify``): the template's loss and logits equal the
model's own ``forward``'s on a tiny random copy built from the same config, or the model is
refused naming the difference.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from . import compat
from .model_reads import child_name, ends, holds, layer_arguments, reads_of, \
    refused_keys, rotary_refused
from .protocol import TypedFamily

HEAD = "ForCausalLM"
KIND = "decoder"
# config keys the template applies (or that change nothing it computes) when the base model's
# or the head's forward reads them
FOLLOWED = frozenset({
    "vocab_size", "num_hidden_layers", "pad_token_id", "use_cache", "use_return_dict",
    "return_dict", "output_attentions", "output_hidden_states", "_attn_implementation",
    "layer_types", "sliding_window", "embedding_multiplier", "logits_scaling", "logit_scale",
    "final_logit_softcapping", "embedding_dropout",
    # read only to add the router's loss, refused below when output_router_logits is on
    "output_router_logits", "router_aux_loss_coef", "num_experts", "num_local_experts",
    "num_experts_per_tok"})
APPLIED = ("embedding_multiplier, logits_scaling, logit_scale, final_logit_softcapping, "
           "embedding_dropout, layer_types and sliding_window")
MASK_KINDS = ("full_attention", "sliding_attention")


class Structure(NamedTuple):
    """Where the template finds each piece of one model (attribute names)."""

    base: str  # the base model, in the model with the head ("model")
    embed: str  # the embedding, in the base model
    layers: str  # the nn.ModuleList of layers, in the base model
    norm: str | None  # the final norm, in the base model
    rotary: str | None  # the rotary tables' module, in the base model
    dropout: str | None  # an nn.Dropout the base model applies to the embeddings (Phi)
    head: str  # the head ("lm_head"), in the model with the head
    masks: str  # "layer_types" (one per type), "sliding" or "causal"
    layer_index: str | None  # dotted path of a layer's index into config.layer_types
    keys: frozenset[str]  # the config keys the top-level forwards read
    passes: tuple[str, ...]  # LAYER_ARGUMENTS the layers take


def match(m: nn.Module) -> Structure | str:
    """The structure of ``m`` as the template follows it, or why it cannot (a sentence
    naming the module, argument or config key). Local."""
    name = type(m).__name__
    if not any(c.__name__.endswith(HEAD) for c in type(m).__mro__):
        return f"{name} is not a ...ForCausalLM (the template follows causal LM heads)"
    config, found = m.config, ends(m)
    if isinstance(found, str):
        return found
    base_name, base, head, embed = found
    if not isinstance(base, nn.Module) or head is None:
        return f"{name} holds no base model (base_model_prefix) and head to follow"
    head_name = child_name(m, head)
    extra = [n for n, c in m.named_children() if n not in (base_name, head_name) and holds(c)]
    if head_name is None or extra:
        return f"{name} holds {extra or 'its head elsewhere'} beside {base_name} and its head"
    embed_name = child_name(base, embed)
    lists = [n for n, c in base.named_children() if isinstance(c, nn.ModuleList)]
    if embed_name is None or len(lists) != 1 or \
            len(getattr(base, lists[0])) != getattr(config, "num_hidden_layers", None):
        return (f"{type(base).__name__} holds {len(lists)} ModuleLists ({lists}) and its "
                f"embedding {'as a child' if embed_name else 'elsewhere'}; the template follows "
                f"one list of config.num_hidden_layers="
                f"{getattr(config, 'num_hidden_layers', None)} layers")
    layers_name = lists[0]
    rotary = [n for n, c in base.named_children() if "inv_freq" in dict(c.named_buffers())]
    dropouts = [n for n, c in base.named_children() if isinstance(c, nn.Dropout)]
    rest = [n for n, c in base.named_children()
            if n not in (embed_name, layers_name, *rotary, *dropouts)]
    norms = [n for n in rest if holds(getattr(base, n))]
    if len(rotary) > 1 or len(dropouts) > 1 or len(norms) > 1:
        return (f"{type(base).__name__} holds {rotary + dropouts + norms} beside its embedding "
                f"and layers; the template follows one final norm, one rotary module and one "
                f"dropout")
    keys = reads_of((type(base), type(m)))
    why = _refused(keys, config) or rotary_refused(base, rotary)
    if why:
        return why
    layer = getattr(base, layers_name)[0]
    passes, why = layer_arguments(layer, rotary)
    if why:
        return why
    masks = ("layer_types" if "layer_types" in keys and getattr(config, "layer_types", None)
             else "sliding" if "sliding_window" in keys and getattr(config, "sliding_window", None)
             else "causal")
    index, why = _layer_index(getattr(base, layers_name), config, masks)
    if why:
        return why
    return Structure(base_name, embed_name, layers_name, norms[0] if norms else None,
                     rotary[0] if rotary else None, dropouts[0] if dropouts else None,
                     head_name, masks, index, frozenset(keys), passes)


def family(s: Structure) -> TypedFamily:
    """The adapter's functions for a model of structure ``s`` (``adapters.py`` makes the
    ``Adapter``)."""
    return TypedFamily(f"{s.base}.{s.layers}", partial(pre, s), partial(layer, s),
                       partial(logits, s))


def pre(s: Structure, m: nn.Module, batch: dict):
    """``(h, masks, rotary tables or None, types, positions)``, as the base model's forward
    makes them before its layers (``types``: ``config.layer_types``, or None for one mask)."""
    base, ids = getattr(m, s.base), batch["input_ids"]
    config = base.config
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    h = getattr(base, s.embed)(ids)
    given = batch.get("attention_mask")
    types = tuple(config.layer_types) if s.layer_index is not None else None
    if s.masks == "layer_types":
        masks = {t: _mask(t, base, h, given, pos) for t in sorted(set(config.layer_types))}
    else:
        masks = {"": _mask("sliding_attention" if s.masks == "sliding" else "full_attention",
                           base, h, given, pos)}
    if "embedding_multiplier" in s.keys:
        h = h * config.embedding_multiplier
    if "embedding_dropout" in s.keys:
        h = nn.functional.dropout(h, p=config.embedding_dropout, training=base.training)
    if s.dropout is not None:
        h = getattr(base, s.dropout)(h)
    rotary = None if s.rotary is None else getattr(base, s.rotary)(h, pos)
    return h, masks, rotary, types, pos


def layer(s: Structure, block: nn.Module, h: torch.Tensor, masks: dict, rotary, types,
          pos) -> torch.Tensor:
    """One layer with its type's mask (``types`` at the index it holds)."""
    if types is None:
        mask = next(iter(masks.values()))
    else:
        mask = masks[types[_attribute(block, s.layer_index)]]
    values = dict(attention_mask=mask, position_ids=pos, position_embeddings=rotary)
    return compat.block_output(block(h, **{k: values[k] for k in s.passes}))


def logits(s: Structure, m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    """The final norm, the head, and the logits' scaling its forward reads."""
    base, config = getattr(m, s.base), m.config
    if s.norm is not None:
        h = getattr(base, s.norm)(h)
    out = getattr(m, s.head)(h)
    if "logit_scale" in s.keys:
        out = out * config.logit_scale
    if "logits_scaling" in s.keys:
        out = out / config.logits_scaling
    cap = getattr(config, "final_logit_softcapping", None) \
        if "final_logit_softcapping" in s.keys else None
    if cap is not None:
        out = torch.tanh(out / cap) * cap
    return out


def _mask(kind: str, base: nn.Module, h, given, pos):
    if kind == "sliding_attention":
        return compat.sliding_window_mask(base.config, h, given, pos)
    return compat.causal_mask(base.config, h, given, pos)


def _refused(keys: frozenset[str], config) -> str | None:
    why = refused_keys(keys, config, FOLLOWED, APPLIED)
    if why is None and "output_router_logits" in keys and \
            getattr(config, "output_router_logits", False):
        return ("config.output_router_logits=True: the template adds no router load-balancing "
                "loss for a family fz3 has not tested; set config.output_router_logits = False")
    return why


def _layer_index(layers: nn.ModuleList, config, masks: str) -> tuple[str | None, str | None]:
    """Where a layer holds its index into ``config.layer_types`` (``self_attn.layer_idx``),
    when layers of several types each need their own mask."""
    if masks != "layer_types":
        return None, None
    kinds = sorted(set(config.layer_types))
    unknown = [k for k in kinds if k not in MASK_KINDS]
    if unknown:
        return None, (f"config.layer_types holds {unknown}; the template builds masks for "
                      f"{', '.join(MASK_KINDS)} only")
    if len(kinds) == 1:
        return None, None
    for path in (p for p, v in _int_attributes(layers[0]) if p.endswith("layer_idx")):
        if all(_attribute(b, path) == i for i, b in enumerate(layers)):
            return path, None
    return None, (f"its layers hold no layer_idx that names their entry of config.layer_types "
                  f"({kinds}), so the template cannot give each its mask")


def _int_attributes(block: nn.Module):
    for prefix, module in block.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, int) and not isinstance(value, bool):
                yield (f"{prefix}.{name}" if prefix else name), value


def _attribute(block: nn.Module, path: str):
    for part in path.split("."):
        block = getattr(block, part)
    return block
