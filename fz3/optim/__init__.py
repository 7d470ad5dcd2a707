"""Functional optimizers over fz3's sharded pytrees: ``init``/``update`` pure, state explicit."""

from .adamw import AdamWState, adamw
from .base import GradientTransformation, apply_updates, chain, step
from .clip import ClipState, clip_by_global_norm, global_norm
from .freeze import FreezeState, freeze
from .loss_scale import LossScale, unscale

__all__ = ["AdamWState", "ClipState", "FreezeState", "GradientTransformation", "LossScale",
           "adamw", "apply_updates", "chain", "clip_by_global_norm", "freeze", "global_norm",
           "step", "unscale"]
