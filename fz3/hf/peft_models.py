"""PEFT wrappers (``peft.PeftModel`` and its task classes) around a model with a built-in adapter.

``get_peft_model(hf_model, LoraConfig(...))`` wraps the model (``PeftModelForCausalLM`` ->
``LoraModel`` -> ``LlamaForCausalLM``: parameter names gain ``base_model.model.``) and
injects ``lora_A``/``lora_B`` into the target modules, which stay where they were (inside
the blocks, or in the embeddings and head). fz3 runs the wrapped model with the inner
model's adapter: the stack's path gains the wrapper's prefix, and ``pre``/``post`` reach the
inner model through the wrapper (their ``m`` is the wrapper's skeleton). PEFT's own
``forward`` is not called; the LoRA layers' forwards are, inside the blocks.

Nothing here imports ``peft``: a module is a PEFT wrapper only if ``peft`` is imported
already (it made the module) and the module is a ``peft.PeftModel``.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, Callable

import torch
from torch import nn


def inner_model(module: nn.Module) -> tuple[nn.Module, str] | None:
    """``(the wrapped model, its path inside module)`` if ``module`` is a PEFT wrapper, else None."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(module, peft.PeftModel):
        return None
    inner = module.get_base_model()
    path = next(name for name, sub in module.named_modules() if sub is inner)
    return inner, path


def _through_pre(path: str, pre: Callable[..., Any], m: nn.Module, batch: Any) -> Any:
    return pre(m.get_submodule(path), batch)


def _through_post(path: str, post: Callable[..., torch.Tensor], m: nn.Module, h: torch.Tensor,
                  batch: Any) -> torch.Tensor:
    return post(m.get_submodule(path), h, batch)


def through(path: str, layers: str, pre: Callable[..., Any],
            post: Callable[..., torch.Tensor]) -> tuple[str, Callable[..., Any], Callable[..., Any]]:
    """An inner model's ``(layers, pre, post)`` for the wrapper whose submodule ``path`` it is."""
    return f"{path}.{layers}", partial(_through_pre, path, pre), partial(_through_post, path, post)


def no_adapter_message(module: nn.Module, inner: nn.Module, path: str, built_in: list[str]) -> str:
    """What to pass for a PEFT model whose inner model has no built-in adapter."""
    return (f"fz3.shard got a PEFT model ({type(module).__name__}) around {type(inner).__name__}, "
            f"which has no built-in adapter (built in: {', '.join(built_in)}); pass "
            f"layers='{path}.<dotted path of the nn.ModuleList inside {type(inner).__name__}>', "
            f"pre=(m, batch) -> h and post=(m, h, batch) -> loss, where m is the PEFT model: "
            f"reach {type(inner).__name__} as m.get_base_model()")


def checkpoint_name(path: str, name: str) -> str:
    """The name a parameter of a PEFT-wrapped model has in the inner model's own checkpoint:
    without the wrapper's prefix and without the ``.base_layer`` PEFT puts around a target
    module's original weights (``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``
    -> ``model.layers.0.self_attn.q_proj.weight``)."""
    if name.startswith(path + "."):
        name = name[len(path) + 1:]
    return name.replace(".base_layer.", ".")
