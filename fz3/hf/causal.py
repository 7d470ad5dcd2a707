"""Adapters for the causal LMs older than transformers' Llama template, by ``config.model_type``:
GPT-2 (``GPT2LMHeadModel``), GPT-NeoX, GPT-J, OPT, BLOOM and Falcon (``...ForCausalLM``).

Each follows its installed model's own ``forward``. Their internals changed within 5.x (5.0's
GPT-J, OPT, BLOOM and Falcon build masks with their own ``_update_causal_mask``, GPT-J's block
computes its rotary tables itself), so masks come from ``compat.own_causal_mask`` and blocks
are called through ``compat.call_block`` (each value under the name the release's block
takes). What a family's forward would do that fz3 does not follow is refused by ``check``,
before any collective: OPT's layer drop in training (fz3 runs every layer), Falcon's ALiBi
(its bias is folded into the mask differently per release).
"""

from __future__ import annotations

from functools import partial
from typing import Mapping

import torch
from torch import nn

from . import compat
from .protocol import TypedFamily as Family


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)


# GPT-2: wte (tied to lm_head) + wpe, a causal mask, transformer.h, ln_f, lm_head.
def _gpt2_pre(m: nn.Module, batch: dict):
    t, ids = m.transformer, batch["input_ids"]
    pos = _positions(ids)
    emb = t.wte(ids)
    mask = compat.causal_mask(t.config, emb, batch.get("attention_mask"), pos)
    return t.drop(emb + t.wpe(pos)), mask, pos


def _gpt2_layer(block: nn.Module, h: torch.Tensor, mask, pos) -> torch.Tensor:
    return compat.block_output(block(h, attention_mask=mask, position_ids=pos))


# GPT-NeoX: embed_in, a causal mask, emb_dropout, rotary tables once, gpt_neox.layers,
# final_layer_norm, the head (embed_out in 5.0, lm_head later: get_output_embeddings names it).
# GPT-J: wte, a causal mask, drop, rotary tables (from rotary_emb; 5.0's attention makes its
# own from the positions), transformer.h, ln_f, lm_head.
def _rotary_pre(names: tuple[str, str, str], m: nn.Module, batch: dict):
    """``(h, mask, rotary tables or None, positions)``; ``names``: the base model's, its
    embedding's and its dropout's attribute names."""
    base_name, embed, dropout = names
    base, ids = getattr(m, base_name), batch["input_ids"]
    pos = _positions(ids)
    h = getattr(base, embed)(ids)
    mask = compat.own_causal_mask(base, h, batch.get("attention_mask"), pos)
    h = getattr(base, dropout)(h)
    rotary = getattr(base, "rotary_emb", None)
    return h, mask, None if rotary is None else rotary(h, position_ids=pos), pos


def _rotary_layer(block: nn.Module, h: torch.Tensor, mask, rotary, pos) -> torch.Tensor:
    return compat.call_block(block, h, attention_mask=mask, position_ids=pos,
                             position_embeddings=rotary)


def _neox_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.get_output_embeddings()(m.gpt_neox.final_layer_norm(h))


def _ln_f_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    return m.lm_head(m.transformer.ln_f(h))


# OPT: embed_tokens, learned positions counted over the unpadded tokens, project_in,
# model.decoder.layers, final_layer_norm and project_out (registered before the layers, so
# assigned to post), lm_head.
def _opt_pre(m: nn.Module, batch: dict):
    dec, ids = m.model.decoder, batch["input_ids"]
    given = batch.get("attention_mask")
    h = dec.embed_tokens(ids)
    counted = given if given is not None else torch.ones(ids.shape, device=ids.device)
    pos = ((torch.cumsum(counted, dim=1) * counted) - 1).long()
    mask = compat.own_causal_mask(dec, h, given, None, fill=True)
    positions = dec.embed_positions(counted, 0, position_ids=pos)
    if dec.project_in is not None:
        h = dec.project_in(h)
    return h + positions, mask, pos


def _opt_layer(block: nn.Module, h: torch.Tensor, mask, pos) -> torch.Tensor:
    return compat.call_block(block, h, attention_mask=mask, position_ids=pos)


def _opt_logits(m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    dec = m.model.decoder
    if dec.final_layer_norm is not None:
        h = dec.final_layer_norm(h)
    if dec.project_out is not None:
        h = dec.project_out(h)
    return m.lm_head(h)


def _opt_assign(m: nn.Module) -> Mapping[str, str]:
    dec = m.model.decoder
    return {f"model.decoder.{name}": "post" for name in ("final_layer_norm", "project_out")
            if getattr(dec, name) is not None}


def _opt_check(m: nn.Module) -> str | None:
    if m.config.layerdrop > 0:
        return (f"OPT's layerdrop={m.config.layerdrop} skips random layers in training, which "
                f"fz3's schedule never does: set config.layerdrop = 0")
    return None


# BLOOM: word_embeddings and their layer norm, ALiBi from the padding mask, a causal mask,
# transformer.h, ln_f, lm_head.
def _bloom_pre(m: nn.Module, batch: dict):
    base, ids = m.transformer, batch["input_ids"]
    given = batch.get("attention_mask")
    emb = base.word_embeddings(ids)
    h = base.word_embeddings_layernorm(emb)
    # with no mask, the model's slopes times 0..T-1: the same values as an all-ones mask's
    counted = given if given is not None else torch.ones(ids.shape, device=ids.device,
                                                          dtype=torch.long)
    alibi = base.build_alibi_tensor(counted, base.num_heads, dtype=h.dtype)
    return h, compat.own_causal_mask(base, emb, given, None, fill=True), alibi


def _bloom_layer(block: nn.Module, h: torch.Tensor, mask, alibi) -> torch.Tensor:
    return compat.call_block(block, h, attention_mask=mask, alibi=alibi)


# Falcon (rotary): word_embeddings, a causal mask always made, rotary tables once,
# transformer.h, ln_f, lm_head.
def _falcon_pre(m: nn.Module, batch: dict):
    base, ids = m.transformer, batch["input_ids"]
    pos = _positions(ids)
    h = base.word_embeddings(ids)
    mask = compat.own_causal_mask(base, h, batch.get("attention_mask"), pos, skip_causal=False)
    return h, mask, base.rotary_emb(h, position_ids=pos), pos


def _falcon_layer(block: nn.Module, h: torch.Tensor, mask, rotary, pos) -> torch.Tensor:
    return compat.call_block(block, h, attention_mask=mask, position_ids=pos,
                             position_embeddings=rotary, alibi=None)


def _falcon_check(m: nn.Module) -> str | None:
    if m.config.alibi:
        return ("Falcon with config.alibi=True (falcon-rw) folds its ALiBi bias into the mask, "
                "differently per transformers release, which fz3's adapter does not follow: "
                "pass layers=, pre= and post= (docs/hf.md, 'A model without a built-in adapter')")
    return None


FAMILIES: dict[str, Family] = {
    "gpt2": Family("transformer.h", _gpt2_pre, _gpt2_layer, _ln_f_logits, head="LMHeadModel"),
    "gpt_neox": Family("gpt_neox.layers",
                       partial(_rotary_pre, ("gpt_neox", "embed_in", "emb_dropout")),
                       _rotary_layer, _neox_logits),
    "gptj": Family("transformer.h", partial(_rotary_pre, ("transformer", "wte", "drop")),
                   _rotary_layer, _ln_f_logits),
    "opt": Family("model.decoder.layers", _opt_pre, _opt_layer, _opt_logits,
                  assign=_opt_assign, check=_opt_check),
    "bloom": Family("transformer.h", _bloom_pre, _bloom_layer, _ln_f_logits),
    "falcon": Family("transformer.h", _falcon_pre, _falcon_layer, _ln_f_logits,
                     check=_falcon_check),
}
