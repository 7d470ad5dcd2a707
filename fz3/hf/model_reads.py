"""What a Hugging Face model holds and what its forwards read, as the templates matched by
structure see it (``structural.py`` for ``...ForCausalLM``, ``structural_encoders.py`` for
``...ForMaskedLM``): its base model and ends, a module's name in its parent, whether it holds
weights, the config keys
a class's ``forward`` reads, and which of the templates' arguments a layer or a rotary module
takes. Local, read once per class."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Iterable

from torch import nn

# what the templates may pass a layer, by name
LAYER_ARGUMENTS = ("attention_mask", "position_ids", "position_embeddings")


def child_name(parent: nn.Module, child: nn.Module) -> str | None:
    """The name under which ``parent`` holds ``child`` directly, or None."""
    return next((n for n, c in parent.named_children() if c is child), None)


def ends(m: nn.Module) -> tuple[str, nn.Module, nn.Module | None, nn.Module | None] | str:
    """``(base name, base model, head, embedding)`` of a model with a head, as it says them
    (``base_model_prefix``, ``get_output_embeddings``, ``get_input_embeddings``), or why it
    does not say them (a sentence)."""
    name, base_name = type(m).__name__, getattr(m, "base_model_prefix", "")
    base = getattr(m, base_name, None) if base_name else None
    try:
        head = m.get_output_embeddings()
        embed = base.get_input_embeddings() if isinstance(base, nn.Module) else None
    except (AttributeError, NotImplementedError) as e:  # a wrapper that does not say
        return f"{name} does not say where its embedding and head are ({e})"
    return base_name, base, head, embed


def holds(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter or a buffer."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def reads_of(classes: Iterable[type]) -> frozenset[str]:
    """The config keys the ``forward`` of any of ``classes`` reads (``reads``)."""
    return frozenset().union(*(reads(c) for c in classes))


@functools.cache
def reads(cls: type) -> frozenset[str]:
    """The config keys ``cls.forward`` reads: ``config.x`` (or ``getattr(config, "x", ...)``),
    and ``self.y`` where ``__init__`` set ``self.y`` to one. Read once per class."""
    forward = _source(getattr(cls, "forward", None))
    init = _source(getattr(cls, "__init__", None))
    read = r"(?:(?:self\.)?config\.(\w+)|getattr\((?:self\.)?config,\s*[\"'](\w+)[\"'][^)]*\))"
    kept = {a: b or c for a, b, c in re.findall(rf"self\.(\w+)\s*=\s*{read}\s*$", init, re.M)}
    keys = {b or c for b, c in re.findall(read, forward)}
    keys |= {kept[a] for a in re.findall(r"self\.(\w+)", forward) if a in kept}
    return frozenset(keys)


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def refused_keys(keys: frozenset[str], config, followed: frozenset[str],
                 applies: str) -> str | None:
    """Why a forward reading ``keys`` cannot be followed: the keys of ``config`` it reads that
    are not ``followed`` (``applies``: what the template does apply, for the message)."""
    unknown = sorted(k for k in keys - followed if hasattr(config, k))
    if unknown:
        shown = ", ".join(f"config.{k}={getattr(config, k)!r}" for k in unknown)
        return (f"its forward reads {shown}, which the template does not apply (it applies "
                f"{applies})")
    return None


def rotary_refused(base: nn.Module, rotary: list[str]) -> str | None:
    """Why the rotary module ``rotary`` of ``base`` cannot be called ``rotary(h, positions)``."""
    if not rotary:
        return None
    params = list(inspect.signature(type(getattr(base, rotary[0])).forward).parameters.values())
    required = [p.name for p in params[3:] if p.default is p.empty and
                p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        return (f"its rotary module {type(getattr(base, rotary[0])).__name__} needs {required} "
                f"beside the positions (tables per layer type); the template makes one pair")
    return None


def layer_arguments(block: nn.Module, rotary: list[str]) -> tuple[tuple[str, ...], str | None]:
    """The template's arguments (``LAYER_ARGUMENTS``) the layer takes, or why it cannot be
    called with them."""
    params = list(inspect.signature(type(block).forward).parameters.values())[2:]
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    required = [p.name for p in params if p.default is p.empty and
                p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in LAYER_ARGUMENTS]
    passes = tuple(a for a in LAYER_ARGUMENTS if a in named or var_keyword)
    if required:
        return passes, (f"its layer {type(block).__name__}.forward needs {required}, which the "
                        f"template does not pass (it passes {', '.join(LAYER_ARGUMENTS)})")
    if rotary and "position_embeddings" not in passes:
        return passes, (f"its layer {type(block).__name__}.forward takes no "
                        f"position_embeddings, and the template hands it the rotary tables")
    if "attention_mask" not in passes:
        return passes, f"its layer {type(block).__name__}.forward takes no attention_mask"
    return passes, None
