"""Measure memory, not arithmetic: the peak bytes of tensor storages allocated while a
``LiveBytes`` mode is active and still alive (a TorchDispatchMode sees every allocation:
factories, copies, op outputs; a storage counts until its last reference is gone)."""

from __future__ import annotations

import optree
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...``; then ``m.peak``: the most bytes of storages created
    inside that were alive at once. Outputs that alias an input (views, in-place ops,
    collectives writing into ``out``) are not new; storages made before entry never count."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in optree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage._cdata not in inputs and storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
