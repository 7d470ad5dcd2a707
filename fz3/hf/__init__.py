"""Hugging Face models: built-in adapters (``adapters.py``), PEFT wrappers (``peft_models.py``)
and their adapters' export (``peft_export.py``)."""

from .peft_export import export_peft
from .peft_models import init_lora

__all__ = ["export_peft", "init_lora"]
