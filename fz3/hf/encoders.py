"""Adapters for masked-LM encoders by ``config.model_type``: BERT, RoBERTa and ModernBERT
(``...ForMaskedLM``). Each follows its installed model's own
``forward``: the embeddings, a bidirectional mask (causal where ``config.is_decoder``), the
stack, the head and the model's own loss over the unshifted labels.

ModernBERT's layers alternate global and local (sliding-window) attention by
``config.layer_types``; each layer takes its own type's mask and rotary tables, as the model's
loop does. Its first layer has no attention norm, so it is a stack of its own. Its release
5.0 builds both masks with ``_update_attention_mask`` and hands both to every layer; later
releases build one per type with transformers' mask builders. Its flash-attention path
(unpadded sequences) is refused with every other attention implementation but eager and sdpa
(``adapters.check_attention``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from . import compat
from .protocol import TypedFamily as Family


MASKED_LM = dict(head="ForMaskedLM", shifted=False)  # ...ForMaskedLM, unshifted labels


# BERT (BertForMaskedLM) and RoBERTa: embeddings (RoBERTa's position ids skip padding_idx
# tokens), the mask, <base>.encoder.layer, the cls (BERT) or lm_head (RoBERTa) head.
def _bert_pre(m: nn.Module, batch: dict):
    base = m.base_model  # bert, roberta
    emb = base.embeddings(input_ids=batch["input_ids"])
    given = batch.get("attention_mask")
    if base.config.is_decoder:  # as BertModel and RobertaModel do
        return emb, compat.causal_mask(base.config, emb, given, None)
    return emb, compat.bidirectional_mask(base.config, emb, given)


def _bert_layer(block: nn.Module, h: torch.Tensor, mask) -> torch.Tensor:
    return compat.block_output(block(h, mask))


def _bert_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.cls(h)


def _roberta_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.lm_head(h)


def masked_lm_loss(logits, m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    """BertForMaskedLM's and RobertaForMaskedLM's loss: cross-entropy over every position,
    -100 ignored."""
    scores = logits(m, h, batch)
    return nn.functional.cross_entropy(scores.view(-1, m.config.vocab_size),
                                       batch["labels"].view(-1))


# ModernBERT (ModernBertForMaskedLM): embeddings, a mask and rotary tables per layer type,
# model.layers, final_norm, head and decoder.
def _modernbert_pre(m: nn.Module, batch: dict):
    base, ids = m.model, batch["input_ids"]
    config, given = base.config, batch.get("attention_mask")
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    types = sorted(set(config.layer_types))
    legacy = getattr(base, "_update_attention_mask", None)
    if legacy is not None:  # 5.0: both masks from the model, computed before the embeddings
        filled = given if given is not None else torch.ones(ids.shape, dtype=torch.bool,
                                                              device=ids.device)
        masks = legacy(filled, output_attentions=False)
    h = base.embeddings(input_ids=ids)
    if legacy is None:
        masks = {"full_attention": compat.bidirectional_mask(config, h, given),
                 "sliding_attention": compat.bidirectional_sliding_window_mask(config, h, given)}
    rotary = {t: base.rotary_emb(h, pos, t) for t in types}
    return h, masks, rotary, pos


def _modernbert_layer(block: nn.Module, h: torch.Tensor, masks, rotary, pos) -> torch.Tensor:
    kind = block.attention_type
    if isinstance(masks, tuple):  # 5.0: the global and the sliding mask, to every layer
        return compat.call_block(block, h, attention_mask=masks[0], sliding_window_mask=masks[1],
                                 position_ids=pos, position_embeddings=rotary[kind])
    return compat.call_block(block, h, attention_mask=masks[kind],
                             position_embeddings=rotary[kind])


def _modernbert_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.decoder(m.head(m.model.final_norm(h)))


def _modernbert_check(m: nn.Module) -> str | None:
    if m.config.sparse_prediction:
        return ("ModernBERT with config.sparse_prediction=True scores only the labelled tokens, "
                "a data-dependent shape fz3's adapter does not follow: set "
                "config.sparse_prediction = False (the same loss)")
    return None


def _modernbert_loss(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.loss_function(_modernbert_logits(m, h, batch), batch["labels"],
                           vocab_size=m.config.vocab_size)


FAMILIES: dict[str, Family] = {
    "bert": Family("bert.encoder.layer", _bert_pre, _bert_layer, _bert_logits,
                   loss=partial(masked_lm_loss, _bert_logits), **MASKED_LM),
    "roberta": Family("roberta.encoder.layer", _bert_pre, _bert_layer, _roberta_logits,
                      loss=partial(masked_lm_loss, _roberta_logits), **MASKED_LM),
    "modernbert": Family("model.layers", _modernbert_pre, _modernbert_layer, _modernbert_logits,
                         loss=_modernbert_loss, check=_modernbert_check, **MASKED_LM),
}
