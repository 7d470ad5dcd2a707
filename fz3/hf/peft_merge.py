"""A PEFT model's weights as the base model's own, LoRA merged in: what ``fz3.export`` writes for
a model sharded from ``get_peft_model(...)``, so ``AutoModelForCausalLM.from_pretrained`` of the
folder loads the trained model with no missing or unexpected keys.

Each LoRA target's weight becomes ``W + scaling * B @ A`` (transposed for ``fan_in_fan_out``
layers, GPT-2's ``Conv1D``; ``W + scaling * (B @ A)^T`` for an embedding's
``lora_embedding_A``/``_B``), summed in fp32 and cast once to ``W``'s dtype (PEFT's own merge
adds the delta in ``W``'s dtype: the same to fp32 rounding, closer in bf16). Names lose the
wrapper's prefix and ``.base_layer`` (``checkpoint_name``); the LoRA tensors are dropped.

What fz3 cannot merge exactly is refused by name before any collective, on every rank: DoRA
(its magnitude vector rescales each column by a norm), several adapters (which one is the
model?), ``modules_to_save`` (trained copies beside the originals), LoRA biases, non-LoRA
tuners and LoRA on layers other than ``Linear``, ``Conv1D`` and ``Embedding``. The adapter
alone stays available through ``fz3.hf.export_peft``.
"""

from __future__ import annotations

import torch
from torch import nn

from .peft_models import checkpoint_name, inner_model


class LoraMerge:
    """``fz3.export``'s rewrite for a PEFT model: ``take`` each unit's ``{name: full tensor}``
    and hand back what to write under the base model's names, holding a target's LoRA
    tensors (small) until its base weight comes (trained rows come before frozen ones)."""

    def __init__(self, skeleton: nn.Module):
        found = inner_model(skeleton)
        assert found is not None
        self.path = found[1]
        # the adapter's name; module name -> (scaling, fan_in_fan_out, kind)
        self.adapter, self.targets = _targets(skeleton)
        self.held: dict[str, torch.Tensor] = {}  # LoRA tensors and base weights awaiting a pair

    def name(self, name: str) -> str | None:
        """The base model's name for a skeleton name; None for a LoRA tensor (merged)."""
        return None if _lora_of(name) is not None else checkpoint_name(self.path, name)

    def take(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            target = _lora_of(name) or _base_of(name, self.targets)
            if target is None:
                out[checkpoint_name(self.path, name)] = t
                continue
            self.held[name] = t
            merged = self._merge(target)
            if merged is not None:
                out[checkpoint_name(self.path, merged[0])] = merged[1]
        return out

    def finish(self) -> None:
        if self.held:  # a LoRA tensor without its base weight, or the other way round
            raise RuntimeError(f"fz3.export: {sorted(self.held)[:4]} found no partner to merge "
                               f"with: a bug, please report it")

    def _merge(self, target: str) -> tuple[str, torch.Tensor] | None:
        scaling, fan_in_fan_out, kind = self.targets[target]
        if kind == "embedding":
            keys = (f"{target}.base_layer.weight", f"{target}.lora_embedding_A.{self.adapter}",
                    f"{target}.lora_embedding_B.{self.adapter}")
        else:
            keys = (f"{target}.base_layer.weight", f"{target}.lora_A.{self.adapter}.weight",
                    f"{target}.lora_B.{self.adapter}.weight")
        if not all(k in self.held for k in keys):
            return None
        w, a, b = (self.held.pop(k) for k in keys)
        delta = b.float() @ a.float()  # (out, in) for Linear; (dim, num) for an embedding
        if kind == "embedding" or fan_in_fan_out:
            delta = delta.T
        return keys[0], (w.float() + delta * scaling).to(w.dtype)


def _lora_of(name: str) -> str | None:
    for marker in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B."):
        if marker in name:
            return name.split(marker)[0]
    return None


def _base_of(name: str, targets: dict) -> str | None:
    head, sep, _ = name.rpartition(".base_layer.")
    return head if sep and head in targets else None


def merge_for(skeleton: nn.Module) -> LoraMerge | None:
    """The rewrite ``fz3.export`` applies to a PEFT model's skeleton; None for another model.
    Raises ``ValueError`` naming what cannot be merged (see the module's docstring)."""
    return None if inner_model(skeleton) is None else LoraMerge(skeleton)


def _targets(skeleton: nn.Module) -> tuple[str, dict[str, tuple[float, bool, str]]]:
    from peft.tuners.lora import LoraLayer

    configs = dict(skeleton.peft_config)
    fix = ("export the adapter alone with fz3.hf.export_peft(path, model, params), or merge it "
           "with PEFT (merge_and_unload) on a full model")
    if len(configs) != 1:
        raise ValueError(f"fz3.export of a PEFT model with {len(configs)} adapters "
                         f"{sorted(configs)}: fz3 merges one; {fix}")
    (adapter, config), = configs.items()
    kind = getattr(config.peft_type, "value", config.peft_type)
    if kind != "LORA":
        raise ValueError(f"fz3.export of a PEFT {kind} model: fz3 merges LoRA only; {fix}")
    if getattr(config, "modules_to_save", None):
        raise ValueError(f"fz3.export of a PEFT model with modules_to_save="
                         f"{list(config.modules_to_save)}: fz3 does not merge trained module "
                         f"copies; {fix}")
    targets = {}
    for name, layer in skeleton.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if layer.use_dora.get(adapter, False):
            raise ValueError(f"fz3.export: {name} uses DoRA (use_dora=True), which fz3 does not "
                             f"merge; {fix}")
        if getattr(layer, "lora_bias", {}).get(adapter, False):
            raise ValueError(f"fz3.export: {name} has a LoRA bias (lora_bias=True), which fz3 "
                             f"does not merge; {fix}")
        base = layer.get_base_layer()
        if adapter in layer.lora_embedding_A:
            targets[name] = (float(layer.scaling[adapter]), False, "embedding")
        elif isinstance(base, nn.Linear) or type(base).__name__ == "Conv1D":
            targets[name] = (float(layer.scaling[adapter]), bool(layer.fan_in_fan_out), "linear")
        else:
            raise ValueError(f"fz3.export: {name} puts LoRA on a {type(base).__name__}, which "
                             f"fz3 does not merge (Linear, Conv1D and Embedding only); {fix}")
    return adapter, targets
