"""A structural match checked, never guessed (``structural.py``): the template's loss and
logits must equal the model's own ``forward``'s on a tiny random copy built from the same
config (2 layers, small widths, fp32, eval mode, a left-padded row), at rtol 1e-5.

The copy keeps every setting of the config but its sizes: 2 layers (the first and the first
that differs from it in a per-layer list such as ``layer_types``, so both kinds are
compared), at most 2 attention heads of the model's own head width, small MLP and expert
widths, at most 4 experts, a vocabulary of 128 (special token ids beyond it unset) and a
sliding window of 3 tokens, shorter than the 8 compared (a window the template ignored would
show). Built on the CPU from a fixed seed in a forked RNG: every rank reaches the same
verdict, and the caller's random state is untouched.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from .protocol import TypedFamily, losses

SEQ = 8  # tokens compared; longer than the copy's sliding window
VOCAB = 128
HEADS = 2
# (config key, its largest value in the copy)
WIDTHS = (("intermediate_size", 64), ("moe_intermediate_size", 32),
          ("shared_expert_intermediate_size", 32), ("num_local_experts", 4), ("num_experts", 4),
          ("n_routed_experts", 4), ("num_experts_per_tok", 2), ("sliding_window", 3))
TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id")


def difference(m: nn.Module, typed: TypedFamily, match: Callable[[nn.Module], Any],
               shape: Any) -> str | None:
    """Why the template ``typed`` (made from ``shape``, ``match(m)``) does not compute ``m``'s
    forward on a tiny copy of it, or None when the copy has the same structure and its loss
    and logits equal the model's (rtol 1e-5, atol 1e-6). Local."""
    try:
        tiny = tiny_copy(m)
    except Exception as e:  # a config the shrinking broke: say so rather than guess
        return f"its tiny copy could not be built from its config ({type(e).__name__}: {e})"
    if match(tiny) != shape:  # the shrinking dropped a module (a projection to equal widths)
        return (f"its tiny copy has another structure ({match(tiny)}) than it has ({shape}), "
                f"so the template's match cannot be checked")
    batch = _batch(tiny.config.vocab_size)
    with torch.no_grad():
        try:
            own = tiny(**batch, **({"use_cache": False} if typed.shifted else {}))
        except Exception as e:  # the shrinking broke a rule of the model's: say so
            return (f"its tiny copy's own forward failed ({type(e).__name__}: "
                    f"{str(e)[:200]}), so the template's match cannot be checked")
        try:
            out = typed.pre(tiny, batch)
            h, extras = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
            for block in tiny.get_submodule(typed.layers):
                h = typed.layer(block, h, *extras)
            loss, _ = losses(typed, tiny, h, batch)
            logits = typed.logits(tiny, h, batch)
        except Exception as e:
            return f"the template failed on its tiny copy ({type(e).__name__}: {e})"
    if logits.shape != own.logits.shape:
        return f"the template's logits have shape {list(logits.shape)}, its own " \
               f"{list(own.logits.shape)}"
    for what, got, want in (("loss", loss, own.loss), ("logits", logits, own.logits)):
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True):
            worst = (got - want).abs().max()
            return (f"on a tiny random copy (2 layers, fp32) the template's {what} differs from "
                    f"{type(m).__name__}'s own forward by up to {float(worst):.3g} (loss "
                    f"{float(loss):.6f} against {float(own.loss):.6f})")
    return None


def tiny_copy(m: nn.Module) -> nn.Module:
    """A random ``type(m)`` of 2 layers and small widths from ``m.config``, fp32, eval mode."""
    config = tiny_config(m.config)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(0)
        tiny = type(m)(config)
    return tiny.float().eval()


def tiny_config(config: Any) -> Any:
    """``config`` with the sizes module doc says, every other setting as it is."""
    config = copy.deepcopy(config)
    layers = config.num_hidden_layers
    kept = _two_layers(config, layers)
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == layers and layers > 2:
            setattr(config, key, type(value)(value[i] for i in kept))
    config.num_hidden_layers = len(kept)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    fused = config.hidden_size == heads * head_dim
    config.num_attention_heads = min(heads, HEADS)
    if hasattr(config, "num_key_value_heads") and config.num_key_value_heads is not None:
        config.num_key_value_heads = max(1, config.num_attention_heads * kv // heads)
    if fused:
        config.hidden_size = config.num_attention_heads * head_dim
    elif config.hidden_size > 64:
        config.hidden_size = 64
    for key, top in WIDTHS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > top:
            setattr(config, key, top)
    if config.vocab_size > VOCAB:
        config.vocab_size = VOCAB
        for key in TOKENS:
            ids = getattr(config, key, None)
            if isinstance(ids, int) and ids >= VOCAB or isinstance(ids, list) and \
                    any(i >= VOCAB for i in ids):
                setattr(config, key, None)
    config.use_cache = False
    return config


def _two_layers(config: Any, layers: int) -> list[int]:
    """The first layer and the first one whose per-layer settings (a list of one entry per
    layer, ``layer_types``) differ from it; else the first two."""
    if layers <= 2:
        return list(range(layers))
    lists = [v for v in vars(config).values() if isinstance(v, (list, tuple)) and
             len(v) == layers]
    differs = next((i for i in range(1, layers) if any(v[i] != v[0] for v in lists)), 1)
    return [0, differs]


def _batch(vocab: int) -> dict:
    """Two rows of ``SEQ`` tokens, the first left-padded by 3, labels on every token."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (2, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}
