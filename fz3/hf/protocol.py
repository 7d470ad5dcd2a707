"""What a built-in Hugging Face adapter is (``Adapter``), and how one is made for a model class
(``make``): shared by ``adapters.py`` and the per-family files (``decoders.py``, ``causal.py``,
``encoders.py``)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, NamedTuple

import torch

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


def make(name: str, layers: str, pre, post, layer, logits, shifted: bool = True,
         assign: Mapping[str, str] | None = None) -> Adapter:
    """The adapter of model class ``name``; ``shifted``: its labels are a causal LM's."""
    return Adapter(layers, pre, post, layer, partial(check_batch, name, shifted=shifted), logits,
                   dict(assign or {}))
