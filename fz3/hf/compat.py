"""The transformers releases fz3's adapters support, and calls into transformers' internal mask
builders that adapt to the signature they find.

transformers has no public function that builds a model's attention mask without running the
model's forward, so the adapters call the helpers the models call themselves,
``transformers.masking_utils.create_causal_mask`` and ``create_bidirectional_mask``. Their
argument names changed inside 5.x (read from each release's source):

==========  ==========================================  ================================
release     create_causal_mask takes                    create_bidirectional_mask takes
==========  ==========================================  ================================
5.0-5.1     input_embeds, cache_position (required),    input_embeds
            past_key_values
5.2-5.8     inputs_embeds, cache_position (required),   inputs_embeds (past_key_values=
            past_key_values                             None from 5.4)
5.9-5.23    inputs_embeds, past_key_values              inputs_embeds, past_key_values=None
5.24        inputs_embeds, cache                        inputs_embeds, cache=None
==========  ==========================================  ================================

Each helper below reads the signature it finds and passes each value under the name that
release uses (``_ALIASES``); a required argument it does not know, or a value it needs that the
release takes under no known name, raises an error naming the release and the supported range.

The models older than the Llama template changed more within 5.x: in 5.0, GPT-J, OPT, BLOOM
and Falcon build their masks with their own ``_update_causal_mask`` (``own_causal_mask`` calls
it the same way), and their blocks take other arguments (``call_block`` passes each value
under a name the block takes; 5.0's GPT-J block makes its own rotary tables).
``bidirectional_sliding_window_mask`` is ModernBERT's local layers' builder (5.24).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable

import torch

# The range pyproject.toml's `hf` extra declares; CI tests both ends (constraints.txt pins the
# top, constraints-hf-low.txt the bottom: see .ci/hf-range).
LOWEST = (5, 0)
BELOW = (6, 0)
RANGE = ">=5.0,<6"

# signature name -> the value it means (releases renamed arguments, not their meaning)
_ALIASES = {
    "config": "config",
    "inputs_embeds": "embeds", "input_embeds": "embeds",
    "attention_mask": "attention_mask",
    "cache": "cache", "past_key_values": "cache",
    "cache_position": "cache_position",
    "position_ids": "position_ids",
    # the older models' own builders (``_update_causal_mask``, 5.0)
    "input_tensor": "embeds", "output_attentions": "output_attentions", "alibi": "alibi",
    "allow_is_causal_skip": "allow_is_causal_skip",
}
# What a mask builder must take: one that took attention_mask under an unknown name with a
# default of None would silently build a mask without the padding.
_NEEDS = ("config", "embeds", "attention_mask")


def check_version(version: str) -> None:
    """Raise ImportError if transformers ``version`` (e.g. ``"5.17.0"``) is outside ``RANGE``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or not LOWEST <= (int(found[1]), int(found[2])) < BELOW:
        raise ImportError(f"fz3's Hugging Face adapters support transformers{RANGE}; transformers "
                          f"{version} is installed. Install a supported release (pip install "
                          f"'transformers{RANGE}') or pass layers=, pre= and post= to fz3.shard")


def causal_mask(config: Any, embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, *, skip_causal: bool = True) -> Any:
    """``create_causal_mask`` for a whole sequence, no KV cache. ``embeds`` (B, T, d) gives the
    batch, length and dtype; ``attention_mask`` (B, T) 1 = token, 0 = padding. Returns what the
    release's attention layers take: a (B, 1, T, T) mask, or None where ``is_causal`` suffices
    (``skip_causal=False``: a mask even then, Falcon's ``allow_is_causal_skip=False``)."""
    from transformers.masking_utils import create_causal_mask

    seq = torch.arange(embeds.shape[1], device=embeds.device)  # cache_position, where asked for
    values = dict(config=config, embeds=embeds, attention_mask=attention_mask, cache=None,
                  cache_position=seq, position_ids=position_ids)
    needs = _NEEDS
    if not skip_causal:
        values["allow_is_causal_skip"] = False
        needs += ("allow_is_causal_skip",)
    return call_by_name(create_causal_mask, values, needs=needs)


def own_causal_mask(model: Any, embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, *, fill: bool = False,
                    skip_causal: bool = True) -> Any:
    """The causal mask a base model's own ``forward`` builds: its ``_update_causal_mask`` where
    its release still has one (StableLM, GPT-J, OPT, BLOOM, Falcon in 5.0), else
    ``causal_mask``. ``fill``: the old builder is given an all-ones mask where none is (as
    OPT's and BLOOM's 5.0 forwards do before building); ``skip_causal``: as for
    ``causal_mask``."""
    legacy = getattr(type(model), "_update_causal_mask", None)
    if legacy is None:
        return causal_mask(model.config, embeds, attention_mask, position_ids,
                           skip_causal=skip_causal)
    if fill and attention_mask is None:
        attention_mask = torch.ones(embeds.shape[:2], device=embeds.device)
    seq = torch.arange(embeds.shape[1], device=embeds.device)
    values = dict(embeds=embeds, attention_mask=attention_mask, cache=None, cache_position=seq,
                  output_attentions=False, alibi=None)
    # the signature read once per class (a bound method per model would keep every model)
    names = _names(legacy, ("embeds", "attention_mask"), tuple(values))
    return legacy(model, **{name: values[meaning] for name, meaning in names})


def call_block(block: Any, h: torch.Tensor, **values: Any) -> torch.Tensor:
    """``block(h, **values)``'s hidden states, each value passed by name where the installed
    release's block takes it (their arguments changed within 5.x: GPT-J's block took no
    rotary tables in 5.0, computing them itself from ``position_ids``). A value that is not
    None and that the block does not take, or an argument it requires and is not given,
    means a release fz3 does not follow: ImportError naming it."""
    names, required = _block_arguments(type(block).forward)
    given = {k: v for k, v in values.items() if k in names}
    lost = [k for k, v in values.items() if v is not None and k not in names]
    missing = [k for k in required if k not in given]
    if lost or missing:
        raise ImportError(f"transformers {_version()}: {type(block).__name__}.forward"
                          f"{inspect.signature(type(block).forward)} takes no {lost} or needs "
                          f"{missing}; fz3's Hugging Face adapters follow transformers{RANGE} "
                          f"as tested in CI. Install a supported release or pass layers=, "
                          f"pre= and post= to fz3.shard")
    return block_output(block(h, **given))


@functools.cache
def _block_arguments(forward: Callable[..., Any]) -> tuple[frozenset[str], tuple[str, ...]]:
    """A block's keyword arguments after ``self`` and the hidden states, and the required
    ones among them: read once per class."""
    params = list(inspect.signature(forward).parameters.values())[2:]
    plain = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return (frozenset(p.name for p in plain),
            tuple(p.name for p in plain if p.default is p.empty))


def sliding_window_mask(config: Any, embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None) -> Any:
    """``create_sliding_window_causal_mask`` (``config.sliding_window`` tokens back); arguments
    as for ``causal_mask``."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    seq = torch.arange(embeds.shape[1], device=embeds.device)
    values = dict(config=config, embeds=embeds, attention_mask=attention_mask, cache=None,
                  cache_position=seq, position_ids=position_ids)
    return call_by_name(create_sliding_window_causal_mask, values, needs=_NEEDS)


def bidirectional_sliding_window_mask(config: Any, embeds: torch.Tensor,
                                      attention_mask: torch.Tensor | None) -> Any:
    """``create_bidirectional_sliding_window_mask`` (ModernBERT's local layers: every unpadded
    token within ``config.sliding_window`` on either side); arguments as for ``causal_mask``."""
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    values = dict(config=config, embeds=embeds, attention_mask=attention_mask, cache=None)
    return call_by_name(create_bidirectional_sliding_window_mask, values, needs=_NEEDS)


def bidirectional_mask(config: Any, embeds: torch.Tensor,
                       attention_mask: torch.Tensor | None) -> Any:
    """``create_bidirectional_mask`` (encoders: every token sees every unpadded token);
    arguments as for ``causal_mask``."""
    from transformers.masking_utils import create_bidirectional_mask

    values = dict(config=config, embeds=embeds, attention_mask=attention_mask, cache=None)
    return call_by_name(create_bidirectional_mask, values, needs=_NEEDS)


def call_by_name(fn: Callable[..., Any], values: dict[str, Any], needs: tuple[str, ...]) -> Any:
    """Call ``fn`` with ``values`` (keyed by meaning, see ``_ALIASES``) under the names its
    signature uses. Every value in ``needs`` must be taken and every required argument known,
    else the release is one fz3 does not follow: ImportError naming it and the supported range."""
    return fn(**{name: values[meaning] for name, meaning in _names(fn, needs, tuple(values))})


@functools.cache
def _names(fn: Callable[..., Any], needs: tuple[str, ...],
           given: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``(argument name, meaning)`` for each argument of ``fn`` that takes one of the ``given``
    meanings: read once per function (a signature costs ~10 us, and ``pre`` runs every step)."""
    known, unknown = [], []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or name == "self":
            continue  # (self: a method, read from its class)
        if _ALIASES.get(name) in given:
            known.append((name, _ALIASES[name]))
        elif param.default is param.empty:
            unknown.append(name)
    missing = [m for m in needs if m not in {meaning for _, meaning in known}]
    if unknown or missing:
        raise ImportError(f"transformers {_version()}: {fn.__module__}.{fn.__name__}"
                          f"{inspect.signature(fn)} has required arguments fz3 does not know "
                          f"({unknown}) or takes no {missing}; fz3's Hugging Face adapters follow "
                          f"transformers{RANGE} as tested in CI. Install a supported release or "
                          f"pass layers=, pre= and post= to fz3.shard")
    return tuple(known)


def block_output(out: Any) -> torch.Tensor:
    """A block's hidden states: GPT-2's block returns ``(hidden, ...)`` up to 5.2, then a tensor."""
    return out[0] if isinstance(out, tuple) else out


def _version() -> str:
    import transformers

    return transformers.__version__
