"""Built-in adapters for Hugging Face transformers models (``pip install fz3[hf]``).

Supported: transformers >=5.0,<6 (``compat.RANGE``; CI tests both ends of it, see
``.ci/hf-range``). ``fz3.shard(model)`` with no ``layers``/``pre``/``post`` looks the model's
class up here, and refuses other transformers releases before any collective.

An adapter says where the stack lives and what each layer needs: the attention mask, position
ids and (Llama) the rotary tables are computed once in ``pre`` and passed to every layer;
``post`` applies the final norm and head and the model's own loss on ``batch["labels"]``.
Each follows the installed model's own ``forward``; the mask builders it shares with it are
called through ``compat``, which adapts to the release's argument names. The decoders built
on transformers' Llama template share one adapter, chosen by ``config.model_type``
(``decoders.py``).

Batches are dicts: ``input_ids`` (B, T), ``labels`` (B, T) and optionally ``attention_mask``
(B, T); ``Adapter.check_batch(batch)`` checks that before a step (see ``batch.py``). The loss
is the mean over ranks of each rank's mean over its labelled tokens: equal to the mean over
all tokens when every rank has the same number of labelled tokens (always for causal LM
without padding; with padding or for MLM, label the same count per rank).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from . import compat, decoders, peft_models
from .batch import check_batch


class Adapter(NamedTuple):
    layers: str  # dotted path of the nn.ModuleList of blocks
    pre: Callable[..., Any]  # (m, batch) -> (h, *extras)
    post: Callable[..., torch.Tensor]  # (m, h, batch) -> scalar loss
    layer: Callable[..., torch.Tensor]  # (block, h, *extras) -> h
    # (batch) -> why it has nothing to learn from, or None; raises naming what it expects
    check_batch: Callable[[Any], str | None]
    # (m, h, batch) -> (B, T, V) logits, as the model's own forward returns them
    # (``fz3.apply(..., output="logits")``)
    logits: Callable[..., torch.Tensor]


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # (1, T), as HF without cache


# GPT-2 (GPT2LMHeadModel): wte (tied to lm_head) + wpe, blocks transformer.h, ln_f, lm_head.
def _gpt2_pre(m: nn.Module, batch: dict):
    t, ids = m.transformer, batch["input_ids"]
    pos = _positions(ids)
    emb = t.wte(ids)
    mask = compat.causal_mask(t.config, emb, batch.get("attention_mask"), pos)
    return t.drop(emb + t.wpe(pos)), mask, pos


def _gpt2_layer(block: nn.Module, h: torch.Tensor, mask, pos) -> torch.Tensor:
    return compat.block_output(block(h, attention_mask=mask, position_ids=pos))


def _gpt2_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.lm_head(m.transformer.ln_f(h))


def _gpt2_post(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.loss_function(logits=_gpt2_logits(m, h, batch), labels=batch["labels"],
                           vocab_size=m.config.vocab_size)


# Llama (LlamaForCausalLM): embed_tokens, rotary tables once, layers model.layers, norm, lm_head.
def _llama_pre(m: nn.Module, batch: dict):
    base, ids = m.model, batch["input_ids"]
    pos = _positions(ids)
    h = base.embed_tokens(ids)
    mask = compat.causal_mask(base.config, h, batch.get("attention_mask"), pos)
    return h, mask, base.rotary_emb(h, position_ids=pos), pos


def _llama_layer(block: nn.Module, h: torch.Tensor, mask, rotary, pos) -> torch.Tensor:
    return block(h, attention_mask=mask, position_ids=pos, position_embeddings=rotary)


def _llama_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.lm_head(m.model.norm(h))


def _llama_post(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.loss_function(logits=_llama_logits(m, h, batch), labels=batch["labels"],
                           vocab_size=m.config.vocab_size)


# RoBERTa (RobertaForMaskedLM): embeddings, bidirectional mask, roberta.encoder.layer, lm_head.
def _roberta_pre(m: nn.Module, batch: dict):
    base = m.roberta
    emb = base.embeddings(input_ids=batch["input_ids"])  # position ids skip padding_idx tokens
    given = batch.get("attention_mask")
    if base.config.is_decoder:  # as RobertaModel does
        return emb, compat.causal_mask(base.config, emb, given, None)
    return emb, compat.bidirectional_mask(base.config, emb, given)


def _roberta_layer(block: nn.Module, h: torch.Tensor, mask) -> torch.Tensor:
    return block(h, mask)


def _roberta_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.lm_head(h)


def _roberta_post(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    scores = _roberta_logits(m, h, batch)
    labels = batch["labels"].view(-1)
    return nn.functional.cross_entropy(scores.view(-1, m.config.vocab_size), labels)


def _adapter(name: str, layers: str, pre, post, layer, logits, shifted: bool = True) -> Adapter:
    return Adapter(layers, pre, post, layer, partial(check_batch, name, shifted=shifted), logits)


ADAPTERS: dict[str, Adapter] = {
    "GPT2LMHeadModel": _adapter("GPT2LMHeadModel", "transformer.h", _gpt2_pre, _gpt2_post,
                                _gpt2_layer, _gpt2_logits),
    "LlamaForCausalLM": _adapter("LlamaForCausalLM", "model.layers", _llama_pre, _llama_post,
                                 _llama_layer, _llama_logits),
    "RobertaForMaskedLM": _adapter("RobertaForMaskedLM", "roberta.encoder.layer", _roberta_pre,
                                   _roberta_post, _roberta_layer, _roberta_logits,
                                   shifted=False),
}


def adapter_for(module: nn.Module) -> Adapter:
    """The built-in adapter for ``module``'s class, or a TypeError naming the fix; ImportError
    when the installed transformers is outside ``compat.RANGE``. A PEFT wrapper
    (``get_peft_model(model, ...)``) gets its inner model's adapter, seen through the wrapper
    (``peft_models.py``). Local: no collective."""
    wrapped = peft_models.inner_model(module)
    if wrapped is not None:
        inner, path = wrapped
        if type(inner).__name__ not in ADAPTERS and _decoder_for(inner) is None:
            raise TypeError(peft_models.no_adapter_message(module, inner, path, sorted(ADAPTERS)))
        found = adapter_for(inner)
        layers, pre, post = peft_models.through(path, found.layers, found.pre, found.post)
        return found._replace(layers=layers, pre=pre, post=post,
                              logits=peft_models.through_head(path, found.logits))
    name = type(module).__name__
    decoder = _decoder_for(module)
    if decoder is not None:
        import transformers

        compat.check_version(transformers.__version__)
        return decoder
    if name not in ADAPTERS:
        raise TypeError(f"fz3.shard got no layers=/pre=/post= and has no built-in adapter for "
                        f"{name} (built in: {', '.join(sorted(ADAPTERS))}, and the "
                        f"ForCausalLM models of config.model_type "
                        f"{', '.join(sorted(decoders.FAMILIES))}); pass layers='<dotted "
                        f"path of the nn.ModuleList>', pre=(m, batch) -> h and "
                        f"post=(m, h, batch) -> loss")
    import transformers

    compat.check_version(transformers.__version__)
    return ADAPTERS[name]


def _decoder_for(module: nn.Module) -> Adapter | None:
    """The template decoders' adapter (``decoders.py``) for a ``...ForCausalLM`` whose
    ``config.model_type`` is listed, else None."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    family = decoders.FAMILIES.get(model_type)
    if family is None or not type(module).__name__.endswith("ForCausalLM"):
        return None
    return _adapter(type(module).__name__, "model.layers", partial(decoders.pre, family),
                    partial(decoders.post, family), decoders.layer,
                    partial(decoders.logits, family))
