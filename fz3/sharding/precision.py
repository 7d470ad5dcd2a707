"""Mixed precision: which dtype parameters are gathered and computed in, and gradients reduced
in."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Precision(NamedTuple):
    """fp32 master shards of trained parameters always; ``param_dtype`` is cast to *before* the
    all-gather (half the bytes in bf16) and used for compute; gradients are reduced in
    ``reduce_dtype`` and land in fp32 gradient shards. Frozen parameters need no master copy:
    their shards are stored (and gathered) in ``frozen_dtype``, the compute dtype unless given.
    ``None`` means fp32 (the compute dtype for ``frozen_dtype``)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    frozen_dtype: torch.dtype | None = None

    @property
    def frozen(self) -> torch.dtype:
        return self.frozen_dtype or self.compute

    @property
    def compute(self) -> torch.dtype:
        return self.param_dtype or torch.float32

    @property
    def reduce(self) -> torch.dtype:
        return self.reduce_dtype or self.compute
