"""Hugging Face models: built-in adapters (``adapters.py``), PEFT wrappers (``peft_models.py``)."""

from .peft_models import init_lora

__all__ = ["init_lora"]
