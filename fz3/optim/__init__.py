"""Functional optimizers over fz3's sharded pytrees: ``init``/``update`` pure, state explicit."""

from ..sharding.matrices import Rest, rest_of
from .adamw import AdamWState, adamw
from .base import GradientTransformation, UnitStep, apply_updates, chain, step
from .clip import ClipState, clip_by_global_norm, global_norm
from .freeze import FreezeState, freeze
from .loss_scale import LossScale, unscale
from .muon import MuonState, muon
from .per_unit import per_unit

__all__ = ["AdamWState", "ClipState", "FreezeState", "GradientTransformation", "LossScale",
           "MuonState", "Rest", "UnitStep", "adamw", "apply_updates", "chain",
           "clip_by_global_norm", "freeze", "global_norm", "muon", "per_unit", "rest_of", "step",
           "unscale"]
