"""What a built-in Hugging Face adapter is (``Adapter``, made by ``make``), and what each
family file writes per family (``TypedFamily``, turned into an ``Adapter`` by ``adapters.py``:
``causal.py`` and ``encoders.py`` directly; ``decoders.py`` from its ``Family``, what each
template decoder does differently from the one shared adapter)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import nn

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
    # fz3.shard's assign= for parameters registered before the stack but used after it (OPT's
    # final norm), names relative to the model; the user's assign= adds to it
    assign: Mapping[str, str] = {}
    # (m, h, batch, *aux) -> (loss, {term: value}): post's loss with its terms (``fz3.hf.losses``)
    losses: Callable[..., Any] | None = None
    # each layer returns (h, aux) and post takes the stacks' aux (fz3.shard's layer_aux)
    layer_aux: bool = False


def make(name: str, layers: str, pre, post, layer, logits, shifted: bool = True,
         assign: Mapping[str, str] | None = None, losses=None, layer_aux: bool = False
         ) -> Adapter:
    """The adapter of model class ``name``; ``shifted``: its labels are a causal LM's."""
    return Adapter(layers, pre, post, layer, partial(check_batch, name, shifted=shifted), logits,
                   dict(assign or {}), losses, layer_aux)


class TypedFamily(NamedTuple):
    """One family's adapter, as functions of the model with the head (``causal.py``,
    ``encoders.py``)."""

    layers: str  # the stack's path in the model with the head
    pre: Callable[..., Any]  # (m, batch) -> (h, *extras)
    layer: Callable[..., torch.Tensor]  # (block, h, *extras) -> h
    logits: Callable[..., torch.Tensor]  # (m, h, batch) -> (B, T, V)
    # (m, h, batch) -> the loss the model's own forward computes; None: its loss_function on
    # the logits and labels (``post``)
    # with ``layer_aux``, ``(m, h, batch, aux)``; it may return ``(loss, {term: value})``
    loss: Callable[..., Any] | None = None
    assign: Callable[[nn.Module], Mapping[str, str]] = lambda m: {}
    check: Callable[[nn.Module], str | None] = lambda m: None  # why fz3 cannot follow it
    head: str = "ForCausalLM"  # how the class name of the model with the head ends
    shifted: bool = True  # its labels are a causal LM's (False: masked LM's)
    # the family as this model's config asks (an MoE model with output_router_logits: layers
    # that return their router's statistics, a loss that adds the load-balancing loss)
    configure: Callable[[Any, nn.Module], Any] = lambda family, m: family
    layer_aux: bool = False  # its layers return (h, aux) (``Adapter.layer_aux``)


def losses(family: TypedFamily, m: nn.Module, h: torch.Tensor, batch: dict, *aux) -> tuple:
    """``(loss, {term: value})``: the loss of ``family``'s model, its own (``loss``) or its
    ``loss_function``'s (``{"lm_loss": loss}``); ``aux``: the stacks' aux outputs
    (``layer_aux``)."""
    if family.loss is not None:
        out = family.loss(m, h, batch, *aux)
    else:
        out = m.loss_function(logits=family.logits(m, h, batch), labels=batch["labels"],
                              vocab_size=m.config.vocab_size)
    return out if isinstance(out, tuple) else (out, {"lm_loss": out})


def post(family: TypedFamily, m: nn.Module, h: torch.Tensor, batch: dict, *aux) -> torch.Tensor:
    """The loss of ``family``'s model (``losses`` without its terms)."""
    return losses(family, m, h, batch, *aux)[0]
