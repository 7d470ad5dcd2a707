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
    """``(the wrapped model, its path in module)`` if ``module`` is a PEFT wrapper, else None."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(module, peft.PeftModel):
        return None
    inner = module.get_base_model()
    path = next(name for name, sub in module.named_modules() if sub is inner)
    return inner, path


def _through_pre(path: str, pre: Callable[..., Any], m: nn.Module, batch: Any) -> Any:
    return pre(m.get_submodule(path), batch)


def _through_post(
    path: str, post: Callable[..., torch.Tensor], m: nn.Module, h: torch.Tensor, batch: Any,
    *aux: Any
) -> torch.Tensor:
    return post(m.get_submodule(path), h, batch, *aux)


def through(
    path: str, layers: str, pre: Callable[..., Any], post: Callable[..., torch.Tensor]
) -> tuple[str, Callable[..., Any], Callable[..., Any]]:
    """An inner model's ``(layers, pre, post)`` for the wrapper whose submodule ``path`` it is."""
    return f"{path}.{layers}", partial(_through_pre, path, pre), through_head(path, post)


def through_head(path: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """An inner model's ``fn(m, h, batch)`` (post, or an output such as its logits;
    ``fn(m, h, batch, aux)`` with layer aux outputs) for the wrapper whose submodule ``path``
    it is."""
    return partial(_through_post, path, fn)


def no_adapter_message(module: nn.Module, inner: nn.Module, path: str, built_in: list[str]) -> str:
    """What to pass for a PEFT model whose inner model has no built-in adapter."""
    return (
        f"fz3.shard got a PEFT model ({type(module).__name__}) around {type(inner).__name__}, "
        f"which has no built-in adapter (built in: {', '.join(built_in)}); pass "
        f"layers='{path}.<dotted path of the nn.ModuleList inside {type(inner).__name__}>', "
        f"pre=(m, batch) -> h and post=(m, h, batch) -> loss, where m is the PEFT model: "
        f"reach {type(inner).__name__} as m.get_base_model()"
    )


def checkpoint_name(path: str, name: str) -> str:
    """The name a parameter of a PEFT-wrapped model has in the inner model's own checkpoint:
    without the wrapper's prefix and without the ``.base_layer`` PEFT puts around a target
    module's original weights
    (``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``
    -> ``model.layers.0.self_attn.q_proj.weight``)."""
    if name.startswith(path + "."):
        name = name[len(path) + 1 :]
    return name.replace(".base_layer.", ".")


def init_lora(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give the LoRA weights of a PEFT model built on the meta device real values on
    ``device``, by PEFT's own init (``reset_lora_parameters``: ``lora_A`` as ``nn.Linear``,
    ``lora_B`` zero; with ``init_lora_weights=False``, both as ``nn.Linear``), and leave the
    base weights on the meta device for ``fz3.shard(module, weights=folder)`` to read. Changes
    ``module`` in place (the model being built) and returns it. Local: no collective; seed
    every rank alike for the same LoRA weights everywhere (each rank keeps its own slice)."""
    wrapped = inner_model(module)
    if wrapped is None:
        raise TypeError(
            f"fz3.hf.init_lora takes a PEFT model (get_peft_model(model, LoraConfig(...))), "
            f"got {type(module).__name__}"
        )
    from peft.tuners.lora import LoraLayer

    for name, layer in module.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in list(layer.lora_A) + list(layer.lora_embedding_A):
            init = module.peft_config[adapter].init_lora_weights
            if init not in (True, False, "gaussian") or layer.use_dora.get(adapter, False):
                raise ValueError(
                    f"{name}: init_lora_weights={init!r} (use_dora="
                    f"{layer.use_dora.get(adapter, False)}) needs the base weights; "
                    f"fz3.hf.init_lora makes only True, False and 'gaussian' on the meta "
                    f"device: build this PEFT model on a real base model"
                )
            for container in (layer.lora_A, layer.lora_B):
                if adapter in container:
                    container[adapter].to_empty(device=device)
                    if init is False:
                        container[adapter].reset_parameters()
            for container in (layer.lora_embedding_A, layer.lora_embedding_B):
                if adapter in container:
                    p = container[adapter]
                    container[adapter] = nn.Parameter(
                        torch.empty_like(p, device=device), requires_grad=p.requires_grad
                    )
                    if init is False:
                        nn.init.normal_(container[adapter])
            if init is not False:
                layer.reset_lora_parameters(adapter, init)
    return module
