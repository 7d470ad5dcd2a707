"""Hugging Face models: built-in adapters (``adapters.py`` looks them up by ``config.model_type``;
``decoders.py``, ``causal.py``, ``encoders.py`` write the families out), PEFT wrappers
(``peft_models.py``) and their adapters' export (``peft_export.py``). For a model with no
built-in adapter, the mask builders the built-ins use, following the installed transformers
release's argument names (``compat.py``); ``losses``, a built-in adapter's loss with its terms
(an MoE router's load-balancing loss apart): ``causal_mask``, ``sliding_window_mask``,
``bidirectional_mask``, and ``block_output`` (a block's hidden states, tuple or not)."""

from .adapters import losses
from .compat import bidirectional_mask, block_output, causal_mask, sliding_window_mask
from .peft_export import export_peft
from .peft_models import init_lora

__all__ = ["bidirectional_mask", "block_output", "causal_mask", "export_peft", "init_lora",
           "losses", "sliding_window_mask"]
