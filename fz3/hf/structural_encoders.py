"""The built-in encoder template matched by structure: a Hugging Face ``...ForMaskedLM``
whose ``model_type`` is none of the tested families' (``adapters.TYPED``) is followed when
what it holds and what its forwards read are what BERT's masked LM does, whatever its type
is called (``structural.py`` is the same for decoders).

What the model must hold (``match``, read from its modules, never from ``model_type``):

- the model with the head holds its base model (``base_model_prefix``) and, beside it, the
  modules of its head (every child with weights, run in the order registered; the last holds
  ``get_output_embeddings``, a decoder tied to the embedding or not), nothing else;
- the base model holds, in this order: the embeddings (the first child with weights, holding
  ``get_input_embeddings``; called on the token ids, so positions and token types are made
  as the model makes them), any projection after them (ELECTRA's ``embeddings_project``),
  one ``nn.ModuleList`` of ``config.num_hidden_layers`` layers (a child, or the only child with
  weights of one: BERT's ``encoder.layer``), then at most norms (modules whose parameters are
  all vectors), inside that child or beside it; and optionally rotary tables (a module with an
  ``inv_freq`` buffer, called ``rotary(h, position_ids)``). Anything else with weights (a
  pooler, a relative-position bias) is refused by name, and so is a dropout of its own;
- each layer takes its hidden states and no required argument but ``attention_mask``,
  ``position_ids`` and ``position_embeddings``;
- the config keys the base model's, its layers' container's and the head's ``forward`` read
  are ones the template applies (``FOLLOWED``: one bidirectional mask; ``is_decoder`` off).
  Any other (Ernie's ``task_type_vocab_size``) is refused by name.

The loss is BERT's: cross-entropy over every position's label, -100 ignored. A match is then
verified (``fz3.hf.verify``) on a tiny random copy, as the decoders' is.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from . import compat
from .encoders import MASKED_LM, masked_lm_loss
from .model_reads import ends, holds, layer_arguments, reads_of, refused_keys, rotary_refused
from .protocol import TypedFamily

HEAD = "ForMaskedLM"
KIND = "encoder"
# config keys the template applies (or that change nothing it computes) when the forwards
# read them; is_decoder is refused when on (the template builds one bidirectional mask)
FOLLOWED = frozenset({
    "vocab_size", "num_hidden_layers", "pad_token_id", "use_cache", "use_return_dict",
    "return_dict", "output_attentions", "output_hidden_states", "_attn_implementation",
    "is_decoder", "is_encoder_decoder", "add_cross_attention"})
APPLIED = "one bidirectional mask, the embeddings' own positions and token types"


class Structure(NamedTuple):
    """Where the template finds each piece of one masked LM (names relative to the base
    model, the head's relative to the model with the head)."""

    base: str  # the base model, in the model with the head ("bert")
    before: tuple[str, ...]  # run before the layers, the embeddings first ("embeddings")
    layers: str  # the nn.ModuleList of layers ("encoder.layer")
    after: tuple[str, ...]  # the norms run after the layers ("encoder.LayerNorm")
    rotary: str | None  # the rotary tables' module
    head: tuple[str, ...]  # the head's modules, in the model with the head ("cls")
    passes: tuple[str, ...]  # the arguments the layers take


def match(m: nn.Module) -> Structure | str:
    """The structure of ``m`` as the template follows it, or why it cannot (a sentence
    naming the module, argument or config key). Local."""
    name, config, found = type(m).__name__, m.config, ends(m)
    if isinstance(found, str):
        return found
    base_name, base, out, embed = found
    if not isinstance(base, nn.Module) or out is None or embed is None:
        return f"{name} holds no base model (base_model_prefix), embedding and head to follow"
    head = tuple(n for n, c in m.named_children() if n != base_name and holds(c))
    if not head or not any(c is out for c in getattr(m, head[-1]).modules()):
        return f"{name}'s last module beside {base_name} ({head}) is not its output embedding"
    found = _layers(base, config.num_hidden_layers)
    if isinstance(found, str):
        return found
    before, layers, after, rotary = found
    if not before or not any(c is embed for c in getattr(base, before[0]).modules()):
        return f"{type(base).__name__}'s first module {before[:1]} does not hold its embedding"
    dropouts = [n for n, c in [*m.named_children(), *base.named_children()]
                if isinstance(c, nn.Dropout) and c.p > 0]
    if dropouts:
        return f"{name} applies dropouts {dropouts} of its own; the template applies none"
    wrapper = layers.rsplit(".", 1)[0] if "." in layers else None
    keys = reads_of((type(m), type(base), *([type(base.get_submodule(wrapper))]
                                           if wrapper else [])))
    why = refused_keys(keys, config, FOLLOWED, APPLIED) or rotary_refused(base, rotary)
    if why is None and getattr(config, "is_decoder", False):
        why = "config.is_decoder=True (causal masks); the template follows bidirectional encoders"
    if why:
        return why
    passes, why = layer_arguments(base.get_submodule(layers)[0], rotary)
    if not rotary:  # nothing of the template's but the mask for a layer without rotary tables
        passes = ("attention_mask",)
    return why or Structure(base_name, before, layers, after, rotary[0] if rotary else None,
                            head, passes)


def _layers(base: nn.Module, count: int):
    """``(before, layers, after, rotary)``: the base model's modules around its one list of
    ``count`` layers, or why it holds something else."""
    lists = [f"{n}.{k}" if k else n for n, c in base.named_children()
             for k, x in ([("", c)] if isinstance(c, nn.ModuleList) else c.named_children())
             if isinstance(x, nn.ModuleList) and len(x) == count]
    if len(lists) != 1:
        return (f"{type(base).__name__} holds {len(lists)} ModuleLists of "
                f"config.num_hidden_layers={count} layers ({lists}); the template follows one")
    rotary = [n for n, c in base.named_children() if "inv_freq" in dict(c.named_buffers())]
    outer = lists[0].split(".")[0]
    named = [(n, c) for n, c in base.named_children() if n not in rotary and holds(c)]
    at = [n for n, _ in named].index(outer)
    inner = [] if outer == lists[0] else [
        (f"{outer}.{n}", c) for n, c in base.get_submodule(outer).named_children() if holds(c)]
    within = [n for n, _ in inner].index(lists[0]) if inner else 0
    if within:
        return f"{type(base).__name__} holds {[n for n, _ in inner[:within]]} before its layers"
    after = inner[within + 1:] + named[at + 1:]
    bad = [n for n, c in after if any(p.dim() != 1 for p in c.parameters()) or
           any(True for _ in c.buffers())]
    if bad or len(rotary) > 1:
        return (f"{type(base).__name__} holds {bad + rotary[1:]} after its layers; the template "
                f"follows norms there (and one rotary module)")
    return tuple(n for n, _ in named[:at]), lists[0], tuple(n for n, _ in after), rotary


def family(s: Structure) -> TypedFamily:
    """The adapter's functions for a masked LM of structure ``s`` (``adapters.py`` makes the
    ``Adapter``)."""
    logits_of = partial(logits, s)
    return TypedFamily(f"{s.base}.{s.layers}", partial(pre, s), partial(layer, s), logits_of,
                       loss=partial(masked_lm_loss, logits_of), assign=partial(assign, s),
                       **MASKED_LM)


def pre(s: Structure, m: nn.Module, batch: dict):
    """``(h, mask, rotary tables or None, positions)``, as the base model makes them."""
    base, ids = getattr(m, s.base), batch["input_ids"]
    h = getattr(base, s.before[0])(ids)
    for name in s.before[1:]:
        h = getattr(base, name)(h)
    mask = compat.bidirectional_mask(base.config, h, batch.get("attention_mask"))
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    rotary = None if s.rotary is None else getattr(base, s.rotary)(h, pos)
    return h, mask, rotary, pos


def layer(s: Structure, block: nn.Module, h: torch.Tensor, mask, rotary, pos) -> torch.Tensor:
    """One layer with the mask (and the rotary tables and positions where it takes them)."""
    values = dict(attention_mask=mask, position_ids=pos, position_embeddings=rotary)
    return compat.block_output(block(h, **{k: values[k] for k in s.passes}))


def logits(s: Structure, m: nn.Module, h: torch.Tensor, batch: dict) -> torch.Tensor:
    """The norms after the layers, then the head's modules."""
    base = getattr(m, s.base)
    for name in s.after:
        h = base.get_submodule(name)(h)
    for name in s.head:
        h = getattr(m, name)(h)
    return h


def assign(s: Structure, m: nn.Module) -> dict[str, str]:
    """Each module to the part that runs it, wherever it is registered (XLM-RoBERTa holds its
    head before its base model); a decoder tied to the embedding is read by both."""
    return {**{f"{s.base}.{n}": "pre" for n in s.before},
            **{f"{s.base}.{n}": "post" for n in s.after}, **{n: "post" for n in s.head}}
