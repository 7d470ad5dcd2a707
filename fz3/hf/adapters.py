"""Built-in adapters for Hugging Face transformers models (``pip install fz3[hf]``, transformers 5.x).

``fz3.shard(model)`` with no ``layers``/``pre``/``post`` looks the model's class up here. An
adapter says where the stack lives and what each layer needs: the attention mask, position
ids and (Llama) the rotary tables are computed once in ``pre`` and passed to every layer;
``post`` applies the final norm and head and the model's own loss on ``batch["labels"]``.
Each follows the installed model's own ``forward``, using the same helpers it calls.

Batches are dicts: ``input_ids`` (B, T), ``labels`` (B, T) and optionally ``attention_mask``.
The loss is the mean over ranks of each rank's mean over its labelled tokens: equal to the
mean over all tokens when every rank has the same number of labelled tokens (always for causal LM
without padding; for MLM, mask the same count per rank).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import nn


class Adapter(NamedTuple):
    layers: str
    pre: Callable[..., Any]
    post: Callable[..., torch.Tensor]
    layer: Callable[..., torch.Tensor]


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)


def _causal_mask(config, embeds: torch.Tensor, batch: dict, positions: torch.Tensor):
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=batch.get("attention_mask"),
                              cache=None, position_ids=positions)


# GPT-2 (GPT2LMHeadModel): wte (tied to lm_head) + wpe, blocks transformer.h, ln_f, lm_head.
def _gpt2_pre(m: nn.Module, batch: dict):
    t, ids = m.transformer, batch["input_ids"]
    pos = _positions(ids)
    emb = t.wte(ids)
    mask = _causal_mask(t.config, emb, batch, pos)
    return t.drop(emb + t.wpe(pos)), mask, pos


def _gpt2_layer(block: nn.Module, h: torch.Tensor, mask, pos) -> torch.Tensor:
    return block(h, None, mask, None, position_ids=pos)


def _gpt2_post(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    logits = m.lm_head(m.transformer.ln_f(h))
    return m.loss_function(logits=logits, labels=batch["labels"], vocab_size=m.config.vocab_size)


# Llama (LlamaForCausalLM): embed_tokens, rotary tables once, layers model.layers, norm, lm_head.
def _llama_pre(m: nn.Module, batch: dict):
    base, ids = m.model, batch["input_ids"]
    pos = _positions(ids)
    h = base.embed_tokens(ids)
    mask = _causal_mask(base.config, h, batch, pos)
    return h, mask, base.rotary_emb(h, position_ids=pos), pos


def _llama_layer(block: nn.Module, h: torch.Tensor, mask, rotary, pos) -> torch.Tensor:
    return block(h, attention_mask=mask, position_ids=pos, position_embeddings=rotary)


def _llama_post(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    logits = m.lm_head(m.model.norm(h))
    return m.loss_function(logits=logits, labels=batch["labels"], vocab_size=m.config.vocab_size)


# RoBERTa (RobertaForMaskedLM): embeddings, bidirectional mask, roberta.encoder.layer, lm_head.
def _roberta_pre(m: nn.Module, batch: dict):
    base = m.roberta
    emb = base.embeddings(input_ids=batch["input_ids"])
    mask, _ = base._create_attention_masks(attention_mask=batch.get("attention_mask"), encoder_attention_mask=None,
                                           embedding_output=emb, encoder_hidden_states=None, cache=None)
    return emb, mask


def _roberta_layer(block: nn.Module, h: torch.Tensor, mask) -> torch.Tensor:
    return block(h, mask)


def _roberta_post(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    scores = m.lm_head(h)
    return nn.functional.cross_entropy(scores.view(-1, m.config.vocab_size), batch["labels"].view(-1))


ADAPTERS: dict[str, Adapter] = {
    "GPT2LMHeadModel": Adapter("transformer.h", _gpt2_pre, _gpt2_post, _gpt2_layer),
    "LlamaForCausalLM": Adapter("model.layers", _llama_pre, _llama_post, _llama_layer),
    "RobertaForMaskedLM": Adapter("roberta.encoder.layer", _roberta_pre, _roberta_post, _roberta_layer),
}


def adapter_for(module: nn.Module) -> Adapter:
    """The built-in adapter for ``module``'s class, or a TypeError naming the fix."""
    name = type(module).__name__
    if name not in ADAPTERS:
        raise TypeError(f"fz3.shard got no layers=/pre=/post= and has no built-in adapter for {name} "
                        f"(built in: {', '.join(sorted(ADAPTERS))}); pass layers='<dotted path of the "
                        f"nn.ModuleList>', pre=(m, batch) -> h and post=(m, h, batch) -> loss")
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise TypeError(f"fz3's adapter for {name} follows transformers 5.x; transformers "
                        f"{transformers.__version__} is installed. Upgrade (pip install 'fz3[hf]') or pass "
                        f"layers=/pre=/post= explicitly")
    return ADAPTERS[name]
