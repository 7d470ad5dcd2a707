"""Built-in adapters for Hugging Face transformers models (``pip install fz3[hf]``), by
``config.model_type`` and the head's class (``...ForCausalLM``, ``...ForMaskedLM``, GPT-2's
``GPT2LMHeadModel``): the tested families, each written out in ``decoders.py``
(transformers' Llama template), ``causal.py`` (GPT-2, GPT-NeoX, GPT-J, OPT, BLOOM, Falcon) or
``encoders.py`` (BERT, RoBERTa, ModernBERT). Another ``...ForCausalLM`` is matched by
structure (``structural.py``: what it holds and what its forwards read, not its type), the
match verified on a tiny copy of it (``verify.py``) and logged once per family as untested;
what matches nothing is refused with the layer containers fz3 sees
(``fz3.sharding.candidates``).

Supported: transformers >=5.0,<6 (``compat.RANGE``; CI tests both ends of it, see
``.ci/hf-range``). ``fz3.shard(model)`` with no ``layers``/``pre``/``post`` looks the model up
here, and refuses other transformers releases before any collective.

An adapter says where the stack lives and what each layer needs: the attention mask, position
ids and the rotary tables are computed once in ``pre`` and passed to every layer; ``post``
applies the final norm and head and the model's own loss on ``batch["labels"]``. Each follows
the installed model's own ``forward``; the mask builders it shares with it are called through
``compat``, which adapts to the release's argument names.

Batches are dicts: ``input_ids`` (B, T), ``labels`` (B, T) and optionally ``attention_mask``
(B, T); ``Adapter.check_batch(batch)`` checks that before a step (see ``batch.py``). The loss
is the mean over ranks of each rank's mean over its labelled tokens: equal to the mean over
all tokens when every rank has the same number of labelled tokens (always for causal LM
without padding; with padding or for MLM, label the same count per rank).
"""

from __future__ import annotations

import functools
import logging
from functools import partial

from torch import nn

from ..sharding.candidates import no_adapter_message
from . import (causal, compat, decoders, encoders, peft_models, structural,
               structural_encoders, verify)
from .protocol import Adapter, TypedFamily, losses as family_losses, make, post

log = logging.getLogger(__name__)

# model_type -> its family: the template decoders', the older causal LMs', the encoders'
TYPED = {**decoders.TYPED, **causal.FAMILIES, **encoders.FAMILIES}
# attention implementations whose masks the adapters build as the models do (flash attention
# unpads or takes no 4-d mask, flex attention takes a BlockMask)
ATTENTION = ("eager", "sdpa")


def adapter_for(module: nn.Module) -> Adapter:
    """The built-in adapter for ``module`` (by ``config.model_type`` and the ending of its
    class name; else the template matched by structure and verified), or a TypeError naming
    the layer containers it holds and the arguments that would run it; ImportError
    when the installed transformers is outside ``compat.RANGE``; ValueError for a config the
    adapter cannot follow (an attention implementation, a family's refused setting). A PEFT
    wrapper (``get_peft_model(model, ...)``) gets its inner model's adapter, seen through the
    wrapper (``peft_models.py``). Local: no collective."""
    wrapped = peft_models.inner_model(module)
    if wrapped is not None:
        inner, path = wrapped
        found = _typed_for(inner)
        if found is None:
            raise TypeError(peft_models.no_adapter_message(module, inner, path, supported()))
        check_attention(inner)
        layers, pre, post = peft_models.through(path, found.layers, found.pre, found.post)
        return found._replace(layers=layers, pre=pre, post=post,
                              logits=peft_models.through_head(path, found.logits),
                              losses=peft_models.through_head(path, found.losses),
                              assign={f"{path}.{k}": v for k, v in found.assign.items()})
    found = _typed_for(module)
    if found is None:
        why = _unmatched(module)
        raise TypeError(no_adapter_message(module, why))
    check_attention(module)
    return found


def supported() -> list[str]:
    """The built-in adapters, for errors: each model type with its head's class name ending."""
    return [f"{t} (...{TYPED[t].head})" for t in sorted(TYPED)]


def check_attention(module: nn.Module) -> None:
    """A ValueError unless the model's attention implementation is one whose masks the
    adapters build as the model does."""
    config = getattr(module, "config", None)
    # transformers has no public accessor for the implementation a model resolved to
    kind = getattr(config, "_attn_implementation", None)
    if kind is not None and kind not in ATTENTION:
        raise ValueError(f"{type(module).__name__} uses attn_implementation={kind!r}; fz3's "
                         f"built-in adapters follow {', '.join(ATTENTION)} only: build the "
                         f"model with attn_implementation='sdpa'")


def _typed_for(module: nn.Module) -> Adapter | None:
    """The adapter chosen by ``config.model_type`` (``TYPED``) for a model of the listed head,
    else the template matched by structure (verified on a tiny copy: a ValueError naming the
    difference), else None; a ValueError where the family refuses the config."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    name = type(module).__name__
    typed = TYPED.get(model_type)
    if typed is None or not name.endswith(typed.head):
        typed = _matched(module)
        if typed is None:
            return None
    else:
        _check_release()
        _refuse(name, typed.check(module))
    typed = typed.configure(typed, module)
    return make(name, typed.layers, typed.pre, partial(post, typed), typed.layer, typed.logits,
                shifted=typed.shifted, assign=typed.assign(module),
                losses=partial(family_losses, typed), layer_aux=typed.layer_aux)


def losses(m: nn.Module, h, batch, *aux) -> tuple:
    """``(loss, {term: value})``: the built-in adapter's loss of ``m`` and its terms
    (``lm_loss``; and ``aux_loss``, the router's load-balancing loss before its
    ``router_aux_loss_coef``, for an MoE model with ``config.output_router_logits``). As a
    step's loss with ``has_aux``: ``fz3.value_and_grad(model, loss=fz3.hf.losses,
    has_aux=True)`` returns ``((loss, terms), grads)``, the same loss and gradients as
    ``post``'s. Local."""
    return adapter_for(m).losses(m, h, batch, *aux)


def _matched(module: nn.Module) -> TypedFamily | None:
    """The template for a Hugging Face model whose structure it follows (``structural`` for a
    causal LM, ``structural_encoders`` for a masked LM), checked on a tiny copy (``verify``: a
    ValueError naming the difference), or None."""
    if not hasattr(getattr(module, "config", None), "model_type"):
        return None
    _check_release()
    template = _template(module)
    shape = template.match(module)
    if isinstance(shape, str):
        return None
    typed = template.family(shape)
    check_attention(module)  # before building a copy with the same implementation
    why = verify.difference(module, typed, template.match, shape)
    if why is not None:
        raise ValueError(f"{type(module).__name__} (model_type {module.config.model_type!r}, "
                         f"not one of fz3's tested families) has the structure of the "
                         f"{template.KIND} template, but the template does not compute its "
                         f"forward: {why}. Pass layers=, pre= and post= (README, 'A model "
                         f"without a built-in adapter')")
    _say_untested(module.config.model_type, type(module).__name__, template.KIND)
    return typed


def _template(module: nn.Module):
    """The template module for the head ``module``'s class ends with: the masked LMs'
    (``structural_encoders``), else the causal LMs' (``structural``)."""
    heads = [c.__name__ for c in type(module).__mro__]
    masked = any(n.endswith(structural_encoders.HEAD) for n in heads)
    return structural_encoders if masked else structural


def _unmatched(module: nn.Module) -> str | None:
    """Why the template does not follow a Hugging Face model (None for another model)."""
    if not hasattr(getattr(module, "config", None), "model_type"):
        return None
    return (f"model_type {module.config.model_type!r} with this head is not one of the tested "
            f"families ({', '.join(supported())}), and the {_template(module).KIND} template "
            f"matched by structure cannot follow it: {_template(module).match(module)}")


@functools.cache
def _say_untested(model_type: str, name: str, kind: str) -> None:
    """Once per family: a model the template follows by structure, not a tested family."""
    log.warning("fz3: %s (model_type %r) is not one of fz3's tested Hugging Face families; "
                "its structure matches the built-in %s template, verified against its "
                "own forward on a tiny random copy", name, model_type, kind)


def _refuse(name: str, why: str | None) -> None:
    if why is not None:
        raise ValueError(f"fz3's built-in adapter for {name}: {why}")


def _check_release() -> None:
    import transformers

    compat.check_version(transformers.__version__)
