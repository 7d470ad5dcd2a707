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
  kinds: one stack per run of alike layers). With ``config.output_router_logits`` the loss
  adds ``router_aux_loss_coef`` x the router's load-balancing loss, as the model's forward
  does (``router_loss``): each layer returns its router's statistics beside h (``fz3.shard``'s
  ``layer_aux``; ``moe_layer``), which the loss combines.

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
    config = m.config
    if family.router and getattr(config, "output_router_logits", False):
        if getattr(config, "router_jitter_noise", 0):
            return (f"config.router_jitter_noise={config.router_jitter_noise} with "
                    f"output_router_logits=True: the jitter is drawn inside the expert block, "
                    f"and the load-balancing statistics fz3 computes beside it would not see "
                    f"it; set config.router_jitter_noise = 0.0 (the default)")
    return None


def configure(family: Family, typed: TypedFamily, m: nn.Module) -> TypedFamily:
    """An MoE model with ``config.output_router_logits``: layers that return their router's
    statistics (``moe_layer``), ``pre`` adding the tokens they count, and the loss with the
    load-balancing term (``router_loss``)."""
    if not (family.router and getattr(m.config, "output_router_logits", False)):
        return typed
    return typed._replace(pre=partial(_router_pre, family), layer=moe_layer,
                          loss=partial(router_loss, family), layer_aux=True)


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


def _router_pre(family: Family, m: nn.Module, batch: dict):
    """``pre``'s extras, then which tokens the router's statistics count: the padding mask,
    flat and in fp32, or None (every token), as the model's load-balancing loss takes it."""
    given = batch.get("attention_mask")
    tokens = None if given is None else given.reshape(-1).to(torch.float32)
    return (*pre(family, m, batch), tokens)


def moe_layer(block: nn.Module, h: torch.Tensor, masks: dict, rotary, types, pos,
              tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, stats)``: one decoder layer (the template's: attention, then the expert block,
    each after its norm and added to its input), and its router's statistics for the
    load-balancing loss (``router_stats``; zeros for a layer with a dense MLP)."""
    kind = "full_attention" if types is None else types[block.self_attn.layer_idx]
    tables = rotary[kind] if isinstance(rotary, dict) else rotary
    attended, _ = block.self_attn(hidden_states=block.input_layernorm(h),
                                  attention_mask=masks[kind], position_ids=pos,
                                  position_embeddings=tables)
    h = h + attended
    x = block.post_attention_layernorm(h)
    stats = router_stats(block.mlp, x, tokens, block.self_attn.config)
    return h + block.mlp(x), stats


def router_stats(mlp: nn.Module, x: torch.Tensor, tokens, config) -> torch.Tensor:
    """``(2 * experts,)`` fp32: per expert, the tokens routed to it (counted once per top-k
    slot) and the sum of its routing probability, over the tokens ``tokens`` weighs (all
    when None), as the release's ``load_balancing_loss_func`` sums them per layer. The
    router runs again on the block's input for them (a (tokens, hidden) x (hidden, experts)
    product: the block's own router output is not returned by its forward); its first
    output, softmaxed and top-k'd as that loss does (in 5.0 that output is already a
    softmax, and the loss applies one more, as the release does)."""
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    gate = getattr(mlp, "gate", None)
    if not hasattr(mlp, "experts") or gate is None:  # a dense layer (mlp_only_layers)
        return x.new_zeros(2 * experts, dtype=torch.float32)
    weights = torch.softmax(gate(x.reshape(-1, x.shape[-1]))[0], dim=-1)
    _, chosen = torch.topk(weights, gate.top_k, dim=-1)
    routed = (chosen.unsqueeze(-1) == torch.arange(experts, device=x.device)).to(torch.float32)
    probs = weights.float()
    if tokens is not None:
        routed = routed * tokens[:, None, None]
        probs = probs * tokens.unsqueeze(-1)
    return torch.cat([routed.sum(dim=(0, 1)), probs.sum(dim=0)])


def router_loss(family: Family, m: nn.Module, h: torch.Tensor, batch: dict, aux: tuple):
    """``(loss, {"lm_loss", "aux_loss"})``: the model's loss with ``router_aux_loss_coef`` x
    the load-balancing loss, from every MoE layer's statistics (``aux``, one tensor per
    stack: ``(layers, 2 * experts)``): experts x sum over experts of (the share of routed
    slots) x (the mean routing probability), over all layers' tokens, as the model's forward
    computes it."""
    config = m.config
    lm = m.loss_function(logits=logits(family, m, h, batch), labels=batch["labels"],
                         vocab_size=config.vocab_size)
    stats = torch.cat(aux).sum(dim=0)
    experts = stats.shape[0] // 2
    counts, probs = stats[:experts], stats[experts:]
    rows = counts.sum() / config.num_experts_per_tok  # tokens counted, over every MoE layer
    balance = torch.sum((counts / rows) * (probs / rows)) * experts
    return lm + config.router_aux_loss_coef * balance, {"lm_loss": lm, "aux_loss": balance}


def logits(family: Family, m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    out = m.lm_head(m.model.norm(h))
    return out if family.logits is None else family.logits(m.config, out)


# model_type -> its adapter's functions, as every other family's (``adapters.TYPED``)
TYPED = {t: TypedFamily("model.layers", partial(pre, f), layer, partial(logits, f),
                        check=partial(check, f), configure=partial(configure, f))
         for t, f in FAMILIES.items()}
