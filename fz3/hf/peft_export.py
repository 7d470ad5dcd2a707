"""The trained part of a PEFT model alone, in PEFT's own layout: ``adapter_model.safetensors`` +
``adapter_config.json``, loadable by ``PeftModel.from_pretrained(base_model, path)``.

``fz3.hf.export_peft(path, model, params)`` gathers the trained parameters (the LoRA weights:
small) to rank 0 one unit at a time, as ``fz3.full_state_dict(model, params)``
does, and rank 0 hands them to PEFT's own ``save_pretrained(path, state_dict=...)`` on fz3's
skeleton of the PEFT model, which picks the adapter's tensors and names them as PEFT loads
them. The frozen base weights are not written: they are the pretrained checkpoint's. For
every weight in one Hugging Face folder, use ``fz3.export``.
"""

from __future__ import annotations

import os

from ..sharding.model import Params, ShardedModel
from ..storage.state_dict import full_state_dict
from .peft_models import inner_model


def export_peft(path: str | os.PathLike, model: ShardedModel, params: Params) -> list[str]:
    """Write the PEFT adapter of ``model`` (trained parameters ``params``) under ``path``.
    **Collective**: one all-gather per part (every rank must call it); rank 0 writes. Returns
    the files written (empty on other ranks)."""
    if inner_model(model.skeleton) is None:
        raise TypeError(f"fz3.hf.export_peft takes a model sharded from a PEFT model "
                        f"(get_peft_model(...)); this one is a {type(model.skeleton).__name__}: "
                        f"use fz3.export(path, model, params) for its weights")
    trained = full_state_dict(model, params)
    if trained is None:  # not rank 0
        return []
    model.skeleton.save_pretrained(os.fspath(path), state_dict=trained)
    return sorted(os.listdir(path))
