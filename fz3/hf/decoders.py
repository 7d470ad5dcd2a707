"""One adapter for the Hugging Face decoders built on transformers' Llama template, by
``config.model_type``: ``model.embed_tokens``, the rotary tables (``model.rotary_emb``), the
masks, ``model.layers``, ``model.norm``, ``lm_head`` and the model's own loss.

Each family follows its installed model's ``forward`` (transformers 5.x), and only what
differs is written per family (``FAMILIES``):

- which masks: one causal mask (``compat.own_causal_mask``: the model's own builder where
  its release still has one, StableLM in 5.0); or, with ``config.sliding_window``
  (Mistral), a sliding one; or one per entry of ``config.layer_types`` (Qwen2, Qwen3,
  Gemma2, Gemma3: sliding and full layers), each layer taking its own type's
  (``config.layer_types[layer_idx]``, as the model's loop does);
- the rotary tables: one pair, or one per layer type (Gemma3);
- the embedding's multiplier (Granite; Gemma's sqrt(hidden) where the release applies it in
  the model's forward) and the logits' scaling (Granite) or soft-capping (Gemma2, Gemma3);
- mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): run as any layer, their
  experts sharded like other weights (Qwen2-MoE's ``mlp_only_layers`` make layers of two
  kinds: one stack per run of alike layers); the router's load-balancing loss
  (``output_router_logits=True``) is refused by ``check`` until the scan can carry a
  per-layer output to the loss.

Only the listed types are used; an unlisted one is refused even when it looks like the
template (``fz3.hf.adapters.adapter_for``).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from . import compat
from .protocol import TypedFamily


class Family(NamedTuple):
    """What one family does differently from the template."""

    # the masks' keys: "full" (one causal, or sliding with config.sliding_window) or
    # "layer_types" (one per type in config.layer_types)
    masks: str = "full"
    rotary_per_type: bool = False  # Gemma3: rotary tables per layer type
    embed: Callable[[Any, torch.Tensor], torch.Tensor] | None = None  # (base model, h) -> h
    logits: Callable[[Any, torch.Tensor], torch.Tensor] | None = None  # (config, logits)
    router: bool = False  # mixture-of-experts layers (a router's load-balancing loss)


def _granite_embed(base, h):
    return h * base.config.embedding_multiplier


def _gemma_embed(base, h):
    """Gemma's sqrt(hidden) scale: in its embedding module since transformers 5.x moved it
    there (5.24), in the model's forward before (5.0)."""
    if hasattr(base.embed_tokens, "embed_scale"):
        return h
    return h * torch.tensor(base.config.hidden_size**0.5, dtype=h.dtype)


def _granite_logits(config, logits):
    return logits / config.logits_scaling


def _softcap(config, logits):
    cap = config.final_logit_softcapping
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(masks="layer_types"),
    "qwen3": Family(masks="layer_types"),
    "phi3": Family(),
    "olmo": Family(),
    "olmo2": Family(),
    "stablelm": Family(),
    "granite": Family(embed=_granite_embed, logits=_granite_logits),
    "gemma": Family(embed=_gemma_embed),
    "gemma2": Family(masks="layer_types", embed=_gemma_embed, logits=_softcap),
    "mixtral": Family(router=True),
    "qwen2_moe": Family(masks="layer_types", router=True),  # mlp_only_layers: two stacks
    "qwen3_moe": Family(router=True),
    "olmoe": Family(router=True),
    "gemma3_text": Family(masks="layer_types", rotary_per_type=True, logits=_softcap),
}


def check(family: Family, m: nn.Module) -> str | None:
    """Why fz3 cannot follow this model's ``forward``, or None."""
    if family.router and getattr(m.config, "output_router_logits", False):
        return (f"{m.config.model_type} with config.output_router_logits=True adds the "
                f"router's load-balancing loss, computed from every layer's router logits at "
                f"once, which fz3's layer scan cannot hand to the loss yet: set "
                f"config.output_router_logits = False (the loss without it, transformers' "
                f"default)")
    return None


def pre(family: Family, m: nn.Module, batch: dict):
    """``(h, masks, rotary, types, positions)``: what every layer takes, computed once."""
    base, ids = m.model, batch["input_ids"]
    config = base.config
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    h = base.embed_tokens(ids)
    if family.embed is not None:
        h = family.embed(base, h)
    given = batch.get("attention_mask")
    if family.masks == "layer_types":
        types = tuple(config.layer_types)
        masks = {t: _mask(t, base, h, given, pos) for t in sorted(set(types))}
    else:
        types = None
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else \
            "full_attention"
        masks = {"full_attention": _mask(kind, base, h, given, pos)}
    if family.rotary_per_type:
        rotary = {t: base.rotary_emb(h, pos, t) for t in sorted(set(types))}
    else:
        rotary = base.rotary_emb(h, position_ids=pos)
    return h, masks, rotary, types, pos


def _mask(kind: str, base: nn.Module, h, given, pos):
    if kind == "sliding_attention":
        return compat.sliding_window_mask(base.config, h, given, pos)
    return compat.own_causal_mask(base, h, given, pos)


def layer(block: nn.Module, h: torch.Tensor, masks: dict, rotary, types, pos) -> torch.Tensor:
    """One decoder layer, with its own type's mask (and rotary tables, per type)."""
    kind = "full_attention" if types is None else types[block.self_attn.layer_idx]
    tables = rotary[kind] if isinstance(rotary, dict) else rotary
    return compat.block_output(block(h, attention_mask=masks[kind], position_ids=pos,
                                     position_embeddings=tables))


def logits(family: Family, m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    out = m.lm_head(m.model.norm(h))
    return out if family.logits is None else family.logits(m.config, out)


# model_type -> its adapter's functions, as every other family's (``adapters.TYPED``)
TYPED = {t: TypedFamily("model.layers", partial(pre, f), layer, partial(logits, f),
                        check=partial(check, f)) for t, f in FAMILIES.items()}
