"""Functional optimizers over fz3's sharded pytrees: ``init``/``update`` pure, state explicit."""

from .adamw import AdamWState, adamw
from .base import GradientTransformation, apply_updates, chain, step

__all__ = ["AdamWState", "GradientTransformation", "adamw", "apply_updates", "chain", "step"]
